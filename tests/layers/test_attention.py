"""ScaledEinsumDense and ScaledMultiHeadAttention against Keras (float32):
outputs, input and weight gradients, masks, scores, conversion, configs,
unit scale at init and bad input."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify import backend as kb
from keras_scalify.layers import ScaledEinsumDense
from keras_scalify.layers import ScaledMultiHeadAttention
from tests.conftest import assert_close
from tests.conftest import data_of
from tests.conftest import rms
from tests.conftest import spy_taken
from tests.conftest import to_np

RTOL = 1e-5
ATOL_REL = 1e-6


def _randn(rng, shape):
    return rng.standard_normal(shape).astype("float32")


def _key(var):
    """A variable's path without the outer layer's name."""
    return var.path.split("/", 1)[1]


def _trained(layer):
    """The variables trained by gradient (scales are written by the optimizer)."""
    return [v for v in layer.trainable_variables if not v.overwrite_with_gradient]


def _scaled_vars(layer):
    """id(data variable) -> ScaledVariable, over the layer and sublayers."""
    out = {}
    for sub in layer._flatten_layers(include_self=True, recursive=True):
        for sv in getattr(sub, "_scaled_weights", []):
            out[id(sv.data)] = sv
    return out


def _loss_and_grads(layer, args, kwargs, upstream, scaled):
    """`sum(layer(*args) * upstream)` and its gradients with respect to the
    positional inputs and to every weight's represented value (by name)."""
    tvars = list(layer.trainable_variables)
    ntvars = [ops.convert_to_tensor(v) for v in layer.non_trainable_variables]
    up = ops.convert_to_tensor(upstream)
    n = len(args)

    def fn(*flat):
        xs = [ksc.as_scaled(x) for x in flat[:n]] if scaled else list(flat[:n])
        out, _ = layer.stateless_call(list(flat[n:]), ntvars, *xs, **kwargs)
        if kwargs.get("return_attention_scores"):
            out = out[0]
        if scaled:
            out = ksc.to_array(out)
        return ops.sum(out * up)

    weights = [ops.convert_to_tensor(v) for v in tvars]
    vg = kb.value_and_grad(fn)
    value, grads = vg(*[ops.convert_to_tensor(a) for a in args], *weights)
    x_grads = [to_np(g) for g in grads[:n]]
    w_grads = {}
    svs = _scaled_vars(layer) if scaled else {}
    for v, g in zip(tvars, grads[n:]):
        if v.overwrite_with_gradient:  # scales: written by the optimizer
            continue
        g = to_np(g)
        if scaled:
            sv = svs[id(v)]
            assert float(to_np(sv.grad_scale)) == 0.0
            # Uncalibrated grad scale reads as 1/scale: the data's cotangent
            # is the true gradient times the scale.
            g = g / float(to_np(sv.scale))
        w_grads[_key(v)] = g
    return float(to_np(value)), x_grads, w_grads


def _check_against_keras(ref, layer, args, kwargs, rng, grads=True):
    """Same outputs (and attention scores when returned) and, with `grads`,
    the same input and weight gradients of the output."""
    expected = ref(*args, **kwargs)
    actual = layer(*[ksc.as_scaled(a) for a in args], **kwargs)
    if kwargs.get("return_attention_scores"):
        assert ksc.is_scaled(actual[1])
        assert_close(actual[1], expected[1], RTOL, ATOL_REL)
        actual, expected = actual[0], expected[0]
    assert ksc.is_scaled(actual)
    assert_close(actual, expected, RTOL, ATOL_REL)
    if not grads:
        return
    upstream = _randn(rng, tuple(expected.shape))
    v_ref, gx_ref, gw_ref = _loss_and_grads(ref, args, kwargs, upstream, False)
    v, gx, gw = _loss_and_grads(layer, args, kwargs, upstream, True)
    np.testing.assert_allclose(v, v_ref, rtol=1e-4, atol=1e-5 * abs(v_ref))
    for a, b in zip(gx, gx_ref):
        assert_close(a, b, RTOL, ATOL_REL)
    assert sorted(gw) == sorted(gw_ref)
    # Some weight gradients are zero in exact arithmetic (the key bias:
    # softmax ignores a constant shift of a row), so their round-off is
    # bounded relative to the largest weight gradient.
    floor = ATOL_REL * max(np.max(np.abs(g)) for g in gw_ref.values())
    for k in gw_ref:
        np.testing.assert_allclose(gw[k], gw_ref[k], rtol=RTOL, atol=floor, err_msg=k)


def _nonzero_bias(layer, rng):
    """Random weights everywhere (biases included), in Keras's order."""
    layer.set_weights([_randn(rng, w.shape) * 0.3 for w in layer.get_weights()])


# --- ScaledEinsumDense ---------------------------------------------------------

EINSUM_CASES = {
    "heads": ("abc,cde->abde", (None, 2, 8), "de", None, (2, 6, 16)),
    "ellipsis": ("...b,bc->...c", 8, "c", "relu", (2, 6, 16)),
    "dense": ("ab,bc->ac", 8, None, "gelu", (6, 16)),
    "right_ellipsis": ("ab...,bc->ac...", (8,), "c", None, (6, 16, 2)),
}


@pytest.mark.parametrize(
    "case,how",
    [(c, "from_keras") for c in sorted(EINSUM_CASES)] + [("heads", "set_weights")],
)
def test_einsum_dense_matches_keras(case, how, rng):
    equation, out_shape, bias_axes, act, x_shape = EINSUM_CASES[case]
    ref = keras.layers.EinsumDense(
        equation, output_shape=out_shape, bias_axes=bias_axes, activation=act
    )
    x = _randn(rng, x_shape)
    ref(x)
    _nonzero_bias(ref, rng)
    if how == "from_keras":
        layer = ScaledEinsumDense.from_keras(ref)
    else:
        layer = ScaledEinsumDense(
            equation, output_shape=out_shape, bias_axes=bias_axes, activation=act
        )
        layer(ksc.as_scaled(x))
        layer.set_weights(ref.get_weights())
    assert layer.built
    assert [tuple(w.shape) for w in layer.get_weights()] == [
        tuple(w.shape) for w in ref.get_weights()
    ]
    assert [sv.name for sv in layer.scaled_weights] == [
        w.name for w in ref.weights
    ]
    assert_close(layer.kernel_value, ref.kernel, 0, 0)
    # Gradients on the two main forms (the same code serves all equations;
    # fewer compiled shapes keep the JAX run short).
    _check_against_keras(ref, layer, [x], {}, rng, grads=case in ("heads", "dense"))


def test_einsum_dense_same_shapes_and_init_statistics(rng):
    """Fresh layers: Keras's weight shapes, and a kernel with Keras's
    initializer statistics (VarianceScaling over the einsum's axes)."""
    keras.utils.set_random_seed(0)
    x = _randn(rng, (2, 6, 16))
    ref = keras.layers.EinsumDense("abc,cde->abde", (None, 2, 8), bias_axes="de")
    layer = ScaledEinsumDense("abc,cde->abde", (None, 2, 8), bias_axes="de")
    ref(x)
    out = layer(ksc.as_scaled(x))
    assert tuple(out.shape) == (2, 6, 2, 8)
    assert [w.shape for w in layer.get_weights()] == [w.shape for w in ref.get_weights()]
    k_ref, k = to_np(ref.kernel), to_np(layer.kernel_value)
    # glorot_uniform with fan_in = 16, fan_out = 16: limit sqrt(6/32).
    limit = np.sqrt(6.0 / 32.0)
    assert np.max(np.abs(k)) <= limit + 1e-6
    std = limit / np.sqrt(3.0)
    assert abs(np.std(k) - std) < 0.2 * std
    assert abs(np.std(k_ref) - std) < 0.2 * std
    # Unit-RMS data, initializer RMS in the pow2 scale.
    assert 0.5 <= rms(data_of(layer.kernel.read())) < 2.0


def test_einsum_dense_to_keras_and_config_round_trip(rng):
    layer = ScaledEinsumDense(
        "abc,cd->abd", output_shape=(None, 8), bias_axes="d", activation="tanh",
        bias_initializer="random_normal",
    )
    x = _randn(rng, (2, 6, 16))
    y = layer(ksc.as_scaled(x))
    ref = layer.to_keras()
    assert isinstance(ref, keras.layers.EinsumDense) and ref.built
    assert_close(ref(x), y, RTOL, ATOL_REL)
    for a, b in zip(ref.get_weights(), layer.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Same config keys as Keras; from_config + set_weights gives the layer back.
    config = layer.get_config()
    assert set(config) == set(ref.get_config())
    clone = ScaledEinsumDense.from_config(config)
    assert clone.get_config() == config
    clone(ksc.as_scaled(x))
    clone.set_weights(layer.get_weights())
    assert_close(clone(ksc.as_scaled(x)), y, 0, 0)
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer)
    )
    assert isinstance(restored, ScaledEinsumDense)
    assert restored.get_config() == config


def test_einsum_dense_functional_model(rng):
    inp = keras.Input((6, 16))
    h = ksc.layers.AsScaled()(inp)
    h = ScaledEinsumDense("abc,cde->abde", (None, 2, 8), bias_axes="de", name="proj")(h)
    model = keras.Model(inp, ksc.layers.ToArray()(h))
    ref = keras.layers.EinsumDense("abc,cde->abde", (None, 2, 8), bias_axes="de")(inp)
    assert tuple(model.output.shape) == tuple(ref.shape) == (None, None, 2, 8)
    x = _randn(rng, (2, 6, 16))
    direct = model.get_layer("proj")(ksc.as_scaled(x))
    assert_close(model(x), direct, RTOL, ATOL_REL)


def test_einsum_dense_bad_input(rng):
    layer = ScaledEinsumDense("abc,cd->abd", output_shape=(None, 4))
    layer(ksc.as_scaled(_randn(rng, (2, 6, 16))))
    with pytest.raises(ValueError, match="inputs"):
        layer(ksc.as_scaled(_randn(rng, (2, 6, 12))))
    with pytest.raises(ValueError, match="rank"):
        layer(ksc.as_scaled(_randn(rng, (2, 16))))
    with pytest.raises(ValueError, match="kernel_regularizer"):
        ScaledEinsumDense("ab,bc->ac", 4, kernel_regularizer="l2")
    with pytest.raises(ValueError, match="equation"):
        ScaledEinsumDense(3, 4)
    with pytest.raises(ValueError, match="equation"):
        ScaledEinsumDense("ab,bc", 4).build((2, 3))
    with pytest.raises(TypeError, match="EinsumDense"):
        ScaledEinsumDense.from_keras(keras.layers.Dense(3))


# --- ScaledMultiHeadAttention: against Keras ----------------------------------------


def _padding_mask(rng, b, t, s):
    """A random boolean (b, t, s) mask with the first key always on (no
    fully masked row: Keras's fused path treats those differently)."""
    mask = rng.random((b, t, s)) > 0.4
    mask[..., 0] = True
    return mask


# name -> (constructor kwargs, query shape, value shape, key shape or None,
#          call kwargs builder)
MHA_CASES = {
    # Scores returned: Keras takes its explicit path (its fused path
    # rejects value_dim != key_dim on JAX).
    "cross_mask": (
        dict(num_heads=2, key_dim=8, value_dim=4, output_shape=12),
        (2, 6, 16), (2, 7, 16), (2, 7, 12),
        lambda rng: {
            "attention_mask": _padding_mask(rng, 2, 6, 7),
            "return_attention_scores": True,
        },
    ),
    "self_mask_causal": (
        dict(num_heads=2, key_dim=8), (2, 6, 16), None, None,
        lambda rng: {
            "attention_mask": _padding_mask(rng, 2, 6, 6),
            "use_causal_mask": True,
        },
    ),
    "gate_window_causal": (
        dict(num_heads=2, key_dim=8, use_gate=True, use_bias=False, sliding_window=2),
        (2, 6, 16), None, None, lambda rng: {"use_causal_mask": True},
    ),
    "rank4_axis2": (
        dict(num_heads=2, key_dim=8, attention_axes=(2,)),
        (2, 3, 4, 16), None, None, None,
    ),
    "rank4_two_axes": (
        dict(num_heads=2, key_dim=8), (2, 3, 4, 16), None, None, None,
    ),
}
# Cases whose gradients are compared too (the others: outputs only; the
# attention code is shared, and fewer compiled shapes keep JAX fast).
GRAD_CASES = ("cross_mask", "self_mask_causal")


def _mha_case(name, rng):
    init, q_shape, v_shape, k_shape, call = MHA_CASES[name]
    q = _randn(rng, q_shape)
    v = q if v_shape is None else _randn(rng, v_shape)
    args = [q, v] + ([] if k_shape is None else [_randn(rng, k_shape)])
    kwargs = {} if call is None else call(rng)
    return init, args, kwargs


@pytest.mark.parametrize("case", sorted(MHA_CASES))
def test_mha_matches_keras(case, rng):
    init, args, kwargs = _mha_case(case, rng)
    ref = keras.layers.MultiHeadAttention(**init)
    ref(*args, **kwargs)
    _nonzero_bias(ref, rng)
    layer = ScaledMultiHeadAttention.from_keras(ref)
    assert layer.built
    assert [_key(w) for w in _trained(layer)] == [
        _key(w) for w in ref.trainable_variables
    ]
    _check_against_keras(ref, layer, args, kwargs, rng, grads=case in GRAD_CASES)


def test_mha_set_weights_matches_keras(rng):
    init, args, kwargs = _mha_case("self_mask_causal", rng)
    ref = keras.layers.MultiHeadAttention(**init)
    ref(*args, **kwargs)
    _nonzero_bias(ref, rng)
    layer = ScaledMultiHeadAttention(**init)
    layer(*[ksc.as_scaled(a) for a in args])
    layer.set_weights(ref.get_weights())
    for a, b in zip(layer.get_weights(), ref.get_weights()):
        np.testing.assert_array_equal(a, b)
    y = layer(*[ksc.as_scaled(a) for a in args], **kwargs)
    assert_close(y, ref(*args, **kwargs), RTOL, ATOL_REL)


def test_mha_return_attention_scores_fully_masked_rows(rng):
    """Rows with every position masked get zero attention, as in Keras's
    explicit path (taken when scores are returned)."""
    b, t, d = 2, 6, 16
    x = _randn(rng, (b, t, d))
    mask = _padding_mask(rng, b, t, t)
    mask[0, 2, :] = False
    mask[1, 4, :] = False
    kwargs = {"attention_mask": mask, "use_causal_mask": True}
    ref = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    y_ref, s_ref = ref(x, x, return_attention_scores=True, **kwargs)
    layer = ScaledMultiHeadAttention.from_keras(ref)
    sx = ksc.as_scaled(x)
    y, s = layer(sx, sx, return_attention_scores=True, **kwargs)
    assert ksc.is_scaled(y) and ksc.is_scaled(s)
    assert tuple(s.shape) == (b, 2, t, t)
    assert_close(y, y_ref, RTOL, ATOL_REL)
    assert_close(s, s_ref, RTOL, ATOL_REL)
    probs = to_np(s)
    assert np.all(probs[0, :, 2, :] == 0.0) and np.all(probs[1, :, 4, :] == 0.0)
    keep = np.broadcast_to((mask & np.tril(np.ones((t, t), bool)))[:, None], probs.shape)
    assert np.all(probs[~keep] == 0.0)
    rows = probs.sum(-1)
    np.testing.assert_allclose(rows[keep.any(-1)], 1.0, rtol=1e-5)


@pytest.mark.parametrize("with_value", [False, True])
@pytest.mark.parametrize("fully_masked_row", [False, True])
def test_mha_masked_softmax_node_equals_its_composition(fully_masked_row, with_value, monkeypatch, rng):
    """The fused masked softmax (`backend.fused.masked_softmax`: one torch
    node on eager torch, where no row is fully masked) gives the
    composition's probabilities, scales and score gradients bit for bit,
    with the probabilities' grad scale set from the values
    (`with_grad_scale`, its factor in the node's backward) or not; other
    backends, and fully masked rows, compose the rules."""
    from keras_scalify.backend import fused

    layer = ScaledMultiHeadAttention(num_heads=2, key_dim=8)
    layer(ksc.as_scaled(_randn(rng, (2, 6, 16))), ksc.as_scaled(_randn(rng, (2, 6, 16))))
    scores = _randn(rng, (2, 2, 6, 6)) * 3.0
    mask = np.tril(np.ones((6, 6), bool))[None, None] & (rng.random((2, 1, 6, 6)) > 0.3)
    mask[:, :, :, 0] = True
    if fully_masked_row:
        mask[1, 0, 3, :] = False
    mask = ops.convert_to_tensor(mask)
    upstream = ops.convert_to_tensor(_randn(rng, (2, 2, 6, 6)))
    value = ksc.as_scaled(_randn(rng, (2, 6, 2, 8)), np.float32(2.0**-2), np.float32(2.0**9))

    def run(d):
        x = ksc.as_scaled(d, np.float32(2.0**-3), np.float32(2.0**5))
        return layer._masked_softmax(x, mask, value if with_value else None)

    def loss(d):
        return ops.sum(run(d).data * upstream)

    args = [ops.convert_to_tensor(scores)]
    taken = spy_taken(monkeypatch, fused, "masked_softmax")
    got = run(*args)
    _, (got_grad,) = kb.value_and_grad(loss)(*args)
    # (The node is eager torch's on a CPU.)
    on_cpu_torch = keras.backend.backend() == "torch" and args[0].device.type == "cpu"
    assert taken[0] == (on_cpu_torch and not fully_masked_row)
    monkeypatch.setattr(fused, "masked_softmax", lambda *a: None)
    want = run(*args)
    _, (want_grad,) = kb.value_and_grad(loss)(*args)
    assert float(got.scale) == float(want.scale) and float(got.grad_scale) == float(want.grad_scale)
    np.testing.assert_array_equal(to_np(got.data), to_np(want.data))
    np.testing.assert_array_equal(to_np(got_grad), to_np(want_grad))
    assert float(got.scale) == 2.0**-1  # P(1/sqrt(6))
    softmax_grad_scale = 2.0**5 * 2.0  # ga·P(sqrt(6))
    assert (float(got.grad_scale) != softmax_grad_scale) is with_value
    rows = to_np(got).sum(-1)
    kept = np.any(np.broadcast_to(to_np(mask), (2, 2, 6, 6)), -1)
    np.testing.assert_allclose(rows[kept], 1.0, rtol=1e-5)
    assert np.all(rows[~kept] == 0.0)


def test_mha_padding_mask_matches_keras(rng):
    """Padding of the values as an `attention_mask` (ScaledTensors carry no
    Keras masks): the same as Keras's `value_mask`."""
    q, v = _randn(rng, (2, 6, 16)), _randn(rng, (2, 7, 16))
    value_mask = np.ones((2, 7), bool)
    value_mask[0, 4:] = False
    ref = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    y_ref = ref(q, v, value_mask=value_mask, return_attention_scores=True)
    layer = ScaledMultiHeadAttention.from_keras(ref)
    mask = np.broadcast_to(value_mask[:, None, :], (2, 6, 7))
    y = layer(q, v, attention_mask=mask, return_attention_scores=True)
    for a, b_ in zip(y, y_ref):
        assert_close(a, b_, RTOL, ATOL_REL)


def test_mha_compiled_matches_eager(rng):
    x = _randn(rng, (2, 6, 16))
    mask = _padding_mask(rng, 2, 6, 6)
    layer = ScaledMultiHeadAttention(num_heads=2, key_dim=8)

    def fn(x, mask):
        return ksc.to_array(
            layer(ksc.as_scaled(x), ksc.as_scaled(x), attention_mask=mask, use_causal_mask=True)
        )

    eager = fn(x, mask)
    compiled = kb.jit(fn)(ops.convert_to_tensor(x), ops.convert_to_tensor(mask))
    assert_close(compiled, eager, RTOL, ATOL_REL)


def test_mha_dropout_training_only(rng):
    x = _randn(rng, (2, 6, 16))
    ref = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.5, seed=7)
    ref(x, x)
    layer = ScaledMultiHeadAttention.from_keras(ref)
    sx = ksc.as_scaled(x)
    # Same seed, same draws: the dropout masks of Keras's layer.
    y1 = layer(sx, sx, training=True)
    assert_close(y1, ref(x, x, training=True), RTOL, ATOL_REL)
    y2 = layer(sx, sx, training=True)
    infer = layer(sx, sx, training=False)
    assert_close(infer, ref(x, x, training=False), RTOL, ATOL_REL)
    assert not np.allclose(to_np(y1), to_np(infer))
    assert not np.allclose(to_np(y1), to_np(y2))


# --- conversion and configs -------------------------------------------------------


def test_mha_to_keras_round_trip(rng):
    x = _randn(rng, (2, 6, 16))
    layer = ScaledMultiHeadAttention(
        num_heads=2, key_dim=8, bias_initializer="random_normal"
    )
    kw = dict(use_causal_mask=True, return_attention_scores=True)
    y, s = layer(ksc.as_scaled(x), ksc.as_scaled(x), **kw)
    ref = layer.to_keras()
    assert isinstance(ref, keras.layers.MultiHeadAttention) and ref.built
    for a, b in zip(ref.get_weights(), layer.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert [_key(w) for w in ref.weights] == [_key(w) for w in _trained(layer)]
    y_ref, s_ref = ref(x, x, **kw)
    assert_close(y_ref, y, RTOL, ATOL_REL)
    assert_close(s_ref, s, RTOL, ATOL_REL)
    back = ScaledMultiHeadAttention.from_keras(ref)
    assert_close(back(x, x, **kw)[0], y, 0, 0)


def test_mha_config_round_trip(rng):
    init = dict(
        num_heads=2, key_dim=8, value_dim=4, dropout=0.1, use_bias=False,
        output_shape=12, attention_axes=1, seed=5, use_gate=True,
        kernel_initializer="he_normal", sliding_window=3,
    )
    layer = ScaledMultiHeadAttention(**init)
    ref = keras.layers.MultiHeadAttention(**init)
    assert set(layer.get_config()) == set(ref.get_config())
    config = layer.get_config()
    clone = ScaledMultiHeadAttention.from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer)
    )
    assert isinstance(restored, ScaledMultiHeadAttention)
    assert restored.get_config() == config
    # A Keras config loads into the scaled class.
    from_ref = ScaledMultiHeadAttention.from_config(ref.get_config()).get_config()
    assert {**from_ref, "name": None} == {**config, "name": None}
    # Built layers: the same values after from_config + set_weights.
    layer = ScaledMultiHeadAttention(num_heads=2, key_dim=8, seed=1)
    x = ksc.as_scaled(_randn(rng, (2, 6, 16)))
    y = layer(x, x)
    clone = ScaledMultiHeadAttention.from_config(layer.get_config())
    clone(x, x)
    clone.set_weights(layer.get_weights())
    assert_close(clone(x, x), y, 0, 0)


def test_mha_functional_model_and_build_config(rng):
    inp = keras.Input((6, 16))
    h = ksc.layers.AsScaled()(inp)
    h = ScaledMultiHeadAttention(num_heads=2, key_dim=8, name="mha")(h, h, use_causal_mask=True)
    out = ksc.layers.ToArray()(h)
    model = keras.Model(inp, out)
    assert tuple(model.output.shape) == (None, 6, 16)
    x = _randn(rng, (2, 6, 16))
    y = to_np(model(x))
    layer = model.get_layer("mha")
    direct = layer(ksc.as_scaled(x), ksc.as_scaled(x), use_causal_mask=True)
    assert_close(y, direct, RTOL, ATOL_REL)
    # What `.keras` loading does for this layer: config, build config, weights.
    build = layer.get_build_config()
    assert build == {"shapes_dict": {
        "query_shape": (None, 6, 16), "value_shape": (None, 6, 16),
        "key_shape": (None, 6, 16),
    }}
    clone = ScaledMultiHeadAttention.from_config(layer.get_config())
    clone.build_from_config(build)
    clone.set_weights(layer.get_weights())
    assert_close(clone(x, x, use_causal_mask=True), direct, 0, 0)


# --- unit scale -----------------------------------------------------------------


def test_mha_unit_scale_at_init(rng):
    keras.utils.set_random_seed(0)
    x = ksc.as_scaled(_randn(rng, (4, 16, 64)))
    layer = ScaledMultiHeadAttention(num_heads=4, key_dim=16)
    y = layer(x, x)
    assert 0.25 <= rms(data_of(y)) <= 4.0
    scale = float(to_np(y.scale))
    assert scale > 0 and 2.0 ** np.round(np.log2(scale)) == scale
    # Projection weights: unit-RMS data, uncalibrated grad scales.
    for sv in layer.query_dense.scaled_weights + layer.output_dense.scaled_weights:
        if sv.name == "kernel":
            assert 0.5 <= rms(data_of(sv.read())) < 2.0
        assert float(to_np(sv.grad_scale)) == 0.0


# --- bad input --------------------------------------------------------------------


@pytest.mark.parametrize("axes", [(0,), (2,), (-1,), (1, 1)])
def test_mha_unsupported_attention_axes(axes, rng):
    layer = ScaledMultiHeadAttention(num_heads=2, key_dim=8, attention_axes=axes)
    x = ksc.as_scaled(_randn(rng, (2, 6, 16)))
    with pytest.raises(ValueError, match="attention_axes"):
        layer(x, x)


def test_mha_bad_arguments():
    with pytest.raises(ValueError, match="attention_axes"):
        ScaledMultiHeadAttention(num_heads=2, key_dim=4, attention_axes="time")
    with pytest.raises(ValueError, match="num_heads"):
        ScaledMultiHeadAttention(num_heads=0, key_dim=4)
    with pytest.raises(ValueError, match="key_dim"):
        ScaledMultiHeadAttention(num_heads=2, key_dim=2.5)
    with pytest.raises(ValueError, match="kernel_constraint"):
        ScaledMultiHeadAttention(num_heads=2, key_dim=4, kernel_constraint="non_neg")
    with pytest.raises(ValueError, match="flash_attention"):
        ScaledMultiHeadAttention(num_heads=2, key_dim=4, flash_attention=True)
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        ScaledMultiHeadAttention.from_keras(keras.layers.Dense(3))


def test_mha_wrong_query_dim(rng):
    layer = ScaledMultiHeadAttention(num_heads=2, key_dim=8)
    x = ksc.as_scaled(_randn(rng, (2, 6, 16)))
    layer(x, x)
    bad = ksc.as_scaled(_randn(rng, (2, 6, 12)))
    with pytest.raises(ValueError, match="query"):
        layer(bad, x)
    with pytest.raises(ValueError, match="value"):
        layer(x, bad)
    with pytest.raises(ValueError, match="same rank"):
        ScaledMultiHeadAttention(num_heads=2, key_dim=8)(x, ksc.as_scaled(_randn(rng, (2, 16))))


def test_every_sublayer_is_built_after_the_first_call(rng):
    layer = ScaledMultiHeadAttention(num_heads=2, key_dim=4)
    x = ksc.as_scaled(_randn(rng, (2, 8, 8)))
    layer(x, x)
    assert all(sub.built for sub in layer._flatten_layers(include_self=True, recursive=True))
