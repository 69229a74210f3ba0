"""Built-in Keras layers, models, saving and compile under scaled policies."""

import importlib.util
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_scalify

from keras_scalify.policies import ScaledDTypePolicy
from keras_scalify.policies import get_named_policy


def _inputs(rng, shape=(4, 8)):
    return rng.standard_normal(shape).astype("float32")


def _model(rng, **dense_kwargs):
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", **dense_kwargs),
            keras.layers.Dense(2),
        ]
    )
    model(_inputs(rng))
    return model


def test_dense_under_global_scaled_fp16(rng):
    keras.mixed_precision.set_dtype_policy("scaled_fp16")
    layer = keras.layers.Dense(4)
    x = _inputs(rng)
    y = layer(x)
    assert isinstance(layer.dtype_policy, ScaledDTypePolicy)
    assert layer.kernel.dtype == "float32"
    assert layer.bias.dtype == "float32"
    assert layer.compute_dtype == "float16"
    assert keras.backend.standardize_dtype(y.dtype) == "float16"
    expected = x @ keras.ops.convert_to_numpy(layer.kernel)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(y).astype("float32"), expected, rtol=1e-2, atol=1e-2
    )


def test_save_and_load_under_global_scaled_fp8(rng, tmp_path):
    keras.mixed_precision.set_dtype_policy("scaled_fp8")
    model = _model(rng)
    x = _inputs(rng)
    expected = keras.ops.convert_to_numpy(model(x))
    path = str(tmp_path / "model.keras")
    keras.saving.save_model(model, path)

    # Reload under the default global policy: the layers keep scaled_fp8.
    keras.config.set_dtype_policy("float32")
    loaded = keras.saving.load_model(path)
    for layer in loaded.layers:
        assert layer.dtype_policy == get_named_policy("scaled_fp8")
        assert layer.kernel.dtype == "float32"
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(x)), expected)


def test_save_and_load_custom_policy_per_layer(rng, tmp_path):
    policy = ScaledDTypePolicy(
        matmul_dtype="float8_e4m3fn", grad_dtype="float8_e5m2",
        compute_dtype="bfloat16",
    )
    model = _model(rng, dtype=policy)
    x = _inputs(rng)
    expected = keras.ops.convert_to_numpy(keras.ops.cast(model(x), "float32"))
    path = str(tmp_path / "model.keras")
    keras.saving.save_model(model, path)
    loaded = keras.saving.load_model(path)
    assert loaded.layers[0].dtype_policy == policy
    assert loaded.layers[1].dtype_policy == keras.dtype_policies.DTypePolicy("float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras.ops.cast(loaded(x), "float32")), expected
    )


def test_compile_does_not_wrap_in_loss_scale_optimizer(rng):
    keras.mixed_precision.set_dtype_policy("scaled_fp16")
    model = _model(rng)
    assert model.dtype_policy.name == "scaled_fp16"
    model.compile(optimizer="sgd", loss="mse")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    model.train_on_batch(_inputs(rng), _inputs(rng, (4, 2)))

    # Control: the same code under mixed_float16 is wrapped.
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    model = _model(rng)
    model.compile(optimizer="sgd", loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


_LOAD_SCRIPT = """
import sys
import keras
import numpy as np
import keras_scalify

model = keras.saving.load_model(sys.argv[1])
for layer in model.layers:
    assert layer.dtype_policy == keras_scalify.policies.get("scaled_fp8")
y = model(np.load(sys.argv[2]))
np.save(sys.argv[3], keras.ops.convert_to_numpy(keras.ops.cast(y, "float32")))
"""


def test_keras_file_loads_on_another_backend(rng, tmp_path):
    other = {"jax": "torch", "tensorflow": "jax", "torch": "tensorflow"}[
        keras.backend.backend()
    ]
    if importlib.util.find_spec(other) is None:
        pytest.skip(f"{other} is not installed")
    keras.mixed_precision.set_dtype_policy("scaled_fp8")
    model = _model(rng)
    x = _inputs(rng)
    expected = keras.ops.convert_to_numpy(keras.ops.cast(model(x), "float32"))
    paths = [str(tmp_path / name) for name in ("m.keras", "x.npy", "y.npy")]
    keras.saving.save_model(model, paths[0])
    np.save(paths[1], x)
    root = os.path.dirname(os.path.dirname(os.path.abspath(keras_scalify.__file__)))
    env = dict(
        os.environ,
        KERAS_BACKEND=other,
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    )
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, *paths],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # float16 compute on two backends: equal to float16 rounding.
    np.testing.assert_allclose(np.load(paths[2]), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "loss,metrics,targets",
    [
        ("mse", [], "regression"),
        ("sparse_categorical_crossentropy", ["accuracy"], "classes"),
    ],
)
def test_design_card_model_fits_without_boundary_layers(rng, loss, metrics, targets):
    """The README's model: a global scaled policy, scaled layers in a
    Sequential, no AsScaled/ToArray: the model returns plain arrays (it ends
    with a ToArray of its own), so Keras losses, metrics and `predict`
    work."""
    import keras_scalify as ksc

    keras.mixed_precision.set_dtype_policy("scaled_fp8")
    try:
        activation = "softmax" if targets == "classes" else None
        model = keras.Sequential(
            [
                keras.Input((8,)),
                ksc.layers.ScaledDense(16, activation="relu"),
                ksc.layers.ScaledLayerNormalization(),
                ksc.layers.ScaledDense(4, activation=activation),
            ]
        )
        model.compile(
            optimizer=ksc.ScaledOptimizer(keras.optimizers.AdamW(1e-3)),
            loss=loss,
            metrics=metrics,
        )
        x = _inputs(rng, (64, 8))
        if targets == "classes":
            y = rng.integers(0, 4, 64)
        else:
            y = rng.standard_normal((64, 4)).astype("float32")
        history = model.fit(x, y, epochs=2, batch_size=16, verbose=0)
        assert np.all(np.isfinite(history.history["loss"]))
        results = model.evaluate(x, y, verbose=0, return_dict=True)
        assert set(results) == {"loss", *metrics}
        predictions = model.predict(x, verbose=0)
        assert isinstance(predictions, np.ndarray)
        assert predictions.shape == (64, 4)
        assert type(model.layers[-1]).__name__ == "ScaledDense"
    finally:
        keras.config.set_dtype_policy("float32")
