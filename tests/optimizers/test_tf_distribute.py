"""TensorFlow's `tf.distribute` is refused with a clear error (in a
subprocess: logical CPU devices are fixed when TensorFlow starts)."""

import os
import subprocess
import sys

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="tf.distribute is TensorFlow's"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np
import keras_scalify as ksc
x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    model = ksc.scalify(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), dtype="scaled_fp16")
    model.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
try:
    model.fit(x, y, verbose=0)
except ValueError as e:
    print("REFUSED", e)
"""


def test_mirrored_strategy_is_refused_naming_the_alternative():
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(root=ROOT)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED ScaledOptimizer does not support tf.distribute (running under MirroredStrategy)" in out.stdout
    assert "keras.distribution" in out.stdout
