"""Scale rules of reductions: sum, mean, max, min."""

import builtins
import math

from keras import ops

from keras_scalify.core import pow2
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.ops._common import check_input
from keras_scalify.ops._common import is_scaled
from keras_scalify.ops._common import rescale
from keras_scalify.ops._common import safe_div
from keras_scalify.ops._common import scalars
from keras_scalify.ops._common import static_count
from keras_scalify.ops._common import static_dim


def _axes(x, axis):
    ndim = len(x.shape)
    if axis is None:
        return list(range(ndim))
    if isinstance(axis, int):
        axis = [axis]
    return [a % ndim for a in axis]


def reduced_count(x, axis):
    """Number of reduced elements: a Python int when static, else a tensor."""
    axes = _axes(x, axis)
    dims = [static_dim(x.shape[a]) for a in axes]
    if all(d is not None for d in dims):
        return static_count(dims)
    shape = ops.shape(x)
    n = ops.ones((), "float32")
    for a in axes:
        n = n * ops.cast(shape[a], "float32")
    return n


def pow2_sqrt(n):
    """`P(sqrt(n))` as float32: static for an int, a tensor otherwise."""
    if isinstance(n, int):
        return pow2.np_pow2_round_down(math.sqrt(builtins.max(n, 1)))
    return pow2.pow2_round_down(ops.sqrt(ops.maximum(n, 1.0)))


def _f32(data):
    """Reductions accumulate in float32: a float16 sum overflows before
    its 1/P(sqrt(N)) rescale could bring it back."""
    return ops.cast(data, "float32")


def sum(x, axis=None, keepdims=False):
    """Rule: `s = sa·r`, `d = sum(a)/r`, `r = P(sqrt(N))`, N reduced elements; `g = ga`.

    Example: 5 elements of scale 2 → scale 4, data `sum/2`.
    """
    check_input("x", x)
    if not is_scaled(x):
        return ops.sum(x, axis=axis, keepdims=keepdims)
    sa, ga = scalars(x)
    r = pow2_sqrt(reduced_count(x.data, axis))
    data = ops.sum(_f32(x.data), axis=axis, keepdims=keepdims)
    # backward: the broadcast cotangent keeps its grad scale (c·f = 1).
    data = rescale(data, 1.0 / r, ops.ones((), "float32"))
    return ScaledTensor(ops.cast(data, x.dtype), sa * r, ga)


def mean(x, axis=None, keepdims=False):
    """Rule: as `sum`, then `1/N = m·p` split exactly: `s = sa·r·p`, `d = sum(a)·m/r`; `g = ga/p`.

    Example: ones (4, 8) of scale 1 → scale 0.125, data 8.
    """
    check_input("x", x)
    if not is_scaled(x):
        return ops.mean(x, axis=axis, keepdims=keepdims)
    sa, ga = scalars(x)
    n = reduced_count(x.data, axis)
    r = pow2_sqrt(n)
    if isinstance(n, int):
        # Python floats (rounded to float32 where they meet a tensor).
        p, m = pow2.np_pow2_decompose(1.0 / n)
    else:
        p, m = pow2.pow2_decompose(1.0 / n)
    data = ops.sum(_f32(x.data), axis=axis, keepdims=keepdims)
    data = rescale(data, m / r, m)
    return ScaledTensor(ops.cast(data, x.dtype), sa * r * p, safe_div(ga, p))


def max(x, axis=None, keepdims=False):
    """Rule: scale and grad scale unchanged; `d = max(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.max(x, axis=axis, keepdims=keepdims)
    data = ops.max(x.data, axis=axis, keepdims=keepdims)
    return ScaledTensor(data, x.scale, x.grad_scale)


def min(x, axis=None, keepdims=False):
    """Rule: scale and grad scale unchanged; `d = min(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.min(x, axis=axis, keepdims=keepdims)
    data = ops.min(x.data, axis=axis, keepdims=keepdims)
    return ScaledTensor(data, x.scale, x.grad_scale)


def var(x, axis=None, keepdims=False):
    """Rule: `s = sa²`, `d = var(a)` (float32, then the data dtype); `g = ga/sa`.

    The deviations are taken from the data, so no rounding of the mean to
    the data dtype enters (as `keras.ops.var`, which works in float32)."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.var(x, axis=axis, keepdims=keepdims)
    sa, ga = scalars(x)
    g = safe_div(ga, sa)
    # d var / d a = 2(a - mean)/n ~ 2/sqrt(n)·|var|/|a|: the data cotangent
    # is `cotangent·g·sa²/(ga·sa)` = cotangent (c = 1).
    data = ops.var(_f32(x.data), axis=axis, keepdims=keepdims)
    return ScaledTensor(ops.cast(data, x.dtype), sa * sa, g)
