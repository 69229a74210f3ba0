"""FP8 rounding as float32 values and FP8 casts, per backend, for the
FP8 GEMM routes (`backend/fp8.py`): `quantized_float32` (the operands of
the simulation and of the bfloat16 routes), the torch route's saturating
cast, and an eager torch rounding in place, chunk by chunk."""

import functools

import keras
import numpy as np
from keras import ops

from keras_scalify.backend.scalar import ELEMENTWISE_CHUNK
from keras_scalify.backend.scalar import dtype_name
from keras_scalify.core.formats import FORMATS
from keras_scalify.core.formats import saturating_cast
from keras_scalify.core.formats import saturating_round
from keras_scalify.core.pow2 import _EXP_MASK


def quantized_float32(x, dtype):
    """`saturating_cast(x, dtype)` as float32 values: on jax (compiled by
    XLA) rounded in float32 arithmetic, where XLA's FP8 conversions are
    slow on CPU; on eager torch the same rounding in place
    (`_round_torch`); on TensorFlow (no XLA on a CPU: each op is its own
    pass) and under `torch.compile` cast there and back (inductor's
    compiled casts beat its compiled `saturating_round`: the FP8 MLP step
    48 ms against 56)."""
    backend = keras.config.backend()
    if backend == "jax":
        return saturating_round(x, dtype)
    if backend == "torch" and dtype_name(dtype) in ("float8_e4m3fn", "float8_e5m2"):
        import torch

        # (float32 and narrower: a float64 beyond float32's range is
        # clipped in float64 by the cast.)
        narrow = getattr(x, "dtype", None) in (torch.float32, torch.float16, torch.bfloat16)
        if narrow and not torch.compiler.is_compiling():
            return _round_torch(x, dtype)
        if _compiled_cast_saturates_inf(x):
            return saturating_round(x, dtype)
    return ops.cast(saturating_cast(x, dtype), "float32")


def _compiled_cast_saturates_inf(x):
    """Whether torch is compiling for a CUDA tensor `x`: inductor's Triton
    casts to FP8 saturate ±inf to ±max there (PTX `cvt...satfinite`, seen
    on an H100), which would turn a fault into a finite value."""
    import torch

    return torch.compiler.is_compiling() and getattr(x, "device", None) is not None and x.device.type == "cuda"


def _torch_saturating_cast(x, dtype):
    """`saturating_cast` to an FP8 `dtype` for the torch route; under
    `torch.compile` on CUDA an E5M2 cast is built from its bits (the
    float16 of the value rounded to E5M2 is exact, ±inf included, and its
    top byte is the E5M2 pattern), since the compiled cast would saturate
    ±inf (`_compiled_cast_saturates_inf`). E4M3 has no inf (±inf and NaN
    become NaN before the cast)."""
    if dtype_name(dtype) != "float8_e5m2" or not _compiled_cast_saturates_inf(x):
        return saturating_cast(x, dtype)
    return e5m2_from_bits(saturating_round(x, dtype))


def e5m2_from_bits(x):
    """Torch float32 `x` whose values are E5M2 values (±inf and NaN
    included) as a float8_e5m2 tensor, bit for bit, without an FP8 cast."""
    import torch

    h = x.to(torch.float16).view(torch.int16)
    top = torch.bitwise_and(torch.bitwise_right_shift(h, 8), 0xFF)
    return top.to(torch.uint8).view(torch.float8_e5m2)


def _round_torch(x, dtype):
    """`saturating_round(x, dtype)` for torch, bit for bit, in nine passes
    in place, chunk by chunk (`ELEMENTWISE_CHUNK`: the passes run in the
    CPU's cache). On one CPU thread, 131072 elements: ~0.41 ms (E4M3) and
    ~0.46 ms (E5M2), where the integer rounding of the bit pattern this
    replaced (16 and 21 passes) took ~0.62 and ~0.77 ms; the cast to FP8
    and back is slower still (torch's FP8-to-float32 conversion alone
    ~3 ms per million elements).

    `y = clip(x, ±max)` is rounded by adding and subtracting
    `c = ±1.5·2^(e + 23 - m)`, with `e` the exponent of `y` (at least the
    smallest normal's) and `m` the format's mantissa bits: `y + c` lies
    in one binade whose float32 spacing is the format's spacing at `y`
    (its subnormal spacing below the smallest normal), so the add rounds
    `y` to nearest-even on the format's grid (`c` is an even multiple of
    that spacing, whatever the sign of `y`) and the subtract is exact
    (`_round_chunk`). The sign is copied back (a negative value rounding
    to zero is -0), and non-finite inputs are restored as
    `saturating_cast` keeps them (NaN; ±inf in E5M2, NaN in E4M3)."""
    import torch

    # (Local: `scalar` defines it under the torch backend only.)
    from keras_scalify.backend.scalar import scratch_buffer

    fmt = FORMATS[dtype_name(dtype)]
    flat = x.contiguous().view(-1)
    out = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
    # (Chunks on a CPU only: a GPU streams each pass at full bandwidth.)
    chunk = ELEMENTWISE_CHUNK if flat.device.type == "cpu" else flat.numel()
    size = min(chunk, flat.numel()) or 1
    # The temporary in a reused buffer on a CPU (`scratch_buffer`: no
    # allocation, and no page faults, per call); a narrower input is
    # widened a chunk at a time.
    scratch = scratch_buffer("fp8_round", size, torch.int32, flat.device)
    for start in range(0, flat.numel(), size):
        piece = flat[start : start + size]
        if piece.dtype != torch.float32:
            piece = scratch_buffer("fp8_round_wide", piece.numel(), torch.float32, flat.device).copy_(piece)
        _round_chunk(piece, out[start : start + size], scratch, fmt)
    return out.view(torch.float32).view(x.shape)


def _round_chunk(x, out, scratch, fmt):
    """`_round_torch` of the float32 chunk `x` into the int32 `out` (its
    bits), with an int32 `scratch` buffer at least as long."""
    import torch

    low, high, magic, max_bits, inf_bits = _round_constants(fmt.name)
    c = scratch[: x.numel()]
    y = out.view(torch.float32)
    torch.clamp(x, -fmt.max, fmt.max, out=y)  # (NaN stays NaN)
    # c = 1.5·2^(e + 23 - m), its exponent field from y's, clamped.
    torch.bitwise_and(out, _EXP_MASK, out=c)
    c.clamp_(low, high).add_(magic)
    cf = c.view(torch.float32)
    y.add_(cf).sub_(cf)
    if fmt.name == "float8_e5m2":
        torch.copysign(y, x, out=y)
        # ±max back to ±inf where x is ±inf: its bits plus (inf - max).
        torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=c)
        out.add_(c.eq_(inf_bits).mul_(inf_bits - max_bits))
    else:
        # NaN where x is ±inf or NaN (x - x), before the sign (-0 + 0 is +0).
        y.add_(torch.sub(x, x, out=cf))
        torch.copysign(y, x, out=y)


@functools.lru_cache(maxsize=None)
def _round_constants(name):
    """`(lowest and highest exponent field of c, the bits added to it, max,
    inf)` of `_round_chunk` for the FP8 format `name`, as int32 float32 bit
    patterns (computed once, not per chunk): the exponent fields of the
    smallest normal and of the max; `(23 - m) << 23` (the exponent's
    offset) plus the mantissa's top bit (the 1.5)."""
    fmt = FORMATS[name]
    m = int(np.log2(fmt.smallest_normal / fmt.smallest_subnormal))
    normal, top, inf = (int(np.float32(v).view(np.int32)) for v in (fmt.smallest_normal, fmt.max, np.inf))
    return normal & _EXP_MASK, top & _EXP_MASK, ((23 - m) << 23) | (1 << 22), top, inf
