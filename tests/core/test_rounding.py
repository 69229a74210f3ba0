"""The random bits of stochastic rounding: a counter-based hash, the same on
every backend (unbiasedness of the rounding itself is tested in
tests/optimizers/test_low_precision.py)."""

import numpy as np
import pytest
from keras import ops

from keras_scalify.core.rounding import hash32
from keras_scalify.core.rounding import random_bits
from keras_scalify.core.rounding import stochastic_cast


def _np_hash32(x):
    """`lowbias32` in NumPy uint32 arithmetic (the reference)."""
    x = np.asarray(x).astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


def _np_random_bits(shape, key):
    golden = np.uint32(0x9E3779B9)
    index = np.arange(int(np.prod(shape)), dtype=np.uint32)
    k = _np_hash32(np.int64(key) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        x = _np_hash32(index * golden + k)
    return x.view(np.int32).reshape(shape)


def _np_noise(size, key, k):
    """The noise `stochastic_cast` adds to the k dropped bits: one hash per
    pair of elements, its low half for the first, its high half for the
    second, each masked to k bits."""
    pairs = _np_random_bits(((size + 1) // 2,), key).view(np.uint32)
    halves = np.stack([pairs & np.uint32(0xFFFF), pairs >> np.uint32(16)], axis=-1).reshape(-1)[:size]
    return halves & np.uint32((1 << k) - 1)


def _bits(shape, key):
    return ops.convert_to_numpy(random_bits(shape, ops.convert_to_tensor(np.int32(key))))


@pytest.mark.parametrize("key", [0, 1, -5, 2**31 - 1, -(2**31)])
def test_random_bits_match_the_uint32_reference_on_every_backend(key):
    np.testing.assert_array_equal(_bits((3, 257), key), _np_random_bits((3, 257), key))


def test_hash32_is_lowbias32():
    x = np.array([0, 1, 2, 12345, -1, 2**31 - 1, -(2**31)], np.int32)
    got = ops.convert_to_numpy(hash32(ops.convert_to_tensor(x))).view(np.uint32)
    np.testing.assert_array_equal(got, _np_hash32(x.view(np.uint32)))


def test_random_bits_are_uniform_and_independent_across_keys():
    n = 1 << 18
    a = _bits((n,), 7).view(np.uint32).astype(np.float64)
    b = _bits((n,), 8).view(np.uint32).astype(np.float64)
    # The 13 bits float16 rounding uses: a chi-square test over 8192 bins
    # (8191 degrees of freedom: mean 8191, std 128).
    top = (a / 2.0**19).astype(np.int64)
    counts = np.bincount(top, minlength=8192)
    expected = n / 8192
    assert abs(((counts - expected) ** 2 / expected).sum() - 8191) < 6 * 128
    # Correlation of 2**18 pairs: std 0.002.
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.01
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.01


@pytest.mark.parametrize("k", [13, 16])
def test_rounding_noise_is_uniform_and_independent_within_and_across_pairs(k):
    # The two halves of one hash feed neighbouring elements: each element's
    # k bits are uniform (chi-square over 2**k bins), uncorrelated with its
    # pair's other half and with the next pair's, and across keys (the
    # backends match this reference bit for bit, below).
    n = 1 << 19
    noise = _np_noise(n, 7, k).astype(np.int64)
    bins = 1 << k
    counts = np.bincount(noise, minlength=bins)
    dof = bins - 1
    assert abs(((counts - n / bins) ** 2 / (n / bins)).sum() - dof) < 6 * np.sqrt(2 * dof)
    u = noise.astype(np.float64)
    assert abs(np.corrcoef(u[0::2], u[1::2])[0, 1]) < 0.01  # one hash's halves
    assert abs(np.corrcoef(u[1:-1:2], u[2::2])[0, 1]) < 0.01  # across pairs
    other = _np_noise(n, 8, k).astype(np.float64)
    assert abs(np.corrcoef(u, other)[0, 1]) < 0.01
    # Each element over 4096 consecutive keys, the two halves of a pair.
    draws = np.stack([_np_noise(2, key, k) for key in range(4096)]).astype(np.int64) >> (k - 6)
    for column in (draws[:, 0], draws[:, 1]):
        counts = np.bincount(column, minlength=64)
        assert abs(((counts - 64) ** 2 / 64).sum() - 63) < 6 * np.sqrt(2 * 63)


def test_bits_of_one_element_are_uniform_across_consecutive_keys():
    # What unbiased rounding over many steps needs: each element's draws
    # over the per-step keys. Consecutive keys (the hardest case for the
    # key mixing), 64 elements each, on the NumPy reference (the backends
    # match it bit for bit, above).
    draws = np.stack([_np_random_bits((64,), k) for k in range(4096)])
    top = draws.view(np.uint32) >> np.uint32(26)  # 64 bins
    for column in (top[:, 0], top[:, 63], top.ravel()):
        counts = np.bincount(column.astype(np.int64), minlength=64)
        expected = column.size / 64
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert abs(chi2 - 63) < 6 * np.sqrt(2 * 63), chi2
    u = draws.view(np.uint32).astype(np.float64)
    # Successive keys, same element; neighbouring elements, same key.
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.01


def test_stochastic_cast_with_a_key_is_deterministic():
    x = np.linspace(1.0, 2.0, 1000, dtype=np.float32)
    key = ops.convert_to_tensor(np.int32(3))
    y1 = ops.convert_to_numpy(ops.cast(stochastic_cast(x, "float16", key=key), "float32"))
    y2 = ops.convert_to_numpy(ops.cast(stochastic_cast(x, "float16", key=key), "float32"))
    np.testing.assert_array_equal(y1, y2)
    other = ops.convert_to_tensor(np.int32(4))
    y3 = ops.convert_to_numpy(ops.cast(stochastic_cast(x, "float16", key=other), "float32"))
    assert np.any(y1 != y3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("owned", [False, True])
def test_stochastic_cast_matches_the_reference_in_chunks(monkeypatch, dtype, owned):
    # Eager torch rounds 100 elements at a time here (the last chunk
    # partial, of odd size); every backend matches the NumPy reference bit for bit.
    import ml_dtypes

    from keras_scalify.backend import scalar

    monkeypatch.setattr(scalar, "ELEMENTWISE_CHUNK", 100)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1051) * 10.0 ** rng.integers(-3, 3, 1051)).astype(np.float32)
    x[:4] = [1e6, -1e6, 0.0, -0.0]
    key = 12345
    got = stochastic_cast(ops.convert_to_tensor(x.copy()), dtype, key=ops.convert_to_tensor(np.int32(key)), owned=owned)
    got = ops.convert_to_numpy(ops.cast(got, "float32"))
    k = {"float16": 13, "bfloat16": 16}[dtype]
    big = float(ml_dtypes.finfo(getattr(ml_dtypes, dtype, np.float16)).max)
    bits = np.clip(x, -big, big).view(np.uint32)
    noise = _np_noise(x.size, key, k)
    with np.errstate(over="ignore"):
        rounded = ((bits + noise) & np.uint32((1 << 32) - (1 << k))).view(np.float32)
    want = rounded.astype(getattr(ml_dtypes, dtype, np.float16)).astype(np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_stochastic_cast_all_is_each_tensors_cast(monkeypatch, dtype):
    # Eager torch rounds the tensors below 100 elements together,
    # concatenated; each result is its own `stochastic_cast`, bit for bit.
    from keras_scalify.backend import scalar
    from keras_scalify.core.rounding import stochastic_cast_all

    monkeypatch.setattr(scalar, "ELEMENTWISE_CHUNK", 100)
    rng = np.random.default_rng(1)
    shapes = [(5,), (3, 10), (99,), (250,), (), (4, 4)]
    xs = [rng.standard_normal(s).astype(np.float32) * 1e3 for s in shapes]
    keys = [ops.convert_to_tensor(np.int32(k)) for k in (7, -3, 2**31 - 1, 0, 11, 7)]
    got = stochastic_cast_all([ops.convert_to_tensor(x) for x in xs], dtype, keys)
    for x, key, y in zip(xs, keys, got):
        want = stochastic_cast(ops.convert_to_tensor(x), dtype, key=key)
        assert tuple(y.shape) == x.shape
        np.testing.assert_array_equal(
            ops.convert_to_numpy(ops.cast(y, "float32")), ops.convert_to_numpy(ops.cast(want, "float32"))
        )


@pytest.mark.parametrize("size", [50, 250])
def test_stochastic_casts_do_not_share_reused_buffers(monkeypatch, size):
    # Eager torch rounds a chunk in reused buffers (`backend.scalar`'s
    # scratch): a result must not be one of them, or the next cast would
    # overwrite it.
    from keras_scalify.backend import scalar

    monkeypatch.setattr(scalar, "ELEMENTWISE_CHUNK", 100)
    rng = np.random.default_rng(2)
    x1, x2 = (rng.standard_normal(size).astype(np.float32) for _ in range(2))
    key = ops.convert_to_tensor(np.int32(9))
    y1 = stochastic_cast(ops.convert_to_tensor(x1), "float16", key=key, owned=True)
    before = ops.convert_to_numpy(ops.cast(y1, "float32")).copy()
    stochastic_cast(ops.convert_to_tensor(x2), "float16", key=key, owned=True)
    np.testing.assert_array_equal(ops.convert_to_numpy(ops.cast(y1, "float32")), before)
    np.testing.assert_allclose(before, x1, rtol=2**-10)


@pytest.mark.parametrize("size", [50, 250])
def test_stochastic_cast_into_a_tensor_equals_a_new_one(monkeypatch, size):
    # Eager torch writes the result into `into` (one call or chunk by
    # chunk) and returns it; a non-contiguous `into` gets a new tensor.
    # The bits are the same either way, on every backend.
    import keras

    from keras_scalify.backend import scalar

    monkeypatch.setattr(scalar, "ELEMENTWISE_CHUNK", 100)
    x = np.random.default_rng(3).standard_normal(size).astype(np.float32)
    key = ops.convert_to_tensor(np.int32(21))
    want = ops.convert_to_numpy(ops.cast(stochastic_cast(ops.convert_to_tensor(x), "float16", key=key), "float32"))
    into = ops.zeros((size,), "float16")
    got = stochastic_cast(ops.convert_to_tensor(x), "float16", key=key, owned=True, into=into)
    assert (got is into) == (keras.backend.backend() == "torch")
    np.testing.assert_array_equal(ops.convert_to_numpy(ops.cast(got, "float32")), want)
    strided = ops.zeros((size, 2), "float16")[:, 0]
    got = stochastic_cast(ops.convert_to_tensor(x), "float16", key=key, into=strided)
    assert got is not strided
    np.testing.assert_array_equal(ops.convert_to_numpy(ops.cast(got, "float32")), want)
