"""Scaled Keras layers: they take and return ScaledTensors."""

from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.boundary import AsScaled
from keras_scalify.layers.boundary import ToArray
from keras_scalify.layers.rescale import DynamicRescaleGrad
