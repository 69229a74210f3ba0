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

from keras_scalify.backend import scalar as S
from keras_scalify.backend.scalar import dtype_name
from keras_scalify.backend.scalar import TORCH
from keras_scalify.core.pow2 import as_dtype

_JAX = keras.backend.backend() == "jax"

if TORCH:
    import torch

Gemms = collections.namedtuple(
    "Gemms",
    ["forward", "grad_a", "grad_b", "quantize", "layout", "alpha", "laid_grads"],
    defaults=(None, None, False, None),
)
Gemms.__doc__ = """The three GEMMs of `y = einsum(eq, a, b)`, each returning
float32: `forward(a, b)`, `grad_a(g, b)` (the cotangent of `a` from the
cotangent `g` of `y`) and `grad_b(a, g)`. `quantize`: None, or the
roundings `(qa, qb, qg)` of the operands and of the cotangent; then the
GEMMs take operands already rounded, so that `a` and `b` are rounded once
in the forward (and kept rounded for the backward) and `g` once in the
backward, instead of once per GEMM. `layout`: None, or `(la, lb, lg)`:
the operands and the cotangent laid out as batches of matrices
(`batched_gemms`), once per pass (after `quantize`), for the GEMMs to
take; their results keep the layouts of `y`, `a` and `b`. `alpha`: whether
each GEMM takes `alpha=` (a Python float it multiplies its float32 result
by inside the GEMM, as BLAS's `alpha`: eager torch's `addmm` and `bmm`
GEMMs), else False.
`laid_grads`: None, or `(grad_a, grad_b)` returning the cotangents in the
laid-out shapes of `a` and `b` (as `layout[0]` and `layout[1]` give them),
for operands laid out before the custom gradient (`ops._gemm`): autograd
then keeps the laid-out operands for the backward, which lays out only
the cotangent."""


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
    if _JAX:
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
        for x in xs:  # (no generator: ~450 calls per GPT step)
            if not isinstance(x, torch.Tensor):
                return False
        return True

    def _reshape(x, shape):
        return torch.reshape(x, shape) if _tensors(x) else ops.reshape(x, shape)

    def _shape(x):
        return tuple(x.shape) if _tensors(x) else ops.shape(x)

    def _transpose(x):
        return x.t() if _tensors(x) else ops.transpose(x)

    def _matmul(a, b, alpha=None):
        if not _tensors(a, b):
            return _times(ops.matmul(a, b), alpha)
        if alpha is None:
            return torch.matmul(a, b)
        if a.ndim == 2 and b.ndim == 2 and a.dtype == torch.float32:
            return torch.addmm(_zero(a), a, b, beta=0, alpha=alpha)
        return torch.matmul(a, b).mul_(alpha)

    def _bmm(a, b, alpha=None):
        if alpha is None:
            return torch.bmm(a, b)
        return torch.baddbmm(_zero(a), a, b, beta=0, alpha=alpha)

    def _zero(like):
        """A 0-d zero of `like`'s dtype and device: the ignored `input`
        of `addmm`/`baddbmm` with `beta=0` (broadcast, never read)."""
        return S.float32_scalar(0.0, like) if like.dtype == torch.float32 else like.new_zeros(())

    def _einsum(equation, a, b):
        return torch.einsum(equation, a, b) if _tensors(a, b) else ops.einsum(equation, a, b)

else:
    _reshape, _shape, _transpose = ops.reshape, ops.shape, ops.transpose
    _einsum = ops.einsum

    def _matmul(a, b, alpha=None):
        return _times(ops.matmul(a, b), alpha)


def _times(x, alpha):
    return x if alpha is None else ops.multiply(x, alpha)


def einsum_f32(equation, a, b, alpha=None):
    """`einsum(equation, a, b)` accumulated and returned in float32, times
    the Python float `alpha` where given (on torch, a matrix product takes
    it as BLAS's `alpha`: no pass of its own, `takes_alpha`; a normal
    power of two then gives the bits of the product times `alpha`;
    other einsums multiply their own result)."""
    if _JAX:
        import jax.numpy as jnp

        return _times(jnp.einsum(equation, a, b, preferred_element_type=jnp.float32), alpha)
    if TORCH and (a.dtype != torch.float32 or b.dtype != torch.float32):
        # Only CPU tensors come here with other dtypes (`has_float32_gemm`).
        a, b = a.to(torch.float32), b.to(torch.float32)
    transposes = _matrix_product(equation)
    if transposes is None:
        out = _times(_einsum(equation, a, b), alpha)
    else:
        # A product of two matrices: `matmul` (torch runs a 2-D einsum as a
        # batched GEMM of batch 1, with copies around it).
        ta, tb = transposes
        out = _matmul(_transpose(a) if ta else a, _transpose(b) if tb else b, alpha)
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

    # (`alpha` only where `gemms_2d` takes it: `Gemms.alpha`.)
    def forward(a, b, **alpha):
        y = gemms_2d.forward(a2(a), b2(b), **alpha)
        return _reshape(y, lead(a, nk) + tuple(b.shape[nk:]))

    def grad_a(g, b, **alpha):
        w = tuple(b.shape[nk:])
        ga = gemms_2d.grad_a(_reshape(g, (-1, prod(w))), b2(b), **alpha)
        return _reshape(ga, lead(g, len(w)) + tuple(b.shape[:nk]))

    def grad_b(a, g, **alpha):
        w = tuple(g.shape[len(a.shape) - nk:])
        gb = gemms_2d.grad_b(a2(a), _reshape(g, (-1, prod(w))), **alpha)
        return _reshape(gb, tuple(a.shape[len(a.shape) - nk:]) + w)

    # The cotangent made contiguous once (a permuted view arrives from an
    # attention product): its two reshapes are then views, not two copies.
    layout = (same, same, _contiguous) if TORCH else None
    return Gemms(forward, grad_a, grad_b, gemms_2d.quantize, layout, gemms_2d.alpha)


def same(x):
    """`x` itself: a layout that leaves an operand as it is."""
    return x


def _contiguous(x):
    return x.contiguous() if isinstance(x, torch.Tensor) else x


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
    """`Gemms` of `einsum_f32` for a two-operand `equation` (on eager
    torch, `batched_gemms` where it applies)."""
    if TORCH:
        gemms = batched_gemms(equation)
        if gemms is not None:
            return gemms
    eq_a, eq_b = grad_equations(equation)
    return Gemms(
        lambda a, b, alpha=None: einsum_f32(equation, a, b, alpha),
        lambda g, b, alpha=None: einsum_f32(eq_a, g, b, alpha),
        lambda a, g, alpha=None: einsum_f32(eq_b, a, g, alpha),
        alpha=takes_alpha(equation),
    )


def takes_alpha(equation):
    """Whether `einsum_f32` runs `equation` (and so its two gradient
    equations) as a GEMM that takes `alpha` itself: a product of two
    matrices on torch (`addmm`). Other einsums would multiply their
    result in a pass of its own, where the exact path may scale a
    smaller operand instead."""
    return TORCH and _matrix_product(equation) is not None


if TORCH:

    def _laid_out(x, perm, groups):
        """`x` permuted by `perm` (indices grouped as `groups` counts, e.g.
        batch, rows, contracted) as float32 whose grouping into a batch of
        matrices is a view: a copy only where that view does not exist."""
        if x.dtype != torch.float32:  # (CPU only: `has_float32_gemm`)
            x = x.to(torch.float32)
        x = x.permute(perm)
        if torch.compiler.is_compiling():  # (no storage to inspect)
            return x.contiguous()
        x3 = torch.reshape(x, _grouped(x.shape, groups))
        if x3.data_ptr() == x.data_ptr() and _bmm_strided(x3):
            return x
        # (`reshape` copied, or `bmm` would copy on every use.)
        return x3.contiguous().view(x.shape)

    def _bmm_strided(x3):
        """Whether `bmm` reads the batch of matrices `x3` without a copy
        (each matrix row- or column-major, batches strided evenly)."""
        _, r, c = x3.shape
        st = x3.stride()
        return (st[2] == 1 and st[1] >= max(c, 1)) or (st[1] == 1 and st[2] >= max(r, 1))

    def _grouped(shape, groups):
        out, i = [], 0
        for n in groups:
            size = 1
            for d in shape[i : i + n]:
                size *= int(d)
            out.append(size)
            i += n
        return out

    @functools.lru_cache(maxsize=1024)
    def batched_gemms(equation):
        """`Gemms` of a two-operand einsum with a batch index (in `a`, `b`
        and the output) or a transposed operand, as `torch.bmm` on batches
        of matrices (eager torch): `layout` permutes `a` to (batch, rows,
        contracted), `b` to (batch, contracted, columns) and the cotangent
        to (batch, rows, columns), copying only where that is not a view
        (the operands once, before the custom gradient, which keeps them for
        the backward: `laid_grads`; the cotangent once per backward); the
        backward GEMMs read the laid-out operands transposed (`bmm` takes
        them as they are). `torch.einsum` lays its operands out
        per call, so each backward einsum copied both of its operands again
        (the GPT's attention products: 24 copies per backward pass, 8 for
        Keras's autograd through its einsums). None for a product of
        matrices in place (`_matrix_product`: `matmul`) or an equation
        with an index summed within one operand, repeated or elided."""
        ins, out = equation.replace(" ", "").split("->")
        a, b = ins.split(",")
        if _matrix_product(equation) is not None or "." in equation:
            return None
        if len(set(a)) != len(a) or len(set(b)) != len(b) or len(set(out)) != len(out):
            return None
        batch = [c for c in out if c in a and c in b]
        rows = [c for c in a if c in out and c not in b]
        cols = [c for c in b if c in out and c not in a]
        k = [c for c in a if c in b and c not in out]
        if len(batch) + len(rows) + len(k) != len(a) or len(batch) + len(k) + len(cols) != len(b):
            return None
        if len(batch) + len(rows) + len(cols) != len(out) or not k:
            return None
        nb, nm, nk, nn = len(batch), len(rows), len(k), len(cols)
        perm_a = [a.index(c) for c in batch + rows + k]
        perm_b = [b.index(c) for c in batch + k + cols]
        perm_g = [out.index(c) for c in batch + rows + cols]
        inv = lambda order, term: [order.index(c) for c in term]
        inv_out = inv(batch + rows + cols, out)
        inv_a = inv(batch + rows + k, a)
        inv_b = inv(batch + k + cols, b)

        def forward(a3, b3, alpha=None):
            y = _bmm(a3.reshape(_grouped(a3.shape, (nb, nm, nk))), b3.reshape(_grouped(b3.shape, (nb, nk, nn))), alpha)
            return y.view(tuple(a3.shape[: nb + nm]) + tuple(b3.shape[nb + nk :])).permute(inv_out)

        def grad_a_laid(g3, b3, alpha=None):
            ga = _bmm(
                g3.reshape(_grouped(g3.shape, (nb, nm, nn))),
                b3.reshape(_grouped(b3.shape, (nb, nk, nn))).transpose(1, 2),
                alpha,
            )
            return ga.view(tuple(g3.shape[: nb + nm]) + tuple(b3.shape[nb : nb + nk]))

        def grad_b_laid(a3, g3, alpha=None):
            gb = _bmm(
                a3.reshape(_grouped(a3.shape, (nb, nm, nk))).transpose(1, 2),
                g3.reshape(_grouped(g3.shape, (nb, nm, nn))),
                alpha,
            )
            return gb.view(tuple(a3.shape[:nb]) + tuple(a3.shape[nb + nm :]) + tuple(g3.shape[nb + nm :]))

        def grad_a(g3, b3, alpha=None):
            return grad_a_laid(g3, b3, alpha).permute(inv_a)

        def grad_b(a3, g3, alpha=None):
            return grad_b_laid(a3, g3, alpha).permute(inv_b)

        layout = (
            lambda x: _laid_out(x, perm_a, (nb, nm, nk)),
            lambda x: _laid_out(x, perm_b, (nb, nk, nn)),
            lambda x: _laid_out(x, perm_g, (nb, nm, nn)),
        )
        return Gemms(forward, grad_a, grad_b, None, layout, True, (grad_a_laid, grad_b_laid))
