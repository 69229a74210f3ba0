"""ScaledLayerNormalization and ScaledRMSNormalization."""

import keras

from keras_scalify import ops as sops
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.weights import add_grad_scale_state
from keras_scalify.layers.base import cast_to_compute
from keras_scalify.layers.variable import read_tensor
from keras_scalify.layers.keras_twin import check_keras_layer
from keras_scalify.layers.keras_twin import copy_built_weights
from keras_scalify.layers.keras_twin import keras_base_kwargs
from keras_scalify.layers.keras_twin import reject_options
from keras_scalify.layers.keras_twin import scaled_base_kwargs
from keras_scalify.layers.base import spec_like
from keras_scalify.layers.base import to_float32
from keras_scalify.layers.activation import _as_spec
from keras_scalify.ops.rescaling import STATISTICS
from keras_scalify.ops.nn import affine_layer_normalization
from keras_scalify.ops.rescaling import delayed_rescale_grad


def _norm_axes(axis, ndim, name):
    axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
    out = []
    for a in axes:
        if not isinstance(a, int) or not -ndim <= a < ndim:
            raise ValueError(
                f"`axis` of {name} must be ints in [-{ndim}, {ndim}) for inputs "
                f"of rank {ndim}, got {axis!r}."
            )
        out.append(a % ndim)
    return sorted(out)


class _ScaledNorm(ScaledLayer):
    """Shared: axes, delayed input-gradient rescaling (paper Alg. 5)."""

    def __init__(self, axis, epsilon, grad_rescale, **kwargs):
        super().__init__(**kwargs)
        if grad_rescale is not None and grad_rescale not in STATISTICS:
            raise ValueError(
                f"`grad_rescale` must be None or one of {STATISTICS}, got "
                f"{grad_rescale!r}."
            )
        self.axis = axis
        self.epsilon = float(epsilon)
        self.grad_rescale = grad_rescale

    def _build_common(self, input_shape):
        shape = input_shape.data if is_scaled(input_shape) else input_shape
        self._axes = _norm_axes(self.axis, len(shape), self.name)
        param_shape = tuple(shape[a] for a in self._axes)
        if any(d is None for d in param_shape):
            raise ValueError(
                f"`inputs` of {self.name} need known sizes on `axis` "
                f"{self.axis}, got shape {tuple(shape)}."
            )
        if self.grad_rescale is not None:
            self.grad_scale_state = add_grad_scale_state(self)
        return shape, param_shape

    def _call_axes(self, x):
        """`axis` resolved against this call's input rank (like Keras, a
        negative axis counts from the end of each input, whatever the rank
        the layer was built on)."""
        return _norm_axes(self.axis, len(x.shape), self.name)

    def _param(self, weight, y, axes, ndim):
        """A scaled weight in float32, shaped to broadcast against `y`."""
        return self._broadcast(sops.cast(weight.read(), "float32"), axes, ndim)

    def _broadcast(self, w, axes, ndim):
        """Reshape a parameter over `axes` to broadcast against inputs."""
        if axes == list(range(ndim - len(axes), ndim)):
            return w
        shape = [1] * ndim
        for a, d in zip(axes, w.shape):
            shape[a] = d
        return sops.reshape(w, shape)

    def _rescaled_input(self, inputs):
        """The input in the compute dtype, then in float32 for the norm;
        the delayed gradient rescale sits after the float32 cast, so the
        float32 input gradient is rescaled, then rounded once."""
        x = to_float32(cast_to_compute(self, inputs))
        rescale = self._grad_rescale_args()
        return x if rescale is None else delayed_rescale_grad(x, *rescale)

    def _grad_rescale_args(self):
        """`(state, statistic)` of the input's delayed gradient rescale, or
        None without one."""
        if self.grad_rescale is None:
            return None
        return read_tensor(self.grad_scale_state), self.grad_rescale

    def _finish(self, y):
        return sops.cast(y, self.compute_dtype)

    def compute_output_spec(self, inputs):
        x = _as_spec(inputs)
        return spec_like(type(x)(keras.KerasTensor(x.data.shape, dtype=self.compute_dtype), x.scale, x.grad_scale))

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "axis": self.axis,
                "epsilon": self.epsilon,
                "grad_rescale": self.grad_rescale,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledLayerNormalization(_ScaledNorm):
    """`keras.layers.LayerNormalization` on ScaledTensors.

    The normalization acts on the data (output scale 1, exactly Keras's
    values, see `ksc.ops.layer_normalization`), then `gamma`/`beta` (scaled
    weights) apply with their own scales. With `grad_rescale` ("l2" by
    default) the input gradient's scale is re-anchored from the previous
    step's statistic: the paper's one rescale per LayerNorm.

    Args:
        axis, epsilon, center, scale, beta_initializer, gamma_initializer:
            as in `keras.layers.LayerNormalization`.
        grad_rescale: None, "l2", "l1" or "max".
    """

    def __init__(
        self,
        axis=-1,
        epsilon=1e-3,
        center=True,
        scale=True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        grad_rescale="l2",
        **kwargs,
    ):
        super().__init__(axis, epsilon, grad_rescale, **kwargs)
        self.center = center
        self.scale = scale
        self.beta_initializer = keras.initializers.get(beta_initializer)
        self.gamma_initializer = keras.initializers.get(gamma_initializer)

    def build(self, input_shape):
        _, param_shape = self._build_common(input_shape)
        self._gamma = (
            self.add_scaled_weight("gamma", param_shape, self.gamma_initializer)
            if self.scale
            else None
        )
        self._beta = (
            self.add_scaled_weight("beta", param_shape, self.beta_initializer)
            if self.center
            else None
        )

    @property
    def gamma(self):
        return self._gamma

    @property
    def beta(self):
        return self._beta

    def call(self, inputs):
        # Normalized and scaled in float32, rounded once (`_finish`).
        if self._gamma is not None and self._beta is not None:
            # One node where the backend fuses it (`affine_layer_normalization`,
            # the delayed gradient rescale of the input included).
            x = to_float32(cast_to_compute(self, inputs))
            axes, ndim = self._call_axes(x), len(x.shape)
            y = affine_layer_normalization(
                x,
                self._param(self._gamma, x, axes, ndim),
                self._param(self._beta, x, axes, ndim),
                axis=axes,
                epsilon=self.epsilon,
                calibrated=(self._gamma.calibrated, self._beta.calibrated),
                grad_rescale=self._grad_rescale_args(),
            )
            return self._finish(y)
        x = self._rescaled_input(inputs)
        axes, ndim = self._call_axes(x), len(x.shape)
        y = sops.layer_normalization(x, axis=axes, epsilon=self.epsilon)
        if self._gamma is not None:
            y = sops.multiply(
                y, self._param(self._gamma, y, axes, ndim), calibrated=(None, self._gamma.calibrated)
            )
        if self._beta is not None:
            y = sops.add(
                y, self._param(self._beta, y, axes, ndim), calibrated=(None, self._beta.calibrated)
            )
        return self._finish(y)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "center": self.center,
                "scale": self.scale,
                "beta_initializer": keras.initializers.serialize(self.beta_initializer),
                "gamma_initializer": keras.initializers.serialize(self.gamma_initializer),
            }
        )
        return config

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A ScaledLayerNormalization with the config and weights of a
        `keras.layers.LayerNormalization` (and `grad_rescale="l2"` unless
        overridden). Regularizers, constraints and the deprecated
        `rms_scaling` raise a ValueError naming the argument."""
        check_keras_layer(layer, keras.layers.LayerNormalization, cls)
        reject_options(layer, cls, _UNSUPPORTED_NORM + ("rms_scaling",))
        kwargs = keras_base_kwargs(layer, {})
        kwargs.update(
            axis=layer.axis,
            epsilon=layer.epsilon,
            center=layer.center,
            scale=layer.scale,
            beta_initializer=keras.initializers.serialize(layer.beta_initializer),
            gamma_initializer=keras.initializers.serialize(layer.gamma_initializer),
        )
        kwargs.update(overrides)
        return copy_built_weights(layer, cls(**kwargs))

    def to_keras(self, **overrides):
        """A plain `keras.layers.LayerNormalization` with this config and
        the represented gamma/beta."""
        kwargs = scaled_base_kwargs(self, {})
        kwargs.update(
            axis=self.axis,
            epsilon=self.epsilon,
            center=self.center,
            scale=self.scale,
            beta_initializer=keras.initializers.serialize(self.beta_initializer),
            gamma_initializer=keras.initializers.serialize(self.gamma_initializer),
        )
        kwargs.update(overrides)
        return copy_built_weights(self, keras.layers.LayerNormalization(**kwargs))


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledRMSNormalization(_ScaledNorm):
    """`keras.layers.RMSNormalization` on ScaledTensors: `x/rms(x) · scale`.

    Args:
        axis, epsilon: as in `keras.layers.RMSNormalization`.
        grad_rescale: None, "l2", "l1" or "max" (see
            `ScaledLayerNormalization`).
    """

    def __init__(self, axis=-1, epsilon=1e-6, grad_rescale="l2", **kwargs):
        super().__init__(axis, epsilon, grad_rescale, **kwargs)

    def build(self, input_shape):
        _, param_shape = self._build_common(input_shape)
        self._scale = self.add_scaled_weight("scale", param_shape, "ones")

    @property
    def scale(self):
        return self._scale

    def call(self, inputs):
        x = self._rescaled_input(inputs)
        axes, ndim = self._call_axes(x), len(x.shape)
        y = sops.rms_normalization(x, axis=axes, epsilon=self.epsilon)
        y = sops.multiply(
            y, self._param(self._scale, y, axes, ndim), calibrated=(None, self._scale.calibrated)
        )
        return self._finish(y)

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A ScaledRMSNormalization with the config and weight of a
        `keras.layers.RMSNormalization` (and `grad_rescale="l2"`)."""
        check_keras_layer(layer, keras.layers.RMSNormalization, cls)
        kwargs = keras_base_kwargs(layer, {})
        kwargs.update(axis=layer.axis, epsilon=layer.epsilon)
        kwargs.update(overrides)
        return copy_built_weights(layer, cls(**kwargs))

    def to_keras(self, **overrides):
        """A plain `keras.layers.RMSNormalization` with this config and the
        represented scale."""
        kwargs = scaled_base_kwargs(self, {})
        kwargs.update(axis=self.axis, epsilon=self.epsilon)
        kwargs.update(overrides)
        return copy_built_weights(self, keras.layers.RMSNormalization(**kwargs))


_UNSUPPORTED_NORM = (
    "beta_regularizer",
    "gamma_regularizer",
    "activity_regularizer",
    "beta_constraint",
    "gamma_constraint",
)
