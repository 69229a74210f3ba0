"""The elementwise ops of scale arithmetic, named as in `keras.ops`. On
eager torch, the torch functions where the operands are torch tensors
and Python numbers (these as cached constants of the tensor's dtype),
else `keras.ops` (`_fast`); elsewhere `keras.ops` itself. With them
`cast`, `view`, `stop_gradient` and `identity_in_custom_gradient`."""

from keras import ops

from keras_scalify.backend.scalar.base import TORCH

if TORCH:
    import torch

    from keras_scalify.backend.scalar.base import _NUMBERS
    from keras_scalify.backend.scalar.base import _TENSOR
    from keras_scalify.backend.scalar.base import to_torch_dtype
    from keras_scalify.backend.scalar.constants import _constant
    from keras_scalify.backend.scalar.constants import _number_or_constant

    def _fast(torch_fn, keras_fn, first=0, constants=False):
        """`torch_fn` when the operands from `first` on are torch tensors or
        Python numbers, at least one a tensor; `keras_fn` otherwise (NumPy
        values, symbolic tensors), which converts them. `constants`: pass
        Python numbers as cached tensors of the tensor operand's dtype
        (`_constant`)."""

        def fn(*args):
            # The usual calls first: one tensor, or two tensors.
            if first == 0 and type(args[0]) is _TENSOR:
                if len(args) == 1 or (len(args) == 2 and type(args[1]) is _TENSOR):
                    return torch_fn(*args)
                if constants and len(args) == 2 and type(args[1]) in _NUMBERS:
                    c = _constant(args[1], args[0])
                    return torch_fn(args[0], args[1] if c is None else c)
            tensor = None
            numbers = False
            for a in args[first:]:
                if isinstance(a, torch.Tensor):
                    tensor = a if tensor is None else tensor
                elif type(a) in _NUMBERS:
                    numbers = True
                else:
                    return keras_fn(*args)
            if tensor is None:
                return keras_fn(*args)
            if numbers and constants:
                args = args[:first] + tuple(_number_or_constant(a, tensor) for a in args[first:])
            return torch_fn(*args)

        fn.__name__ = keras_fn.__name__
        return fn

    def cast(x, dtype):
        if isinstance(x, torch.Tensor):
            return x.to(to_torch_dtype(dtype))
        return ops.cast(x, dtype)

    def view(x, dtype):
        if isinstance(x, torch.Tensor):
            return x.view(to_torch_dtype(dtype))
        return ops.view(x, dtype)

    def stop_gradient(x):
        """`x` itself when no gradient flows into it (scales nearly
        always): a `detach` per call is an op of its own."""
        if isinstance(x, torch.Tensor):
            return x.detach() if x.requires_grad else x
        return ops.stop_gradient(x)

    def _where(condition, x1, x2):
        """`torch.where`; on a GPU a Python number as a cached constant
        (torch would make it a device tensor with a fill kernel per call;
        on a CPU its wrapped number costs less than the cache lookup)."""
        if not isinstance(condition, torch.Tensor):
            return ops.where(condition, x1, x2)
        if type(x2) in _NUMBERS and type(x1) is _TENSOR and not x1.is_cpu:
            x2 = _number_or_constant(x2, x1)
        elif type(x1) in _NUMBERS and type(x2) is _TENSOR and not x2.is_cpu:
            x1 = _number_or_constant(x1, x2)
        return torch.where(condition, x1, x2)

    def _divide_no_nan(x1, x2):
        if not isinstance(x2, torch.Tensor):
            return torch.zeros_like(x1) if x2 == 0 else x1 / x2
        zero = equal(x2, 0)
        if not (x2.requires_grad or getattr(x1, "requires_grad", False)):
            # No gradient: the quotient's inf/NaN where x2 == 0 is
            # selected away (with one, the select's zero cotangent would
            # meet them in the division's backward).
            return torch.where(zero, 0.0, x1 / x2)
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
    multiply = _fast(torch.multiply, ops.multiply, constants=True)
    add = _fast(torch.add, ops.add, constants=True)
    subtract = _fast(torch.sub, ops.subtract, constants=True)
    divide = _fast(torch.div, ops.divide, constants=True)
    equal = _fast(torch.eq, ops.equal, constants=True)
    not_equal = _fast(torch.ne, ops.not_equal, constants=True)
    greater = _fast(torch.gt, ops.greater, constants=True)
    logical_and = _fast(torch.logical_and, ops.logical_and)
    logical_or = _fast(torch.logical_or, ops.logical_or)
    logical_not = _fast(torch.logical_not, ops.logical_not)
    isfinite = _fast(torch.isfinite, ops.isfinite)
    abs = _fast(torch.abs, ops.abs)
    ones_like = _fast(torch.ones_like, ops.ones_like)
    bitwise_and = _fast(torch.bitwise_and, ops.bitwise_and, constants=True)
    bitwise_or = _fast(torch.bitwise_or, ops.bitwise_or, constants=True)
    bitwise_xor = _fast(torch.bitwise_xor, ops.bitwise_xor, constants=True)
    left_shift = _fast(torch.bitwise_left_shift, ops.left_shift, constants=True)
    right_shift = _fast(torch.bitwise_right_shift, ops.right_shift, constants=True)
    floor_divide = _fast(torch.floor_divide, ops.floor_divide, constants=True)
    clip = _fast(torch.clamp, ops.clip)
    square = _fast(torch.square, ops.square)
    sqrt = _fast(torch.sqrt, ops.sqrt)

    def identity_in_custom_gradient(x):
        """`x` as the output of a custom-gradient forward: torch's autograd
        returns an input as a fresh alias with the node's gradient (no pass
        over the data)."""
        return x

else:
    cast = ops.cast
    view = ops.view
    stop_gradient = ops.stop_gradient
    where = ops.where
    divide_no_nan = ops.divide_no_nan
    multiply = ops.multiply
    add = ops.add
    subtract = ops.subtract
    divide = ops.divide
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
    bitwise_xor = ops.bitwise_xor
    left_shift = ops.left_shift
    right_shift = ops.right_shift
    floor_divide = ops.floor_divide
    clip = ops.clip
    square = ops.square
    sqrt = ops.sqrt

    def identity_in_custom_gradient(x):
        """`x` as the output of a custom-gradient forward: a multiply by
        one (a TensorFlow custom gradient must not return its input; XLA and
        Grappler drop the multiply)."""
        return ops.multiply(x, ops.ones((), x.dtype))
