"""The boundary between plain tensors and ScaledTensors."""

import math

import keras
import numpy as np
from keras import ops

from keras_scalify.backend import is_concrete
from keras_scalify.backend import scalar as S
from keras_scalify.core import pow2
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_input
from keras_scalify.ops._common import rescale
from keras_scalify.ops._common import scale_grad
from keras_scalify.ops._common import times
from keras_scalify.ops.rescaling import overflow_safe_rms
from keras_scalify.ops.rescaling import rescale_by_statistic


def _check_scale_value(name, s, allow_zero):
    """Value checks on a concrete scale: finite, >= 0, a power of two."""
    if not is_concrete(s):
        return
    v = float(np.asarray(ops.convert_to_numpy(s), dtype=np.float64))
    if not math.isfinite(v):
        raise ValueError(f"`{name}` must be finite, got {v}.")
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"`{name}` must be positive, got {v}.")
    if v != 0 and pow2.np_pow2_round_down(v) != v:
        raise ValueError(
            f"`{name}` must be a power of two, got {v}. Use "
            f"`keras_scalify.core.pow2_round_down` to round it."
        )


# The smallest normal float32 power of two: a scale below it would be a
# subnormal, which JAX and TensorFlow flush to zero in arithmetic on CPU.
_MIN_NORMAL_EXPONENT = -126


def _split_python_float(v):
    """`v` as exact float32 `(data, scale)`: mantissa in [1, 2) × pow2,
    the scale kept a normal float32 (a float32 subnormal value goes into
    the data, exactly); 0 → (0, 0); inf/NaN stay in the data (scale 1), so
    they propagate."""
    if v == 0.0:
        return np.float32(0.0), np.float32(0.0)
    if not math.isfinite(v):
        return np.float32(v), np.float32(1.0)
    s, _ = pow2.np_pow2_decompose(v)
    s = max(s, 2.0**_MIN_NORMAL_EXPONENT)
    return np.float32(v / s), np.float32(s)


def _check_static_scale(name, s):
    """A Python/NumPy scale must survive its float32 conversion: 2**-160
    would become 0 (a zero tensor), 2**200 inf."""
    if s is None or not isinstance(s, (float, int, np.floating, np.integer)):
        return
    v = float(s)
    if math.isfinite(v) and v != 0.0:
        f = float(np.float32(v))
        if f == 0.0 or not math.isfinite(f) or abs(f) < 2.0**_MIN_NORMAL_EXPONENT:
            raise ValueError(
                f"`{name}` must be a normal float32 power of two (between "
                f"2**-126 and 2**127), got {v!r}: as float32 it would be "
                f"{f!r}. Move the factor into the data instead."
            )


def as_scaled(x, scale=None, grad_scale=None):
    """A ScaledTensor with data `x` and `scale`: it represents `x * scale`.

    - `scale=None`: a tensor gets scale 1; a Python float is split exactly
      into mantissa (data, in [1, 2)) and pow2 scale.
    - `scale`: a power-of-two scalar (0 for a zero tensor).
    - `grad_scale`: the pow2 gradient scale (default 1): the cotangent of
      the data is `true_gradient / grad_scale`. Gradients with respect to
      `x` come back as ordinary (true) gradients.

    A ScaledTensor is returned unchanged. Integer or boolean inputs raise
    `TypeError`; a non-scalar, non-finite, negative or non-pow2 scale raises
    `ValueError`.
    """
    if is_scaled(x):
        if scale is not None or grad_scale is not None:
            raise ValueError(
                "`x` is already a ScaledTensor: `scale` and `grad_scale` "
                "must be None. Use `keras_scalify.ops.dynamic_rescale_*` "
                "to move a factor between data and scale."
            )
        return x
    if isinstance(x, (bool, np.bool_)):
        raise TypeError("`x` must be a float, got a bool.")
    if isinstance(x, (float, int, np.floating, np.integer)) and scale is None:
        x, scale = _split_python_float(float(x))
    check_input("x", x)
    _check_static_scale("scale", scale)
    _check_static_scale("grad_scale", grad_scale)
    if isinstance(x, keras.Variable):
        # Its value, as Keras's ops take it: on torch the Variable object
        # itself would reach a custom gradient and lose its gradient.
        x = ops.convert_to_tensor(x)
    if isinstance(x, (np.ndarray, np.generic, float, int, list, tuple)):
        x = np.asarray(x)
        if x.dtype == np.float64:
            x = x.astype(np.float32)
        x = ops.convert_to_tensor(x)
    if scale is None:
        scale = 1.0
    if grad_scale is None:
        grad_scale = 1.0
    out = ScaledTensor(x, scale, grad_scale)
    _check_scale_value("scale", out.scale, allow_zero=True)
    _check_scale_value("grad_scale", out.grad_scale, allow_zero=False)
    s = S.stop_gradient(out.scale)
    gs = S.stop_gradient(out.grad_scale)
    # d loss / d x = s * gs * cotangent(data)
    return ScaledTensor(scale_grad(out.data, times(s, gs)), out.scale, out.grad_scale)


def encode(x, grad_scale=None):
    """A plain float tensor as a ScaledTensor with the pow2 of its RMS in
    the scale: the data has RMS in [1, 2), exactly. The RMS is measured
    without overflow (`overflow_safe_rms`), so a finite value beyond the
    data's format (1e30 on its way to float16) is carried by the scale;
    an inf or NaN leaves the scale at 1 and propagates. `grad_scale`: a
    pow2 float32 scalar (default 1), not validated (it may be a traced
    state); the cotangent of `x` comes back in true units.
    """
    x = ops.convert_to_tensor(x)
    one = S.float32_scalar(1.0, x)
    gs = one if grad_scale is None else grad_scale
    x = ScaledTensor(scale_grad(x, gs), one, gs)
    return rescale_by_statistic(x, overflow_safe_rms(x.data))


def to_array(x, dtype=None):
    """The represented tensor `data * scale`, multiplied in float32.

    `dtype` (default float32) is the output dtype; the cast after the
    float32 multiply is a plain cast (overflow gives ±inf). A plain tensor
    is returned as is (cast to `dtype` if given). Gradients flowing back
    are true gradients; the data receives `gradient / grad_scale`.
    """
    if not is_scaled(x):
        check_input("x", x)
        x = ops.convert_to_tensor(x)
        return x if dtype is None else ops.cast(x, dtype)
    s = ops.stop_gradient(x.scale)
    gs = ops.stop_gradient(x.grad_scale)
    data = x.data
    if keras.backend.standardize_dtype(data.dtype) != "float32":
        data = ops.cast(data, "float32")
    one = ops.ones((), "float32")
    out = rescale(data, s, one / gs)
    if dtype is not None and keras.backend.standardize_dtype(dtype) != "float32":
        out = ops.cast(out, dtype)
    return out
