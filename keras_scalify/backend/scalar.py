"""The ops of scale arithmetic, with the least dispatch per call.

Scale rules and the power-of-two helpers run thousands of ops per training
step, nearly all on scalars (a GPT step of `benchmarks/step_time.py`: ~6,000
`keras.ops` calls). On eager torch, Keras's torch ops convert every operand
and resolve a result dtype before the kernel (5-20 µs per call on a scalar,
`divide_no_nan` ~20); the torch functions themselves take 1-2 µs. This
module gives the handful of ops the helpers use, named as in `keras.ops`,
as the torch functions on torch, and as `keras.ops` elsewhere (JAX and
TensorFlow trace them once into a compiled step, where dispatch costs
nothing per step).

The torch versions take what the helpers pass: tensors, and Python numbers
for the second operand (masks, shift counts, constants), whose dtype then
follows the tensor's, as in Keras. They are plain torch calls, so
`torch.compile` traces them too.
"""

import keras
from keras import ops

TORCH = keras.backend.backend() == "torch"

if TORCH:
    import torch

    from keras.src.backend.torch.core import to_torch_dtype as _keras_torch_dtype

    _DTYPES = {}
    _NUMBERS = (int, float, bool)

    def to_torch_dtype(dtype):
        """Keras's `to_torch_dtype`, memoized (it standardizes the name on
        every call)."""
        out = _DTYPES.get(dtype)
        if out is None:
            out = _DTYPES[dtype] = _keras_torch_dtype(dtype)
        return out

    def _fast(torch_fn, keras_fn, first=0):
        """`torch_fn` when the operands from `first` on are torch tensors or
        Python numbers, at least one a tensor; `keras_fn` otherwise (NumPy
        values, symbolic tensors), which converts them."""

        def fn(*args):
            tensor = False
            for a in args[first:]:
                if isinstance(a, torch.Tensor):
                    tensor = True
                elif type(a) not in _NUMBERS:
                    return keras_fn(*args)
            if not tensor:
                return keras_fn(*args)
            return torch_fn(*args)

        fn.__name__ = keras_fn.__name__
        return fn

    def is_tensor(x):
        return isinstance(x, torch.Tensor)

    def has_dtype(x, dtype):
        """Whether `x` is a tensor of the (standardized) `dtype`."""
        return isinstance(x, torch.Tensor) and x.dtype == to_torch_dtype(dtype)

    def cast(x, dtype):
        if isinstance(x, torch.Tensor):
            return x.to(to_torch_dtype(dtype))
        return ops.cast(x, dtype)

    def view(x, dtype):
        if isinstance(x, torch.Tensor):
            return x.view(to_torch_dtype(dtype))
        return ops.view(x, dtype)

    def stop_gradient(x):
        if isinstance(x, torch.Tensor):
            return x.detach()
        return ops.stop_gradient(x)

    def _where(condition, x1, x2):
        if not isinstance(condition, torch.Tensor):
            return ops.where(condition, x1, x2)
        return torch.where(condition, x1, x2)

    def _divide_no_nan(x1, x2):
        if not isinstance(x2, torch.Tensor):
            return torch.zeros_like(x1) if x2 == 0 else x1 / x2
        zero = x2 == 0
        return torch.where(zero, 0.0, x1 / torch.where(zero, 1.0, x2))

    def _extremum(fn, bound):
        """`fn(x1, x2)` of two tensors; a clamp (`bound=` the number) when
        one operand is a Python number (`torch.maximum` takes tensors)."""

        def apply(x1, x2):
            if isinstance(x2, torch.Tensor):
                if isinstance(x1, torch.Tensor):
                    return fn(x1, x2)
                x1, x2 = x2, x1
            return torch.clamp(x1, **{bound: x2})

        return apply

    where = _fast(_where, ops.where, first=1)
    divide_no_nan = _fast(_divide_no_nan, ops.divide_no_nan)
    maximum = _fast(_extremum(torch.maximum, "min"), ops.maximum)
    minimum = _fast(_extremum(torch.minimum, "max"), ops.minimum)
    multiply = _fast(torch.multiply, ops.multiply)
    equal = _fast(torch.eq, ops.equal)
    not_equal = _fast(torch.ne, ops.not_equal)
    greater = _fast(torch.gt, ops.greater)
    logical_and = _fast(torch.logical_and, ops.logical_and)
    logical_or = _fast(torch.logical_or, ops.logical_or)
    logical_not = _fast(torch.logical_not, ops.logical_not)
    isfinite = _fast(torch.isfinite, ops.isfinite)
    abs = _fast(torch.abs, ops.abs)
    ones_like = _fast(torch.ones_like, ops.ones_like)
    bitwise_and = _fast(torch.bitwise_and, ops.bitwise_and)
    bitwise_or = _fast(torch.bitwise_or, ops.bitwise_or)
    left_shift = _fast(torch.bitwise_left_shift, ops.left_shift)
    right_shift = _fast(torch.bitwise_right_shift, ops.right_shift)
    floor_divide = _fast(torch.floor_divide, ops.floor_divide)
    clip = _fast(torch.clamp, ops.clip)

    def max(x):
        """The max over all elements (Keras's torch `max` reads `.values`
        of the result, a graph break under `torch.compile`)."""
        if isinstance(x, torch.Tensor):
            return torch.amax(x)
        return ops.max(x)

    def variable_value(variable):
        """The current value of a Keras variable (inside a stateless scope,
        the mapped one)."""
        if isinstance(variable, keras.Variable):
            return variable.value
        return ops.convert_to_tensor(variable)

else:
    from keras.src.backend import standardize_dtype

    is_tensor = ops.is_tensor

    def has_dtype(x, dtype):
        """Whether `x` is a tensor of the (standardized) `dtype`."""
        return ops.is_tensor(x) and standardize_dtype(x.dtype) == dtype

    cast = ops.cast
    view = ops.view
    stop_gradient = ops.stop_gradient
    where = ops.where
    divide_no_nan = ops.divide_no_nan
    multiply = ops.multiply
    maximum = ops.maximum
    minimum = ops.minimum
    equal = ops.equal
    not_equal = ops.not_equal
    greater = ops.greater
    logical_and = ops.logical_and
    logical_or = ops.logical_or
    logical_not = ops.logical_not
    isfinite = ops.isfinite
    abs = ops.abs
    ones_like = ops.ones_like
    bitwise_and = ops.bitwise_and
    bitwise_or = ops.bitwise_or
    left_shift = ops.left_shift
    right_shift = ops.right_shift
    floor_divide = ops.floor_divide
    clip = ops.clip

    def max(x):
        """The max over all elements."""
        return ops.max(x)

    def variable_value(variable):
        """The current value of a Keras variable as a backend tensor.

        On TensorFlow `convert_to_tensor(variable)` returns the variable
        itself, which is then read inside the next op; when that op is a
        custom gradient (every scale rule is one), an eager
        `tf.GradientTape` finds a variable read inside it and calls the
        gradient function with `variables=`, expecting variable gradients
        back. Reading the value here (`ops.copy` is `tf.identity` on TF)
        keeps the read outside; the gradient still reaches the variable
        through the identity."""
        t = ops.convert_to_tensor(variable)
        if isinstance(t, keras.Variable):
            t = ops.copy(t)
        return t
