"""Backward pass: gradients of every scaled op equal plain Keras gradients
(float32), stay near unit scale, and survive FP16/FP8 without loss scaling."""

import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify import backend as kb
from tests.conftest import assert_close
from tests.conftest import rms
from tests.conftest import to_np

SCALES = [(2.0**-10, 2.0**-5), (1.0, 1.0), (2.0**10, 2.0**3)]


def _scaled_input(x, s, gs):
    """`x` as a ScaledTensor of the same value, data `x/s`."""
    return ksc.as_scaled(x * np.float32(1.0 / s), np.float32(s), np.float32(gs))


def _pos(x):
    return np.abs(x) + 0.5


# (name, scaled fn, plain fn, number of inputs, input transform)
OPS = [
    ("add", ksc.ops.add, ops.add, 2, None),
    ("subtract", ksc.ops.subtract, ops.subtract, 2, None),
    ("multiply", ksc.ops.multiply, ops.multiply, 2, None),
    ("divide", ksc.ops.divide, ops.divide, 2, _pos),
    ("scalar_multiply", lambda a: a * 0.3, lambda a: a * 0.3, 1, None),
    ("scalar_divide", lambda a: a / 3.0, lambda a: a / 3.0, 1, None),
    ("negative", ksc.ops.negative, ops.negative, 1, None),
    ("abs", ksc.ops.abs, ops.abs, 1, None),
    ("square", ksc.ops.square, ops.square, 1, None),
    ("sqrt", ksc.ops.sqrt, ops.sqrt, 1, _pos),
    ("power3", lambda a: ksc.ops.power(a, 3), lambda a: ops.power(a, 3), 1, None),
    ("matmul", ksc.ops.matmul, ops.matmul, 2, None),
    ("dot", ksc.ops.dot, ops.dot, 2, None),
    (
        "einsum",
        lambda a, b: ksc.ops.einsum("ij,kj->ik", a, b),
        lambda a, b: ops.einsum("ij,kj->ik", a, b),
        2,
        None,
    ),
    (
        "einsum_multiplier",
        lambda a, b: ksc.ops.einsum("ij,kj->ik", a, b, multiplier=-0.3),
        lambda a, b: ops.einsum("ij,kj->ik", a, b) * -0.3,
        2,
        None,
    ),
    ("sum", lambda a: ksc.ops.sum(a, axis=1), lambda a: ops.sum(a, axis=1), 1, None),
    ("mean", lambda a: ksc.ops.mean(a, axis=0), lambda a: ops.mean(a, axis=0), 1, None),
    ("max", lambda a: ksc.ops.max(a, axis=1), lambda a: ops.max(a, axis=1), 1, None),
    ("min", lambda a: ksc.ops.min(a, axis=0), lambda a: ops.min(a, axis=0), 1, None),
    ("maximum", ksc.ops.maximum, ops.maximum, 2, None),
    ("minimum", ksc.ops.minimum, ops.minimum, 2, None),
    (
        "where",
        lambda a, b: ksc.ops.where(ops.greater(ksc.to_array(a), 0), a, b),
        lambda a, b: ops.where(ops.greater(a, 0), a, b),
        2,
        None,
    ),
    ("relu_as_max0", lambda a: ksc.ops.maximum(a, 0.0), lambda a: ops.maximum(a, 0.0), 1, None),
    ("clip", lambda a: ksc.ops.clip(a, -0.5, 0.5), lambda a: ops.clip(a, -0.5, 0.5), 1, None),
    (
        "concatenate",
        lambda a, b: ksc.ops.concatenate([a, b], axis=1),
        lambda a, b: ops.concatenate([a, b], axis=1),
        2,
        None,
    ),
    (
        "stack",
        lambda a, b: ksc.ops.stack([a, b], axis=0),
        lambda a, b: ops.stack([a, b], axis=0),
        2,
        None,
    ),
    ("reshape", lambda a: ksc.ops.reshape(a, (-1,)), lambda a: ops.reshape(a, (-1,)), 1, None),
    ("transpose", ksc.ops.transpose, ops.transpose, 1, None),
    (
        "expand_squeeze",
        lambda a: ksc.ops.squeeze(ksc.ops.expand_dims(a, 0), 0),
        lambda a: ops.squeeze(ops.expand_dims(a, 0), 0),
        1,
        None,
    ),
    (
        "slice",
        lambda a: ksc.ops.slice(a, (1, 2), (3, 4)),
        lambda a: ops.slice(a, (1, 2), (3, 4)),
        1,
        None,
    ),
    (
        "take",
        lambda a: ksc.ops.take(a, np.array([0, 2, 2, 5]), axis=0),
        lambda a: ops.take(a, np.array([0, 2, 2, 5]), axis=0),
        1,
        None,
    ),
    ("exp", ksc.ops.exp, ops.exp, 1, None),
    ("log", ksc.ops.log, ops.log, 1, _pos),
    ("tanh", ksc.ops.tanh, ops.tanh, 1, None),
    ("sigmoid", ksc.ops.sigmoid, ops.sigmoid, 1, None),
    ("erf", ksc.ops.erf, ops.erf, 1, None),
    ("relu", ksc.ops.relu, ops.relu, 1, None),
    ("gelu", ksc.ops.gelu, ops.gelu, 1, None),
    (
        "gelu_erf",
        lambda a: ksc.ops.gelu(a, approximate=False),
        lambda a: ops.gelu(a, approximate=False),
        1,
        None,
    ),
    ("silu", ksc.ops.silu, ops.silu, 1, None),
    ("softmax", ksc.ops.softmax, ops.softmax, 1, None),
    ("log_softmax", ksc.ops.log_softmax, ops.log_softmax, 1, None),
    ("logsumexp", lambda a: ksc.ops.logsumexp(a, axis=-1), lambda a: ops.logsumexp(a, axis=-1), 1, None),
    (
        "layer_normalization",
        lambda a: ksc.ops.layer_normalization(a, epsilon=1e-5),
        lambda a: ops.layer_normalization(a, epsilon=1e-5),
        1,
        None,
    ),
    (
        "rms_normalization",
        lambda a: ksc.ops.rms_normalization(a, epsilon=1e-5),
        lambda a: ops.rms_normalization(a, epsilon=1e-5),
        1,
        None,
    ),
    (
        "dynamic_rescale_l2",
        ksc.ops.dynamic_rescale_l2,
        lambda a: a,
        1,
        None,
    ),
    (
        "with_grad_scale",
        lambda a: ksc.ops.with_grad_scale(a, 2.0**-30),
        lambda a: a,
        1,
        None,
    ),
    (
        "cast_on_backward_f32",
        lambda a: ksc.ops.cast_on_backward(a, "float32"),
        lambda a: a,
        1,
        None,
    ),
]

SHAPES = {1: [(6, 8)], 2: [(6, 8), (6, 8)]}
MATMUL_SHAPES = {"matmul": [(6, 8), (8, 4)], "dot": [(6, 8), (8, 4)], "einsum": [(6, 8), (4, 8)]}


def _inputs(name, n, transform, rng):
    shapes = MATMUL_SHAPES.get(name, SHAPES[n])
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    if transform is not None:
        xs = [transform(x).astype("float32") for x in xs]
    return xs


def _grads(fn, xs, upstream, compiled):
    def loss(*args):
        y = fn(*args)
        y = ksc.to_array(y) if ksc.is_scaled(y) else y
        return ops.sum(y * ops.convert_to_tensor(upstream))

    vg = kb.value_and_grad(loss)
    if compiled:
        vg = kb.jit(vg)
    return vg(*[ops.convert_to_tensor(x) for x in xs])


@pytest.mark.parametrize("scales", SCALES, ids=["tiny", "unit", "huge"])
@pytest.mark.parametrize("name,f_scaled,f_plain,n,transform", OPS, ids=[o[0] for o in OPS])
def test_gradient_invariance_float32(name, f_scaled, f_plain, n, transform, scales, rng):
    s, gs = scales
    xs = _inputs(name, n, transform, rng)
    out = to_np(f_plain(*[ops.convert_to_tensor(x) for x in xs]))
    upstream = rng.standard_normal(out.shape).astype("float32")

    def scaled(*args):
        return f_scaled(*[_scaled_input(a, s, gs) for a in args])

    _, g_ref = _grads(f_plain, xs, upstream, compiled=False)
    # Compiled once per op (at unit scales) to keep the suite fast.
    for compiled in (False, True) if s == 1.0 else (False,):
        _, g = _grads(scaled, xs, upstream, compiled)
        for a, b in zip(g, g_ref):
            assert_close(a, b, rtol=1e-5, atol_rel=1e-6)


def _residual_block(ops_mod, to_arr, x, w1, w2):
    """y = x + W2·gelu(W1·LN(x)), loss through Q/K/V-style fan-out of LN(x)."""
    h = ops_mod.layer_normalization(x, epsilon=1e-5)
    q = ops_mod.matmul(h, w1)
    k = ops_mod.matmul(h, w2)
    v = ops_mod.matmul(h, w1)
    att = ops_mod.softmax(ops_mod.matmul(q, ops_mod.transpose(k)) * 0.25)
    y = x + ops_mod.matmul(ops_mod.gelu(ops_mod.matmul(att, v)), ops_mod.transpose(w2))
    return to_arr(y)


class _Plain:
    def __getattr__(self, name):
        return getattr(ops, name)


@pytest.mark.parametrize("compiled", [False, True])
def test_composed_graph_with_fan_out_is_exact(compiled, rng):
    x = rng.standard_normal((8, 16)).astype("float32")
    w1 = (rng.standard_normal((16, 16)) / 4).astype("float32")
    w2 = (rng.standard_normal((16, 16)) / 4).astype("float32")
    up = ops.convert_to_tensor(rng.standard_normal((8, 16)).astype("float32"))

    def plain(x, w1, w2):
        return ops.sum(_residual_block(_Plain(), lambda t: t, x, w1, w2) * up)

    def scaled(x, w1, w2):
        xs = _scaled_input(x, 2.0**-6, 2.0**-3)
        w1s = _scaled_input(w1, 2.0**-2, 2.0**4)
        w2s = _scaled_input(w2, 2.0**-3, 2.0**2)
        return ops.sum(_residual_block(ksc.ops, ksc.to_array, xs, w1s, w2s) * up)

    args = [ops.convert_to_tensor(a) for a in (x, w1, w2)]
    v_ref, g_ref = kb.value_and_grad(plain)(*args)
    vg = kb.value_and_grad(scaled)
    v, g = (kb.jit(vg) if compiled else vg)(*args)
    assert_close(v, v_ref, rtol=1e-5)
    for a, b in zip(g, g_ref):
        assert_close(a, b, rtol=1e-5, atol_rel=1e-6)


def test_tied_embedding_gradient_is_exact(rng):
    """One weight used by a lookup and by the transposed output projection."""
    vocab, dim = 32, 16
    emb = rng.standard_normal((vocab, dim)).astype("float32")
    tokens = rng.integers(0, vocab, size=(10,))
    up = ops.convert_to_tensor(rng.standard_normal((10, vocab)).astype("float32"))

    def plain(e):
        h = ops.take(e, tokens, axis=0)
        h = ops.layer_normalization(h, epsilon=1e-5)
        return ops.sum(ops.matmul(h, ops.transpose(e)) * up)

    def scaled(e):
        es = _scaled_input(e, 2.0**-4, 2.0**5)
        h = ksc.ops.take(es, tokens, axis=0)
        h = ksc.ops.layer_normalization(h, epsilon=1e-5)
        return ops.sum(ksc.to_array(ksc.ops.matmul(h, ksc.ops.transpose(es))) * up)

    e = ops.convert_to_tensor(emb)
    _, (g_ref,) = kb.value_and_grad(plain)(e)
    _, (g,) = kb.value_and_grad(scaled)(e)
    assert_close(g, g_ref, rtol=1e-5, atol_rel=1e-6)


# --- unit scale at init ----------------------------------------------------


def _weight(rng, fan_in, fan_out, batch, dtype="float32"):
    """Unit-normal data, scale P(1/sqrt(fan_in)), grad scale P(sqrt(batch))."""
    data = rng.standard_normal((fan_in, fan_out)).astype(dtype)
    s = ksc.core.pow2.np_pow2_round_down(1.0 / np.sqrt(fan_in))
    gs = ksc.core.pow2.np_pow2_round_down(np.sqrt(batch))
    return ksc.ScaledTensor(ops.convert_to_tensor(data), np.float32(s), np.float32(gs))


def _unit_upstream_loss(fn, rng):
    """Loss whose upstream cotangent at fn's output data is unit normal."""

    def loss(*args):
        y = fn(*args)
        u = rng_up(y.shape)
        return ops.sum(ksc.to_array(y) * u * ops.stop_gradient(y.grad_scale)), y

    state = {}

    def rng_up(shape):
        if "u" not in state:
            state["u"] = ops.convert_to_tensor(
                rng.standard_normal(shape).astype("float32")
            )
        return state["u"]

    return loss


def _check_unit(fn, args, rng):
    loss = _unit_upstream_loss(fn, rng)
    y = loss(*args)[1]
    assert 0.25 <= rms(to_np(ops.cast(y.data, "float32"))) <= 4.0
    _, grads = ksc.debug.scaled_value_and_grad(lambda *a: loss(*a)[0])(*args)
    for g in grads:
        r = rms(to_np(ops.cast(g.data, "float32")))
        assert 0.25 <= r <= 4.0, r


def test_unit_scale_dense(rng):
    x = ksc.as_scaled(rng.standard_normal((64, 128)).astype("float32"))
    w = _weight(rng, 128, 256, 64)
    _check_unit(ksc.ops.matmul, [x, w], rng)


def test_unit_scale_mlp(rng):
    x = ksc.as_scaled(rng.standard_normal((64, 128)).astype("float32"))
    ws = [_weight(rng, 128, 256, 64), _weight(rng, 256, 256, 64), _weight(rng, 256, 128, 64)]

    def mlp(x, w1, w2, w3):
        h = ksc.ops.gelu(ksc.ops.matmul(x, w1))
        h = ksc.ops.gelu(ksc.ops.matmul(h, w2))
        return ksc.ops.matmul(h, w3)

    _check_unit(mlp, [x] + ws, rng)


def test_unit_scale_attention_block(rng):
    b, t, d, heads = 4, 16, 64, 4
    x = ksc.as_scaled(rng.standard_normal((b, t, d)).astype("float32"))
    ws = [_weight(rng, d, d, b * t) for _ in range(4)]
    # Unit scaling's init prediction for attention weights: near-uniform
    # attention averages over t positions, so the true gradients of all four
    # projections are ~1/sqrt(t) of a dense layer's (softmax backward for
    # Q/K, the average over queries for V, the averaged output for O).
    shrink = np.float32(1.0 / ksc.core.pow2.np_pow2_round_down(np.sqrt(t)))
    for i in range(4):
        ws[i] = ksc.ScaledTensor(ws[i].data, ws[i].scale, ws[i].grad_scale * shrink)

    def attention(x, wq, wk, wv, wo):
        h = ksc.ops.layer_normalization(x)

        def split(w):
            y = ksc.ops.matmul(h, w)
            return ksc.ops.transpose(ksc.ops.reshape(y, (b, t, heads, d // heads)), (0, 2, 1, 3))

        q, k, v = split(wq), split(wk), split(wv)
        scores = ksc.ops.einsum("bhqd,bhkd->bhqk", q, k) * (1.0 / np.sqrt(d // heads))
        att = ksc.ops.softmax(scores)
        o = ksc.ops.einsum("bhqk,bhkd->bhqd", att, v)
        o = ksc.ops.reshape(ksc.ops.transpose(o, (0, 2, 1, 3)), (b, t, d))
        return ksc.ops.add(x, ksc.ops.matmul(o, wo))

    _check_unit(attention, [x] + ws, rng)


def test_an_input_without_gradient_skips_its_gemm(monkeypatch, rng):
    # A model's input needs no cotangent: eager torch (`requires_grad`)
    # skips its GEMM, as Keras's Dense does; the weight's gradient is the
    # same as when the input is differentiated too.
    from keras_scalify.backend import scalar
    from keras_scalify.ops import _gemm

    gemms = []
    original = _gemm._apply

    def recording(gemm, *args):
        gemms.append(gemm)
        return original(gemm, *args)

    monkeypatch.setattr(_gemm, "_apply", recording)
    x = ops.convert_to_tensor(rng.standard_normal((8, 32)).astype("float32"))
    w = rng.standard_normal((32, 16)).astype("float32")

    def loss(xd, wd):
        return ops.sum(ksc.to_array(ksc.ops.matmul(ksc.as_scaled(xd), ksc.as_scaled(wd))) ** 2)

    _, (_, both) = kb.value_and_grad(loss)(x, ops.convert_to_tensor(w))
    assert len(gemms) == 3
    del gemms[:]
    _, (only,) = kb.value_and_grad(lambda wd: loss(x, wd))(ops.convert_to_tensor(w))
    np.testing.assert_array_equal(to_np(only), to_np(both))
    assert len(gemms) == (2 if scalar.TORCH else 3)
