"""Scaled convolutions: `ScaledConv1D`, `ScaledConv2D`."""

import keras

from keras_scalify import ops as sops
from keras_scalify.core.formats import FP8_DTYPES
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.layers.activation import _as_spec
from keras_scalify.layers.activation import activation_name
from keras_scalify.layers.activation import get_activation
from keras_scalify.layers.activation import keras_activation
from keras_scalify.layers.base import KernelBiasMixin
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.base import cast_to_compute
from keras_scalify.layers.keras_twin import check_keras_layer
from keras_scalify.layers.keras_twin import copy_built_weights
from keras_scalify.layers.keras_twin import keras_base_kwargs
from keras_scalify.layers.keras_twin import reject_options
from keras_scalify.layers.keras_twin import scaled_base_kwargs
from keras_scalify.layers.base import scaled_spec
from keras_scalify.layers.base import to_float32


def _tuple(value, rank, name):
    if isinstance(value, int):
        return (value,) * rank
    value = tuple(value)
    if len(value) != rank or not all(isinstance(v, int) and v > 0 for v in value):
        raise ValueError(f"`{name}` must be a positive int or {rank} of them, got {value!r}.")
    return value


class _ScaledConv(KernelBiasMixin, ScaledLayer):
    """`keras.layers.Conv{rank}D` on ScaledTensors.

    `y = activation(conv(x, kernel) + bias)` with the scale rule of
    `ksc.ops.conv` (as `matmul`, K the kernel's fan-in). Under a scaled
    policy the operands are rounded to its `matmul_dtype` and the output
    gradient to its `grad_dtype` (E4M3 / E5M2 under `scaled_fp8`: values on
    the FP8 grid, computed in the container dtype, the "simulate" route;
    no backend has an FP8 convolution on CPU).

    Args:
        filters, kernel_size, strides, padding, data_format, dilation_rate,
        activation, use_bias, kernel_initializer, bias_initializer: as in
        the Keras layer (`groups` must be 1).
    """

    rank = None
    _keras_class = None

    def __init__(
        self,
        filters,
        kernel_size,
        strides=1,
        padding="valid",
        data_format=None,
        dilation_rate=1,
        groups=1,
        activation=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(filters, int) or filters <= 0:
            raise ValueError(f"`filters` must be a positive int, got {filters!r}.")
        if groups != 1:
            raise ValueError(f"`groups` must be 1 for {type(self).__name__}, got {groups!r}.")
        if padding not in ("valid", "same"):
            raise ValueError(f"`padding` must be 'valid' or 'same', got {padding!r}.")
        self.filters = filters
        self.kernel_size = _tuple(kernel_size, self.rank, "kernel_size")
        self.strides = _tuple(strides, self.rank, "strides")
        self.dilation_rate = _tuple(dilation_rate, self.rank, "dilation_rate")
        self.padding = padding
        if data_format is None:
            data_format = keras.config.image_data_format()
        if data_format not in ("channels_last", "channels_first"):
            raise ValueError(
                f"`data_format` must be 'channels_last' or 'channels_first', "
                f"got {data_format!r}."
            )
        self.data_format = data_format
        self.groups = 1
        self._act = get_activation(activation)
        self.activation = activation_name(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def _channel_axis(self):
        return -1 if self.data_format == "channels_last" else 1

    def build(self, input_shape):
        shape = input_shape.data if is_scaled(input_shape) else input_shape
        if len(shape) != self.rank + 2 or shape[self._channel_axis()] is None:
            raise ValueError(
                f"`inputs` of {self.name} must have rank {self.rank + 2} and a "
                f"known channel dimension, got shape {tuple(shape)}."
            )
        channels = shape[self._channel_axis()]
        self._kernel = self.add_scaled_weight(
            "kernel", self.kernel_size + (channels, self.filters), self.kernel_initializer
        )
        self._bias = (
            self.add_scaled_weight("bias", (self.filters,), self.bias_initializer)
            if self.use_bias
            else None
        )

    def _conv(self, x, w, operand_dtype=None):
        return sops.conv(
            x, w, self.strides, self.padding, self.data_format, self.dilation_rate,
            calibrated=(None, self._kernel.calibrated), operand_dtype=operand_dtype,
        )

    def call(self, inputs):
        x = cast_to_compute(self, inputs)
        if len(x.shape) != self.rank + 2:
            raise ValueError(
                f"`inputs` of {self.name} must have rank {self.rank + 2}, got "
                f"shape {tuple(x.shape)}."
            )
        mm = self.policy_dtype("matmul_dtype")
        gd = self.policy_dtype("grad_dtype")
        if keras.backend.standardize_dtype(mm) in FP8_DTYPES:
            self._fp8_route = "simulate"
            y = self._conv(sops.cast_on_forward(x, mm), sops.cast_on_forward(self._kernel.read(), mm))
        else:  # (the kernel cast inside: its gradient in its master dtype)
            y = self._conv(x, self._kernel.read(), operand_dtype=mm)
        y = sops.cast_on_backward(y, gd)
        dtype = keras.backend.standardize_dtype(self.compute_dtype)
        if self._bias is None and self._act is None:
            return sops.cast(y, dtype)
        y = to_float32(y)
        if self._bias is not None:
            bias = sops.cast(self._bias.read(rebalance=True), "float32")
            if self.data_format == "channels_first":
                bias = sops.reshape(bias, (self.filters,) + (1,) * self.rank)
            y = sops.add(y, bias, calibrated=(None, self._bias.calibrated))
        if self._act is not None:
            y = self._act(y)
        return sops.cast(y, dtype)

    def compute_output_spec(self, inputs):
        x = _as_spec(inputs).data
        kernel = keras.KerasTensor(self.kernel_size + (x.shape[self._channel_axis()], self.filters))
        out = keras.ops.conv(
            keras.KerasTensor(x.shape), kernel, self.strides, self.padding,
            self.data_format, self.dilation_rate,
        )
        return scaled_spec(out.shape, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(_conv_kwargs(self))
        return config

    @classmethod
    def from_keras(cls, layer, **overrides):
        """The scaled layer with the config and represented weights of a
        Keras convolution (name, dtype policy and trainability kept;
        `overrides` replace constructor arguments). Regularizers,
        constraints, LoRA, quantization, `groups` > 1 and activations
        without a scaled rule raise a ValueError naming the argument."""
        check_keras_layer(layer, cls._keras_class, cls)
        reject_options(layer, cls, _UNSUPPORTED_CONV)
        if layer.groups != 1:
            raise ValueError(
                f"`groups` of layer {layer.name!r} is {layer.groups}: "
                f"{cls.__name__} supports groups=1 only."
            )
        kwargs = keras_base_kwargs(layer, {})
        kwargs.update(_conv_kwargs(layer), **overrides)
        return copy_built_weights(layer, cls(**kwargs))

    def to_keras(self, **overrides):
        """The plain Keras convolution with this config and the represented
        float32 weights; a scaled dtype policy becomes "float32"."""
        kwargs = scaled_base_kwargs(self, {})
        kwargs.update(_conv_kwargs(self), **overrides)
        return copy_built_weights(self, self._keras_class(**kwargs))


def _conv_kwargs(layer):
    """The arguments a Keras convolution and its scaled twin share."""
    return dict(
        filters=layer.filters,
        kernel_size=tuple(layer.kernel_size),
        strides=tuple(layer.strides),
        padding=layer.padding,
        data_format=layer.data_format,
        dilation_rate=tuple(layer.dilation_rate),
        groups=layer.groups,
        activation=keras_activation(layer.activation),
        use_bias=layer.use_bias,
        kernel_initializer=keras.initializers.serialize(layer.kernel_initializer),
        bias_initializer=keras.initializers.serialize(layer.bias_initializer),
    )


_UNSUPPORTED_CONV = (
    "kernel_regularizer",
    "bias_regularizer",
    "activity_regularizer",
    "kernel_constraint",
    "bias_constraint",
    "lora_rank",
)


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledConv1D(_ScaledConv):
    __doc__ = _ScaledConv.__doc__.replace("{rank}", "1")
    rank = 1
    _keras_class = keras.layers.Conv1D


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledConv2D(_ScaledConv):
    __doc__ = _ScaledConv.__doc__.replace("{rank}", "2")
    rank = 2
    _keras_class = keras.layers.Conv2D
