"""`examples/gpt.py --quick` runs on every backend (a subset of rows keeps
the suite short: FP32, FP8 + FP16 master + FP16 state, and Keras float32)."""

import importlib.util
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    spec = importlib.util.spec_from_file_location("gpt_example", os.path.join(ROOT, "examples", "gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpt_quick(tmp_path, capsys):
    gpt = _load()
    png = os.path.join(tmp_path, "loss.png")
    results = gpt.main(["--quick", "--quiet", "--rows", "0", "4", "keras_fp32", "--plot", png])
    out = capsys.readouterr().out
    assert "| #0 FP32 |" in out and "| #4 + FP16 optimizer state |" in out
    for key in ("0", "4", "keras_fp32"):
        r = results[key]
        assert np.isfinite(r["train"]) and np.isfinite(r["val"]), r
        # 20 steps from ln(256) = 5.55 nats: the loss must have moved down.
        assert r["val"] < 5.2, r
    assert results["4"]["skipped"] is not None
    assert abs(results["4"]["val"] - results["0"]["val"]) < 0.1
    assert os.path.getsize(png) > 0
