"""examples/mnist.py in quick mode on the current KERAS_BACKEND (real MNIST).

Quick mode (4096 training images, width 64, batch 64, one epoch of plain
SGD lr 0.1, tested on 1000 images) reached test accuracies 0.78-0.81 for
every row on jax, tensorflow and torch (CPU); the thresholds below (0.5,
and scaled runs within 0.05 of float32) leave a wide margin.
"""

import gzip
import importlib.util
import math
import os
from pathlib import Path

import keras
import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# The shared data folder sits next to the checkout; a clean clone elsewhere
# (as CI makes) finds it at its usual place or through KSC_MNIST_DIR.
_CANDIDATES = [
    os.environ.get("KSC_MNIST_DIR", ""),
    REPO_ROOT.parent / "shared" / "data" / "mnist",
    "/work/shared/data/mnist",
]
DATA_DIR = next((Path(c) for c in _CANDIDATES if c and Path(c).is_dir()), Path(_CANDIDATES[1]))
ROWS = ("fp32", "mixed_float16", "keras_float8", "scaled_fp16", "scaled_fp8")


def load_example():
    spec = importlib.util.spec_from_file_location("mnist_example", REPO_ROOT / "examples" / "mnist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_read_idx(tmp_path):
    mnist = load_example()
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    header = bytes([0, 0, 0x08, 3]) + np.array(images.shape, ">u4").tobytes()
    with gzip.open(tmp_path / "x-idx3-ubyte.gz", "wb") as f:
        f.write(header + images.tobytes())
    np.testing.assert_array_equal(mnist.read_idx(tmp_path / "x-idx3-ubyte.gz"), images)
    with open(tmp_path / "bad", "wb") as f:
        f.write(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX file"):
        mnist.read_idx(tmp_path / "bad")


@pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"MNIST IDX files not found in {DATA_DIR}")
def test_mnist_quick(capsys):
    mnist = load_example()
    results = mnist.main(["--quick", "--quiet", "--data-dir", str(DATA_DIR)])
    out = capsys.readouterr().out

    assert [r["run"] for r in results] == list(ROWS)
    errors = {r["run"]: r["error"] for r in results if r["error"]}
    assert not errors, errors
    acc = {r["run"]: r["test_accuracy"] for r in results}
    for r in results:
        assert math.isfinite(r["test_accuracy"]) and math.isfinite(r["train_loss"]), r
        assert f"| {r['run']} | {r['test_accuracy']:.4f} |" in out
    for run in ("fp32", "scaled_fp16", "scaled_fp8"):
        assert acc[run] > 0.5, acc
    for run in ("mixed_float16", "keras_float8"):
        assert acc[run] > 0.3, acc  # well above chance (0.1)
    for run in ("scaled_fp16", "scaled_fp8"):
        assert abs(acc[run] - acc["fp32"]) < 0.05, acc
    assert "| run | test accuracy | train loss (last epoch) | wall time (s) |" in out
    assert f"backend {keras.backend.backend()}, width 64, depth 2, epochs 1, batch size 64, seed 0" in out
    assert "command: KERAS_BACKEND=" in out
    # Each run restores the global policy.
    assert keras.config.dtype_policy().name == "float32"
