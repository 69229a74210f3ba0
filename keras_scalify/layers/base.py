"""Shared base of the scaled layers."""

import keras


class ScaledLayer(keras.layers.Layer):
    """A layer that takes and returns ScaledTensors.

    Keras's input autocasting is turned off: it would cast the float32
    scale and grad scale of a ScaledTensor to the compute dtype.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._convert_input_args = False


def spec_like(x):
    """Fresh symbolic tensors with the shapes and dtypes of `x`."""
    return keras.tree.map_structure(
        lambda t: keras.KerasTensor(t.shape, dtype=t.dtype), x
    )
