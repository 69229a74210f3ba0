"""`contraction_plus`: a two-operand contraction with the bias add and
activation that follow it (a Dense layer's), as one custom gradient of
the GEMMs of `ops/_gemm.py`."""

from keras import ops

from keras_scalify.backend import scalar as S
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
# `gate_epilogue` (`backend.fused`'s) is read from the package,
# `linalg.gate_epilogue`, at each call: where tests replace it.
from keras_scalify.ops import linalg
from keras_scalify.ops._common import check_calibrated as _check_calibrated
from keras_scalify.ops._common import scalars
from keras_scalify.ops._common import static_count
from keras_scalify.ops._common import static_pow2_sqrt
from keras_scalify.ops._common import times
from keras_scalify.ops._gemm import scaled_gemms
from keras_scalify.ops._gemm import scaled_gemms_plus
from keras_scalify.ops.arithmetic import _sum_scales
from keras_scalify.ops.linalg.rules import _contraction_scales
from keras_scalify.ops.linalg.rules import _gemm_factors
from keras_scalify.ops.linalg.rules import _sizes
from keras_scalify.ops.linalg.shapes import _einsum_shape
from keras_scalify.ops.linalg.shapes import _gemm_args
from keras_scalify.ops.linalg.shapes import _operands
from keras_scalify.ops.linalg.shapes import _parse_einsum
from keras_scalify.ops.linalg.shapes import _result_shape
from keras_scalify.ops.linalg.shapes import _static_k
from keras_scalify.ops.linalg.shapes import _two_operand_equation
from keras_scalify.ops.linalg.shapes import _weight_equation


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
        u_scale = None if gate is None else linalg.gate_epilogue(scale, gate)
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
        u_scale = None if gate is None else linalg.gate_epilogue(s, gate)
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
