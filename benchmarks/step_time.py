"""Training-step time of scaled models vs their Keras counterparts.

    KERAS_BACKEND=jax python benchmarks/step_time.py [--model mlp|gpt|both|gpt2-hub|llama-hub]
        [--steps 40] [--warmup 3] [--rounds 20] [--batch-size N]
        [--fp8-route auto] [--rows ROW ...] [--breakdown] [--jit-compile]
        [--op-count] [--keep-heap]

Two models, each built six ways and trained with Adam by
`model.train_on_batch` on one fixed batch (no input pipeline is timed):

- MLP: Input(784) -> Dense(1024, relu) -> Dense(1024, relu) -> Dense(10),
  sparse categorical cross-entropy on logits (`--mlp-input`,
  `--mlp-width`, `--mlp-depth`; batch 128).
- GPT: a pre-LayerNorm decoder, token embedding -> [LN -> causal
  MultiHeadAttention -> add -> LN -> Dense(4d, gelu) -> Dense(d) -> add] x L
  -> LN -> output projection tied to the token embedding, next-token
  cross-entropy (`--vocab 256 --seq-len 64 --d-model 128 --heads 4
  --layers 2`; batch 16). No position embedding (a timing model). The
  Keras one is built from `keras.layers` plus a small tied-projection
  layer (`x @ embeddingsᵀ`, never quantized), the scaled one from
  `keras_scalify.layers` (`ScaledEmbedding(..)(x, reverse=True)` is the tied
  projection, an FP8 GEMM under `scaled_fp8`), with the same initializers.
  (`ksc.scalify` converts an untied Keras GPT, Embedding and causal MHA
  included, but a tied projection needs the scaled embedding's `reverse`
  call, so the scaled GPT is written with the scaled layers.) The Keras
  MHA takes its explicit path by default (scores materialized:
  ScaledMultiHeadAttention's computation); `--keras-attention fused` uses
  `ops.dot_product_attention`, which under mixed_float16 does not compile
  on jax CPU ("precision F16_F16_F32 not supported by dot_general").

Rows, each paired with its Keras counterpart:

| row | model | optimizer |
|---|---|---|
| Keras float32 | plain | Adam |
| scaled_float32 | scaled, `dtype="scaled_float32"` | `ScaledOptimizer(Adam())` |
| Keras mixed_float16 | plain, global policy `mixed_float16` | Adam in Keras's `LossScaleOptimizer` (added by `compile`) |
| scaled_fp16 | scaled, `scaled_fp16` | `ScaledOptimizer(Adam())` |
| Keras mixed_bfloat16 | plain, global policy `mixed_bfloat16` (the scaled_fp8 rows also give their ratio to it) | Adam |
| Keras float8 | plain float32, every Dense / EinsumDense `.quantize("float8")` (delayed scaling, E4M3 fwd / E5M2 bwd, simulated by quantize-dequantize) | Adam |
| scaled_fp8 | scaled, `scaled_fp8` (FP8 GEMMs on `--fp8-route`, default `auto`; FP16 activations and master weights) | `ScaledOptimizer(Adam())` |
| scaled_fp8, float32 storage | scaled, the FP8 GEMMs of `scaled_fp8` with float32 activations and master weights, as Keras float8 keeps them | `ScaledOptimizer(Adam())` |
| scaled_fp8, simulate route | scaled, `scaled_fp8` with its FP8 GEMMs on the simulation: float32 GEMMs on the FP8 values, as Keras float8 computes them | `ScaledOptimizer(Adam())` |

On a CPU no route has FP8 arithmetic. `auto` takes the native route
where it is faster: on jax and TensorFlow a bfloat16 GEMM of the FP8
values (exact, float32 accumulation) on a CPU with bfloat16 units, else
the float32 simulation (TensorFlow: compiled as one XLA function), with the
FP8 rounding done in float32 arithmetic (`keras_scalify.backend.fp8`);
Keras float8 quantizes with FP8 casts and multiplies as float32. The device
line says whether the CPU has bfloat16 units; the FP8 GEMM route column
names the route each row's FP8 GEMMs took.

The MLP's scaled rows are `ksc.scalify(keras_mlp, dtype=...)`.

`--model gpt2-hub` / `llama-hub` (needs keras-hub): a keras-hub
`GPT2CausalLM` / `LlamaCausalLM` of the GPT's sizes (MLP width 4d, no
dropout; Llama with half as many key/value heads), random weights, inputs
`token_ids` and an all-true `padding_mask`; the scaled rows are the Keras
model converted by `ksc.scalify` (keras-hub's own blocks run on
ScaledTensors through the dispatch), Keras float8 quantizes its Dense and
EinsumDense layers.

Timing: every model is compiled and warmed up first (`--warmup` calls; the
first compiles under jax / tensorflow, so compile time is excluded), then
the rows are timed in interleaved rounds (`--rounds`, the row order rotated
each round, `--steps` timed calls per row in all), so that changes in the
machine's load hit every row alike. Each `train_on_batch` returns the loss
as a Python float, so every timed call includes the device sync. The table
gives the median ms/step and the ratio to the Keras counterpart: the
median over rounds of the two rows' per-round medians' ratio, which
cancels the machine's slower and faster phases (`paired_ratio`),
with the issues' targets (scaled_float32 <= 1.15x Keras float32 on jax and
TensorFlow, <= 1.25x on torch; scaled_fp8 <= 1.0x Keras float8, checked
for both FP8 rows) and whether this run meets them. The "first step"
column is the wall time of each row's first `train_on_batch` (jax and
TensorFlow trace and compile the step in it; Keras on TensorFlow traces
it twice, as it builds the optimizer inside the first trace), taken as
the rows are built, in the table's order. The page faults column is
the median minor page faults per step (Unix): eager torch on a CPU
allocates every temporary through malloc, and glibc returns freed memory
to the system (heap trimming, `mmap`ed blocks), so a step that allocates
more than the last one faults its pages back in (~1-2 ms per thousand
faults on the 2-core machines), and which row pays depends on the heap
the rows share. `--keep-heap` (glibc) keeps freed memory in the heap for
the whole run, every row alike, as a caching allocator (a GPU's) does. `--jit-compile` passes
`jit_compile=True` to every row's `compile` (on torch: `torch.compile`).

A model whose stateless sublayers stay unbuilt after a train step (the
ScaledDropout of a ScaledMultiHeadAttention with dropout=0, never called)
makes Keras re-trace it symbolically before every `train_on_batch`; the
script prints that cost, then marks such layers built and times the steady
state (`--keep-unbuilt` times them as they are). `--breakdown` also
times parts of the step apart: on jax the jitted forward+backward and
optimizer update; on eager torch the forward, loss, backward and optimizer
update of Keras's torch train step, and what `train_on_batch` costs beyond
them (Keras's bookkeeping).
`--op-count` (torch) counts the aten operators of one train_on_batch per
row with `torch.profiler` (design §9c's operator counts), the operators
that return a 0-d tensor (scale arithmetic; each a kernel launch on a
GPU) and the host's synchronizing reads of kept scale values
(`backend.scalar.synchronizing_reads`); on a GPU also its kernel
launches, the host's waits for the device (synchronizations) and the
GPU's kernel time. `--scalar-path` picks the scale path the counted steps
take (after 3 steps on it): `auto` (the device's own), `host-reads-off`
(a GPU's, run on a CPU: `backend.scalar.host_reads_disabled`) or
`tensor-ops` (no memo, no host value: `memo_disabled`, the GPU path
before design §8.4).
On torch the rows run on 1 CPU thread by default (`--torch-threads`; with
torch's default threads a loaded 2-core machine gave 5-10x erratic times).
"""

import argparse
import contextlib
import ctypes
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
_HERE = os.path.dirname(os.path.abspath(__file__))
# Run from a checkout without installing: the repository root and this
# folder (for `fp8_matmul.device_name`) on the path.
sys.path[:0] = [os.path.dirname(_HERE), _HERE]

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_scalify as ksc  # noqa: E402
from keras_scalify.backend import fp8  # noqa: E402
from keras_scalify.backend import scalar as S  # noqa: E402

from fp8_matmul import device_name  # noqa: E402

# The FP8 GEMM recipe of `scaled_fp8` with Keras float8's storage: float32
# activations and master weights (`scaled_fp8` keeps both in float16).
FP8_FLOAT32_STORAGE = ksc.ScaledDTypePolicy(
    "scaled_fp8_float32_storage",
    compute_dtype="float32",
    matmul_dtype="float8_e4m3fn",
    grad_dtype="float8_e5m2",
    master_dtype="float32",
    state_dtype="float32",
)

# (row, kind, policy, Keras counterpart)
ROWS = [
    ("Keras float32", "keras", "float32", None),
    ("scaled_float32", "scaled", "scaled_float32", "Keras float32"),
    ("Keras mixed_float16", "keras", "mixed_float16", None),
    ("scaled_fp16", "scaled", "scaled_fp16", "Keras mixed_float16"),
    ("Keras mixed_bfloat16", "keras", "mixed_bfloat16", None),
    ("Keras float8", "keras_fp8", "float32", None),
    ("scaled_fp8", "scaled", "scaled_fp8", "Keras float8"),
    ("scaled_fp8, float32 storage", "scaled", FP8_FLOAT32_STORAGE, "Keras float8"),
    ("scaled_fp8, simulate route", "scaled", "scaled_fp8", "Keras float8"),
]
# The scaled_fp8 rows also report their ratio to this row where it ran (on
# a GPU, bfloat16 mixed precision is what FP8 training has to beat).
BF16_ROW = "Keras mixed_bfloat16"
# Rows whose FP8 GEMMs take a fixed route (the others take `--fp8-route`):
# the simulation runs float32 GEMMs on the dequantized FP8 values, as Keras
# float8 does.
ROUTES = {"scaled_fp8, simulate route": "simulate"}

# Targets set by the issues: {row: {backend (None: every backend): max ratio}}
TARGETS = {
    "scaled_float32": {"jax": 1.15, "tensorflow": 1.15, "torch": 1.25},
    "scaled_fp8": {None: 1.0},
    "scaled_fp8, float32 storage": {None: 1.0},
}


class policy_scope:
    """Sets the global dtype policy (a scaled name too) for a `with` block."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.old = keras.config.dtype_policy()
        ksc.set_dtype_policy(self.name)

    def __exit__(self, *exc):
        keras.config.set_dtype_policy(self.old)


# --- models --------------------------------------------------------------------


def keras_mlp(args):
    layers = [keras.Input((args.mlp_input,))]
    layers += [
        keras.layers.Dense(args.mlp_width, activation="relu")
        for _ in range(args.mlp_depth)
    ]
    layers.append(keras.layers.Dense(args.mlp_classes))
    return keras.Sequential(layers, name="mlp")


class TiedProjection(keras.layers.Layer):
    """`x @ embeddingsᵀ` with the table of a `keras.layers.Embedding`.

    The embedding layer is reached through a closure, so that this layer
    does not track it (its table stays one variable of the model)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self._table = lambda: embedding.embeddings

    def call(self, x):
        table = ops.cast(self._table(), x.dtype)
        return ops.matmul(x, ops.transpose(table))


def _gpt_layers(args, scaled):
    """Keras or keras_scalify layer classes by Keras name."""
    L = ksc.layers if scaled else keras.layers
    prefix = "Scaled" if scaled else ""
    return {
        "Embedding": getattr(L, prefix + "Embedding"),
        "LayerNormalization": getattr(L, prefix + "LayerNormalization"),
        "MultiHeadAttention": getattr(L, prefix + "MultiHeadAttention"),
        "Dense": getattr(L, prefix + "Dense"),
        "Add": getattr(L, prefix + "Add"),
    }


def transformer_block(x, i, args, scaled):
    """One pre-LayerNorm block: x + attn(LN(x)), then + MLP(LN(.)), with
    Keras layers or keras_scalify layers (`args`: d_model, heads,
    keras_attention)."""
    K = _gpt_layers(args, scaled)
    d = args.d_model
    h = K["LayerNormalization"](epsilon=1e-5, name=f"block{i}_ln1")(x)
    attention = K["MultiHeadAttention"](
        args.heads, d // args.heads, name=f"block{i}_attention"
    )
    if scaled or args.keras_attention == "fused":
        h = attention(h, h, use_causal_mask=True)
    else:
        # Keras's explicit path (scores materialized), the computation
        # ScaledMultiHeadAttention performs.
        h, _ = attention(h, h, use_causal_mask=True, return_attention_scores=True)
    x = K["Add"](name=f"block{i}_add1")([x, h])
    h = K["LayerNormalization"](epsilon=1e-5, name=f"block{i}_ln2")(x)
    h = K["Dense"](4 * d, activation="gelu", name=f"block{i}_mlp_in")(h)
    h = K["Dense"](d, name=f"block{i}_mlp_out")(h)
    return K["Add"](name=f"block{i}_add2")([x, h])


def gpt(args, scaled):
    """The GPT decoder from Keras layers or from keras_scalify layers (the
    current global dtype policy applies)."""
    K = _gpt_layers(args, scaled)
    tokens = keras.Input((args.seq_len,), dtype="int32", name="tokens")
    embedding = K["Embedding"](args.vocab, args.d_model, name="token_embedding")
    x = embedding(tokens)
    for i in range(args.layers):
        x = transformer_block(x, i, args, scaled)
    x = K["LayerNormalization"](epsilon=1e-5, name="final_ln")(x)
    if scaled:
        logits = ksc.layers.ToArray(name="logits")(embedding(x, reverse=True))
    else:
        logits = TiedProjection(embedding, name="logits")(x)
    return keras.Model(tokens, logits, name="gpt")


# keras-hub causal LMs (`--model gpt2-hub` / `llama-hub`): tiny configs of
# the GPT sizes (`--vocab --seq-len --d-model --heads --layers`, MLP width
# 4d, Llama with half as many key/value heads), random weights.
HUB_MODELS = ("gpt2-hub", "llama-hub")


def hub_causal_lm(model_name, args):
    """A keras-hub CausalLM (no preprocessor) under the current policy."""
    try:
        import keras_hub
    except ImportError as e:
        raise SystemExit(f"--model {model_name} needs keras-hub (pip install keras-hub): {e}")
    d, h = args.d_model, args.heads
    if model_name == "gpt2-hub":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=args.vocab, num_layers=args.layers, num_heads=h, hidden_dim=d,
            intermediate_dim=4 * d, dropout=0.0, max_sequence_length=args.seq_len,
        )
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=args.vocab, num_layers=args.layers, num_query_heads=h,
        num_key_value_heads=max(1, h // 2), hidden_dim=d, intermediate_dim=4 * d,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def quantize_float8(model):
    """Keras float8 training: every Dense / EinsumDense quantized."""
    n = 0
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if type(layer) in (keras.layers.Dense, keras.layers.EinsumDense):
            layer.quantize("float8")
            n += 1
    return n


def build(model_name, kind, policy, args):
    """A compiled model for one row."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(0)
    keras_model = {"mlp": keras_mlp, "gpt": lambda a: gpt(a, scaled=False)}.get(
        model_name, lambda a: hub_causal_lm(model_name, a)
    )
    if kind == "scaled":
        optimizer = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-4))
        if model_name == "gpt":
            with policy_scope(policy):
                model = gpt(args, scaled=True)
        else:  # the Keras model, converted
            with policy_scope("float32"):
                model = keras_model(args)
            model = ksc.scalify(model, dtype=policy)
    else:
        optimizer = keras.optimizers.Adam(1e-4)
        with policy_scope(policy):
            model = keras_model(args)
            if kind == "keras_fp8":
                quantize_float8(model)
    with policy_scope(policy if kind == "keras" else "float32"):
        # Under mixed_float16, compile wraps Adam in a LossScaleOptimizer.
        model.compile(optimizer=optimizer, loss=loss, jit_compile=args.jit_compile)
    return model


def batch(model_name, args, batch_size):
    rng = np.random.default_rng(0)
    if model_name == "mlp":
        x = rng.standard_normal((batch_size, args.mlp_input)).astype("float32")
        y = rng.integers(0, args.mlp_classes, (batch_size,)).astype("int32")
        return x, y
    seq = rng.integers(0, args.vocab, (batch_size, args.seq_len + 1)).astype("int32")
    if model_name in HUB_MODELS:
        x = {"token_ids": seq[:, :-1], "padding_mask": np.ones((batch_size, args.seq_len), "bool")}
        return x, seq[:, 1:]
    return seq[:, :-1], seq[:, 1:]


# --- timing --------------------------------------------------------------------


def minor_faults():
    """This process's minor page faults so far (None where the OS does not
    count them: `resource` is Unix only)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# glibc's `mallopt` parameters, and the largest mmap threshold it accepts
# on 64-bit (`DEFAULT_MMAP_THRESHOLD_MAX`).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20


def keep_heap(libc=None):
    """`--keep-heap`: glibc keeps freed memory in the process's heap for the
    rest of the run (every row alike) instead of returning it to the
    system (heap trimming above `M_TRIM_THRESHOLD`, `mmap` for blocks above
    `M_MMAP_THRESHOLD`), so that a step reuses pages instead of
    page-faulting fresh ones back in: what a caching allocator (a GPU's)
    does. Eager torch on a CPU allocates every temporary through malloc;
    which row pays the faults then depends on the heap the rows share.
    Raises where the C library has no `mallopt` (not glibc) or refuses."""
    try:
        mallopt = (ctypes.CDLL(None) if libc is None else libc).mallopt
    except (OSError, AttributeError, TypeError):  # (TypeError: Windows)
        raise RuntimeError("--keep-heap needs glibc's mallopt (Linux).") from None
    for param, value in ((M_TRIM_THRESHOLD, 2**31 - 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)):
        if mallopt(param, value) != 1:
            raise RuntimeError(f"mallopt({param}, {value}) failed.")


def time_rows(models, x, y, steps, warmup, rounds, routes):
    """Median seconds per `train_on_batch` of each model, timed in
    interleaved rounds (row order rotated each round) after `warmup` more
    untimed calls each (the models have already run, and compiled, once).
    Each row runs under its FP8 route (`routes[row]`; torch resolves it on
    every eager call). Also returns each row's median minor page faults
    per step (None where not counted) and its median in each round."""
    losses = {}
    for name, model in models.items():
        with fp8.fp8_route(routes[name]):
            for _ in range(warmup):
                losses[name] = model.train_on_batch(x, y)
    times = {name: [] for name in models}
    faults = {name: [] for name in models}
    names = list(models)
    if not names:  # every row failed to build: the table reports why
        return {}, losses, {}, {}
    rounds = max(1, min(rounds, steps))
    per_round = [steps // rounds + (r < steps % rounds) for r in range(rounds)]
    by_round = {name: [] for name in models}
    for r, n in enumerate(per_round):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            model = models[name]
            start = len(times[name])
            with fp8.fp8_route(routes[name]):
                for _ in range(n):
                    f0 = minor_faults()
                    t0 = time.perf_counter()
                    losses[name] = model.train_on_batch(x, y)
                    times[name].append(time.perf_counter() - t0)
                    if f0 is not None:
                        faults[name].append(minor_faults() - f0)
            by_round[name].append(float(np.median(times[name][start:])))
    medians = {name: float(np.median(t)) for name, t in times.items()}
    fault_medians = {name: float(np.median(f)) if f else None for name, f in faults.items()}
    return medians, losses, fault_medians, by_round


def paired_ratio(by_round, row, counterpart):
    """The median over rounds of `row`'s median step time over
    `counterpart`'s in the same round (`time_rows`): a slower or faster
    phase of the machine, lasting seconds, scales both alike and cancels,
    where a ratio of whole-run medians moves with the phases each row
    happened to meet (on the 2-core machines, the torch MLP's
    scaled_float32 ratio spread 1.14-1.28x over four runs as a ratio of
    medians, 1.19-1.22x paired)."""
    return float(np.median(np.array(by_round[row]) / np.array(by_round[counterpart])))


def fp8_routes_taken(model):
    """The FP8 GEMM routes the model's layers took (sorted names)."""
    return sorted(
        {
            str(layer.fp8_route)
            for layer in model._flatten_layers(recursive=True)
            if getattr(layer, "fp8_route", None)
        }
    )


def unbuilt(model):
    """Names of the model's layers that are not built after a train step."""
    return [
        type(layer).__name__
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if not layer.built
    ]


def rebuild_cost(model, x, y, args, calls=3):
    """Median ms of `train_on_batch` with the unbuilt layers left as they
    are, then with them marked built (NaN with --keep-unbuilt)."""

    def median_call():
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            model.train_on_batch(x, y)
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3

    before = median_call()
    if args.keep_unbuilt:
        return before, float("nan")
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not layer.built:
            # Stateless (ScaledDropout in ScaledMultiHeadAttention with
            # dropout=0, which is never called): nothing to build.
            if layer.variables:
                raise RuntimeError(f"{layer.name} is unbuilt and holds variables")
            layer.built = True
    return before, median_call()


def jax_breakdown(model, x, y, repeats):
    """jax only: median ms of the jitted forward+backward (loss and
    gradients) and of the jitted optimizer update, each on its own."""
    import jax

    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    ov = [v.value for v in model.optimizer.variables]

    def loss_fn(tv, ntv, x, y):
        out, _ = model.stateless_call(tv, ntv, x, training=True)
        return model.loss(y, out)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    opt_fn = jax.jit(lambda ov, g, tv: model.optimizer.stateless_apply(ov, g, tv))
    _, grads = grad_fn(tv, ntv, x, y)

    def median_ms(fn, *a):
        jax.block_until_ready(fn(*a))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3

    return median_ms(grad_fn, tv, ntv, x, y), median_ms(opt_fn, ov, grads, tv)


# The parts of an eager torch step that `torch_breakdown` times apart.
TORCH_PARTS = ("forward", "loss", "backward", "optimizer")


def torch_breakdown(models, x, y, rounds, routes):
    """Eager torch only: per row, the median ms of each part of a training
    step timed apart (`TORCH_PARTS`), and of a whole `train_on_batch` timed
    in the same rounds, the rows interleaved round by round as in
    `time_rows` (each under its FP8 route, `routes[row]`). The parts are
    the steps of Keras's torch `train_step`, through public APIs: the
    forward call, `compute_loss` and the optimizer's `scale_loss`,
    `backward()`, `optimizer.apply` of the gradients. What
    `train_on_batch` costs beyond them (Keras's bookkeeping: its per-call
    build check, which re-registers every variable with torch, the data
    conversion, the loss tracker) is its median minus their sum."""
    import torch

    xt, yt = keras.tree.map_structure(keras.ops.convert_to_tensor, (x, y))
    times = {row: {part: [] for part in (*TORCH_PARTS, "train_on_batch")} for row in models}
    for _ in range(rounds):
        for row, model in models.items():
            with fp8.fp8_route(routes[row]):
                t0 = time.perf_counter()
                model.train_on_batch(x, y)
                times[row]["train_on_batch"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                y_pred = model(xt, training=True)
                t1 = time.perf_counter()
                model.zero_grad()
                loss = model.compute_loss(x=xt, y=yt, y_pred=y_pred, training=True)
                loss = model.optimizer.scale_loss(loss)
                t2 = time.perf_counter()
                loss.backward()
                t3 = time.perf_counter()
                variables = model.trainable_weights
                gradients = [v.value.grad for v in variables]
                with torch.no_grad():
                    model.optimizer.apply(gradients, variables)
                t4 = time.perf_counter()
            for part, seconds in zip(TORCH_PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[row][part].append(seconds)
    return {
        row: {part: float(np.median(ts)) * 1e3 for part, ts in parts.items()}
        for row, parts in times.items()
    }


def print_breakdown(backend, breakdown, med, eager_torch):
    """The `--breakdown` tables (jax, eager torch) or why there is none."""
    if eager_torch:
        print(
            "\ntorch breakdown, the parts of an eager step timed apart, each "
            "round also timing one whole train_on_batch (medians over "
            "interleaved rounds; the rest is train_on_batch's median minus the "
            "parts': Keras's bookkeeping):\n"
        )
        print("| row | " + " ms | ".join(TORCH_PARTS) + " ms | sum | train_on_batch ms | rest ms |")
        print("|---|" + "---|" * (len(TORCH_PARTS) + 3))
        for row, parts in breakdown.items():
            total = sum(parts[p] for p in TORCH_PARTS)
            cells = [f"{parts[p]:.2f}" for p in TORCH_PARTS]
            step = parts["train_on_batch"]
            print(f"| {row} | {' | '.join(cells)} | {total:.2f} | {step:.2f} | {step - total:.2f} |")
        return
    if backend != "jax":
        print("\n(--breakdown is implemented on jax and on eager torch only)")
        return
    print(
        "\njax breakdown, each part jitted on its own (medians; the fused "
        "train step can differ from the sum):\n"
    )
    print("| row | forward+backward ms | optimizer update ms | sum | train_on_batch ms |")
    print("|---|---|---|---|---|")
    for row, (fb, op) in breakdown.items():
        print(f"| {row} | {fb:.2f} | {op:.2f} | {fb + op:.2f} | {med[row] * 1e3:.2f} |")


def target_text(row, backend, ratio):
    if row not in TARGETS:
        return "", ""
    bounds = TARGETS[row]
    bound = bounds.get(backend, bounds.get(None))
    if bound is None:
        return "", ""
    where = "" if None in bounds else f" on {backend}"
    return f"<= {bound:.2f}x{where}", "met" if ratio <= bound else "NOT met"


def describe(model_name, args, batch_size):
    if model_name == "mlp":
        return (
            f"MLP {args.mlp_input} -> "
            + " -> ".join([f"Dense({args.mlp_width}, relu)"] * args.mlp_depth)
            + f" -> Dense({args.mlp_classes}), batch {batch_size}"
        )
    if model_name in HUB_MODELS:
        kind = "GPT2CausalLM" if model_name == "gpt2-hub" else "LlamaCausalLM"
        return (
            f"keras-hub {kind} vocab {args.vocab}, seq {args.seq_len}, d {args.d_model}, "
            f"{args.heads} heads, {args.layers} layers, batch {batch_size} (scaled rows: "
            f"`ksc.scalify` of the Keras model)"
        )
    attention = (
        "Keras MHA on its fused dot_product_attention path"
        if args.keras_attention == "fused"
        else "Keras MHA on its explicit path, as ScaledMultiHeadAttention"
    )
    return (
        f"GPT vocab {args.vocab}, seq {args.seq_len}, d {args.d_model}, "
        f"{args.heads} heads, {args.layers} layers, tied output projection, "
        f"batch {batch_size} ({attention})"
    )


def run_model(model_name, args):
    """Builds, warms up and times every row; prints the table. Returns
    `{row: (ms per step or None, ratio or None)}`."""
    backend = keras.config.backend()
    batch_size = args.batch_size or (128 if model_name == "mlp" else 16)
    x, y = batch(model_name, args, batch_size)
    rows = [r for r in ROWS if args.rows is None or r[0] in args.rows]
    route_of = {r[0]: ROUTES.get(r[0], args.fp8_route) for r in rows}
    models, errors, unbuilt_notes, taken, first = {}, {}, {}, {}, {}
    for row, kind, policy, _ in rows:
        with fp8.fp8_route(route_of[row]):
            try:
                model = build(model_name, kind, policy, args)
                t0 = time.perf_counter()
                model.train_on_batch(x, y)  # compiles: a failure shows here
                first[row] = time.perf_counter() - t0
                models[row] = model
            except Exception as e:  # a row that cannot run is reported
                errors[row] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                continue
            taken[row] = fp8_routes_taken(model)
            unbuilt_layers = unbuilt(model)
            if unbuilt_layers:
                unbuilt_notes[row] = (unbuilt_layers, rebuild_cost(model, x, y, args))
    med, losses, faults, by_round = time_rows(models, x, y, args.steps, args.warmup - 1, args.rounds, route_of)
    breakdown = {}
    if args.breakdown and backend == "jax":
        for row, model in models.items():
            with fp8.fp8_route(route_of[row]):
                breakdown[row] = jax_breakdown(model, x, y, max(args.steps // 2, 3))
    eager_torch = backend == "torch" and args.jit_compile is not True
    if args.breakdown and eager_torch:
        breakdown = torch_breakdown(models, x, y, max(args.steps // 2, 3), route_of)
    op_counts = {}
    if args.op_count and backend == "torch":
        for row, model in models.items():
            with fp8.fp8_route(route_of[row]):
                op_counts[row] = torch_op_count(model, x, y, args.scalar_path)
    base = models.get("Keras float32") or next(iter(models.values()), None)
    params = keras_params(base) if base is not None else "?"
    print(
        f"\n### {describe(model_name, args, batch_size)}: {params} parameters, Adam\n\n"
        f"backend: {backend}; device: {device_name()}{threads_text()}; "
        f"jit_compile={args.jit_compile}; "
        f"heap: {'kept (--keep-heap)' if args.keep_heap else 'C library default'}; "
        f"keras {keras.__version__}; "
        f"median of {args.steps} train_on_batch steps per row ({args.rounds} "
        f"interleaved rounds, after >= {args.warmup} warm-up steps incl. compilation; "
        f"ratios: median of the per-round ratios)\n"
    )
    print(
        "| row | ms/step | ratio vs Keras counterpart | target | met | FP8 GEMM route "
        "| page faults/step | first step (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for row, _, _, counterpart in rows:
        if row in errors:
            print(f"| {row} | failed | {errors[row]} | | | | | |")
            results[row] = (None, None)
            continue
        ms = med[row] * 1e3
        ratio, target, met = None, "", ""
        if counterpart is None:
            ratio_text = "baseline"
        elif counterpart in med:
            ratio = paired_ratio(by_round, row, counterpart)
            ratio_text = f"{ratio:.2f}x {counterpart}"
            target, met = target_text(row, backend, ratio)
            if row.startswith("scaled_fp8") and BF16_ROW in med:
                ratio_text += f"; {paired_ratio(by_round, row, BF16_ROW):.2f}x {BF16_ROW}"
        else:
            ratio_text = f"n/a ({counterpart} did not run)"
        results[row] = (ms, ratio)
        route = ", ".join(taken.get(row, []))
        fault_text = "n/a" if faults.get(row) is None else f"{faults[row]:.0f}"
        print(
            f"| {row} | {ms:.2f} | {ratio_text} | {target} | {met} | {route} | {fault_text} "
            f"| {first[row]:.2f} |"
        )
    for row, (names, (before, after)) in unbuilt_notes.items():
        print(
            f"\nnote ({row}): {len(names)} sublayer(s) stay unbuilt after training "
            f"({', '.join(sorted(set(names)))}); Keras's jax and torch trainers "
            f"(and TensorFlow's under a distribution strategy) then re-trace the "
            f"model symbolically (`_symbolic_build`) before every train_on_batch: "
            f"{before:.0f} ms/step before vs {after:.0f} ms/step after marking them "
            + (
                "built; the table times them as is (--keep-unbuilt)."
                if args.keep_unbuilt
                else "built, which the table uses (steady state; pass --keep-unbuilt "
                "to time them as is)."
            )
        )
    bad = [
        row
        for row, loss in losses.items()
        if not np.all(np.isfinite(np.asarray(loss, dtype=np.float64)))
    ]
    if bad:
        print(f"\nnon-finite loss in: {', '.join(bad)}")
    if args.breakdown:
        print_breakdown(backend, breakdown, med, eager_torch)
    if args.op_count:
        if backend != "torch":
            print("\n(--op-count is implemented on torch only)")
        else:
            print(
                f"\naten operators per train_on_batch (torch.profiler, one step; "
                f"scale path: {args.scalar_path}):\n"
            )
            gpu = any(len(c) > 3 for c in op_counts.values())
            extra = " kernel launches | host waits for the device | GPU kernel ms |" if gpu else ""
            print("| row | aten operators | 0-d tensor ops | synchronizing reads |" + extra)
            print("|---|---|---|---|" + ("---|---|---|" if gpu else ""))
            for row, counts in op_counts.items():
                print("| " + " | ".join([row, *map(str, counts)]) + " |")
    return results


# CUDA runtime calls that launch a kernel, and those that make the host
# wait for the device (a `.item()`, a copy from or to pageable memory).
CUDA_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


SCALAR_PATHS = {
    "auto": contextlib.nullcontext,
    "host-reads-off": S.host_reads_disabled,
    "tensor-ops": S.memo_disabled,
}


def torch_op_count(model, x, y, scalar_path="auto"):
    """Counts of one `train_on_batch` on the scale path `scalar_path`
    (`SCALAR_PATHS`, after 3 steps on it): `[aten operators (torch.profiler),
    operators returning a 0-d tensor, synchronizing reads]` of one step
    each, and on a GPU also kernel launches, host waits for the device and
    the GPU's kernel time in ms (eager torch on a GPU is bound by the host
    when every scale computation is a kernel launch)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ScalarOps.count += type(out) is torch.Tensor and out.ndim == 0
            return out

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with SCALAR_PATHS[scalar_path]():
        for _ in range(3):
            model.train_on_batch(x, y)
        with profile(activities=activities) as prof:
            model.train_on_batch(x, y)
            if cuda:
                torch.cuda.synchronize()
        reads = S.synchronizing_reads()
        with ScalarOps():
            model.train_on_batch(x, y)
        reads = S.synchronizing_reads() - reads
    events = prof.key_averages()
    counts = [sum(e.count for e in events if e.key.startswith("aten::")), ScalarOps.count, reads]
    if cuda:
        counts.append(sum(e.count for e in events if e.key in CUDA_LAUNCHES))
        counts.append(sum(e.count for e in events if e.key in CUDA_SYNCS))
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        counts.append(round(sum(e.self_device_time_total for e in kernels) / 1e3, 2))
    return counts


def threads_text():
    if keras.config.backend() != "torch":
        return ""
    import torch

    return f", torch threads {torch.get_num_threads()}"


def keras_params(model):
    return sum(int(np.prod(v.shape)) for v in model.trainable_variables)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Training-step time, scaled vs Keras")
    p.add_argument(
        "--model", choices=["mlp", "gpt", "both", *HUB_MODELS], default="both",
        help="mlp, gpt, both (default), or a keras-hub causal LM of the GPT's "
        "sizes (gpt2-hub, llama-hub; needs keras-hub)",
    )
    p.add_argument("--steps", type=int, default=40, help="timed steps per row")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per row (>= 1; the first compiles)"
    )
    p.add_argument(
        "--rounds", type=int, default=20,
        help="interleaved timing rounds (each row's ratio pairs it with its "
        "counterpart round by round)",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="default: 128 (MLP), 16 (GPT)"
    )
    p.add_argument(
        "--fp8-route",
        choices=["auto", "native", "simulate"],
        default="auto",
        help="FP8 GEMM route of the scaled_fp8 rows (default: auto, the "
        "backend's native route; the row 'scaled_fp8, simulate route' always "
        "runs the simulation, float32 GEMMs as Keras float8)",
    )
    p.add_argument(
        "--rows", nargs="+", default=None, choices=[r[0] for r in ROWS], metavar="ROW",
        help="run only these rows (quoted names, e.g. 'Keras float32' scaled_float32)",
    )
    p.add_argument(
        "--keep-unbuilt", action="store_true",
        help="time models whose stateless sublayers stay unbuilt as they are "
        "(Keras then re-traces the model on every train_on_batch)",
    )
    p.add_argument(
        "--breakdown", action="store_true",
        help="jax and eager torch: also time the parts of a step apart",
    )
    p.add_argument(
        "--op-count", action="store_true",
        help="torch only: also count the aten operators of one train_on_batch per row",
    )
    p.add_argument(
        "--scalar-path", choices=list(SCALAR_PATHS), default="auto",
        help="--op-count's scale path: the device's own, a GPU's on a CPU "
        "(host-reads-off), or no memo and no host value (tensor-ops)",
    )
    p.add_argument(
        "--jit-compile", action="store_true", default="auto",
        help="compile every row with `model.compile(jit_compile=True)` (torch: "
        "torch.compile through Keras; compile time and recompiles fall in the "
        "warm-up steps). Default: Keras's 'auto'",
    )
    p.add_argument(
        "--keep-heap", action="store_true",
        help="glibc only: keep freed memory in the heap for the whole run, "
        "every row alike (mallopt: no heap trimming, no mmap below 32 MB), so "
        "that steps reuse pages as a caching allocator does instead of "
        "page-faulting fresh ones (the page faults/step column)",
    )
    p.add_argument(
        "--torch-threads", type=int, default=1,
        help="torch only: torch.set_num_threads for every row (default 1: on a "
        "shared CPU, torch's 2+ OpenMP threads spin-wait and make the timings "
        "erratic; 0 keeps torch's own choice)",
    )
    p.add_argument("--mlp-input", type=int, default=784)
    p.add_argument("--mlp-width", type=int, default=1024)
    p.add_argument("--mlp-depth", type=int, default=2)
    p.add_argument("--mlp-classes", type=int, default=10)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--keras-attention", choices=["explicit", "fused"], default="explicit",
        help="Keras MHA path of the Keras GPT rows: 'explicit' (scores "
        "materialized, the computation ScaledMultiHeadAttention does; default) "
        "or 'fused' (ops.dot_product_attention; under mixed_float16 it fails "
        "to compile on jax CPU)",
    )
    args = p.parse_args(argv)
    if args.d_model % args.heads:
        p.error("--d-model must be a multiple of --heads")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first step compiles)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.keep_heap:
        keep_heap()
    models = ["mlp", "gpt"] if args.model == "both" else [args.model]
    if not (args.torch_threads and keras.config.backend() == "torch"):
        return {m: run_model(m, args) for m in models}
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        return {m: run_model(m, args) for m in models}
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
