"""keras_scalify: FP8/FP16 training for Keras 3 by scale propagation."""

from keras_scalify import core
from keras_scalify import debug
from keras_scalify import layers
from keras_scalify import ops
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops.boundary import as_scaled
from keras_scalify.ops.boundary import to_array

__version__ = "0.1.0"
