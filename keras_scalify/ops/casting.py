"""One-pass casts (paper Alg. 6): a saturating cast on one pass only.

- 16/32-bit float targets are real casts: `cast_on_forward(x, "float16")`
  returns float16 data; its cotangent is cast back to `x`'s dtype.
- FP8 targets (`float8_e4m3fn`, `float8_e5m2`) round the values to the FP8
  grid (saturating at ±max) and keep the container dtype: TensorFlow and
  torch on CPU cannot compute on FP8 tensors, and a cotangent must share its
  primal's dtype. The values are exactly FP8-representable, so an FP8 GEMM
  can consume them after a lossless cast.

A ScaledTensor keeps its scale and grad scale: the cast acts on `data`,
which is why gradients must be near unit scale in data units.

A cast to the dtype the data already has rounds nothing and is the
identity (no pass over the tensor): non-finite values stay as they are, so
an overflowed gradient still reaches the optimizer's skip check.
"""

from keras import ops

from keras_scalify.backend.scalar import dtype_name
from keras_scalify.core.formats import FP8_DTYPES
from keras_scalify.core.formats import get_format
from keras_scalify.core.formats import saturating_cast
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_input


def round_to_format(x, dtype):
    """Values of `x` rounded (saturating) to `dtype`, in `x`'s dtype for FP8
    targets, in `dtype` otherwise."""
    name = get_format(dtype).name
    if name in FP8_DTYPES:
        return ops.cast(saturating_cast(x, name), x.dtype)
    return saturating_cast(x, name)


def _cast_back(g, dtype):
    return ops.cast(g, dtype) if dtype_name(g.dtype) != dtype else g


def _forward_fn(dtype):
    @ops.custom_gradient
    def fn(x):
        src = dtype_name(x.dtype)

        def grad(*args, upstream=None, variables=None):
            g = args[0] if upstream is None else upstream
            return _cast_back(g, src)

        return round_to_format(x, dtype), grad

    return fn


def _backward_fn(dtype):
    @ops.custom_gradient
    def fn(x):
        def grad(*args, upstream=None, variables=None):
            g = args[0] if upstream is None else upstream
            return _cast_back(round_to_format(g, dtype), dtype_name(g.dtype))

        return ops.multiply(x, ops.ones((), x.dtype)), grad

    return fn


def _dtype_of(x):
    if is_scaled(x) or hasattr(x, "dtype"):
        return dtype_name(x.dtype)
    return None


def cast_on_forward(x, dtype):
    """Saturating cast of `x` (its data) to `dtype` in the forward pass;
    identity on the gradient. Scale rule: unchanged."""
    check_input("x", x)
    get_format(dtype)
    dtype = dtype_name(dtype)
    if _dtype_of(x) == dtype:
        return x
    fn = _forward_fn(dtype)
    if is_scaled(x):
        return ScaledTensor(fn(x.data), x.scale, x.grad_scale)
    return fn(ops.convert_to_tensor(x))


def cast_on_backward(x, dtype):
    """Identity forward; the cotangent (of `x`'s data) is rounded with a
    saturating cast to `dtype` in the backward pass. Scale rule: unchanged."""
    check_input("x", x)
    get_format(dtype)
    dtype = dtype_name(dtype)
    if _dtype_of(x) == dtype:
        return x
    fn = _backward_fn(dtype)
    if is_scaled(x):
        return ScaledTensor(fn(x.data), x.scale, x.grad_scale)
    return fn(ops.convert_to_tensor(x))
