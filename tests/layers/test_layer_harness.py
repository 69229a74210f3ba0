"""One harness over every scaled layer, after Keras's
`testing.TestCase.run_layer_test`: symbolic and eager calls agree, weights
agree with the plain Keras twin's (count, shapes, `count_params`,
`set_weights` both ways), a model around the layer trains a step with
`ScaledOptimizer`, and its `.keras` file gives the same outputs."""

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from keras_scalify import layers as L

B = 2


def _floats(*shape):
    return lambda rs: rs.standard_normal((B,) + shape).astype("float32")


def _tokens(n, vocab):
    return lambda rs: rs.randint(0, vocab, (B, n)).astype("int32")


# name -> (make the layer, its inputs (one or a list), whether it has a plain twin)
SPECS = {
    "ScaledDense": (lambda: L.ScaledDense(5, activation="gelu"), [_floats(6)], True),
    "ScaledEinsumDense": (
        lambda: L.ScaledEinsumDense("abc,cd->abd", output_shape=(None, 4), bias_axes="d"),
        [_floats(3, 6)],
        True,
    ),
    "ScaledConv1D": (lambda: L.ScaledConv1D(4, 3, activation="relu"), [_floats(8, 3)], True),
    "ScaledConv2D": (lambda: L.ScaledConv2D(4, 3), [_floats(6, 6, 3)], True),
    "ScaledEmbedding": (lambda: L.ScaledEmbedding(10, 4), [_tokens(5, 10)], True),
    "ScaledReversibleEmbedding": (lambda: L.ScaledReversibleEmbedding(10, 4), [_tokens(5, 10)], True),
    "ScaledLayerNormalization": (lambda: L.ScaledLayerNormalization(), [_floats(6)], True),
    "ScaledRMSNormalization": (lambda: L.ScaledRMSNormalization(), [_floats(6)], True),
    "ScaledActivation": (lambda: L.ScaledActivation("silu"), [_floats(6)], True),
    "ScaledAdd": (lambda: L.ScaledAdd(), [_floats(6), _floats(6)], True),
    "ScaledDropout": (lambda: L.ScaledDropout(0.25, seed=1), [_floats(6)], True),
    "ScaledMultiHeadAttention": (
        lambda: L.ScaledMultiHeadAttention(num_heads=2, key_dim=4),
        [_floats(5, 8), _floats(3, 8)],
        True,
    ),
    "DynamicRescaleGrad": (lambda: L.DynamicRescaleGrad("l2"), [_floats(6)], False),
}


@pytest.fixture
def scaled_float32():
    keras.config.set_dtype_policy("scaled_float32")
    yield
    keras.config.set_dtype_policy("float32")


def _call(layer, inputs):
    if isinstance(layer, (L.ScaledAdd, keras.layers.Add)):
        return layer(inputs)
    return layer(*inputs)


def _plain(y):
    return np.asarray(keras.ops.convert_to_numpy(y.data * y.scale if hasattr(y, "scale") else y))


def _model(make, values):
    """A Functional model: plain inputs -> the layer -> ToArray."""
    layer = make()
    inputs = [keras.Input(v.shape[1:], dtype=v.dtype) for v in values]
    out = L.ToArray()(_call(layer, inputs))
    return keras.Model(inputs, out), layer


@pytest.mark.parametrize("name", sorted(SPECS))
def test_symbolic_and_eager_calls_agree(name, scaled_float32):
    make, inputs, has_twin = SPECS[name]
    values = [f(np.random.RandomState(0)) for f in inputs]
    eager = _call(make(), values)
    symbols = [keras.Input(v.shape[1:], dtype=v.dtype) for v in values]
    symbolic = _call(make(), symbols)
    # A plain input leaves a scaled layer as a ScaledTensor, both ways.
    assert isinstance(eager, ksc.ScaledTensor) and isinstance(symbolic, ksc.ScaledTensor)
    assert keras.backend.standardize_dtype(symbolic.dtype) == keras.backend.standardize_dtype(eager.dtype)
    assert tuple(symbolic.scale.shape) == tuple(eager.scale.shape) == ()
    assert len(symbolic.shape) == len(eager.shape)
    for s, e in zip(tuple(symbolic.shape)[1:], tuple(eager.shape)[1:]):
        assert s in (None, e)
    if has_twin:  # The plain twin's symbolic shape, exactly.
        assert tuple(symbolic.shape) == tuple(_call(make().to_keras(), symbols).shape)


@pytest.mark.parametrize("name", sorted(n for n, s in SPECS.items() if s[2]))
def test_weights_interoperate_with_the_plain_twin(name, scaled_float32):
    make, inputs, _ = SPECS[name]
    rs = np.random.RandomState(0)
    values = [f(rs) for f in inputs]
    layer = make()
    _call(layer, values)
    twin = layer.to_keras()
    _call(twin, values)
    plain = twin.get_weights()
    scaled = layer.get_weights()
    assert [w.shape for w in scaled] == [w.shape for w in plain]
    assert sum(w.size for w in scaled) == twin.count_params() == layer.count_params()
    # Every weight is a data/scale/grad-scale triple of Keras variables;
    # the rest are delayed-rescaling states (float32 scalars).
    parts = [w for w in layer.weights if hasattr(w, "_ksc_scaled_variable")]
    assert len(parts) == 3 * len(plain)
    assert all(tuple(w.shape) == () for w in layer.weights if not hasattr(w, "_ksc_scaled_variable"))
    if not plain:
        return
    # The twin's (random) weights into the scaled layer: the same outputs.
    new = [rs.standard_normal(w.shape).astype("float32") for w in plain]
    twin.set_weights(new)
    layer.set_weights(twin.get_weights())
    for a, b in zip(layer.get_weights(), new):
        np.testing.assert_array_equal(a, b)  # (the pow2 split is exact)
    expected = np.asarray(keras.ops.convert_to_numpy(_call(twin, values)))
    np.testing.assert_allclose(_plain(_call(layer, values)), expected, rtol=1e-5, atol=1e-5)
    # And back.
    twin.set_weights([np.zeros_like(w) for w in new])
    twin.set_weights(layer.get_weights())
    for a, b in zip(twin.get_weights(), new):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_model_of_the_layer_trains_and_round_trips(name, tmp_path):
    keras.config.set_dtype_policy("scaled_fp8")
    try:
        make, inputs, _ = SPECS[name]
        values = [f(np.random.RandomState(0)) for f in inputs]
        keras.utils.set_random_seed(0)
        model, layer = _model(make, values)
    finally:
        keras.config.set_dtype_policy("float32")
    y = np.asarray(keras.ops.convert_to_numpy(model(values)), dtype="float32") * 0.5
    model.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    before = layer.get_weights()
    losses = [float(np.ravel(model.train_on_batch(values, y))[0]) for _ in range(2)]
    assert np.all(np.isfinite(losses))
    assert int(keras.ops.convert_to_numpy(model.optimizer.skipped_steps)) == 0
    if before:
        assert any(np.max(np.abs(a - b)) > 0 for a, b in zip(layer.get_weights(), before))
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    predict = lambda m: np.asarray(keras.ops.convert_to_numpy(m(values, training=False)))
    np.testing.assert_array_equal(predict(loaded), predict(model))
