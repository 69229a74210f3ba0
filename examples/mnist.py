"""MNIST MLP: float32, Keras mixed_float16 / float8, and keras_scalify FP16 / FP8.

Trains the same MLP classifier (784 -> width x depth ReLU -> 10) on real
MNIST in up to five ways, from identical initial weights (per backend), and
prints a markdown table of test accuracy, last-epoch train loss and wall time:

    fp32            plain Keras, float32
    mixed_float16   plain Keras, policy "mixed_float16", NO loss scaling
                    (`compile(..., auto_scale_loss=False)`, so Keras does not
                    wrap the optimizer in a LossScaleOptimizer)
    keras_float8    plain Keras float32 model, `model.quantize("float8")`
                    before compile (Keras' own delayed-scaling FP8 training:
                    E4M3 forward, E5M2 gradients, amax histories)
    scaled_fp16     `ksc.scalify(model, dtype="scaled_fp16")` +
                    `ksc.ScaledOptimizer(<same optimizer>)`
    scaled_fp8      `ksc.scalify(model, dtype="scaled_fp8")` (E4M3 forward /
                    E5M2 backward GEMMs, FP16 master weights) +
                    `ksc.ScaledOptimizer(<same optimizer>)`

Neither scaled run uses loss scaling: the scales are propagated.

Run (any KERAS_BACKEND; from the repository root):

    KERAS_BACKEND=jax python examples/mnist.py                 # all rows, 10 epochs
    KERAS_BACKEND=torch python examples/mnist.py --quick       # smoke run, < 1 min
    python examples/mnist.py --runs fp32 scaled_fp8 --width 512

Defaults: width 1024, depth 2 (784-1024-1024-10), 10 epochs, batch 128,
plain SGD (no momentum) with learning rate 0.1, seed 0. `--init-scale s`
multiplies the standard deviation of Keras' default Dense initializer
(glorot_uniform): the kernels use `VarianceScaling(scale=s**2,
mode="fan_avg", distribution="uniform")`, which is glorot_uniform at s=1;
biases start at zero. `--quick` trains on the first 4096 images for 1
epoch with width 64 and batch size 64 and tests on the first 1000
(explicit flags still override it).

Data: the four IDX files (`train-images-idx3-ubyte.gz`,
`train-labels-idx1-ubyte.gz`, `t10k-images-idx3-ubyte.gz`,
`t10k-labels-idx1-ubyte.gz`) in `--data-dir`; by default
`../shared/data/mnist` next to the repository if it exists, else
`keras.datasets.mnist.load_data()` (which downloads). Pixels are scaled to
[0, 1] float32.

Reference (jax-scalify, `examples/mnist/mnist_classifier_from_scratch*.py`,
jax 0.4.31, CPU, 10 epochs, test accuracy after the last epoch): FP32 0.9772,
Scalify FP16 0.9772, Scalify FP16 + simulated FP8 0.9767. Note that those
runs used a 784-512-512-10 MLP, init 0.1·randn (weights and biases), plain
SGD lr 0.1, batch 128 and a hand-written log-softmax loss; the closest
setting here is `--width 512` (with Keras' glorot init and zero biases).
"""

import argparse
import gzip
import math
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

try:
    import keras_scalify as ksc  # noqa: E402  (installs the "scaled_*" policies)
except ImportError:  # not installed: use the checkout this file is in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import keras_scalify as ksc  # noqa: E402

RUNS = ("fp32", "mixed_float16", "keras_float8", "scaled_fp16", "scaled_fp8")
DEFAULT_LR = {"sgd": 0.1, "adam": 1e-3}
# Quick mode: 4096 = 64 batches of 64, no partial batch (jax and tf.function
# would compile the train step a second time for one).
QUICK = {"width": 64, "epochs": 1, "batch_size": 64, "train_size": 4096, "test_size": 1000}
FULL = {"width": 1024, "epochs": 10, "batch_size": 128, "train_size": None, "test_size": None}
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data" / "mnist"
FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
IDX_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


# --- data ----------------------------------------------------------------------


def read_idx(path):
    """An IDX file (optionally gzipped) as a NumPy array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (magic {raw[:4]!r})")
    dtype, ndim = np.dtype(IDX_DTYPES[raw[2]]), raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    data = np.frombuffer(raw, dtype, count=math.prod(shape), offset=4 + 4 * ndim)
    return data.reshape(shape).astype(dtype.newbyteorder("="))


def _find(data_dir, stem):
    # Both the canonical "train-images-idx3-ubyte" and the "train-images.idx3-ubyte"
    # spelling, gzipped or not.
    for name in (stem, stem.replace("-idx", ".idx")):
        for suffix in (".gz", ""):
            if (data_dir / (name + suffix)).is_file():
                return data_dir / (name + suffix)
    raise FileNotFoundError(f"no {stem}[.gz] in {data_dir}")


def load_mnist(data_dir=None):
    """(x_train, y_train, x_test, y_test): float32 (n, 784) in [0, 1], int32 labels.

    Returns also a string naming the source.
    """
    if data_dir is None and DEFAULT_DATA_DIR.is_dir():
        data_dir = DEFAULT_DATA_DIR
    if data_dir is not None:
        data_dir = Path(data_dir)
        arrays = {k: read_idx(_find(data_dir, stem)) for k, stem in FILES.items()}
        source = str(data_dir)
    else:
        (x_tr, y_tr), (x_te, y_te) = keras.datasets.mnist.load_data()
        arrays = {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te}
        source = "keras.datasets.mnist"
    out = []
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.shape[0] != y.shape[0] or x.shape[1:] != (28, 28):
            raise ValueError(f"unexpected MNIST {split} shapes {x.shape}, {y.shape}")
        out += [x.reshape(len(x), 784).astype("float32") / 255.0, y.astype("int32")]
    return (*out, source)


# --- model and runs --------------------------------------------------------------


def build_model(width, depth, init_scale, seed):
    """784 -> Dense(width, relu) x depth -> Dense(10), under the current policy."""

    def init(i):
        # glorot_uniform is VarianceScaling(1, "fan_avg", "uniform"); the stddev
        # scales with sqrt(scale). Explicit seeds: the same weights every run.
        return keras.initializers.VarianceScaling(
            scale=init_scale**2, mode="fan_avg", distribution="uniform", seed=seed + i
        )

    layers = [keras.Input((784,))]
    for i in range(depth):
        layers.append(
            keras.layers.Dense(width, activation="relu", kernel_initializer=init(i), name=f"dense_{i}")
        )
    layers.append(keras.layers.Dense(10, kernel_initializer=init(depth), name="logits"))
    return keras.Sequential(layers, name="mlp")


def make_optimizer(name, learning_rate):
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate)
    return keras.optimizers.Adam(learning_rate)


def prepare(run, args):
    """The model and the compile keyword arguments of one row."""
    optimizer = make_optimizer(args.optimizer, args.learning_rate)  # fresh each run
    compile_kwargs = {}
    if run == "mixed_float16":
        keras.config.set_dtype_policy("mixed_float16")
    model = build_model(args.width, args.depth, args.init_scale, args.seed)
    if run == "keras_float8":
        # Keras 3 quantizes the built Dense layers in place (float8 training
        # with delayed scaling). Model.quantize calls Dense.quantize("float8")
        # and then re-tracks the torch parameters, which calling the layers'
        # quantize directly would skip; the filter keeps it from warning that
        # the InputLayer has no quantize method.
        model.quantize("float8", filters=lambda layer: isinstance(layer, keras.layers.Dense))
    elif run in ("scaled_fp16", "scaled_fp8"):
        model = ksc.scalify(model, dtype=run)
        optimizer = ksc.ScaledOptimizer(optimizer)
    elif run == "mixed_float16":
        # Keras would otherwise wrap the optimizer in a LossScaleOptimizer.
        compile_kwargs["auto_scale_loss"] = False
    return model, optimizer, compile_kwargs


def train_one(run, args, data):
    x_train, y_train, x_test, y_test = data
    keras.backend.clear_session()
    keras.utils.set_random_seed(args.seed)
    try:
        start = time.perf_counter()
        model, optimizer, compile_kwargs = prepare(run, args)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **compile_kwargs,
        )
        history = model.fit(
            x_train,
            y_train,
            batch_size=args.batch_size,
            epochs=args.epochs,
            shuffle=True,
            verbose=0 if args.quiet else 2,
        )
        _, test_acc = model.evaluate(x_test, y_test, batch_size=1000, verbose=0)
        wall = time.perf_counter() - start
        return {
            "run": run,
            "test_accuracy": float(test_acc),
            "train_loss": float(history.history["loss"][-1]),
            "wall_time": wall,
            "error": None,
        }
    finally:
        keras.config.set_dtype_policy("float32")


# --- command line ----------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=None, help=f"IDX files (default {DEFAULT_DATA_DIR} if present)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="rows to run (default all)")
    p.add_argument("--width", type=int, default=None, help="hidden width (default 1024; 64 with --quick)")
    p.add_argument("--depth", type=int, default=2, help="number of hidden layers (default 2)")
    p.add_argument("--init-scale", type=float, default=1.0, help="multiplier on the glorot_uniform stddev")
    p.add_argument("--optimizer", choices=sorted(DEFAULT_LR), default="sgd", help="default sgd")
    p.add_argument("--learning-rate", type=float, default=None, help="default 0.1 (sgd) / 1e-3 (adam)")
    p.add_argument("--epochs", type=int, default=None, help="default 10; 1 with --quick")
    p.add_argument("--batch-size", type=int, default=None, help="default 128; 64 with --quick")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-size", type=int, default=None, help="first N training images (default all; 4096 with --quick)")
    p.add_argument("--test-size", type=int, default=None, help="first N test images (default all; 1000 with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: 4096/1000 images, width 64, batch 64, 1 epoch")
    p.add_argument("--quiet", action="store_true", help="no per-epoch progress")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LR[args.optimizer]
    return args


def format_table(results, args, n_train, n_test):
    lines = [
        f"backend {keras.backend.backend()}, width {args.width}, depth {args.depth}, "
        f"epochs {args.epochs}, batch size {args.batch_size}, seed {args.seed}, "
        f"{args.optimizer} lr {args.learning_rate:g}, init scale {args.init_scale:g}, "
        f"train/test images {n_train}/{n_test}",
        "",
        "| run | test accuracy | train loss (last epoch) | wall time (s) |",
        "|---|---|---|---|",
    ]
    for r in results:
        if r["error"]:
            lines.append(f"| {r['run']} | failed: {r['error']} | | |")
        else:
            lines.append(
                f"| {r['run']} | {r['test_accuracy']:.4f} | {r['train_loss']:.4f} | {r['wall_time']:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    """Runs the selected rows; returns a list of per-row result dicts."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = f"KERAS_BACKEND={keras.backend.backend()} python examples/mnist.py " + " ".join(
        shlex.quote(a) for a in argv
    )
    print("command:", command.rstrip(), flush=True)
    x_train, y_train, x_test, y_test, source = load_mnist(args.data_dir)
    x_train, y_train = x_train[: args.train_size], y_train[: args.train_size]
    x_test, y_test = x_test[: args.test_size], y_test[: args.test_size]
    print(f"data: {source} ({len(x_train)} train / {len(x_test)} test images)", flush=True)
    data = (x_train, y_train, x_test, y_test)
    results = []
    for run in args.runs:
        print(f"--- {run} ---", flush=True)
        try:
            results.append(train_one(run, args, data))
        except Exception as e:  # keep the other rows; report the failure
            traceback.print_exc()
            results.append({"run": run, "error": f"{type(e).__name__}: {e}".splitlines()[0][:120]})
    print()
    print("command:", command.rstrip())
    print(format_table(results, args, len(x_train), len(x_test)), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(1 if any(r["error"] for r in main()) else 0)
