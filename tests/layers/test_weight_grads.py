"""Weight gradients of scaled layers equal Keras's (float32), through the
data variables: d loss / d data = scale · d loss / d weight."""

import keras
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify import backend as kb
from tests.conftest import assert_close
from tests.conftest import to_np


def _trainable_grads(layer, x, up, scaled):
    tv = [v for v in layer.trainable_variables if not v.overwrite_with_gradient]
    ntv = list(layer.non_trainable_variables) + [
        v for v in layer.trainable_variables if v.overwrite_with_gradient
    ]

    def loss(*values):
        mapping = list(zip(tv, values)) + [(v, ops.convert_to_tensor(v)) for v in ntv]
        with keras.StatelessScope(state_mapping=mapping):
            y = layer(x)
        y = ksc.to_array(y) if scaled else y
        return ops.sum(y * up)

    _, grads = kb.value_and_grad(loss)(*[ops.convert_to_tensor(v) for v in tv])
    return tv, [to_np(g) for g in grads]


LAYERS = {
    "dense": (lambda: keras.layers.Dense(6, activation="gelu", bias_initializer="random_normal"), (4, 8), (4, 6)),
    "layer_norm": (
        lambda: keras.layers.LayerNormalization(
            epsilon=1e-5, gamma_initializer="random_normal", beta_initializer="random_normal"
        ),
        (4, 8),
        (4, 8),
    ),
    "einsum_dense": (
        lambda: keras.layers.EinsumDense("ab,bc->ac", output_shape=6, bias_axes="c"),
        (4, 8),
        (4, 6),
    ),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_weight_gradients_match_keras(name, rng):
    make, x_shape, y_shape = LAYERS[name]
    plain = make()
    plain.build(x_shape)
    scaled_cls = {
        "dense": ksc.layers.ScaledDense,
        "layer_norm": ksc.layers.ScaledLayerNormalization,
        "einsum_dense": ksc.layers.ScaledEinsumDense,
    }[name]
    scaled = scaled_cls.from_keras(plain)
    x = ops.convert_to_tensor(rng.standard_normal(x_shape).astype("float32"))
    up = ops.convert_to_tensor(rng.standard_normal(y_shape).astype("float32"))
    _, g_plain = _trainable_grads(plain, x, up, scaled=False)
    tv, g_scaled = _trainable_grads(scaled, x, up, scaled=True)
    scales = {sv.data.path: float(to_np(sv.scale)) for sv in scaled.scaled_weights}
    assert len(g_plain) == len(g_scaled)
    for v, gs, gp in zip(tv, g_scaled, g_plain):
        # data = value / scale, so d/d data = scale · d/d value.
        assert_close(gs, gp * scales[v.path], rtol=1e-5, atol_rel=1e-6)
