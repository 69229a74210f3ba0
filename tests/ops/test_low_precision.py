"""FP16 without loss scaling and FP8 matmuls: gradients stay in range."""

import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify import backend as kb
from keras_scalify.core import pow2
from keras_scalify.ops.rescaling import next_grad_scale
from tests.conftest import to_np

DEPTH, WIDTH, BATCH = 16, 64, 32
LOSS_FACTOR = 2.0**-27  # true gradients ~1e-8


W_SCALE = np.float32(pow2.np_pow2_round_down(np.sqrt(1.0 / WIDTH)))
GAIN = 1.5  # tanh MLP: activations stay O(1) through 16 layers


def _mlp_weights(rng):
    """Weights exactly representable as float16 data × W_SCALE, so the
    float32 reference and the float16 run share the same weights. A smooth
    activation (tanh) keeps float16's own rounding of a 16-layer net at
    ~0.5% (relu's flipped units cost ~4% in plain float16 too)."""
    return [
        (rng.standard_normal((WIDTH, WIDTH)) * GAIN).astype("float16").astype("float32")
        * W_SCALE
        for _ in range(DEPTH)
    ]


def _reference_grads(x, weights, up):
    """float32 plain Keras gradients of the loss."""

    def loss(*ws):
        h = ops.convert_to_tensor(x)
        for w in ws:
            h = ops.tanh(ops.matmul(h, w))
        return ops.sum(h * up) * LOSS_FACTOR

    _, g = kb.value_and_grad(loss)(*[ops.convert_to_tensor(w.astype("float32")) for w in weights])
    return [to_np(t) for t in g]


def test_plain_float16_gradients_underflow(rng):
    x = rng.standard_normal((BATCH, WIDTH)).astype("float16")
    weights = _mlp_weights(rng)
    up = ops.convert_to_tensor(rng.standard_normal((BATCH, WIDTH)).astype("float16"))

    def loss(*ws):
        h = ops.convert_to_tensor(x)
        for w in ws:
            h = ops.tanh(ops.matmul(h, w))
        return ops.cast(ops.sum(h * up * np.float16(2.0**-12)), "float32") * 2.0**-15

    _, g = kb.value_and_grad(loss)(*[ops.convert_to_tensor(w.astype("float16")) for w in weights])
    assert all(np.all(to_np(t) == 0.0) for t in g)


def test_float16_trains_without_loss_scaling(rng):
    """Scaled float16 gradients of ~1e-8 match float32 to 1e-2 relative.

    Every weight's grad scale and one delayed rescale point at the input
    calibrate from the previous step's statistic (as ScaledOptimizer does
    for weights); from grad scale 1 that takes a few steps, during which
    gradients may underflow to zero: no loss scale, no NaN.
    """
    x = rng.standard_normal((BATCH, WIDTH)).astype("float16").astype("float32")
    weights = _mlp_weights(rng)
    up = rng.standard_normal((BATCH, WIDTH)).astype("float32")
    ref = _reference_grads(x, weights, ops.convert_to_tensor(up))
    w_scale = W_SCALE
    w_data = [ops.convert_to_tensor((w / w_scale).astype("float16")) for w in weights]
    up16 = ops.convert_to_tensor(up)

    def loss(state, gs_ws, *ws):
        h = ksc.as_scaled(ops.convert_to_tensor(x.astype("float16")))
        h = ksc.ops.dynamic_rescale_l2_grad(h, state)
        for w, gs in zip(ws, gs_ws):
            wt = ksc.ScaledTensor(w, w_scale, ops.stop_gradient(gs))
            h = ksc.ops.tanh(ksc.ops.matmul(h, wt))
        return ops.sum(ksc.to_array(h) * up16) * LOSS_FACTOR

    state = ops.zeros((), "float32")
    gs_ws = ops.ones((DEPTH,), "float32")
    vg = kb.value_and_grad(lambda st, gs, *ws: loss(st, [gs[i] for i in range(DEPTH)], *ws))
    for step in range(6):
        _, grads = vg(state, gs_ws, *w_data)
        new_state, cots = grads[0], grads[2:]
        decoded = [to_np(ops.cast(c, "float32")) * float(to_np(gs_ws[i])) for i, c in enumerate(cots)]
        gs_ws = ops.stack([next_grad_scale(c, gs_ws[i], "l2") for i, c in enumerate(cots)])
        state = new_state
    assert all(np.all(np.isfinite(d)) for d in decoded)
    for d, r in zip(decoded, ref):
        err = np.linalg.norm(d - r) / np.linalg.norm(r)
        assert err < 1e-2, err
    # The cotangents themselves sit near unit scale in float16.
    rms = [np.sqrt(np.mean(to_np(ops.cast(c, "float32")) ** 2)) for c in cots]
    assert all(0.25 <= r <= 4.0 for r in rms), rms


def _fp8_mlp(x, ws, fp8=True):
    h = x
    for i, w in enumerate(ws):
        if fp8:
            h = ksc.ops.cast_on_forward(h, "float8_e4m3fn")
            w = ksc.ops.cast_on_forward(w, "float8_e4m3fn")
        h = ksc.ops.matmul(h, w)
        if fp8:
            h = ksc.ops.cast_on_backward(h, "float8_e5m2")
        if i < len(ws) - 1:
            h = ksc.ops.gelu(h)
    return h


def _fp8_setup(rng, width=128, batch=64, depth=3):
    x = rng.standard_normal((batch, width)).astype("float32")
    ws = [rng.standard_normal((width, width)).astype("float32") for _ in range(depth)]
    up = rng.standard_normal((batch, width)).astype("float32")
    s_w = np.float32(pow2.np_pow2_round_down(1.0 / np.sqrt(width)))
    gs_w = np.float32(pow2.np_pow2_round_down(np.sqrt(batch)))
    return x, ws, up, s_w, gs_w


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_gradients_match_float32_within_quantization_error(compiled, rng):
    """Bound: E4M3 rounding has relative RMS error 2**-4/sqrt(3) ≈ 0.036,
    E5M2 2**-3/sqrt(3) ≈ 0.072; a weight gradient of a 3-layer MLP collects
    about six such roundings (operands and upstream, per layer) in
    quadrature, ≈ 0.15. We test relative Frobenius error < 0.2, and that
    it is not trivially 0 (the casts did act)."""
    x, ws, up, s_w, gs_w = _fp8_setup(rng)

    def loss(fp8):
        def f(*wds):
            wts = [ksc.ScaledTensor(w, s_w, gs_w) for w in wds]
            y = _fp8_mlp(ksc.as_scaled(ops.convert_to_tensor(x)), wts, fp8)
            return ops.sum(ksc.to_array(y) * ops.convert_to_tensor(up))

        vg = kb.value_and_grad(f)
        return kb.jit(vg) if compiled else vg

    args = [ops.convert_to_tensor(w) for w in ws]
    _, g8 = loss(True)(*args)
    _, g32 = loss(False)(*args)
    for a, b in zip(g8, g32):
        a, b = to_np(a), to_np(b)
        assert np.all(np.isfinite(a))
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert 1e-4 < err < 0.2, err


@pytest.mark.parametrize("magnitude", [1e4, 1e30])
def test_fp8_saturates_instead_of_nan(magnitude, rng):
    x, ws, up, s_w, gs_w = _fp8_setup(rng, width=32, batch=16, depth=2)
    x = x.copy()
    x[0, :4] = magnitude  # outliers far beyond E4M3's 448
    x[1, :4] = -magnitude

    def f(*wds):
        wts = [ksc.ScaledTensor(w, s_w, gs_w) for w in wds]
        y = _fp8_mlp(ksc.as_scaled(ops.convert_to_tensor(x)), wts, True)
        return ops.sum(ksc.to_array(y) * ops.convert_to_tensor(up))

    v, g = kb.value_and_grad(f)(*[ops.convert_to_tensor(w) for w in ws])
    assert np.isfinite(float(to_np(v)))
    assert all(np.all(np.isfinite(to_np(t))) for t in g)


def test_cast_on_forward_rounds_only_forward(rng):
    x = ops.convert_to_tensor(np.array([1.0, 17.0, 1000.0, -1e30], "float32"))
    y = ksc.ops.cast_on_forward(x, "float8_e4m3fn")
    np.testing.assert_array_equal(to_np(y), [1.0, 16.0, 448.0, -448.0])
    _, (g,) = kb.value_and_grad(lambda t: ops.sum(ksc.ops.cast_on_forward(t, "float8_e4m3fn") * 0.3))(x)
    np.testing.assert_allclose(to_np(g), np.full(4, 0.3), rtol=1e-7)


def test_cast_on_backward_rounds_only_backward():
    x = ops.convert_to_tensor(np.array([1.0, 17.0, 3.0], "float32"))
    y = ksc.ops.cast_on_backward(x, "float8_e5m2")
    np.testing.assert_array_equal(to_np(y), [1.0, 17.0, 3.0])
    up = ops.convert_to_tensor(np.array([17.0, 1e6, 0.3], "float32"))
    _, (g,) = kb.value_and_grad(lambda t: ops.sum(ksc.ops.cast_on_backward(t, "float8_e5m2") * up))(x)
    # 17 -> 16 in E5M2, 1e6 saturates at 57344, 0.3 -> 0.3125
    np.testing.assert_array_equal(to_np(g), [16.0, 57344.0, 0.3125])


def test_cast_on_forward_float16_is_a_real_cast(rng):
    x = ksc.as_scaled(rng.standard_normal((4, 4)).astype("float32"), 2.0)
    y = ksc.ops.cast_on_forward(x, "float16")
    assert y.dtype == "float16"
    assert float(to_np(y.scale)) == 2.0


def test_casts_to_the_dtype_already_held_are_the_identity():
    x = ksc.as_scaled(np.array([1.0, np.inf, -3.0], "float16"), 2.0)
    assert ksc.ops.cast_on_forward(x, "float16") is x
    assert ksc.ops.cast_on_backward(x, "float16") is x
    # An overflowed cotangent stays inf (a saturating cast would turn it
    # into 65504 and hide the overflow from the optimizer's skip check).
    t = ops.convert_to_tensor(np.array([1.0, 2.0], "float16"))
    up = ops.convert_to_tensor(np.array([np.inf, 1.0], "float16"))
    _, (g,) = kb.value_and_grad(lambda v: ops.sum(ksc.ops.cast_on_backward(v, "float16") * up))(t)
    assert np.isinf(to_np(g)[0])


def test_cast_rejects_unknown_format():
    with pytest.raises(ValueError, match="dtype"):
        ksc.ops.cast_on_forward(np.ones(2, "float32"), "float8_e4m3fnuz")


def test_einsum_out_dtype_keeps_the_float32_accumulator(rng):
    a = rng.standard_normal((8, 64)).astype("float16")
    b = rng.standard_normal((64, 8)).astype("float16")
    xa, xb = ksc.as_scaled(a), ksc.as_scaled(b)
    y16 = ksc.ops.einsum("ik,kj->ij", xa, xb)
    y32 = ksc.ops.einsum("ik,kj->ij", xa, xb, out_dtype="float32")
    assert y16.dtype == "float16" and y32.dtype == "float32"
    exact = a.astype(np.float64) @ b.astype(np.float64)
    err32 = np.max(np.abs(to_np(y32) - exact))
    np.testing.assert_allclose(to_np(y16), exact, rtol=2e-3, atol=2e-2)
    from keras_scalify.backend.gemm import has_float32_gemm

    if has_float32_gemm("float16", "float16"):  # else: a float16 GEMM, cast up
        assert err32 < 1e-4 < np.max(np.abs(to_np(y16) - exact)), err32
    with pytest.raises(ValueError, match="out_dtype"):
        ksc.ops.einsum("ik,kj->ij", xa, xb, out_dtype="float8_e4m3fn")


def test_fp8_matmul_out_dtype(rng):
    x = ksc.as_scaled(rng.standard_normal((4, 32)).astype("float16"))
    w = ksc.as_scaled(rng.standard_normal((32, 8)).astype("float16"))
    assert ksc.ops.fp8_matmul(x, w).dtype == "float16"
    y = ksc.ops.fp8_matmul(x, w, out_dtype="float32")
    assert y.dtype == "float32"
    np.testing.assert_allclose(
        to_np(ksc.ops.fp8_matmul(x, w)), to_np(y).astype(np.float16), rtol=1e-3, atol=1e-3
    )
    with pytest.raises(ValueError, match="out_dtype"):
        ksc.ops.fp8_matmul(x, w, out_dtype="float8_e5m2")


def test_grad_scale_from_statistic_in_python_is_the_tensor_ops_bit_for_bit():
    """Where the host has the statistic and the grad scale (eager torch on
    the CPU) the next grad scale is computed in Python; it equals the
    tensor ops' result (`memo_disabled` turns the host reads off) for
    zeros, subnormals, normal values, the float32 extremes, inf and NaN."""
    from keras_scalify.backend import scalar as S
    from keras_scalify.ops.rescaling import grad_scale_from_statistic

    stats = [0.0, 2.0**-149, 3 * 2.0**-140, 0.75 * 2.0**-126, 2.0**-126, 1e-30, 0.75, 1.0, 3.0, 2.0**100,
             3.4e38, np.inf, np.nan]
    g_outs = [0.0, 2.0**-140, 2.0**-126, 2.0**-100, 2.0**-12, 1.0, 2.0**20, 2.0**127, np.inf]
    f32 = lambda v: ops.convert_to_tensor(np.float32(v))  # noqa: E731
    for z in (True, False):
        for g in g_outs:
            for v in stats:
                got = ops.convert_to_numpy(grad_scale_from_statistic(f32(v), f32(g), z))
                with S.memo_disabled():
                    want = ops.convert_to_numpy(grad_scale_from_statistic(f32(v), f32(g), z))
                assert got.dtype == want.dtype == np.float32
                assert got.tobytes() == want.tobytes(), (v, g, z, got, want)
