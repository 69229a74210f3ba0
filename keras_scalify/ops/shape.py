"""Scale rules of shape, indexing and dtype ops: scale and grad scale unchanged."""

from keras import ops

from keras_scalify.backend.scalar import dtype_name
from keras_scalify.core.formats import FORMATS
from keras_scalify.core.formats import FP8_DTYPES
from keras_scalify.core.formats import saturating_cast
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_input


def _same_scale(x, data):
    return ScaledTensor(data, x.scale, x.grad_scale)


def reshape(x, newshape):
    """Rule: scale unchanged; `d = reshape(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.reshape(x, newshape)
    return _same_scale(x, ops.reshape(x.data, newshape))


def transpose(x, axes=None):
    """Rule: scale unchanged; `d = transpose(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.transpose(x, axes)
    return _same_scale(x, ops.transpose(x.data, axes))


def expand_dims(x, axis):
    """Rule: scale unchanged; `d = expand_dims(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.expand_dims(x, axis)
    return _same_scale(x, ops.expand_dims(x.data, axis))


def squeeze(x, axis=None):
    """Rule: scale unchanged; `d = squeeze(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.squeeze(x, axis)
    return _same_scale(x, ops.squeeze(x.data, axis))


def slice(inputs, start_indices, shape):
    """Rule: scale unchanged; `d = slice(a)`."""
    check_input("inputs", inputs)
    if not is_scaled(inputs):
        return ops.slice(inputs, start_indices, shape)
    return _same_scale(inputs, ops.slice(inputs.data, start_indices, shape))


def repeat(x, repeats, axis=None):
    """Rule: scale unchanged; `d = repeat(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.repeat(x, repeats, axis=axis)
    return _same_scale(x, ops.repeat(x.data, repeats, axis=axis))


def tile(x, repeats):
    """Rule: scale unchanged; `d = tile(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.tile(x, repeats)
    return _same_scale(x, ops.tile(x.data, repeats))


def broadcast_to(x, shape):
    """Rule: scale unchanged; `d = broadcast_to(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.broadcast_to(x, shape)
    return _same_scale(x, ops.broadcast_to(x.data, shape))


def moveaxis(x, source, destination):
    """Rule: scale unchanged; `d = moveaxis(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.moveaxis(x, source, destination)
    return _same_scale(x, ops.moveaxis(x.data, source, destination))


def swapaxes(x, axis1, axis2):
    """Rule: scale unchanged; `d = swapaxes(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.swapaxes(x, axis1, axis2)
    return _same_scale(x, ops.swapaxes(x.data, axis1, axis2))


def split(x, indices_or_sections, axis=0):
    """Rule: each piece keeps the scale; `d_i = split(a)_i`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.split(x, indices_or_sections, axis=axis)
    return [_same_scale(x, d) for d in ops.split(x.data, indices_or_sections, axis=axis)]


def take(x, indices, axis=None):
    """Rule: scale unchanged; `d = take(a, indices)` (an embedding lookup)."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.take(x, indices, axis=axis)
    return _same_scale(x, ops.take(x.data, indices, axis=axis))


def cast(x, dtype):
    """Rule: scale unchanged; `d = cast(a)`.

    Only a cast to FP8 (a GEMM operand) saturates finite overflow; to any
    other format overflow is ±inf, a fault the optimizer skips (a finite
    value beyond the format belongs in the scale: `dynamic_rescale_*`).
    NaN and ±inf always propagate. Casting a ScaledTensor to a non-float dtype raises `TypeError` (use
    `to_array` first).
    """
    check_input("x", x)
    if not is_scaled(x):
        return ops.cast(x, dtype)
    name = dtype_name(dtype)
    if name not in FORMATS:
        raise TypeError(
            f"`dtype` must be one of {sorted(FORMATS)} for a ScaledTensor, "
            f"got {name}. Call `keras_scalify.to_array` before casting to "
            f"other dtypes."
        )
    if name == x.dtype:
        return x
    if name not in FP8_DTYPES:
        return _same_scale(x, ops.cast(x.data, name))
    return _same_scale(x, _saturating_cast_st(x.data, name))


@ops.custom_gradient
def _cast_with_grad(x, ref):
    """Saturating cast whose cotangent is cast back to `x`'s dtype."""
    src = x.dtype
    out = saturating_cast(x, dtype_name(ref.dtype))

    def grad(*args, upstream=None, variables=None):
        g = args[0] if upstream is None else upstream
        return saturating_cast(g, dtype_name(src)), None

    return out, grad


def _saturating_cast_st(data, name):
    ref = ops.cast(ops.zeros((), "float32"), name)
    return _cast_with_grad(data, ref)
