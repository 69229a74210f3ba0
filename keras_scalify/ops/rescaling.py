"""Dynamic and delayed rescaling.

Forward rescaling (`dynamic_rescale_l1/l2/max`) moves an exact power of two
from the data to the scale, chosen from a statistic of the data: the
represented value does not change.

Gradient rescaling (`dynamic_rescale_*_grad`) cannot be decided inside the
backward pass: autodiff sums the cotangents of a tensor used twice, so each
tensor's grad scale is fixed in the forward pass (docs/design.md). It is
therefore *delayed*: the statistic measured on this step's cotangent sets
the grad scale of the next step. The state is one float32 scalar (history
length 1; 0 means "not calibrated yet: keep the propagated grad scale"),
and the new value leaves the backward pass as the "gradient" of that state,
the route of Keras's `overwrite_with_gradient` variables (see
`keras_scalify.layers.DynamicRescaleGrad`).
"""

import math

from keras import ops

from keras_scalify.backend import scalar as S
from keras_scalify.core import pow2
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import _check_number_scale
from keras_scalify.ops._common import _mul_pow2
from keras_scalify.ops._common import promote
from keras_scalify.ops._common import rescale
from keras_scalify.ops._common import safe_div
from keras_scalify.ops._common import scale_grad
from keras_scalify.ops._common import scalars
from keras_scalify.ops._common import stop

STATISTICS = ("l1", "l2", "max")


def data_statistic(data, statistic):
    """Mean |d| (l1), RMS (l2) or max |d| (max) of `data`, in float32."""
    d = S.cast(data, "float32")
    if statistic == "l1":
        return S.mean(S.abs(d))
    if statistic == "l2":
        return S.rms(d)
    if statistic == "max":
        return S.max(S.abs(d))
    raise ValueError(
        f"`statistic` must be one of {STATISTICS}, got {statistic!r}."
    )


def valid_pow2(stat):
    """`P(stat)` when finite and > 0, else 1 (rescaling is then a no-op)."""
    ok = S.logical_and(S.isfinite(stat), S.greater(stat, 0.0))
    return S.where(ok, pow2.pow2_round_down(stat), S.ones_like(stat))


def rescale_by_statistic(x, stat):
    """Rule: `k = P(stat)`; `s = sa·k`, `d = a/k`; `g` unchanged. Exact.
    A non-finite or zero `stat` leaves `x` as is (k = 1)."""
    sa, ga = scalars(x)
    k = stop(valid_pow2(stat))
    one = ops.ones((), "float32")
    data = rescale(x.data, one / k, one)
    return ScaledTensor(data, sa * k, ga)


def overflow_safe_rms(data):
    """The RMS of `data` in float32, measured on `data / P(max|data|)` so
    that the squares cannot overflow (1e30 has an RMS); two reductions."""
    d = ops.cast(data, "float32")
    k = stop(valid_pow2(S.max(ops.abs(d))))
    return ops.sqrt(ops.mean(ops.square(d / k))) * k


def dynamic_rescale(x, statistic="l2"):
    """Rule: `k = P(stat(d))`; `s = sa·k`, `d = a/k`; `g` unchanged. Exact."""
    x = promote(x, None, "x")
    return rescale_by_statistic(x, data_statistic(x.data, statistic))


def dynamic_rescale_l1(x):
    """`dynamic_rescale` with the mean absolute value."""
    return dynamic_rescale(x, "l1")


def dynamic_rescale_l2(x):
    """`dynamic_rescale` with the RMS (paper Alg. 4)."""
    return dynamic_rescale(x, "l2")


def dynamic_rescale_max(x):
    """`dynamic_rescale` with the max absolute value."""
    return dynamic_rescale(x, "max")


# When the statistic cannot be measured (every value underflowed to 0, or
# overflowed), move the grad scale by 2**12 and measure again next step, as
# automatic loss scaling does: from grad scale 1, float16 gradients of 1e-8
# are calibrated after two steps.
RECOVERY_EXPONENT = 12
# An all-zero cotangent lowers its grad scale (it may be an underflow), but
# not below 2**-100: the pow2 factors built from grad scales need headroom
# below float32's smallest normal (at 2**-126, a LayerNorm gamma whose
# gradient was zero for many steps got a factor that flushed to zero, and
# NaN gradients). A 16-bit cotangent more than 2**100 below its true units
# reads as zero.
ZERO_SEARCH_MIN_EXPONENT = -100


def next_grad_scale(g, g_out, statistic):
    """The grad scale for the next step from this step's cotangent `g`
    (in `g_out` units): `P(g_out·stat(g))`; `g_out·2**-12` if every value is
    0; `g_out·2**12` if the statistic is not finite."""
    return grad_scale_from_statistic(data_statistic(g, statistic), g_out)


def grad_scale_from_statistic(stat, g_out, zero_may_be_underflow=True):
    """`next_grad_scale` from an already measured statistic `stat` (float32
    scalar) of a cotangent in `g_out` units.

    Elementwise: `stat` and `g_out` may be vectors (one entry per weight),
    and `zero_may_be_underflow` a bool tensor of the same length.

    `zero_may_be_underflow=False` (a float32 cotangent, whose every value
    would have to be below 2**-149 to vanish): an all-zero cotangent is a
    true zero (an unused weight, a dead unit), so the grad scale is kept
    rather than lowered towards the floor. Otherwise it is lowered by
    2**12, not below 2**-100 (`ZERO_SEARCH_MIN_EXPONENT`)."""
    host = _host_grad_scale(stat, g_out, zero_may_be_underflow)
    if host is not None:
        return host
    finite = S.isfinite(stat)
    e_out = pow2.pow2_exponent(g_out)
    e_stat = pow2.pow2_exponent(S.where(finite, stat, S.ones_like(stat)))
    if zero_may_be_underflow is False:
        e_zero = e_out
    else:
        floor = S.minimum(e_out, ZERO_SEARCH_MIN_EXPONENT)
        e_zero = S.maximum(e_out - RECOVERY_EXPONENT, floor)
        if zero_may_be_underflow is not True:
            e_zero = S.where(zero_may_be_underflow, e_zero, e_out)
    e_new = S.where(S.greater(stat, 0.0), e_out + e_stat, e_zero)
    e_new = S.where(finite, e_new, e_out + RECOVERY_EXPONENT)
    return pow2.pow2_from_exponent(e_new)


def _host_grad_scale(stat, g_out, zero_may_be_underflow):
    """`grad_scale_from_statistic` in Python, bit for bit, where the host
    has both scalars (`backend.scalar.host_value`: eager torch on the CPU;
    the statistic is new every step, so no memo would hit): a cached
    float32 tensor. None elsewhere (then the tensor ops run)."""
    if type(zero_may_be_underflow) is not bool:
        return None
    v, g = S.host_value(stat), S.host_value(g_out)
    if v is None or g is None:
        return None
    return S.float32_scalar(host_grad_scale(v, g, zero_may_be_underflow), stat)


def host_grad_scale(v, g, zero_may_be_underflow):
    """`grad_scale_from_statistic` of Python floats holding float32 values
    (statistic `v`, grad scale `g`), in Python, bit for bit: a Python
    float."""
    e_out = pow2.host_exponent(g)
    if not math.isfinite(v):
        e_new = e_out + RECOVERY_EXPONENT
    elif v > 0.0:
        e_new = e_out + pow2.host_exponent(v)
    elif zero_may_be_underflow:
        e_new = max(e_out - RECOVERY_EXPONENT, min(e_out, ZERO_SEARCH_MIN_EXPONENT))
    else:
        e_new = e_out
    return math.ldexp(1.0, min(max(e_new, -126), 127))


def check_rebalance_factor(factor):
    """`factor` as a Python float; a ValueError unless it is a positive
    power of two."""
    f = float(factor)
    if not (f > 0 and pow2.np_pow2_round_down(f) == f):
        raise ValueError(f"`factor` must be a positive power of two, got {factor!r}.")
    return f


def rebalance(x, factor):
    """Rule: `s = sa/factor`, `d = a·factor` for a static power of two
    `factor`; grad scale unchanged. Exact (paper Alg. 4's `rebalance`)."""
    x = promote(x, None, "x")
    f = check_rebalance_factor(factor)
    one = ops.ones((), "float32")
    data = rescale(x.data, f, one)
    return ScaledTensor(data, stop(x.scale) / f, x.grad_scale)


def with_grad_scale(x, grad_scale):
    """Rule: `g = grad_scale` (a float32 power of two, or 0 for "keep
    `ga`"); scale and data unchanged.

    Backward: the cotangent is re-expressed in `ga` units (`·g/ga`, exact,
    in the data's dtype, so a float32 tensor takes any pow2 ratio). For a
    grad scale predicted by an op downstream rather than by the rules
    upstream (attention's probabilities, whose cotangent is the values'
    business, not the scores')."""
    x = promote(x, None, "x")
    _check_number_scale("grad_scale", grad_scale, allow_zero=True)
    if grad_scale is None or isinstance(grad_scale, (str, bytes, bool)):
        raise TypeError(
            f"`grad_scale` must be a float32 power of two (or 0), got "
            f"{type(grad_scale).__name__} {grad_scale!r:.80}."
        )
    g, factor = grad_scale_and_factor(x, grad_scale)
    return ScaledTensor(scale_grad(x.data, factor), x.scale, g)


def grad_scale_and_factor(x, grad_scale):
    """`(g, factor)` of `with_grad_scale(x, grad_scale)`: the grad scale it
    sets and the factor its backward re-expresses the cotangent by (for a
    node that applies that factor inside its own backward)."""
    _, ga = scalars(x)
    return _chosen_grad_scale(stop(pow2.as_dtype(grad_scale, "float32")), ga)


@S.memoize_scalars
def _chosen_grad_scale(g, ga):
    """`(g if g > 0 else ga, that / ga)`: a grad scale and the factor that
    re-expresses a cotangent from it in `ga` units."""
    g = S.where(S.greater(g, 0.0), g, ga)
    return g, safe_div(g, ga)


def _delayed_fn(statistic):
    @ops.custom_gradient
    def fn(data, state, g_in, g_out):
        def grad(*args, upstream=None, variables=None):
            g = args[0] if upstream is None else upstream
            # Re-express the cotangent in the input's grad scale.
            g_data = _mul_pow2(g, safe_div(g_out, g_in))
            return g_data, next_grad_scale(g, g_out, statistic), None, None

        return S.identity_in_custom_gradient(data), grad

    return fn


def delayed_rescale_grad(x, state, statistic="l2"):
    """Rule: `g = P(state)` (the previous step's measured grad scale,
    rounded down to a power of two: a layer called twice in a step receives
    the sum of two; the propagated `ga` while `state == 0`); scale and data
    unchanged.

    Backward: the cotangent is re-expressed in `ga` units (exact pow2), and
    the "gradient" of `state` is the next grad scale (`next_grad_scale`).
    `state` is a float32 scalar tensor read from an
    `overwrite_with_gradient` variable.
    """
    x, state, ga, g_out = _delayed_scalars(x, state, statistic)
    data = _DELAYED_FNS[statistic](x.data, state, ga, g_out)
    return ScaledTensor(data, x.scale, g_out)


def delayed_rescale_parts(x, state, statistic="l2"):
    """`delayed_rescale_grad(x, state, statistic)` in parts, for a node
    that runs it inside its own backward (`backend.fused.affine_normalize`):
    `(x with the grad scale g_out, state, k, next_state)`, where the node
    multiplies its input cotangent by `k = g_out/ga` and returns
    `next_state(cotangent before k)` as the state's gradient."""
    x, state, ga, g_out = _delayed_scalars(x, state, statistic)
    rescaled = ScaledTensor(x.data, x.scale, g_out)
    return rescaled, state, safe_div(g_out, ga), lambda g: next_grad_scale(g, g_out, statistic)


def _delayed_scalars(x, state, statistic):
    """`(x, state, ga, g_out)` of `delayed_rescale_grad`, its arguments
    checked (`x` as a ScaledTensor, `state` as float32)."""
    if statistic not in STATISTICS:
        raise ValueError(
            f"`statistic` must be one of {STATISTICS}, got {statistic!r}."
        )
    x = promote(x, None, "x")
    _, ga = scalars(x)
    state = pow2.as_dtype(state, "float32")
    # (The state variable's detached tensor: its key kept per version.)
    return x, state, ga, _delayed_grad_scale(S.detached_tensor(state), ga)


@S.memoize_scalars
def _delayed_grad_scale(state, ga):
    """`P(state)` where > 0, else `ga`. (`P`: a power of two even when the
    layer ran twice in a step and autodiff summed two next grad scales
    into the state.)"""
    s_state = pow2.pow2_round_down(state)
    return S.where(S.greater(s_state, 0.0), s_state, ga)


_DELAYED_FNS = {statistic: _delayed_fn(statistic) for statistic in STATISTICS}


def dynamic_rescale_l1_grad(x, state):
    """`delayed_rescale_grad` with the mean absolute value."""
    return delayed_rescale_grad(x, state, "l1")


def dynamic_rescale_l2_grad(x, state):
    """`delayed_rescale_grad` with the RMS (paper Alg. 5: LayerNorm inputs)."""
    return delayed_rescale_grad(x, state, "l2")


def dynamic_rescale_max_grad(x, state):
    """`delayed_rescale_grad` with the max absolute value."""
    return delayed_rescale_grad(x, state, "max")
