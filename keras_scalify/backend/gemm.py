"""GEMMs that return float32: the three GEMMs of a scaled contraction.

A scaled contraction (`keras_scalify.ops.linalg`) applies its pow2 factors
to float32 GEMM results, before rounding once to the data dtype. That
needs a GEMM with a float32 output for the operands' dtype:

- jax: `jnp.einsum(..., preferred_element_type=float32)` for every dtype
  (float32, bfloat16, float16; XLA uses the low-precision GEMM with float32
  accumulation where the hardware has one, and upcasts on CPU).
- torch on the CPU: every float dtype, upcast to float32 (the CPU has no
  fast float16/bfloat16 GEMM; the products of narrow floats are exact in
  float32).
- tensorflow, torch on a GPU: float32 operands only (`has_float32_gemm`);
  float16 and bfloat16 GEMMs there return their own dtype, and the
  contraction keeps the layout that protects that output's range.

`grad_equations` gives the einsum equations of the two backward GEMMs.
"""

import collections
import functools

import keras
from keras import ops

from keras_scalify.backend.scalar import dtype_name
from keras_scalify.backend.scalar import TORCH
from keras_scalify.core.pow2 import as_dtype

if TORCH:
    import torch

Gemms = collections.namedtuple(
    "Gemms", ["forward", "grad_a", "grad_b", "quantize"], defaults=(None,)
)
Gemms.__doc__ = """The three GEMMs of `y = einsum(eq, a, b)`, each returning
float32: `forward(a, b)`, `grad_a(g, b)` (the cotangent of `a` from the
cotangent `g` of `y`) and `grad_b(a, g)`. `quantize`: None, or the
roundings `(qa, qb, qg)` of the operands and of the cotangent; then the
GEMMs take operands already rounded, so that `a` and `b` are rounded once
in the forward (and kept rounded for the backward) and `g` once in the
backward, instead of once per GEMM."""


@functools.lru_cache(maxsize=1024)
def grad_equations(equation, kind="scaled"):
    """`(equation of grad_a, equation of grad_b)` for a two-operand
    `equation` with explicit output, e.g. "ak,kn->an" gives ("an,kn->ak",
    "ak,an->kn"). Raises a ValueError when an index of one operand appears
    neither in the other operand nor in the output (it is summed within
    one operand, which these GEMMs do not do) or when an ellipsis is used.
    """
    ins, out = equation.replace(" ", "").split("->")
    a, b = ins.split(",")
    for name, term, others in (("x1", a, b + out), ("x2", b, a + out)):
        missing = [c for c in term if c not in others]
        if missing or "." in term:
            raise ValueError(
                f"Einsum `{equation}`: index {missing} of {name} is summed "
                f"within one operand (or an ellipsis is used): not supported "
                f"for {kind} GEMMs, which need every index in the other "
                f"operand or the output."
            )
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


def has_float32_gemm(*operands):
    """Whether this backend's `einsum_f32` takes these operands (tensors,
    or dtypes) without upcasting them: jax, every float dtype; torch
    tensors on the CPU, every float dtype too (`einsum_f32` upcasts them:
    torch's CPU float16/bfloat16 GEMMs are emulated, ~10x slower than
    float32 on the GPT's attention products); else float32 only."""
    if keras.backend.backend() == "jax":
        return True
    if TORCH and all(_on_cpu(x) for x in operands):
        return True
    return all(dtype_name(getattr(x, "dtype", x)) == "float32" for x in operands)


def _on_cpu(x):
    return isinstance(x, torch.Tensor) and x.device.type == "cpu"


# The data ops around the GEMMs. On torch, the torch functions on torch
# tensors: `keras.ops` converts its operands and checks for symbolic
# tensors on every call (~20 µs; a GPT step of `benchmarks/step_time.py`
# made ~130 such reshapes, transposes and matmuls).
if TORCH:

    def _tensors(*xs):
        return all(isinstance(x, torch.Tensor) for x in xs)

    def _reshape(x, shape):
        return torch.reshape(x, shape) if _tensors(x) else ops.reshape(x, shape)

    def _shape(x):
        return tuple(x.shape) if _tensors(x) else ops.shape(x)

    def _transpose(x):
        return x.t() if _tensors(x) else ops.transpose(x)

    def _matmul(a, b):
        return torch.matmul(a, b) if _tensors(a, b) else ops.matmul(a, b)

    def _einsum(equation, a, b):
        return torch.einsum(equation, a, b) if _tensors(a, b) else ops.einsum(equation, a, b)

else:
    _reshape, _shape, _transpose = ops.reshape, ops.shape, ops.transpose
    _matmul, _einsum = ops.matmul, ops.einsum


def einsum_f32(equation, a, b):
    """`einsum(equation, a, b)` accumulated and returned in float32."""
    if keras.backend.backend() == "jax":
        import jax.numpy as jnp

        return jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)
    if TORCH and (a.dtype != torch.float32 or b.dtype != torch.float32):
        # Only CPU tensors come here with other dtypes (`has_float32_gemm`).
        a, b = a.to(torch.float32), b.to(torch.float32)
    transposes = _matrix_product(equation)
    if transposes is None:
        out = _einsum(equation, a, b)
    else:
        # A product of two matrices: `matmul` (torch runs a 2-D einsum as a
        # batched GEMM of batch 1, with copies around it).
        ta, tb = transposes
        out = _matmul(_transpose(a) if ta else a, _transpose(b) if tb else b)
    return as_dtype(out, "float32")


@functools.lru_cache(maxsize=1024)
def _matrix_product(equation):
    """`(transpose a, transpose b)` when `equation` is a product of two
    matrices ("mk,kn->mn" and its transposed forms), else None."""
    ins, out = equation.replace(" ", "").split("->")
    a, b = ins.split(",")
    if len(a) != 2 or len(b) != 2 or len(out) != 2 or len(set(a + b)) != 3:
        return None
    (k,) = set(a) & set(b)
    m, n = a.replace(k, ""), b.replace(k, "")
    if out != m + n:
        return None
    return a[0] == k, b[1] == k


MATMUL_2D = "mk,kn->mn"


@functools.lru_cache(maxsize=1024)
def as_matmul(equation):
    """For an einsum that is a matrix product in disguise, `lead..K..,
    K..W..->lead..W..` (the contracted indices K last in `a`, first in `b`,
    in the same order, no batch index): the number of K indices; else None.
    Dense ("abk,kn->abn") and the attention projections ("abc,cde->abde",
    "abcd,cde->abe") are of this form."""
    ins, out = equation.replace(" ", "").split("->")
    a, b = ins.split(",")
    if len(set(a)) != len(a) or len(set(b)) != len(b) or "." in a + b:
        return None
    k = [c for c in a if c in b]
    nk = len(k)
    if nk == 0 or any(c in out for c in k):
        return None
    if a[len(a) - nk:] != b[:nk] or out != a[: len(a) - nk] + b[nk:]:
        return None
    return nk


def flattened(gemms_2d, nk):
    """`Gemms` of an `as_matmul` einsum with `nk` contracted indices, from
    the `Gemms` of `MATMUL_2D`: `a` runs as (M, K), `b` as (K, N) and the
    cotangent as (M, N), so each GEMM is one plain 2-D product (for the
    einsum with several contracted dims, XLA on CPU copied a transposed
    activation for the weight gradient). The contracted and `b`'s other
    dims must be static."""

    def prod(dims):
        n = 1
        for d in dims:
            n *= int(d)
        return n

    def a2(x):
        return _reshape(x, (-1, prod(x.shape[len(x.shape) - nk:])))

    def b2(w):
        return _reshape(w, (prod(w.shape[:nk]), -1))

    def lead(x, nt):
        return tuple(_shape(x)[: len(x.shape) - nt])

    def forward(a, b):
        y = gemms_2d.forward(a2(a), b2(b))
        return _reshape(y, lead(a, nk) + tuple(b.shape[nk:]))

    def grad_a(g, b):
        w = tuple(b.shape[nk:])
        ga = gemms_2d.grad_a(_reshape(g, (-1, prod(w))), b2(b))
        return _reshape(ga, lead(g, len(w)) + tuple(b.shape[:nk]))

    def grad_b(a, g):
        w = tuple(g.shape[len(a.shape) - nk:])
        gb = gemms_2d.grad_b(a2(a), _reshape(g, (-1, prod(w))))
        return _reshape(gb, tuple(a.shape[len(a.shape) - nk:]) + w)

    return Gemms(forward, grad_a, grad_b, gemms_2d.quantize)


@functools.lru_cache(maxsize=1024)
def contraction_gemms(equation, b_shape):
    """`Gemms` of `einsum_f32` for a two-operand `equation`, as 2-D GEMMs
    (`flattened`) when it is `as_matmul` on operands of more than 2 dims
    and `b`'s shape is static."""
    nk = as_matmul(equation)
    if nk is None or is_2d(equation, nk) or any(d is None for d in b_shape):
        return plain_gemms(equation)
    return flattened(plain_gemms(MATMUL_2D), nk)


def is_2d(equation, nk):
    """Whether an `as_matmul` equation is already a product of matrices."""
    a, b = equation.replace(" ", "").split("->")[0].split(",")
    return nk == 1 and len(a) <= 2 and len(b) == 2


def plain_gemms(equation):
    """`Gemms` of `einsum_f32` for a two-operand `equation`."""
    eq_a, eq_b = grad_equations(equation)
    return Gemms(
        lambda a, b: einsum_f32(equation, a, b),
        lambda g, b: einsum_f32(eq_a, g, b),
        lambda a, g: einsum_f32(eq_b, a, g),
    )
