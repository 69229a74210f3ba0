"""Comparisons: plain boolean tensors, computed on a common scale in float32."""

from keras import ops

from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops.selection import _common_scale


def _compare(fn, x1, x2):
    if not (is_scaled(x1) or is_scaled(x2)):
        return fn(x1, x2)
    # Rescale in float32: a float16 operand far below the other's scale
    # would underflow on the way to the common scale.
    x1, x2 = _f32(x1), _f32(x2)
    (a, b), _, _, _ = _common_scale([x1, x2], ["x1", "x2"])
    a = ops.cast(a, "float32") if not isinstance(a, float) else a
    b = ops.cast(b, "float32") if not isinstance(b, float) else b
    return fn(a, b)


def _f32(x):
    if is_scaled(x):
        return ScaledTensor(ops.cast(x.data, "float32"), x.scale, x.grad_scale)
    if hasattr(x, "dtype"):
        return ops.cast(x, "float32")
    return x


def equal(x1, x2):
    """`x1 == x2` on the represented values (plain bool)."""
    return _compare(ops.equal, x1, x2)


def not_equal(x1, x2):
    """`x1 != x2` on the represented values (plain bool)."""
    return _compare(ops.not_equal, x1, x2)


def less(x1, x2):
    """`x1 < x2` on the represented values (plain bool)."""
    return _compare(ops.less, x1, x2)


def less_equal(x1, x2):
    """`x1 <= x2` on the represented values (plain bool)."""
    return _compare(ops.less_equal, x1, x2)


def greater(x1, x2):
    """`x1 > x2` on the represented values (plain bool)."""
    return _compare(ops.greater, x1, x2)


def greater_equal(x1, x2):
    """`x1 >= x2` on the represented values (plain bool)."""
    return _compare(ops.greater_equal, x1, x2)
