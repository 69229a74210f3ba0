"""The named scaled policies (paper Table 3) and name lookup."""

from keras_scalify.policies.policy import FIELDS
from keras_scalify.policies.policy import ScaledDTypePolicy

# name -> (matmul, grad, master, compute, state), in `FIELDS` order.
_NAMED = {
    # Everything in float32: the scaled model computes what plain Keras
    # computes (model invariance tests).
    "scaled_float32": ("float32", "float32", "float32", "float32", "float32"),
    # Table 3 #1: FP16 matmuls and gradients, FP32 master weights.
    "scaled_fp16": ("float16", "float16", "float32", "float16", "float32"),
    "scaled_bf16": ("bfloat16", "bfloat16", "float32", "bfloat16", "float32"),
    # Table 3 #3: FP8 matmuls (E4M3 forward, E5M2 backward), scaled FP16
    # master weights, FP32 optimizer state.
    "scaled_fp8": (
        "float8_e4m3fn",
        "float8_e5m2",
        "float16",
        "float16",
        "float32",
    ),
}

NAMED_POLICIES = tuple(_NAMED)

# Custom policies by name: name -> config of the most recently created
# `ScaledDTypePolicy` with that name (see `get_named_policy`).
_CUSTOM_CONFIGS = {}


def named_policy_fields(name):
    """Returns the dtypes of a named policy as a dict keyed by field.

    Args:
        name: One of `NAMED_POLICIES`.

    Returns:
        A dict `{"matmul_dtype": ..., "grad_dtype": ..., "master_dtype": ...,
        "compute_dtype": ..., "state_dtype": ...}`.
    """
    return dict(zip(FIELDS, _NAMED[name]))


def remember_policy(policy):
    """Records a custom policy so that its name resolves to it.

    Called by `ScaledDTypePolicy.__init__`; a no-op for named policies.

    Args:
        policy: A `ScaledDTypePolicy`.
    """
    if policy.name not in _NAMED:
        _CUSTOM_CONFIGS[policy.name] = policy.get_config()


def get_named_policy(name):
    """Returns a new `ScaledDTypePolicy` for a policy name.

    Named policies:

    | name | matmul | grad | master | compute | state |
    |---|---|---|---|---|---|
    | `"scaled_float32"` | float32 | float32 | float32 | float32 | float32 |
    | `"scaled_fp16"` | float16 | float16 | float32 | float16 | float32 |
    | `"scaled_bf16"` | bfloat16 | bfloat16 | float32 | bfloat16 | float32 |
    | `"scaled_fp8"` | float8_e4m3fn | float8_e5m2 | float16 | float16 |
      float32 |

    The name of a custom policy (a `ScaledDTypePolicy` created with other
    dtypes, e.g. `"scaled_custom"`) resolves to the most recently created
    policy of that name. This is what lets Keras reload built-in layers saved
    under a custom policy: `Operation.from_config` recreates the policy from
    its config, then passes only its name to the layer.

    Args:
        name: A policy name starting with `"scaled_"`.

    Returns:
        A new `ScaledDTypePolicy`.
    """
    if not isinstance(name, str):
        raise TypeError(
            "Invalid `name`: expected a string such as 'scaled_fp8'. "
            f"Received: name={name!r} (of type {type(name).__name__})"
        )
    if name in _NAMED:
        return ScaledDTypePolicy(name, **named_policy_fields(name))
    if name in _CUSTOM_CONFIGS:
        return ScaledDTypePolicy.from_config(dict(_CUSTOM_CONFIGS[name]))
    valid = ", ".join(repr(n) for n in NAMED_POLICIES)
    custom = ""
    if _CUSTOM_CONFIGS:
        custom = " Custom policies created so far: " + ", ".join(
            repr(n) for n in _CUSTOM_CONFIGS
        ) + "."
    raise ValueError(
        f"Unknown scaled dtype policy name: {name!r}. Valid names: "
        f"{valid}.{custom} Other policies can be built with "
        "`keras_scalify.ScaledDTypePolicy(...)`."
    )
