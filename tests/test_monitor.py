"""`ksc.callbacks.ScaleMonitor` and `ksc.plot.scales` under `fit`."""

import json
import os
import warnings

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from keras_scalify.callbacks import ScaleMonitor
from keras_scalify.debug import _watching_calls
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.debug import scaled_value_and_grad
from keras_scalify.debug import stats
from keras_scalify.ops.boundary import encode

E4M3, E5M2, F16 = "float8_e4m3fn", "float8_e5m2", "float16"
N, BATCH = 32, 8  # 4 steps an epoch


def _data(n=N, d=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype("float32")
    w = rng.standard_normal((d, 4)).astype("float32")
    return x, np.tanh(x @ w).astype("float32")


def _model(seed=1, width=16):
    keras.utils.set_random_seed(seed)
    plain = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(width, activation="relu", name="hidden"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Dense(4, name="head"),
        ]
    )
    model = ksc.scalify(plain, dtype="scaled_fp8")
    opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2), seed=3)
    model.compile(optimizer=opt, loss="mse")
    return model


def _np(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float64)


def _stats_np(s):
    return {k: float(_np(v)) for k, v in s.items()}


def _check(history, column, expected, i=-1):
    """The record's four stats equal `expected` (a `stats` dict)."""
    np.testing.assert_array_equal(history[f"{column}/scale_exp"][i], expected["scale_exponent"])
    np.testing.assert_allclose(history[f"{column}/rms"][i], expected["data_rms"], rtol=1e-6)
    np.testing.assert_array_equal(history[f"{column}/underflow"][i], expected["underflow_fraction"])
    np.testing.assert_array_equal(history[f"{column}/saturation"][i], expected["saturation_fraction"])


@pytest.fixture(scope="module")
def trained():
    """A scaled_fp8 MLP fitted 4 steps with a monitor recording each step."""
    x, y = _data()
    sample = (x[:BATCH], y[:BATCH])
    model = _model()
    monitor = ScaleMonitor(every=1, sample=sample)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    return model, monitor, sample


# --- arguments -----------------------------------------------------------------


@pytest.mark.parametrize("every", [0, -3, 1.5, True, "10"])
def test_every_must_be_a_positive_int(every):
    with pytest.raises(ValueError, match="`every`"):
        ScaleMonitor(every=every)


@pytest.mark.parametrize(
    "formats", [{"forward": E4M3}, ["float16"], {"matmul": "not_a_dtype"}]
)
def test_bad_formats_raise(formats):
    with pytest.raises((ValueError, TypeError), match="formats"):
        ScaleMonitor(formats=formats)


def test_get_config():
    config = ScaleMonitor(every=7, formats={"grad": E5M2}, log_dir="runs").get_config()
    assert config == {
        "every": 7, "formats": {"grad": E5M2}, "log_dir": "runs", "tensorboard": True,
    }
    assert ScaleMonitor(**config).every == 7


# --- the numbers -------------------------------------------------------------------


def test_records_every_n_steps():
    x, y = _data(n=56)  # 7 steps
    model = _model()
    monitor = ScaleMonitor(every=3)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor])
    np.testing.assert_array_equal(monitor.history["step"], [1, 4, 7])
    np.testing.assert_array_equal(monitor.trace["step"], np.arange(1, 8))
    np.testing.assert_array_equal(monitor.history["learning_rate"], [np.float32(1e-2)] * 3)
    assert monitor.history["skipped_steps"].tolist() == [0, 0, 0]
    # No sample: weights only.
    assert not any("/output/" in c or "/grad/" in c for c in monitor.history)
    assert monitor.layers == ["hidden", "norm", "head"]


def test_weight_records_equal_debug_stats(trained):
    model, monitor, _ = trained
    h = monitor.history
    assert len(h["step"]) == 4
    for name in ("hidden", "norm", "head"):
        layer = model.get_layer(name)
        for sv in layer.scaled_weights:
            fmt = E4M3 if sv.name == "kernel" else F16
            expected = _stats_np(stats(ksc.ScaledTensor(_np(sv.data), _np(sv.scale)), fmt))
            _check(h, f"{name}/{sv.name}", expected)
            gs = _np(sv.grad_scale)
            gs = gs if gs > 0 else 1.0 / _np(sv.scale)
            assert h[f"{name}/{sv.name}/grad_scale_exp"][-1] == np.log2(gs)
    # The weights moved between records: the record is of the current step.
    assert h["hidden/kernel/rms"][0] != h["hidden/kernel/rms"][-1]


def test_activation_and_gradient_records_equal_debug_stats(trained):
    model, monitor, (x, y) = trained
    h = monitor.history
    seen = {}

    def record(layer, args, kwargs, out):
        seen[layer.name] = (args[0], out)

    with _watching_calls(model, record):
        model(x, training=False)
    for name in ("hidden", "norm", "head"):
        inp, out = seen[name]
        # A plain input (the model's, to `hidden`) is measured encoded.
        inp = inp if is_scaled(inp) else encode(inp)
        _check(h, f"{name}/input", _stats_np(stats(inp, E4M3)))
        _check(h, f"{name}/output", _stats_np(stats(out, F16)))
    # The gradient reaching `hidden`'s output: the rest of the model
    # differentiated by hand with respect to that ScaledTensor.
    rest = [model.get_layer(n) for n in ("norm", "head")] + [ksc.layers.ToArray()]

    def loss_of_hidden(hidden_out):
        t = hidden_out
        for layer in rest:
            t = layer(t, training=False)
        return keras.ops.mean(keras.losses.mean_squared_error(y, t))

    _, (g,) = scaled_value_and_grad(loss_of_hidden)(seen["hidden"][1])
    expected = _stats_np(stats(g, E5M2))
    _check(h, "hidden/grad", expected)
    assert expected["data_rms"] > 0
    assert h["step"][-1] == 4 and np.isfinite(h["loss"]).all()


def test_training_is_bit_identical_with_and_without_monitor():
    x, y = _data()
    results = []
    for monitor in (None, ScaleMonitor(every=1, sample=(x[:BATCH], y[:BATCH]))):
        model = _model()
        model.fit(
            x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
            callbacks=[monitor] if monitor else [],
        )
        values = [_np(v) for v in model.weights + model.optimizer.variables]
        results.append(values)
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    # And training did something.
    assert not np.array_equal(results[0][0], _np(_model().weights[0]))


class Saturate(ksc.layers.ScaledLayer):
    """An injected fault: hands on the data × 2^20 in float32 (the scale
    and grad scale compensate, so the represented value and gradient are
    unchanged), beyond float16's range where the data is large."""

    def call(self, inputs):
        k = 2.0**20
        data = keras.ops.cast(inputs.data, "float32") * k
        return ksc.ScaledTensor(data, inputs.scale / k, inputs.grad_scale * k)


def test_injected_saturating_layer_is_seen():
    """The injected layer's output saturates float16 and the input of the
    layer it feeds saturates E4M3; every other saturation record is 0."""
    x, y = _data()
    keras.utils.set_random_seed(1)
    fp8 = {"dtype": "scaled_fp8"}
    # A Sequential of scaled layers (layers taken from a scalified model
    # keep that model's graph nodes: a new graph is built from new layers).
    model = keras.Sequential(
        [
            keras.Input((8,)),
            ksc.layers.ScaledDense(16, activation="relu", name="hidden", **fp8),
            Saturate(name="injected", **fp8),
            ksc.layers.ScaledLayerNormalization(name="norm", **fp8),
            ksc.layers.ScaledDense(4, name="head", **fp8),
        ]
    )
    model.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    monitor = ScaleMonitor(every=2, sample=(x[:BATCH], y[:BATCH]))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor])
    h = monitor.history
    injected, norm = (model.get_layer(n).path for n in ("injected", "norm"))
    assert len(h["step"]) == 2
    for i in range(2):
        sat = {c: h[c][i] for c in h if c.endswith("/saturation")}
        assert sat.pop(f"{injected}/output/saturation") > 0.1
        assert sat.pop(f"{norm}/input/saturation") > 0.1
        assert len(sat) >= 15
        nonzero = {c: v for c, v in sat.items() if v != 0.0}
        assert nonzero == {}, nonzero
    # The norm casts its input to float16: infinities, so steps are skipped.
    assert monitor.trace["skipped_steps"][-1] > 0


def test_skipped_steps_in_logs_and_trace():
    x, y = _data()
    x[BATCH + 1, 0] = np.nan  # step 2 is skipped
    seen = []

    class Logs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs.get("skipped_steps"))

    model = _model()
    monitor = ScaleMonitor(every=2)
    model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
        callbacks=[monitor, Logs()],
    )
    assert seen == [0, 1, 1, 1]
    np.testing.assert_array_equal(monitor.trace["skipped_steps"], [0, 1, 1, 1])
    np.testing.assert_array_equal(monitor.history["skipped_steps"], [0, 1])


# --- files and pictures ---------------------------------------------------------


def test_log_dir_files_and_plot(trained, tmp_path):
    model, monitor, _ = trained
    monitor.log_dir = str(tmp_path)
    monitor._writer_tried = True  # TensorBoard: tested below
    monitor._save()
    history, trace = ksc.callbacks.load_history(tmp_path)
    assert list(history) == list(monitor.history)
    for k, v in monitor.history.items():
        np.testing.assert_array_equal(history[k], v)
    np.testing.assert_array_equal(trace["loss"], monitor.trace["loss"])
    with open(tmp_path / "scale_monitor.json") as f:
        js = json.load(f)
    assert js["history"]["hidden/kernel/rms"] == monitor.history["hidden/kernel/rms"].tolist()

    for source in (monitor, monitor.history, str(tmp_path)):
        fig = ksc.plot.scales(source, title="test")
        path = tmp_path / "scales.png"
        fig.savefig(path, dpi=40)
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 2000
        os.remove(path)
    with pytest.raises(ValueError, match="history"):
        ksc.plot.scales([1, 2])


def test_tensorboard_written_or_skipped_with_a_message(tmp_path):
    x, y = _data(n=16)
    model = _model()
    monitor = ScaleMonitor(every=1, log_dir=tmp_path)
    try:
        import tensorboard  # noqa: F401
        import tensorflow  # noqa: F401

        available = True
    except ImportError:
        available = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[monitor])
    messages = [str(w.message) for w in caught if "TensorBoard" in str(w.message)]
    assert (tmp_path / "scale_monitor.csv").exists()
    if available:
        assert not messages
        events = [f for _, _, fs in os.walk(tmp_path / "tensorboard") for f in fs]
        assert any(f.startswith("events.out.tfevents") for f in events)
    else:
        assert len(messages) == 1 and "skipped" in messages[0]


# --- keras-hub ---------------------------------------------------------------------


def test_finds_scaled_layers_inside_keras_hub_blocks():
    pytest.importorskip("keras_hub")
    from tests import hub_models as hm

    model = ksc.scalify(hm.MODELS["gpt2_causal_lm"](), dtype="scaled_fp8")
    x = hm.make_inputs("gpt2_causal_lm", batch=2)
    y = np.random.RandomState(1).randint(0, hm.VOCAB, x["token_ids"].shape)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    row = ksc.callbacks.measure(model, sample=(x, y), loss=loss)
    inner = [
        layer for layer in ksc.callbacks.scaled_layers(model)
        if layer.plain_io and "transformer_layer_0" in layer.path
    ]
    assert inner
    for layer in inner:
        if layer.scaled_weights:
            assert f"{layer.path}/{layer.scaled_weights[0].name}/scale_exp" in row
    # Activations and gradients inside the first block, seen as ScaledTensors.
    for stat in ("output", "grad"):
        cols = [
            c for c in row
            if "transformer_layer_0" in c and f"/{stat}/rms" in c
        ]
        assert cols and all(np.isfinite(row[c]) for c in cols)
        assert any(row[c] > 0 for c in cols)
