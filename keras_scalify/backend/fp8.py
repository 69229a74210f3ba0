"""FP8 GEMMs behind one dispatch: a route per backend.

`fp8_einsum(equation, a, b, forward_dtype, backward_dtype, route)` computes
`einsum(equation, q(a), q(b))` with `q` a saturating cast to
`forward_dtype` (E4M3), float32 accumulation and a float32 output. Its
gradient quantizes the cotangent to `backward_dtype` (E5M2) and runs the two
backward GEMMs (E5M2 × E4M3) through the same route.

Routes (`resolve_route` picks one; `"auto"` prefers native):
- `jax-dot_general-fp8`: `jnp.einsum` on FP8 operands with
  `preferred_element_type=float32` (XLA upcasts on CPU; on GPU the
  FP8 operands reach cuBLASLt).
- `tensorflow-xla`: FP8 tensors cast up inside a `jit_compile=True`
  function (TF supports only casts on FP8; XLA rewrites the pattern into an
  FP8 GEMM on GPUs that have one).
- `torch-scaled_mm`: `torch._scaled_mm` for 2-D GEMMs (inputs are
  flattened to 2-D); on CUDA it needs compute capability >= 8.9 and K, N
  multiples of 16, else it falls back.
- `simulate`: saturate, cast to FP8, cast back, float32 einsum: the
  reference, on any backend.
"""

import contextlib

import keras
from keras import ops

from keras_scalify.core.formats import saturating_cast

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
    if torch.cuda.is_available() and keras.config.backend() == "torch":
        from keras.src.backend.torch.core import get_device

        if "cuda" in str(get_device()):
            major, minor = torch.cuda.get_device_capability()
            k, n = b_shape
            if (major, minor) < (8, 9) or k % 16 or n % 16:
                return False
    return True


def _matmul_2d(equation):
    """For "...k,kn->...n"-style equations: True; None otherwise."""
    ins, out = equation.replace(" ", "").split("->")
    a, b = ins.split(",")
    if len(b) != 2 or not a or a[-1] != b[0] or out != a[:-1] + b[1]:
        return None
    if b[1] in a or len(set(a)) != len(a):
        return None
    return True


def resolve_route(equation, a_shape, b_shape, route=None):
    """The route name an FP8 einsum with these shapes takes."""
    route = route or get_fp8_route()
    if route not in ROUTES:
        raise ValueError(f"`route` must be one of {ROUTES}, got {route!r}.")
    if route == "simulate":
        return "simulate"
    backend = keras.config.backend()
    if backend == "jax":
        return "jax-dot_general-fp8"
    if backend == "tensorflow":
        return "tensorflow-xla"
    if backend == "torch" and _torch_route_ok(a_shape, b_shape, equation):
        return "torch-scaled_mm"
    return "simulate"


# --- GEMM implementations --------------------------------------------------


def _gemm_simulate(equation, a, b, da, db):
    qa = ops.cast(saturating_cast(a, da), "float32")
    qb = ops.cast(saturating_cast(b, db), "float32")
    return ops.einsum(equation, qa, qb)


def _gemm_jax(equation, a, b, da, db):
    import jax.numpy as jnp

    a8 = saturating_cast(a, da)
    b8 = saturating_cast(b, db)
    return jnp.einsum(equation, a8, b8, preferred_element_type=jnp.float32)


_TF_FUNCTIONS = {}


def _gemm_tf(equation, a, b, da, db):
    import tensorflow as tf

    fn = _TF_FUNCTIONS.get(equation)
    if fn is None:

        @tf.function(jit_compile=True, autograph=False)
        def fn(a8, b8):
            return tf.einsum(equation, tf.cast(a8, tf.float32), tf.cast(b8, tf.float32))

        _TF_FUNCTIONS[equation] = fn
    return fn(saturating_cast(a, da), saturating_cast(b, db))


def tf_xla_function(equation):
    """The XLA-compiled TF function used for `equation` (for inspection)."""
    return _TF_FUNCTIONS.get(equation)


def _torch_mm(x8, y8):
    """`torch._scaled_mm` with a row-major first and a column-major second
    operand (the layout cuBLASLt needs), float32 output."""
    import torch

    one = torch.ones((), dtype=torch.float32, device=x8.device)
    return torch._scaled_mm(
        x8.contiguous(), y8.t().contiguous().t(), scale_a=one, scale_b=one,
        out_dtype=torch.float32,
    )


def _gemm_torch(equation, a, b, da, db):
    """Forward 2-D `_scaled_mm` on `a` flattened to (M, K)."""
    a8 = saturating_cast(a, da)
    b8 = saturating_cast(b, db)
    out = _torch_mm(a8.reshape(-1, a8.shape[-1]), b8)
    return out.reshape(*a8.shape[:-1], b8.shape[-1])


def _torch_backward(a, b, g, fwd, bwd):
    """The two backward GEMMs, E5M2 cotangent × E4M3 operand."""
    a8 = saturating_cast(a, fwd).reshape(-1, a.shape[-1])
    b8 = saturating_cast(b, fwd)
    g8 = saturating_cast(g, bwd).reshape(-1, g.shape[-1])
    ga = _torch_mm(g8, b8.t()).reshape(*a.shape)
    gb = _torch_mm(a8.t(), g8)
    return ga, gb


_GEMMS = {
    "simulate": _gemm_simulate,
    "jax-dot_general-fp8": _gemm_jax,
    "tensorflow-xla": _gemm_tf,
    "torch-scaled_mm": _gemm_torch,
}


def _grad_equations(equation):
    ins, out = equation.replace(" ", "").split("->")
    a, b = ins.split(",")
    for name, term, others in (("x1", a, b + out), ("x2", b, a + out)):
        missing = [c for c in term if c not in others]
        if missing or "." in term:
            raise ValueError(
                f"FP8 einsum `{equation}`: index {missing} of {name} is summed "
                f"within one operand; not supported for FP8 GEMMs."
            )
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


def fp8_einsum(equation, a, b, forward_dtype="float8_e4m3fn", backward_dtype="float8_e5m2", route=None):
    """`einsum(equation, q(a), q(b))` in float32 through the chosen route,
    with the FP8 backward described in the module docstring."""
    grad_a_eq, grad_b_eq = _grad_equations(equation)
    name = resolve_route(equation, tuple(a.shape), tuple(b.shape), route)
    _STATE["last"] = name
    gemm = _GEMMS[name]

    @ops.custom_gradient
    def fn(a, b):
        a_dtype, b_dtype = a.dtype, b.dtype

        def grad(*args, upstream=None, variables=None):
            g = args[0] if upstream is None else upstream
            if name == "torch-scaled_mm":
                ga, gb = _torch_backward(a, b, g, forward_dtype, backward_dtype)
            else:
                ga = gemm(grad_a_eq, g, b, backward_dtype, forward_dtype)
                gb = gemm(grad_b_eq, a, g, forward_dtype, backward_dtype)
            return ops.cast(ga, a_dtype), ops.cast(gb, b_dtype)

        return gemm(equation, a, b, forward_dtype, forward_dtype), grad

    return fn(a, b)
