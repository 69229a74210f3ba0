"""Optimizers for scaled weights."""

from keras_scalify.optimizers import guard
from keras_scalify.optimizers.scaled_optimizer import ScaledOptimizer
