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

import builtins
import contextlib
import itertools
import math
import threading
import weakref

import numpy as np

import keras
from keras import ops
from keras.src.backend import standardize_dtype

TORCH = keras.backend.backend() == "torch"

# Elements per chunk of a multi-pass elementwise computation on eager
# torch (`chunked`): its passes then run on ~1 MB buffers in the CPU's
# cache instead of streaming a weight-sized tensor from memory once per
# pass (FP8 rounding of 1024x1024 float32, one thread: 3.9 -> 1.2 ms).
ELEMENTWISE_CHUNK = 2**18

# The size from which `unless_one` skips a multiply by 1 at run time on a
# TensorFlow graph: below it, the conditional's own ops cost about as much
# as the pass.
UNLESS_ONE_MIN_ELEMENTS = 2**15

_DTYPE_NAMES = {}


def dtype_name(dtype):
    """Keras's `standardize_dtype`, memoized by the dtype object (the rules
    ask for operands' dtypes thousands of times per step)."""
    if dtype is None:  # floatx, which may change
        return standardize_dtype(dtype)
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = standardize_dtype(dtype)
        if not _compiling():
            # (Under `torch.compile`, a write to a global inside a custom
            # gradient is a graph break.)
            _DTYPE_NAMES[dtype] = name
        return name
    except TypeError:  # unhashable
        return standardize_dtype(dtype)


def indexed_pair_noise(index, multiplier, offset, mask, hash_fn):
    """The stochastic-rounding noise of the elements of flat indices
    `index` (int32, written over on eager torch): `hash_fn((index >> 1) ·
    multiplier + offset)` (wrapping int32; `offset` a scalar or one per
    element), its low 16 bits for an even index and its high 16 bits for
    an odd one, `& mask` (`mask < 2**16`). Elementwise (each element
    hashes its pair: XLA fuses it into one loop); `pair_noise` is the
    same bits."""
    half = multiply_in_place(bitwise_and(index, 1), 16)
    pairs = add_in_place(multiply_in_place(right_shift_in_place(index, 1), multiplier), offset)
    # (An arithmetic shift: `mask` drops the sign bits.)
    return bitwise_and_in_place(right_shift_in_place(hash_fn(pairs), half), mask)


def _sum_to_ops(x, shape):
    """`sum_to` with `keras.ops`: the leading axes `x` has beyond `shape`,
    and those where `shape` is 1, summed."""
    shape = tuple(shape)
    lead = len(x.shape) - len(shape)
    axes = list(range(lead)) + [
        lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1
    ]
    if not axes:
        return ops.reshape(x, shape) if lead else x
    return ops.reshape(ops.sum(x, axis=axes, keepdims=True), shape)


def _compiling():
    """Whether `torch.compile` is tracing this call."""
    if not TORCH:
        return False
    import torch

    return torch.compiler.is_compiling()

if TORCH:
    import torch

    from keras.src.backend.torch.core import to_torch_dtype as _keras_torch_dtype
    from keras.src.backend.torch.core import get_device

    _DTYPES = {}
    _NUMBERS = (int, float, bool)

    def to_torch_dtype(dtype):
        """Keras's `to_torch_dtype`, memoized (it standardizes the name on
        every call)."""
        out = _DTYPES.get(dtype)
        if out is None:
            out = _keras_torch_dtype(dtype)
            if not _compiling():
                _DTYPES[dtype] = out
        return out

    _CONSTANTS = {}
    _TENSOR = torch.Tensor
    _is_compiling = torch.compiler.is_compiling
    # A tensor made under `torch.inference_mode` cannot be saved for a
    # backward outside it: no cached tensor is made there.
    _is_inference = torch.is_inference_mode_enabled
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

    def host_value(x):
        """The value of scalar `x` as a Python float where the host has it
        for free: a Python number, a 0-d CPU tensor without gradient on
        eager torch (`item()` there reads memory, no device sync), or a
        0-d tensor on any device whose value the host has kept
        (`_known_key`: a memo's result, a variable's detached scalar, a
        cached constant). None elsewhere (another GPU tensor,
        `torch.compile`, a tensor that needs a gradient, inside
        `memo_disabled()`)."""
        if type(x) in _NUMBERS:
            return float(x)
        if _MEMO_OFF or type(x) is not _TENSOR or x.ndim != 0 or x.requires_grad or _is_compiling():
            return None
        key = _known_key(x)
        if key is not None:
            return _key_value(key)
        if x.is_cpu and not _HOST_READS_OFF:
            return x.item()
        return None

    def is_one(x):
        """Whether scalar `x` is known on the host to be exactly 1
        (`host_value`): a multiply by it can then be skipped, which saves
        a pass over the data it would scale."""
        return host_value(x) == 1.0

    def unless_one(factor, x, times):
        """`times()` (`x` times `factor`), or `x` where `factor` is known on
        the host to be 1 (`is_one`)."""
        return x if is_one(factor) else times()

    def _number_or_constant(a, like):
        if type(a) not in _NUMBERS:
            return a
        c = _constant(a, like)
        return a if c is None else c

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

    def is_tensor(x):
        return isinstance(x, torch.Tensor)

    _FLOAT_DTYPES = {
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.float8_e4m3fn, torch.float8_e5m2,
    }

    def valid_scaled_fields(data, scale, grad_scale):
        """Whether a ScaledTensor takes these as they are (its checks would
        pass and convert nothing): torch tensors, float data, 0-d float32
        scales. The rules build ~300 ScaledTensors per step of a small
        GPT."""
        return (
            type(scale) is _TENSOR
            and type(grad_scale) is _TENSOR
            and type(data) is _TENSOR
            and scale.dtype is torch.float32
            and grad_scale.dtype is torch.float32
            and data.dtype in _FLOAT_DTYPES
            and scale.dim() == 0
            and grad_scale.dim() == 0
        )

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

    def mean(x):
        """The mean over all elements."""
        if isinstance(x, torch.Tensor):
            return torch.mean(x)
        return ops.mean(x)

    def int32_range(start, shape, like=None):
        """`start, start + 1, ...` as an int32 tensor of `shape` (a tuple
        of ints): the flat indices of a tensor of that shape, from
        `start`; on the device of tensor `like` (the data they index),
        else on Keras's device."""
        n = math.prod(shape)
        device = like.device if isinstance(like, torch.Tensor) else get_device()
        return torch.arange(start, start + n, dtype=torch.int32, device=device).reshape(shape)

    def _writable(x):
        """Whether an in-place op may write `x`: an eager torch tensor
        outside autograd (no gradient recorded through it)."""
        return (
            isinstance(x, torch.Tensor)
            and not _compiling()
            and not (x.requires_grad and torch.is_grad_enabled())
        )

    def _in_place(method, op, name):
        def f(x, y):
            if _writable(x):
                return getattr(x, method)(y)
            return op(x, y)

        f.__name__ = f"{name}_in_place"
        f.__doc__ = (
            f"`{name}(x, y)`, written into `x` (a tensor no one else "
            "reads; weight-sized temporaries cost page faults on eager torch)."
        )
        return f

    def clip_in_place(x, lo, hi):
        """`clip(x, lo, hi)`, written into `x` (a tensor no one else reads)."""
        if _writable(x):
            return x.clamp_(lo, hi)
        return ops.clip(x, lo, hi)

    multiply_in_place = _in_place("mul_", multiply, "multiply")

    def multiply_all_in_place(xs, factors):
        """`[multiply_in_place(x, f) ...]` over the pairs of `xs` and scalar
        `factors`, the float32 tensors whose factors the host knows
        (`host_value`) in one `torch._foreach_mul_` (an optimizer step
        decodes and re-encodes every weight: one Python-level op per
        weight each way); a factor of exactly 1 is skipped (a norm's
        gamma and beta have scale 1: no pass)."""
        out = list(xs)
        batch, values = [], []
        for i, (x, f) in enumerate(zip(xs, factors)):
            v = host_value(f) if _writable(x) and x.dtype == torch.float32 else None
            if v is None:
                out[i] = multiply_in_place(x, f)
            elif v != 1.0:  # (a factor of 1 writes nothing)
                batch.append(x)
                values.append(v)
        if batch:
            torch._foreach_mul_(batch, values)
        return out

    def sum_to(x, shape):
        """`x` summed over its broadcast axes down to `shape` (the
        cotangent of an operand broadcast to `x`'s shape)."""
        if isinstance(x, torch.Tensor):
            return x.sum_to_size(shape) if tuple(x.shape) != tuple(shape) else x
        return _sum_to_ops(x, shape)

    def rms_all(xs):
        """`stack([rms(x) for x in xs])`; CPU float32 tensors outside
        `torch.compile` by one `torch._foreach_norm` (on a GPU its
        reduction order differs from `rms`'s: not bit for bit)."""
        xs = list(xs)
        if _float32_on_one_device(xs) and xs[0].is_cpu:
            return torch.stack(torch._foreach_norm(xs)) * _inverse_sqrt_sizes(xs)
        return stack([rms(x) for x in xs])

    _INVERSE_SQRT_SIZES = {}

    def _inverse_sqrt_sizes(xs):
        """float32 `1/√size` of each of `xs`, on their device (cached, not
        made per step)."""
        key = (tuple(x.numel() for x in xs), xs[0].device)
        out = _INVERSE_SQRT_SIZES.get(key)
        if out is None:
            if len(_INVERSE_SQRT_SIZES) > 64:
                _INVERSE_SQRT_SIZES.clear()
            sizes = [1.0 / math.sqrt(n or 1) for n in key[0]]
            out = _INVERSE_SQRT_SIZES[key] = torch.tensor(sizes, dtype=torch.float32, device=key[1])
        return out

    def note_written(pairs):
        """After each `(tensor, value)` of `pairs` was copied in place
        (`backend.optimizer.assign_all`): a 0-d tensor given a value whose
        key the host keeps (`_known_key`) keeps that key for its new
        version, so that `detached_variable_value` need not read it (on a
        GPU, a synchronization per grad scale written per step)."""
        for t, x in pairs:
            if type(x) is _TENSOR and x.ndim == 0 and t.ndim == 0 and x.dtype == t.dtype:
                key = _known_key(x)
                if key is not None:
                    t.__dict__[_WRITTEN_KEY_ATTR] = (t._version, t.data_ptr(), key)

    def rms_all_on_host(xs):
        """`rms_all(xs)` as Python floats (its float32 values): float32
        tensors on one device on eager torch, outside `memo_disabled()`:
        one read of the stacked vector (on a GPU, one synchronization,
        counted by `synchronizing_reads`). None elsewhere."""
        xs = list(xs)
        if _MEMO_OFF or not _float32_on_one_device(xs):
            return None
        _count_read(xs[0])
        return rms_all(xs).tolist()

    def _float32_on_one_device(xs):
        """Whether `xs` is a non-empty list of float32 tensors on one
        device, outside `torch.compile` (`rms_all`'s one `_foreach_norm`)."""
        return bool(xs) and not _is_compiling() and all(
            type(x) is _TENSOR and x.dtype == torch.float32 and x.device == xs[0].device for x in xs
        )
    add_in_place = _in_place("add_", add, "add")
    subtract_in_place = _in_place("sub_", subtract, "subtract")
    bitwise_and_in_place = _in_place("bitwise_and_", bitwise_and, "bitwise_and")
    bitwise_xor_in_place = _in_place("bitwise_xor_", bitwise_xor, "bitwise_xor")
    right_shift_in_place = _in_place("bitwise_right_shift_", right_shift, "right_shift")

    _SCRATCH = threading.local()

    def _scratch(role, n, dtype, device):
        """`n` uninitialized elements of a 1-D buffer kept for `role` (per
        thread, dtype and device; at most `ELEMENTWISE_CHUNK` elements):
        a chunk's temporaries reused from one call to the next. (Freed
        ~1 MB tensors go back to the system through glibc's heap trim and
        fault back in on the next allocation: a stochastic rounding chunk
        took ~600 page faults, half its time.)"""
        pool = _SCRATCH.__dict__.setdefault("pool", {})
        key = (role, dtype, device)
        buffer = pool.get(key)
        if buffer is None or buffer.numel() < n:
            buffer = pool[key] = torch.empty(builtins.max(n, ELEMENTWISE_CHUNK), dtype=dtype, device=device)
        return buffer[:n]

    def scratch_buffer(role, n, dtype, device):
        """`n` uninitialized elements for a chunk's temporaries: on a CPU
        outside `torch.compile`, up to `ELEMENTWISE_CHUNK` of them, the
        reused buffer of `role` (valid until the next call for `role`);
        else a new tensor."""
        if not _pooled(n, device):
            return torch.empty(n, dtype=dtype, device=device)
        return _scratch(role, n, dtype, device)

    def _pooled(n, device):
        """Whether `n` elements on `device` can be a `_scratch` buffer: at
        most `ELEMENTWISE_CHUNK` on a CPU, outside `torch.compile` and
        `torch.inference_mode` (a buffer made there could not be written
        outside it)."""
        return (
            not _compiling()
            and torch.device(device).type == "cpu"
            and n <= ELEMENTWISE_CHUNK
            and not torch.is_inference_mode_enabled()
        )

    def _reusable(x):
        """Whether `x`'s temporaries can be `_scratch` buffers: a writable
        tensor whose size and device are `_pooled`."""
        return _writable(x) and _pooled(x.numel(), x.device)

    def scratch_like(x):
        """An uninitialized tensor like `x` for `right_shift_into` to
        write, where `x` is writable (eager torch; for a chunk-sized CPU
        tensor a reused buffer, valid until the next `scratch_like` call:
        never `x` itself); else None."""
        if not _writable(x):
            return None
        if _reusable(x):
            return _scratch("scratch_like", x.numel(), x.dtype, x.device).view(x.shape)
        return torch.empty_like(x)

    _WEYL = {}

    def weyl_chunk(start, shape, multiplier, offset, like):
        """`(start + i)·multiplier + offset` over the flat indices `i` of
        `shape`, wrapping int32 (`multiplier` a Python int, `offset` an
        int32 scalar tensor): the hash input of a chunk whose `like` is
        `_reusable`, written into a reused buffer (valid until the next
        call; the caller consumes it) as one add to a cached
        `i·multiplier` table, instead of an `arange` and two passes."""
        n = math.prod(shape)
        key = (multiplier, like.device)
        table = _WEYL.get(key)
        if table is None or table.numel() < n:
            table = _WEYL[key] = int32_range(0, (builtins.max(n, ELEMENTWISE_CHUNK),), like).mul_(multiplier)
        shift = (start * multiplier + 2**31) % 2**32 - 2**31  # wrapped to int32
        out = _scratch("weyl_chunk", n, torch.int32, like.device).view(shape)
        return torch.add(table[:n].view(shape), offset + shift, out=out)

    def pair_noise(start, shape, multiplier, offset, mask, hash_fn, like):
        """`indexed_pair_noise` of the flat indices `start, start + 1, ...`
        of `shape` (`start` even), bit for bit. For a `_reusable` `like`
        (the chunk it is for; eager torch on a CPU), one hash per pair:
        the pairs' `weyl_chunk` hashed in place, then one converting copy
        of its int16 view (the halves, low first) and one mask, into a
        reused buffer (valid until the next call): half the hash's
        passes. Elsewhere the elementwise form, which a compiler fuses."""
        n = math.prod(shape)
        if not _reusable(like):
            return indexed_pair_noise(int32_range(start, shape, like), multiplier, offset, mask, hash_fn)
        h = hash_fn(weyl_chunk(start // 2, ((n + 1) // 2,), multiplier, offset, like))
        out = _scratch("pair_noise", 2 * h.numel(), torch.int32, h.device)
        return out.copy_(h.view(torch.int16)).bitwise_and_(mask)[:n].view(shape)

    def right_shift_into(x, n, out):
        """`right_shift(x, n)`, written into `out` (a `scratch_like`
        tensor, or None)."""
        if out is not None:
            return torch.bitwise_right_shift(x, n, out=out)
        return right_shift(x, n)

    def chunked(fn, x, dtype, into=None):
        """`cast(fn(x, 0), dtype)` computed `ELEMENTWISE_CHUNK` flat
        elements at a time: `fn(piece, start)` maps a 1-D slice of `x`
        starting at flat index `start` to its elementwise result, values
        that `dtype` represents exactly (it may write the slice in place
        where `x` is writable, and return a `_scratch` buffer: the result
        is copied out before the next piece). `into`: a tensor of `x`'s
        shape and `dtype` that nothing reads any more (a weight's stored
        data, re-encoded), written with the result and returned (no new
        tensor, no copy into the variable after). Eager torch on a CPU only
        (a GPU streams each pass at full bandwidth, and each chunk costs
        kernel launches there); on a GPU, while `torch.compile` traces,
        and for small tensors, one call."""
        n = x.numel() if isinstance(x, torch.Tensor) else 0
        writes = (
            into is not None and _writable(into) and into.is_contiguous()
            and into.dtype == to_torch_dtype(dtype) and into.shape == x.shape
        )
        if n <= ELEMENTWISE_CHUNK or _compiling() or x.device.type != "cpu":
            return into.copy_(fn(x, 0)) if writes else cast(fn(x, 0), dtype)
        flat = x.reshape(-1)
        if writes:
            out = into.view(-1)
        else:
            out = torch.empty(n, dtype=to_torch_dtype(dtype), device=x.device)
        for start in range(0, n, ELEMENTWISE_CHUNK):
            end = start + ELEMENTWISE_CHUNK
            out[start:end].copy_(fn(flat[start:end], start))
        return into if writes else out.view(x.shape)

    def batches(x):
        """Whether `x` is rounded together with other small tensors
        (`core.rounding.stochastic_cast_all`): an eager torch tensor of
        fewer than `ELEMENTWISE_CHUNK` elements, where each op's dispatch
        costs more than its pass."""
        return isinstance(x, torch.Tensor) and x.numel() < ELEMENTWISE_CHUNK and not _compiling()

    _LAYOUTS = {}

    def concatenate_flat(xs):
        """`(flat, index, segment)` for `batches` tensors: their float32
        values in one new flat tensor, each element's flat index within its
        own tensor (int32, a new tensor) and its tensor's number (int64;
        the layout is cached by the tensors' sizes)."""
        sizes = tuple(x.numel() for x in xs)
        flat = torch.cat([x.reshape(-1).to(torch.float32) for x in xs])
        key = (sizes, flat.device)
        layout = _LAYOUTS.get(key)
        if layout is None:
            if len(_LAYOUTS) > 64:
                _LAYOUTS.clear()
            index = np.concatenate([np.arange(n, dtype=np.int32) for n in sizes])
            segment = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
            layout = _LAYOUTS[key] = (
                torch.from_numpy(index).to(flat.device),
                torch.from_numpy(segment).to(flat.device),
            )
        return flat, layout[0].clone(), layout[1]

    def split_like(flat, xs):
        """`flat` cut into views shaped as `xs` (`concatenate_flat`'s
        inverse)."""
        pieces = torch.split(flat, [x.numel() for x in xs])
        return [p.view(x.shape) for p, x in zip(pieces, xs)]

    def gather(values, index):
        """`values[index]` (a 1-D tensor and int64 indices), as
        `index_select`: indexing took 1.2 ms for the 400k small-weight
        elements of the GPT's stochastic rounding, `index_select` 0.3 ms
        (one CPU thread)."""
        return torch.index_select(values, 0, index)

    def stack(xs):
        """The scalars or tensors `xs` stacked on a new first axis
        (`torch.stack` on torch tensors: `keras.ops.stack` walks the list
        for symbolic tensors, ~0.2 ms for a model's ~100 scales)."""
        xs = list(xs)
        if xs and all(isinstance(x, _TENSOR) for x in xs):
            return torch.stack(xs)
        return ops.stack(xs)

    def unstack(x):
        """The entries of `x` along its first axis (`stack`'s inverse)."""
        if isinstance(x, _TENSOR):
            return list(torch.unbind(x))
        return ops.unstack(x)

    def rms(x):
        """`sqrt(mean(x²))` over all elements of a float32 tensor, without
        the squared copy (`vector_norm`; it overflows to inf where the sum
        of squares does)."""
        if isinstance(x, torch.Tensor):
            return torch.linalg.vector_norm(x) * (1.0 / math.sqrt(x.numel() or 1))
        return ops.sqrt(ops.mean(ops.square(x)))

    def identity_in_custom_gradient(x):
        """`x` as the output of a custom-gradient forward: torch's autograd
        returns an input as a fresh alias with the node's gradient (no pass
        over the data)."""
        return x

    def max(x):
        """The max over all elements (Keras's torch `max` reads `.values`
        of the result, a graph break under `torch.compile`)."""
        if isinstance(x, torch.Tensor):
            return torch.amax(x)
        return ops.max(x)

    def needs_gradient(x):
        """Whether autograd will ask for `x`'s cotangent (`requires_grad`;
        a model's input does not, so the first layer's GEMM skips its
        input gradient, as Keras's own layers do)."""
        return not isinstance(x, torch.Tensor) or x.requires_grad

    from keras.src.backend.common import global_state as _global_state

    _VARIABLE = keras.Variable

    def variable_value(variable):
        """The current value of a Keras variable (inside a stateless scope,
        the mapped one).

        Where `Variable.value` would return the variable's own tensor (no
        stateless or autocast scope that applies, not a symbolic call on
        the meta device, not traced), that tensor, read directly: Keras's
        property checks those scopes one by one (~2.5 µs; a GPT step of
        `benchmarks/step_time.py` reads ~500 variables in the rules and
        the optimizer). Keras's private `_value` and `_autocast`, and the
        global-state names its scopes use."""
        if type(variable) is _VARIABLE:  # (a subclass may read otherwise)
            value = variable._value
            get = _global_state.get_global_attribute
            if (
                value is not None
                and get("stateless_scope") is None
                and (not variable._autocast or get("autocast_scope") is None)
                and get("torch_device") is None
                and not _is_compiling()
            ):
                return value
            return variable.value
        if isinstance(variable, keras.Variable):
            return variable.value
        return ops.convert_to_tensor(variable)

    def detached_variable_value(variable):
        """`stop_gradient(variable_value(variable))` of a scalar variable (a
        weight's scale or grad scale): `detached_tensor` of its tensor."""
        return detached_tensor(variable_value(variable))

    def detached_tensor(value):
        """`stop_gradient(value)` of a variable's own scalar tensor. On eager
        torch, for a tensor that needs a gradient (a trainable variable's),
        the detached alias is kept on the tensor and returned again (it
        shares the tensor's storage and version counter), with its memo key
        read once per version of the tensor (`_VERSIONED_KEY_ATTR`; every
        in-place write bumps the version; on a GPU the read is a
        synchronization, none where `note_written` recorded the value
        written): a GPT step of `benchmarks/step_time.py` read ~200 scales,
        each a `detach` and an `item()`. Elsewhere, the plain read."""
        if (
            type(value) is not _PARAMETER
            or not value.requires_grad
            or _MEMO_OFF
            or _is_compiling()
            or _is_inference()
        ):
            return stop_gradient(value)
        attrs = value.__dict__
        alias = attrs.get(_ALIAS_ATTR)
        # (An alias must share the tensor's storage and version counter:
        # not after `param.data = ...`, nor one restored by unpickling.)
        if alias is None or alias.data_ptr() != value.data_ptr() or alias._version != value._version:
            alias = attrs[_ALIAS_ATTR] = value.detach()
        else:
            versioned = alias.__dict__.get(_VERSIONED_KEY_ATTR)
            if versioned is not None and versioned[0] == alias._version:
                return alias
        written = attrs.get(_WRITTEN_KEY_ATTR)
        if written is not None and written[:2] == (alias._version, value.data_ptr()):
            key = written[2]
        else:
            key = _kept_key(alias)
        alias.__dict__[_VERSIONED_KEY_ATTR] = (alias._version, key)
        return alias

    def kept(x):
        """`x`, a 0-d tensor of scale arithmetic computed from data (e.g. a
        bias's rebalancing `P(max|data|)`), with its value key kept on it
        (`_kept_key`: read once, on a GPU a synchronization) where the
        memoized rules it feeds would otherwise find no key (on a GPU, or
        inside `host_reads_disabled()`), so that they hit as on a CPU.
        No one may write `x` in place afterwards."""
        if (
            type(x) is _TENSOR
            and x.ndim == 0
            and not x.requires_grad
            and not _MEMO_OFF
            and (not x.is_cpu or _HOST_READS_OFF)
            and not x.is_meta
            and not _is_compiling()
            and not _is_inference()
            and _KEY_ATTR not in x.__dict__
        ):
            x.__dict__[_KEY_ATTR] = _kept_key(x)
        return x

    def signature(x):
        """A hashable key of what a rule's static analysis reads of tensor
        `x` (shape, dtype, device) on eager torch, where that analysis
        would otherwise run on every call: None elsewhere (a traced step
        runs it once per trace) and under `torch.compile`."""
        if (type(x) is not _TENSOR and type(x) is not _PARAMETER) or _is_compiling():
            return None
        return (x.shape, x.dtype, x.device)

    _PARAMETER = torch.nn.Parameter
    _KEY_CODES = {torch.float32: "f", torch.int32: "i", torch.bool: "b"}
    _PLAIN_KEYS = (type(None), bool, int, str)
    _MISS = object()
    _MEMO_OFF = []  # non-empty inside `memo_disabled()`

    _HOST_READS_OFF = []  # non-empty inside `host_reads_disabled()`
    _TOKENS = itertools.count()
    _SYNCHRONIZING_READS = [0]

    @contextlib.contextmanager
    def memo_disabled():
        """A scope in which `memoize_scalars` functions compute every call
        and `host_value` reads nothing (to compare a result with that of
        the tensor ops it shortcuts)."""
        _MEMO_OFF.append(True)
        try:
            yield
        finally:
            _MEMO_OFF.pop()

    @contextlib.contextmanager
    def host_reads_disabled():
        """A scope in which CPU tensors are read as a GPU's: no free read
        (`host_value` of a tensor whose value the host has not kept is
        None, a memo takes no key from one), and the reads the host does
        to keep a value count in `synchronizing_reads`. Runs a GPU's code
        paths on a CPU (tests)."""
        _HOST_READS_OFF.append(True)
        try:
            yield
        finally:
            _HOST_READS_OFF.pop()

    def _stored_key(x):
        """The key kept on tensor `x` (a memo's result, a variable's
        detached scalar at its current version, a cached constant; an
        identity token included), or None."""
        attrs = x.__dict__
        key = attrs.get(_KEY_ATTR)
        if key is None:
            versioned = attrs.get(_VERSIONED_KEY_ATTR)
            if versioned is not None and versioned[0] == x._version:
                key = versioned[1]
        return key

    def _known_key(x):
        """The value key the host keeps for tensor `x` (`_stored_key`), or
        None (none kept, or an identity token)."""
        key = _stored_key(x)
        return None if key is None or key[0] == "t" else key

    def _key_value(key):
        """The Python value of a value key (`_value_key`)."""
        return math.copysign(key[1], key[2]) if len(key) == 3 else key[1]

    def _memo_key(x, tensors):
        """A hashable key of `x`'s value (0-d CPU tensors of float32, int32
        or bool without a gradient, Python scalars, None, strings, and
        lists or tuples of those; a tensor's value read with `item()`,
        which on a CPU is a memory read, or, on any device, the key kept on
        the tensor: a memo's result (`_keep`), a variable's detached scalar
        at its version (`detached_variable_value`), a cached constant), or
        `_MISS`. Each tensor found is appended to `tensors`. NaN has no key
        (it equals nothing); -0.0 has its own."""
        t = type(x)
        if t is _TENSOR or t is _PARAMETER:
            key = _stored_key(x)
            if key is None:
                key = _tensor_key(x)
                if key is _MISS:
                    return _MISS
            tensors.append(x)
            return key
        if t is tuple or t is list:
            keys = [t]
            for e in x:
                k = _memo_key(e, tensors)
                if k is _MISS:
                    return _MISS
                keys.append(k)
            return tuple(keys)
        if t is float:
            return _value_key("p", x)
        if t in _PLAIN_KEYS:
            return (t, x)
        return _MISS

    def _tensor_key(x):
        """`_memo_key` of a tensor, read from it for free (`_MISS` for
        other than a 0-d CPU float32 / int32 / bool tensor without a
        gradient, and inside `host_reads_disabled()`)."""
        if not x.is_cpu or _HOST_READS_OFF:
            return _MISS
        return _read_key(x)

    def _read_key(x):
        """The value key of a 0-d float32 / int32 / bool tensor `x` without
        a gradient, read with `item()` on any device (on a GPU a device
        synchronization, counted by `synchronizing_reads`); `_MISS` for
        others, for NaN and on the meta device (a symbolic call's, no
        values)."""
        code = _KEY_CODES.get(x.dtype)
        if code is None or x.dim() != 0 or x.requires_grad or x.is_meta:
            return _MISS
        _count_read(x)
        return _value_key(code, x.item())

    def _kept_key(x):
        """The key of a tensor whose value never changes under it (a memo's
        result, a variable's detached scalar at one version), read once
        (`_read_key`: on a GPU one synchronization, after which memos hit
        on it and `host_value` knows it as on a CPU); where it cannot be
        read, a key never given before (`_TOKENS`: memos still hit on it
        by identity)."""
        key = _read_key(x)
        return ("t", next(_TOKENS)) if key is _MISS else key

    def _count_read(x):
        if not x.is_cpu or _HOST_READS_OFF:
            _SYNCHRONIZING_READS[0] += 1

    def on_host(x):
        """Whether tensor `x` is on the CPU, outside `host_reads_disabled()`
        (which runs a GPU's paths on a CPU): the CPU-only fused nodes of
        `backend.fused` take it."""
        return x.device.type == "cpu" and not _HOST_READS_OFF

    def synchronizing_reads():
        """How many values the host has read from tensors where a read is
        not free (a GPU's, or any inside `host_reads_disabled()`): each a
        device synchronization on a GPU."""
        return _SYNCHRONIZING_READS[0]

    def _value_key(code, v):
        if v != v:
            return _MISS
        if v == 0 and code != "b":
            return (code, v, math.copysign(1.0, v))
        return (code, v)

    # The attribute under which a memoized result's tensor keeps its key
    # (its value never changes: no one writes a memo's results in place).
    _KEY_ATTR = "_ksc_memo_key"
    # The attribute under which a variable's detached scalar keeps its key
    # with the version it holds for (`detached_variable_value`).
    _VERSIONED_KEY_ATTR = "_ksc_versioned_memo_key"
    # The attribute under which a variable's tensor keeps the key of the
    # value `assign_all` wrote into it, with the version and storage it
    # holds for.
    _WRITTEN_KEY_ATTR = "_ksc_written_memo_key"
    # The attribute under which a variable's tensor keeps its detached
    # alias (`detached_tensor`).
    _ALIAS_ATTR = "_ksc_detached_alias"

    # The tensors some memo keeps (never written in place).
    _MEMO_TENSORS = weakref.WeakSet()

    def _memo_value(out, inputs):
        """Whether `out` may be returned again: 0-d tensors without a
        gradient, none of them one of the `inputs` unless a memo keeps it
        already (a variable's own tensor would change under the cache when
        the variable is written), Python scalars, None, and tuples or
        lists of those."""
        t = type(out)
        if t is _TENSOR:
            if out.dim() != 0 or out.requires_grad:
                return False
            return not any(out is x for x in inputs) or out in _MEMO_TENSORS
        if t is list or t is tuple:
            return all(_memo_value(e, inputs) for e in out)
        return t in _PLAIN_KEYS or t is float

    def _keep(out):
        """Record the tensors of a memoized result (`_MEMO_TENSORS`), each
        with its key (`_memo_key` reads no value from it again)."""
        if type(out) is _TENSOR:
            _MEMO_TENSORS.add(out)
            if _KEY_ATTR not in out.__dict__:  # (a cached constant has its own)
                out.__dict__[_KEY_ATTR] = _kept_key(out)
        elif type(out) is list or type(out) is tuple:
            for e in out:
                _keep(e)

    def memoize_scalars(fn):
        """`fn`, a pure function of scalars (scale arithmetic), with its
        results memoized by its arguments' values on eager torch.

        Scale rules compute the same scales step after step from the same
        inputs (weights' scales change at most once per optimizer step,
        activations' follow from them), and on eager torch each scalar op
        costs a dispatch (1-2 µs, and the Python around it). A call whose
        arguments are all 0-d CPU tensors (float32, int32, bool, without a
        gradient) or Python scalars, at least one a tensor, returns the
        tensors `fn` returned for the same values before (`item()` reads
        a CPU tensor without a device synchronization). Other calls (a
        GPU tensor, NaN, while `torch.compile` traces, in inference mode)
        run `fn`. The results are the same bit for bit: `fn` must depend
        on nothing but its arguments, and no one may write its results in
        place."""
        cache = {}

        def wrapper(*args):
            if _MEMO_OFF or _is_compiling() or _is_inference():
                return fn(*args)
            tensors = []
            try:
                key = _memo_key(args, tensors)
            except RuntimeError:  # e.g. `item()` under a functorch transform
                key = _MISS
            if key is _MISS or not tensors:
                return fn(*args)
            try:
                out = cache[key]
            except KeyError:
                out = fn(*args)
                if not _memo_value(out, tensors):
                    return out
                if len(cache) >= 4096:
                    cache.clear()
                cache[key] = out
                _keep(out)
            return list(out) if type(out) is list else out

        wrapper.__name__ = fn.__name__
        wrapper.__qualname__ = fn.__qualname__
        wrapper.__doc__ = fn.__doc__
        wrapper.__wrapped__ = fn
        return wrapper

else:
    _TF = keras.backend.backend() == "tensorflow"
    if _TF:
        import tensorflow as _tf

    is_tensor = ops.is_tensor

    def valid_scaled_fields(data, scale, grad_scale):
        """False: a ScaledTensor checks its fields (traced once here)."""
        return False

    def has_dtype(x, dtype):
        """Whether `x` is a tensor of the (standardized) `dtype`."""
        return ops.is_tensor(x) and dtype_name(x.dtype) == dtype

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

    def mean(x):
        """The mean over all elements."""
        return ops.mean(x)

    def stack(xs):
        """The scalars or tensors `xs` stacked on a new first axis."""
        return ops.stack(list(xs))

    def unstack(x):
        """The entries of `x` along its first axis (`stack`'s inverse)."""
        return ops.unstack(x)

    def host_value(x):
        """A Python number's value; None for tensors (traced backends)."""
        return float(x) if type(x) in (int, float, bool) else None

    def is_one(x):
        """Whether `x` is the Python number 1."""
        return host_value(x) == 1.0

    def unless_one(factor, x, times):
        """`times()` (`x` times `factor`), or `x` where `factor` is 1.

        On a TensorFlow graph that XLA does not compile, for a tensor `x`
        of at least `UNLESS_ONE_MIN_ELEMENTS` elements, the choice is made
        at run time (`tf.cond`, lowered to a switch: the untaken branch
        does not run): a factor of 1, which eager torch sees on the host
        and skips, no longer costs a pass there either (the rescales of
        the GPT of `step_time.py`, ~5 ms of its 2-thread op time per
        step). XLA and jax fuse the multiply into its neighbours, where a
        conditional would split the fusion."""
        if is_one(factor):
            return x
        if _TF and _runtime_choice(x, factor):
            return _tf.cond(_tf.equal(factor, 1.0), lambda: _tf.identity(x), times)
        return times()

    def _runtime_choice(x, factor):
        """Whether `unless_one` chooses with `tf.cond`: a large static-shape
        tensor and a scalar factor of a TensorFlow graph (a `tf.function`
        trace) that XLA does not compile. `control_flow_util`'s XLA test
        is TensorFlow's internal one (no public equivalent): where it is
        missing, no conditional is built."""
        if not (isinstance(x, _tf.Tensor) and isinstance(factor, _tf.Tensor)) or _tf.executing_eagerly():
            return False
        n = x.shape.num_elements()
        if n is None or n < UNLESS_ONE_MIN_ELEMENTS or factor.shape.rank != 0:
            return False
        try:
            from tensorflow.python.ops import control_flow_util
        except ImportError:
            return False
        return not control_flow_util.GraphOrParentsInXlaContext(_tf.compat.v1.get_default_graph())

    def float32_scalar(value, like):
        """Python number `value` as a float32 0-d tensor."""
        if isinstance(value, (int, float)):  # (straight to float32, whatever floatx)
            return ops.convert_to_tensor(float(value), "float32")
        return ops.cast(ops.convert_to_tensor(value), "float32")

    def full_scalar(value, like):
        """`ops.full((), value, dtype=like.dtype)`."""
        return ops.full((), value, dtype=like.dtype)

    def int32_range(start, shape, like=None):
        """`start, start + 1, ...` as an int32 tensor of `shape` (`like`:
        the data they index; Keras places it)."""
        n = math.prod(shape)
        return ops.reshape(ops.arange(start, start + n, dtype="int32"), shape)

    # Traced backends have no in-place writes: the ops above.
    clip_in_place, multiply_in_place, add_in_place, subtract_in_place = clip, multiply, add, subtract

    def sum_to(x, shape):
        """`x` summed over its broadcast axes down to `shape`."""
        return _sum_to_ops(x, shape)

    def multiply_all_in_place(xs, factors):
        """`[multiply(x, f) ...]` (no in-place writes here)."""
        return [multiply(x, f) for x, f in zip(xs, factors)]

    def rms_all(xs):
        """`stack([rms(x) for x in xs])`."""
        return stack([rms(x) for x in xs])

    def rms_all_on_host(xs):
        """None: the host has no tensor values here (see the torch one)."""
        return None

    def detached_variable_value(variable):
        """`stop_gradient` of the variable's value (see the torch one)."""
        return stop_gradient(variable_value(variable))

    def detached_tensor(value):
        """`stop_gradient(value)` (see the torch one)."""
        return stop_gradient(value)

    def kept(x):
        """`x` (nothing is kept on the host here)."""
        return x

    bitwise_and_in_place, right_shift_in_place = bitwise_and, right_shift
    bitwise_xor_in_place = bitwise_xor

    def scratch_like(x):
        """No scratch tensors on traced backends."""
        return None

    def pair_noise(start, shape, multiplier, offset, mask, hash_fn, like):
        """`indexed_pair_noise` of the flat indices `start, start + 1, ...`
        of `shape`: elementwise, one fused loop."""
        return indexed_pair_noise(int32_range(start, shape, like), multiplier, offset, mask, hash_fn)

    def right_shift_into(x, n, out):
        """`right_shift(x, n)` (`out` is None here)."""
        return right_shift(x, n)

    def chunked(fn, x, dtype, into=None):
        """`cast(fn(x, 0), dtype)`: traced backends fuse the passes
        themselves (`into` is not written: no in-place writes)."""
        return cast(fn(x, 0), dtype)

    def batches(x):
        """Never: traced backends fuse each tensor's passes (the batching
        helpers of eager torch are not defined here)."""
        return False

    def rms(x):
        """`sqrt(mean(x²))` over all elements (0 for an empty tensor). On
        TensorFlow a dense float32 tensor's sum of squares is
        `2·l2_loss(x)`: one pass without the squared copy (Grappler fuses
        neither `square` into `sum` nor a norm; the two passes were
        ~0.7 ms of a 9 ms MLP step). It overflows to inf where the sum of
        squares does."""
        if _TF and isinstance(x, _tf.Tensor) and x.dtype == _tf.float32:
            squares = _tf.nn.l2_loss(x) * 2.0
        else:
            squares = ops.sum(ops.square(x))
        if all(isinstance(d, int) for d in x.shape):
            return ops.sqrt(squares / float(math.prod(x.shape) or 1))
        n = ops.maximum(ops.cast(ops.size(x), squares.dtype), 1.0)
        return ops.sqrt(squares / n)

    def identity_in_custom_gradient(x):
        """`x` as the output of a custom-gradient forward: a multiply by
        one (a TensorFlow custom gradient must not return its input; XLA and
        Grappler drop the multiply)."""
        return ops.multiply(x, ops.ones((), x.dtype))

    def max(x):
        """The max over all elements."""
        return ops.max(x)

    def needs_gradient(x):
        """Always (traced backends drop an unused cotangent themselves)."""
        return True

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

    def signature(x):
        """None: traced steps run a rule's static analysis once per trace."""
        return None

    def memo_disabled():
        """A scope without memoization: there is none here."""
        return contextlib.nullcontext()

    def host_reads_disabled():
        """A scope without host reads: there are none here."""
        return contextlib.nullcontext()

    def synchronizing_reads():
        """No value is read on the host here: 0."""
        return 0

    def note_written(pairs):
        """Nothing is kept on the host here."""

    def memoize_scalars(fn):
        """`fn` itself: JAX and TensorFlow trace the step, so its scale
        arithmetic runs once per trace, not per step. (Running each such
        function as one XLA call on TensorFlow, whose CPU steps Keras runs
        without XLA, measured no faster: 1.25-1.27x against 1.22-1.24x
        on the GPT.)"""
        return fn
