"""Scaled dtype policies: `ScaledDTypePolicy`, the named policies and the
hook that lets Keras accept their names.

Importing this package (or `keras_scalify`) installs the policy hook, so
`keras.mixed_precision.set_dtype_policy("scaled_fp8")` and
`keras.layers.Dense(4, dtype="scaled_fp8")` work; see `hook.py`.
"""

from keras_scalify.policies.hook import install_policy_hook
from keras_scalify.policies.hook import is_policy_hook_installed
from keras_scalify.policies.hook import uninstall_policy_hook
from keras_scalify.policies.named import NAMED_POLICIES
from keras_scalify.policies.named import get_named_policy
from keras_scalify.policies.policy import ScaledDTypePolicy
from keras_scalify.policies.resolve import get
from keras_scalify.policies.resolve import set_dtype_policy

install_policy_hook()
