"""`keras_scalify.backend.scalar`: the ops of scale arithmetic give what
`keras.ops` gives (values and dtypes), for the operands the helpers pass:
tensors with Python numbers, NumPy scalars, special values. On torch they
are the torch functions themselves; elsewhere `keras.ops`."""

import math

import keras
import numpy as np
import pytest
from keras import ops
from keras.src.backend import standardize_dtype

from keras_scalify.backend import scalar as S
from tests.conftest import to_np

F = np.array([0.0, -0.0, 1.5, -3.0, 2.0**-140, 3e38, np.inf, -np.inf, np.nan], np.float32)
I = np.array([0, 1, -7, 0x7F800000, -(2**31), 2**31 - 1], np.int32)


def _same(got, want):
    assert standardize_dtype(got.dtype) == standardize_dtype(want.dtype)
    np.testing.assert_array_equal(to_np(got), to_np(want))


def f32(v=F):
    return ops.convert_to_tensor(v)


CASES = [
    ("multiply", lambda: (f32(), f32(F[::-1].copy()))),
    ("multiply", lambda: (f32(), 0.5)),
    ("maximum", lambda: (f32(), f32(F[::-1].copy()))),
    ("maximum", lambda: (f32(), 1.0)),
    ("maximum", lambda: (2.0, f32())),
    ("maximum", lambda: (ops.convert_to_tensor(I), 1)),
    ("minimum", lambda: (f32(), -1.0)),
    ("minimum", lambda: (ops.convert_to_tensor(I), 5)),
    ("divide_no_nan", lambda: (f32(), f32(F[::-1].copy()))),
    ("divide_no_nan", lambda: (f32(), 0.0)),
    ("divide_no_nan", lambda: (f32(), 4.0)),
    ("divide_no_nan", lambda: (1.0, f32())),
    ("add", lambda: (f32(), 1.5)),
    ("add", lambda: (f32(), f32(F[::-1].copy()))),
    ("add", lambda: (ops.convert_to_tensor(I), 1 << 23)),
    ("subtract", lambda: (ops.convert_to_tensor(I), 127)),
    ("subtract", lambda: (f32(), -0.0)),
    ("subtract", lambda: (f32(), float("nan"))),
    ("multiply", lambda: (ops.convert_to_tensor(I), 3)),
    ("multiply", lambda: (ops.convert_to_tensor(I), 0.5)),
    ("equal", lambda: (f32(), 0)),
    ("equal", lambda: (ops.convert_to_tensor(I), 0)),
    ("not_equal", lambda: (ops.convert_to_tensor(I), 1)),
    ("greater", lambda: (f32(), 0.0)),
    ("logical_and", lambda: (ops.greater(f32(), 0.0), ops.isfinite(f32()))),
    ("logical_or", lambda: (ops.greater(f32(), 0.0), ops.isfinite(f32()))),
    ("logical_not", lambda: (ops.isfinite(f32()),)),
    ("isfinite", lambda: (f32(),)),
    ("abs", lambda: (f32(),)),
    ("ones_like", lambda: (ops.convert_to_tensor(I),)),
    ("bitwise_and", lambda: (ops.convert_to_tensor(I), 0x7F800000)),
    ("bitwise_or", lambda: (ops.convert_to_tensor(I), -(2**31))),
    ("left_shift", lambda: (ops.convert_to_tensor(np.array([1, 3], np.int32)), 23)),
    ("left_shift", lambda: (ops.ones((3,), "int32"), ops.convert_to_tensor(np.array([0, 5, 30], np.int32)))),
    ("right_shift", lambda: (ops.convert_to_tensor(I), 23)),
    ("floor_divide", lambda: (ops.convert_to_tensor(I), 2)),
    ("clip", lambda: (ops.convert_to_tensor(I), -126, 127)),
    ("where", lambda: (ops.isfinite(f32()), f32(), 0.0)),
    ("where", lambda: (ops.isfinite(f32()), 7, ops.convert_to_tensor(np.arange(9, dtype=np.int32)))),
    ("where", lambda: (np.bool_(True), 1.0, np.float32(2.0))),
    ("where", lambda: (True, f32(), 1.0)),
    ("where", lambda: (ops.isfinite(f32(F[:6].copy())), ops.convert_to_tensor(I), 1.5)),
    ("multiply", lambda: (np.float32(2.0), np.float32(3.0))),
]


@pytest.mark.parametrize("name,args", CASES, ids=[f"{c[0]}{i}" for i, c in enumerate(CASES)])
def test_scalar_op_matches_keras_ops(name, args):
    a = args()
    _same(getattr(S, name)(*a), getattr(ops, name)(*a))


def test_casts_views_and_reductions_match_keras_ops():
    x = f32()
    for dtype in ("int32", "float16", "bfloat16", "float32"):
        _same(S.cast(x, dtype), ops.cast(x, dtype))
    _same(S.view(x, "int32"), ops.view(x, "int32"))
    _same(S.view(S.view(x, "int32"), "float32"), x)
    finite = f32(F[:6].copy())
    _same(S.max(finite), ops.max(finite))
    assert math.isnan(float(to_np(S.max(x))))  # a NaN is never dropped
    _same(S.stop_gradient(x), x)
    _same(S.mean(finite), ops.mean(finite))
    _same(S.sqrt(S.abs(finite)), ops.sqrt(ops.abs(finite)))
    _same(S.square(x), ops.square(x))
    np.testing.assert_allclose(
        to_np(S.rms(finite[:5])), to_np(ops.sqrt(ops.mean(ops.square(finite[:5])))), rtol=1e-6
    )
    assert not np.isfinite(to_np(S.rms(f32(np.full(4, 1e20, np.float32)))))
    # A weight-sized 2-D operand (TensorFlow: the l2_loss route), float64 reference.
    w = np.random.default_rng(0).standard_normal((300, 7)).astype(np.float32) * 2.0**-30
    np.testing.assert_allclose(
        float(to_np(S.rms(f32(w)))), np.sqrt(np.mean(w.astype(np.float64) ** 2)), rtol=1e-5
    )
    # Empty: 0 (not measured), not a NaN that would skip every step.
    assert float(to_np(S.rms(f32(np.zeros((0, 3), np.float32))))) == 0.0
    # (A multiply by one on JAX/TF: XLA and TF flush the subnormal to 0.)
    normal = f32(np.delete(F, 4))
    _same(S.identity_in_custom_gradient(normal), normal)


def test_cached_constants_keep_each_ops_result():
    """Python numbers passed as cached 0-d tensors give what the number
    gives, call after call, for 0-d scales and int32 exponent bits."""
    s = ops.convert_to_tensor(np.float32(2.0**-20))
    e = ops.convert_to_tensor(np.int32(-20))
    for _ in range(3):
        _same(S.multiply(s, 0.5), ops.multiply(s, 0.5))
        _same(S.subtract(e, 127), ops.subtract(e, 127))
        _same(S.left_shift(S.add(e, 127), 23), ops.left_shift(ops.add(e, 127), 23))
        _same(S.equal(s, 0), ops.equal(s, 0))
        # 0.0 cached first: -0.0 (equal as a dict key) keeps its sign.
        z = ops.convert_to_tensor(np.float32(0.0))
        for c in (0.0, -0.0, 0):
            got = S.add(z, c) if c == 0.0 else S.multiply(z, c)
            want = ops.add(z, c) if c == 0.0 else ops.multiply(z, c)
            _same(got, want)
            signs = [np.signbit(ops.convert_to_numpy(f(s, c))) for f in (S.multiply, ops.multiply)]
            assert signs[0] == signs[1], (c, signs)
    _same(S.bitwise_and(e, -(2**31)), ops.bitwise_and(e, -(2**31)))


def test_full_scalar_and_where_constants_keep_value_dtype_and_sign():
    """`full_scalar` is `ops.full((), v, dtype=like.dtype)` (cached on
    eager torch), and `where` with a Python number gives what the number
    gives, -0.0 included, call after call."""
    likes = [f32(), ops.cast(f32(), "float16"), ops.cast(f32(), "bfloat16"), ops.convert_to_tensor(I)]
    for _ in range(2):  # the second time from the cache
        for like in likes:
            ints = standardize_dtype(like.dtype) == "int32"
            for v in (0.0, -0.0, 1.5, 3, -(2**20)) if ints else (0.0, -0.0, 1.5, 3, 70000.0, np.inf, -np.inf):
                # (the number rounded to `like`'s dtype: on CUDA, torch's
                # `full` refuses a finite float16 overflow outright)
                want = ops.full((), v, dtype="int32" if ints else "float32")
                got, want = S.full_scalar(v, like), ops.cast(want, like.dtype)
                assert standardize_dtype(got.dtype) == standardize_dtype(like.dtype)
                got, want = (to_np(ops.cast(t, "float32")) for t in (got, want))  # (bfloat16 on TF)
                np.testing.assert_array_equal(got, want)
                assert np.signbit(got) == np.signbit(want), (v, like.dtype)
        cond = ops.isfinite(f32())
        for c in (0.0, -0.0):
            got, want = S.where(cond, f32(), c), ops.where(cond, f32(), c)
            _same(got, want)
            np.testing.assert_array_equal(np.signbit(to_np(got)), np.signbit(to_np(want)))


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch.inference_mode (torch only)")
def test_cached_constants_are_not_made_under_inference_mode():
    """A cached constant first asked for under `torch.inference_mode`
    would be an inference tensor, which autograd cannot save for a
    backward outside it: none is cached there."""
    import torch

    v = 0.2890625  # a value no other test caches
    x = torch.ones(3)
    with torch.inference_mode():
        S.float32_scalar(v, x), S.full_scalar(v, x), S.multiply(x, v)
    w = torch.ones(3, requires_grad=True)
    for c in (S.float32_scalar(v, w), S.full_scalar(v, w)):
        torch.maximum(w, c).sum().backward()  # saves c
    S.multiply(w, v).sum().backward()  # saves the cached constant
    assert w.grad is not None


def test_has_dtype_and_is_tensor():
    x = f32()
    assert S.is_tensor(x) and not S.is_tensor(1.0) and not S.is_tensor(np.float32(1))
    assert S.has_dtype(x, "float32") and not S.has_dtype(x, "int32")
    assert not S.has_dtype(np.float32(1.0), "float32")


def test_variable_value_reads_the_current_value():
    import keras

    v = keras.Variable(np.float32(2.0))
    _same(S.variable_value(v), ops.convert_to_tensor(np.float32(2.0)))
    v.assign(np.float32(4.0))
    _same(S.variable_value(v), ops.convert_to_tensor(np.float32(4.0)))
    with keras.StatelessScope(state_mapping=[(v, ops.convert_to_tensor(np.float32(8.0)))]):
        _same(S.variable_value(v), ops.convert_to_tensor(np.float32(8.0)))


def test_variable_value_follows_every_scope_keras_applies():
    """The direct read of a variable's tensor (eager torch) gives what
    `Variable.value` gives: inside a stateless scope the mapped value,
    inside an autocast scope an autocast variable cast and a
    non-autocast one as it is, on the meta device (symbolic calls) a
    stub, and after `assign` the new value."""
    from keras.src.backend.common.variables import AutocastScope

    v = keras.Variable(np.float32(2.0))
    kept = keras.Variable(np.float32(2.0), autocast=False)
    for var in (v, kept):
        assert S.variable_value(var) is var.value or _eq(S.variable_value(var), var.value)
    with AutocastScope("float16"):
        assert standardize_dtype(S.variable_value(v).dtype) == "float16"
        assert standardize_dtype(S.variable_value(kept).dtype) == "float32"
    with keras.StatelessScope(state_mapping=[(kept, ops.convert_to_tensor(np.float32(8.0)))]):
        _same(S.variable_value(kept), ops.convert_to_tensor(np.float32(8.0)))
    kept.assign(np.float32(3.0))
    _same(S.variable_value(kept), ops.convert_to_tensor(np.float32(3.0)))
    if keras.backend.backend() == "torch":
        from keras.src.backend.torch.core import device_scope

        with device_scope("meta"):
            assert S.variable_value(kept).device.type == "meta"


def _eq(a, b):
    return np.array_equal(to_np(a), to_np(b))


def test_signature_keys_shape_dtype_and_device_on_eager_torch_only():
    x = ops.zeros((2, 3))
    sig = S.signature(x)
    if keras.backend.backend() != "torch":
        assert sig is None
        return
    assert sig == S.signature(ops.ones((2, 3)))
    assert sig != S.signature(ops.zeros((3, 2)))
    assert sig != S.signature(ops.zeros((2, 3), "float16"))
    assert S.signature(np.zeros((2, 3))) is None


def test_in_place_ops_match_keras_ops_and_spare_autograd():
    a = np.array([1.5, -3.0, 2.0**-140, 3e38, np.inf, np.nan], np.float32)
    ints = np.array([5, -7, 2**31 - 1, -(2**31)], np.int32)
    pairs = [
        (S.multiply_in_place, ops.multiply, a, 2.0),
        (S.add_in_place, ops.add, a, 1.0),
        (S.subtract_in_place, ops.subtract, a, 1.0),
        (S.bitwise_and_in_place, ops.bitwise_and, ints, 0x0F0F0F0F),
        (S.bitwise_xor_in_place, ops.bitwise_xor, ints, -3),
        (S.right_shift_in_place, ops.right_shift, ints, 3),
    ]
    for in_place, op, x, y in pairs:
        _same(in_place(ops.convert_to_tensor(x.copy()), y), op(ops.convert_to_tensor(x), y))
    _same(S.clip_in_place(f32(a.copy()), -448.0, 448.0), ops.clip(f32(a), -448.0, 448.0))
    t = ops.convert_to_tensor(ints)
    scratch = S.scratch_like(t)
    for _ in range(2):  # a scratch tensor is written over on each use
        _same(S.right_shift_into(t, 3, scratch), ops.right_shift(t, 3))
    _same(t, ops.convert_to_tensor(ints))
    if keras.backend.backend() != "torch":
        assert scratch is None
        return
    assert S.right_shift_into(t, 3, scratch) is scratch
    import torch

    x = torch.ones(3, requires_grad=True)
    y = S.multiply_in_place(x, 2.0)  # recorded by autograd: not in place
    assert y is not x and float(x[0]) == 1.0
    y.sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
    with torch.no_grad():
        assert S.clip_in_place(x, 0.0, 0.5) is x and float(x[0]) == 0.5


# --- memoize_scalars -----------------------------------------------------------

SCALARS = [0.0, -0.0, 1.0, 0.75, 2.0**-140, 2.0**127, 3e38, np.inf, -np.inf, np.nan]


def _memo_helpers():
    """Memoized scale helpers and how to call them on two float32 scalars."""
    from keras_scalify.core import pow2
    from keras_scalify.layers.variable import effective_grad_scale
    from keras_scalify.ops import _common
    from keras_scalify.ops.arithmetic import _sum_scales

    return {
        "pow2_round_down": lambda a, b: pow2.pow2_round_down(a),
        "pow2_round_up": lambda a, b: pow2.pow2_round_up(b),
        "pow2_mean": lambda a, b: _common.pow2_mean(a, b),
        "grad_factor": lambda a, b: _common.grad_factor(a, b, b, a),
        "votes": lambda a, b: _common.votes([a, b], [S.greater(a, 0.0), True]),
        "effective_grad_scale": lambda a, b: effective_grad_scale(a, b),
        "_sum_scales": lambda a, b: _sum_scales(a, b, b, a, None),
    }


def _flat(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


@pytest.mark.parametrize("name", sorted(_memo_helpers()))
def test_memoized_helpers_give_their_function_s_results_bit_for_bit(name):
    """Every pair of special values, twice (the second call hits the
    cache on torch): the results of the memoized helper are those of the
    function it wraps, bits and dtypes."""
    call = _memo_helpers()[name]
    for a in SCALARS:
        for b in SCALARS:
            ta, tb = f32(np.float32(a)), f32(np.float32(b))
            first = _flat(call(ta, tb))
            second = _flat(call(f32(np.float32(a)), f32(np.float32(b))))
            plain = _flat(_unmemoized(call, ta, tb))
            assert len(first) == len(second) == len(plain)
            for x, y, z in zip(first, second, plain):
                want = np.asarray(to_np(z))
                for got in (x, y):
                    got = np.asarray(to_np(got))
                    assert got.dtype == want.dtype, (name, a, b)
                    assert got.tobytes() == want.tobytes(), (name, a, b, got, want)


def _unmemoized(call, *args):
    """`call(*args)` with memoization switched off."""
    with S.memo_disabled():
        return call(*args)


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="memoization is eager torch's")
def test_memoize_scalars_calls_once_per_value_and_keeps_signed_zeros_apart():
    import torch

    calls = []

    @S.memoize_scalars
    def f(x, k, flags):
        calls.append(1)
        return [x * k, S.greater(x, 0.0)]

    one = torch.tensor(1.0)
    out = f(one, 2.0, [True, None])
    again = f(torch.tensor(1.0), 2.0, [True, None])
    assert len(calls) == 1
    assert again[0] is out[0] and again is not out  # a fresh list each call
    f(one, 3.0, [True, None])
    f(one, 2.0, [False, None])
    f(torch.tensor(1, dtype=torch.int32), 2.0, [True, None])  # int 1 is not 1.0
    assert len(calls) == 4
    neg = f(torch.tensor(-0.0), 1.0, None)
    pos = f(torch.tensor(0.0), 1.0, None)
    assert math.copysign(1.0, neg[0].item()) == -1.0
    assert math.copysign(1.0, pos[0].item()) == 1.0
    n = len(calls)
    f(torch.tensor(float("nan")), 1.0, None)
    f(torch.tensor(float("nan")), 1.0, None)
    assert len(calls) == n + 2  # NaN has no key
    # No tensor, a tensor with a gradient, a non-scalar, inference mode:
    # computed every time.
    for args in [
        (1.0, 2.0, None),
        (torch.tensor(1.0, requires_grad=True), 2.0, None),
        (torch.ones(2), 2.0, None),
    ]:
        n = len(calls)
        f(*args)
        f(*args)
        assert len(calls) == n + 2
    n = len(calls)
    with torch.inference_mode():
        f(one, 2.0, [True, None])
    assert len(calls) == n + 1


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="memoization is eager torch's")
def test_memoize_scalars_does_not_keep_an_input_it_returns():
    """A result that is one of the arguments (e.g. a variable's own
    tensor, written in place later) is returned, not cached."""
    import torch

    @S.memoize_scalars
    def first(x, y):
        return x, y * 2.0

    storage = torch.tensor(1.0)
    out = first(storage, torch.tensor(3.0))
    assert out[0] is storage
    storage.fill_(7.0)  # as an optimizer writes a variable
    again = first(torch.tensor(1.0), torch.tensor(3.0))
    assert again[0].item() == 1.0
    # An argument that a memo keeps (never written) may be kept again.
    calls = []

    @S.memoize_scalars
    def double(x):
        return x * 2.0

    @S.memoize_scalars
    def same(x):
        calls.append(1)
        return x

    kept = double(torch.tensor(1.0))
    assert same(kept) is kept and same(torch.tensor(2.0)) is kept
    assert len(calls) == 1


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="memoization is eager torch's")
def test_memoized_results_follow_a_variable_written_in_place():
    """A scale variable's tensor is read by value at every call: after the
    optimizer writes it (in place), the helper sees the new value."""
    from keras_scalify.layers.variable import effective_grad_scale

    scale = keras.Variable(2.0, dtype="float32", trainable=False)
    gs = keras.Variable(0.0, dtype="float32", trainable=False)
    read = lambda v: S.stop_gradient(S.variable_value(v))  # noqa: E731
    assert float(effective_grad_scale(read(gs), read(scale))) == 0.5
    scale.assign(8.0)
    assert float(effective_grad_scale(read(gs), read(scale))) == 0.125
    gs.assign(-4.0)
    assert float(effective_grad_scale(read(gs), read(scale))) == 4.0


def test_host_value_reads_only_what_the_host_has_for_free():
    """Python numbers everywhere; on eager torch a 0-d CPU tensor without
    gradient too; never a tensor of a traced backend, a non-scalar or a
    tensor that needs a gradient. `is_one` is exact."""
    assert S.host_value(2) == 2.0 and S.host_value(0.5) == 0.5
    assert S.is_one(1) and S.is_one(1.0) and not S.is_one(1.0 + 2.0**-23)
    one = ops.convert_to_tensor(np.float32(1.0))
    # (A CUDA scalar is not free: reading it syncs the device.)
    on_torch = keras.backend.backend() == "torch" and one.device.type == "cpu"
    assert S.is_one(one) is on_torch
    assert S.host_value(ops.convert_to_tensor(np.float32(-0.25))) == (-0.25 if on_torch else None)
    assert S.host_value(ops.ones((1,))) is None
    assert not S.is_one(ops.convert_to_tensor(np.float32(np.nan)))
    if on_torch:
        import torch

        assert S.host_value(torch.tensor(1.0, requires_grad=True)) is None


def test_batched_optimizer_helpers_match_their_per_tensor_ops():
    """`rms_all` gives `rms` of each tensor bit for bit (one
    `_foreach_norm` on eager torch); `multiply_all_in_place` gives
    `multiply` of each pair, writing the tensors that may be written (on
    torch, not one that autograd records) and leaving the others."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(shape).astype("float32") * 2.0**e for shape, e in [((7, 5), -30), ((11,), 0), ((), 40)]]
    arrays.append(np.array([-0.0, np.inf, np.nan, 2.0**-149, 3.0], np.float32))
    xs = [ops.convert_to_tensor(a) for a in arrays]
    want = np.stack([np.asarray(to_np(S.rms(x))) for x in xs])
    assert to_np(S.rms_all(xs)).tobytes() == want.tobytes()
    factors = [ops.convert_to_tensor(np.float32(f)) for f in (2.0**-3, 1.0, 2.0**7, 1.0)]
    want = [np.asarray(to_np(S.multiply(x, f))) for x, f in zip(xs, factors)]
    fresh = [ops.convert_to_tensor(a.copy()) for a in arrays]
    if keras.backend.backend() == "torch":
        fresh[1].requires_grad_(True)
    got = S.multiply_all_in_place(fresh, factors)
    for g, w in zip(got, want):
        g = np.asarray(to_np(g if not getattr(g, "requires_grad", False) else g.detach()), np.float32)
        assert g.tobytes() == np.asarray(w, np.float32).tobytes()
    if keras.backend.backend() == "torch":
        assert got[0] is fresh[0] and got[2] is fresh[2]  # written in place
        assert got[3] is fresh[3]  # (a factor of 1: left as it is)
        assert got[1] is not fresh[1]  # a tensor autograd records is not


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch.inference_mode (torch only)")
def test_reused_buffers_are_not_made_under_inference_mode():
    # Eager torch keeps a chunk's temporaries in reused buffers; one made
    # under `torch.inference_mode` could not be written outside it. FP8
    # and stochastic rounding first called there run again outside.
    import torch

    from keras_scalify.backend import fp8_rounding
    from keras_scalify.backend import scalar
    from keras_scalify.core.rounding import stochastic_cast

    scalar._SCRATCH.__dict__.pop("pool", None)
    scalar._WEYL.clear()
    w = torch.randn(600, 1000).half()
    x = torch.randn(3000)
    key = torch.tensor(5, dtype=torch.int32)
    with torch.inference_mode():
        inside = (fp8_rounding._round_torch(w, "float8_e4m3fn").clone(), stochastic_cast(x, "float16", key=key).clone())
    outside = (fp8_rounding._round_torch(w, "float8_e4m3fn"), stochastic_cast(x, "float16", key=key))
    for a, b in zip(inside, outside):
        assert torch.equal(a, b)


@pytest.mark.parametrize("factor", [1.0, 0.25, 2.0**40])
def test_unless_one_is_the_multiply_bit_for_bit(run, factor):
    # `x · factor` (the multiply `times` makes) whatever path is taken: on
    # a TensorFlow graph a large `x` chooses at run time; inf and NaN in
    # `x` pass through a factor of 1 as they would through the multiply.
    x = np.random.default_rng(0).standard_normal(S.UNLESS_ONE_MIN_ELEMENTS + 7).astype(np.float32)
    x[:3] = [np.inf, -np.inf, np.nan]
    for n in (5, x.size):  # below and above the size of the run-time choice
        xt = ops.convert_to_tensor(x[:n])

        def f(x, k):
            return S.unless_one(k, x, lambda: ops.multiply(x, k))

        got = np.asarray(ops.convert_to_numpy(run(f, xt, ops.convert_to_tensor(np.float32(factor)))))
        want = x[:n] * np.float32(factor)
        assert got.tobytes() == want.tobytes() or np.array_equal(got, want, equal_nan=True)
        assert np.array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="inspects a TensorFlow graph")
def test_unless_one_chooses_at_run_time_on_tensorflow_graphs_only():
    # A conditional on a traced graph for a large tensor, where the untaken
    # multiply does not run; none for a small tensor, nor under XLA (which
    # fuses the multiply), nor for a Python 1 (no op at all).
    import tensorflow as tf

    big = tf.zeros((S.UNLESS_ONE_MIN_ELEMENTS,))
    small = tf.zeros((8,))

    def f(x, k):
        return S.unless_one(k, x, lambda: x * k)

    def op_types(fn, x, k):
        return {op.type for op in tf.function(fn).get_concrete_function(x, k).graph.get_operations()}

    k = tf.constant(1.0)
    assert {"If", "StatelessIf"} & op_types(f, big, k)
    assert not {"If", "StatelessIf"} & op_types(f, small, k)
    xla = tf.function(f, jit_compile=True).get_concrete_function(big, k).graph
    assert not {"If", "StatelessIf"} & {op.type for op in xla.get_operations()}
    assert S.unless_one(1.0, big, lambda: pytest.fail("multiplied by a Python 1")) is big


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="values are kept on the host on eager torch only")
def test_kept_values_read_nothing_on_the_meta_device():
    """A symbolic call (Keras's meta device, in a stateless scope) reads no
    value: a scale variable's read, `kept` and `host_value` give meta
    tensors without keys there (`item()` would raise)."""
    import torch
    from keras.src.backend.common.stateless_scope import StatelessScope

    from tests.optimizers.helpers import scaled_mlp

    sv = scaled_mlp("scaled_float32").layers[0].kernel
    with StatelessScope(), keras.device("meta"):
        scale = S.detached_variable_value(sv.scale)
        assert scale.is_meta and S.host_value(scale) is None
        assert S.kept(torch.zeros((), device="meta")).is_meta
        assert S.float32_scalar(2.0, torch.zeros((3,))).is_meta
    assert S.host_value(sv.read_scale()) == float(keras.ops.convert_to_numpy(sv.scale))


def test_float32_scalar_converts_numbers_straight_to_float32():
    """A Python number becomes a float32 scalar whatever floatx is (on torch
    a conversion through floatx float16 turned 70000 into inf)."""
    previous = keras.config.floatx()
    keras.config.set_floatx("float16")
    try:
        out = S.float32_scalar(70000.0, None)  # (no tensor to cache on: converted)
    finally:
        keras.config.set_floatx(previous)
    assert standardize_dtype(out.dtype) == "float32"
    assert float(to_np(out)) == 70000.0
