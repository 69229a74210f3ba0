"""Shared test helpers. Every test runs under the KERAS_BACKEND in force
(tests/run_all.sh runs the suite on jax, tensorflow and torch)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# XLA on a CPU spends most of a scaled model's first step generating code
# (the scale arithmetic fused into many kernels): LLVM's optimization
# level 0 compiles ~30% faster. XLA's own graph passes (where a rewrite
# could change a value) all still run, and code generation keeps IEEE
# semantics at every level (no fast math). Under jax, XLA's elemental
# emitters instead of its MLIR fusion emitters compile another ~35% faster
# (a tiny keras-hub GPT-2's scaled step: 15.5 -> 9.7 s; the jax suite
# 975 -> 586 s), with the same values (FP8 conversions included). Not
# under TensorFlow: its older XLA's elemental emitters round float32 to
# FP8 differently from ml_dtypes (`test_tensorflow_routes_are_compiled_
# with_xla` fails). Set XLA_FLAGS to override.
_XLA_FLAGS = ["--xla_backend_optimization_level=0"]
if os.environ.get("KERAS_BACKEND") == "jax":
    _XLA_FLAGS.append("--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", " ".join(_XLA_FLAGS))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_scalify as ksc  # noqa: E402
from keras_scalify import backend as kb  # noqa: E402


def _full_float32_gemms():
    """On a GPU, float32 GEMMs may run on TF32 tensor cores (jax's default
    precision; cuDNN's convolutions on torch). The tests compare against
    float64 references at float32 tolerances: they ask for full float32."""
    if keras.backend.backend() == "jax":
        import jax

        if jax.devices()[0].platform == "gpu":
            jax.config.update("jax_default_matmul_precision", "highest")
    elif keras.backend.backend() == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


_full_float32_gemms()


def on_gpu():
    """Whether the backend computes on a GPU (the suite runs there too
    when a session is lent one; CI has none)."""
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        return torch.cuda.is_available()
    if backend == "jax":
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def host_scalars():
    """Whether the host reads the scales for free: eager torch on a CPU
    (`backend.scalar.host_value`), where host-known factors take their
    shortcuts (a GEMM's alpha, the GEMM epilogue's GELU). On a GPU a
    scale is a device tensor and the general path runs."""
    return keras.backend.backend() == "torch" and not on_gpu()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(params=["eager", "compiled"])
def run(request):
    """`run(fn, *args)`: call `fn` eagerly or compiled (jax.jit/tf.function)."""

    def call(fn, *args):
        f = kb.jit(fn) if request.param == "compiled" else fn
        return f(*args)

    call.mode = request.param
    return call


def to_np(x):
    """A ScaledTensor or a tensor as a float64 NumPy array of its value."""
    if ksc.is_scaled(x):
        x = ksc.to_array(x)
    return np.asarray(keras.ops.convert_to_numpy(x)).astype(np.float64)


def scale_of(x):
    return float(keras.ops.convert_to_numpy(x.scale))


def grad_scale_of(x):
    return float(keras.ops.convert_to_numpy(x.grad_scale))


def data_of(x):
    return np.asarray(
        keras.ops.convert_to_numpy(keras.ops.cast(x.data, "float32"))
    ).astype(np.float64)


def assert_close(actual, expected, rtol=1e-6, atol_rel=1e-6):
    """`rtol` elementwise, plus an absolute floor relative to max|expected|
    (values that cancel to ~0 cannot meet a pure relative bound)."""
    actual, expected = to_np(actual), to_np(expected)
    floor = atol_rel * max(float(np.max(np.abs(expected), initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=floor)


def rms(x):
    x = np.asarray(x, dtype=np.float64)
    return float(np.sqrt(np.mean(x * x)))


def spy_taken(monkeypatch, module, name):
    """Wraps `module.name` (a function that returns None where it does not
    apply); returns the list, filled as it is called, of whether each call
    applied."""
    original = getattr(module, name)
    taken = []

    def spy(*args):
        out = original(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(module, name, spy)
    return taken
