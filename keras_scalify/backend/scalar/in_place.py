"""In-place writes on eager torch: the `*_in_place` ops (written into a
tensor no one else reads, outside autograd), `multiply_all_in_place`
(one `torch._foreach_mul_`), and the reused scratch buffers of a chunk's
temporaries (`scratch_buffer`, `scratch_like`, `right_shift_into`), at
most `ELEMENTWISE_CHUNK` elements. JAX and TensorFlow have no in-place
writes: there the plain ops."""

import builtins
import threading

from keras import ops

# The package: `ELEMENTWISE_CHUNK` is read there at each call, where tests
# set it (`monkeypatch.setattr(scalar, "ELEMENTWISE_CHUNK", ...)`).
from keras_scalify.backend import scalar
from keras_scalify.backend.scalar.base import TORCH
from keras_scalify.backend.scalar.elementwise import add
from keras_scalify.backend.scalar.elementwise import bitwise_and
from keras_scalify.backend.scalar.elementwise import bitwise_xor
from keras_scalify.backend.scalar.elementwise import clip
from keras_scalify.backend.scalar.elementwise import multiply
from keras_scalify.backend.scalar.elementwise import right_shift
from keras_scalify.backend.scalar.elementwise import subtract

# Elements per chunk of a multi-pass elementwise computation on eager
# torch (`chunked`): its passes then run on ~1 MB buffers in the CPU's
# cache instead of streaming a weight-sized tensor from memory once per
# pass (FP8 rounding of 1024x1024 float32, one thread: 3.9 -> 1.2 ms).
ELEMENTWISE_CHUNK = 2**18


if TORCH:
    import torch

    from keras_scalify.backend.scalar.base import _compiling
    from keras_scalify.backend.scalar.host import host_value

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
    add_in_place = _in_place("add_", add, "add")
    subtract_in_place = _in_place("sub_", subtract, "subtract")
    bitwise_and_in_place = _in_place("bitwise_and_", bitwise_and, "bitwise_and")
    bitwise_xor_in_place = _in_place("bitwise_xor_", bitwise_xor, "bitwise_xor")
    right_shift_in_place = _in_place("bitwise_right_shift_", right_shift, "right_shift")

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
            buffer = pool[key] = torch.empty(
                builtins.max(n, scalar.ELEMENTWISE_CHUNK), dtype=dtype, device=device
            )
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
            and n <= scalar.ELEMENTWISE_CHUNK
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

    def right_shift_into(x, n, out):
        """`right_shift(x, n)`, written into `out` (a `scratch_like`
        tensor, or None)."""
        if out is not None:
            return torch.bitwise_right_shift(x, n, out=out)
        return right_shift(x, n)

else:
    # Traced backends have no in-place writes: the ops of `elementwise`.
    clip_in_place, multiply_in_place, add_in_place, subtract_in_place = clip, multiply, add, subtract

    bitwise_and_in_place, right_shift_in_place = bitwise_and, right_shift
    bitwise_xor_in_place = bitwise_xor

    def multiply_all_in_place(xs, factors):
        """`[multiply(x, f) ...]` (no in-place writes here)."""
        return [multiply(x, f) for x, f in zip(xs, factors)]

    def scratch_like(x):
        """No scratch tensors on traced backends."""
        return None

    def right_shift_into(x, n, out):
        """`right_shift(x, n)` (`out` is None here)."""
        return right_shift(x, n)
