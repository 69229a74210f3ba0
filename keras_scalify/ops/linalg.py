"""Scale rules of contractions: matmul, dot, einsum.

Rule (jax-scalify's `dot_general`, generalised to batch dims and einsum):
`s = Π s_i · r` and `d = contraction(data) / r` with `r = P(sqrt(K))`, K the
contracted size. Gradient scale (inverse unit-scaling backward rule): the
backward of operand i contracts `n_i = size(out)·K/size(i)` elements, so
`g = mean_i(g_i / (Π_{j≠i} s_j · P(sqrt(n_i))))`, over the operands whose
grad scale was measured (`calibrated=`; a weight's guess does not vote).
"""

import functools
import math
import string

from keras import ops

from keras_scalify.backend import fp8
from keras_scalify.backend.fused import gate_epilogue
from keras_scalify.backend.gemm import contraction_gemms
from keras_scalify.backend import scalar as S
from keras_scalify.backend.scalar import memoize_scalars
from keras_scalify.backend.gemm import grad_equations
from keras_scalify.backend.gemm import has_float32_gemm
from keras_scalify.backend.gemm import same
from keras_scalify.backend.scalar import dtype_name
from keras_scalify.core.formats import FP8_DTYPES
from keras_scalify.core.formats import get_format
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_calibrated as _check_calibrated
from keras_scalify.ops._common import check_input
from keras_scalify.ops._common import is_static_scalar
from keras_scalify.core.pow2 import np_pow2_decompose
from keras_scalify.ops._common import grad_factor
from keras_scalify.ops._common import pow2_mean
from keras_scalify.ops._common import votes as _votes
from keras_scalify.ops._common import promote
from keras_scalify.ops._common import same_dtype
from keras_scalify.ops._common import rescale
from keras_scalify.ops._common import safe_div
from keras_scalify.ops._common import scalars
from keras_scalify.ops._common import scale_grad
from keras_scalify.ops._common import result_dtype
from keras_scalify.ops._common import static_count
from keras_scalify.ops._common import static_dim
from keras_scalify.ops._common import static_pow2_sqrt
from keras_scalify.ops._common import times
from keras_scalify.ops._gemm import scaled_gemms
from keras_scalify.ops._gemm import scaled_gemms_plus
from keras_scalify.ops.arithmetic import _static_gs
from keras_scalify.ops.arithmetic import _sum_scales
from keras_scalify.ops.arithmetic import multiply
from keras_scalify.ops.casting import cast_on_forward
from keras_scalify.ops.rescaling import check_rebalance_factor
from keras_scalify.ops.rescaling import rebalance
from keras_scalify.ops.shape import cast as _cast


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


def cast_contraction(subscripts, x, w, operand_dtype, calibrated=None):
    """`einsum(subscripts, x, w)` (`matmul` for `subscripts=None`) on data
    cast to the 16/32-bit `operand_dtype`, `w`'s cast inside the
    contraction: the forward GEMM takes the cast data (output in
    `operand_dtype`), and `w`'s cotangent comes back in `w`'s own dtype,
    the GEMM's float32 result times its factor, never rounded to
    `operand_dtype` on the way: a float32 master weight's gradient beyond
    float16's range (outputs ~2^20 while its grad scale is a guess) stays
    finite. `x` is cast outside (`cast_on_forward`). Rule: as `einsum`
    (`matmul`); `calibrated` as in `matmul`."""
    operand_dtype = _check_out_dtype(operand_dtype)
    x = cast_on_forward(x, operand_dtype)
    a = x if is_scaled(x) else promote(x, w, "x")
    b = w if is_scaled(w) else promote(w, a, "w")
    if dtype_name(b.dtype) == operand_dtype:
        return _einsum(subscripts, (a, b), None, calibrated, None, None) if subscripts else matmul(
            a, b, calibrated=calibrated
        )
    if subscripts is None:
        subscripts = _weight_equation(a, b)
        if subscripts is None:
            raise ValueError(f"`w` must be 2-D for a matmul, got shape {tuple(b.shape)}.")
    subscripts = subscripts.replace(" ", "")
    k = _parse_einsum(subscripts, [a.shape, b.shape])
    out_shape = _einsum_shape(subscripts, (a, b))
    calibrated = _check_calibrated(calibrated, 2)
    equation = _two_operand_equation(subscripts, (a, b))
    if equation is not None and has_float32_gemm(operand_dtype):
        gemms = contraction_gemms(equation, tuple(static_dim(d) for d in b.shape))
        gemms = gemms._replace(quantize=(same, lambda d: _cast_data(d, operand_dtype), same))
        return _contract(
            None, [a, b], k, out_shape, gemms=gemms, out_dtype=operand_dtype, quantized=True,
            calibrated=calibrated,
        )

    def fn(*datas):
        return ops.einsum(subscripts, *datas)

    return _contract(fn, [a, b], k, out_shape, calibrated=calibrated, operand_dtype=operand_dtype)


def contraction_plus(
    subscripts, x, w, c, *, calibrated=None, c_calibrated=None, activation=None, gate=None,
    c_factor=None,
):
    """`add(einsum(subscripts, x, w, calibrated=calibrated), c,
    calibrated=(None, c_calibrated))` (`matmul` for `subscripts=None`),
    with both rules' scales from their own scale arithmetic, as one custom
    gradient (`ops._gemm.scaled_gemms_plus`: no pass of its own for the
    sum's factors), where the GEMMs of `ops/_gemm.py` run it on float32
    data of `x`, `w` and the ScaledTensor `c` (a Dense layer's bias; None:
    no sum, the contraction alone); None otherwise (the caller composes
    the ops).

    `activation` (a scaled activation, or None) is applied to the sum;
    `gate`: its kind when it is a gated one (`backend.fused.KINDS`), which
    the same node then computes where `backend.fused.gate_epilogue` allows
    (its rule: scale unchanged, `d = a·gate(a·s)`). `c_factor`: a pow2
    scalar by which `c`'s data is multiplied forward only (a rebalanced
    bias's, `ScaledVariable.read_rebalanced`), joined to the sum's factor
    for `c` (the sum is `add(x, ScaledTensor(rescale(c.data, c_factor, 1),
    ...))`'s)."""
    ab = _operands(x, w)
    if ab is None or not (c is None or is_scaled(c)):
        return None
    a, b = ab
    if c is not None and c.dtype != "float32":
        return None
    plan = _contraction_plan(subscripts, a, b)
    if plan is None:
        return None
    k, out_shape, args, size_out, sizes, r = plan
    sc = (scalars(a), scalars(b))
    scale, g, cs = _contraction_scales(
        sc, k, size_out, sizes, _check_calibrated(calibrated, 2)
    )
    factors = _gemm_factors(cs, r)
    if c is None:
        u_scale = None if gate is None else gate_epilogue(scale, gate)
        out = scaled_gemms(
            args["gemms"], a.data, b.data, factors, out_shape, "float32",
            gate=None if u_scale is None else (gate, u_scale),
        )
        y = ScaledTensor(out, scale, g)
    else:
        sc_c = scalars(c)
        s, g_sum, fa, ba, fb, bb = _sum_scales(
            scale, g, *sc_c, None if c_calibrated is None else [None, c_calibrated]
        )
        if c_factor is not None:
            fb = times(fb, c_factor)
        u_scale = None if gate is None else gate_epilogue(s, gate)
        out = scaled_gemms_plus(
            args["gemms"], a.data, b.data, c.data, factors,
            (fa, ba, fb, bb), out_shape, gate=None if u_scale is None else (gate, u_scale),
        )
        y = ScaledTensor(out, s, g_sum)
    if activation is None or u_scale is not None:
        return y
    return activation(y)


# `_contraction_plan`'s results by the operands' signatures (eager torch).
_PLANS = {}
_PLANS_MAX = 1024


def _contraction_plan(subscripts, a, b):
    """What `contraction_plus` reads of its float32 operands' shapes and
    dtypes: `(k, out_shape, gemm arguments, output size, operand sizes,
    P(sqrt(k)))`, or None where the one-custom-gradient GEMMs do not take
    them. Memoized by `backend.scalar.signature` where there is one (eager
    torch, where this analysis ran on every call of a Dense layer)."""
    key = (subscripts, S.signature(a.data), S.signature(b.data))
    known = key[1] is not None and key[2] is not None
    if known and key in _PLANS:
        return _PLANS[key]
    plan = None
    if a.dtype == "float32" and b.dtype == "float32":
        if subscripts is None:
            equation, k = _weight_equation(a, b), _static_k(a.data, "x1")
            out_shape = _result_shape(("matmul",), ops.matmul, (a, b))
        else:
            equation = _two_operand_equation(subscripts, (a, b))
            k = _parse_einsum(subscripts, [a.shape, b.shape])
            out_shape = _einsum_shape(subscripts, (a, b))
        args = _gemm_args(equation, a, b)
        if args:
            plan = (k, out_shape, args, static_count(out_shape), _sizes((a, b)), static_pow2_sqrt(k))
    if known:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _check_out_dtype(out_dtype):
    """`out_dtype` as a format name (None stays None); FP8 is refused."""
    if out_dtype is None:
        return None
    name = get_format(out_dtype).name
    if name in FP8_DTYPES:
        raise ValueError(f"`out_dtype` must be a 16/32-bit float, got {name}.")
    return name


def _operands(x1, x2):
    check_input("x1", x1)
    check_input("x2", x2)
    if not (is_scaled(x1) or is_scaled(x2)):
        return None
    like = x1 if is_scaled(x1) else x2
    return tuple(same_dtype([promote(x1, like, "x1"), promote(x2, like, "x2")]))


def _static_k(x, name):
    k = static_dim(x.shape[-1]) if len(x.shape) else 1
    if k is None:
        raise ValueError(
            f"`{name}` needs a static contracted dimension for its scale rule; "
            f"got shape {tuple(x.shape)}."
        )
    return int(k)


def matmul(x1, x2, *, calibrated=None):
    """Rule: `s = sa·sb·P(sqrt(K))`, `d = (a @ b)/P(sqrt(K))`, K = x1.shape[-1].

    Example: `(3,5)·2 @ (5,2)·4` → scale 16 (2·4·P(√5)=2), data 2.5 for ones.
    `calibrated` (keyword, ours): one bool per operand, false where its grad
    scale is not a measurement (`ScaledVariable.calibrated`); it does not
    vote for the output's grad scale (`ops._common.votes`).
    """
    ab = _operands(x1, x2)
    if ab is None:
        return ops.matmul(x1, x2)
    a, b = ab
    out_shape = _result_shape(("matmul",), ops.matmul, (a, b))
    return _contract(
        ops.matmul, [a, b], _static_k(a.data, "x1"), out_shape,
        calibrated=_check_calibrated(calibrated, 2),
        **_gemm_args(_weight_equation(a, b), a, b),
    )


def dot(x1, x2):
    """Rule: as `matmul`, K = x1.shape[-1] (NumPy `dot` semantics)."""
    ab = _operands(x1, x2)
    if ab is None:
        return ops.dot(x1, x2)
    a, b = ab
    out_shape = _result_shape(("dot",), ops.dot, (a, b))
    return _contract(
        ops.dot, [a, b], _static_k(a.data, "x1"), out_shape,
        **_gemm_args(_weight_equation(a, b), a, b),
    )


def _spec(x):
    import keras

    return keras.KerasTensor(
        tuple(static_dim(d) for d in x.shape), dtype=x.dtype
    )


# Keras's shape inference on KerasTensors costs 0.1-0.5 ms per call (a
# symbolic einsum ~0.5 ms: more than a small GEMM); results are memoized per
# operation and static input shapes.
_RESULT_SHAPES = {}
_RESULT_SHAPES_MAX = 4096


def _result_shape(key, fn, xs):
    """`fn(*specs of xs).shape` for the operation named by `key` (a hashable
    tuple that fixes everything but the shapes), memoized."""
    shapes = tuple(tuple(static_dim(d) for d in x.shape) for x in xs)
    out = _RESULT_SHAPES.get((key, shapes))
    if out is None:
        if len(_RESULT_SHAPES) >= _RESULT_SHAPES_MAX:
            _RESULT_SHAPES.clear()
        out = tuple(fn(*[_spec(x) for x in xs]).shape)
        _RESULT_SHAPES[(key, shapes)] = out
    return out


def _einsum_shape(subscripts, xs):
    return _result_shape(("einsum", subscripts), lambda *a: ops.einsum(subscripts, *a), xs)


def _parse_einsum(subscripts, shapes):
    """The contracted size K of `einsum(subscripts)` on operands of these
    shapes (memoized by the static shapes)."""
    return _contracted_size(subscripts, tuple(tuple(static_dim(d) for d in s) for s in shapes))


@functools.lru_cache(maxsize=1024)
def _contracted_size(subscripts, shapes):
    subs = subscripts.replace(" ", "")
    if "->" in subs:
        ins, out = subs.split("->")
    else:
        ins, out = subs, None
    ins = ins.split(",")
    if len(ins) != len(shapes):
        raise ValueError(
            f"`subscripts` {subscripts!r} names {len(ins)} operands, got "
            f"{len(shapes)}."
        )
    sizes = {}
    free = iter(c for c in string.ascii_uppercase[::-1])
    for term, shape in zip(ins, shapes):
        letters = _expand_ellipsis(term, len(shape), free)
        for c, d in zip(letters, shape):
            sizes[c] = d
    counts = {}
    for term in ins:
        for c in term.replace("...", ""):
            counts[c] = counts.get(c, 0) + 1
    if out is None:
        out = "".join(sorted(c for c, n in counts.items() if n == 1))
    contracted = [c for c in counts if c not in out]
    k = 1
    for c in contracted:
        if static_dim(sizes[c]) is None:
            raise ValueError(
                f"einsum needs a static size for contracted index {c!r}."
            )
        k *= int(sizes[c])
    return k


def _expand_ellipsis(term, ndim, free):
    if "..." not in term:
        return term
    n = ndim - (len(term) - 3)
    return term.replace("...", "".join(next(free) for _ in range(n)))


@memoize_scalars
def _divided(scale, f):
    """`scale / f` (the scale `rebalance` gives)."""
    return scale / f


def rebalanced_einsum(subscripts, a, b, factor, out_dtype=None):
    """`rebalance(einsum(subscripts, a, b, out_dtype=out_dtype), factor)`
    for a static power of two `factor`: where the GEMMs of
    `ops/_gemm.py` run the contraction, the factor joins the forward
    GEMM's (no node and no pass of its own, forward or backward);
    composed otherwise. The same scales and data bit for bit (a pow2
    factor commutes with rounding), except that a narrow output that the
    composition would overflow or flush before the factor is rounded
    once, after it."""
    check_rebalance_factor(factor)
    if not (is_scaled(a) or is_scaled(b)):
        return rebalance(einsum(subscripts, a, b, out_dtype=out_dtype), factor)
    return _einsum(subscripts, (a, b), out_dtype, None, None, factor)


def einsum(subscripts, *operands, out_dtype=None, calibrated=None, multiplier=None):
    """Rule: `s = Π s_i · P(sqrt(K))`, `d = einsum(data)/P(sqrt(K))`.

    K is the product of the sizes of the indices summed out (in an input,
    not in the output). `out_dtype` (ScaledTensor operands): the data dtype
    of the result, default the operands' result dtype; "float32" keeps the
    GEMM's float32 accumulator for float32 work that follows. `calibrated`:
    as in `matmul`. `multiplier` (ours; a finite nonzero Python number
    `k = m·P(k)`): the result is `multiply(einsum(...), k)`, with that
    rule's scales (`s·P(k)`, `g/P(k)`); where the two-operand GEMMs run as
    one custom gradient, `m` joins their factors (no pass of its own, each
    way: attention's `1/sqrt(d)`).
    """
    return _einsum(subscripts, operands, out_dtype, calibrated, multiplier, None)


def _einsum(subscripts, operands, out_dtype, calibrated, multiplier, out_factor):
    """`einsum`, then `rebalance(·, out_factor)` unless `out_factor` is None
    (`rebalanced_einsum`)."""
    if not isinstance(subscripts, str):
        raise TypeError(f"`subscripts` must be a string, got {subscripts!r}.")
    for i, x in enumerate(operands):
        check_input(f"operands[{i}]", x)
    out_dtype = _check_out_dtype(out_dtype)
    _split_multiplier(multiplier)  # checks it early
    if not any(is_scaled(x) for x in operands):
        out = ops.einsum(subscripts, *operands)
        out = out if multiplier is None else ops.multiply(out, multiplier)
        return out if out_dtype is None else ops.cast(out, out_dtype)
    like = next(x for x in operands if is_scaled(x))
    xs = same_dtype([promote(x, like, f"operands[{i}]") for i, x in enumerate(operands)])
    k = _parse_einsum(subscripts, [x.shape for x in xs])
    out_shape = _einsum_shape(subscripts, xs)

    def fn(*datas):
        return ops.einsum(subscripts, *datas)

    extra = _gemm_args(_two_operand_equation(subscripts, xs), *xs) if len(xs) == 2 else {}
    if extra and out_dtype is not None:
        extra["out_dtype"] = out_dtype
    calibrated = _check_calibrated(calibrated, len(xs))
    folded = multiplier if "gemms" in extra else None
    rebalanced = out_factor if "gemms" in extra else None
    out = _contract(
        fn, xs, k, out_shape, calibrated=calibrated, multiplier=folded, out_factor=rebalanced, **extra
    )
    if out_dtype is not None and out.dtype != out_dtype:
        out = _cast(out, out_dtype)
    if multiplier is not None and folded is None:
        out = multiply(out, multiplier)
    if out_factor is not None and rebalanced is None:
        out = rebalance(out, out_factor)
    return out


def conv(
    inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1, *,
    calibrated=None, operand_dtype=None,
):
    """Rule: as `matmul`, K the kernel's fan-in (`prod(kernel.shape[:-1])`,
    window × input channels per group): `s = sx·sw·P(sqrt(K))`,
    `d = conv(data)/P(sqrt(K))`. Arguments as `keras.ops.conv`;
    `calibrated` as in `matmul`. `operand_dtype` (keyword, ours): a
    16/32-bit float the convolution takes its data in, the kernel cast
    inside, its cotangent returned in its own dtype (`cast_contraction`)."""
    check_input("inputs", inputs)
    check_input("kernel", kernel)
    if not (is_scaled(inputs) or is_scaled(kernel)):
        return ops.conv(inputs, kernel, strides, padding, data_format, dilation_rate)
    like = inputs if is_scaled(inputs) else kernel
    operands = [promote(inputs, like, "inputs"), promote(kernel, like, "kernel")]
    if operand_dtype is None:
        x, w = same_dtype(operands)
    else:
        operand_dtype = _check_out_dtype(operand_dtype)
        x, w = cast_on_forward(operands[0], operand_dtype), operands[1]
    k = static_count(w.shape[:-1])

    def fn(a, b):
        return ops.conv(a, b, strides, padding, data_format, dilation_rate)

    out_shape = _result_shape(
        ("conv", repr((strides, padding, data_format, dilation_rate))), fn, (x, w)
    )
    return _contract(
        fn, [x, w], k, out_shape, calibrated=_check_calibrated(calibrated, 2),
        operand_dtype=operand_dtype,
    )


def _weight_equation(a, b):
    """The einsum equation of `a @ b` for a 2-D `b` (None otherwise)."""
    if len(b.shape) != 2 or not 1 <= len(a.shape) <= 9:
        return None
    return "abcdefgh"[: len(a.shape) - 1] + "k,kn->" + "abcdefgh"[: len(a.shape) - 1] + "n"


def _two_operand_equation(subscripts, xs):
    """`subscripts` when the GEMMs of `ops/_gemm.py` can run it: explicit
    output, no ellipsis, every index in the other operand or the output,
    no broadcasting of size-1 dims (memoized by the static shapes)."""
    return _gemm_equation(subscripts, tuple(tuple(static_dim(d) for d in x.shape) for x in xs))


@functools.lru_cache(maxsize=1024)
def _gemm_equation(subscripts, shapes):
    subs = subscripts.replace(" ", "")
    if "->" not in subs or "." in subs:
        return None
    try:
        grad_equations(subs)
    except ValueError:
        return None
    sizes = {}
    for term, shape in zip(subs.split("->")[0].split(","), shapes):
        if len(term) != len(shape):
            return None
        for c, d in zip(term, shape):
            if sizes.setdefault(c, d) != d:
                return None
    return subs


def _gemm_args(equation, a, b):
    """`_contract` arguments for the one-custom-gradient GEMMs, or none
    when the equation or the dtypes need the generic path."""
    if equation is None or not has_float32_gemm(a.data, b.data):
        return {}
    gemms = contraction_gemms(equation, tuple(static_dim(d) for d in b.shape))
    return {"gemms": gemms, "out_dtype": result_dtype(a.data, b.data)}


def _matmul_equation(a_ndim, b_ndim):
    if b_ndim != 2 or a_ndim < 1:
        raise ValueError(
            "`x2` of an FP8 matmul must be 2-D (a weight), and `x1` at least "
            f"1-D; got ranks {a_ndim} and {b_ndim}. Use fp8_einsum."
        )
    letters = "abcdefgh"[: a_ndim - 1]
    return f"{letters}k,kn->{letters}n"


def fp8_einsum(
    subscripts, x1, x2, forward_dtype="float8_e4m3fn", backward_dtype="float8_e5m2",
    route=None, out_dtype=None, calibrated=None,
):
    """`einsum` with FP8 operands: the scale rule of `einsum`; the data is
    cast (saturating) to `forward_dtype` for the GEMM, accumulated in
    float32, and the output gradient is cast to `backward_dtype` for the two
    backward GEMMs, all through `keras_scalify.backend.fp8` (route "auto",
    "native" or "simulate"). Output data in `out_dtype` (default `x1`'s
    dtype; "float32" keeps the accumulator for an epilogue that rounds
    once). `calibrated` as in `matmul`."""
    out_dtype = _check_out_dtype(out_dtype)

    ab = _operands(x1, x2)
    if ab is None:
        ab = (promote(x1, None, "x1"), promote(x2, None, "x2"))
    a, b = ab
    k = _parse_einsum(subscripts, [a.shape, b.shape])
    out_shape = _einsum_shape(subscripts, (a, b))
    _, gemms = fp8.fp8_gemms(
        subscripts.replace(" ", ""), a.shape, b.shape, forward_dtype, backward_dtype, route
    )
    out_dtype = a.dtype if out_dtype is None else out_dtype
    return _contract(
        None, [a, b], k, out_shape, gemms=gemms, out_dtype=out_dtype, quantized=True,
        calibrated=_check_calibrated(calibrated, 2),
    )


def fp8_matmul(
    x1, x2, forward_dtype="float8_e4m3fn", backward_dtype="float8_e5m2", route=None,
    out_dtype=None, calibrated=None,
):
    """`matmul` of an activation by a 2-D weight with FP8 operands (see
    `fp8_einsum`); the scale rule of `matmul`."""
    x1s = x1 if is_scaled(x1) else promote(x1, None, "x1")
    x2s = x2 if is_scaled(x2) else promote(x2, None, "x2")
    eq = _matmul_equation(len(x1s.shape), len(x2s.shape))
    return fp8_einsum(eq, x1s, x2s, forward_dtype, backward_dtype, route, out_dtype, calibrated)
