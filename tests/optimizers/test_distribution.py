"""Scaled keras-hub causal LMs under `keras.distribution` (jax, 8 virtual
CPU devices, in a subprocess: the device count is fixed when jax starts):
`ModelParallel` with the backbone's own `get_layout_map` and
`DataParallel` train as one device does, and `ScaledOptimizer`'s slots
are sharded as their weights are (scales and grad scales replicated);
`scalify` of a distributed model outside the distribution's scope is
refused with the fix; a model saved from a sharded run loads on one
device and resumes training as the sharded one goes on."""

import json
import os
import subprocess
import sys

import keras
import pytest

pytest.importorskip("keras_hub")
pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="keras.distribution runs on jax (Keras 3.15)"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
import numpy as np, keras, keras_hub
import keras_scalify as ksc

family, policy = {family!r}, {policy!r}
backbones = {{"llama": keras_hub.models.LlamaBackbone, "gemma": keras_hub.models.GemmaBackbone,
             "qwen": keras_hub.models.QwenBackbone}}
tasks = {{"llama": keras_hub.models.LlamaCausalLM, "gemma": keras_hub.models.GemmaCausalLM,
         "qwen": keras_hub.models.QwenCausalLM}}
# (Sizes that the mesh's 4 "model" devices divide.)
config = dict(vocabulary_size=128, num_layers=2, num_query_heads=4, num_key_value_heads=2,
              hidden_dim=64, intermediate_dim=128)
if family == "gemma":  # (its layout map shards the key/value heads too)
    config.update(head_dim=16, num_key_value_heads=4)
rs = np.random.RandomState(0)
x = {{"token_ids": rs.randint(0, 128, (8, 16)).astype("int32"),
     "padding_mask": np.ones((8, 16), "int32")}}
y = rs.randint(0, 128, (8, 16)).astype("int32")


def train():
    keras.utils.set_random_seed(0)
    lm = tasks[family](backbone=backbones[family](**config), preprocessor=None)
    ksc.scalify(lm, dtype=policy)
    lm.compile(optimizer=keras.optimizers.AdamW(1e-3), weighted_metrics=[],
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return lm, [float(np.ravel(lm.train_on_batch(x, y))[0]) for _ in range(3)]


def specs(variables):
    out = []
    for v in variables:
        sharding = v.value.sharding
        if not sharding.is_fully_replicated:
            out.append((v.value.ndim, str(sharding.spec)))
    return sorted(out)


devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
out = {{"devices": len(devices)}}
_, out["one"] = train()
with keras.distribution.DataParallel(devices=devices).scope():
    _, out["data"] = train()
layout_map = backbones[family].get_layout_map(mesh)
with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    lm, out["model"] = train()
out["weights"] = specs(lm.trainable_variables)
out["slots"] = specs(lm.optimizer.variables)
out["scalars_sharded"] = [v.path for v in lm.variables + lm.optimizer.variables
                          if v.value.ndim < 2 and not v.value.sharding.is_fully_replicated]
# Saved from the sharded run, loaded on one device: the same weights, and
# training resumes with the losses the sharded model goes on with.
path = {path!r}
lm.save(path)
with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    out["resumed_sharded"] = [float(np.ravel(lm.train_on_batch(x, y))[0]) for _ in range(2)]
loaded = keras.saving.load_model(path)
out["loaded_sharded"] = specs(loaded.variables)
out["resumed_loaded"] = [float(np.ravel(loaded.train_on_batch(x, y))[0]) for _ in range(2)]
# Built under the distribution, converted outside its scope: refused.
with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
    lm = tasks[family](backbone=backbones[family](**config), preprocessor=None)
try:
    ksc.scalify(lm, dtype=policy)
except ValueError as e:
    out["outside"] = str(e)
print("RESULT" + json.dumps(out))
"""

# A step's losses under a distribution: the same GEMMs on shards of the
# batch or of the weights, whose sums XLA may order differently.
RTOL = {"scaled_float32": 1e-5, "scaled_fp16": 1e-3, "scaled_fp8": 1e-3}


# (Each case trains three models in a subprocess, ~40 s on 2 cores: the
# suite runs the first, `KSC_DISTRIBUTION=all` all three.)
CASES = [("gemma", "scaled_fp8"), ("llama", "scaled_float32"), ("qwen", "scaled_fp16")]


@pytest.mark.parametrize("family, policy", CASES)
def test_model_and_data_parallel_train_as_one_device(family, policy, tmp_path):
    if (family, policy) != CASES[0] and os.environ.get("KSC_DISTRIBUTION") != "all":
        pytest.skip("KSC_DISTRIBUTION=all runs it (suite time)")
    env = dict(
        os.environ, KERAS_BACKEND="jax",
        # (8 devices on 2 busy cores: a device may reach a collective
        # long after the others, past XLA's CPU default timeout.)
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        " --xla_cpu_collective_timeout_seconds=900"
        " --xla_cpu_collective_call_terminate_timeout_seconds=900",
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(root=ROOT, family=family, policy=policy, path=str(tmp_path / "lm.keras"))],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["devices"] == 8
    for mode in ("data", "model"):
        assert out[mode] == pytest.approx(out["one"], rel=RTOL[policy]), (mode, out)
    # Kernels sharded over "model"; each of their Adam slots (two per
    # weight) sharded as its weight; no scale, grad scale or counter sharded.
    sharded = [w for w in out["weights"] if "model" in w[1]]
    assert len(sharded) >= 7, out["weights"]
    assert out["slots"] == sorted(out["weights"] * 2), out
    assert out["scalars_sharded"] == []
    assert "inside the same distribution's scope" in out.get("outside", ""), out.get("outside")
    assert out["loaded_sharded"] == []
    assert out["resumed_loaded"] == pytest.approx(out["resumed_sharded"], rel=RTOL[policy])
