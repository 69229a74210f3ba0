"""Scaled counterparts of `keras.ops`: same names, same arguments.

Each function takes ScaledTensors (plain tensors count as scale 1, Python
scalars are split exactly into mantissa × pow2) and returns a ScaledTensor
whose scale follows the rule in its docstring. With no ScaledTensor input,
the plain `keras.ops` function is called.
"""

from keras_scalify.ops.activations import gelu
from keras_scalify.ops.activations import relu
from keras_scalify.ops.activations import silu
from keras_scalify.ops.arithmetic import abs
from keras_scalify.ops.arithmetic import add
from keras_scalify.ops.arithmetic import divide
from keras_scalify.ops.arithmetic import multiply
from keras_scalify.ops.arithmetic import negative
from keras_scalify.ops.arithmetic import power
from keras_scalify.ops.arithmetic import sqrt
from keras_scalify.ops.arithmetic import square
from keras_scalify.ops.arithmetic import subtract
from keras_scalify.ops.boundary import as_scaled
from keras_scalify.ops.boundary import to_array
from keras_scalify.ops.comparison import equal
from keras_scalify.ops.comparison import greater
from keras_scalify.ops.comparison import greater_equal
from keras_scalify.ops.comparison import less
from keras_scalify.ops.comparison import less_equal
from keras_scalify.ops.comparison import not_equal
from keras_scalify.ops.linalg import conv
from keras_scalify.ops.linalg import dot
from keras_scalify.ops.linalg import einsum
from keras_scalify.ops.linalg import fp8_einsum
from keras_scalify.ops.linalg import fp8_matmul
from keras_scalify.ops.linalg import matmul
from keras_scalify.ops.math import cos
from keras_scalify.ops.math import erf
from keras_scalify.ops.math import exp
from keras_scalify.ops.math import log
from keras_scalify.ops.math import reciprocal
from keras_scalify.ops.math import rsqrt
from keras_scalify.ops.math import sigmoid
from keras_scalify.ops.math import sin
from keras_scalify.ops.math import tanh
from keras_scalify.ops.nn import dot_product_attention
from keras_scalify.ops.nn import layer_normalization
from keras_scalify.ops.nn import log_softmax
from keras_scalify.ops.nn import logsumexp
from keras_scalify.ops.nn import rms_normalization
from keras_scalify.ops.nn import softmax
from keras_scalify.ops.reduction import max
from keras_scalify.ops.reduction import mean
from keras_scalify.ops.reduction import min
from keras_scalify.ops.reduction import sum
from keras_scalify.ops.reduction import var
from keras_scalify.ops.selection import clip
from keras_scalify.ops.selection import concatenate
from keras_scalify.ops.selection import maximum
from keras_scalify.ops.selection import minimum
from keras_scalify.ops.selection import stack
from keras_scalify.ops.selection import where
from keras_scalify.ops.shape import broadcast_to
from keras_scalify.ops.shape import cast
from keras_scalify.ops.shape import expand_dims
from keras_scalify.ops.shape import moveaxis
from keras_scalify.ops.shape import repeat
from keras_scalify.ops.shape import reshape
from keras_scalify.ops.shape import slice
from keras_scalify.ops.shape import split
from keras_scalify.ops.shape import squeeze
from keras_scalify.ops.shape import swapaxes
from keras_scalify.ops.shape import take
from keras_scalify.ops.shape import tile
from keras_scalify.ops.shape import transpose
from keras_scalify.ops.casting import cast_on_backward
from keras_scalify.ops.casting import cast_on_forward
from keras_scalify.ops.rescaling import delayed_rescale_grad
from keras_scalify.ops.rescaling import rebalance
from keras_scalify.ops.rescaling import dynamic_rescale
from keras_scalify.ops.rescaling import dynamic_rescale_l1
from keras_scalify.ops.rescaling import dynamic_rescale_l1_grad
from keras_scalify.ops.rescaling import dynamic_rescale_l2
from keras_scalify.ops.rescaling import dynamic_rescale_l2_grad
from keras_scalify.ops.rescaling import dynamic_rescale_max
from keras_scalify.ops.rescaling import dynamic_rescale_max_grad
from keras_scalify.ops.rescaling import with_grad_scale

# Called on symbolic tensors (`keras.Input`), each function above runs as a
# Keras Operation node (`keras_scalify.ops.symbolic`), as `keras.ops` do.
from keras_scalify.ops.symbolic import symbolic_aware as _symbolic_aware  # noqa: E402

for _name, _fn in list(globals().items()):
    if (
        not _name.startswith("_")
        and callable(_fn)
        and getattr(_fn, "__module__", "").startswith("keras_scalify.ops.")
        and not isinstance(_fn, type)
    ):
        globals()[_name] = _symbolic_aware(_fn)
del _name, _fn
