"""`get` and `set_dtype_policy` that understand scaled policy names.

They work whether or not the policy hook (`hook.py`) is installed: they call
Keras's own functions, kept here as `KERAS_GET` and `KERAS_SET_DTYPE_POLICY`.
"""

from keras.src import dtype_policies as _keras_dtype_policies
from keras.src.dtype_policies import dtype_policy as _keras_dtype_policy

from keras_scalify.policies.named import get_named_policy
from keras_scalify.policies.policy import NAME_PREFIX


def unwrap_hook(fn):
    """Returns the function a policy-hook wrapper delegates to, else `fn`."""
    while getattr(fn, "_keras_scalify_hook", False):
        fn = fn.__wrapped__
    return fn


# Keras's own functions (`keras.dtype_policies.get` and
# `keras.config.set_dtype_policy`), whatever the hook's state.
KERAS_GET = unwrap_hook(_keras_dtype_policies.get)
KERAS_SET_DTYPE_POLICY = unwrap_hook(_keras_dtype_policy.set_dtype_policy)


def resolve(identifier):
    """Maps a scaled policy name to a new policy; anything else is returned.

    Args:
        identifier: Any argument of `keras.dtype_policies.get` or
            `keras.config.set_dtype_policy`.

    Returns:
        A `ScaledDTypePolicy` if `identifier` is a string starting with
        `"scaled_"`, otherwise `identifier` itself.
    """
    if isinstance(identifier, str) and identifier.startswith(NAME_PREFIX):
        return get_named_policy(identifier)
    return identifier


def get(identifier):
    """Retrieves a Keras `DTypePolicy` instance, scaled names included.

    Same as `keras.dtype_policies.get`, and also maps names starting with
    `"scaled_"` (e.g. `"scaled_fp8"`) to a `ScaledDTypePolicy`.

    Args:
        identifier: A dtype policy identifier: `None`, a policy name, a
            `DTypePolicy` configuration dict or a `DTypePolicy` instance.

    Returns:
        A Keras `DTypePolicy` instance.
    """
    return KERAS_GET(resolve(identifier))


def set_dtype_policy(policy):
    """Sets the default dtype policy globally, scaled names included.

    Same as `keras.config.set_dtype_policy`, and also accepts names starting
    with `"scaled_"`. Works whether or not the policy hook is installed.

    >>> keras_scalify.set_dtype_policy("scaled_fp8")

    Args:
        policy: A dtype policy name (e.g. `"scaled_fp8"`, `"mixed_float16"`)
            or a `DTypePolicy` instance.
    """
    KERAS_SET_DTYPE_POLICY(resolve(policy))
