"""Scale rules of elementwise arithmetic (jax-scalify's rules, pow2 down).

Notation in docstrings: inputs `(a, sa)`, `(b, sb)` (data, scale), gradient
scales `ga`, `gb`; output `(d, s)` with gradient scale `g`. `P` is
`pow2_round_down`; `mean` is the pow2 geometric mean.
"""

import math

import numpy as np
from keras import ops

from keras_scalify.backend import fused
from keras_scalify.backend import scalar as S
from keras_scalify.core import pow2
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_calibrated
from keras_scalify.ops._common import check_input
from keras_scalify.ops._common import grad_factor
from keras_scalify.ops._common import is_static_scalar
from keras_scalify.ops._common import pow2_mean
from keras_scalify.ops._common import promote
from keras_scalify.ops._common import rescale
from keras_scalify.ops._common import safe_div
from keras_scalify.ops._common import same_dtype
from keras_scalify.ops._common import scalars
from keras_scalify.ops._common import scale_grad
from keras_scalify.ops._common import times
from keras_scalify.ops._common import votes


def binary_operands(x1, x2):
    """Both operands as ScaledTensors (None if neither is scaled)."""
    check_input("x1", x1)
    check_input("x2", x2)
    if not (is_scaled(x1) or is_scaled(x2)):
        return None
    like = x1 if is_scaled(x1) else x2
    return same_dtype([promote(x1, like, "x1"), promote(x2, like, "x2")])


def add_scale(sa, sb):
    """`P(sqrt(sa**2 + sb**2))`, which for scales that are powers of two (or
    0) is `max(sa, sb)`: `sqrt(M² + m²)` lies in `[M, sqrt(2)·M]` for
    `m <= M`, below `2M`. One op instead of a dozen on eager torch;
    non-finite scales stay non-finite."""
    return S.maximum(sa, sb)


@S.memoize_scalars
def _sum_scales(sa, ga, sb, gb, calibrated):
    """The scalars of the `add` rule: `(s, g, fa, ba, fb, bb)`, each
    operand's forward factor `f = s_i/s` and backward factor `b = g/g_i`."""
    s = add_scale(sa, sb)
    g = pow2_mean(*votes([ga, gb], calibrated))
    return s, g, safe_div(sa, s), safe_div(g, ga), safe_div(sb, s), safe_div(g, gb)


def _add_sub(x1, x2, sign, calibrated=None):
    a, b = x1, x2
    s, g, fa, ba, fb, bb = _sum_scales(*scalars(a), *scalars(b), check_calibrated(calibrated, 2))
    if fused.applies(a.data, b.data, fa, ba, fb, bb):
        return ScaledTensor(fused.scaled_sum(a.data, fa, ba, b.data, fb, bb, sign), s, g)
    da, db = rescale(a.data, fa, ba), rescale(b.data, fb, bb)
    return ScaledTensor(da + db if sign > 0 else da - db, s, g)


def add(x1, x2, *, calibrated=None):
    """Rule: `s = P(sqrt(sa² + sb²))`, `d = a·sa/s + b·sb/s`; `g = mean(ga, gb)`.

    Example: `as_scaled(ones, 2) + as_scaled(ones, 4)` → scale 4, data 1.5.
    `calibrated` (keyword, ours): one bool per operand, false where its grad
    scale was not measured (`ScaledVariable.calibrated`): it does not vote.
    """
    ab = binary_operands(x1, x2)
    if ab is None:
        return ops.add(x1, x2)
    return _add_sub(*ab, 1.0, calibrated)


def subtract(x1, x2):
    """Rule: as `add`, `d = a·sa/s - b·sb/s`."""
    ab = binary_operands(x1, x2)
    if ab is None:
        return ops.subtract(x1, x2)
    return _add_sub(*ab, -1.0)


def _static_gs(ga, k, power):
    """`ga * P(|k|)**power` for a static constant `k` (0/inf leave `ga`)."""
    k = float(k)
    if k == 0.0 or not math.isfinite(k):
        return ga
    return ga * pow2.np_pow2_round_down(k) ** power


@S.memoize_scalars
def _product_grad_scales(sa, ga, sb, gb, s, calibrated):
    """The grad scalars of the `multiply` rule: `(g, ca, cb)`, the output's
    grad scale and each operand's cotangent factor."""
    g = pow2_mean(*votes([safe_div(ga, sb), safe_div(gb, sa)], calibrated))
    return g, grad_factor(s, g, sa, ga), grad_factor(s, g, sb, gb)


def multiply(x1, x2, *, calibrated=None):
    """Rule: `s = sa·sb`, `d = a·b`; `g = mean(ga/sb, gb/sa)`.

    A Python scalar `k` is split exactly as `mantissa · P(k)`: `g = ga/P(k)`.
    `calibrated`: as in `add`.
    """
    ab = binary_operands(x1, x2)
    if ab is None:
        return ops.multiply(x1, x2)
    a, b = ab
    (sa, ga), (sb, gb) = scalars(a), scalars(b)
    s = times(sa, sb)
    if is_static_scalar(x2) or is_static_scalar(x1):
        x, k = (a, x2) if is_static_scalar(x2) else (b, x1)
        sx, gx = scalars(x)
        g = _static_gs(gx, k, -1)
        return ScaledTensor(a.data * b.data, s, g)
    g, ca, cb = _product_grad_scales(sa, ga, sb, gb, s, check_calibrated(calibrated, 2))
    if fused.applies(a.data, b.data, ca, cb):
        return ScaledTensor(fused.scaled_product(a.data, ca, b.data, cb), s, g)
    return ScaledTensor(scale_grad(a.data, ca) * scale_grad(b.data, cb), s, g)


def divide(x1, x2):
    """Rule: `s = sa/sb`, `d = a/b`; `g = mean(ga·sb, gb·sb²/sa)`.

    Dividing by a Python scalar `k`: `g = ga·P(k)`.
    """
    ab = binary_operands(x1, x2)
    if ab is None:
        return ops.divide(x1, x2)
    a, b = ab
    (sa, ga), (sb, gb) = scalars(a), scalars(b)
    s = sa / sb
    if is_static_scalar(x2):
        return ScaledTensor(a.data / b.data, s, _static_gs(ga, x2, 1))
    if is_static_scalar(x1):
        g = safe_div(gb * sb * sb, sa)
        db = scale_grad(b.data, grad_factor(s, g, sb, gb))
        return ScaledTensor(a.data / db, s, g)
    g = pow2_mean(ga * sb, safe_div(gb * sb * sb, sa))
    da = scale_grad(a.data, grad_factor(s, g, sa, ga))
    db = scale_grad(b.data, grad_factor(s, g, sb, gb))
    return ScaledTensor(da / db, s, g)


def _unary(x, name):
    check_input("x", x)
    return x if is_scaled(x) else None


def negative(x):
    """Rule: scale, grad scale unchanged; `d = -a`."""
    if _unary(x, "negative") is None:
        return ops.negative(x)
    return ScaledTensor(ops.negative(x.data), x.scale, x.grad_scale)


def abs(x):
    """Rule: scale, grad scale unchanged; `d = |a|`."""
    if _unary(x, "abs") is None:
        return ops.abs(x)
    return ScaledTensor(ops.abs(x.data), x.scale, x.grad_scale)


def square(x):
    """Rule: `s = sa²`, `d = a²`; `g = ga/sa`."""
    if _unary(x, "square") is None:
        return ops.square(x)
    sa, ga = scalars(x)
    return ScaledTensor(ops.square(x.data), sa * sa, safe_div(ga, sa))


def power(x1, x2):
    """Rule for an integer exponent `y`: `s = sa**y`, `d = a**y`; `g = ga/sa**(y-1)`."""
    check_input("x1", x1)
    if not is_scaled(x1):
        return ops.power(x1, x2)
    if not isinstance(x2, (int, np.integer)) or isinstance(x2, bool):
        raise TypeError(
            f"`x2` must be a Python int for a ScaledTensor base, got {x2!r}."
        )
    y = int(x2)
    sa, ga = scalars(x1)
    s = ops.power(sa, float(y))
    g = safe_div(ga, ops.power(sa, float(y - 1)))
    return ScaledTensor(ops.power(x1.data, y), s, g)


def sqrt(x):
    """Rule: `s = P(sqrt(sa))` (exact), `d = sqrt(a·sa/s²)`; `g = ga·s`."""
    if _unary(x, "sqrt") is None:
        return ops.sqrt(x)
    sa, ga = scalars(x)
    e = pow2.pow2_exponent(sa)
    s = pow2.pow2_from_exponent(ops.floor_divide(e, 2))
    s = ops.where(ops.equal(sa, 0), ops.zeros_like(sa), s)
    k = safe_div(sa, s * s)  # 1 or 2
    g = ga * s
    a = scale_grad(x.data, grad_factor(s, g, sa, ga))
    data = ops.sqrt(a * ops.cast(k, a.dtype))
    return ScaledTensor(data, s, g)
