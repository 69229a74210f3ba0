"""Power-of-two helpers, computed with integer bit operations.

Every helper works on float16, bfloat16 and float32 inputs, computes in
float32 (which holds every float16/bfloat16 value exactly) and is exact for
float32 *subnormals* too: JAX and TensorFlow flush subnormal arithmetic to
zero on CPU, so the exponent is read from the bits, never from arithmetic.

Special values (for every helper the sign of the input is ignored in the
power of two, which is always >= 0):

| x          | pow2_round_down | pow2_round_up | pow2_decompose (scale, mantissa) |
|------------|-----------------|---------------|----------------------------------|
| 0          | 0               | 0             | (0, 0)                           |
| ±inf       | inf             | inf           | (inf, ±inf)                      |
| NaN        | inf             | inf           | (inf, NaN)                       |
| > 2**127   | 2**127          | inf           | (2**127, m)                      |
"""

import math

import keras
from keras import ops

from keras_scalify.backend import scalar as S

_EXP_MASK = 0x7F800000
_MANT_MASK = 0x007FFFFF
_SIGN_MASK = -0x80000000  # 0x80000000 as int32
_ONE_BITS = 0x3F800000


def as_dtype(x, dtype):
    """`x` as a tensor of `dtype`; a tensor that already is one is returned
    as is (eager torch pays a dispatch and a kernel launch per no-op cast,
    and scale arithmetic makes thousands per step)."""
    if S.has_dtype(x, dtype):
        return x
    if S.is_tensor(x):
        return S.cast(x, dtype)
    return ops.cast(ops.convert_to_tensor(x), dtype)


def _as_f32(x):
    if S.has_dtype(x, "float32"):
        return x
    if not S.is_tensor(x):
        x = ops.convert_to_tensor(x)
    if not _is_float(x.dtype):
        raise TypeError(
            f"Expected a floating-point tensor, got dtype {x.dtype}."
        )
    return as_dtype(x, "float32")


def _is_float(dtype):
    return keras.backend.standardize_dtype(dtype) in (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
    )


def _bits(x):
    return S.view(x, "int32")


def _from_bits(b):
    return S.view(as_dtype(b, "int32"), "float32")


def pow2_round_down(x):
    """Largest power of two `<= |x|`, as float32 (see the module table).
    A scalar whose value the host has (`backend.scalar.host_value`: eager
    torch on the CPU) is rounded in Python, and the result is a cached
    tensor: a statistic that changes every step would miss the memo."""
    v = S.host_value(x) if S.is_tensor(x) else None
    if v is not None:
        return S.float32_scalar(_host_round_down(v), x)
    return _pow2_round_down(x)


def _host_round_down(v):
    """`pow2_round_down` of a Python float holding a float16, bfloat16 or
    float32 value (the module table; `frexp` is exact for subnormals)."""
    v = abs(v)
    if v == 0.0:
        return 0.0
    if not math.isfinite(v):
        return math.inf
    return math.ldexp(0.5, math.frexp(v)[1])


@S.memoize_scalars
def _pow2_round_down(x):
    b = _bits(_as_f32(x))
    # A normal |x| rounded down keeps its exponent field alone (inf and NaN
    # keep all ones: inf).
    exp = S.bitwise_and(b, _EXP_MASK)
    # A subnormal |x| is mant * 2**-149: the integer mant converted to
    # float32 (exact, and normal) and rounded down the same way is the
    # float 2**k, whose integer value is the bits of 2**(k - 149); zero
    # stays 0 (11 ops in all, where selecting a bit count took 18).
    mant = S.cast(S.bitwise_and(b, _MANT_MASK), "float32")
    sub = S.cast(_from_bits(S.bitwise_and(_bits(mant), _EXP_MASK)), "int32")
    return _from_bits(S.where(S.equal(exp, 0), sub, exp))


@S.memoize_scalars
def pow2_round_up(x):
    """Smallest power of two `>= |x|`, as float32 (exact powers stay)."""
    x32 = S.abs(_as_f32(x))
    down = pow2_round_down(x32)
    mant = S.bitwise_and(_bits(x32), _MANT_MASK)
    exp = S.bitwise_and(_bits(x32), _EXP_MASK)
    # A normal number is a power of two iff its mantissa bits are zero; a
    # subnormal iff it equals its own round-down.
    is_pow2 = S.where(
        S.equal(exp, 0),
        S.equal(_bits(down), _bits(x32)),
        S.equal(mant, 0),
    )
    is_special = S.equal(exp, _EXP_MASK)
    bits = S.where(
        S.logical_or(is_pow2, is_special), _bits(down), _double_bits(_bits(down))
    )
    return _from_bits(bits)


def _double_bits(b):
    """Bits of 2*p for a power of two p given by its bits (p finite)."""
    exp = S.bitwise_and(b, _EXP_MASK)
    # Normal: add one to the exponent (2**127 becomes inf, as it should).
    # Subnormal (or zero): shift the single mantissa bit left.
    return S.where(S.equal(exp, 0), S.left_shift(b, 1), S.add(b, 1 << 23))


def pow2_decompose(x):
    """Split `x` into `(scale, mantissa)` with `x == mantissa * scale`.

    `scale = pow2_round_down(x)` (float32, >= 0) and `|mantissa|` lies in
    [1, 2) with the sign of `x`; the mantissa has the dtype of `x`. See the
    module table for 0, ±inf and NaN.
    """
    x_in = ops.convert_to_tensor(x)
    b = _bits(_as_f32(x_in))
    sign = S.bitwise_and(b, _SIGN_MASK)
    exp = S.bitwise_and(b, _EXP_MASK)
    mant = S.bitwise_and(b, _MANT_MASK)
    # Subnormal: the mantissa integer converted to float32 is normal and
    # carries the same significant bits.
    sub_bits = _bits(S.cast(S.maximum(mant, 1), "float32"))
    frac = S.where(S.equal(exp, 0), S.bitwise_and(sub_bits, _MANT_MASK), mant)
    m_bits = S.bitwise_or(S.bitwise_or(sign, _ONE_BITS), frac)
    is_zero = S.logical_and(S.equal(exp, 0), S.equal(mant, 0))
    is_special = S.equal(exp, _EXP_MASK)
    # Select on integer bits: XLA CPU may turn a float select into a float
    # comparison that flushes subnormals.
    m_bits = S.where(S.logical_or(is_zero, is_special), b, m_bits)
    mantissa = _from_bits(m_bits)
    return pow2_round_down(_from_bits(b)), S.cast(mantissa, x_in.dtype)


def np_pow2_round_down(x):
    """Static (NumPy) `pow2_round_down` for Python/NumPy scalars > 0."""
    x = float(abs(x))
    if x == 0.0 or not math.isfinite(x):
        return 0.0 if x == 0.0 else float("inf")
    _, e = math.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    return math.ldexp(1.0, e - 1)


def np_pow2_decompose(x):
    """Static (NumPy) `pow2_decompose` of a Python/NumPy float scalar."""
    x = float(x)
    if x == 0.0:
        return 0.0, 0.0
    if not math.isfinite(x):
        return float("inf"), x
    s = np_pow2_round_down(x)
    return s, x / s


def pow2_exponent(x):
    """`floor(log2|x|)` of a normal float32 `x`, as int32 (exact)."""
    b = _bits(_as_f32(x))
    return S.subtract(S.right_shift(S.bitwise_and(b, _EXP_MASK), 23), 127)


def host_exponent(v):
    """`pow2_exponent` of a Python float holding a float32 value, in
    Python: the exponent field minus 127 (-127 for 0 and subnormals, 128
    for inf and NaN)."""
    v = abs(v)
    if not math.isfinite(v):
        return 128
    if v < 2.0**-126:
        return -127
    return math.frexp(v)[1] - 1


def pow2_from_exponent(e):
    """`2**e` as float32 for int32 `e`, clamped to [-126, 127] (exact)."""
    e = S.clip(as_dtype(e, "int32"), -126, 127)
    return _from_bits(S.left_shift(S.add(e, 127), 23))


def biased_exponent(x):
    """`pow2_exponent(x) + 127`: the exponent field of float32 `x`, int32."""
    return S.right_shift(S.bitwise_and(_bits(_as_f32(x)), _EXP_MASK), 23)


def pow2_from_biased_exponent(e):
    """`pow2_from_exponent(e - 127)` for int32 `e` (the field clamped to
    [1, 254])."""
    return _from_bits(S.left_shift(S.clip(e, 1, 254), 23))
