"""Importing keras_scalify after keras-hub models were built: the same
conversion and the same training as importing it first (a layer built
before the import holds the original `keras.ops` functions, e.g.
keras-hub's `activation = ops.silu`)."""

import os
import subprocess
import sys

import keras
import pytest

pytest.importorskip("keras_hub")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import numpy as np, keras, keras_hub
from tests import hub_models as hm

def task():
    return keras_hub.models.LlamaCausalLM(backbone=hm.llama(), preprocessor=None)

x = hm.make_inputs("llama", batch=4)
y = np.random.RandomState(0).randint(0, hm.VOCAB, x["token_ids"].shape)
plain, lm = task(), task()  # both built before keras_scalify is imported
import keras_scalify as ksc
ksc.scalify(lm, dtype="scaled_float32")
for m in (plain, lm):
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=[])
losses = [[float(np.asarray(m.train_on_batch(x, y))) for _ in range(2)] for m in (plain, lm)]
print("LOSSES", losses)
"""


def test_import_after_building_keras_hub_models_trains_the_same():
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(root=ROOT)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("LOSSES"))
    plain, scaled = eval(line[len("LOSSES"):])
    # scaled_float32 computes what the plain model does: every factor a
    # power of two (the optimizer wrapped in ScaledOptimizer by compile).
    for a, b in zip(plain, scaled):
        assert abs(a - b) <= 1e-5 * abs(a)
