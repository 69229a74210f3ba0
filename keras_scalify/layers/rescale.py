"""Delayed gradient rescaling as a layer (paper Alg. 5)."""

import keras

from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.weights import add_grad_scale_state
from keras_scalify.layers.variable import read_tensor
from keras_scalify.layers.activation import _as_spec
from keras_scalify.layers.base import spec_like
from keras_scalify.ops.rescaling import STATISTICS
from keras_scalify.ops.rescaling import delayed_rescale_grad


@keras.saving.register_keras_serializable(package="keras_scalify")
class DynamicRescaleGrad(ScaledLayer):
    """Identity forward; re-anchors the gradient scale of its output.

    The grad scale of the output is the statistic (`"l2"`: RMS, `"l1"`:
    mean |g|, `"max"`) of the true gradient measured at the previous step,
    rounded down to a power of two. The statistic is stored in the
    `grad_scale_state` weight (float32 scalar, 0 until the first backward
    pass), which leaves the backward pass through Keras's
    `overwrite_with_gradient` route, so it persists under `model.fit` on
    JAX (stateless), TensorFlow and torch. One statistic per step.
    """

    def __init__(self, statistic="l2", **kwargs):
        super().__init__(**kwargs)
        if statistic not in STATISTICS:
            raise ValueError(
                f"`statistic` must be one of {STATISTICS}, got {statistic!r}."
            )
        self.statistic = statistic

    def build(self, input_shape=None):
        self.grad_scale_state = add_grad_scale_state(self)

    def call(self, inputs):
        state = read_tensor(self.grad_scale_state)
        return delayed_rescale_grad(inputs, state, self.statistic)

    def compute_output_spec(self, inputs):
        # (A plain input leaves as a ScaledTensor, as in an eager call.)
        return spec_like(_as_spec(inputs))

    def get_config(self):
        config = super().get_config()
        config.update({"statistic": self.statistic})
        return config
