"""FORMATS table and saturating_cast (clip finite values to ±max, then
round to nearest even; ±inf and NaN kept), eager and compiled, from float16/bfloat16/float32 inputs; and
saturating_round, its float32 values in float32 arithmetic."""

import keras
import ml_dtypes
import numpy as np
import pytest
from keras.src.backend import standardize_dtype

from keras_scalify.core import FORMATS
from keras_scalify.core import get_format
from keras_scalify.core import saturating_cast
from keras_scalify.core import saturating_round

INPUT_DTYPES = ["float16", "bfloat16", "float32"]


def values_of(x):
    """A (possibly FP8/bfloat16) tensor's values as float64 NumPy."""
    x = keras.ops.cast(x, "float32")
    return np.asarray(keras.ops.convert_to_numpy(x)).astype(np.float64)


def tensor(values, dtype):
    # float32 -> float16 turns 1e30 into inf on purpose.
    with np.errstate(over="ignore"):
        return keras.ops.cast(np.asarray(values, dtype=np.float32), dtype)


def cast_fn(dtype):
    def fn(x):
        return saturating_cast(x, dtype)

    return fn


# --- FORMATS -----------------------------------------------------------------
@pytest.mark.parametrize(
    "name, np_dtype, max_, smallest_normal, smallest_subnormal",
    [
        ("float8_e4m3fn", ml_dtypes.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9),
        ("float8_e5m2", ml_dtypes.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16),
        ("float16", np.float16, 65504.0, 2.0**-14, 2.0**-24),
        ("bfloat16", ml_dtypes.bfloat16, (2 - 2.0**-7) * 2.0**127, 2.0**-126,
         2.0**-133),
        ("float32", np.float32, (2 - 2.0**-23) * 2.0**127, 2.0**-126,
         2.0**-149),
    ],
)
def test_formats_table(name, np_dtype, max_, smallest_normal,
                       smallest_subnormal):
    fmt = FORMATS[name]
    info = ml_dtypes.finfo(np_dtype)
    assert fmt.name == name
    assert fmt.max == max_ == float(info.max)
    assert (fmt.smallest_normal == smallest_normal
            == float(info.smallest_normal))
    assert (fmt.smallest_subnormal == smallest_subnormal
            == float(info.smallest_subnormal))


def test_get_format_accepts_names_and_rejects_others():
    assert get_format("float8_e4m3fn").max == 448.0
    assert get_format("float16") is FORMATS["float16"]
    with pytest.raises(ValueError, match="int32"):
        get_format("int32")


# --- saturation --------------------------------------------------------------
SATURATION_CASES = {
    "float8_e4m3fn": (
        [1e30, -1e30, np.inf, -np.inf, 1000.0, -1000.0, 448.0, 500.0, -500.0,
         464.0],
        [448.0, -448.0, 448.0, -448.0, 448.0, -448.0, 448.0, 448.0, -448.0,
         448.0],
    ),
    "float8_e5m2": (
        [1e30, -1e30, np.inf, -np.inf, 60000.0, -60000.0, 57344.0, 61440.0,
         -61440.0],
        [57344.0, -57344.0, 57344.0, -57344.0, 57344.0, -57344.0, 57344.0,
         57344.0, -57344.0],
    ),
    "float16": (
        [1e30, -1e30, np.inf, -np.inf, 70000.0, -70000.0, 65504.0, 65520.0],
        [65504.0, -65504.0, 65504.0, -65504.0, 65504.0, -65504.0, 65504.0,
         65504.0],
    ),
}


@pytest.mark.parametrize("in_dtype", INPUT_DTYPES)
@pytest.mark.parametrize("dtype", sorted(SATURATION_CASES))
def test_saturating_cast_clips_finite_overflow_to_max(run, dtype, in_dtype):
    values, expected = SATURATION_CASES[dtype]
    x = tensor(values, in_dtype)
    finite = np.isfinite(values_of(x))  # 1e30 is inf in float16 already
    out = run(cast_fn(dtype), x)
    assert standardize_dtype(out.dtype) == dtype
    got = values_of(out)
    np.testing.assert_array_equal(got[finite], np.asarray(expected)[finite])


@pytest.mark.parametrize("in_dtype", INPUT_DTYPES)
@pytest.mark.parametrize("dtype", sorted(SATURATION_CASES))
def test_saturating_cast_keeps_inf_a_fault(run, dtype, in_dtype):
    """±inf is a fault upstream, not an overflow to saturate: ±inf where
    the format has it, NaN in e4m3fn (torch's plain cast would give ±448)."""
    got = values_of(run(cast_fn(dtype), tensor([np.inf, -np.inf, 3.0], in_dtype)))
    if dtype == "float8_e4m3fn":
        assert np.isnan(got[0]) and np.isnan(got[1]), got
    else:
        assert got[0] == np.inf and got[1] == -np.inf, got
    assert got[2] == 3.0


@pytest.mark.parametrize("in_dtype", INPUT_DTYPES)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float16"])
def test_saturating_cast_keeps_nan(run, dtype, in_dtype):
    out = run(cast_fn(dtype), tensor([np.nan, 1.0, -np.nan], in_dtype))
    got = values_of(out)
    assert np.isnan(got[0]) and np.isnan(got[2]), got
    assert got[1] == 1.0


@pytest.mark.parametrize("in_dtype", INPUT_DTYPES)
@pytest.mark.parametrize(
    "dtype, values, expected",
    [
        # e4m3fn: spacing 2 in [16, 32): 17 is a tie -> even mantissa 16.
        ("float8_e4m3fn", [17.0, 19.0, -17.0, 0.5 + 2.0**-5],
         [16.0, 20.0, -16.0, 0.5]),
        # e5m2: spacing 2 in [8, 16): 9 -> 8 and 11 -> 12 (ties to even).
        ("float8_e5m2", [9.0, 11.0, -11.0, 13.0], [8.0, 12.0, -12.0, 12.0]),
    ],
)
def test_saturating_cast_rounds_to_nearest_even(run, dtype, values, expected,
                                                in_dtype):
    out = run(cast_fn(dtype), tensor(values, in_dtype))
    np.testing.assert_array_equal(values_of(out), expected)


def test_saturating_cast_keeps_small_and_subnormal_values(run):
    # e4m3fn subnormals are multiples of 2**-9; below half of it -> 0.
    x = tensor([2.0**-9, 3 * 2.0**-9, -(2.0**-6), 2.0**-11, 1.5], "float32")
    out = run(cast_fn("float8_e4m3fn"), x)
    np.testing.assert_array_equal(
        values_of(out), [2.0**-9, 3 * 2.0**-9, -(2.0**-6), 0.0, 1.5])


def test_saturating_cast_from_fp8_to_narrower_fp8(run):
    x = saturating_cast(tensor([57344.0, -1024.0, 3.0], "float32"),
                        "float8_e5m2")
    out = run(cast_fn("float8_e4m3fn"), x)
    np.testing.assert_array_equal(values_of(out), [448.0, -448.0, 3.0])


def test_plain_cast_does_not_saturate_e4m3fn_overflow():
    # Why saturating_cast exists: a plain cast of 1000 to e4m3fn is NaN on
    # JAX and TensorFlow (as in ml_dtypes) and on torch's CUDA kernels; only
    # torch's CPU kernel saturates to 448.
    t = keras.ops.convert_to_tensor(np.array([1000.0], np.float32))
    got = values_of(keras.ops.cast(t, "float8_e4m3fn"))[0]
    assert np.isnan(np.float32(1000.0).astype(ml_dtypes.float8_e4m3fn))
    if keras.backend.backend() == "torch" and t.device.type == "cpu":
        assert got == 448.0
    else:
        assert np.isnan(got), got
    saturated = values_of(saturating_cast(np.array([1000.0], np.float32),
                                          "float8_e4m3fn"))[0]
    assert saturated == 448.0


def test_plain_cast_of_e5m2_overflow_is_inf_on_every_backend():
    x = np.array([1e6, -1e6, 61440.0], np.float32)
    got = values_of(keras.ops.cast(x, "float8_e5m2"))
    np.testing.assert_array_equal(got, [np.inf, -np.inf, np.inf])
    saturated = values_of(saturating_cast(x, "float8_e5m2"))
    np.testing.assert_array_equal(saturated, [57344.0, -57344.0, 57344.0])


@pytest.mark.parametrize(
    "src, dst", [("float16", "float32"), ("bfloat16", "float32"), ("float8_e4m3fn", "float8_e5m2"),
                 ("float8_e5m2", "float16"), ("float8_e4m3fn", "float32")]
)
def test_cast_to_a_wider_range_is_a_plain_cast(run, src, dst):
    # Nothing can overflow: no clip, so ±inf (an overflow upstream) stays
    # ±inf for the optimizer's skip check, and NaN stays NaN.
    big = get_format(src).max
    x = keras.ops.cast(np.asarray([big, -big, 2.0, -0.5], np.float32), src)
    out = run(cast_fn(dst), x)
    assert standardize_dtype(out.dtype) == dst
    np.testing.assert_array_equal(values_of(out), values_of(x))
    if src in ("float16", "bfloat16"):
        special = keras.ops.cast(np.asarray([np.inf, -np.inf, np.nan], np.float32), src)
        got = values_of(run(cast_fn(dst), special))
        assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2]), got


# --- saturating_round ------------------------------------------------------------
def _edge_values():
    """Random values over 16 decades, a sweep of float32 bit patterns
    (NaNs and infs included), and each format's boundaries and ties."""
    rng = np.random.default_rng(0)
    parts = [
        (rng.standard_normal(4096) * 10.0**e).astype(np.float32) for e in range(-8, 8)
    ]
    parts.append(np.arange(0, 2**32, 2**32 // 20000, dtype=np.uint64).astype(np.uint32).view(np.float32))
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.0, 65520.0, 2.0**-24, 2.0**-25]
    for name in ("float8_e4m3fn", "float8_e5m2"):
        fmt = FORMATS[name]
        tiny, normal, top = fmt.smallest_subnormal, fmt.smallest_normal, fmt.max
        special += [top, top * 1.01, top * 1.2, normal, normal * (1 - 2.0**-5), tiny, tiny / 2, tiny * 1.5, tiny * 2.5]
    # Ties of the 3- and 2-bit mantissas (round to even both ways).
    special += [1.0625, 1.1875, 1.125, 1.375, 3 * 2.0**-10, 5 * 2.0**-10]
    special = np.asarray(special, np.float32)
    parts += [special, -special]
    return np.concatenate(parts)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float16"])
def test_saturating_round_is_saturating_cast_bit_for_bit(run, dtype):
    x = _edge_values()
    got = keras.ops.convert_to_numpy(run(lambda t: saturating_round(t, dtype), x))
    assert got.dtype == np.float32
    # The independent reference: ml_dtypes' cast after the clip.
    fmax = FORMATS[dtype].max
    with np.errstate(invalid="ignore"):
        want = np.clip(x, -fmax, fmax).astype(getattr(ml_dtypes, dtype, np.float16)).astype(np.float32)
    # ±inf is kept (NaN in e4m3fn, which has no inf), as by saturating_cast.
    want = np.where(np.isinf(x), x if dtype != "float8_e4m3fn" else np.nan, want).astype(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (x[~same][:5], got[~same][:5], want[~same][:5])
    # And the backend's own saturating cast.
    cast = values_of(saturating_cast(x, dtype)).astype(np.float32)
    assert ((got.view(np.uint32) == cast.view(np.uint32)) | (np.isnan(got) & np.isnan(cast))).all()


def test_saturating_round_takes_float16_input_and_refuses_other_formats():
    x = keras.ops.cast(np.asarray([300.0, 460.0, -1e-3], np.float32), "float16")
    got = keras.ops.convert_to_numpy(saturating_round(x, "float8_e4m3fn"))
    np.testing.assert_array_equal(got, np.float32([288.0, 448.0, -(2.0**-9)]))
    with pytest.raises(ValueError, match="dtype"):
        saturating_round(x, "bfloat16")


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="eager torch's tensor conversions")
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float16"])
def test_saturating_cast_converts_no_python_number(monkeypatch, dtype):
    """The clip bounds reach torch as Python numbers: Keras's `ops.clip`
    converts each to a device tensor, on a GPU a host-to-device copy and a
    wait, two per FP8 cast (30 of a scaled_fp8 GPT step's 48 waits on an
    H100)."""
    import torch

    converted = []
    as_tensor = torch.as_tensor

    def counting(value, *args, **kwargs):
        if isinstance(value, (bool, int, float)):
            converted.append(value)
        return as_tensor(value, *args, **kwargs)

    monkeypatch.setattr(torch, "as_tensor", counting)
    x = torch.tensor([1e6, -3.0, float("inf"), 0.5])
    saturating_cast(x, dtype)
    saturating_cast(x.to(torch.float16), dtype)
    assert converted == []
