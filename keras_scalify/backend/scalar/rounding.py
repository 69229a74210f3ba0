"""The helpers of stochastic and FP8 rounding over whole tensors: the
stochastic-rounding noise of flat indices (`indexed_pair_noise`,
`pair_noise`, `weyl_chunk`, `int32_range`), elementwise passes computed
chunk by chunk on eager torch (`chunked`), and the small tensors rounded
together there (`batches`, `concatenate_flat`, `split_like`, `gather`)."""

import builtins
import math

import numpy as np

from keras import ops

# The package: `ELEMENTWISE_CHUNK` is read there at each call, where tests
# set it (`monkeypatch.setattr(scalar, "ELEMENTWISE_CHUNK", ...)`).
from keras_scalify.backend import scalar
from keras_scalify.backend.scalar.base import TORCH
from keras_scalify.backend.scalar.elementwise import bitwise_and
from keras_scalify.backend.scalar.elementwise import cast
from keras_scalify.backend.scalar.in_place import add_in_place
from keras_scalify.backend.scalar.in_place import bitwise_and_in_place
from keras_scalify.backend.scalar.in_place import multiply_in_place
from keras_scalify.backend.scalar.in_place import right_shift_in_place


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


if TORCH:
    import torch

    from keras.src.backend.torch.core import get_device

    from keras_scalify.backend.scalar.base import _compiling
    from keras_scalify.backend.scalar.base import to_torch_dtype
    from keras_scalify.backend.scalar.in_place import _reusable
    from keras_scalify.backend.scalar.in_place import _scratch
    from keras_scalify.backend.scalar.in_place import _writable

    def int32_range(start, shape, like=None):
        """`start, start + 1, ...` as an int32 tensor of `shape` (a tuple
        of ints): the flat indices of a tensor of that shape, from
        `start`; on the device of tensor `like` (the data they index),
        else on Keras's device."""
        n = math.prod(shape)
        device = like.device if isinstance(like, torch.Tensor) else get_device()
        return torch.arange(start, start + n, dtype=torch.int32, device=device).reshape(shape)

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
            table = _WEYL[key] = int32_range(
                0, (builtins.max(n, scalar.ELEMENTWISE_CHUNK),), like
            ).mul_(multiplier)
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
        if n <= scalar.ELEMENTWISE_CHUNK or _compiling() or x.device.type != "cpu":
            return into.copy_(fn(x, 0)) if writes else cast(fn(x, 0), dtype)
        flat = x.reshape(-1)
        if writes:
            out = into.view(-1)
        else:
            out = torch.empty(n, dtype=to_torch_dtype(dtype), device=x.device)
        for start in range(0, n, scalar.ELEMENTWISE_CHUNK):
            end = start + scalar.ELEMENTWISE_CHUNK
            out[start:end].copy_(fn(flat[start:end], start))
        return into if writes else out.view(x.shape)

    def batches(x):
        """Whether `x` is rounded together with other small tensors
        (`core.rounding.stochastic_cast_all`): an eager torch tensor of
        fewer than `ELEMENTWISE_CHUNK` elements, where each op's dispatch
        costs more than its pass."""
        return isinstance(x, torch.Tensor) and x.numel() < scalar.ELEMENTWISE_CHUNK and not _compiling()

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

else:
    def int32_range(start, shape, like=None):
        """`start, start + 1, ...` as an int32 tensor of `shape` (`like`:
        the data they index; Keras places it)."""
        n = math.prod(shape)
        return ops.reshape(ops.arange(start, start + n, dtype="int32"), shape)

    def pair_noise(start, shape, multiplier, offset, mask, hash_fn, like):
        """`indexed_pair_noise` of the flat indices `start, start + 1, ...`
        of `shape`: elementwise, one fused loop."""
        return indexed_pair_noise(int32_range(start, shape, like), multiplier, offset, mask, hash_fn)

    def chunked(fn, x, dtype, into=None):
        """`cast(fn(x, 0), dtype)`: traced backends fuse the passes
        themselves (`into` is not written: no in-place writes)."""
        return cast(fn(x, 0), dtype)

    def batches(x):
        """Never: traced backends fuse each tensor's passes (the batching
        helpers of eager torch are not defined here)."""
        return False
