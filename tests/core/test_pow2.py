"""pow2_round_down / pow2_round_up / pow2_decompose: exact values, special
values (the table in core/pow2.py), float16/bfloat16 inputs and float32
subnormals (compared bit for bit), eager and compiled."""

import keras
import numpy as np
import pytest
from keras.src.backend import standardize_dtype

from keras_scalify.core import pow2_decompose
from keras_scalify.core import pow2_exponent
from keras_scalify.core import pow2_from_exponent
from keras_scalify.core import pow2_round_down
from keras_scalify.core import pow2_round_up
from tests.conftest import to_np

F32_MAX = float(np.finfo(np.float32).max)


# --- helpers -----------------------------------------------------------------
def _np(x):
    """A backend tensor as a NumPy array in its own dtype (no float64)."""
    if standardize_dtype(x.dtype) == "bfloat16":
        x = keras.ops.cast(x, "float32")
    return np.asarray(keras.ops.convert_to_numpy(x))


def bits32(x):
    """The int32 bit patterns of a float32 tensor (subnormals untouched)."""
    assert standardize_dtype(x.dtype) == "float32", x.dtype
    return np.ascontiguousarray(_np(x), dtype=np.float32).view(np.int32)


def np_bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def vec(values, dtype=np.float32):
    """`values` repeated to length 8: small tests share one shape, so eager
    JAX compiles each op once (not once per test)."""
    return np.resize(np.asarray(values, dtype=dtype), 8)


def tensor(values, dtype):
    """A backend tensor of `dtype` built from float32 values (length 8)."""
    return keras.ops.cast(vec(values), dtype)


def ref_round_down(x32):
    """2**floor(log2|x|) for float32 `x32`, exact via np.frexp in float64."""
    x64 = np.abs(np.asarray(x32, dtype=np.float32).astype(np.float64))
    m, e = np.frexp(x64)  # x = m * 2**e, m in [0.5, 1)
    out = np.ldexp(1.0, e - 1)
    out = np.where(x64 == 0, 0.0, out)
    out = np.where(np.isfinite(x64), out, np.inf)
    return out.astype(np.float32)


def ref_round_up(x32):
    x64 = np.abs(np.asarray(x32, dtype=np.float32).astype(np.float64))
    down = ref_round_down(x32).astype(np.float64)
    m, _ = np.frexp(x64)
    out = np.where((m == 0.5) | (x64 == 0), down, 2.0 * down)
    with np.errstate(over="ignore"):
        return out.astype(np.float32)  # 2**128 -> inf


def ref_mantissa(x32):
    x64 = np.asarray(x32, dtype=np.float32).astype(np.float64)
    down = ref_round_down(x32).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.where(down == 0, x64, x64 / down)
    m = np.where(np.isfinite(x64), m, x64)
    return m.astype(np.float32)


def random_float32(rng, n):
    """Random finite float32 values from random bit patterns: normal ones of
    every exponent and (one in four) subnormal ones, both signs."""
    b = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    exp = (b >> 23) & 0xFF
    # No inf/NaN: move exponent 255 to 254.
    b = np.where(exp == 0xFF, b & ~np.uint32(1 << 23), b)
    # One value in four becomes subnormal (exponent bits 0).
    sub = rng.random(n) < 0.25
    b = np.where(sub, b & np.uint32(0x807FFFFF), b)
    x = b.view(np.float32)
    return x[x != 0]


# --- exact values ------------------------------------------------------------
@pytest.mark.parametrize(
    "x, scale, mantissa",
    [
        (2.1, 2.0, np.float32(2.1) / 2),
        (0.3, 0.25, np.float32(0.3) * 4),
        (-0.5, 0.5, -1.0),
        (65504.0, 32768.0, 1.9990234375),
        (3.0, 2.0, 1.5),
        (1.0, 1.0, 1.0),
        (-7.0, 4.0, -1.75),
    ],
)
def test_decompose_exact_values_float32(run, x, scale, mantissa):
    s, m = run(pow2_decompose, np.float32(x))
    assert standardize_dtype(s.dtype) == "float32"
    assert standardize_dtype(m.dtype) == "float32"
    assert to_np(s) == scale
    assert to_np(m) == np.float32(mantissa)
    assert to_np(s) * to_np(m) == np.float64(np.float32(x))


def test_decompose_approximate_mantissas_of_2_1_and_0_3(run):
    s, m = run(pow2_decompose, vec([2.1, 0.3]))
    np.testing.assert_array_equal(to_np(s), vec([2.0, 0.25]))
    np.testing.assert_allclose(to_np(m), vec([1.05, 1.2]), rtol=1e-6)


@pytest.mark.parametrize(
    "x, expected",
    [(2.1, 2.0), (0.3, 0.25), (-0.5, 0.5), (65504.0, 32768.0), (3.0, 2.0),
     (4.0, 4.0), (1.0, 1.0), (0.99, 0.5)],
)
def test_round_down_values(run, x, expected):
    assert to_np(run(pow2_round_down, np.float32(x))) == expected


@pytest.mark.parametrize(
    "x, expected",
    [(4.0, 4.0), (3.0, 4.0), (-3.0, 4.0), (2.1, 4.0), (0.3, 0.5),
     (0.25, 0.25), (1.0, 1.0), (65504.0, 65536.0), (1.0000001, 2.0)],
)
def test_round_up_values_exact_powers_stay(run, x, expected):
    out = run(pow2_round_up, np.float32(x))
    assert standardize_dtype(out.dtype) == "float32"
    assert to_np(out) == expected


def test_round_down_and_up_ignore_sign(run):
    x = vec([-0.5, -3.0, -1e-3, 6.0])
    np.testing.assert_array_equal(to_np(run(pow2_round_down, x)),
                                  vec([0.5, 2.0, 2.0**-10, 4.0]))
    np.testing.assert_array_equal(to_np(run(pow2_round_up, x)),
                                  vec([0.5, 4.0, 2.0**-9, 8.0]))


# --- special values (module table) -------------------------------------------
def test_zero_special_values(run):
    x = vec([0.0, -0.0])
    zeros = np.zeros(8)
    np.testing.assert_array_equal(to_np(run(pow2_round_down, x)), zeros)
    np.testing.assert_array_equal(to_np(run(pow2_round_up, x)), zeros)
    s, m = run(pow2_decompose, x)
    np.testing.assert_array_equal(to_np(s), zeros)
    np.testing.assert_array_equal(to_np(m), zeros)


def test_inf_special_values(run):
    x = vec([np.inf, -np.inf])
    infs = np.full(8, np.inf)
    np.testing.assert_array_equal(to_np(run(pow2_round_down, x)), infs)
    np.testing.assert_array_equal(to_np(run(pow2_round_up, x)), infs)
    s, m = run(pow2_decompose, x)
    np.testing.assert_array_equal(to_np(s), infs)
    np.testing.assert_array_equal(to_np(m), x)


def test_nan_special_values(run):
    x = vec([np.nan, -np.nan])
    infs = np.full(8, np.inf)
    np.testing.assert_array_equal(to_np(run(pow2_round_down, x)), infs)
    np.testing.assert_array_equal(to_np(run(pow2_round_up, x)), infs)
    s, m = run(pow2_decompose, x)
    np.testing.assert_array_equal(to_np(s), infs)
    assert np.all(np.isnan(to_np(m)))


def test_values_above_2_pow_127(run):
    x = vec([3e38, -F32_MAX, 2.0**127])
    np.testing.assert_array_equal(to_np(run(pow2_round_down, x)),
                                  vec([2.0**127]))
    np.testing.assert_array_equal(to_np(run(pow2_round_up, x)),
                                  vec([np.inf, np.inf, 2.0**127]))
    s, m = run(pow2_decompose, x)
    np.testing.assert_array_equal(to_np(s), vec([2.0**127]))
    np.testing.assert_array_equal(
        to_np(m), vec([3e38 / 2.0**127, -F32_MAX / 2.0**127, 1.0]))


# --- float16 / bfloat16 inputs -----------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_decompose_keeps_input_dtype_and_is_exact(run, dtype):
    values = [2.1, 0.3, -0.5, 3.0, 1000.0, -0.007, 60000.0, 1.0]
    x = tensor(values, dtype)
    s, m = run(pow2_decompose, x)
    assert standardize_dtype(s.dtype) == "float32"
    assert standardize_dtype(m.dtype) == dtype
    xv = to_np(x)
    np.testing.assert_array_equal(to_np(s), ref_round_down(xv))
    np.testing.assert_array_equal(to_np(s) * to_np(m), xv)
    assert np.all((np.abs(to_np(m)) >= 1) & (np.abs(to_np(m)) < 2))


def test_float16_subnormals_are_exact(run):
    # Every positive float16 subnormal i * 2**-24 (i = 1..1023), both signs.
    i = np.arange(1, 1024, dtype=np.float64)
    x64 = np.concatenate([i, -i]) * 2.0**-24
    x = keras.ops.convert_to_tensor(x64.astype(np.float16))
    assert standardize_dtype(x.dtype) == "float16"
    s, m = run(pow2_decompose, x)
    assert standardize_dtype(m.dtype) == "float16"
    expected_scale = 2.0 ** np.floor(np.log2(np.abs(x64)))
    np.testing.assert_array_equal(to_np(s), expected_scale)
    np.testing.assert_array_equal(to_np(s) * to_np(m), x64)
    np.testing.assert_array_equal(to_np(run(pow2_round_down, x)),
                                  expected_scale)
    up = np.where(np.log2(i) % 1 == 0, 1.0, 2.0)
    np.testing.assert_array_equal(to_np(run(pow2_round_up, x)),
                                  np.concatenate([up, up]) * expected_scale)


def test_smallest_float16_subnormal(run):
    x = keras.ops.convert_to_tensor(vec([2.0**-24], np.float16))
    s, m = run(pow2_decompose, x)
    assert to_np(s)[0] == 2.0**-24
    assert to_np(m)[0] == 1.0
    assert to_np(run(pow2_round_down, x))[0] == 2.0**-24
    assert to_np(run(pow2_round_up, x))[0] == 2.0**-24


def test_bfloat16_input(run):
    x = tensor([3.0, -0.3, 1e30, 1e-38, 2.0**-130, -(2.0**-133), 1.0, 7.0],
               "bfloat16")
    xv = to_np(x)
    s, m = run(pow2_decompose, x)
    assert standardize_dtype(m.dtype) == "bfloat16"
    np.testing.assert_array_equal(bits32(s), np_bits(ref_round_down(xv)))
    np.testing.assert_array_equal(to_np(s) * to_np(m), xv)
    np.testing.assert_array_equal(bits32(run(pow2_round_down, x)),
                                  np_bits(ref_round_down(xv)))
    np.testing.assert_array_equal(bits32(run(pow2_round_up, x)),
                                  np_bits(ref_round_up(xv)))


# --- float32 subnormals (bits, since JAX/TF flush subnormal arithmetic) ------
def test_float32_subnormal_specific_values(run):
    x = np.array(
        [1e-40, 2.0**-149, -(2.0**-149), 2.0**-130 + 2.0**-140,
         2.0**-127, 3 * 2.0**-149, (2**23 - 1) * 2.0**-149,
         -(2.0**-140 + 2.0**-149)],
        np.float32,
    )
    assert np.all(np.abs(x) < np.finfo(np.float32).smallest_normal)
    expected_down = np.array(
        [2.0**-133, 2.0**-149, 2.0**-149, 2.0**-130, 2.0**-127,
         2.0**-148, 2.0**-127, 2.0**-140],
        np.float32,
    )
    expected_up = np.array(
        [2.0**-132, 2.0**-149, 2.0**-149, 2.0**-129, 2.0**-127,
         2.0**-147, 2.0**-126, 2.0**-139],
        np.float32,
    )
    np.testing.assert_array_equal(bits32(run(pow2_round_down, x)),
                                  np_bits(expected_down))
    np.testing.assert_array_equal(bits32(run(pow2_round_up, x)),
                                  np_bits(expected_up))
    s, m = run(pow2_decompose, x)
    np.testing.assert_array_equal(bits32(s), np_bits(expected_down))
    expected_m = (x.astype(np.float64) / expected_down).astype(np.float32)
    np.testing.assert_array_equal(bits32(m), np_bits(expected_m))
    assert bits32(m)[1] == np_bits(np.float32(1.0))
    assert bits32(m)[2] == np_bits(np.float32(-1.0))


def test_random_float32_sweep_matches_numpy_reference(run, rng):
    x = random_float32(rng, 20000)
    assert np.sum(np.abs(x) < np.finfo(np.float32).smallest_normal) > 1000
    assert np.sum(x < 0) > 1000
    s, m = run(pow2_decompose, x)
    np.testing.assert_array_equal(bits32(s), np_bits(ref_round_down(x)))
    np.testing.assert_array_equal(bits32(m), np_bits(ref_mantissa(x)))
    np.testing.assert_array_equal(bits32(run(pow2_round_down, x)),
                                  np_bits(ref_round_down(x)))
    np.testing.assert_array_equal(bits32(run(pow2_round_up, x)),
                                  np_bits(ref_round_up(x)))


def test_reference_helpers_agree_with_bit_masking(rng):
    # The frexp reference against a second one built from the exponent bits
    # (normal numbers only), so a wrong reference cannot hide a wrong helper.
    x = random_float32(rng, 2000)
    x = x[np.abs(x) >= np.finfo(np.float32).smallest_normal]
    by_bits = (np_bits(x) & 0x7F800000).view(np.float32)
    np.testing.assert_array_equal(np_bits(ref_round_down(x)),
                                  by_bits.view(np.int32))


def test_integer_input_raises_type_error():
    with pytest.raises(TypeError):
        pow2_round_down(np.array([4, 8], np.int32))


# --- exponent helpers --------------------------------------------------------
def test_pow2_exponent_and_from_exponent(run):
    x = vec([1.0, 3.0, 0.3, 2.0**-126, 2.0**127, -8.0, 0.75, 1e30])
    e = run(pow2_exponent, x)
    np.testing.assert_array_equal(to_np(e), [0, 1, -2, -126, 127, 3, -1, 99])
    e_in = np.array([0, 5, -126, 127, -200, 300, -1, -127], np.int32)
    np.testing.assert_array_equal(
        to_np(run(pow2_from_exponent, e_in)),
        [1.0, 32.0, 2.0**-126, 2.0**127, 2.0**-126, 2.0**127, 0.5, 2.0**-126],
    )


def test_pow2_mean_matches_the_mean_exponent(run):
    # `pow2_mean` works on biased exponents: the same powers of two as
    # `pow2_from_exponent(floor(mean(pow2_exponent(s))))`, special values
    # (0, subnormal, inf, NaN, non-powers of two) included.
    from keras_scalify.ops._common import pow2_mean

    values = [1.0, 3.0, 0.3, 2.0**-126, 2.0**-140, 2.0**127, 0.0, np.inf, np.nan, 1e30, 0.75]
    pairs = [(a, b) for a in values for b in values]
    a = np.array([p[0] for p in pairs], np.float32)
    b = np.array([p[1] for p in pairs], np.float32)
    c = np.roll(b, 7)

    def reference(*xs):
        e = sum(to_np(pow2_exponent(x)).astype(np.int64) for x in xs)
        e = np.floor_divide(e, len(xs)).astype(np.int32)
        return to_np(pow2_from_exponent(e))

    for xs in [(a,), (a, b), (a, b, c)]:
        got = to_np(run(lambda *t: pow2_mean(*t), *xs))
        np.testing.assert_array_equal(got, reference(*xs))
