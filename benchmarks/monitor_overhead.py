"""Step time of `fit` with and without `ksc.callbacks.ScaleMonitor`.

An MLP (784 -> 1024 -> 1024 -> 10, the examples/mnist.py default) under
"scaled_fp8" with `ScaledOptimizer(SGD)`, batch 128, synthetic data.
Each configuration first fits `--warmup` steps (compilation; the monitor
records its first step there), then `--steps` steps are timed; the
monitor records every `--every` steps (with a 128-example sample batch:
weights, activations and gradients). Configurations alternate `--repeats`
times and the fastest timed run of each is kept.

    KERAS_BACKEND=jax python benchmarks/monitor_overhead.py
"""

import argparse
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

# The repository (keras_scalify) and this folder (fp8_matmul.cpu_model).
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import keras_scalify as ksc  # noqa: E402
from fp8_matmul import cpu_model  # noqa: E402


def build(width):
    keras.utils.set_random_seed(0)
    plain = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model = ksc.scalify(plain, dtype="scaled_fp8")
    model.compile(
        optimizer=ksc.ScaledOptimizer(keras.optimizers.SGD(0.05), seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    n = args.batch_size * args.steps
    x = rng.uniform(0, 1, (n, 784)).astype("float32")
    y = rng.integers(0, 10, n).astype("int32")
    sample = (x[: args.batch_size], y[: args.batch_size])
    runs = {}
    for name in ("without", "with"):
        model = build(args.width)
        cbs = []
        if name == "with":
            monitor = ksc.callbacks.ScaleMonitor(every=args.every, sample=sample)
            cbs = [monitor]
        model.fit(x[: args.batch_size * args.warmup], y[: args.batch_size * args.warmup],
                  batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False, callbacks=cbs)
        runs[name] = (model, cbs)
    best = {k: float("inf") for k in runs}
    records = 0
    for _ in range(args.repeats):
        for name, (model, cbs) in runs.items():
            before = len(cbs[0].history["step"]) if cbs else 0
            t = time.perf_counter()
            model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0,
                      shuffle=False, callbacks=cbs)
            best[name] = min(best[name], (time.perf_counter() - t) / args.steps)
            if cbs:
                records = len(cbs[0].history["step"]) - before
    ratio = best["with"] / best["without"]
    print(f"backend {keras.backend.backend()}, CPU: {cpu_model()} ({os.cpu_count()} cores)")
    print(f"MLP 784-{args.width}-{args.width}-10, scaled_fp8, batch {args.batch_size}, "
          f"{args.steps} timed steps, ScaleMonitor(every={args.every}) "
          f"({records} records in a timed run)")
    print("| | step time (ms) |\n|---|---|")
    print(f"| without monitor | {best['without'] * 1e3:.2f} |")
    print(f"| with monitor | {best['with'] * 1e3:.2f} |")
    print(f"| ratio | {ratio:.3f} (overhead {100 * (ratio - 1):+.1f}%) |")


if __name__ == "__main__":
    main()
