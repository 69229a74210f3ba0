"""ScaledEinsumDense: `keras.layers.EinsumDense` on ScaledTensors."""

import functools

import keras
from keras.src.layers.core.einsum_dense import _analyze_einsum_string

from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.layers.activation import activation_name
from keras_scalify.layers.activation import get_activation
from keras_scalify.layers.base import KernelBiasMixin
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.base import scaled_spec
from keras_scalify.layers.weights import weight_values
from keras_scalify.layers.dense import matmul_bias_and_activation
from keras_scalify.layers.base import cast_to_compute
from keras_scalify.policies import ScaledDTypePolicy

# Keras EinsumDense arguments that scaled layers accept only at their
# default (so that Keras configs load), with the reason.
_UNSUPPORTED = {
    "kernel_regularizer": None,
    "bias_regularizer": None,
    "kernel_constraint": None,
    "bias_constraint": None,
    "activity_regularizer": None,
    "quantization_config": None,
    "lora_rank": None,
    "lora_alpha": None,
    "gptq_unpacked_column_size": None,
}


def check_unsupported(layer_name, kwargs):
    """Pop Keras-only arguments from `kwargs`; raise unless at default."""
    for key in list(kwargs):
        if key in _UNSUPPORTED:
            value = kwargs.pop(key)
            if value is not None:
                raise ValueError(
                    f"`{key}` is not supported by {layer_name} (got "
                    f"{value!r}); it must be None."
                )


def plain_shape(shape):
    """A build/call shape as a tuple: ScaledTensors give their data's, and
    tensors (symbolic ones included) their own."""
    if is_scaled(shape):
        shape = shape.data
    if shape is None:
        return None
    if hasattr(shape, "shape"):
        shape = shape.shape
    return tuple(None if d is None else int(d) for d in shape)


def plain_policy(layer):
    """The dtype for a plain Keras copy of `layer`: its policy when it is a
    plain Keras policy, else float32 (the represented weights' dtype)."""
    policy = layer.dtype_policy
    if isinstance(policy, ScaledDTypePolicy):
        return "float32"
    return policy


def explicit_equation(equation, ndim):
    """`equation` with its ellipsis spelled out for inputs of rank `ndim`
    (unused lowercase letters), e.g. `ab...,bc->ac...` at rank 3 gives
    `abz,bc->acz`: Keras's symbolic einsum cannot infer the shape of a
    trailing ellipsis."""
    if "..." not in equation:
        return equation
    lhs, out = equation.split("->")
    inp, kernel = lhs.split(",")
    n = ndim - (len(inp) - 3)
    free = [c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in equation]
    if n < 0 or n > len(free):
        raise ValueError(
            f"`equation` {equation!r} does not fit inputs of rank {ndim}."
        )
    dims = "".join(free[:n][::-1])
    return f"{inp.replace('...', dims)},{kernel}->{out.replace('...', dims)}"


@functools.lru_cache(maxsize=1024)
def _analyzed(equation, bias_axes, shape, partial_output_shape):
    """Keras's analysis of an EinsumDense equation for an input shape
    (memoized: each call of the layer checks its input with it)."""
    return _analyze_einsum_string(equation, bias_axes, shape, partial_output_shape)


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledEinsumDense(KernelBiasMixin, ScaledLayer):
    """`keras.layers.EinsumDense` on ScaledTensors.

    `y = activation(einsum(equation, x, kernel) + bias)` with the scale
    rules of `ksc.ops` (the einsum rule: `s = s_x·s_w·P(sqrt(K))`, K the
    contracted size). The kernel and bias are `ScaledVariable`s named
    "kernel" and "bias", with Keras's shapes and initializers (a
    VarianceScaling kernel initializer gets the einsum's input/output axes,
    as in Keras). Under a scaled policy the einsum inputs are cast to the
    policy's `matmul_dtype` and the output gradient to its `grad_dtype`.

    Each weight's gradient scale is its `ScaledVariable.grad_scale` (0 until
    the optimizer calibrates it from the weight-gradient statistic).

    Args:
        equation, output_shape, activation, bias_axes, kernel_initializer,
            bias_initializer: as in `keras.layers.EinsumDense`.
        Regularizers, constraints, LoRA and quantization arguments of Keras
        are accepted only as None (Keras configs load unchanged).

    `from_keras(layer)` converts a built Keras EinsumDense (same config,
    same represented weights); `to_keras()` goes back.
    """

    def __init__(
        self,
        equation,
        output_shape,
        activation=None,
        bias_axes=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        check_unsupported(type(self).__name__, kwargs)
        super().__init__(**kwargs)
        if not isinstance(equation, str):
            raise ValueError(f"`equation` must be a string, got {equation!r}.")
        self.equation = equation
        if isinstance(output_shape, int):
            self.partial_output_shape = (output_shape,)
        else:
            try:
                self.partial_output_shape = tuple(output_shape)
            except TypeError:
                raise ValueError(
                    f"`output_shape` must be an int or a tuple, got "
                    f"{output_shape!r}."
                ) from None
        if bias_axes is not None and not isinstance(bias_axes, str):
            raise ValueError(
                f"`bias_axes` must be None or a string, got {bias_axes!r}."
            )
        self.bias_axes = bias_axes
        self.activation = activation_name(activation)
        self._act = get_activation(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self._kernel = None
        self._bias = None

    # --- build --------------------------------------------------------------
    def _analyze(self, shape):
        return _analyzed(
            self.equation, self.bias_axes, tuple(shape), self.partial_output_shape
        )

    def _kernel_init(self, input_axes, output_axes):
        init = self.kernel_initializer
        if isinstance(init, keras.initializers.VarianceScaling) and (
            init.input_axes is None or init.output_axes is None
        ):
            config = init.get_config()
            config["seed"] = init.seed
            config["input_axes"] = input_axes
            config["output_axes"] = output_axes
            init = init.__class__.from_config(config)
        return init

    def build(self, input_shape):
        shape = plain_shape(input_shape)
        kernel_shape, bias_shape, _, in_axes, out_axes = self._analyze(shape)
        if any(d is None for d in kernel_shape):
            raise ValueError(
                f"`inputs` of {self.name} need known sizes on the kernel's "
                f"axes of {self.equation!r}, got shape {shape}."
            )
        self._input_ndim = len(shape)
        self._call_equation = explicit_equation(self.equation, len(shape))
        self._kernel = self.add_scaled_weight(
            "kernel", tuple(kernel_shape), self._kernel_init(in_axes, out_axes)
        )
        self._bias = (
            self.add_scaled_weight("bias", tuple(bias_shape), self.bias_initializer)
            if bias_shape is not None
            else None
        )
        self.input_spec = None

    def get_build_config(self):
        config = super().get_build_config()
        if config is not None and "input_shape" in config:
            config = {"input_shape": plain_shape(config["input_shape"])}
        return config

    # --- weights --------------------------------------------------------------

    # --- call -----------------------------------------------------------------
    def _check_input(self, shape):
        if len(shape) != self._input_ndim:
            raise ValueError(
                f"`inputs` of {self.name} must have rank {self._input_ndim} "
                f"(equation {self.equation!r}), got shape {shape}."
            )
        kernel_shape = self._analyze(shape)[0]
        for got, want in zip(kernel_shape, self._kernel.shape):
            if got is not None and got != want:
                raise ValueError(
                    f"`inputs` of {self.name} of shape {shape} do not match "
                    f"the kernel of shape {self._kernel.shape} (equation "
                    f"{self.equation!r})."
                )

    def call(self, inputs, training=None):
        x = cast_to_compute(self, inputs)
        self._check_input(tuple(x.shape))
        return matmul_bias_and_activation(
            self, self._call_equation, x, self._kernel.read(), calibrated=self._kernel.calibrated
        )

    def compute_output_shape(self, input_shape):
        return tuple(self._analyze(plain_shape(input_shape))[2])

    def compute_output_spec(self, inputs, training=None):
        shape = self.compute_output_shape(inputs)
        return scaled_spec(shape, self.compute_dtype)

    # --- config and conversion -------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "output_shape": self.partial_output_shape,
                "equation": self.equation,
                "activation": self.activation,
                "bias_axes": self.bias_axes,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "bias_initializer": keras.initializers.serialize(
                    self.bias_initializer
                ),
                "kernel_regularizer": None,
                "bias_regularizer": None,
                "activity_regularizer": None,
                "kernel_constraint": None,
                "bias_constraint": None,
                "quantization_config": None,
            }
        )
        return config

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A ScaledEinsumDense with `layer`'s config and represented weights.

        `layer` is a `keras.layers.EinsumDense`; when it is built, the
        result is built on the same input shape and holds the same weight
        values (split into unit-RMS data × pow2 scale). `overrides` replace
        config entries, e.g. `dtype="scaled_fp8"`.
        """
        if not isinstance(layer, keras.layers.EinsumDense):
            raise TypeError(
                f"`layer` must be a keras.layers.EinsumDense, got "
                f"{type(layer).__name__}."
            )
        if getattr(layer, "quantization_mode", None) is not None:
            raise ValueError(
                f"`layer` {layer.name!r} is quantized "
                f"({layer.quantization_mode}); convert a float layer."
            )
        if getattr(layer, "lora_enabled", False):
            raise ValueError(
                f"`layer` {layer.name!r} has LoRA enabled; merge it first."
            )
        config = layer.get_config()
        config.update(overrides)
        scaled = cls.from_config(config)
        if layer.built:
            build = layer.get_build_config() or {}
            if "input_shape" not in build:
                raise ValueError(
                    f"`layer` {layer.name!r} is built but has no recorded "
                    f"input shape; call it once on an input."
                )
            scaled.build(build["input_shape"])
            scaled.set_weights(weight_values(layer))
        return scaled

    def to_keras(self, **overrides):
        """A plain `keras.layers.EinsumDense` with this config and the
        represented weights (built when this layer is). A scaled dtype
        policy becomes float32; `overrides` replace config entries."""
        config = self.get_config()
        config["dtype"] = plain_policy(self)
        config.update(overrides)
        layer = keras.layers.EinsumDense.from_config(config)
        if self.built:
            build = self.get_build_config() or {}
            layer.build(build["input_shape"])
            layer.set_weights(weight_values(self))
        return layer
