"""Every place keras_scalify changes Keras, why, and how to undo it.

Keras offers no public extension point for these five. Each is a wrapper
that leaves Keras's behaviour unchanged for plain values and layers,
installs itself at most once, and has its own undo; `uninstall()` runs them
all. Only the first is installed by `import keras_scalify`:

| wrapper | of | why | installed |
|---|---|---|---|
| policy names | `keras.config.set_dtype_policy`, `keras.dtype_policies.get` (every binding) | Keras has no registry of dtype-policy names: `set_dtype_policy("scaled_fp8")` and `Dense(dtype="scaled_fp8")` would raise | on import |
| `keras.ops` dispatch | the public `keras.ops` functions and `keras.src.ops` | Keras has no dispatch protocol for a custom tensor type: Keras code (keras-hub blocks, custom layers) on a ScaledTensor would pack its three fields into one array | by the first ScaledTensor, and by a scaled region about to run |
| plain model outputs | `Functional.__init__` | a model ending in a scaled layer must return arrays to Keras's losses, metrics and `predict` | by the first ScaledTensor |
| plain-layer guard | `Layer._assert_input_compatibility` | a Keras layer called on a ScaledTensor raises a clear error instead of computing on a named tuple | by the first ScaledTensor |
| optimizer guard | `BaseOptimizer.build` | a plain optimizer built on scaled weights raises a clear error instead of training their data | by the first ScaledVariable |

`installed()` names those in place now.
"""

import keras
from keras.src.optimizers.base_optimizer import BaseOptimizer

from keras_scalify.layers import boundary
from keras_scalify.ops import dispatch
from keras_scalify.optimizers import guard
from keras_scalify.policies import hook


def installed():
    """The names of the wrappers in place now (see the module docstring)."""
    from keras.src.models.functional import Functional

    checks = {
        "policy names": hook.is_policy_hook_installed(),
        "keras.ops dispatch": getattr(keras.ops.add, "_keras_scalify_dispatch", False),
        "plain model outputs": getattr(Functional.__init__, "_keras_scalify_outputs", False),
        "plain-layer guard": getattr(
            keras.layers.Layer._assert_input_compatibility, "_keras_scalify_guard", False
        ),
        "optimizer guard": BaseOptimizer.build is guard._guarded_build,
    }
    return [name for name, on in checks.items() if on]


def uninstall():
    """Put back every Keras function keras_scalify wrapped. Scaled models
    need the `keras.ops` dispatch: a scaled region that runs afterwards
    installs it again (`ops.dispatch.dispatching`)."""
    hook.uninstall_policy_hook()
    dispatch.uninstall_ops_dispatch()
    boundary.uninstall_plain_outputs()
    boundary.uninstall_plain_layer_guard()
    guard.uninstall()
