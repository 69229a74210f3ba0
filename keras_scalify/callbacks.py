"""Callbacks: watching scales during `fit`.

`ScaleMonitor` records, every `every` training steps, how well each scaled
layer's tensors fit their formats, as a history of NumPy arrays (and
CSV/JSON/TensorBoard files with `log_dir`); `keras_scalify.plot.scales`
draws it.
"""

import contextlib
import csv
import json
import math
import os
import warnings

import keras
import numpy as np
from keras import ops

from keras_scalify.backend import value_and_grad
from keras_scalify.core import pow2
from keras_scalify.core.formats import get_format
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.core.scaled_tensor import map_scaled
from keras_scalify.debug import _wrapped_calls
from keras_scalify.debug import stats
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.base import TENSOR_KWARGS
from keras_scalify.layers.plain_io import _input_masks
from keras_scalify.layers.plain_io import _is_float_tensor
from keras_scalify.layers.plain_io import _set_keras_mask
from keras_scalify.layers.regions import _region
from keras_scalify.layers.regions import in_region
from keras_scalify.layers.variable import effective_grad_scale
from keras_scalify.layers.variable import read_tensor
from keras_scalify.ops.boundary import encode
from keras_scalify.ops.boundary import to_array

# The columns of each layer (see `ScaleMonitor`): `<layer path>/<item>/<stat>`.
STATS = ("scale_exp", "rms", "underflow", "saturation")
# Weights read by a GEMM (measured in the matmul format); other weights
# (bias, gamma, beta) in the data format.
GEMM_WEIGHTS = ("kernel", "embeddings", "reverse_embeddings")
FORMAT_KEYS = ("matmul", "grad", "data")
GLOBAL_COLUMNS = ("step", "loss", "learning_rate", "skipped_steps")
HISTORY_FILE = "scale_monitor.csv"
TRACE_FILE = "scale_monitor_steps.csv"
JSON_FILE = "scale_monitor.json"

_STAT_KEYS = {
    "scale_exp": "scale_exponent",
    "rms": "data_rms",
    "underflow": "underflow_fraction",
    "saturation": "saturation_fraction",
}


def scaled_layers(model):
    """The scaled layers inside `model` (inside custom layers and scaled
    layers too), each once, in `_flatten_layers` order."""
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if isinstance(layer, ScaledLayer)
    ]


def layer_key(layer):
    """The name a layer's columns start with: its path (its name if it
    has none)."""
    return getattr(layer, "path", None) or layer.name


def _to_float(x):
    return float(np.asarray(ops.convert_to_numpy(x)))


def _stat_row(prefix, s):
    return {f"{prefix}/{k}": s[v] for k, v in _STAT_KEYS.items()}


def _first_input(args, kwargs):
    if args:
        return args[0]
    for k in TENSOR_KWARGS:
        if k in kwargs:
            return kwargs[k]
    return None


def _replace_first_scaled(outputs, fn):
    """`outputs` with its first ScaledTensor replaced by `fn(it)`."""
    done = []

    def replace(x):
        if done or not is_scaled(x):
            return x
        done.append(True)
        return fn(x)

    return map_scaled(replace, outputs)


@contextlib.contextmanager
def _capturing(model, on_output):
    """While open, each call of a scaled layer inside `model` reports its
    inputs and its first ScaledTensor output to `on_output(layer, args,
    kwargs, y)`, which returns the tensor to hand on in place of `y`.

    A plain-I/O layer (converted inside a custom layer) called outside a
    scaled region decodes its ScaledTensor on the way out; here it is
    called in a region, so that its ScaledTensor (re-anchored as it would
    be) is seen, then decoded exactly as the layer does. The layers' `call`
    (their class's or an instance attribute) is restored afterwards.
    """
    def wrap(layer, original):
        def call(*args, **kwargs):
            plain = layer.plain_io and not in_region()
            if plain:
                masks = _input_masks(layer, args, kwargs)
                with _region(True):
                    out = original(*args, **kwargs)
            else:
                out = original(*args, **kwargs)
            out = _replace_first_scaled(
                out, lambda y: on_output(layer, args, kwargs, y)
            )
            if plain:
                dtype = layer._plain_io_dtype
                out = map_scaled(
                    lambda t: to_array(t, dtype) if is_scaled(t) else t, out
                )
                if masks:
                    _set_keras_mask(out, masks[0])
            return out

        return call

    with _wrapped_calls(scaled_layers(model), wrap):
        yield


@contextlib.contextmanager
def _no_grad():
    if keras.backend.backend() == "torch":
        import torch

        with torch.no_grad():
            yield
    else:
        yield


def _formats_of(layer, formats):
    """The (matmul, grad, data) formats of `layer`: `formats` where given,
    else its policy's."""
    return (
        formats.get("matmul") or layer.policy_dtype("matmul_dtype"),
        formats.get("grad") or layer.policy_dtype("grad_dtype"),
        formats.get("data") or layer.compute_dtype,
    )


def _item_name(kind, k):
    return kind if k == 0 else f"{kind}{k}"


def measure(model, formats=None, sample=None, loss=None, _cache=None):
    """One record of what `ScaleMonitor` watches, from `model`'s current
    weights (and a forward/backward pass on `sample`), as a dict of Python
    floats `{"<layer path>/<item>/<stat>": value}`. See `ScaleMonitor`.

    Under JAX the measurement is one compiled function of the model's
    variable values (`keras.StatelessScope`), under TensorFlow a
    `tf.function` reading the variables, cached in `_cache` (a dict) when
    given; under torch it runs eagerly."""
    formats = _check_formats(formats)
    x, y = _split_sample(sample) if sample is not None else (None, None)
    compile_ = {"jax": _jax_measure, "tensorflow": _tf_measure}.get(
        keras.backend.backend()
    )
    if compile_ is not None:
        key = (id(model), tuple(sorted(formats.items())), id(loss))
        fn = _cache.get(key) if _cache is not None else None
        if fn is None:
            fn = compile_(model, formats, loss)
            if _cache is not None:
                _cache[key] = fn
        row = fn(x, y)
    else:
        row = _measure_tensors(model, formats, x, y, loss)
    return {k: _to_float(v) for k, v in row.items()}


def _jax_measure(model, formats, loss):
    import jax

    variables = list(model.trainable_variables) + list(model.non_trainable_variables)

    keys = []  # the record's column order, set when `pure` is traced

    def pure(values, x, y):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            row = _measure_tensors(model, formats, x, y, loss)
        keys[:] = list(row)
        return [row[k] for k in keys]

    jitted = jax.jit(pure)

    def run(x, y):
        values = jitted([v.value for v in variables], x, y)
        return dict(zip(keys, values))

    return run


def _tf_measure(model, formats, loss):
    import tensorflow as tf

    keys = []  # the record's column order, set when `pure` is traced

    def pure(x, y):
        row = _measure_tensors(model, formats, x, y, loss)
        keys[:] = list(row)
        return [row[k] for k in keys]

    compiled = tf.function(pure, reduce_retracing=True)

    def run(x, y):
        values = compiled(x, y)
        return dict(zip(keys, values))

    return run


def _measure_tensors(model, formats, x, y, loss):
    """`measure`'s record as a dict of scalar tensors."""
    row = {}
    for layer in scaled_layers(model):
        mm, _, data = _formats_of(layer, formats)
        key = layer_key(layer)
        for sv in layer.scaled_weights:
            fmt = mm if sv.name in GEMM_WEIGHTS else data
            s = stats(ScaledTensor(read_tensor(sv.data), read_tensor(sv.scale)), fmt)
            row.update(_stat_row(f"{key}/{sv.name}", s))
            gs = effective_grad_scale(read_tensor(sv.grad_scale), read_tensor(sv.scale))
            row[f"{key}/{sv.name}/grad_scale_exp"] = pow2.pow2_exponent(gs)
    if x is not None:
        row.update(_activation_stats(model, x, formats))
        if y is not None:
            row.update(_gradient_stats(model, x, y, formats, loss))
    return row


def _split_sample(sample):
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        return sample[0], sample[1]
    return sample, None


def _activation_stats(model, x, formats):
    """Stats of each scaled layer call's first input (matmul format) and
    first ScaledTensor output (data format), in inference mode."""
    row, calls = {}, {}

    def on_output(layer, args, kwargs, y):
        mm, _, data = _formats_of(layer, formats)
        key = layer_key(layer)
        k = calls[id(layer)] = calls.get(id(layer), -1) + 1
        first = _first_input(args, kwargs)
        if is_scaled(first) or _is_float_tensor(first):
            xin = first if is_scaled(first) else encode(first)
            row.update(_stat_row(f"{key}/{_item_name('input', k)}", stats(xin, mm)))
        row.update(_stat_row(f"{key}/{_item_name('output', k)}", stats(y, data)))
        return y

    with _no_grad(), _capturing(model, on_output):
        model(x, training=False)
    return row


def _loss_fn(model, loss):
    loss = loss if loss is not None else getattr(model, "loss", None)
    if loss is None or isinstance(loss, (dict, list, tuple)):
        raise ValueError(
            "ScaleMonitor needs a single loss to measure gradients on "
            "`sample=(x, y)`: pass `loss=` (the model's compiled loss is "
            f"{loss!r})."
        )
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    return lambda y, p: ops.mean(fn(y, p))


def _gradient_stats(model, x, y, formats, loss):
    """Stats of the cotangent reaching each scaled layer call's first
    ScaledTensor output (in data units, scale = its grad scale) in the
    grad format: the loss on `(x, y)` differentiated with respect to a
    zero added to that output's data."""
    fn = _loss_fn(model, loss)
    probes = []  # (layer, call index, grad scale, shape, dtype)
    calls = {}

    def find(layer, args, kwargs, y_):
        k = calls[id(layer)] = calls.get(id(layer), -1) + 1
        probes.append((layer, k, y_.grad_scale, tuple(y_.data.shape), y_.data.dtype))
        return y_

    with _no_grad(), _capturing(model, find):
        model(x, training=False)
    if not probes:
        return {}

    def objective(*zeros):
        it = iter(zeros)

        def add(layer, args, kwargs, y_):
            return ScaledTensor(y_.data + next(it), y_.scale, y_.grad_scale)

        with _capturing(model, add):
            pred = model(x, training=False)
        return fn(y, pred)

    zeros = [ops.zeros(p[3], keras.backend.standardize_dtype(p[4])) for p in probes]
    _, grads = value_and_grad(objective)(*zeros)
    row = {}
    for (layer, k, gs, _, _), g in zip(probes, grads):
        if g is None:
            continue
        _, gd, _ = _formats_of(layer, formats)
        s = stats(ScaledTensor(g, gs), gd)
        row.update(_stat_row(f"{layer_key(layer)}/{_item_name('grad', k)}", s))
    return row


def _check_formats(formats):
    if formats is None:
        return {}
    if not isinstance(formats, dict) or set(formats) - set(FORMAT_KEYS):
        raise ValueError(
            f"`formats` must be None or a dict with keys among {FORMAT_KEYS} "
            f"(dtype names, e.g. {{'matmul': 'float8_e4m3fn'}}), got {formats!r}."
        )
    out = {}
    for k, v in formats.items():
        if v is None:
            continue
        try:
            v = keras.backend.standardize_dtype(v)
            get_format(v)
        except Exception as e:
            raise ValueError(f"`formats[{k!r}]`: unknown format {v!r} ({e}).")
        out[k] = v
    return out


class ScaleMonitor(keras.callbacks.Callback):
    """Records the scales of a scaled model during `fit`.

    Every `every` training steps (steps 1, 1 + every, 1 + 2·every, ...,
    counted over every `fit` this callback is given to), it records for
    each scaled layer inside the model (`ksc.layers.ScaledLayer`, found
    inside custom layers such as keras-hub blocks too), under the column
    `"<layer path>/<item>/<stat>"`:

    - each weight (`item` = its name: `kernel`, `bias`, `gamma`, ...):
      `scale_exp` (log2 of its scale), `rms` (RMS of its data), and
      `underflow` / `saturation`, the fractions of its data that round to
      zero / exceed the format's max (as `ksc.debug.stats`) in the layer's
      matmul format (E4M3 under "scaled_fp8") for GEMM weights (`kernel`,
      `embeddings`, `reverse_embeddings`) and its data format (the compute
      dtype, float16) for the others; `grad_scale_exp`, log2 of the
      weight's gradient scale (`1/scale` while uncalibrated);
    - with `sample` (a batch `x` or `(x, y)`), a forward pass in inference
      mode: each call's first input (`input`; a plain input is measured as
      the layer encodes it) in the matmul format, and its first
      ScaledTensor output (`output`) in the data format, with the same four
      stats. A plain-I/O layer (converted inside a custom layer) is seen
      before it decodes its output; the second call of a layer (a tied
      embedding's reverse projection) gets `input1`, `output1`;
    - with `sample=(x, y)`, the gradient (`grad`): the cotangent reaching
      each such output's data on the loss of `(x, y)` (scale: the output's
      grad scale), in the grad format (E5M2 under "scaled_fp8"): what the
      layer's backward GEMMs read.

    and, for the model: `step`, `loss` (as `fit` reports it: the epoch's
    running mean), `learning_rate` and `skipped_steps` (the
    `ScaledOptimizer`'s count of skipped non-finite steps; -1 for another
    optimizer). Each step it also adds `skipped_steps` to the logs, so
    `fit`'s progress bar shows it, and keeps `step`, `loss` and
    `skipped_steps` in `trace`.

    Recording reads the weights and runs the model on `sample` outside the
    training step: training is unchanged, bit for bit (under JAX it syncs
    the trained state to the model's variables first, as Keras's own
    callbacks may).

    Args:
        every: record every this many steps (an int >= 1; 1 for debugging).
        formats: None (each layer's policy formats), or a dict overriding
            some of `"matmul"` (forward GEMM operands), `"grad"` (backward
            GEMM operand) and `"data"` (layer outputs, other weights) with
            dtype names.
        log_dir: if given, the history is written there as CSV
            (`scale_monitor.csv`, `scale_monitor_steps.csv`) and JSON
            (`scale_monitor.json`) at the end of each epoch, and as
            TensorBoard scalars and histograms when TensorFlow's summary
            writer can be imported (skipped with a warning otherwise).
        sample: a batch `x` or `(x, y)` for the activation and gradient
            records (None: weights and model-level values only).
        loss: the loss of the gradient records (default: the model's
            compiled loss, when it is a single one).
        tensorboard: write TensorBoard summaries when `log_dir` is given.

    Attributes:
        history: a dict of 1-D NumPy float64 arrays, one entry per record,
            keyed by column (`GLOBAL_COLUMNS`, then the layer columns).
        trace: a dict of per-step arrays, `step`, `loss`, `skipped_steps`.
        layers: the column prefixes (layer paths) of the monitored layers.
    """

    def __init__(
        self,
        every=100,
        formats=None,
        log_dir=None,
        sample=None,
        loss=None,
        tensorboard=True,
    ):
        super().__init__()
        if (
            not isinstance(every, (int, np.integer))
            or isinstance(every, bool)
            or every <= 0
        ):
            raise ValueError(f"`every` must be an integer >= 1, got {every!r}.")
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(f"`log_dir` must be None or a path, got {log_dir!r}.")
        self.every = int(every)
        self.formats = _check_formats(formats)
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.sample = sample
        self.loss = loss
        self.tensorboard = bool(tensorboard)
        self._rows = []
        self._trace = {"step": [], "loss": [], "skipped_steps": []}
        self._step = 0
        self._columns = None
        self._writer = None
        self._writer_tried = False
        self._cache = {}

    def get_config(self):
        return {
            "every": self.every,
            "formats": self.formats or None,
            "log_dir": self.log_dir,
            "tensorboard": self.tensorboard,
        }

    # --- reading the training state ------------------------------------------

    def _skipped_variable_index(self):
        opt = getattr(self.model, "optimizer", None)
        var = getattr(opt, "skipped_steps", None)
        if var is None:
            return None, None
        for i, v in enumerate(opt.variables):
            if v is var:
                return var, i
        return var, None

    def _skipped_steps(self):
        """The optimizer's skipped-step count now (-1 if it has none),
        without syncing the whole JAX state."""
        var, i = self._skipped_variable_index()
        if var is None:
            return -1
        state = getattr(self.model, "_jax_state", None)
        if (
            state
            and not getattr(self.model, "_jax_state_synced", True)
            and i is not None
            and state.get("optimizer_variables")
        ):
            return int(np.asarray(state["optimizer_variables"][i]))
        return int(np.asarray(ops.convert_to_numpy(var)))

    def _sync(self):
        sync = getattr(self.model, "jax_state_sync", None)
        if sync is not None:
            sync()

    def _learning_rate(self):
        opt = getattr(self.model, "optimizer", None)
        lr = getattr(opt, "learning_rate", None)
        if lr is None:
            return math.nan
        try:
            return _to_float(lr)
        except Exception:
            return math.nan

    # --- Callback hooks -------------------------------------------------------

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        skipped = self._skipped_steps()
        loss = math.nan
        if logs is not None:
            if "loss" in logs:
                loss = float(logs["loss"])
            if skipped >= 0:
                logs["skipped_steps"] = skipped
        self._trace["step"].append(self._step)
        self._trace["loss"].append(loss)
        self._trace["skipped_steps"].append(skipped)
        if (self._step - 1) % self.every == 0:
            self._record(loss, skipped)

    def on_epoch_end(self, epoch, logs=None):
        skipped = self._skipped_steps()
        if logs is not None and skipped >= 0:
            logs["skipped_steps"] = skipped
        self._save()

    def on_train_end(self, logs=None):
        self._save()
        if self._writer is not None:
            self._writer.flush()

    # --- recording ------------------------------------------------------------

    def _record(self, loss, skipped):
        self._sync()
        row = {
            "step": float(self._step),
            "loss": loss,
            "learning_rate": self._learning_rate(),
            "skipped_steps": float(skipped),
        }
        row.update(
            measure(self.model, self.formats, self.sample, self.loss, self._cache)
        )
        if self._columns is None:
            self._columns = list(row)
        self._rows.append(row)
        self._write_tensorboard(row)

    @property
    def history(self):
        columns = self._columns or list(GLOBAL_COLUMNS)
        return {
            c: np.asarray([r.get(c, math.nan) for r in self._rows], np.float64)
            for c in columns
        }

    @property
    def trace(self):
        return {k: np.asarray(v, np.float64) for k, v in self._trace.items()}

    @property
    def layers(self):
        seen = []
        for c in self._columns or []:
            if c.count("/") >= 2:
                prefix = c.rsplit("/", 2)[0]
                if prefix not in seen:
                    seen.append(prefix)
        return seen

    # --- files ----------------------------------------------------------------

    def _save(self):
        if self.log_dir is None or not self._rows:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        _write_csv(os.path.join(self.log_dir, HISTORY_FILE), self.history)
        _write_csv(os.path.join(self.log_dir, TRACE_FILE), self.trace)
        with open(os.path.join(self.log_dir, JSON_FILE), "w") as f:
            json.dump(
                {
                    "history": {k: _json_list(v) for k, v in self.history.items()},
                    "trace": {k: _json_list(v) for k, v in self.trace.items()},
                },
                f,
            )

    def _tensorboard_writer(self):
        if self._writer_tried:
            return self._writer
        self._writer_tried = True
        if self.log_dir is None or not self.tensorboard:
            return None
        try:
            import tensorboard  # noqa: F401  (tf.summary's ops need it)
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(
                os.path.join(self.log_dir, "tensorboard")
            )
        except Exception as e:  # ImportError, or a TF without summaries
            warnings.warn(
                "ScaleMonitor: TensorBoard summaries skipped (TensorFlow's "
                f"summary writer is not usable: {e}; `pip install tensorflow "
                f"tensorboard`); the CSV and JSON "
                f"history is still written to {self.log_dir!r}.",
                stacklevel=2,
            )
        return self._writer

    def _write_tensorboard(self, row):
        writer = self._tensorboard_writer()
        if writer is None:
            return
        import tensorflow as tf

        step = int(row["step"])
        groups = {}
        with writer.as_default(step=step):
            for k, v in row.items():
                if k == "step" or not np.isfinite(v):
                    continue
                tf.summary.scalar(k, v)
                if k.count("/") >= 2:
                    _, item, stat = k.rsplit("/", 2)
                    kind = item.rstrip("0123456789")
                    kind = kind if kind in ("input", "output", "grad") else "weights"
                    groups.setdefault(f"{kind}/{stat}", []).append(v)
            for name, values in groups.items():
                tf.summary.histogram(f"all_layers/{name}", np.asarray(values))


def _json_list(a):
    return [None if not np.isfinite(v) else float(v) for v in a]


def _write_csv(path, columns):
    keys = list(columns)
    n = len(next(iter(columns.values()))) if columns else 0
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for i in range(n):
            w.writerow([repr(float(columns[k][i])) for k in keys])


def load_history(log_dir):
    """`(history, trace)` as dicts of NumPy arrays, read back from the CSV
    files a `ScaleMonitor(log_dir=...)` wrote."""

    def read(path):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows:
            return {}
        keys, body = rows[0], rows[1:]
        return {
            k: np.asarray([float(r[i]) for r in body], np.float64)
            for i, k in enumerate(keys)
        }

    history = read(os.path.join(log_dir, HISTORY_FILE))
    trace_path = os.path.join(log_dir, TRACE_FILE)
    trace = read(trace_path) if os.path.exists(trace_path) else None
    return history, trace
