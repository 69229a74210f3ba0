"""Training memory (weights + Adam state) and accuracy per row of Table 3.

    KERAS_BACKEND=jax python benchmarks/memory.py [--width 1024] [--depth 4]
                                                  [--skip-training]

Part 1 builds an MLP of `depth` Dense layers of `width` units, builds Adam
on it and counts the bytes of every model variable (data, scales, gradient
scales) and every optimizer variable (slots, their scales, counters) per
represented parameter. Rows:

- Keras float32 and Keras `mixed_bfloat16` (its variables stay float32);
- #1 `scaled_fp16`: FP16 matmuls, FP32 master weights and Adam state;
- #2: + FP16 master weights (scaled, stochastic rounding);
- #4: + FP16 Adam state (each slot float16 data × pow2 scale).

Part 2 (unless --skip-training) trains a 16-64-64-4 tanh MLP regression
with Adam at lr 1e-4 (steps below FP16's resolution of the weights) under
#1, #2, #4 and #2 with round-to-nearest, and prints the final MSE of each
relative to #1 (the test suite asserts #2 and #4 within 1%).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_scalify as ksc  # noqa: E402


def policy(master, state):
    return ksc.ScaledDTypePolicy(
        compute_dtype="float16",
        matmul_dtype="float16",
        grad_dtype="float16",
        master_dtype=master,
        state_dtype=state,
    )


ROWS = [
    ("Keras float32", "float32"),
    ("Keras mixed_bfloat16", "mixed_bfloat16"),
    ("#1 scaled_fp16 (FP32 master, FP32 state)", "scaled_fp16"),
    ("#2 + FP16 master weights", ("float16", "float32")),
    ("#4 + FP16 optimizer state", ("float16", "float16")),
]


def _nbytes(variables):
    return sum(
        int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype).replace("bfloat16", "float16")).itemsize
        for v in variables
    )


def _mlp(width, depth, dtype=None):
    layers = [keras.Input((width,))]
    layers += [keras.layers.Dense(width, dtype=dtype) for _ in range(depth)]
    return keras.Sequential(layers)


def memory_row(spec, width, depth):
    if isinstance(spec, tuple):
        spec = policy(*spec)
    if isinstance(spec, str) and not spec.startswith("scaled_"):
        model = _mlp(width, depth, dtype=spec)
        opt = keras.optimizers.Adam()
    else:
        model = ksc.scalify(_mlp(width, depth), dtype=spec)
        opt = ksc.ScaledOptimizer(keras.optimizers.Adam())
    params = _mlp(width, depth).count_params()
    opt.build(model.trainable_variables)
    weights = _nbytes(model.weights)
    state = _nbytes(opt.variables)
    return params, weights / params, state / params


def regression_loss(spec, stochastic=True, epochs=10):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 16)).astype("float32")
    w1 = rng.standard_normal((16, 32)) / 4
    w2 = rng.standard_normal((32, 4)) / 6
    y = (np.tanh(x @ w1) @ w2).astype("float32")
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="tanh"),
            keras.layers.Dense(64, activation="tanh"),
            keras.layers.Dense(4),
        ]
    )
    model = ksc.scalify(model, dtype=spec)
    opt = ksc.ScaledOptimizer(
        keras.optimizers.Adam(1e-4), stochastic_rounding=stochastic, seed=0
    )
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    return model.evaluate(x, y, verbose=0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    print(f"backend: {keras.config.backend()}")
    print(f"\nAdam, MLP {args.depth} x Dense({args.width}): bytes per parameter")
    print("| row | weights | Adam state | total |")
    print("|---|---|---|---|")
    for name, spec in ROWS:
        params, w, s = memory_row(spec, args.width, args.depth)
        print(f"| {name} | {w:.3f} | {s:.3f} | {w + s:.3f} |")
    print(f"({params} parameters)")
    if args.skip_training:
        return
    print("\nMLP regression, Adam lr 1e-4, 320 steps: final MSE")
    print("| row | MSE | vs #1 |")
    print("|---|---|---|")
    base = regression_loss(policy("float32", "float32"))
    runs = [
        ("#1 FP32 master, FP32 state", base),
        ("#2 FP16 master (stochastic rounding)", regression_loss(policy("float16", "float32"))),
        ("#4 FP16 master + FP16 state", regression_loss(policy("float16", "float16"))),
        (
            "#2 with round-to-nearest",
            regression_loss(policy("float16", "float32"), stochastic=False),
        ),
    ]
    for name, loss in runs:
        print(f"| {name} | {loss:.5f} | {100 * (loss / base - 1):+.2f}% |")


if __name__ == "__main__":
    main()
