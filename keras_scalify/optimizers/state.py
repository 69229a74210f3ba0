"""Encoding float32 values as stored data × pow2 scale, for the optimizer.

- Weights (`encode_weight`): the scale is kept between rescalings, so the
  new data is `value / scale`; every `rescale_every` steps the scale moves
  by `P(rms(data))` of the stored data (`rescale_factors`, read before the
  update, so that the update stays one pass over the weight) and the data
  returns to unit RMS (exact: a pow2 factor).
  Low-precision data is rounded stochastically, or to nearest.
- Optimizer slots (`encode_slot`): float32 slots are stored as they are;
  float16/bfloat16 slots are re-split every step from their max, which
  lands at `[2**14, 2**15)` (under float16's max 65504), so the slot keeps
  float16's full dynamic range below its largest element: an Adam second
  moment of 1e-10 is stored as ~1e4 × 2**-47.
"""

from keras import ops

from keras_scalify.backend import optimizer as backend_optimizer
from keras_scalify.backend import scalar as S
from keras_scalify.backend.scalar import dtype_name
from keras_scalify.core import pow2
from keras_scalify.core.formats import saturating_cast
from keras_scalify.core.rounding import stochastic_cast
from keras_scalify.ops.rescaling import valid_pow2

SLOT_MAX_EXPONENT = 14
# Weight scales stay normal powers of two, so that 1/scale is exact.
SCALE_MIN = 2.0**-126
SCALE_MAX = 2.0**126


def rms(x):
    """The RMS of stored data, in float32 (`backend.scalar.rms`)."""
    return S.rms(pow2.as_dtype(x, "float32"))


def rescale_factors(datas, rescale):
    """`P(rms(d))` of each stored `d` in `datas` when `rescale` (a bool
    tensor, or a Python bool on eager torch) is true, else 1 (a list of
    float32 scalars). The RMS are only computed on such steps, under one
    `cond` for all weights."""

    def measure():
        return valid_pow2(ops.stack([rms(d) for d in datas]))

    def ones():
        return ops.ones((len(datas),), "float32")

    if not datas:
        return []
    if isinstance(rescale, bool):
        factors = measure() if rescale else ones()
    else:
        factors = backend_optimizer.cond(rescale, measure, ones)
    return ops.unstack(factors)


def encode_weight(value, scale, dtype, key=None, owned=False):
    """`(data, scale)` for the float32 weight `value` with the pow2 `scale`
    (the current scale times its `rescale_factors` entry, kept in the normal range
    `[2**-126, 2**126]`): `data = value · (1/scale)`, exact.

    Args:
        value: the new represented weight (float32).
        scale: its pow2 scale.
        dtype: the master dtype of the data.
        key: an int32 scalar key for stochastic rounding
            (`core.rounding.random_bits`), or None for round-to-nearest.
        owned: `value` is a tensor of this step that nothing else reads
            (eager torch's in-place update of the decoded weight): it is
            scaled in place, without a weight-sized temporary.
    """
    # A normal pow2 scale has an exact reciprocal: one multiply per element
    # instead of a divide (the scale is kept normal).
    scale = S.clip(scale, SCALE_MIN, SCALE_MAX)
    inv = 1.0 / scale
    data = S.multiply_in_place(value, inv) if owned else value * inv
    if dtype == "float32":
        return data, scale
    if key is None:
        return saturating_cast(data, dtype), scale
    return stochastic_cast(data, dtype, key=key, owned=owned), scale


def encode_slot(value, dtype):
    """`(data, scale)` for an optimizer slot; scale is None for float32."""
    if dtype == "float32":
        return pow2.as_dtype(value, "float32"), None
    amax = S.max(ops.abs(value)) if len(value.shape) else ops.abs(value)
    scale = valid_pow2(amax) * 2.0**-SLOT_MAX_EXPONENT
    return saturating_cast(value / scale, dtype), scale


def decode(data, scale, owned=False):
    """The float32 value of stored `data` (× `scale` unless it is None);
    `owned`: float32 `data` that may be scaled in place (eager torch's
    native update, which then updates it there). The float32 copy of
    narrower data is scaled in place."""
    narrower = dtype_name(data.dtype) != "float32"  # its cast is a copy
    value = pow2.as_dtype(data, "float32")
    if scale is None:
        return value
    if owned or narrower:
        return S.multiply_in_place(value, scale)
    return value * scale
