"""Model-level weights a Keras user understands: a scalified model's
`get_weights()` / `set_weights()` / `count_params()` are its plain
original's (a scaled weight as its represented float32 value; scales,
gradient scales and rescaling states are bookkeeping), so weights move
between the plain and the scalified model both ways. (Layer level: the
harness, `test_layer_harness.py`.)"""

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from tests import hub_models
from tests.conftest import to_np


def _mlp(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(3),
        ]
    )


def _functional(seed):
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,))
    h = keras.layers.Dense(6, activation="gelu")(x)
    h = keras.layers.Add()([x, h])
    h = keras.layers.BatchNormalization()(h)  # unconverted, kept plain
    return keras.Model(x, keras.layers.Dense(2)(h))


def _check_round_trip(plain, other, scaled, inputs):
    """`scaled` takes `plain`'s weights and computes its outputs; `other`
    (a plain twin with other weights) takes them back."""
    n = len(plain.get_weights())
    assert len(scaled.get_weights()) == n
    assert scaled.count_params() == plain.count_params()
    scaled.set_weights(plain.get_weights())
    # scaled_float32: every factor a power of two, the values exact.
    for a, b in zip(scaled.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    out, ref = (
        np.asarray(keras.ops.convert_to_numpy(m(inputs, training=False)))
        for m in (scaled, plain)
    )
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    other.set_weights(scaled.get_weights())
    for a, b in zip(other.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make", [_mlp, _functional], ids=["sequential", "functional"])
def test_graph_model_weights_interoperate(make):
    plain = make(0)
    scaled = ksc.scalify(make(1), dtype="scaled_float32")
    x = np.random.RandomState(0).standard_normal((4, 6)).astype("float32")
    _check_round_trip(plain, make(2), scaled, x)


def test_hub_backbone_weights_interoperate():
    pytest.importorskip("keras_hub")
    plain = hub_models.gpt2_backbone()
    keras.utils.set_random_seed(1)
    scaled = ksc.scalify(hub_models._gpt2(), dtype="scaled_float32")
    keras.utils.set_random_seed(2)
    other = hub_models._gpt2()
    inputs = hub_models.make_inputs("gpt2_backbone")
    _check_round_trip(plain, other, scaled, inputs)


def test_set_weights_names_what_is_wrong():
    scaled = ksc.scalify(_mlp(0), dtype="scaled_float32")
    weights = _mlp(0).get_weights()
    with pytest.raises(ValueError, match=r"must have 6 arrays .* got 5"):
        scaled.set_weights(weights[:-1])
    weights[0] = weights[0].T
    with pytest.raises(ValueError, match=r"dense.*kernel.* must have shape \(6, 8\)"):
        scaled.set_weights(weights)


def test_a_scalified_sequential_quantizes_as_its_plain_self():
    """A scalified Sequential is converted in place like every other model:
    `quantize` serves it as Keras's quantize of its unscalified self."""
    scaled = ksc.scalify(_mlp(0), dtype="scaled_float32")
    assert isinstance(scaled, ksc.models.ScalifiedModel)
    assert isinstance(scaled, keras.Sequential)
    x = np.random.RandomState(0).standard_normal((4, 6)).astype("float32")
    ref = to_np(scaled(x))
    scaled.quantize("int8")
    assert type(scaled) is keras.Sequential
    dense = [layer for layer in scaled.layers if type(layer) is keras.layers.Dense]
    assert len(dense) == 2 and all(layer.quantization_mode == "int8" for layer in dense)
    out = to_np(scaled(x))
    # int8 weights (per-channel) and activations: ~1% of the outputs' scale.
    np.testing.assert_allclose(out, ref, atol=0.05 * np.abs(ref).max())
