"""Watching scales during training: `ksc.callbacks.ScaleMonitor` and
`ksc.plot.scales` on a real run.

Trains an MNIST MLP (784 -> 256 -> 256 -> 10, ReLU) under "scaled_fp8"
(E4M3 forward / E5M2 backward GEMMs, float16 data) with
`ksc.ScaledOptimizer(SGD(0.1))`, records every `--every` steps with a
256-image sample batch, writes the figure and the history, and prints the
last record as a table.

`--inject` puts a fault in: a layer after the first hidden layer that
multiplies its data by 2^8 (its scale by 2^-8, so the represented values
are unchanged): the next GEMM's E4M3 input then saturates (|data| > 448)
for the larger activations, which the monitor shows, and training loses
some accuracy.

Run (from the repository root; the README figure):

    KERAS_BACKEND=jax python examples/monitor.py --inject

Options: --steps-per-epoch / --epochs / --every / --out (figure path,
default docs/figures/scale_monitor.png) / --log-dir (CSV, JSON).
Data: `../shared/data/mnist` (see examples/mnist.py), else
`keras.datasets.mnist`.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import keras_scalify as ksc  # noqa: E402
from examples.mnist import load_mnist  # noqa: E402


class ShiftData(ksc.layers.ScaledLayer):
    """The injected fault: data × 2^shift, scale × 2^-shift (the value and
    its gradient unchanged; only the data's range moves)."""

    def __init__(self, shift=8, **kwargs):
        super().__init__(**kwargs)
        self.shift = shift

    def call(self, inputs):
        k = 2.0**self.shift
        data = keras.ops.cast(keras.ops.cast(inputs.data, "float32") * k, inputs.data.dtype)
        return ksc.ScaledTensor(data, inputs.scale / k, inputs.grad_scale * k)


def build(width, inject, seed=0):
    keras.utils.set_random_seed(seed)
    plain = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(width, activation="relu", name="dense_0"),
            keras.layers.Dense(width, activation="relu", name="dense_1"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="mlp",
    )
    model = ksc.scalify(plain, dtype="scaled_fp8")
    if inject:
        # The same model from scaled layers, the fault after dense_0.
        fp8 = {"dtype": "scaled_fp8"}
        injected = keras.Sequential(
            [
                keras.Input((784,)),
                ksc.layers.ScaledDense(width, activation="relu", name="dense_0", **fp8),
                ShiftData(8, name="injected", **fp8),
                ksc.layers.ScaledDense(width, activation="relu", name="dense_1", **fp8),
                ksc.layers.ScaledDense(10, name="logits", **fp8),
            ],
            name="mlp_injected",
        )
        for name in ("dense_0", "dense_1", "logits"):
            injected.get_layer(name).set_weights(model.get_layer(name).get_weights())
        model = injected
    model.compile(
        optimizer=ksc.ScaledOptimizer(keras.optimizers.SGD(0.1), seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def table(monitor):
    """The last record, one row per layer, as markdown."""
    h = monitor.history
    cols = [
        ("kernel/scale_exp", "kernel 2^"),
        ("kernel/grad_scale_exp", "kernel grad 2^"),
        ("input/saturation", "input sat. (E4M3)"),
        ("output/scale_exp", "output 2^"),
        ("output/rms", "output data RMS"),
        ("grad/scale_exp", "grad 2^"),
        ("grad/underflow", "grad underflow (E5M2)"),
    ]
    lines = [
        f"step {int(h['step'][-1])}, loss {h['loss'][-1]:.4f}, "
        f"skipped steps {int(h['skipped_steps'][-1])}",
        "",
        "| layer | " + " | ".join(c[1] for c in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for layer in monitor.layers:
        cells = []
        for key, _ in cols:
            v = h.get(f"{layer}/{key}")
            if v is None:
                cells.append("")
            elif key.endswith(("saturation", "underflow")):
                cells.append(f"{v[-1]:.2%}")
            elif key.endswith("rms"):
                cells.append(f"{v[-1]:.3g}")
            else:
                cells.append(f"{int(v[-1])}")
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--inject", action="store_true", help="add the saturating layer")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--train-size", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--out", default=str(REPO_ROOT / "docs" / "figures" / "scale_monitor.png"))
    p.add_argument("--log-dir", default=None)
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)

    x_tr, y_tr, x_te, y_te, source = load_mnist(args.data_dir)
    x_tr, y_tr = x_tr[: args.train_size], y_tr[: args.train_size]
    model = build(args.width, args.inject)
    monitor = ksc.callbacks.ScaleMonitor(
        every=args.every, sample=(x_tr[:256], y_tr[:256]), log_dir=args.log_dir,
        tensorboard=False,
    )
    t = time.time()
    model.fit(
        x_tr, y_tr, batch_size=args.batch_size, epochs=args.epochs,
        shuffle=True, verbose=2, callbacks=[monitor],
    )
    seconds = time.time() - t
    _, acc = model.evaluate(x_te, y_te, verbose=0)
    print(
        f"\nbackend {keras.backend.backend()}, data {source}, {len(x_tr)} images, "
        f"{args.epochs} epochs, {len(monitor.trace['step'])} steps, "
        f"{len(monitor.history['step'])} records (every {args.every}); "
        f"test accuracy {acc:.4f}; {seconds:.1f} s\n"
    )
    print(table(monitor))
    title = "MNIST MLP, scaled_fp8" + (", injected data x 2^8 after dense_0" if args.inject else "")
    fig = ksc.plot.scales(monitor, title=title)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"\nfigure: {args.out}")


if __name__ == "__main__":
    main()
