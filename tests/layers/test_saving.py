"""Saving scaled models: `.keras` round trips on the current backend, under
a scaled policy, of `scalify`/`unscalify` results, and across backends
(a subprocess saves under another backend, this process loads)."""

import atexit
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify import backend as kb
from keras_scalify.layers import AsScaled
from keras_scalify.layers import DynamicRescaleGrad
from keras_scalify.layers import ScaledAdd
from keras_scalify.layers import ScaledDense
from keras_scalify.layers import ScaledDropout
from keras_scalify.layers import ScaledEmbedding
from keras_scalify.layers import ScaledLayerNormalization
from keras_scalify.layers import ScaledRMSNormalization
from keras_scalify.layers import ToArray
from tests.conftest import to_np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- models (also built by the subprocess of the cross-backend test) ----------


def build_scaled_model():
    """A small language-model-like Functional model of scaled layers, with
    a tied output projection and non-default rescaling states."""
    tokens = keras.Input((8,), dtype="int32", name="tokens")
    emb = ScaledEmbedding(32, 16, name="emb")
    h = emb(tokens)
    a = ScaledLayerNormalization(name="ln")(h)
    a = ScaledDense(32, activation="gelu", name="up")(a)
    a = ScaledDropout(0.1, name="drop")(a)
    a = ScaledDense(16, name="down")(a)
    h = ScaledAdd(name="residual")([h, a])
    h = DynamicRescaleGrad(name="rescale")(h)
    h = ScaledRMSNormalization(name="rms")(h)
    logits = ToArray(name="logits")(emb(h, reverse=True))
    model = keras.Model(tokens, logits, name="scaled_lm")
    # Bookkeeping state that a round trip must keep too.
    model.get_layer("ln").grad_scale_state.assign(2.0**-5)
    model.get_layer("rescale").grad_scale_state.assign(2.0**-7)
    model.get_layer("up").kernel.grad_scale.assign(2.0**3)
    return model


def build_keras_model():
    """A plain Keras model for `scalify`: converted layers around an
    unconverted Flatten and Reshape."""
    inp = keras.Input((4, 8), name="x")
    h = keras.layers.LayerNormalization(name="ln")(inp)
    h = keras.layers.Dense(8, activation="relu", name="up")(h)
    h = keras.layers.Add(name="residual")([inp, h])
    h = keras.layers.Dropout(0.2, name="drop")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    h = keras.layers.Dense(16, name="mid")(h)
    h = keras.layers.Reshape((2, 8), name="reshape")(h)
    out = keras.layers.Dense(4, activation="tanh", name="head")(h)
    return keras.Model(inp, out, name="plain")


def inputs():
    rng = np.random.default_rng(7)
    return {
        "scaled": rng.integers(0, 32, (4, 8)).astype("int32"),
        "scalified": rng.standard_normal((4, 4, 8)).astype("float32"),
    }


def models():
    return {"scaled": build_scaled_model(), "scalified": ksc.scalify(build_keras_model())}


def predict(model, x):
    """Inference outputs; on JAX under one `jax.jit` (eager JAX compiles
    every primitive of the model separately, ~10x slower here)."""

    def call(t):
        return model(t, training=False)

    if keras.backend.backend() == "jax":
        call = kb.jit(call)
    return to_np(call(ops.convert_to_tensor(x)))


def variables_in_order(model):
    """`[(name, value)]` of every variable (scales, grad scales and
    rescaling states included), in creation order. Names are the last path
    component: the prefixes of auto-named objects (seed generators, the
    Sequential's name) are renumbered when a model is rebuilt."""
    return [
        (v.path.split("/")[-1], np.asarray(to_np(v)))
        for v in model.variables
        if "seed_generator" not in v.path  # RNG state: not saved by Keras
    ]


def write_artifacts(out_dir):
    """Save both models, their inputs, predictions and variables."""
    xs = inputs()
    for name, model in models().items():
        model.save(os.path.join(out_dir, f"{name}.keras"))
        np.save(os.path.join(out_dir, f"{name}_pred.npy"), predict(model, xs[name]))
        names, values = zip(*variables_in_order(model))
        np.savez(
            os.path.join(out_dir, f"{name}_vars.npz"),
            names=np.array(names),
            **{f"v{i}": v for i, v in enumerate(values)},
        )


# --- helpers ---------------------------------------------------------------------


def _round_trip(model, path):
    keras.saving.save_model(model, path)
    return keras.saving.load_model(path)


def _assert_same_variables(loaded, expected):
    got = variables_in_order(loaded)
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, a), (_, b) in zip(got, expected):
        np.testing.assert_array_equal(a, b, err_msg=name)


def _close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(b))))


@pytest.fixture
def policy():
    yield keras.mixed_precision.set_dtype_policy
    keras.config.set_dtype_policy("float32")


# --- same backend ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["scaled", "scalified"])
def test_keras_file_round_trip(name, tmp_path):
    model = models()[name]
    x = inputs()[name]
    loaded = _round_trip(model, str(tmp_path / f"{name}.keras"))
    assert [type(layer) for layer in loaded.layers] == [type(layer) for layer in model.layers]
    _assert_same_variables(loaded, variables_in_order(model))
    np.testing.assert_array_equal(predict(loaded, x), predict(model, x))
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_scaled_policy_round_trip(policy, tmp_path):
    policy("scaled_fp8")
    model = keras.Sequential(
        [keras.Input((8,)), AsScaled(), ScaledDense(16, activation="gelu"),
         ScaledLayerNormalization(), ScaledDense(8), ToArray(), keras.layers.Dense(2)]
    )
    x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
    expected = predict(model, x)
    keras.config.set_dtype_policy("float32")
    loaded = _round_trip(model, str(tmp_path / "fp8.keras"))
    dense = loaded.layers[1]
    assert dense.dtype_policy.name == "scaled_fp8"
    assert dense.policy_dtype("matmul_dtype") == "float8_e4m3fn"
    assert dense.kernel.data.dtype == "float16"
    _assert_same_variables(loaded, variables_in_order(model))
    np.testing.assert_array_equal(predict(loaded, x), expected)


def test_unscalified_file_has_no_scalify_objects(tmp_path):
    original = build_keras_model()
    x = inputs()["scalified"]
    expected = predict(original, x)
    model = ksc.unscalify(ksc.scalify(original))
    path = str(tmp_path / "plain.keras")
    keras.saving.save_model(model, path)
    with zipfile.ZipFile(path) as z:
        config = json.loads(z.read("config.json").decode())
    text = json.dumps(config)
    assert "keras_scalify" not in text and "scaled_" not in text.lower()
    _close(predict(keras.saving.load_model(path), x), expected)


# --- across backends -------------------------------------------------------------
#
# A subprocess under another backend (jax for torch and tensorflow, torch for
# jax) saves the models, their predictions and variables; this process loads
# them. Starting a Python process with a second backend takes ~10-15 s, so
# it is started when this module is imported (pytest collects every test
# file before running any) and runs while the other tests do; the fixture
# waits for it.

_CHILD_ENV = "KERAS_SCALIFY_SAVING_CHILD"


class _Saver:
    def __init__(self):
        self.other = "torch" if keras.backend.backend() == "jax" else "jax"
        self.out = tempfile.mkdtemp(prefix=f"keras_scalify_saved_by_{self.other}_")
        self.result = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        atexit.register(shutil.rmtree, self.out, True)

    def _run(self):
        script = (
            "import sys; sys.path.insert(0, sys.argv[1]);"
            "from tests.layers.test_saving import write_artifacts;"
            "write_artifacts(sys.argv[2])"
        )
        env = {
            **os.environ,
            "KERAS_BACKEND": self.other,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
            _CHILD_ENV: "1",
        }
        self.result = subprocess.run(
            [sys.executable, "-c", script, ROOT, self.out],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
        )

    def wait(self):
        self.thread.join(timeout=600)
        assert self.result is not None, "the saving subprocess did not finish"
        assert self.result.returncode == 0, self.result.stderr[-3000:]
        return self.other, pathlib.Path(self.out)


_SAVER = None if os.environ.get(_CHILD_ENV) else _Saver()


@pytest.fixture(scope="module")
def saved_elsewhere():
    """`(backend, folder)` of the artifacts written under another backend."""
    return _SAVER.wait()


@pytest.mark.parametrize("name", ["scaled", "scalified"])
def test_load_model_saved_by_another_backend(name, saved_elsewhere):
    other, out = saved_elsewhere
    loaded = keras.saving.load_model(str(out / f"{name}.keras"))
    saved = np.load(out / f"{name}_vars.npz")
    names = [str(n) for n in saved["names"]]
    _assert_same_variables(loaded, [(n, saved[f"v{i}"]) for i, n in enumerate(names)])
    expected = np.load(out / f"{name}_pred.npy")
    _close(predict(loaded, inputs()[name]), expected)


class _NoConfig(keras.Model):
    """A subclassed model built with a non-serializable argument: Keras
    cannot give it a config."""

    def __init__(self, fn, **kwargs):
        super().__init__(**kwargs)
        self.fn = fn
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return self.fn(self.dense(x))


def _double(t):
    return t * 2.0


def test_a_converted_model_without_a_config_says_why_it_cannot_be_saved(tmp_path):
    model = _NoConfig(_double)
    model(np.ones((2, 3), "float32"))
    ksc.scalify(model)  # converts and trains; only saving needs a config
    with pytest.raises(NotImplementedError, match="(?s)cannot be saved.*get_config"):
        model.save(str(tmp_path / "m.keras"))


@keras.saving.register_keras_serializable(package="test_saving")
class GraphHolder(keras.Model):
    """A subclassed model calling a plain Functional model it builds."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        inp = keras.Input((8,))
        self.inner = keras.Model(inp, keras.layers.Dense(4)(keras.layers.Dense(8, activation="relu")(inp)))

    def call(self, x):
        return self.inner(x)


def test_a_functional_model_inside_a_subclassed_one_reloads_exactly(tmp_path):
    """Its layers are replaced in its graph (node keys included, which the
    inner model's config is written from): trained, saved, loaded, the
    same outputs bit for bit."""
    model = GraphHolder()
    x = np.random.default_rng(0).standard_normal((16, 8)).astype("float32")
    model(x)
    ksc.scalify(model, dtype="scaled_fp8")
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, x[:, :4], epochs=2, batch_size=8, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(predict(loaded, x), predict(model, x))
