"""`ScaledDTypePolicy` and the named policies."""

import keras
import ml_dtypes
import numpy as np
import pytest

import keras_scalify as ksc
from keras_scalify.policies import NAMED_POLICIES
from keras_scalify.policies import ScaledDTypePolicy
from keras_scalify.policies import get_named_policy

FP8 = ("float8_e4m3fn", "float8_e5m2")

# name: (matmul, grad, master, compute, state) -- DESIGN.md section 8.
TABLE = {
    "scaled_float32": ("float32", "float32", "float32", "float32", "float32"),
    "scaled_fp16": ("float16", "float16", "float32", "float16", "float32"),
    "scaled_bf16": ("bfloat16", "bfloat16", "float32", "bfloat16", "float32"),
    "scaled_fp8": ("float8_e4m3fn", "float8_e5m2", "float16", "float16", "float32"),
}


def test_named_policies_tuple():
    assert isinstance(NAMED_POLICIES, tuple)
    assert set(NAMED_POLICIES) == set(TABLE)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_named_policy_fields(name):
    policy = get_named_policy(name)
    matmul, grad, master, compute, state = TABLE[name]
    assert isinstance(policy, ScaledDTypePolicy)
    assert isinstance(policy, keras.dtype_policies.DTypePolicy)
    assert policy.name == name
    assert policy.matmul_dtype == matmul
    assert policy.grad_dtype == grad
    assert policy.master_dtype == master
    assert policy.compute_dtype == compute
    assert policy.state_dtype == state
    assert policy.variable_dtype == "float32"
    assert policy.quantization_mode is None


def test_get_named_policy_returns_fresh_instances():
    a, b = get_named_policy("scaled_fp8"), get_named_policy("scaled_fp8")
    assert a is not b
    assert a == b and hash(a) == hash(b)


def test_name_is_never_mixed_float16():
    for name in NAMED_POLICIES:
        assert get_named_policy(name).name != "mixed_float16"


def test_unknown_scaled_name_lists_valid_names():
    with pytest.raises(ValueError, match="scaled_fp7") as info:
        get_named_policy("scaled_fp7")
    for name in NAMED_POLICIES:
        assert repr(name) in str(info.value)


def test_get_named_policy_rejects_non_string():
    with pytest.raises(TypeError, match="`name`"):
        get_named_policy(8)


def test_properties_are_read_only():
    policy = get_named_policy("scaled_fp8")
    for attr in (
        "name",
        "matmul_dtype",
        "grad_dtype",
        "master_dtype",
        "state_dtype",
        "compute_dtype",
        "variable_dtype",
    ):
        with pytest.raises(AttributeError):
            setattr(policy, attr, "float32")


def test_default_name():
    assert ScaledDTypePolicy().name == "scaled_float32"
    fp8 = ScaledDTypePolicy(
        matmul_dtype="float8_e4m3fn",
        grad_dtype="float8_e5m2",
        master_dtype="float16",
        compute_dtype="float16",
    )
    assert fp8.name == "scaled_fp8"
    assert fp8 == get_named_policy("scaled_fp8")
    custom = ScaledDTypePolicy(matmul_dtype="float8_e4m3fn")
    assert custom.name == "scaled_custom"


def test_repr():
    assert repr(get_named_policy("scaled_fp8")) == (
        '<ScaledDTypePolicy "scaled_fp8" matmul=float8_e4m3fn '
        "grad=float8_e5m2 master=float16 compute=float16 state=float32>"
    )


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_master_dtype_raises(dtype):
    with pytest.raises(ValueError, match="`master_dtype`"):
        ScaledDTypePolicy(master_dtype=dtype)


@pytest.mark.parametrize("arg", ["state_dtype", "compute_dtype"])
def test_fp8_storage_and_compute_raise(arg):
    with pytest.raises(ValueError, match=f"`{arg}`"):
        ScaledDTypePolicy(**{arg: "float8_e4m3fn"})


@pytest.mark.parametrize(
    "arg",
    ["compute_dtype", "matmul_dtype", "grad_dtype", "master_dtype", "state_dtype"],
)
@pytest.mark.parametrize("bad", ["int8", "float64", "not_a_dtype", None])
def test_invalid_dtype_names_argument(arg, bad):
    with pytest.raises(ValueError, match=f"`{arg}`"):
        ScaledDTypePolicy(**{arg: bad})


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_allowed_for_matmul_and_grad(dtype):
    policy = ScaledDTypePolicy(matmul_dtype=dtype, grad_dtype=dtype)
    assert policy.matmul_dtype == dtype and policy.grad_dtype == dtype


def test_numpy_dtypes_are_standardized():
    policy = ScaledDTypePolicy(
        compute_dtype=np.float16,
        matmul_dtype=ml_dtypes.float8_e4m3fn,
        grad_dtype=np.dtype(ml_dtypes.float8_e5m2),
        master_dtype="float16",
    )
    assert policy.compute_dtype == "float16"
    assert policy.matmul_dtype == "float8_e4m3fn"
    assert policy.grad_dtype == "float8_e5m2"
    assert policy.name == "scaled_fp8"


def test_name_validation():
    with pytest.raises(TypeError, match="`name`"):
        ScaledDTypePolicy(16)
    with pytest.raises(ValueError, match="`name`.*scaled_"):
        ScaledDTypePolicy("my_fp8")
    with pytest.raises(ValueError, match="`name`.*matmul_dtype=float16"):
        ScaledDTypePolicy("scaled_fp8", matmul_dtype="float16")


def test_get_config_and_from_config():
    policy = get_named_policy("scaled_fp8")
    config = policy.get_config()
    assert config == {
        "name": "scaled_fp8",
        "matmul_dtype": "float8_e4m3fn",
        "grad_dtype": "float8_e5m2",
        "master_dtype": "float16",
        "compute_dtype": "float16",
        "state_dtype": "float32",
    }
    restored = ScaledDTypePolicy.from_config(config)
    assert restored == policy and restored is not policy


def test_eq_and_hash():
    fp8, fp16 = get_named_policy("scaled_fp8"), get_named_policy("scaled_fp16")
    assert fp8 != fp16
    assert fp16 != keras.dtype_policies.DTypePolicy("mixed_float16")
    assert keras.dtype_policies.DTypePolicy("mixed_float16") != fp16
    assert fp16 != "scaled_fp16"
    assert len({fp8, get_named_policy("scaled_fp8"), fp16}) == 2


def test_serialize_deserialize_round_trip():
    policy = ScaledDTypePolicy(
        "scaled_mine", matmul_dtype="bfloat16", compute_dtype="bfloat16"
    )
    config = keras.dtype_policies.serialize(policy)
    assert config["registered_name"] == "keras_scalify>ScaledDTypePolicy"
    restored = keras.dtype_policies.deserialize(config)
    assert type(restored) is ScaledDTypePolicy
    assert restored == policy
    assert keras.dtype_policies.get(config) == policy
    assert keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(policy)
    ) == policy


def test_custom_policy_name_resolves():
    policy = ScaledDTypePolicy(
        "scaled_mine", matmul_dtype="float8_e4m3fn", grad_dtype="float8_e5m2"
    )
    assert get_named_policy("scaled_mine") == policy
    assert ksc.policies.get("scaled_mine") == policy
    assert keras.dtype_policies.get("scaled_mine") == policy


def test_dtype_policy_map_sets_name_to_none():
    # `DTypePolicyMap.get_config` with no default policy sets `_name = None`
    # on the policies it holds.
    policy = get_named_policy("scaled_fp8")
    policy_map = keras.dtype_policies.DTypePolicyMap(
        policy_map={"dense": policy}
    )
    config = keras.dtype_policies.serialize(policy_map)
    assert policy._name is None
    assert policy.name == "scaled_fp8"
    assert "scaled_fp8" in repr(policy)
    assert policy == get_named_policy("scaled_fp8")
    restored = keras.dtype_policies.deserialize(config)
    assert restored["dense"] == get_named_policy("scaled_fp8")

    custom = ScaledDTypePolicy(matmul_dtype="float16")
    custom._name = None
    assert custom.name == "scaled_custom"
    assert ScaledDTypePolicy.from_config({**custom.get_config(), "name": None})
