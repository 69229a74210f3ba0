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

The random integers come from a counter-based hash (`hash32`, as in
`random_bits`) of a 32-bit key and the index of each *pair* of elements:
its low 16 bits serve the pair's first element, its high 16 bits the
second, each masked to its `k` bits. In int32 `keras.ops`: integer
arithmetic that fuses with the cast, the same bits on every backend.
(`keras.random.randint` on JAX's default threefry generator took 10.8 ms
per million elements on the 2-core CPU, the hash 0.33 ms: on a
1.9M-parameter model that was most of the optimizer's step. Eager torch
hashes each pair once, half the passes of one hash per element, each of
its 11 integer ops a pass of its own; compiled backends hash each
element's pair in one fused loop, `backend.scalar.pair_noise`.)
"""

import keras

from keras_scalify.backend import scalar as S
from keras_scalify.core.formats import get_format

DROPPED_BITS = {"float16": 13, "bfloat16": 16}

# The multipliers of Chris Wellons's `lowbias32` integer hash and the
# 32-bit golden-ratio constant, as signed int32 (same low 32 bits).
_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)
_GOLDEN = 0x9E3779B9 - (1 << 32)


def _shift_right(x, n, owned=False, out=None):
    """Logical right shift of int32 `x` by `n` bits (`owned`: written into
    `x`, a tensor no one else reads; `out`: into this scratch tensor)."""
    if owned:
        shifted = S.right_shift_in_place(x, n)
    else:
        shifted = S.right_shift_into(x, n, out)
    return S.bitwise_and_in_place(shifted, (1 << (32 - n)) - 1)


def _xor_shift(x, n, owned, scratch=None):
    """`x ^ (x >>> n)` (`owned`: written into `x`; the shift into
    `scratch` when given)."""
    xor = S.bitwise_xor_in_place if owned else S.bitwise_xor
    return xor(x, _shift_right(x, n, out=scratch))


def hash32(x, owned=False):
    """`lowbias32`: a bijective avalanche hash of int32 `x` (wrapping
    int32 arithmetic, bit-identical on every backend). `owned`: computed
    in place in `x`, a tensor no one else reads, its shifts in one scratch
    tensor (eager torch: one temporary instead of ten weight-sized ones)."""
    multiply = S.multiply_in_place if owned else S.multiply
    scratch = S.scratch_like(x) if owned else None
    x = _xor_shift(x, 16, owned, scratch)
    x = multiply(x, _M1)
    x = _xor_shift(x, 15, owned, scratch)
    x = multiply(x, _M2)
    return _xor_shift(x, 16, owned, scratch)


def random_bits(shape, key, start=0):
    """Uniform random int32 bit patterns of `shape` for an int32 scalar
    `key`: `hash32` of each element's flat index (plus `start`) times the
    golden-ratio constant (a Weyl sequence) plus the hashed key. One hash
    round per element (11 integer ops), in place on the index tensor;
    different keys give independent patterns."""
    index = S.int32_range(start, tuple(int(d) for d in shape))
    return _hashed(index, hash32(S.cast(key, "int32")))


def _hash_owned(x):
    """`hash32(x)`, in place in `x` (a tensor no one else reads)."""
    return hash32(x, owned=True)


def _hashed(index, hashed_key):
    """`hash32(index · golden + hashed_key)`, in place on the int32 flat
    indices `index` (`hashed_key`: a scalar, or one per element)."""
    return hash32(S.add_in_place(S.multiply_in_place(index, _GOLDEN), hashed_key), owned=True)


def draw_key(seed):
    """One int32 key from a `keras.random.SeedGenerator` or an int seed."""
    return keras.random.randint((), -(2**31), 2**31 - 1, dtype="int32", seed=seed)


def stochastic_cast(x, dtype, seed=None, key=None, owned=False, into=None):
    """Cast float32 `x` to `dtype` (float16 or bfloat16) with stochastic
    rounding, saturating at the format's max; float32 is returned as is.

    Args:
        x: a float tensor.
        dtype: "float16", "bfloat16" or "float32".
        seed: a `keras.random.SeedGenerator` or an int (as `keras.random`),
            from which one key is drawn; ignored when `key` is given.
        key: an int32 scalar tensor: the random bits of elements `2j` and
            `2j + 1` (flat) are the low and high halves of entry `j` of
            `random_bits((ceil(size / 2),), key)`.
        owned: `x` is a float32 tensor no one else reads: it is clipped in
            place (eager torch).
        into: a tensor of `x`'s shape in `dtype` that no one reads any
            more: on eager torch (a contiguous tensor outside autograd)
            the result may be written there and `into` returned; callers
            compare identity (elsewhere, a new tensor).
    """
    dtype = keras.backend.standardize_dtype(dtype)
    x = S.cast(x, "float32")
    if dtype == "float32":
        return x
    if dtype not in DROPPED_BITS:
        raise ValueError(
            f"`dtype` must be float16, bfloat16 or float32, got {dtype!r}."
        )
    if key is None:
        key = draw_key(seed)
    clip = S.clip_in_place if owned else S.clip
    hashed_key = hash32(S.cast(key, "int32"))
    k = DROPPED_BITS[dtype]

    def piece(x, start):
        # (Eager torch: a slice at a time into reused buffers,
        # `backend.scalar.chunked` and `pair_noise`; a chunk starts at an
        # even index, so its pairs are the whole tensor's.)
        if start % 2:
            raise ValueError(f"A chunk must start at an even index, got {start}.")
        noise = S.pair_noise(start, tuple(x.shape), _GOLDEN, hashed_key, (1 << k) - 1, _hash_owned, x)
        return _round_bits(x, dtype, noise, clip)

    return S.chunked(piece, x, dtype, into)


def _round_bits(x, dtype, noise, clip):
    """The stochastic rounding of float32 `x` to `dtype`'s precision with
    the int32 noise `noise` (uniform below `2**k`, for the `k` bits `dtype`
    drops; written over), as float32 values that `dtype` represents
    exactly."""
    k = DROPPED_BITS[dtype]
    big = get_format(dtype).max
    bits = S.view(clip(x, -big, big), "int32")
    bits = S.bitwise_and_in_place(S.add_in_place(noise, bits), -(2**k))
    return S.view(bits, "float32")


def stochastic_cast_all(xs, dtype, keys, owned=False, intos=None):
    """`[stochastic_cast(x, dtype, key=key, owned=owned, into=into) for x,
    key, into in zip(xs, keys, intos)]`, bit for bit (`intos`: None for
    no `into`; a batched small tensor is not written into). On eager torch the small tensors
    (`backend.scalar.batches`: a model's biases, norms, attention
    projections) are rounded together, concatenated: one pass of ~20 ops
    instead of ~20 ops each."""
    dtype = keras.backend.standardize_dtype(dtype)
    out = [None] * len(xs)
    small = [i for i, x in enumerate(xs) if S.batches(x)]
    if dtype in DROPPED_BITS and len(small) > 1:
        group = [xs[i] for i in small]
        flat, index, segment = S.concatenate_flat(group)
        hashed = hash32(S.cast(S.stack([keys[i] for i in small]), "int32"))
        # Each element's pair (its index within its own tensor) hashed
        # with its own tensor's key.
        keys_each = S.gather(hashed, segment)
        noise = S.indexed_pair_noise(index, _GOLDEN, keys_each, (1 << DROPPED_BITS[dtype]) - 1, _hash_owned)
        rounded = S.cast(_round_bits(flat, dtype, noise, S.clip_in_place), dtype)
        for i, piece in zip(small, S.split_like(rounded, group)):
            out[i] = piece
    intos = [None] * len(xs) if intos is None else intos
    return [
        y if y is not None else stochastic_cast(x, dtype, key=key, owned=owned, into=into)
        for x, key, y, into in zip(xs, keys, out, intos)
    ]
