"""Under a float16 compute dtype, scaled layers do their elementwise
epilogue (bias, norm affine, activation, residual sum) in float32 and round
once to the compute dtype."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from tests.conftest import host_scalars
from tests.conftest import spy_taken
from tests.conftest import to_np


def _layers():
    return [
        ksc.layers.ScaledDense(16, activation="gelu", dtype="scaled_fp16"),
        ksc.layers.ScaledLayerNormalization(dtype="scaled_fp16"),
        ksc.layers.ScaledRMSNormalization(dtype="scaled_fp16"),
    ]


@pytest.mark.parametrize("layer", _layers(), ids=lambda l: type(l).__name__)
def test_output_is_the_float32_result_rounded_once(layer, rng):
    x = rng.standard_normal((4, 8, 16)).astype("float16")
    layer(ksc.as_scaled(x))
    # Biases/shifts that float16 cannot hold exactly (they stay float32).
    for sv in layer.scaled_weights:
        if sv.name in ("bias", "beta"):
            sv.assign(np.full(sv.shape, 1.0 / 3.0, np.float32))
    y = layer(ksc.as_scaled(x))
    assert y.dtype == "float16"
    f32 = type(layer).from_keras(layer.to_keras(), dtype="scaled_float32")
    want = to_np(f32(ksc.as_scaled(x.astype("float32"))))
    # One rounding of the float32 result (up to the GEMM's own float16
    # rounding for Dense): within float16's half-ulp plus a little.
    np.testing.assert_allclose(to_np(y), want, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(keras.config.backend() != "jax", reason="inspects a jaxpr (jax only)")
@pytest.mark.parametrize("layer", _layers(), ids=lambda l: type(l).__name__)
def test_parameter_gradients_are_summed_in_float32(layer, rng):
    import jax

    x = rng.standard_normal((4, 8, 16)).astype("float16")
    layer(ksc.as_scaled(x))
    tv = [v.value for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    def loss(tv):
        y, _ = layer.stateless_call(tv, ntv, ksc.as_scaled(x))
        return ops.sum(ksc.to_array(y))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(tv)
    f16_sums = [
        e for e in jaxpr.jaxpr.eqns
        if e.primitive.name == "reduce_sum" and e.invars[0].aval.dtype == np.float16
    ]
    assert not f16_sums, f16_sums


def _eqns(jaxpr):
    """Every equation of `jaxpr`, nested ones (custom gradients, pjit) too."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _f16_roundings(fn, *args):
    """`convert_element_type` equations to float16 in fn's jaxpr."""
    import jax

    jaxpr = jax.make_jaxpr(fn)(*args)
    return [
        e for e in _eqns(jaxpr.jaxpr)
        if e.primitive.name == "convert_element_type" and e.params["new_dtype"] == np.float16
    ]


@pytest.mark.skipif(keras.config.backend() != "jax", reason="inspects a jaxpr (jax only)")
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_fp8_dense_rounds_its_output_once(activation, rng):
    # The FP8 GEMM hands its float32 accumulator to the epilogue: the only
    # float16 rounding of the forward pass is the output's.
    layer = ksc.layers.ScaledDense(16, activation=activation, dtype="scaled_fp8")
    x = rng.standard_normal((4, 8, 32)).astype("float16")
    layer(ksc.as_scaled(x))
    tv = [v.value for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    def forward(tv):
        y, _ = layer.stateless_call(tv, ntv, ksc.as_scaled(x))
        return ksc.to_array(y)

    outputs = [e for e in _f16_roundings(forward, tv) if e.outvars[0].aval.shape == (4, 8, 16)]
    assert len(outputs) == 1, outputs


def test_fp8_dense_matches_its_float32_epilogue(rng):
    # Output = round_f16(gelu(GEMM_f32 + bias)) with the GEMM on E4M3 values.
    layer = ksc.layers.ScaledDense(16, activation="gelu", dtype="scaled_fp8")
    x = rng.standard_normal((4, 32)).astype("float16")
    layer(ksc.as_scaled(x))
    layer.scaled_weights[1].assign(np.full((16,), 1.0 / 3.0, np.float32))
    y = to_np(layer(ksc.as_scaled(x)))
    xs = ksc.as_scaled(x)
    gemm = ksc.ops.fp8_matmul(xs, layer.scaled_weights[0].read(), out_dtype="float32")
    assert gemm.dtype == "float32"
    bias = ksc.ops.cast(layer.scaled_weights[1].read(), "float32")
    want = to_np(layer._act(ksc.ops.add(gemm, bias)))
    np.testing.assert_allclose(y, want.astype(np.float16).astype(np.float64), rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(keras.config.backend() != "jax", reason="inspects a jaxpr (jax only)")
def test_embedding_gradient_is_summed_in_float32(rng):
    import jax

    policy = ksc.ScaledDTypePolicy(
        "scaled_fp16_master", compute_dtype="float16", matmul_dtype="float16",
        grad_dtype="float16", master_dtype="float16",
    )
    layer = ksc.layers.ScaledEmbedding(32, 8, dtype=policy)
    ids = rng.integers(0, 32, (4, 64)).astype("int32")
    layer(ids)
    assert layer.scaled_weights[0].data.dtype == "float16"
    tv = [v.value for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    def loss(tv):
        y, _ = layer.stateless_call(tv, ntv, ids)
        return ops.sum(ops.cast(ksc.to_array(y), "float32"))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(tv)
    scatters = [e for e in _eqns(jaxpr.jaxpr) if "scatter" in e.primitive.name]
    assert scatters and all(e.outvars[0].aval.dtype == np.float32 for e in scatters), scatters


@pytest.mark.skipif(keras.config.backend() != "jax", reason="inspects a jaxpr (jax only)")
def test_attention_scores_stay_float32_until_the_probabilities(rng):
    # Scores leave their GEMM in float32 and are scaled by 1/sqrt(d) there;
    # the only float16 rounding of a scores-shaped tensor is the softmax
    # output (the GEMM's own float16 output was another).
    layer = ksc.layers.ScaledMultiHeadAttention(2, 8, dtype="scaled_fp16")
    x = rng.standard_normal((2, 6, 16)).astype("float16")
    layer(ksc.as_scaled(x), ksc.as_scaled(x), use_causal_mask=True)
    tv = [v.value for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    def forward(tv):
        y, _ = layer.stateless_call(tv, ntv, ksc.as_scaled(x), ksc.as_scaled(x), use_causal_mask=True)
        return ksc.to_array(y)

    roundings = _f16_roundings(forward, tv)
    scores = [e for e in roundings if e.outvars[0].aval.shape == (2, 2, 6, 6)]
    assert len(scores) == 1, scores


def _fused_bias_layers():
    return {
        "dense_2d": (lambda: ksc.layers.ScaledDense(24, activation="relu"), (6, 16)),
        "dense_3d": (lambda: ksc.layers.ScaledDense(24), (3, 5, 16)),
        "einsum_trailing_bias": (
            lambda: ksc.layers.ScaledEinsumDense("abc,cde->abde", output_shape=(None, 4, 8), bias_axes="de"),
            (3, 5, 16),
        ),
        "einsum_middle_bias": (
            lambda: ksc.layers.ScaledEinsumDense("abc,cd->abd", output_shape=(5, 12), bias_axes="b"),
            (3, 5, 16),
        ),
    }


@pytest.mark.parametrize("name", sorted(_fused_bias_layers()))
def test_float32_bias_add_in_the_gemm_node_matches_the_two_rules(name, rng, monkeypatch):
    """Under scaled_float32 the bias add of Dense / EinsumDense runs in the
    GEMMs' custom gradient (`contraction_plus`; the layers take it on eager
    torch, the test forces it on every backend): output, scales and the
    gradients of the input, kernel and bias equal those of the contraction
    followed by the `add` rule, with a bias and grad scales far from 1."""
    from keras_scalify.layers import dense as dense_module

    monkeypatch.setattr(dense_module, "_bias_in_gemm", lambda x, w: True)

    make, shape = _fused_bias_layers()[name]
    layer = make()
    x = ksc.as_scaled(rng.standard_normal(shape).astype("float32"), np.float32(2.0**-3), np.float32(2.0**4))
    layer(x)
    for sv in layer.scaled_weights:
        if sv.name == "bias":
            sv.assign(rng.standard_normal(sv.shape).astype("float32") * 40.0)
        sv.grad_scale.assign(np.float32(2.0**-6))

    def run(x_data, weights):
        y, _ = layer.stateless_call(weights, [v.value for v in layer.non_trainable_variables],
                                    ksc.as_scaled(x_data, np.float32(2.0**-3), np.float32(2.0**4)))
        return y

    data = ops.convert_to_tensor(x.data)
    weights = [v.value for v in layer.trainable_variables]
    up = ops.convert_to_tensor(rng.standard_normal(layer(x).data.shape).astype("float32"))
    loss = lambda d, *w: ops.sum(run(d, list(w)).data * up)
    original, taken = dense_module.contraction_plus, []

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(dense_module, "contraction_plus", spy)
    fused = run(data, weights)
    _, fused_grads = ksc.backend.value_and_grad(loss)(data, *weights)
    assert taken and all(taken), "the fused node was not taken"
    monkeypatch.setattr(dense_module, "contraction_plus", lambda *a, **k: None)
    composed = run(data, weights)
    _, composed_grads = ksc.backend.value_and_grad(loss)(data, *weights)
    assert float(fused.scale) == float(composed.scale)
    assert float(fused.grad_scale) == float(composed.grad_scale)
    np.testing.assert_allclose(to_np(fused.data), to_np(composed.data), rtol=1e-6, atol=1e-6)
    assert len(fused_grads) == len(composed_grads) == 1 + len(weights)
    for got, want in zip(fused_grads, composed_grads):
        np.testing.assert_allclose(to_np(got), to_np(want), rtol=1e-5, atol=1e-6 * np.abs(to_np(want)).max())


def test_layers_take_the_bias_in_gemm_node_on_torch_and_tensorflow(rng, monkeypatch):
    """`_bias_in_gemm` holds for float32 tensors on eager torch and
    TensorFlow (the composition's passes cost there: Grappler fuses no
    elementwise chain on a CPU), not on JAX (XLA fuses the composition:
    the fused node measured slower)."""
    from keras_scalify.layers import dense as dense_module

    layer = ksc.layers.ScaledDense(8)
    x = ksc.as_scaled(rng.standard_normal((4, 16)).astype("float32"))
    layer(x)
    taken = []
    original = dense_module.contraction_plus
    monkeypatch.setattr(
        dense_module, "contraction_plus", lambda *a, **k: taken.append(1) or original(*a, **k)
    )
    layer(x)
    assert bool(taken) == (keras.config.backend() in ("torch", "tensorflow"))


def test_contraction_plan_follows_the_operands_shapes(rng):
    """`contraction_plus` memoizes its static analysis by the operands'
    shapes, dtypes and devices (eager torch): the same layers called on
    inputs of other shapes, and back, give Keras's outputs for each."""
    layers = [
        ksc.layers.ScaledEinsumDense("abc,cd->abd", output_shape=(None, 6), bias_axes="d"),
        ksc.layers.ScaledDense(6, activation="gelu"),
    ]
    for layer in layers:
        reference = None
        for shape in [(2, 3, 4), (5, 7, 4), (1, 1, 4), (2, 3, 4)]:
            x = rng.standard_normal(shape).astype("float32")
            y = layer(ksc.as_scaled(x))
            reference = reference or layer.to_keras()
            want = to_np(reference(x))
            assert tuple(y.data.shape) == want.shape
            np.testing.assert_allclose(to_np(y.data) * float(y.scale), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["gelu", "gelu_approximate", "silu"])
@pytest.mark.parametrize("x_scale", [2.0**-20, 1.0, 2.0**20], ids=["2^-20", "1", "2^20"])
def test_gated_activation_in_the_gemm_epilogue_is_bit_identical(activation, x_scale, rng, monkeypatch):
    """A float32 Dense / EinsumDense with a GELU or SiLU, with or without a
    bias: on eager torch
    the GEMM node computes the activation's input `u = y·s` itself where
    `fused.gate_epilogue` allows (the output scale `s` known on the host,
    at most 1: taken for the input scale 2^-20 here, not for 2^20), and
    the output, its scales and every gradient are those of the bias add
    followed by the activation's rule, bit for bit. Elsewhere it is never
    taken (TensorFlow's GEMM node takes the bias add, not the activation)."""
    from keras_scalify.ops import linalg

    taken = spy_taken(monkeypatch, linalg, "gate_epilogue")
    for make, shape in (
        (lambda: ksc.layers.ScaledDense(24, activation=activation), (3, 5, 16)),
        (lambda: ksc.layers.ScaledDense(24, activation=activation, use_bias=False), (3, 5, 16)),
        (lambda: ksc.layers.ScaledEinsumDense(
            "abc,cde->abde", output_shape=(None, 4, 8), bias_axes="de", activation=activation), (3, 5, 16)),
    ):
        layer = make()
        x = rng.standard_normal(shape).astype("float32")
        layer(ksc.as_scaled(x, np.float32(x_scale)))
        for sv in layer.scaled_weights:
            if sv.name == "bias":  # at the scale of the product
                sv.assign(rng.standard_normal(sv.shape).astype("float32") * np.float32(x_scale))
        up = ops.convert_to_tensor(rng.standard_normal(layer(ksc.as_scaled(x)).data.shape).astype("float32"))

        def run(d, w):
            y, _ = layer.stateless_call(list(w), [v.value for v in layer.non_trainable_variables],
                                        ksc.as_scaled(d, np.float32(x_scale)))
            return y

        def results():
            args = [ops.convert_to_tensor(x)] + [v.value for v in layer.trainable_variables]
            y = run(args[0], args[1:])
            _, grads = ksc.backend.value_and_grad(lambda d, *w: ops.sum(run(d, w).data * up))(*args)
            return y, grads

        taken.clear()
        fused, fused_grads = results()
        folded = host_scalars() and 2.0**-64 <= float(fused.scale) <= 1.0
        # (TensorFlow's node asks and is refused: no host scales. On JAX
        # the layers compose the ops: no epilogue is asked for.)
        in_node = keras.config.backend() in ("torch", "tensorflow")
        assert taken == [folded] * len(taken) and bool(taken) == in_node
        if x_scale != 1.0:
            assert folded == (host_scalars() and x_scale < 1.0)
        with monkeypatch.context() as m:
            m.setattr(linalg, "gate_epilogue", lambda s, kind: None)
            composed, composed_grads = results()
        assert float(fused.scale) == float(composed.scale)
        assert float(fused.grad_scale) == float(composed.grad_scale)
        np.testing.assert_array_equal(to_np(fused.data), to_np(composed.data))
        assert len(fused_grads) == len(composed_grads) == 1 + len(layer.trainable_variables)
        for got, want in zip(fused_grads, composed_grads):
            np.testing.assert_array_equal(to_np(got), to_np(want))


@pytest.mark.skipif(not host_scalars(), reason="eager torch on a CPU: the fused node (host-known scales)")
def test_gated_epilogue_node_runs_its_backward_twice(rng):
    """A retained graph may run the fused node's backward again (its saved
    `u` is not overwritten): the second pass gives the same gradients."""
    import torch

    layer = ksc.layers.ScaledDense(8, activation="gelu")
    x = torch.tensor(rng.standard_normal((4, 16)).astype("float32"), requires_grad=True)
    y = layer(ksc.as_scaled(x, np.float32(2.0**-4)))
    assert 2.0**-64 <= float(y.scale) <= 1.0  # (the fused path)
    loss = (y.data * y.scale).sum()
    (first,) = torch.autograd.grad(loss, [x], retain_graph=True)
    (second,) = torch.autograd.grad(loss, [x])
    np.testing.assert_array_equal(first.numpy(), second.numpy())
