"""Small models for the optimizer tests."""

import keras
import numpy as np

import keras_scalify as ksc


def data(n=160, d=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype("float32")
    w = rng.standard_normal((d, 4)).astype("float32")
    y = np.tanh(x @ w).astype("float32")
    return x, y


def keras_mlp(d=8, width=16, seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((d,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(4),
        ]
    )


def scaled_mlp(dtype, d=8, width=16, seed=1):
    """The same MLP from scaled layers (same initial weights as `keras_mlp`)."""
    return ksc.scalify(keras_mlp(d, width, seed), dtype=dtype)


def represented_weights(model):
    """Every layer's weights as float64 arrays (scaled ones as data × scale)."""
    out = []
    for layer in model.layers:
        out += [np.asarray(w, dtype=np.float64) for w in layer.get_weights()]
    return out


def variable_values(variables):
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]
