"""Scale rules of pointwise transcendental functions.

These are computed on the represented values in float32 (`u = a·sa`) and
returned with a rule-given output scale, so no scale can overflow the data
dtype; cotangents are exact.
"""

from keras import ops

from keras_scalify.backend import scalar as S
from keras_scalify.core import pow2
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_input
from keras_scalify.ops._common import rescale
from keras_scalify.ops._common import safe_div
from keras_scalify.ops._common import scalars


def pointwise(x, fn, s_out, g_out):
    """`fn` applied to the true values of `x`, output with scale `s_out`.

    Forward `d = fn(a·sa)/s_out` in float32; backward: the cotangent of `a`
    is `fn'·cotangent·g_out/ga` (the convention of docs/design.md).
    """
    sa, ga = scalars(x)
    one = S.float32_scalar(1.0, x.data)
    back, inv_out = _pointwise_factors(g_out, ga, s_out, one)
    u = rescale(pow2.as_dtype(x.data, "float32"), sa, back)
    v = rescale(fn(u), inv_out, one)
    return ScaledTensor(pow2.as_dtype(v, x.dtype), s_out, g_out)


@S.memoize_scalars
def _pointwise_factors(g_out, ga, s_out, one):
    """`(g_out/ga, 1/s_out)`, each 0 where its divisor is (`pointwise`)."""
    return safe_div(g_out, ga), safe_div(one, s_out)


def _plain_or_scaled(x, plain_fn):
    check_input("x", x)
    return None if is_scaled(x) else plain_fn(x)


def exp(x):
    """Rule: `s = 1`, `d = exp(a·sa)` (float32); `g = ga`."""
    if not is_scaled(x):
        return _plain_or_scaled(x, ops.exp)
    _, ga = scalars(x)
    return pointwise(x, ops.exp, ops.ones((), "float32"), ga)


def log(x):
    """Rule: `s = 1`, `d = log(a) + log(sa)` (float32, no overflow); `g = ga·sa`."""
    if not is_scaled(x):
        return _plain_or_scaled(x, ops.log)
    sa, ga = scalars(x)
    data = ops.log(ops.cast(x.data, "float32")) + ops.log(sa)
    return ScaledTensor(ops.cast(data, x.dtype), ops.ones((), "float32"), ga * sa)


def _bounded_scale(sa):
    """`min(sa, 1)`: for |f(x)| <= min(|x|, 1) (tanh, erf up to 2/√π)."""
    return ops.minimum(sa, ops.ones((), "float32"))


def tanh(x):
    """Rule: `s = min(sa, 1)` (|tanh x| ≤ min(|x|, 1)), `d = tanh(a·sa)/s`; `g = ga`."""
    if not is_scaled(x):
        return _plain_or_scaled(x, ops.tanh)
    sa, ga = scalars(x)
    return pointwise(x, ops.tanh, _bounded_scale(sa), ga)


def erf(x):
    """Rule: `s = min(sa, 1)`, `d = erf(a·sa)/s`; `g = ga`."""
    if not is_scaled(x):
        return _plain_or_scaled(x, ops.erf)
    sa, ga = scalars(x)
    return pointwise(x, ops.erf, _bounded_scale(sa), ga)


def sigmoid(x):
    """Rule: `s = 1` (values in (0, 1)), `d = sigmoid(a·sa)`; `g = ga`."""
    if not is_scaled(x):
        return _plain_or_scaled(x, ops.sigmoid)
    _, ga = scalars(x)
    return pointwise(x, ops.sigmoid, ops.ones((), "float32"), ga)


def _half_exponent_scale(sa):
    """`2**floor(e/2)` for `sa = 2**e` (0 for 0): `sqrt(sa)` up to a factor
    of 1 or 2."""
    e = pow2.pow2_exponent(sa)
    h = pow2.pow2_from_exponent(ops.floor_divide(e, 2))
    return ops.where(ops.equal(sa, 0), ops.zeros_like(sa), h)


def _balanced_grad_scale(sa, ga, s):
    """`ga·sa/s`: for f with |f'(x)| ≈ |f(x)|/|x| (powers), the data
    cotangent `f'·cotangent·g/ga` then stays at the output's."""
    return ga * safe_div(sa, s)


def rsqrt(x):
    """Rule: `s = 1/P(sqrt(sa))`, `d = rsqrt(a·sa)/s`; `g = ga·sa/s`."""
    if not is_scaled(x):
        return _plain_or_scaled(x, ops.rsqrt)
    sa, ga = scalars(x)
    s = safe_div(ops.ones_like(sa), _half_exponent_scale(sa))
    return pointwise(x, ops.rsqrt, s, _balanced_grad_scale(sa, ga, s))


def reciprocal(x):
    """Rule: `s = 1/sa`, `d = 1/a`; `g = ga·sa²`."""
    if not is_scaled(x):
        return _plain_or_scaled(x, ops.reciprocal)
    sa, ga = scalars(x)
    s = safe_div(ops.ones_like(sa), sa)
    return pointwise(x, ops.reciprocal, s, _balanced_grad_scale(sa, ga, s))


def sin(x):
    """Rule: `s = min(sa, 1)` (|sin x| ≤ min(|x|, 1)), `d = sin(a·sa)/s`; `g = ga`."""
    if not is_scaled(x):
        return _plain_or_scaled(x, ops.sin)
    sa, ga = scalars(x)
    return pointwise(x, ops.sin, _bounded_scale(sa), ga)


def cos(x):
    """Rule: `s = 1` (|cos x| ≤ 1), `d = cos(a·sa)`; `g = ga`."""
    if not is_scaled(x):
        return _plain_or_scaled(x, ops.cos)
    _, ga = scalars(x)
    return pointwise(x, ops.cos, ops.ones((), "float32"), ga)
