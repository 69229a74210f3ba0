"""`keras_scalify.ops` on `keras.Input`s: symbolic ScaledTensors and
Functional models built from them (values, training, saving)."""

import keras
import numpy as np

import keras_scalify as ksc
from keras_scalify.ops.symbolic import ScaledOperation
from tests.conftest import assert_close
from tests.conftest import to_np


def _graph(w):
    x = keras.Input((8,))
    s = ksc.as_scaled(x, 4.0)
    h = ksc.ops.multiply(ksc.ops.matmul(s, w), 0.5)
    h = ksc.ops.concatenate([h, ksc.ops.tanh(h)], axis=-1)
    y = ksc.ops.softmax(h[:, 1:], axis=-1)
    return x, s, y


def _eager(x, w):
    h = ksc.ops.multiply(ksc.ops.matmul(ksc.as_scaled(x, 4.0), w), 0.5)
    h = ksc.ops.concatenate([h, ksc.ops.tanh(h)], axis=-1)
    return ksc.to_array(ksc.ops.softmax(h[:, 1:], axis=-1))


def test_scaled_ops_on_keras_inputs_return_symbolic_scaled_tensors(rng):
    w = rng.standard_normal((8, 3)).astype("float32")
    x, s, y = _graph(w)
    assert ksc.is_scaled(s) and isinstance(s.data, keras.KerasTensor)
    assert ksc.is_scaled(y) and tuple(y.data.shape) == (None, 5)
    assert tuple(y.scale.shape) == () and y.scale.dtype == "float32"
    model = keras.Model(x, y)  # the model ends with a ToArray of its own
    assert any(isinstance(op, ScaledOperation) for op in model.operations)
    xv = rng.standard_normal((4, 8)).astype("float32")
    out = model.predict(xv, verbose=0)
    assert isinstance(out, np.ndarray)
    assert_close(out, _eager(xv, w), rtol=1e-6)


def test_symbolic_graph_saves_and_loads(rng, tmp_path):
    w = rng.standard_normal((8, 3)).astype("float32")
    x, _, y = _graph(w)
    model = keras.Model(x, y)
    xv = rng.standard_normal((4, 8)).astype("float32")
    path = str(tmp_path / "graph.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(
        loaded.predict(xv, verbose=0), model.predict(xv, verbose=0)
    )


def test_symbolic_ops_between_scaled_layers_train(rng):
    x = keras.Input((6,))
    h = ksc.layers.ScaledDense(8, dtype="scaled_fp16")(ksc.layers.AsScaled(dtype="scaled_fp16")(x))
    h = ksc.ops.gelu(h)  # a scaled op between two scaled layers
    y = ksc.layers.ScaledDense(2, dtype="scaled_fp16")(h)
    model = keras.Model(x, y)
    model.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    xv = rng.standard_normal((64, 6)).astype("float32")
    yv = np.stack([xv[:, 0] * 0.5, xv[:, 1] - xv[:, 2]], axis=-1).astype("float32")
    history = model.fit(xv, yv, epochs=20, batch_size=16, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]
    assert to_np(model.predict(xv[:2], verbose=0)).shape == (2, 2)


def test_graphs_with_scaled_operations_scalify_and_refuse_unscalify(rng):
    w = rng.standard_normal((8, 3)).astype("float32")
    x, _, y = _graph(w)
    model = keras.Model(x, y)
    xv = rng.standard_normal((4, 8)).astype("float32")
    expected = model.predict(xv, verbose=0)
    new = ksc.scalify(model)
    assert new is model
    assert_close(new.predict(xv, verbose=0), expected, rtol=1e-6)
    import pytest

    with pytest.raises(ValueError, match="no plain Keras counterpart"):
        ksc.unscalify(model)
