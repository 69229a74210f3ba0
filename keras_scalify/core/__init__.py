"""Core: `ScaledTensor`, power-of-two helpers, formats and saturating casts."""

from keras_scalify.core.formats import FORMATS
from keras_scalify.core.formats import FloatFormat
from keras_scalify.core.formats import get_format
from keras_scalify.core.formats import saturating_cast
from keras_scalify.core.formats import saturating_round
from keras_scalify.core.pow2 import pow2_decompose
from keras_scalify.core.pow2 import pow2_exponent
from keras_scalify.core.pow2 import pow2_from_exponent
from keras_scalify.core.pow2 import pow2_round_down
from keras_scalify.core.pow2 import pow2_round_up
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
