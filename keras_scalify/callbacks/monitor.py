"""`ScaleMonitor`: the callback that records a scaled model's scales
during `fit` (`measuring.py` takes each record, `history.py` names and
writes the files)."""

import json
import math
import os
import warnings

import keras
import numpy as np
from keras import ops

from keras_scalify.callbacks.history import HISTORY_FILE
from keras_scalify.callbacks.history import JSON_FILE
from keras_scalify.callbacks.history import TRACE_FILE
from keras_scalify.callbacks.history import _json_list
from keras_scalify.callbacks.history import _write_csv
from keras_scalify.callbacks.measuring import _check_formats
from keras_scalify.callbacks.measuring import _to_float
from keras_scalify.callbacks.measuring import measure

GLOBAL_COLUMNS = ("step", "loss", "learning_rate", "skipped_steps")


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
