"""Tensor statistics per training step and scaling state, per transformer block.

    KERAS_BACKEND=jax python benchmarks/stats_count.py [--d-model 128]
        [--heads 4] [--seq-len 64] [--batch-size 3] [--amax-history-length 16]

One pre-LayerNorm transformer block (the block of `benchmarks/step_time.py`:
LN -> causal MultiHeadAttention -> add -> LN -> Dense(4d, gelu) -> Dense(d)
-> add), trained with Adam, built twice:

- Keras float8: Keras layers, every Dense and EinsumDense (the attention's
  query/key/value/output projections) `.quantize("float8")`: delayed
  scaling with an amax history per tensor;
- keras_scalify `scaled_fp8`: the same block from `keras_scalify.layers`
  (`ScaledLayerNormalization` with its default `grad_rescale="l2"`),
  trained with `ksc.ScaledOptimizer(Adam())`.

Statistics are counted two ways:

1. From the model: Keras float8 keeps an amax history for the inputs, the
   kernel and the output gradient of each quantized layer (one amax of
   each per step); keras_scalify has one delayed rescale point per
   `grad_scale_state` variable (one RMS of an activation gradient per
   step). Static scale rules measure nothing.
2. Measured: one training step runs (traced once by jax.jit /
   tf.function, eager on torch) with the functions that compute
   statistics wrapped to count their calls —
   Keras's `compute_float8_amax_history`; keras_scalify's
   `ops.rescaling.data_statistic` (every dynamic / delayed rescale),
   `backend.scalar.rms_all` (the optimizer's gradient-scale calibration,
   one RMS per weight gradient), `ScaledVariable.read(
   rebalance=True)` (a max over a bias), and the optimizer's
   `state.rms` / `state.encode_slot`. Each call is classified by its
   tensor: batch-shaped (an activation or its gradient) or weight-shaped,
   and by whether the optimizer made it.

The issue's target counts statistics over activations and activation
gradients: at most 2 per transformer block. Statistics over weights,
weight gradients and optimizer state are printed separately, labelled as
such. The scaling state per Dense layer is counted from the variables
(names and dtypes).
"""

import argparse
import collections
import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
_HERE = os.path.dirname(os.path.abspath(__file__))
# Run from a checkout without installing: the repository root and this
# folder (for `step_time.transformer_block`) on the path.
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras.src import quantizers as keras_quantizers  # noqa: E402

import keras_scalify as ksc  # noqa: E402
from keras_scalify.layers import variable as ksc_variable  # noqa: E402
from keras_scalify.ops import rescaling as ksc_rescaling  # noqa: E402
from keras_scalify.optimizers import scaled_optimizer as ksc_scaled_optimizer  # noqa: E402
from keras_scalify.optimizers import state as ksc_state  # noqa: E402
from step_time import policy_scope  # noqa: E402
from step_time import transformer_block  # noqa: E402

TARGET_PER_BLOCK = 2  # activation / activation-gradient statistics
STAT_NAMES = {"l2": "RMS", "l1": "mean |x|", "max": "max |x|"}


# --- models --------------------------------------------------------------------


def keras_float8_block(args):
    keras.utils.set_random_seed(0)
    with policy_scope("float32"):
        inputs = keras.Input((args.seq_len, args.d_model), name="x")
        outputs = transformer_block(inputs, 0, args, scaled=False)
        model = keras.Model(inputs, outputs, name="keras_float8_block")
        for layer in model._flatten_layers(include_self=False, recursive=True):
            if type(layer) in (keras.layers.Dense, keras.layers.EinsumDense):
                layer.quantize("float8")
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def scaled_block(args):
    keras.utils.set_random_seed(0)
    with policy_scope(args.policy):
        inputs = keras.Input((args.seq_len, args.d_model), name="x")
        x = ksc.layers.AsScaled(name="as_scaled")(inputs)
        x = transformer_block(x, 0, args, scaled=True)
        outputs = ksc.layers.ToArray(name="to_array")(x)
        model = keras.Model(inputs, outputs, name="scaled_block")
    with policy_scope("float32"):
        model.compile(
            optimizer=ksc.ScaledOptimizer(keras.optimizers.Adam(1e-4)),
            loss="mse",
        )
    return model


# --- counting ------------------------------------------------------------------


class Counter:
    """Counts statistic calls by (who, kind, over what)."""

    def __init__(self, batch_size):
        self.batch_size = batch_size
        self.counts = collections.Counter()
        self.in_optimizer = False

    def over(self, x):
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) >= 2 and shape[0] == self.batch_size:
            return "activation/gradient"
        return "weight/optimizer"

    def add(self, kind, x):
        who = "optimizer" if self.in_optimizer else "model"
        self.counts[(who, kind, self.over(x))] += 1


@contextlib.contextmanager
def patched(obj, name, wrapper):
    original = getattr(obj, name)
    setattr(obj, name, wrapper(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


@contextlib.contextmanager
def counting(counter):
    """Wraps every function that computes a statistic to count its calls."""

    def amax_history(fn):
        def wrapped(x, amax_history):
            counter.add("amax into an amax history (Keras float8)", x)
            return fn(x, amax_history)

        return wrapped

    def data_statistic(fn):
        def wrapped(data, statistic):
            if counter.in_optimizer:
                kind = f"{STAT_NAMES[statistic]} of a weight gradient (its grad-scale calibration)"
            else:
                kind = f"{STAT_NAMES[statistic]} (dynamic or delayed rescale)"
            counter.add(kind, data)
            return fn(data, statistic)

        return wrapped

    def rms_all(fn):
        # The optimizer's grad-scale calibration: the RMS of every weight
        # gradient in one call (`backend.scalar.rms_all`).
        def wrapped(xs):
            xs = list(xs)
            for x in xs:
                counter.add(f"{STAT_NAMES['l2']} of a weight gradient (its grad-scale calibration)", x)
            return fn(xs)

        return wrapped

    def rms(fn):
        def wrapped(x):
            counter.add("RMS of each weight's data (scale re-split; computed only on rescale steps, every `rescale_every`)", x)
            return fn(x)

        return wrapped

    def encode_slot(fn):
        def wrapped(value, dtype):
            if dtype != "float32":
                counter.add("max of an optimizer slot (low-precision state)", value)
            return fn(value, dtype)

        return wrapped

    def read(fn):
        def wrapped(self, rebalance=False):
            if rebalance:
                counter.add("max of a bias / shift (rebalance)", self.data)
            return fn(self, rebalance=rebalance)

        return wrapped

    def apply(fn):
        def wrapped(self, *args, **kwargs):
            counter.in_optimizer = True
            try:
                return fn(self, *args, **kwargs)
            finally:
                counter.in_optimizer = False

        return wrapped

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(keras_quantizers, "compute_float8_amax_history", amax_history))
        stack.enter_context(patched(ksc_rescaling, "data_statistic", data_statistic))
        stack.enter_context(patched(ksc_scaled_optimizer.S, "rms_all", rms_all))
        stack.enter_context(patched(ksc_state, "rms", rms))
        stack.enter_context(patched(ksc_state, "encode_slot", encode_slot))
        stack.enter_context(patched(ksc_variable.ScaledVariable, "read", read))
        stack.enter_context(
            patched(ksc_scaled_optimizer.ScaledOptimizer, "apply", apply)
        )
        yield


def measure(model, args):
    """Statistic calls in one training step: the model, its loss and its
    optimizer are built first (Keras's symbolic build), then
    the calls made while the first `train_on_batch` runs its step once
    (traced once by jax.jit / tf.function, eager on torch) are counted."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, args.seq_len, args.d_model)).astype("float32")
    y = np.zeros_like(x)
    # What train_on_batch does first (builds the model, its loss and its
    # optimizer from symbolic inputs), done here outside the counting.
    model._symbolic_build(data_batch=(x, y, None))
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not layer.built and not layer.variables:
            # A stateless sublayer never called (ScaledDropout of a
            # ScaledMultiHeadAttention with dropout=0): else Keras re-traces
            # the model symbolically before each train_on_batch.
            layer.built = True
    counter = Counter(args.batch_size)
    with counting(counter):
        model.train_on_batch(x, y)
    return counter.counts


# --- state ---------------------------------------------------------------------


def nbytes(variables):
    return sum(
        int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in variables
    )


def keras_float8_state(layer):
    """Scaling-state variables of a float8-quantized Dense / EinsumDense."""
    return [v for v in layer.variables if v.name.endswith(("_scale", "_amax_history"))]


def scaled_state(layer):
    """Scaling-state variables of a scaled layer: each ScaledVariable's
    scale and grad scale, and delayed-rescale states."""
    out = []
    for sv in layer.scaled_weights:
        out += [sv.scale, sv.grad_scale]
    return out + [v for v in layer.variables if v.name == "grad_scale_state"]


def describe_vars(variables):
    parts = collections.Counter()
    for v in variables:
        shape = "x".join(str(d) for d in v.shape) or "scalar"
        parts[f"{keras.backend.standardize_dtype(v.dtype)} {shape}"] += 1
    return ", ".join(f"{n} x {k}" for k, n in sorted(parts.items()))


def layer_named(model, name):
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if layer.name == name:
            return layer
    raise KeyError(name)


# --- report --------------------------------------------------------------------


def total(counts, who=None, over=None, kind_prefix=None):
    return sum(
        n
        for (w, k, o), n in counts.items()
        if (who is None or w == who)
        and (over is None or o == over)
        and (kind_prefix is None or k.startswith(kind_prefix))
    )


def report(args):
    backend = keras.config.backend()
    kmodel = keras_float8_block(args)
    smodel = scaled_block(args)
    kcounts = measure(kmodel, args)
    scounts = measure(smodel, args)

    kgemms = [
        layer
        for layer in kmodel._flatten_layers(include_self=False, recursive=True)
        if getattr(layer, "quantization_mode", None) == "float8"
    ]
    history = int(kgemms[0].inputs_amax_history.shape[0])
    rescale_points = [
        v.path for v in smodel.variables if v.name == "grad_scale_state"
    ]
    dynamic_layers = [
        layer.name
        for layer in smodel._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, ksc.layers.DynamicRescaleGrad)
    ]
    act = "activation/gradient"
    k_act = total(kcounts, over=act)
    s_act = total(scounts, over=act)
    # One amax per step into each history over an activation (a GEMM's
    # inputs) or an activation gradient (its output gradient).
    k_from_model = sum(
        1
        for v in kmodel.variables
        if v.name in ("inputs_amax_history", "outputs_grad_amax_history")
    )
    s_from_model = len(rescale_points)

    print(
        f"backend: {backend}; one transformer block: d {args.d_model}, "
        f"{args.heads} heads, seq {args.seq_len}, batch {args.batch_size} "
        f"(causal MHA + MLP 4d, pre-LayerNorm); Adam; keras {keras.__version__}\n"
        f"Keras float8: {len(kgemms)} quantized GEMM layers "
        f"({', '.join(layer.name for layer in kgemms)}), amax history length "
        f"{history}.\nkeras_scalify {args.policy}: delayed rescale points "
        f"(grad_scale_state variables): {', '.join(rescale_points) or 'none'}; "
        f"DynamicRescaleGrad layers: {', '.join(dynamic_layers) or 'none'}.\n"
    )
    print("Statistics per training step, one transformer block:\n")
    print("| statistic | Keras float8 | keras_scalify " + args.policy + " |")
    print("|---|---|---|")

    def row(label, k, s):
        print(f"| {label} | {k} | {s} |")

    row(
        "**activation + activation-gradient statistics, from the model** "
        "(Keras: inputs_amax_history + outputs_grad_amax_history variables; "
        "scalify: grad_scale_state variables)",
        k_from_model,
        s_from_model,
    )
    row(
        "**activation + activation-gradient statistics, measured** (calls over "
        "batch-shaped tensors in one training step)",
        k_act,
        s_act,
    )
    kinds = sorted({k for (_, k, o) in list(kcounts) + list(scounts) if o == act})
    for kind in kinds:
        row(
            f"&nbsp;&nbsp;of which {kind}",
            sum(n for (w, k, o), n in kcounts.items() if k == kind and o == act),
            sum(n for (w, k, o), n in scounts.items() if k == kind and o == act),
        )
    row(
        "weight statistics in the model step (Keras: kernel amax per GEMM; "
        "scalify: max of each bias/shift, `read(rebalance=True)`)",
        total(kcounts, who="model", over="weight/optimizer"),
        total(scounts, who="model", over="weight/optimizer"),
    )
    opt_kinds = sorted({k for (w, k, o) in scounts if w == "optimizer"})
    row(
        "optimizer-side statistics over weights / weight gradients / slots "
        "(not activations)",
        total(kcounts, who="optimizer"),
        total(scounts, who="optimizer"),
    )
    for kind in opt_kinds:
        row(
            f"&nbsp;&nbsp;of which {kind}",
            0,
            sum(n for (w, k, o), n in scounts.items() if k == kind and w == "optimizer"),
        )
    checked = sum(1 for kind, _, _ in smodel.optimizer._entries if kind == "plain")
    row(
        "optimizer all-finite checks over plain (unscaled) variables' "
        "gradients (`all(isfinite(g))`, to skip non-finite steps; a scaled "
        "weight's skip test reuses its gradient RMS; Keras's "
        "LossScaleOptimizer checks every gradient, plain Adam none)",
        0,
        checked,
    )
    met = s_act <= TARGET_PER_BLOCK and s_from_model <= TARGET_PER_BLOCK
    print(
        f"\nTarget (issue): at most {TARGET_PER_BLOCK} activation/gradient "
        f"statistics per transformer block: keras_scalify {s_act} measured, "
        f"{s_from_model} from the model -> {'met' if met else 'NOT met'} "
        f"(Keras float8: {k_act}).\n"
        "(A full GPT adds one more rescale point for its final LayerNorm, "
        "per model, not per block. The weight-gradient RMS above is "
        f"computed every step, the weight RMS only on rescale steps, every "
        f"`rescale_every` steps, under a cond.)\n"
    )

    kdense = layer_named(kmodel, "block0_mlp_in")
    sdense = layer_named(smodel, "block0_mlp_in")
    kstate = keras_float8_state(kdense)
    kernel_only = [sdense.scaled_weights[0].scale, sdense.scaled_weights[0].grad_scale]
    sstate = scaled_state(sdense)
    kblock = sum(nbytes(keras_float8_state(layer)) for layer in kgemms)
    sblock = sum(
        nbytes(scaled_state(layer))
        for layer in smodel._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, ksc.layers.ScaledLayer)
    )
    print(f"Scaling state per Dense layer ({kdense.name}, Dense({4 * args.d_model})):\n")
    print("| | variables | bytes |")
    print("|---|---|---|")
    print(
        f"| Keras float8 Dense (amax history {history}) | "
        f"{', '.join(v.name for v in kstate)}: {describe_vars(kstate)} | {nbytes(kstate)} |"
    )
    if args.amax_history_length is not None and args.amax_history_length != history:
        n_scalars = sum(1 for v in kstate if len(v.shape) == 0)
        n_hist = len(kstate) - n_scalars
        print(
            f"| Keras float8 Dense (amax history {args.amax_history_length}, "
            f"same variables resized) | {n_scalars} x float32 scalar, {n_hist} x "
            f"float32 {args.amax_history_length} | "
            f"{4 * n_scalars + 4 * n_hist * args.amax_history_length} |"
        )
    print(
        f"| keras_scalify ScaledDense, kernel | {', '.join(v.name for v in kernel_only)}: "
        f"{describe_vars(kernel_only)} | {nbytes(kernel_only)} |"
    )
    print(
        f"| keras_scalify ScaledDense, kernel + bias | "
        f"{', '.join(v.name for v in sstate)}: {describe_vars(sstate)} | {nbytes(sstate)} |"
    )
    print(
        f"| whole block: Keras float8 ({len(kgemms)} GEMM layers) vs keras_scalify "
        f"(every scaled weight's scale + grad scale, and the rescale states) | "
        f"{kblock} | {sblock} |"
    )
    return {
        "keras_activation_stats": k_act,
        "scaled_activation_stats": s_act,
        "keras_from_model": k_from_model,
        "scaled_from_model": s_from_model,
        "keras_dense_bytes": nbytes(kstate),
        "scaled_dense_bytes": nbytes(sstate),
        "scaled_kernel_bytes": nbytes(kernel_only),
        "target_met": met,
        "keras_counts": dict(kcounts),
        "scaled_counts": dict(scounts),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Statistics per step and scaling state")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=3, help="an odd size that no weight dimension has")
    p.add_argument("--policy", default="scaled_fp8", help="scaled policy of the keras_scalify block")
    p.add_argument(
        "--amax-history-length", type=int, default=None,
        help="also give the Keras float8 state bytes for this amax history "
        "length (the model uses Keras's default, 1024)",
    )
    args = p.parse_args(argv)
    args.keras_attention = "explicit"
    if args.d_model % args.heads:
        p.error("--d-model must be a multiple of --heads")
    return args


def main(argv=None):
    return report(parse_args(argv))


if __name__ == "__main__":
    main()
