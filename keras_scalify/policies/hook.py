"""The policy hook: scaled policy names in Keras's own functions.

Keras 3 has no registry of policy names: `keras.config.set_dtype_policy`
and `keras.dtype_policies.get` parse names with hard-coded rules, so
`keras.mixed_precision.set_dtype_policy("scaled_fp8")` and
`keras.layers.Dense(4, dtype="scaled_fp8")` raise. The hook wraps these
functions, wherever Keras binds them, so that names starting with
`"scaled_"` resolve to a `ScaledDTypePolicy` and every other argument goes
to the original function untouched.

Keras binds the functions in several modules (the public API modules
re-export them by value with `from ... import ...`), so each binding is
replaced:

- `keras.config.set_dtype_policy`, `keras.mixed_precision.set_dtype_policy`,
  `keras.mixed_precision.set_global_policy` and their source
  `keras.src.dtype_policies.dtype_policy.set_dtype_policy`;
- `keras.dtype_policies.get` and `keras.src.dtype_policies.get`, which
  layers, losses, metrics and `DTypePolicyMap` look up as a module attribute
  (`dtype_policies.get(dtype)`), so `dtype="scaled_fp8"` works in any layer
  constructor and when Keras reloads a saved model;
- any other binding of the same two functions in a loaded `keras` module.

`keras_scalify` installs the hook when imported. `uninstall_policy_hook()`
puts every original function back; `keras_scalify.set_dtype_policy` and
`keras_scalify.policies.get` work with or without the hook.
"""

import functools
import importlib
import sys

from keras_scalify.policies.resolve import KERAS_GET
from keras_scalify.policies.resolve import KERAS_SET_DTYPE_POLICY
from keras_scalify.policies.resolve import resolve

# The bindings the hook must replace (more are found by identity).
_GET_BINDINGS = (
    ("keras.dtype_policies", "get"),
    ("keras.src.dtype_policies", "get"),
)
_SET_BINDINGS = (
    ("keras.config", "set_dtype_policy"),
    ("keras.mixed_precision", "set_dtype_policy"),
    ("keras.mixed_precision", "set_global_policy"),
    ("keras.src.dtype_policies.dtype_policy", "set_dtype_policy"),
)

# (module, attribute, original, wrapper) for every replaced binding.
_patched = []
_installed = False


def _wrap_get(original):
    @functools.wraps(original)
    def get(identifier):
        return original(resolve(identifier))

    get._keras_scalify_hook = True
    return get


def _wrap_set_dtype_policy(original):
    @functools.wraps(original)
    def set_dtype_policy(policy):
        return original(resolve(policy))

    set_dtype_policy._keras_scalify_hook = True
    return set_dtype_policy


def _keras_modules():
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "keras" or name.startswith("keras.")):
            yield module


def _module_items(module):
    try:
        return list(vars(module).items())
    except TypeError:
        return []


def _bindings():
    """Yields `(module, attribute, make_wrapper)` for every binding to wrap."""
    for bindings, make in (
        (_GET_BINDINGS, _wrap_get),
        (_SET_BINDINGS, _wrap_set_dtype_policy),
    ):
        for module_name, attr in bindings:
            yield importlib.import_module(module_name), attr, make
    for module in _keras_modules():
        for attr, value in _module_items(module):
            if value is KERAS_GET:
                yield module, attr, _wrap_get
            elif value is KERAS_SET_DTYPE_POLICY:
                yield module, attr, _wrap_set_dtype_policy


def install_policy_hook():
    """Makes Keras's policy functions accept scaled policy names.

    After this call, `keras.config.set_dtype_policy`,
    `keras.mixed_precision.set_dtype_policy`,
    `keras.mixed_precision.set_global_policy` and `keras.dtype_policies.get`
    (also as used by layer constructors) map names starting with `"scaled_"`
    to a `ScaledDTypePolicy` and pass everything else to Keras unchanged.
    Called when `keras_scalify` is imported; calling it again does nothing.
    """
    global _installed
    if _installed:
        return
    wrappers = {}  # id(original) -> wrapper, so aliases stay identical.
    seen = set()
    for module, attr, make in _bindings():
        if (id(module), attr) in seen:
            continue
        seen.add((id(module), attr))
        original = getattr(module, attr)
        if getattr(original, "_keras_scalify_hook", False):
            continue
        if id(original) not in wrappers:
            wrappers[id(original)] = make(original)
        wrapper = wrappers[id(original)]
        setattr(module, attr, wrapper)
        _patched.append((module, attr, original, wrapper))
    _installed = True


def uninstall_policy_hook():
    """Puts back the exact functions `install_policy_hook` replaced.

    Afterwards Keras rejects scaled policy names again (use
    `keras_scalify.set_dtype_policy`, or pass `ScaledDTypePolicy` instances).
    Calling it when the hook is not installed does nothing.
    """
    global _installed
    originals = {}
    for module, attr, original, wrapper in reversed(_patched):
        originals[id(wrapper)] = original
        if getattr(module, attr, None) is wrapper:
            setattr(module, attr, original)
    # Modules imported while the hook was installed may have copied a
    # wrapper (`from keras.src.dtype_policies import get`).
    if originals:
        for module in _keras_modules():
            for attr, value in _module_items(module):
                if id(value) in originals and getattr(
                    value, "_keras_scalify_hook", False
                ):
                    setattr(module, attr, originals[id(value)])
    _patched.clear()
    _installed = False


def is_policy_hook_installed():
    """Returns True if the policy hook is installed."""
    return _installed
