"""Boundary layers between plain tensors and ScaledTensors."""

import keras
import numpy as np
from keras import ops

from keras_scalify.core import pow2
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.ops.boundary import as_scaled
from keras_scalify.ops.boundary import to_array


@keras.saving.register_keras_serializable(package="keras_scalify")
class AsScaled(ScaledLayer):
    """Plain tensor → ScaledTensor representing the same values.

    Args:
        scale: a power of two; the data is `inputs / scale` (exact), cast
            to the layer's compute dtype. Default 1.
        grad_scale: the pow2 gradient scale of the output (default 1).
    """

    def __init__(self, scale=1.0, grad_scale=1.0, **kwargs):
        super().__init__(**kwargs)
        for name, v in (("scale", scale), ("grad_scale", grad_scale)):
            v = float(v)
            if not (np.isfinite(v) and v > 0 and pow2.np_pow2_round_down(v) == v):
                raise ValueError(
                    f"`{name}` must be a positive finite power of two, got {v}."
                )
        self.scale = float(scale)
        self.grad_scale = float(grad_scale)

    def call(self, inputs):
        if is_scaled(inputs):
            return inputs
        x = ops.convert_to_tensor(inputs)
        x = ops.cast(x, "float32") * np.float32(1.0 / self.scale)
        x = ops.cast(x, self.compute_dtype)
        return as_scaled(x, np.float32(self.scale), np.float32(self.grad_scale))

    def compute_output_spec(self, inputs):
        from keras_scalify.core.scaled_tensor import ScaledTensor

        shape = inputs.data.shape if is_scaled(inputs) else inputs.shape
        return ScaledTensor(
            keras.KerasTensor(shape, dtype=self.compute_dtype),
            keras.KerasTensor((), dtype="float32"),
            keras.KerasTensor((), dtype="float32"),
        )

    def get_config(self):
        config = super().get_config()
        config.update({"scale": self.scale, "grad_scale": self.grad_scale})
        return config


@keras.saving.register_keras_serializable(package="keras_scalify")
class ToArray(ScaledLayer):
    """ScaledTensor → plain tensor `data * scale` (multiplied in float32).

    Args:
        dtype_out: output dtype (default float32).
    """

    def __init__(self, dtype_out="float32", **kwargs):
        super().__init__(**kwargs)
        self.dtype_out = dtype_out

    def call(self, inputs):
        return to_array(inputs, self.dtype_out)

    def compute_output_spec(self, inputs):
        shape = inputs.data.shape if is_scaled(inputs) else inputs.shape
        return keras.KerasTensor(shape, dtype=self.dtype_out)

    def get_config(self):
        config = super().get_config()
        config.update({"dtype_out": self.dtype_out})
        return config
