"""The policy hook: scaled names in Keras's own functions, nothing else
changed, and fully reversible."""

import sys
import types

import keras
import pytest
from keras.src import dtype_policies as src_dtype_policies
from keras.src.dtype_policies import dtype_policy as src_dtype_policy

import keras_scalify as ksc
from keras_scalify import policies
from keras_scalify.policies import ScaledDTypePolicy
from keras_scalify.policies import get_named_policy
from keras_scalify.policies.resolve import KERAS_GET
from keras_scalify.policies.resolve import KERAS_SET_DTYPE_POLICY

SETTERS = {
    "keras.config.set_dtype_policy": lambda: keras.config.set_dtype_policy,
    "keras.mixed_precision.set_dtype_policy": (
        lambda: keras.mixed_precision.set_dtype_policy
    ),
    "keras.mixed_precision.set_global_policy": (
        lambda: keras.mixed_precision.set_global_policy
    ),
}

# Every binding the hook replaces, as (module, attribute, original).
BINDINGS = [
    (keras.config, "set_dtype_policy", KERAS_SET_DTYPE_POLICY),
    (keras.mixed_precision, "set_dtype_policy", KERAS_SET_DTYPE_POLICY),
    (keras.mixed_precision, "set_global_policy", KERAS_SET_DTYPE_POLICY),
    (src_dtype_policy, "set_dtype_policy", KERAS_SET_DTYPE_POLICY),
    (keras.dtype_policies, "get", KERAS_GET),
    (src_dtype_policies, "get", KERAS_GET),
]

# Identifiers whose handling must not change.
OTHER_IDENTIFIERS = [
    "float32",
    "float16",
    "bfloat16",
    "mixed_float16",
    "mixed_bfloat16",
    "float8_from_float32",
    "int8_from_mixed_bfloat16",
]


def _same_policy(a, b):
    return type(a) is type(b) and a == b and repr(a) == repr(b)


def test_hook_installed_on_import():
    assert policies.is_policy_hook_installed()
    for module, attr, original in BINDINGS:
        wrapper = getattr(module, attr)
        assert wrapper is not original
        assert wrapper.__wrapped__ is original
        assert wrapper.__name__ == original.__name__
        assert wrapper.__doc__ == original.__doc__


def test_aliases_stay_identical():
    assert keras.mixed_precision.set_global_policy is keras.config.set_dtype_policy
    assert keras.mixed_precision.set_dtype_policy is keras.config.set_dtype_policy
    assert keras.dtype_policies.get is src_dtype_policies.get


@pytest.mark.parametrize("setter", sorted(SETTERS))
@pytest.mark.parametrize("name", ["scaled_fp8", "scaled_fp16"])
def test_setters_accept_scaled_names(setter, name):
    SETTERS[setter]()(name)
    policy = keras.config.dtype_policy()
    assert isinstance(policy, ScaledDTypePolicy)
    assert policy == get_named_policy(name)
    assert keras.mixed_precision.global_policy() is policy


def test_layer_dtype_accepts_scaled_names():
    layer = keras.layers.Dense(4, dtype="scaled_fp8")
    assert layer.dtype_policy == get_named_policy("scaled_fp8")
    assert layer.compute_dtype == "float16"
    assert layer.variable_dtype == "float32"
    layer.dtype_policy = "scaled_bf16"
    assert layer.dtype_policy == get_named_policy("scaled_bf16")


def test_get_accepts_scaled_names():
    for get in (keras.dtype_policies.get, src_dtype_policies.get, ksc.policies.get):
        assert get("scaled_fp8") == get_named_policy("scaled_fp8")


@pytest.mark.parametrize("identifier", OTHER_IDENTIFIERS)
def test_get_delegates_other_names(identifier):
    for get in (keras.dtype_policies.get, src_dtype_policies.get, ksc.policies.get):
        assert _same_policy(get(identifier), KERAS_GET(identifier))


def test_get_delegates_other_arguments():
    get = keras.dtype_policies.get
    instance = keras.dtype_policies.DTypePolicy("mixed_bfloat16")
    assert get(instance) is instance
    assert get(None) is KERAS_GET(None) is keras.config.dtype_policy()
    config = keras.dtype_policies.serialize(instance)
    assert _same_policy(get(config), KERAS_GET(config))
    for bad in ("scald_fp8", "nonsense", 3.5):
        with pytest.raises(Exception) as ours:
            get(bad)
        with pytest.raises(Exception) as theirs:
            KERAS_GET(bad)
        assert type(ours.value) is type(theirs.value)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("setter", sorted(SETTERS))
@pytest.mark.parametrize("identifier", OTHER_IDENTIFIERS[:5])
def test_setters_delegate_other_names(setter, identifier):
    SETTERS[setter]()(identifier)
    ours = keras.config.dtype_policy()
    KERAS_SET_DTYPE_POLICY(identifier)
    assert _same_policy(ours, keras.config.dtype_policy())


@pytest.mark.parametrize("setter", sorted(SETTERS))
def test_setters_delegate_instances_and_errors(setter):
    instance = keras.dtype_policies.DTypePolicy("mixed_float16")
    SETTERS[setter]()(instance)
    assert keras.config.dtype_policy() is instance
    for bad in ("nonsense", {"name": "float32"}, 16):
        with pytest.raises(Exception) as ours:
            SETTERS[setter]()(bad)
        with pytest.raises(Exception) as theirs:
            KERAS_SET_DTYPE_POLICY(bad)
        assert type(ours.value) is type(theirs.value)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("setter", sorted(SETTERS))
def test_unknown_scaled_name_raises(setter):
    with pytest.raises(ValueError, match="'scaled_fp8'"):
        SETTERS[setter]()("scaled_fp7")
    with pytest.raises(ValueError, match="scaled_fp7"):
        keras.layers.Dense(4, dtype="scaled_fp7")


def test_uninstall_restores_originals_and_reinstall_works():
    policies.uninstall_policy_hook()
    assert not policies.is_policy_hook_installed()
    for module, attr, original in BINDINGS:
        assert getattr(module, attr) is original
    with pytest.raises(ValueError, match="Cannot convert 'scaled_fp8'"):
        keras.mixed_precision.set_dtype_policy("scaled_fp8")
    with pytest.raises(ValueError, match="Cannot convert 'scaled_fp8'"):
        keras.layers.Dense(4, dtype="scaled_fp8")
    policies.uninstall_policy_hook()  # A second uninstall does nothing.

    # The plugin's own entry points work without the hook.
    ksc.set_dtype_policy("scaled_fp8")
    assert keras.config.dtype_policy() == get_named_policy("scaled_fp8")
    assert ksc.policies.get("scaled_fp16") == get_named_policy("scaled_fp16")
    layer = keras.layers.Dense(4)
    assert layer.dtype_policy == get_named_policy("scaled_fp8")

    ksc.install_policy_hook()
    assert policies.is_policy_hook_installed()
    keras.mixed_precision.set_dtype_policy("scaled_bf16")
    assert keras.config.dtype_policy() == get_named_policy("scaled_bf16")


def test_install_is_idempotent():
    wrappers = [getattr(module, attr) for module, attr, _ in BINDINGS]
    policies.install_policy_hook()
    policies.install_policy_hook()
    assert [getattr(m, a) for m, a, _ in BINDINGS] == wrappers
    policies.uninstall_policy_hook()
    for module, attr, original in BINDINGS:
        assert getattr(module, attr) is original
    policies.install_policy_hook()


def test_uninstall_restores_copies_made_while_installed():
    # A keras module imported while the hook is installed that does
    # `from keras.src.dtype_policies import get` holds the wrapper.
    module = types.ModuleType("keras._scalify_test_alias")
    module.get = keras.src.dtype_policies.get
    module.set_dtype_policy = keras.config.set_dtype_policy
    sys.modules[module.__name__] = module
    try:
        policies.uninstall_policy_hook()
        assert module.get is KERAS_GET
        assert module.set_dtype_policy is KERAS_SET_DTYPE_POLICY
        # ... and installing again also wraps such bindings.
        policies.install_policy_hook()
        assert module.get is keras.dtype_policies.get
        assert module.get("scaled_fp8") == get_named_policy("scaled_fp8")
    finally:
        del sys.modules[module.__name__]
