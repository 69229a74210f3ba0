"""Encoding float32 values as stored data × pow2 scale, for the optimizer.

- Weights (`encode_weights`): the scale is kept between rescalings, so the
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
from keras_scalify.core.rounding import stochastic_cast_all
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
        return valid_pow2(S.stack([rms(d) for d in datas]))

    def ones():
        return ops.ones((len(datas),), "float32")

    if not datas:
        return []
    if isinstance(rescale, bool):
        factors = measure() if rescale else ones()
    else:
        factors = backend_optimizer.cond(rescale, measure, ones)
    return S.unstack(factors)


def encode_weights(values, scales, dtypes, keys, owned=False, intos=None, units=None):
    """`(data, scale)` of each float32 weight in `values` with its pow2
    scale in `scales` (the current scale times its `rescale_factors`
    entry, kept in the normal range `[2**-126, 2**126]`): `data = value ·
    (1/scale)`, exact, in the weight's master dtype (`dtypes`).

    Args:
        values: the new represented weights (float32).
        scales: their pow2 scales.
        dtypes: the master dtypes of their data.
        keys: per weight, an int32 scalar key for stochastic rounding
            (`core.rounding.random_bits`), or None for round-to-nearest.
            The stochastic roundings to one dtype run together
            (`stochastic_cast_all`: one pass over a model's small weights
            on eager torch).
        owned: the values are tensors of this step that nothing else reads
            (eager torch's in-place update of the decoded weights): they
            are scaled in place, without weight-sized temporaries.
        intos: per weight, its stored data when nothing reads it any more
            (eager torch's native update, the weights decoded): a
            stochastically rounded weight may be written there (the
            returned data is then that tensor: callers compare identity).
            None: new tensors.
        units: per weight, the pow2 scale (a Python float) its value is
            expressed in, or None for float32 values as they are (a
            weight updated on its stored data: `scale_folds`). The data
            is then `value · (unit/scale)`, no pass where that is 1.
    """
    # A normal pow2 scale has an exact reciprocal: one multiply per
    # element instead of a divide (the scale is kept normal).
    scales, invs = zip(*[_normal_and_inverse(scale) for scale in scales]) if scales else ((), ())
    if units is not None:
        invs = [inv if unit is None else _times(inv, unit) for inv, unit in zip(invs, units)]
    values = S.multiply_all_in_place(values, invs) if owned else [v * inv for v, inv in zip(values, invs)]
    out = [[value, scale] for value, scale in zip(values, scales)]
    rounded = {}
    for i, (dtype, key) in enumerate(zip(dtypes, keys)):
        if dtype == "float32":
            continue
        if key is None:
            out[i][0] = saturating_cast(out[i][0], dtype)
        else:
            rounded.setdefault(dtype, []).append(i)
    for dtype, indices in rounded.items():
        datas = stochastic_cast_all(
            [out[i][0] for i in indices],
            dtype,
            [keys[i] for i in indices],
            owned=owned,
            intos=None if intos is None else [intos[i] for i in indices],
        )
        for i, data in zip(indices, datas):
            out[i][0] = data
    return [tuple(pair) for pair in out]


def _times(inverse, unit):
    """`inverse · unit` (both powers of two), a Python float where the host
    has `inverse` (`multiply_all_in_place` then skips a factor of 1)."""
    value = S.host_value(inverse)
    return unit * value if value is not None else S.multiply(inverse, unit)


@S.memoize_scalars
def _normal_and_inverse(scale):
    """`(scale clipped to [SCALE_MIN, SCALE_MAX], its reciprocal)`."""
    scale = S.clip(scale, SCALE_MIN, SCALE_MAX)
    return scale, 1.0 / scale


def encode_slot(value, dtype):
    """`(data, scale)` for an optimizer slot; scale is None for float32."""
    if dtype == "float32":
        return pow2.as_dtype(value, "float32"), None
    amax = S.max(ops.abs(value)) if len(value.shape) else ops.abs(value)
    scale = valid_pow2(amax) * 2.0**-SLOT_MAX_EXPONENT
    return saturating_cast(value / scale, dtype), scale


def decode_all(datas, scales, owned):
    """`[decode(d, s, o) ...]` over `datas`, `scales` and `owned`, the
    in-place ones as one batch (`backend.scalar.multiply_all_in_place`);
    a scale of None leaves float32 data as it is."""
    values = [pow2.as_dtype(d, "float32") for d in datas]
    batch = [
        i
        for i, (d, s, o) in enumerate(zip(datas, scales, owned))
        if s is not None and (o or dtype_name(d.dtype) != "float32")
    ]
    in_batch = set(batch)
    out = [v if i in in_batch or s is None else v * s for i, (v, s) in enumerate(zip(values, scales))]
    for i, v in zip(batch, S.multiply_all_in_place([values[i] for i in batch], [scales[i] for i in batch])):
        out[i] = v
    return out


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
