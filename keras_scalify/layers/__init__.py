"""Scaled Keras layers: they take and return ScaledTensors."""

from keras_scalify.layers.activation import ScaledActivation
from keras_scalify.layers.attention import ScaledMultiHeadAttention
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.boundary import AsScaled
from keras_scalify.layers.boundary import ToArray
from keras_scalify.layers.conv import ScaledConv1D
from keras_scalify.layers.conv import ScaledConv2D
from keras_scalify.layers.dense import ScaledDense
from keras_scalify.layers.einsum_dense import ScaledEinsumDense
from keras_scalify.layers.embedding import ScaledEmbedding
from keras_scalify.layers.embedding import ScaledReversibleEmbedding
from keras_scalify.layers.merging import ScaledAdd
from keras_scalify.layers.merging import ScaledDropout
from keras_scalify.layers.normalization import ScaledLayerNormalization
from keras_scalify.layers.normalization import ScaledRMSNormalization
from keras_scalify.layers.rescale import DynamicRescaleGrad
from keras_scalify.layers.variable import ScaledVariable
