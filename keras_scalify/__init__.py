"""keras_scalify: FP8/FP16 training for Keras 3 by scale propagation."""

from keras_scalify import callbacks
from keras_scalify import core
from keras_scalify import debug
from keras_scalify import layers
from keras_scalify import models
from keras_scalify import ops
from keras_scalify import optimizers
from keras_scalify import patches
from keras_scalify import plot
from keras_scalify import policies
from keras_scalify.convert import scalify
from keras_scalify.convert import unscalify
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.layers.variable import ScaledVariable
from keras_scalify.optimizers import ScaledOptimizer
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops import as_scaled
from keras_scalify.ops import to_array
from keras_scalify.ops.dispatch import install_ops_dispatch
from keras_scalify.ops.dispatch import uninstall_ops_dispatch
from keras_scalify.policies import ScaledDTypePolicy
from keras_scalify.policies import install_policy_hook
from keras_scalify.policies import set_dtype_policy
from keras_scalify.policies import uninstall_policy_hook

__version__ = "0.1.0"
