"""DynamicRescaleGrad: delayed gradient statistics persist under fit."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from tests.conftest import to_np


class _Matmul(ksc.layers.ScaledLayer):
    """Test-only scaled projection with a plain float32 kernel."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        fan_in = input_shape.data[-1]
        self.kernel = self.add_weight(
            name="kernel", shape=(fan_in, self.units), initializer="random_normal"
        )

    def call(self, x):
        w = ksc.as_scaled(ops.convert_to_tensor(self.kernel))
        return ksc.ops.matmul(x, w)


def _model(statistic="l2"):
    inp = keras.Input((16,))
    h = ksc.layers.AsScaled()(inp)
    h = _Matmul(16)(h)
    h = ksc.layers.DynamicRescaleGrad(statistic, name="rescale")(h)
    h = _Matmul(4)(h)
    out = ksc.layers.ToArray()(h)
    return keras.Model(inp, out)


def test_state_is_zero_before_training():
    model = _model()
    assert float(to_np(model.get_layer("rescale").grad_scale_state)) == 0.0


@pytest.mark.parametrize("statistic", ["l2", "max"])
def test_delayed_statistic_persists_under_fit(statistic):
    keras.utils.set_random_seed(0)
    model = _model(statistic)
    model.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x = np.random.default_rng(0).standard_normal((32, 16)).astype("float32")
    y = np.random.default_rng(1).standard_normal((32, 4)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    state = float(to_np(model.get_layer("rescale").grad_scale_state))
    # Set by the backward pass, a power of two, and of the order of the
    # true gradient at that point: mse gradients of a 4-wide head, ~1e-2.
    assert state > 0.0
    assert 2.0 ** np.round(np.log2(state)) == state
    assert 2.0**-12 < state < 1.0
    weights_before = [to_np(w) for w in model.weights if w.path.endswith("kernel")]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    weights_after = [to_np(w) for w in model.weights if w.path.endswith("kernel")]
    assert any(np.any(a != b) for a, b in zip(weights_before, weights_after))


def test_state_matches_measured_gradient_rms():
    """The stored value is P(RMS of the true gradient) at the layer output."""
    keras.utils.set_random_seed(0)
    layer = ksc.layers.DynamicRescaleGrad("l2")
    x = np.random.default_rng(0).standard_normal((8, 16)).astype("float32")
    g_true = np.random.default_rng(1).standard_normal((8, 16)).astype("float32") * 2.0**-9
    layer.build(None)
    state = ops.convert_to_tensor(layer.grad_scale_state)

    def loss(data, st):
        y = ksc.ops.delayed_rescale_grad(ksc.ScaledTensor(data, 1.0), st, "l2")
        return ops.sum(ksc.to_array(y) * ops.convert_to_tensor(g_true))

    _, (g_data, g_state) = ksc.backend.value_and_grad(loss)(ops.convert_to_tensor(x), state)
    rms = np.sqrt(np.mean(g_true.astype(np.float64) ** 2))
    assert float(to_np(g_state)) == 2.0 ** np.floor(np.log2(rms))
    np.testing.assert_allclose(to_np(g_data), g_true, rtol=1e-6)


def test_bad_statistic():
    with pytest.raises(ValueError, match="statistic"):
        ksc.layers.DynamicRescaleGrad("l3")
