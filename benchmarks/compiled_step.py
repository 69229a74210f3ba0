"""The whole compiled training step of a keras-hub Llama, counted.

    KERAS_BACKEND=jax python benchmarks/compiled_step.py [--d-model 1024]
        [--layers 4] [--heads 16] [--seq-len 512] [--batch-size 4]
        [--vocab 8192] [--rows ...] [--sweep-layers 1 2 4 8]
    KERAS_BACKEND=torch python benchmarks/compiled_step.py --torch ...

jax: for each row the training step Keras's trainer compiles
(`model.train_step` on the trainable, non-trainable, optimizer and metric
variables: forward, backward and the AdamW update) is lowered and compiled
by XLA, and the script prints:

- seconds to trace and lower the step (Python: Keras's and the rules'),
  and to compile it (`lowered.compile()`: XLA);
- kernels: the instructions of the optimized HLO's entry computation that
  a device launches (not parameters, constants, tuples, bitcasts), with
  the bodies of `while` loops once and the largest branch of a
  `conditional`; and of them, those with a scalar (rank-0) output: scale
  bookkeeping;
- bytes accessed and FLOPs (XLA's cost analysis), temporary memory
  (`memory_analysis().temp_size_in_bytes`);
- the share of dot FLOPs whose operands are FP8 / 16-bit / float32, from
  the HLO before optimization (what a GPU multiplies: on a CPU, XLA runs
  every dot in float32 after optimization).

Rows: Keras `mixed_bfloat16`; Keras float8 (`quantize("float8")` on the
bfloat16 model); keras_scalify `scaled_bf16` and `scaled_fp8` (`scalify`
of the float32 model, `ScaledOptimizer(AdamW)`). On a CPU the scaled rows
take the GPU's FP8 GEMM route (`jax-dot_general-fp8`), so that the HLO
holds FP8 dots as a GPU's does; on a GPU the step is also timed.
`--sweep-layers` prints the compile seconds of each row against the
number of layers.

torch (`--torch`): the train step with `jit_compile=True` (Keras's
`torch.compile` of it): graph breaks by `torch._dynamo.explain`, with
those whose frames are in keras_scalify counted apart, and the seconds
of the first step (compile) against a compiled step.
"""

import argparse
import os
import platform
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_scalify as ksc  # noqa: E402

ROWS = ("Keras mixed_bfloat16", "Keras float8", "scaled_bf16", "scaled_fp8")

# Optimized-HLO instructions that launch nothing.
_NOT_KERNELS = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast",
    "after-all", "partition-id", "replica-id",
}


def build(row, args, layers):
    """The compiled keras-hub LlamaCausalLM of `row`, and a batch."""
    import keras_hub

    keras.utils.set_random_seed(0)
    policy = "mixed_bfloat16" if row.startswith("Keras") else "float32"
    keras.config.set_dtype_policy(policy)
    try:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=args.vocab,
            num_layers=layers,
            num_query_heads=args.heads,
            num_key_value_heads=args.heads,
            hidden_dim=args.d_model,
            intermediate_dim=4 * args.d_model,
            dropout=0,
        )
        lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    finally:
        keras.config.set_dtype_policy("float32")
    rs = np.random.RandomState(0)
    x = {
        "token_ids": rs.randint(0, args.vocab, (args.batch_size, args.seq_len)).astype("int32"),
        "padding_mask": np.ones((args.batch_size, args.seq_len), "int32"),
    }
    y = rs.randint(0, args.vocab, (args.batch_size, args.seq_len)).astype("int32")
    optimizer = keras.optimizers.AdamW(1e-4)
    if row == "Keras float8":
        lm.quantize("float8")
    elif row.startswith("scaled"):
        ksc.scalify(lm, dtype=row)
        optimizer = ksc.ScaledOptimizer(optimizer)
    lm.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
        jit_compile=args.torch,
    )
    lm.optimizer.build(lm.trainable_variables)
    return lm, x, y


# --- jax --------------------------------------------------------------------


def lower_step(lm, x, y):
    """`jax.jit(model.train_step)` lowered on the model's state (as Keras's
    jax trainer calls it)."""
    import jax

    lm._symbolic_build(data_batch=(x, y, None))
    state = lm._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
        purge_model_variables=False,
    )
    return jax.jit(lm.train_step).lower(state, (x, y, None))


def _computations(hlo):
    """`{name: [instruction lines]}` of an HLO module's text, and the
    entry computation's name."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None and "=" in line:
            comps[current].append(line.strip())
    return comps, entry


_INSTRUCTION = re.compile(r"^(ROOT\s+)?%?[\w.\-]+\s*=\s*(\([^)]*\)|\S+)\s+([\w\-]+)\(")


def kernel_counts(hlo):
    """`(kernels, scalar-output kernels)` of optimized HLO text (module
    docstring)."""
    comps, entry = _computations(hlo)

    def count(name, seen):
        kernels = scalars = 0
        for line in comps.get(name, []):
            m = _INSTRUCTION.match(line)
            if m is None:
                continue
            shape, op = m.group(2), m.group(3)
            if op in _NOT_KERNELS:
                continue
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line)
                if body and body.group(1) not in seen:
                    k, s = count(body.group(1), seen | {body.group(1)})
                    kernels, scalars = kernels + k, scalars + s
                continue
            if op == "conditional":
                branches = re.findall(r"%([\w.\-]+)", line.split("branch_computations=")[-1]) if "branch_computations" in line else []
                best = max((count(b, seen | {b}) for b in branches), default=(0, 0))
                kernels, scalars = kernels + best[0], scalars + best[1]
                continue
            kernels += 1
            scalars += bool(re.fullmatch(r"\w+\[\](\{\})?", shape))
        return kernels, scalars

    return count(entry, {entry})


_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]")
_DOT = re.compile(r"\sdot\(%?([\w.\-]+),\s*%?([\w.\-]+)\).*?lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text):
    return [int(d) for d in text.split(",") if d]


def dot_shares(hlo):
    """`{"fp8": f, "16-bit": f, "float32": f}`: shares of dot FLOPs by
    operand width (both FP8; both 16-bit or narrower; else float32), from
    HLO text before optimization."""
    shapes = {}
    for line in hlo.splitlines():
        m = _DEFINITION.match(line)
        if m:
            shapes[m.group(1)] = (m.group(2), _dims(m.group(3)))
    flops = {"fp8": 0, "16-bit": 0, "float32": 0}
    for line in hlo.splitlines():
        m, d = _DOT.search(line), _DEFINITION.match(line)
        if m is None or d is None or m.group(1) not in shapes or m.group(2) not in shapes:
            continue
        (lhs_type, lhs), (rhs_type, _) = shapes[m.group(1)], shapes[m.group(2)]
        k = int(np.prod([lhs[i] for i in _dims(m.group(3))]))
        n = 2 * int(np.prod(_dims(d.group(3)))) * k
        if lhs_type.startswith("f8") and rhs_type.startswith("f8"):
            flops["fp8"] += n
        elif all(t in ("bf16", "f16") or t.startswith("f8") for t in (lhs_type, rhs_type)):
            flops["16-bit"] += n
        else:
            flops["float32"] += n
    total = sum(flops.values()) or 1
    return {key: v / total for key, v in flops.items()}


def measure_jax(row, args, layers):
    import jax

    from keras_scalify.backend import fp8

    lm, x, y = build(row, args, layers)
    saved = fp8.resolve_route
    if jax.default_backend() == "cpu":
        # The GPU's route: FP8 dots in the HLO (XLA upcasts them on a CPU).
        fp8.resolve_route = lambda *a, **k: "jax-dot_general-fp8"
    try:
        t0 = time.perf_counter()
        lowered = lower_step(lm, x, y)
        lower_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
    finally:
        fp8.resolve_route = saved
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    kernels, scalars = kernel_counts(compiled.as_text())
    out = {
        "row": row,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "kernels": kernels,
        "scalar_kernels": scalars,
        "bytes": float(cost.get("bytes accessed", 0.0)),
        "flops": float(cost.get("flops", 0.0)),
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "dots": dot_shares(lowered.as_text(dialect="hlo")),
        # Weight arrays of the model (a scaled weight's data, scale and
        # grad scale count once).
        "weights": len(lm.trainable_weights)
        - sum(hasattr(v, "_ksc_scaled_variable") for v in lm.trainable_weights) * 2 // 3,
        "step_ms": None,
    }
    if jax.default_backend() == "gpu":
        out["step_ms"] = time_step(lm, x, y, args.steps)
    return out


def time_step(lm, x, y, steps):
    """Median ms of a compiled training step (after one warm-up)."""
    lm.train_on_batch(x, y)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        float(np.asarray(lm.train_on_batch(x, y)))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def print_jax(results):
    base = results[0]
    print(
        "| row | trace and lower (s) | compile (s) | kernels | scalar-output kernels | bytes accessed "
        "| FLOPs | temp memory | dot FLOPs FP8 / 16-bit / f32 | step (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = lambda key: f" ({r[key] / base[key]:.2f}×)" if r is not base and base[key] else ""  # noqa: E731
        d = r["dots"]
        step = "–" if r["step_ms"] is None else f"{r['step_ms']:.2f}"
        print(
            f"| {r['row']} | {r['lower_s']:.1f}{ratio('lower_s')} | {r['compile_s']:.1f}{ratio('compile_s')} "
            f"| {r['kernels']}{ratio('kernels')} | {r['scalar_kernels']} "
            f"| {r['bytes'] / 1e9:.2f} GB{ratio('bytes')} | {r['flops'] / 1e9:.1f} G "
            f"| {r['temp'] / 2**20:.1f} MB{ratio('temp')} "
            f"| {d['fp8']:.0%} / {d['16-bit']:.0%} / {d['float32']:.0%} "
            f"| {step} |",
            flush=True,
        )
    print(f"\n(weight arrays of the model: {base['weights']})")


# --- torch ------------------------------------------------------------------


def measure_torch(row, args, layers):
    import torch

    lm, x, y = build(row, args, layers)
    xs = keras.tree.map_structure(torch.as_tensor, x)
    ys = torch.as_tensor(y)
    t0 = time.perf_counter()
    lm.train_on_batch(x, y)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    lm.train_on_batch(x, y)
    step = time.perf_counter() - t0
    # (After the steps: Keras builds the loss in the first one, which
    # dynamo cannot explain.)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(lm.train_step)((xs, ys, None))
    ours = [
        b
        for b in explanation.break_reasons
        if any("keras_scalify" in getattr(f, "filename", "") for f in b.user_stack)
    ]
    return {
        "row": row,
        "graph_breaks": explanation.graph_break_count,
        "ours": len(ours),
        "reasons": sorted({b.reason.splitlines()[0][:120] for b in ours}),
        "first_s": first,
        "step_s": step,
    }


def print_torch(results):
    print("| row | graph breaks | in keras_scalify | first step (s) | second step (s) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['row']} | {r['graph_breaks']} | {r['ours']} "
            f"| {r['first_s']:.1f} | {r['step_s']:.3f} |",
            flush=True,
        )
    for r in results:
        for reason in r["reasons"]:
            print(f"- {r['row']}: {reason}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (GPU)")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    parser.add_argument("--sweep-layers", type=int, nargs="*", default=[])
    parser.add_argument("--torch", action="store_true", help="torch jit_compile rows")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    backend = keras.backend.backend()
    print(
        f"backend: {backend}; keras {keras.__version__}; python "
        f"{platform.python_version()}; machine: {platform.processor() or platform.machine()}; "
        f"Llama d={args.d_model}, {args.layers} layers, {args.heads} heads, "
        f"seq {args.seq_len}, batch {args.batch_size}, vocab {args.vocab}"
    )
    if args.torch:
        if backend != "torch":
            raise SystemExit("--torch needs KERAS_BACKEND=torch")
        results = [measure_torch(row, args, args.layers) for row in args.rows]
        print_torch(results)
        return results
    if backend != "jax":
        raise SystemExit("the compiled-step counts need KERAS_BACKEND=jax (or --torch)")
    results = [measure_jax(row, args, args.layers) for row in args.rows]
    print_jax(results)
    if args.sweep_layers:
        print("\nTrace-and-lower + compile seconds by number of layers:\n")
        print("| layers | " + " | ".join(args.rows) + " |")
        print("|---|" + "---|" * len(args.rows))
        for n in args.sweep_layers:
            cells = [
                "{lower_s:.1f} + {compile_s:.1f}".format(**measure_jax(row, args, n))
                for row in args.rows
            ]
            print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    return results


if __name__ == "__main__":
    main()
