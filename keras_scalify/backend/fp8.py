"""FP8 GEMMs behind one dispatch: a route per backend.

`fp8_gemms(equation, a_shape, b_shape, forward_dtype, backward_dtype,
route)` gives the three GEMMs of `einsum(equation, q(a), q(b))`, with `q` a
saturating cast to `forward_dtype` (E4M3), float32 accumulation and float32
outputs; the two backward GEMMs quantize the output cotangent to
`backward_dtype` (E5M2). `keras_scalify.ops.fp8_einsum` runs them under one
custom gradient, with the scale rule's pow2 factors.

Routes (`resolve_route` picks one). `"native"` takes the backend's own
route below; `"auto"` takes it where it is faster than the simulation: on
a GPU, and on a CPU only where the CPU has bfloat16 units (x86 flags
`avx512_bf16` / `amx_bf16`, `cpu_has_bfloat16()`); without them XLA's
bfloat16 GEMM is slower than its float32 GEMM, and `"auto"` takes the
float32 simulation (`simulate` on jax, `tensorflow-xla-f32` on TF).
On a CPU no FP8 tensor is formed: XLA's FP8 conversions take several
times longer there than `core.formats.saturating_round`, which gives the
same float32 values (bit for bit) in float32 arithmetic.
- `jax-dot_general-fp8` (jax on GPU/TPU): `jnp.einsum` on FP8 operands
  with `preferred_element_type=float32`; on GPU the FP8 operands reach
  cuBLASLt.
- `jax-dot_general-bf16` (jax on CPU, native): the operands rounded to
  their FP8 values, cast to bfloat16 (which holds every E4M3 and E5M2
  value exactly), and `jnp.einsum` with `preferred_element_type=float32`.
  Every product of two FP8 values is exact in float32, so this is the
  float32 GEMM of the simulation up to summation order, on the CPU's
  bfloat16 units (AVX512-BF16 / AMX). The forward and input-gradient
  GEMMs; the weight gradient `aᵀg` runs in float32 (see `_route_gemms`).
- `tensorflow-xla` (TF on a GPU): saturating casts to FP8 and back to
  float32 and the einsum in one `jit_compile=True` function (TF supports
  only casts on FP8; XLA rewrites the pattern into an FP8 GEMM on GPUs
  that have one).
- `tensorflow-xla-bf16` (TF on a CPU, native, for the 2-D matrix
  products every Dense GEMM is flattened to): as `jax-dot_general-bf16`,
  with `tf.linalg.matmul(..., output_type=float32)`, in one XLA function.
- `tensorflow-xla-f32` (TF on a CPU otherwise): the simulation's rounding
  and float32 einsum in one XLA function (Keras runs TF without XLA on a
  CPU, where each rounding op would be its own pass).
- `torch-scaled_mm`: `torch._scaled_mm` for 2-D GEMMs (inputs are
  flattened to 2-D), on CUDA with compute capability >= 8.9 and K, N
  multiples of 16; else (and on CPU, where `_scaled_mm` is a slow
  reference kernel) the simulation.
- `simulate`: the operands rounded to their FP8 format (saturating) as
  float32 values, float32 einsum: the reference, on any backend (jax
  rounds with `saturating_round`, TF and torch cast to FP8 and back).
"""

import contextlib
import functools

import keras
import numpy as np
from keras import ops

from keras_scalify.backend.fp8_rounding import _torch_saturating_cast
from keras_scalify.backend.fp8_rounding import quantized_float32
from keras_scalify.backend.gemm import MATMUL_2D
from keras_scalify.backend.gemm import Gemms
from keras_scalify.backend.gemm import as_matmul
from keras_scalify.backend.gemm import einsum_f32
from keras_scalify.backend.gemm import flattened
from keras_scalify.backend.gemm import grad_equations
from keras_scalify.backend.gemm import is_2d
from keras_scalify.backend.gemm import takes_alpha
from keras_scalify.core.formats import saturating_cast
from keras_scalify.core.formats import saturating_round

ROUTES = ("auto", "native", "simulate")
_STATE = {"route": "auto", "last": None}


def set_fp8_route(route):
    """Choose the FP8 GEMM route: "auto", "native" or "simulate"."""
    if route not in ROUTES:
        raise ValueError(f"`route` must be one of {ROUTES}, got {route!r}.")
    _STATE["route"] = route


def get_fp8_route():
    return _STATE["route"]


@contextlib.contextmanager
def fp8_route(route):
    """Context manager form of `set_fp8_route`."""
    previous = get_fp8_route()
    set_fp8_route(route)
    try:
        yield
    finally:
        _STATE["route"] = previous


def last_fp8_route():
    """The route taken by the most recent FP8 GEMM traced or run."""
    return _STATE["last"]


def _torch_route_ok(a_shape, b_shape, equation):
    import torch

    if not hasattr(torch, "_scaled_mm") or _matmul_2d(equation) is None:
        return False
    if len(b_shape) != 2:
        return False
    if not (torch.cuda.is_available() and keras.config.backend() == "torch"):
        # On CPU `_scaled_mm` is a reference kernel: 3.4 s for an E4M3
        # 128x784 @ 784x1024 GEMM on one thread, where the simulation's
        # float32 GEMM takes milliseconds.
        return False
    from keras.src.backend.torch.core import get_device

    if "cuda" not in str(get_device()):
        return False
    major, minor = torch.cuda.get_device_capability()
    k, n = b_shape
    return (major, minor) >= (8, 9) and not (k % 16 or n % 16)


def _matmul_2d(equation):
    """For "...k,kn->...n"-style equations: True; None otherwise."""
    ins, out = equation.replace(" ", "").split("->")
    a, b = ins.split(",")
    if len(b) != 2 or not a or a[-1] != b[0] or out != a[:-1] + b[1]:
        return None
    if b[1] in a or len(set(a)) != len(a):
        return None
    return True


@functools.lru_cache(maxsize=None)
def cpu_has_bfloat16(cpuinfo="/proc/cpuinfo"):
    """Whether the CPU has bfloat16 GEMM units (AVX512-BF16 or AMX-BF16),
    from the flags in `cpuinfo` (False where it cannot be read)."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_route(equation, a_shape, b_shape, route=None):
    """The route name an FP8 einsum with these shapes takes."""
    route = route or get_fp8_route()
    if route not in ROUTES:
        raise ValueError(f"`route` must be one of {ROUTES}, got {route!r}.")
    if route == "simulate":
        return "simulate"
    backend = keras.config.backend()
    if backend == "torch":
        # No CPU route: `_scaled_mm` on CUDA, else the simulation (the CPU
        # flags are not read: under `torch.compile`, dynamo would trace
        # the file read, a graph break per call).
        if _torch_route_ok(a_shape, b_shape, equation):
            return "torch-scaled_mm"
        return "simulate"
    # On a CPU the native routes multiply as bfloat16: only faster than the
    # simulation's float32 GEMM on bfloat16 units.
    cpu_native = route == "native" or cpu_has_bfloat16()
    if backend == "jax":
        import jax

        if jax.default_backend() == "cpu":
            return "jax-dot_general-bf16" if cpu_native else "simulate"
        return "jax-dot_general-fp8"
    if backend == "tensorflow":
        import tensorflow as tf

        if not tf.config.list_physical_devices("GPU"):
            if tf_matmul_flags(equation) and cpu_native:
                return "tensorflow-xla-bf16"
            return "tensorflow-xla-f32"
        return "tensorflow-xla"
    return "simulate"


# --- GEMM implementations (operands rounded by `fp8_rounding`) ---------------


def _gemm_simulate(equation, a, b, da, db):
    qa = quantized_float32(a, da)
    qb = quantized_float32(b, db)
    return ops.einsum(equation, qa, qb)


def _gemm_jax(equation, a, b, da, db):
    import jax.numpy as jnp

    a8 = saturating_cast(a, da)
    b8 = saturating_cast(b, db)
    return jnp.einsum(equation, a8, b8, preferred_element_type=jnp.float32)


def _gemm_jax_bf16(equation, a, b, da, db):
    import jax.numpy as jnp

    a16 = saturating_round(a, da).astype(jnp.bfloat16)
    b16 = saturating_round(b, db).astype(jnp.bfloat16)
    return jnp.einsum(equation, a16, b16, preferred_element_type=jnp.float32)


_TF_FUNCTIONS = {}  # (route, equation, dtypes) -> XLA-compiled tf.function


def _tf_xla(route, equation, da, db, body):
    """Run `body(a, b)` of a TF route as a cached `jit_compile=True`
    function: the FP8 rounding and the GEMM compile together (Keras runs
    TensorFlow without XLA on a CPU, where each rounding op would be its
    own pass)."""
    import tensorflow as tf

    key = (route, equation, da, db)
    if key not in _TF_FUNCTIONS:
        _TF_FUNCTIONS[key] = tf.function(body, jit_compile=True, autograph=False)
    return _TF_FUNCTIONS[key]


def _gemm_tf(equation, a, b, da, db):
    import tensorflow as tf

    def body(a, b):
        qa = tf.cast(saturating_cast(a, da), tf.float32)
        qb = tf.cast(saturating_cast(b, db), tf.float32)
        return tf.einsum(equation, qa, qb)

    return _tf_xla("tensorflow-xla", equation, da, db, body)(a, b)


def _gemm_tf_f32(equation, a, b, da, db):
    import tensorflow as tf

    def body(a, b):
        return tf.einsum(equation, saturating_round(a, da), saturating_round(b, db))

    return _tf_xla("tensorflow-xla-f32", equation, da, db, body)(a, b)


def tf_matmul_flags(equation):
    """`(transpose_a, transpose_b)` when the 2-D `equation` is one
    `tf.linalg.matmul` (output: the free index of `a`, then of `b`);
    None otherwise."""
    ins, out = equation.replace(" ", "").split("->")
    a, b = ins.split(",")
    common = set(a) & set(b)
    if len(a) != 2 or len(b) != 2 or len(common) != 1 or len(set(a + b)) != 3:
        return None
    (c,) = common
    if out != a.replace(c, "") + b.replace(c, ""):
        return None
    return a[0] == c, b[1] == c


def _gemm_tf_bf16(equation, a, b, da, db):
    import tensorflow as tf

    transpose_a, transpose_b = tf_matmul_flags(equation)

    def body(a, b):
        return tf.linalg.matmul(
            tf.cast(saturating_round(a, da), tf.bfloat16),
            tf.cast(saturating_round(b, db), tf.bfloat16),
            transpose_a=transpose_a,
            transpose_b=transpose_b,
            output_type=tf.float32,
        )

    return _tf_xla("tensorflow-xla-bf16", equation, da, db, body)(a, b)


def tf_xla_function(equation, route="tensorflow-xla", dtypes=("float8_e4m3fn", "float8_e4m3fn")):
    """The XLA-compiled TF function a TF route used for `equation` and the
    operands' FP8 `dtypes` (for inspection)."""
    return _TF_FUNCTIONS.get((route, equation) + tuple(dtypes))


def _torch_mm(x8, y8):
    """`torch._scaled_mm` with a row-major first and a column-major second
    operand (the layout cuBLASLt needs), float32 output."""
    import torch

    one = torch.ones((), dtype=torch.float32, device=x8.device)
    return torch._scaled_mm(
        x8.contiguous(), y8.t().contiguous().t(), scale_a=one, scale_b=one,
        out_dtype=torch.float32,
    )


def _torch_forward(a8, b8):
    """Forward 2-D `_scaled_mm` on FP8 `a8` flattened to (M, K)."""
    out = _torch_mm(a8.reshape(-1, a8.shape[-1]), b8)
    return out.reshape(*a8.shape[:-1], b8.shape[-1])


_GEMMS = {
    "simulate": _gemm_simulate,
    "jax-dot_general-fp8": _gemm_jax,
    "jax-dot_general-bf16": _gemm_jax_bf16,
    "tensorflow-xla": _gemm_tf,
    "tensorflow-xla-bf16": _gemm_tf_bf16,
    "tensorflow-xla-f32": _gemm_tf_f32,
}


def fp8_gemms(equation, a_shape, b_shape, forward_dtype="float8_e4m3fn", backward_dtype="float8_e5m2", route=None):
    """`(route name, Gemms)` for `einsum(equation, a, b)` with FP8 operands:
    the forward GEMM takes `a`, `b` cast (saturating) to `forward_dtype`;
    the backward GEMMs take the output cotangent cast to `backward_dtype`
    and the other operand in `forward_dtype`. Every GEMM returns float32.
    """
    grad_equations(equation, "FP8")
    nk = as_matmul(equation)
    if nk is None or is_2d(equation, nk):
        name = resolve_route(equation, tuple(a_shape), tuple(b_shape), route)
        gemms = _route_gemms(name, equation, forward_dtype, backward_dtype)
    else:  # 2-D GEMMs on flattened operands (`backend.gemm.flattened`)
        k = int(np.prod(b_shape[:nk]))
        n = int(np.prod(b_shape[nk:]))
        name = resolve_route(MATMUL_2D, (None, k), (k, n), route)
        gemms = flattened(_route_gemms(name, MATMUL_2D, forward_dtype, backward_dtype), nk)
    _STATE["last"] = name
    return name, gemms


def _route_gemms(name, equation, fwd, bwd):
    grad_a_eq, grad_b_eq = grad_equations(equation, "FP8")
    if name in ("simulate", "torch-scaled_mm"):
        # Operands rounded once (`Gemms.quantize`): `a` and `b` in the
        # forward, kept rounded for the backward; the cotangent once for
        # both backward GEMMs. (The other routes round inside one compiled
        # function per GEMM, where XLA fuses the rounding into it.)
        if name == "simulate":
            round_to = quantized_float32
            gemm_fwd = lambda a, b, alpha=None: einsum_f32(equation, a, b, alpha)
            gemm_a = lambda g, b, alpha=None: einsum_f32(grad_a_eq, g, b, alpha)
            gemm_b = lambda a, g, alpha=None: einsum_f32(grad_b_eq, a, g, alpha)
            alpha = takes_alpha(equation)
        else:
            round_to = _torch_saturating_cast
            gemm_fwd, gemm_a, gemm_b = _torch_forward, _torch_grad_a, _torch_grad_b
            alpha = False
        quantize = tuple((lambda x, d=d: round_to(x, d)) for d in (fwd, fwd, bwd))
        return Gemms(gemm_fwd, gemm_a, gemm_b, quantize, alpha=alpha)
    gemm = _GEMMS[name]
    # The weight gradient `aᵀg` contracts the leading (row) dim of both
    # operands: XLA CPU's bfloat16 GEMM does not take that layout and
    # upcasts its operands to float32, duplicating their elementwise
    # producers into a float32 and a bfloat16 copy; it is run on the
    # float32 values directly (the same products, exact either way).
    grad_b = _gemm_simulate if name == "jax-dot_general-bf16" else gemm
    return Gemms(
        lambda a, b: gemm(equation, a, b, fwd, fwd),
        lambda g, b: gemm(grad_a_eq, g, b, bwd, fwd),
        lambda a, g: grad_b(grad_b_eq, a, g, fwd, bwd),
    )


def _torch_grad_a(g8, b8):
    """`g8 @ b8ᵀ` (E5M2 × E4M3) for the 2-D weight `b8`, in `g8`'s leading shape."""
    out = _torch_mm(g8.reshape(-1, g8.shape[-1]), b8.t())
    return out.reshape(*g8.shape[:-1], b8.shape[0])


def _torch_grad_b(a8, g8):
    """`a8ᵀ @ g8` (E4M3 × E5M2) over every leading dimension. The
    contraction runs over the M rows, which `_scaled_mm` needs in
    multiples of 16: other M are padded with zero rows (exact)."""
    import torch

    a2, g2 = a8.reshape(-1, a8.shape[-1]), g8.reshape(-1, g8.shape[-1])
    pad = -a2.shape[0] % 16
    if pad:  # (as bytes: zero bits are +0 in every FP8 format)
        a2, g2 = (
            torch.cat([t.view(torch.uint8), t.new_zeros((pad, t.shape[1]), dtype=torch.uint8)]).view(t.dtype)
            for t in (a2, g2)
        )
    return _torch_mm(a2.t(), g2)
