"""Bad input raises a clear TypeError/ValueError naming the argument (§9)."""

import re

import keras
import numpy as np
import pytest

import keras_scalify as ksc

kops = ksc.ops


def sc(shape=(2, 2), scale=1.0):
    return ksc.as_scaled(np.ones(shape, np.float32), np.float32(scale))


def int_tensor(shape=(2, 2)):
    return keras.ops.convert_to_tensor(np.ones(shape, np.int32))


def raises(exc, *names):
    """`pytest.raises` whose message must name every argument in `names`."""
    return pytest.raises(exc, match="".join(f"(?=.*`{re.escape(n)}`)" for n in names))


# --------------------------------------------------------------------------
# Non-float data.
# --------------------------------------------------------------------------

INTEGER_DATA = [
    ("add_int_x2", lambda: kops.add(sc(), int_tensor()), "x2"),
    ("add_int_x1", lambda: kops.add(int_tensor(), sc()), "x1"),
    ("subtract_int_x2", lambda: kops.subtract(sc(), int_tensor()), "x2"),
    ("multiply_bool_x2", lambda: kops.multiply(sc(), keras.ops.convert_to_tensor(np.ones((2, 2), bool))), "x2"),
    ("matmul_int_x1", lambda: kops.matmul(int_tensor(), sc()), "x1"),
    ("matmul_int_x2", lambda: kops.matmul(sc(), int_tensor()), "x2"),
    ("exp_int", lambda: kops.exp(int_tensor()), "x"),
    ("einsum_int_operand", lambda: kops.einsum("ij,jk->ik", sc(), int_tensor()), "operands[1]"),
    ("concatenate_int", lambda: kops.concatenate([sc(), int_tensor()]), "xs[1]"),
    ("as_scaled_int", lambda: ksc.as_scaled(np.ones((2,), np.int32)), "x"),
    ("as_scaled_int_tensor", lambda: ksc.as_scaled(int_tensor(), np.float32(2.0)), "x"),
    ("as_scaled_bool", lambda: ksc.as_scaled(True), "x"),
    ("ScaledTensor_int_data", lambda: ksc.ScaledTensor(int_tensor(), np.float32(1.0)), "data"),
    ("add_python_bool", lambda: kops.add(sc(), True), "x2"),
]


@pytest.mark.parametrize("fn, name", [r[1:] for r in INTEGER_DATA], ids=[r[0] for r in INTEGER_DATA])
def test_non_float_data_raises_type_error_naming_the_argument(fn, name):
    with raises(TypeError, name):
        fn()


def test_integer_scale_value_is_accepted_as_float():
    """Guard for the table above: an int *scale* is fine (it is a number)."""
    x = ksc.as_scaled(np.ones((2,), np.float32), 4)
    assert float(keras.ops.convert_to_numpy(x.scale)) == 4.0


# --------------------------------------------------------------------------
# Bad scales.
# --------------------------------------------------------------------------

BAD_SCALES = [
    ("vector_scale", np.ones((2,), np.float32), ValueError, "scalar"),
    ("matrix_scale", np.full((1, 1), 2.0, np.float32), ValueError, "scalar"),
    ("inf_scale", np.float32(np.inf), ValueError, "finite"),
    ("nan_scale", np.float32(np.nan), ValueError, "finite"),
    ("neg_inf_scale", -np.inf, ValueError, "finite"),
    ("negative_scale", np.float32(-2.0), ValueError, "positive"),
    ("non_pow2_scale", np.float32(3.0), ValueError, "power of two"),
    ("int_array_scale", np.ones((2,), np.int32), ValueError, "scalar"),
]


@pytest.mark.parametrize(
    "scale, exc, words", [r[1:] for r in BAD_SCALES], ids=[r[0] for r in BAD_SCALES]
)
def test_bad_scale_raises_naming_scale(scale, exc, words):
    with pytest.raises(exc, match=f"(?=.*`scale`)(?=.*{words})"):
        ksc.as_scaled(np.ones((2,), np.float32), scale)


def test_non_scalar_scale_tensor_raises_value_error():
    s = keras.ops.convert_to_tensor(np.ones((3,), np.float32))
    with raises(ValueError, "scale"):
        ksc.as_scaled(np.ones((3,), np.float32), s)


@pytest.mark.parametrize("gs", [np.float32(np.inf), np.float32(0.0), np.ones((2,), np.float32)])
def test_bad_grad_scale_raises_value_error(gs):
    with raises(ValueError, "grad_scale"):
        ksc.as_scaled(np.ones((2,), np.float32), np.float32(1.0), gs)


# --------------------------------------------------------------------------
# Bad arguments of individual ops.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("y", [2.5, 0.5, np.float32(2.0), True])
def test_power_with_non_integer_exponent_raises_type_error(y):
    with raises(TypeError, "x2"):
        kops.power(sc(), y)


def test_power_with_integer_exponent_is_accepted():
    out = kops.power(sc(scale=2.0), np.int64(2))
    assert float(keras.ops.convert_to_numpy(out.scale)) == 4.0


@pytest.mark.parametrize(
    "subscripts, n",
    [("ij,jk->ik", 1), ("ij,jk->ik", 3), ("ij->ji", 2), ("ij,jk,kl->il", 2)],
)
def test_einsum_with_wrong_operand_count_raises_value_error(subscripts, n):
    operands = [sc() for _ in range(n)]
    with raises(ValueError, "subscripts"):
        kops.einsum(subscripts, *operands)


def test_einsum_with_non_string_subscripts_raises_type_error():
    with raises(TypeError, "subscripts"):
        kops.einsum(["ij", "jk"], sc(), sc())


@pytest.mark.parametrize(
    "multiplier, error", [(0.0, ValueError), (float("inf"), ValueError), ("2", TypeError)]
)
def test_einsum_with_bad_multiplier_raises_naming_it(multiplier, error):
    with raises(error, "multiplier"):
        kops.einsum("ij,jk->ik", sc(), sc(), multiplier=multiplier)


def test_where_with_scaled_condition_raises_type_error():
    cond = ksc.as_scaled(np.ones((2, 2), np.float32))
    with raises(TypeError, "condition"):
        kops.where(cond, sc(), sc())


@pytest.mark.parametrize("dtype", ["int32", "int8", "bool", "uint8"])
def test_cast_scaled_tensor_to_non_float_raises_type_error(dtype):
    with raises(TypeError, "dtype"):
        kops.cast(sc(), dtype)


def test_as_scaled_of_a_scaled_tensor_with_a_new_scale_raises_value_error():
    with raises(ValueError, "x"):
        ksc.as_scaled(sc(), np.float32(2.0))


def test_valid_matmul_raises_nothing():
    """A valid matmul raises nothing (guard for the error tests above)."""
    out = kops.matmul(sc((2, 4)), sc((4, 3)))
    assert tuple(out.shape) == (2, 3)


def test_bad_input_does_not_produce_silent_nan():
    """Zero-scale operands (valid) give zeros, never NaN (§9)."""
    zero = ksc.as_scaled(np.ones((2,), np.float32), np.float32(0.0))
    for out in (kops.add(zero, zero), kops.divide(sc((2,)), 3.0), kops.sqrt(zero)):
        v = np.asarray(keras.ops.convert_to_numpy(ksc.to_array(out)))
        assert not np.any(np.isnan(v))


# --------------------------------------------------------------------------
# Issue 14, items 5-9: each bad input is refused early, naming the argument.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [3.0, -1.0, float("nan")])
def test_scaled_tensor_refuses_a_bad_number_scale(scale):
    with raises(ValueError, "scale"):
        ksc.ScaledTensor(keras.ops.ones((2,)), scale)


@pytest.mark.parametrize("data", [None, "a", [1.0, 2.0]])
def test_scaled_tensor_refuses_non_tensor_data(data):
    with raises(TypeError, "data"):
        ksc.ScaledTensor(data, 1.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda x: ksc.as_scaled(x, scale="2"),
        lambda x: ksc.as_scaled(x, scale=np.array("2")),
        lambda x: ksc.ScaledTensor(x, None),
        lambda x: ksc.ScaledTensor(x, object()),
    ],
    ids=["str", "str_array", "none", "object"],
)
def test_a_non_numeric_or_missing_scale_is_named(make):
    with raises(TypeError, "scale"):
        make(keras.ops.ones((2,)))


def test_scaled_tensor_keeps_pytree_placeholders():
    # What tree utilities build when they map over the fields.
    assert ksc.ScaledTensor(None, None, None).data is None
    assert ksc.ScaledTensor((2, 3), (), ()).data == (2, 3)


@pytest.mark.parametrize("x", [None, "a"])
def test_as_scaled_and_ops_name_the_bad_argument(x):
    with raises(TypeError, "x"):
        ksc.as_scaled(x)
    with raises(TypeError, "x2"):
        kops.add(sc(), x)
    with raises(TypeError, "x"):
        kops.exp(x)


def test_as_scaled_refuses_a_scale_float32_cannot_hold():
    with raises(ValueError, "scale"):
        ksc.as_scaled(np.ones(2, np.float32), 2.0**-160)
    with raises(ValueError, "grad_scale"):
        ksc.as_scaled(np.ones(2, np.float32), 1.0, 2.0**200)


def test_as_scaled_of_non_finite_and_subnormal_python_floats():
    nan = ksc.as_scaled(float("nan"))  # NaN stays in the data: it propagates
    assert np.isnan(float(keras.ops.convert_to_numpy(nan.data)))
    assert float(keras.ops.convert_to_numpy(nan.scale)) == 1.0
    subnormal = float(np.float32(1e-42))  # a float32 subnormal
    tiny = ksc.as_scaled(subnormal)  # represented exactly, normal scale
    data = float(keras.ops.convert_to_numpy(tiny.data))
    scale = float(keras.ops.convert_to_numpy(tiny.scale))
    assert scale == 2.0**-126 and data * scale == subnormal


def test_policy_and_optimizer_arguments_are_checked():
    with raises(ValueError, "name"):
        ksc.ScaledDTypePolicy("scaled_fp9")
    assert ksc.ScaledDTypePolicy("scaled_fp8").matmul_dtype == "float8_e4m3fn"
    inner = keras.optimizers.Adam
    with raises(TypeError, "stochastic_rounding"):
        ksc.ScaledOptimizer(inner(), stochastic_rounding="no")
    with raises(TypeError, "seed"):
        ksc.ScaledOptimizer(inner(), seed="abc")
    with raises(ValueError, "state_dtype"):
        ksc.ScaledOptimizer(inner(), state_dtype="nonsense")


def test_layers_check_and_convert_numpy_inputs():
    with pytest.raises(ValueError, match="min_ndim=2"):
        ksc.layers.ScaledDense(4)(np.float32(1.0))
    mha = ksc.layers.ScaledMultiHeadAttention(num_heads=2, key_dim=4)
    q = np.ones((1, 3, 8), np.float32)
    out = mha(q, np.ones((1, 5, 8), np.float32))
    assert tuple(ksc.to_array(out).shape) == (1, 3, 8)


def test_binary_ops_promote_mixed_data_dtypes():
    """float16 and float32 ScaledTensors combine as Keras promotes them (on
    TensorFlow too, which refuses mixed dtypes itself)."""
    a = ksc.as_scaled(keras.ops.cast(np.full((2,), 1.5, np.float32), "float16"), 2.0)
    b = ksc.as_scaled(np.full((2,), 3.0, np.float32), 4.0)
    for op, expected in ((kops.add, 15.0), (kops.subtract, -9.0), (kops.multiply, 36.0)):
        out = op(a, b)
        assert out.dtype == "float32"
        np.testing.assert_allclose(keras.ops.convert_to_numpy(ksc.to_array(out)), expected)


def test_calibrated_needs_one_entry_per_operand():
    a = ksc.as_scaled(np.ones((2, 3), "float32"))
    b = ksc.as_scaled(np.ones((3, 4), "float32"))
    with pytest.raises(ValueError, match="`calibrated`"):
        ksc.ops.matmul(a, b, calibrated=(True,))
    with pytest.raises(ValueError, match="`calibrated`"):
        ksc.ops.add(a, a, calibrated=(True, True, True))


@pytest.mark.parametrize(
    "gs, exc", [(3.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), ("a", TypeError), (None, TypeError)]
)
def test_with_grad_scale_refuses_a_bad_grad_scale(gs, exc):
    with raises(exc, "grad_scale"):
        kops.with_grad_scale(sc(), gs)
