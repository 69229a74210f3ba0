"""`ScaledTensor`: a tensor carried as `data * scale`."""

import collections

import math

import numpy as np
from keras import ops

from keras_scalify.backend import scalar as S
from keras_scalify.backend.scalar import dtype_name


_FLOAT_DTYPES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
)


def _is_tensor_like(x):
    return hasattr(x, "shape") and hasattr(x, "dtype")


# What the first ScaledTensor made in this process runs, once: the
# wrappers of Keras that only scaled values need register here
# (`keras_scalify/patches.py`), so that importing keras_scalify changes
# nothing in Keras until scaled values exist.
ON_FIRST_SCALED_TENSOR = []


def _run_first_use_hooks():
    while ON_FIRST_SCALED_TENSOR:
        ON_FIRST_SCALED_TENSOR.pop(0)()


class ScaledTensor(
    collections.namedtuple("ScaledTensor", ["data", "scale", "grad_scale"])
):
    """A tensor represented as `data * scale`.

    - `data`: the payload, in the storage/compute dtype (float32, float16,
      bfloat16; FP8 only where a cast asks for it).
    - `scale`: a float32 scalar, a power of two (or 0 for a zero tensor).
    - `grad_scale`: a float32 power-of-two scalar fixed in the forward pass;
      the cotangent of `data` travels as `true_gradient / grad_scale`
      (see `docs/design.md`). Defaults to 1.

    It is a named tuple, so it flows as a structure of three tensors through
    `keras.tree`, JAX pytrees, `tf.nest`, torch pytrees and between the
    layers of a Functional model. Arithmetic operators (`+ - * / @`, unary
    `-`, `abs`, `**`) dispatch to `keras_scalify.ops`; tuple concatenation
    and repetition are therefore not available. `x[...]` with anything but
    an int indexes the data (`x[:, 0]`); an int picks a field. `keras.ops`
    functions given a ScaledTensor apply the scale rule of the
    same-named `keras_scalify.ops` function, or decode it
    (`keras_scalify.ops.dispatch`).

    The scale fields are never written in place: on eager torch a scale
    given as a Python number, and the scales the rules compute, are
    tensors shared between ScaledTensors (cached constants, memoized
    results whose values the host keeps: `backend.scalar`).
    """

    __slots__ = ()
    # Let NumPy arrays and TF tensors on the left defer to our operators
    # instead of converting the tuple into one array.
    __array_ufunc__ = None

    # A ScaledTensor reaching a plain TF op is refused with a message naming
    # the boundary. (No `__jax_array__`: JAX arrays on the left of an
    # operator would convert through it instead of deferring to `__radd__`.)
    def __tf_tensor__(self, dtype=None, name=None):
        raise TypeError("A ScaledTensor is not a tf.Tensor. " + _PLAIN_OP_HINT)

    def __new__(cls, data, scale, grad_scale=None):
        if ON_FIRST_SCALED_TENSOR:
            _run_first_use_hooks()
        if S.valid_scaled_fields(data, scale, grad_scale):
            return tuple.__new__(cls, (data, scale, grad_scale))
        if _is_number(scale) or _is_number(grad_scale):
            # A real scale: the data must be a float tensor or number. (Other
            # contents, e.g. ScaledTensor(None, None, None) or of shapes, are
            # what pytree utilities build when they map over the fields.)
            _check_data(data)
            _check_number_scale("scale", scale, allow_zero=True)
            _check_number_scale("grad_scale", grad_scale, allow_zero=False)
        if _is_tensor_like(data) or isinstance(data, (float, int)):
            if not isinstance(data, (float, int)) or isinstance(data, bool):
                _check_float("data", data)
            like = data if _is_tensor_like(data) else None
            scale = _as_scale_tensor("scale", scale, like)
            if grad_scale is None:
                grad_scale = 1.0
            grad_scale = _as_scale_tensor("grad_scale", grad_scale, like)
        return super().__new__(cls, data, scale, grad_scale)

    # --- array-like properties --------------------------------------------
    @property
    def shape(self):
        return tuple(self.data.shape)

    @property
    def dtype(self):
        return dtype_name(self.data.dtype)

    @property
    def ndim(self):
        return len(self.data.shape)

    def __getitem__(self, key):
        # An int index keeps its tuple meaning (the fields), which pytree
        # libraries and unpacking rely on; any other index (slices, `...`,
        # None, tuples of those, index tensors) indexes the data, as
        # `x[:, 0]` does on a tensor: the scale is unchanged.
        if isinstance(key, (int, np.integer)):
            return tuple.__getitem__(self, key)
        # (Local: keras_scalify.ops imports this module.)
        from keras_scalify.ops.dispatch import getitem

        return getitem(self, key)

    def to_array(self, dtype=None):
        """The represented tensor `data * scale` (see `to_array`)."""
        # (Local: keras_scalify.ops imports this module.)
        from keras_scalify.ops.boundary import to_array

        return to_array(self, dtype)

    def __array__(self, dtype=None, copy=None):
        out = ops.convert_to_numpy(self.to_array())
        return out.astype(dtype) if dtype is not None else out

    def __repr__(self):
        return (
            f"ScaledTensor(data={self.data!r}, scale={self.scale!r}, "
            f"grad_scale={self.grad_scale!r})"
        )

    # --- operators ----------------------------------------------------------
    def __add__(self, other):
        return _ops().add(self, other)

    def __radd__(self, other):
        return _ops().add(other, self)

    def __sub__(self, other):
        return _ops().subtract(self, other)

    def __rsub__(self, other):
        return _ops().subtract(other, self)

    def __mul__(self, other):
        return _ops().multiply(self, other)

    def __rmul__(self, other):
        return _ops().multiply(other, self)

    def __truediv__(self, other):
        return _ops().divide(self, other)

    def __rtruediv__(self, other):
        return _ops().divide(other, self)

    def __matmul__(self, other):
        return _ops().matmul(self, other)

    def __rmatmul__(self, other):
        return _ops().matmul(other, self)

    def __neg__(self):
        return _ops().negative(self)

    def __abs__(self):
        return _ops().abs(self)

    def __pow__(self, other):
        return _ops().power(self, other)


_PLAIN_OP_HINT = (
    "Use the scaled op from `keras_scalify.ops`, or convert it to its "
    "represented values first with `keras_scalify.to_array(x)` (in a model: "
    "a `keras_scalify.layers.ToArray()` layer)."
)


def _ops():
    # (Local: keras_scalify.ops imports this module.)
    from keras_scalify import ops as ksc_ops

    return ksc_ops


def _is_number(x):
    return isinstance(x, (float, int, np.floating, np.integer)) and not isinstance(
        x, (bool, np.bool_)
    )


def _check_data(data):
    if isinstance(data, (float, int, np.floating, np.integer)) and not isinstance(
        data, (bool, np.bool_)
    ):
        return
    if not _is_tensor_like(data):
        raise TypeError(
            f"`data` must be a floating-point tensor (or a Python number), got "
            f"{type(data).__name__} {data!r:.80}."
        )


def _check_number_scale(name, v, allow_zero):
    """Value checks of a Python/NumPy scale (tensors are not read: that
    would synchronize with the device): finite, >= 0, a power of two."""
    if not _is_number(v):
        return
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"`{name}` must be finite, got {v}.")
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"`{name}` must be positive, got {v}.")
    if v != 0 and math.ldexp(1.0, math.frexp(v)[1] - 1) != v:
        raise ValueError(
            f"`{name}` must be a power of two (or 0), got {v}. Use "
            f"`keras_scalify.core.pow2_round_down` to round it."
        )


def _check_float(name, x):
    dtype = dtype_name(x.dtype)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"`{name}` must have a floating-point dtype, got {dtype}. "
            f"Cast integer or boolean tensors before scaling them."
        )


def _numeric_array(name, s):
    """A Python or NumPy scale as a NumPy array (integers as float32), or a
    TypeError naming `name` for anything that is not a number."""
    if s is None:
        raise TypeError(
            f"`{name}` is required: a power-of-two float scalar (a Python "
            f"float or a rank-0 float tensor), got None."
        )
    try:
        array = np.asarray(s)
    except Exception:  # objects NumPy cannot convert
        array = None
    if array is None or array.dtype.kind not in "fiu":
        raise TypeError(
            f"`{name}` must be a power-of-two float scalar (a Python float "
            f"or a rank-0 float tensor), got {type(s).__name__} {s!r:.80}."
        )
    return array.astype("float32") if array.dtype.kind in "iu" else array


def _as_scale_tensor(name, s, like=None):
    if S.has_dtype(s, "float32") and len(s.shape) == 0:
        return s  # what the rules pass: no conversion, nothing to check
    if isinstance(s, bool):
        raise TypeError(f"`{name}` must be a float, got a bool.")
    if type(s) in (float, int):
        # Straight to float32 (the value a float64 array would be cast to),
        # without NumPy: `torch.compile` traces this. On eager torch a
        # cached constant on the data's device (`like`), whose value the
        # host keeps (`backend.scalar.float32_scalar`).
        if like is not None:
            return S.float32_scalar(float(s), like)
        s = ops.convert_to_tensor(float(s), "float32")
    elif not _is_tensor_like(s) or isinstance(s, (np.ndarray, np.generic)):
        s = ops.convert_to_tensor(_numeric_array(name, s))
    if len(s.shape) != 0:
        raise ValueError(
            f"`{name}` must be a scalar (rank 0), got shape {tuple(s.shape)}."
        )
    _check_float(name, s)
    if dtype_name(s.dtype) != "float32":
        s = ops.cast(s, "float32")
    return s


def map_scaled(fn, x):
    """`fn` applied to every ScaledTensor (whole) and every other leaf of
    `x`, rebuilding lists, tuples, named tuples and dicts."""
    if is_scaled(x):
        return fn(x)
    if isinstance(x, dict):
        return {k: map_scaled(fn, v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*[map_scaled(fn, v) for v in x])
    if isinstance(x, (list, tuple)):
        return type(x)(map_scaled(fn, v) for v in x)
    return fn(x)


def is_scaled(x):
    """Whether `x` is a `ScaledTensor`."""
    return isinstance(x, ScaledTensor)
