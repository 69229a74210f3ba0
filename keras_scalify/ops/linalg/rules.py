"""The scale rule of a contraction and `_contract`, which applies it.

Rule (jax-scalify's `dot_general`, generalised to batch dims and einsum):
`s = Π s_i · r` and `d = contraction(data) / r` with `r = P(sqrt(K))`, K the
contracted size. Gradient scale (inverse unit-scaling backward rule): the
backward of operand i contracts `n_i = size(out)·K/size(i)` elements, so
`g = mean_i(g_i / (Π_{j≠i} s_j · P(sqrt(n_i))))`, over the operands whose
grad scale was measured (`calibrated=`; a weight's guess does not vote).
"""

import math

from keras import ops

from keras_scalify.backend import scalar as S
from keras_scalify.backend.scalar import dtype_name
from keras_scalify.backend.scalar import memoize_scalars
from keras_scalify.core.pow2 import np_pow2_decompose
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.ops._common import grad_factor
from keras_scalify.ops._common import is_static_scalar
from keras_scalify.ops._common import pow2_mean
from keras_scalify.ops._common import rescale
from keras_scalify.ops._common import safe_div
from keras_scalify.ops._common import scalars
from keras_scalify.ops._common import scale_grad
from keras_scalify.ops._common import static_count
from keras_scalify.ops._common import static_pow2_sqrt
from keras_scalify.ops._common import votes as _votes
from keras_scalify.ops._gemm import scaled_gemms
from keras_scalify.ops.arithmetic import _static_gs
from keras_scalify.ops.linalg.shapes import _einsum_shape
from keras_scalify.ops.linalg.shapes import _parse_einsum


def _others_scale(sc, i):
    out = None
    for j, (s_j, _) in enumerate(sc):
        if j != i:
            out = s_j if out is None else out * s_j
    return 1.0 if out is None else out


def _predictions(sizes, sc, k, size_out):
    """Each operand's prediction of the output's grad scale (the inverse
    unit-scaling rule: the one that makes its cotangent unit when the
    output's is), `g_i / (Π_{j≠i} s_j · P(sqrt(n_i)))`, with `n_i` the size
    its backward GEMM contracts (`sizes`: the operands' static element
    counts); returns (predictions, n_i)."""
    ns = _backward_sizes(sizes, k, size_out)
    preds = [
        safe_div(sc[i][1], _others_scale(sc, i) * static_pow2_sqrt(n_i))
        for i, n_i in enumerate(ns)
    ]
    return preds, ns


def _backward_sizes(sizes, k, size_out):
    """`n_i`: the size the backward GEMM of operand i contracts."""
    return [max(size_out * k // max(size, 1), 1) for size in sizes]


def _sizes(operands):
    return tuple(static_count(x.shape) for x in operands)


def operand_grad_scale(subscripts, operands, i):
    """The grad scale of `operands[i]` predicted from the other operands of
    `einsum(subscripts, *operands)`: the one at which its own prediction of
    the output's grad scale equals theirs, `pred_others · Π_{j≠i} s_j ·
    P(sqrt(n_i))`. For an operand whose cotangent the rules upstream cannot
    predict (attention's probabilities: `dP = d(out)·vᵀ`); apply it with
    `with_grad_scale`."""
    xs = list(operands)
    k = _parse_einsum(subscripts, [x.shape for x in xs])
    out_shape = _einsum_shape(subscripts, xs)
    return _operand_grad_scale(tuple(scalars(x) for x in xs), i, _sizes(xs), k, static_count(out_shape))


@memoize_scalars
def _operand_grad_scale(sc, i, sizes, k, size_out):
    """`operand_grad_scale` from the operands' `(scale, grad scale)` pairs
    `sc` and the static sizes."""
    preds, ns = _predictions(sizes, sc, k, size_out)
    others = pow2_mean(*[p for j, p in enumerate(preds) if j != i])
    return others * _others_scale(sc, i) * static_pow2_sqrt(ns[i])


@memoize_scalars
def _contraction_scales(sc, k, size_out, sizes, calibrated):
    """The scalars of a contraction's rule: `(scale, grad scale, (c_i))`,
    from its operands' `(scale, grad scale)` pairs `sc`, the contracted
    size `k`, the output's and operands' static sizes and `calibrated`.
    `c_i` is operand i's cotangent factor."""
    scale = sc[0][0]
    for s_i, _ in sc[1:]:
        scale = scale * s_i
    scale = scale * static_pow2_sqrt(k)
    preds, _ = _predictions(sizes, sc, k, size_out)
    g = pow2_mean(*_votes(preds, calibrated))
    cs = tuple(grad_factor(scale, g, s_i, g_i) for s_i, g_i in sc)
    return scale, g, cs


@memoize_scalars
def _gemm_factors(cs, r, m=1.0, out_factor=1.0):
    """`(m·out_factor/r, c_a·m/r, c_b·m/r)`: the factors of the forward GEMM
    and of the two backward ones (`ops/_gemm.py`); powers of two for `m =
    1`, else `m` is a static multiplier's mantissa (`einsum(multiplier=)`).
    `out_factor`: a static pow2 the output data alone takes (a rebalance
    folded into the GEMM, `rebalanced_einsum`)."""
    inv_r = 1.0 / r
    if not S.is_tensor(inv_r):  # a static r: cached (no copy to a GPU per call)
        inv_r = S.float32_scalar(inv_r, next((c for c in cs if S.is_tensor(c)), None))
    if m != 1.0:
        inv_r = inv_r * m
    f_out = inv_r if out_factor == 1.0 else inv_r * out_factor
    return (f_out,) + tuple(c * inv_r for c in cs)


@memoize_scalars
def _multiplied_scales(scale, g, k):
    """`(scale·P(k), g/P(k))`: the rule of `multiply` by a static `k`."""
    return scale * np_pow2_decompose(float(k))[0], _static_gs(g, k, -1)


@memoize_scalars
def _divided(scale, f):
    """`scale / f` (the scale `rebalance` gives)."""
    return scale / f


def _split_multiplier(multiplier):
    """`(p, m)`, the exact split `multiplier = m·P(multiplier)` of a finite
    nonzero Python number; None for None (no multiplier)."""
    if multiplier is None:
        return None
    if not is_static_scalar(multiplier):
        raise TypeError(f"`multiplier` must be a Python number, got {multiplier!r}.")
    if multiplier == 0 or not math.isfinite(multiplier):
        raise ValueError(f"`multiplier` must be finite and nonzero, got {multiplier!r}.")
    return np_pow2_decompose(float(multiplier))


def _contract(
    fn, operands, k, out_shape, prescale=None, gemms=None, out_dtype=None, quantized=False,
    calibrated=None, multiplier=None, out_factor=None, operand_dtype=None,
):
    """Apply `fn` to the data of `operands` with the contraction rule.

    With `gemms` (two operands; `keras_scalify.backend.gemm.Gemms`, float32
    results) the three GEMMs run under one custom gradient that applies the
    pow2 factors without passes of their own (`ops/_gemm.py`); the output
    data is in `out_dtype`. Otherwise `fn` is differentiated by the backend
    with `rescale` / `scale_grad` around it (below). `multiplier` (with
    `gemms` only): see `einsum`. `out_factor` (with `gemms` only): the
    result is `rebalance(result, out_factor)`'s, the factor in the forward
    GEMM's (`rebalanced_einsum`). `operand_dtype` (generic path): `fn`
    takes the operands cast to it, after their cotangent factors, so that
    each cotangent is multiplied in its operand's own dtype
    (`cast_contraction`)."""
    sc = tuple(scalars(x) for x in operands)
    r = static_pow2_sqrt(k)
    size_out = static_count(out_shape)
    sizes = _sizes(operands)
    scale, g, cs = _contraction_scales(sc, k, size_out, sizes, calibrated)
    split = _split_multiplier(multiplier)
    if (split is not None or out_factor is not None) and gemms is None:
        raise ValueError("`multiplier` and `out_factor` are folded into the GEMMs' factors only.")
    if gemms is not None:
        _, m = split or (1.0, 1.0)
        f = 1.0 if out_factor is None else float(out_factor)
        out = scaled_gemms(
            gemms, *(x.data for x in operands), _gemm_factors(cs, r, m, f), out_shape, out_dtype,
            quantized, pow2_factors=m == 1.0,
        )
        if split is not None:
            scale, g = _multiplied_scales(scale, g, multiplier)
        if out_factor is not None:
            scale = _divided(scale, f)
        return ScaledTensor(out, scale, g)
    beta = 1.0 / static_pow2_sqrt(_backward_sizes(sizes, k, size_out)[0])
    # float16: the first operand is pre-multiplied by 1/r (exact pow2) so a
    # product of correlated data cannot overflow before the rescale. Other
    # dtypes rescale the float32-range output. Backward, the output
    # cotangent is multiplied by beta (the GEMMs see unit-scale operands)
    # and each input by the rest of its factor c_i/r.
    if prescale is None:
        prescale = "float16" in [operand_dtype] + [x.dtype for x in operands]
    one = 1.0
    inv_r = 1.0 / r
    datas = []
    for i, (c, x) in enumerate(zip(cs, operands)):
        if prescale and i == 0:
            datas.append(rescale(x.data, inv_r, c / (r * beta)))
        elif prescale:
            datas.append(scale_grad(x.data, c / beta))
        else:
            datas.append(scale_grad(x.data, c / (r * beta)))
    if operand_dtype is not None:
        datas = [_cast_data(d, operand_dtype) for d in datas]
    out = rescale(fn(*datas), one if prescale else inv_r, beta)
    return ScaledTensor(out, scale, g)


def _cast_data(x, dtype):
    """`x` (a tensor) cast to `dtype`, unless it has it."""
    return x if dtype_name(x.dtype) == dtype else ops.cast(x, dtype)
