"""Stochastic rounding of float32 to float16/bfloat16 (for master weights).

Round-to-nearest loses every update smaller than half a unit in the last
place of the stored weight: an FP16 weight near 1 ignores any step below
2**-11. Stochastic rounding keeps the expected value: it rounds up in
magnitude with probability equal to the discarded fraction of a unit, so
a steady stream of tiny updates moves the weight on average.

Done on the float32 bit pattern: add uniform random integers below
`2**k` to the `k` mantissa bits the target format drops (13 for float16,
16 for bfloat16), then clear them. The carry moves the magnitude to the
next representable value exactly when the random draw is below the
discarded fraction. Exact for every normal target value; values in
float16's subnormal range (|x| < 2**-14) then round to nearest.
"""

import keras
from keras import ops
from keras.src.backend import standardize_dtype

from keras_scalify.core.formats import get_format

DROPPED_BITS = {"float16": 13, "bfloat16": 16}


def stochastic_cast(x, dtype, seed=None):
    """Cast float32 `x` to `dtype` (float16 or bfloat16) with stochastic
    rounding, saturating at the format's max; float32 is returned as is.

    Args:
        x: a float tensor.
        dtype: "float16", "bfloat16" or "float32".
        seed: a `keras.random.SeedGenerator` or an int (as `keras.random`).
    """
    dtype = standardize_dtype(dtype)
    x = ops.cast(x, "float32")
    if dtype == "float32":
        return x
    if dtype not in DROPPED_BITS:
        raise ValueError(
            f"`dtype` must be float16, bfloat16 or float32, got {dtype!r}."
        )
    k = DROPPED_BITS[dtype]
    big = get_format(dtype).max
    bits = ops.view(ops.clip(x, -big, big), "int32")
    noise = keras.random.randint(ops.shape(x), 0, 2**k, dtype="int32", seed=seed)
    bits = ops.bitwise_and(ops.add(bits, noise), -(2**k))
    return ops.cast(ops.view(bits, "float32"), dtype)
