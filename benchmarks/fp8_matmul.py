"""Throughput of the FP8 GEMM route vs bfloat16 and float32 matmuls.

    KERAS_BACKEND=jax python benchmarks/fp8_matmul.py [--sizes 1024 4096 8192]

Square GEMMs of each size, forward only, each timed after a warm-up call
(compiled with jax.jit / tf.function on those backends). Prints the device
and, per size, milliseconds and TFLOP/s for: float32 `keras.ops.matmul`,
bfloat16 `keras.ops.matmul`, and the forward GEMM of
`keras_scalify.backend.fp8.fp8_gemms` on the route "auto" takes (marked),
the native and the simulated route (E4M3 operands, float32 accumulation).
Each FP8 row rounds its float32 operands to FP8 as a layer does; a route
that rounds apart from its GEMM (torch's `_scaled_mm`, the simulation)
also gets a "GEMM only" row, its GEMM on operands rounded ahead.
On a CPU no route has FP8 arithmetic: jax and TensorFlow's native routes
multiply the FP8 values as bfloat16 (exact, float32 accumulation), faster
than float32 on CPUs with bfloat16 units (the device line says whether this
one has them; "auto" takes those routes only there); FP8 speed itself
needs FP8 hardware.
"""

import argparse
import os
import platform
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

from keras_scalify import backend as kb  # noqa: E402
from keras_scalify.backend import fp8  # noqa: E402


def device_name():
    """The accelerator's name, and its host CPU (an eager step on a GPU
    can be bound by the host); else the CPU's."""
    accelerator = _accelerator_name()
    if accelerator is None:
        return f"CPU ({cpu_model()}, {os.cpu_count()} cores, {_bf16_units()})"
    return f"{accelerator} (host: {cpu_model()}, {os.cpu_count()} cores)"


def _accelerator_name():
    b = keras.config.backend()
    if b == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    if b == "jax":
        import jax

        d = jax.devices()[0]
        if d.platform != "cpu":
            return d.device_kind
    if b == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            return tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
    return None


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (else the machine type)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _bf16_units():
    return "bfloat16 units" if fp8.cpu_has_bfloat16() else "no bfloat16 units"


def _sync(x):
    return ops.convert_to_numpy(ops.sum(ops.cast(x, "float32")))


def time_fn(fn, *args, repeats=3):
    _sync(fn(*args))  # warm-up / compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _sync(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def _forward(gemms):
    """The forward GEMM on float32 operands, with the route's roundings to
    FP8 where it does them apart (`Gemms.quantize`, e.g. torch's
    `_scaled_mm` takes FP8 tensors): timed as a layer runs it."""
    if gemms.quantize is None:
        return gemms.forward
    qa, qb, _ = gemms.quantize
    return lambda a, b: gemms.forward(qa(a), qb(b))


def main(argv=None):
    parser = argparse.ArgumentParser(description="FP8 GEMM throughput")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"backend: {keras.config.backend()}  device: {device_name()}")
    rng = np.random.default_rng(0)
    print(f"{'size':>6} {'route':<28} {'ms':>10} {'TFLOP/s':>8} {'vs f32':>7}")
    for n in args.sizes:
        a = ops.convert_to_tensor(rng.standard_normal((n, n)).astype("float32"))
        b = ops.convert_to_tensor(rng.standard_normal((n, n)).astype("float32"))
        a16, b16 = ops.cast(a, "bfloat16"), ops.cast(b, "bfloat16")
        flops = 2.0 * n**3
        runs = [
            ("float32 matmul", kb.jit(ops.matmul), a, b),
            ("bfloat16 matmul", kb.jit(ops.matmul), a16, b16),
        ]
        taken = set()
        for route in ("auto", "native", "simulate"):
            name, gemms = fp8.fp8_gemms("ak,kn->an", (n, n), (n, n), route=route)
            if name not in taken:  # "auto" is one of the others
                taken.add(name)
                label = f"fp8 {name}" + (" (auto)" if route == "auto" else "")
                runs.append((label, kb.jit(_forward(gemms)), a, b))
                if gemms.quantize is not None:  # the GEMM alone, on operands rounded ahead
                    qa, qb, _ = gemms.quantize
                    runs.append((f"fp8 {name}, GEMM only", kb.jit(gemms.forward), qa(a), qb(b)))
        t32 = None
        for label, fn, x, y in runs:
            t = time_fn(fn, x, y, repeats=args.repeats)
            t32 = t32 or t
            print(f"{n:>6} {label:<28} {t * 1e3:>10.2f} {flops / t / 1e12:>8.3f} {t32 / t:>6.2f}x")


if __name__ == "__main__":
    main()
