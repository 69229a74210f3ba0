"""ScaledDense: `keras.layers.Dense` on ScaledTensors."""

import keras

from keras_scalify.backend.scalar import dtype_name
from keras_scalify import ops as sops
from keras_scalify.backend import fp8
from keras_scalify.backend import fused
from keras_scalify.backend import scalar as S
from keras_scalify.core.formats import FP8_DTYPES
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.layers.activation import _as_spec
from keras_scalify.ops._common import logical_not
from keras_scalify.ops.linalg import cast_contraction
from keras_scalify.ops.linalg import contraction_plus
from keras_scalify.layers.activation import activation_name
from keras_scalify.layers.activation import gate_kind
from keras_scalify.layers.activation import get_activation
from keras_scalify.layers.activation import keras_activation
from keras_scalify.layers.base import KernelBiasMixin
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.base import scaled_spec
from keras_scalify.layers.base import cast_to_compute
from keras_scalify.layers.keras_twin import check_keras_layer
from keras_scalify.layers.keras_twin import copy_built_weights
from keras_scalify.layers.keras_twin import keras_base_kwargs
from keras_scalify.layers.keras_twin import reject_options
from keras_scalify.layers.keras_twin import scaled_base_kwargs
from keras_scalify.layers.base import to_float32


def _votes(layer, calibrated):
    """The contraction's `calibrated=` for a weight's `calibrated` flag
    (`policy_matmul`)."""
    if calibrated is None:
        return None
    if not getattr(layer, "_input_votes_when_calibrated", True):
        return (logical_not(calibrated), calibrated)
    return (None, calibrated)


def _bias_in_gemm(x, w):
    """Whether the bias add joins the GEMMs' custom gradient for these
    operands (`backend.fused.bias_in_gemm`: float32 tensors on eager torch
    and TensorFlow)."""
    return fused.bias_in_gemm(x.data if is_scaled(x) else x, w.data)


def matmul_bias_and_activation(layer, subscripts_or_none, x, w, calibrated=None):
    """`bias_and_activation(layer, policy_matmul(layer, subscripts_or_none,
    x, w, epilogue=True, calibrated=calibrated))`. Under a float32 policy
    with a bias or a GELU / SiLU, where the backend runs each op's passes
    as they come (`backend.fused.bias_in_gemm`: eager torch, TensorFlow),
    the GEMMs and the bias add (and, on eager torch, the activation) are
    one custom gradient (`ops.linalg.contraction_plus`, the rules' scales
    unchanged); XLA fuses the composition itself (on jax the fused node
    measured ~3% slower on the MLP of `step_time.py`)."""
    gate = gate_kind(layer._act)
    if (layer._bias is not None or gate is not None) and _bias_in_gemm(x, w) and all(
        dtype_name(d) == "float32"
        for d in (layer.policy_dtype("matmul_dtype"), layer.policy_dtype("grad_dtype"), layer.compute_dtype)
    ):
        bias = bias_factor = None
        if layer._bias is not None:
            # (The rebalanced bias's data factor joins the node's factors.)
            bias, bias_factor = layer._bias.read_rebalanced()
            bias = sops.cast(bias, "float32")
        y = contraction_plus(
            subscripts_or_none, x, w, bias,
            calibrated=_votes(layer, calibrated),
            c_calibrated=None if bias is None else layer._bias.calibrated,
            activation=layer._act, gate=gate, c_factor=bias_factor,
        )
        if y is not None:
            return y
    y = policy_matmul(layer, subscripts_or_none, x, w, epilogue=True, calibrated=calibrated)
    return bias_and_activation(layer, y)


def policy_matmul(layer, subscripts_or_none, x, w, epilogue=False, calibrated=None):
    """`x @ w` (or an einsum) with the policy's casts: inputs cast to the
    matmul dtype forward (E4M3 under scaled_fp8), the output gradient cast
    to the grad dtype backward (E5M2). Output data in the compute dtype;
    `epilogue=True` (float32 work follows, `bias_and_activation`): an FP8
    GEMM's output stays in float32, so the epilogue rounds it once.
    `calibrated`: the weight's `ScaledVariable.calibrated` (a guessed grad
    scale does not vote for the output's). A layer whose
    `_input_votes_when_calibrated` is False takes a calibrated weight's
    prediction alone (see `ScaledMultiHeadAttention`)."""
    cal = _votes(layer, calibrated)
    mm = layer.policy_dtype("matmul_dtype")
    gd = layer.policy_dtype("grad_dtype")
    if dtype_name(mm) in FP8_DTYPES:
        # One FP8 dispatch for the forward GEMM and both backward GEMMs.
        out = "float32" if epilogue else layer.compute_dtype
        if subscripts_or_none is None:
            y = sops.fp8_matmul(x, w, mm, gd, out_dtype=out, calibrated=cal)
        else:
            y = sops.fp8_einsum(subscripts_or_none, x, w, mm, gd, out_dtype=out, calibrated=cal)
        layer._fp8_route = fp8.last_fp8_route()
        return y
    # (The weight is cast inside the contraction: its gradient comes back
    # in its master dtype without a rounding to the matmul dtype.)
    y = cast_contraction(subscripts_or_none, x, w, mm, calibrated=cal)
    y = sops.cast_on_backward(y, gd)
    cd = layer.compute_dtype
    if y.dtype != dtype_name(cd):
        y = sops.cast(y, cd)
    return y


def bias_and_activation(layer, y, add_bias=True):
    """`activation(y + bias)` in float32, rounded once to the compute dtype
    (`y` only cast to it when the layer has neither; `add_bias=False`: the
    bias is in `y` already)."""
    dtype = dtype_name(layer.compute_dtype)
    if (layer._bias is None or not add_bias) and layer._act is None:
        return sops.cast(y, dtype)
    y = to_float32(y)
    if layer._bias is not None and add_bias:
        bias = sops.cast(layer._bias.read(rebalance=True), "float32")
        y = sops.add(y, bias, calibrated=(None, layer._bias.calibrated))
    if layer._act is not None:
        y = layer._act(y)
    return sops.cast(y, dtype)


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledDense(KernelBiasMixin, ScaledLayer):
    """`keras.layers.Dense` on ScaledTensors.

    `y = activation(x @ kernel + bias)` with the scale rules of `ksc.ops`;
    the kernel and bias are `ScaledVariable`s (unit-RMS data, the
    initializer's RMS in the scale). Under a scaled policy the matmul
    inputs are cast to its `matmul_dtype` and the output gradient to its
    `grad_dtype` (E4M3 / E5M2 under `scaled_fp8`).

    Args:
        units, activation, use_bias, kernel_initializer, bias_initializer:
            as in `keras.layers.Dense`.
    """

    # As Keras's Dense (`InputSpec(min_ndim=2)`), checked in `__call__`.
    _min_input_ndim = 2


    def __init__(
        self,
        units,
        activation=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not isinstance(units, int) or units <= 0:
            raise ValueError(f"`units` must be a positive int, got {units!r}.")
        self.units = units
        self._act = get_activation(activation)
        self.activation = activation_name(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        shape = input_shape.data if is_scaled(input_shape) else input_shape
        if len(shape) < 1 or shape[-1] is None:
            raise ValueError(
                f"`inputs` of {self.name} need a known last dimension, got "
                f"shape {tuple(shape)}."
            )
        self._kernel = self.add_scaled_weight(
            "kernel", (shape[-1], self.units), self.kernel_initializer
        )
        self._bias = (
            self.add_scaled_weight("bias", (self.units,), self.bias_initializer)
            if self.use_bias
            else None
        )
        self.input_spec = None


    def call(self, inputs):
        x = cast_to_compute(self, inputs)
        if x.shape[-1] is not None and x.shape[-1] != self._kernel.shape[0]:
            raise ValueError(
                f"`inputs` of {self.name} must have last dimension "
                f"{self._kernel.shape[0]}, got shape {x.shape}."
            )
        return matmul_bias_and_activation(
            self, None, x, self._kernel.read(), calibrated=self._kernel.calibrated
        )

    def compute_output_spec(self, inputs):
        x = _as_spec(inputs)
        shape = tuple(x.data.shape[:-1]) + (self.units,)
        return scaled_spec(shape, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "activation": self.activation,
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "bias_initializer": keras.initializers.serialize(
                    self.bias_initializer
                ),
            }
        )
        return config

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A ScaledDense with the config and weights of a `keras.layers.Dense`.

        The name, dtype policy and trainability are kept (`overrides`
        replace constructor arguments, e.g. `dtype="scaled_fp8"`); a built
        layer gives a built ScaledDense holding the same represented
        weights. Regularizers, constraints, LoRA, quantization and
        activations without a scaled rule raise a ValueError naming the
        argument.
        """
        check_keras_layer(layer, keras.layers.Dense, cls)
        reject_options(layer, cls, _UNSUPPORTED_DENSE)
        kwargs = keras_base_kwargs(layer, {})
        kwargs.update(_dense_kwargs(layer), **overrides)
        return copy_built_weights(layer, cls(**kwargs))

    def to_keras(self, **overrides):
        """A plain `keras.layers.Dense` with this config and the represented
        float32 weights (built when this layer is); a scaled dtype policy
        becomes "float32"."""
        kwargs = scaled_base_kwargs(self, {})
        kwargs.update(_dense_kwargs(self), **overrides)
        return copy_built_weights(self, keras.layers.Dense(**kwargs))


def _dense_kwargs(layer):
    """The arguments a Dense and a ScaledDense share, read from `layer`."""
    return dict(
        units=layer.units,
        activation=keras_activation(layer.activation),
        use_bias=layer.use_bias,
        kernel_initializer=keras.initializers.serialize(layer.kernel_initializer),
        bias_initializer=keras.initializers.serialize(layer.bias_initializer),
    )


_UNSUPPORTED_DENSE = (
    "kernel_regularizer",
    "bias_regularizer",
    "activity_regularizer",
    "kernel_constraint",
    "bias_constraint",
    "lora_rank",
)
