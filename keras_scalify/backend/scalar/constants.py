"""Python numbers as tensors. `float32_scalar` and `full_scalar` (cached
on eager torch, each with its value key kept on it), and the cached
0-d constants that the torch ops of `backend.scalar.elementwise` pass in
place of a Python operand (`_constant`)."""

import math

from keras import ops

from keras_scalify.backend.scalar.base import TORCH

if TORCH:
    import torch

    from keras.src.backend.common import global_state as _global_state

    from keras_scalify.backend.scalar.base import _NUMBERS
    from keras_scalify.backend.scalar.base import _TENSOR
    from keras_scalify.backend.scalar.base import _compiling
    from keras_scalify.backend.scalar.base import _is_compiling
    from keras_scalify.backend.scalar.base import _is_inference
    from keras_scalify.backend.scalar.host import _KEY_ATTR
    from keras_scalify.backend.scalar.host import _KEY_CODES
    from keras_scalify.backend.scalar.host import _value_key

    _CONSTANTS = {}
    # The dtypes of scale arithmetic. (A float16 operand computes with a
    # Python number in float32: a float16 constant would round it first.)
    _CONSTANT_DTYPES = (torch.float32, torch.int32)

    def _constant(a, like):
        """Python number `a` as a 0-d tensor of `like`'s dtype and device
        (cached), where torch would convert it the same way: a Python
        number in an eager op is wrapped and copied to the operand's dtype
        (4 extra dispatches per op). None where the conversion could differ
        (other dtypes than float32 and int32, an int tensor with a float
        or an int outside int32, NaN, -0.0, while `torch.compile`
        traces, or a new one under `torch.inference_mode`)."""
        dtype = like.dtype
        key = (a, type(a), dtype, like.device)
        out = _CONSTANTS.get(key)
        # (-0.0 finds 0.0's entry: not valid for it.)
        if out is not None and not _is_compiling():
            if a != 0 or type(a) is int or math.copysign(1.0, a) > 0:
                return out
        if dtype not in _CONSTANT_DTYPES or a != a:
            return None
        if dtype != torch.float32 and (type(a) is not int or not -(2**31) <= a < 2**31):
            return None
        if a == 0 and type(a) is float and math.copysign(1.0, a) < 0:
            return None
        if _compiling() or _is_inference():
            return None
        if out is None:
            if len(_CONSTANTS) > 4096:
                _CONSTANTS.clear()
            out = _CONSTANTS[key] = torch.tensor(a, dtype=dtype, device=like.device)
        return out

    def _number_or_constant(a, like):
        if type(a) not in _NUMBERS:
            return a
        c = _constant(a, like)
        return a if c is None else c

    _SCALARS = {}

    def _cached_scalar(value, dtype, device):
        """Python number `value` as a 0-d tensor of `dtype` on `device`,
        cached on eager torch (None where not cached: NaN, bool, while
        `torch.compile` traces, under `torch.inference_mode`)."""
        if type(value) not in _NUMBERS or type(value) is bool or value != value:
            return None
        if _is_compiling() or _is_inference():
            return None
        key = (value, math.copysign(1.0, value), dtype, device)
        out = _SCALARS.get(key)
        if out is None:
            if len(_SCALARS) > 4096:
                _SCALARS.clear()
            # Narrow float dtypes through float32: CUDA's `full` refuses a
            # finite number past float16's range, where a cast rounds it
            # to inf as the CPU does.
            narrow = dtype.is_floating_point and dtype.itemsize < 4
            out = torch.full((), value, dtype=torch.float32 if narrow else dtype, device=device)
            out = _SCALARS[key] = out.to(dtype)
            # Its value key, from the same number on the host (no read of
            # a device's tensor).
            code = _KEY_CODES.get(dtype)
            if code is not None:
                out.__dict__[_KEY_ATTR] = _value_key(code, torch.full((), value, dtype=dtype).item())
        return out

    def float32_scalar(value, like):
        """Python number `value` as a float32 0-d tensor on the device of
        tensor `like` (cached on eager torch: converting it per call costs
        ~10 µs in Keras's `convert_to_tensor`); inside a symbolic call
        (Keras's meta device scope) converted there."""
        if (
            isinstance(like, torch.Tensor)
            and type(value) in _NUMBERS
            and type(value) is not bool
            and "meta" not in str(_global_state.get_global_attribute("torch_device"))
        ):
            out = _cached_scalar(float(value), torch.float32, like.device)
            if out is not None:
                return out
        if isinstance(value, (int, float)):  # (straight to float32, whatever floatx)
            return ops.convert_to_tensor(float(value), "float32")
        return ops.cast(ops.convert_to_tensor(value), "float32")

    def full_scalar(value, like):
        """`ops.full((), value, dtype=like.dtype)` on `like`'s device, cached
        on eager torch (Keras's `full` copies the number to the device on
        every call: a synchronization on a GPU)."""
        out = _cached_scalar(value, like.dtype, like.device) if type(like) is _TENSOR else None
        return ops.full((), value, dtype=like.dtype) if out is None else out

else:
    def float32_scalar(value, like):
        """Python number `value` as a float32 0-d tensor."""
        if isinstance(value, (int, float)):  # (straight to float32, whatever floatx)
            return ops.convert_to_tensor(float(value), "float32")
        return ops.cast(ops.convert_to_tensor(value), "float32")

    def full_scalar(value, like):
        """`ops.full((), value, dtype=like.dtype)`."""
        return ops.full((), value, dtype=like.dtype)
