"""ScaledAdd and ScaledDropout."""

import keras

from keras_scalify import ops as sops
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.layers.activation import _as_spec
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.base import cast_to_compute
from keras_scalify.layers.keras_twin import check_keras_layer
from keras_scalify.layers.keras_twin import keras_base_kwargs
from keras_scalify.layers.keras_twin import scaled_base_kwargs
from keras_scalify.layers.base import spec_like
from keras_scalify.layers.base import to_float32


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledAdd(ScaledLayer):
    """`keras.layers.Add` on ScaledTensors, optionally weighted.

    `weights=None` sums the inputs (scale rule of `ksc.ops.add`). A list of
    Python floats gives `Σ wᵢ·xᵢ`, e.g. unit scaling's residual
    `[sqrt(1 - tau), sqrt(tau)]` for `[skip, branch]`.

    Args:
        weights: None or one float per input.
    """

    def __init__(self, weights=None, **kwargs):
        super().__init__(**kwargs)
        if weights is not None:
            weights = [float(w) for w in weights]
        self.residual_weights = weights

    def call(self, inputs):
        if not isinstance(inputs, (list, tuple)) or isinstance(inputs, ScaledTensor) or len(inputs) < 2:
            raise ValueError(
                f"`inputs` of {self.name} must be a list of at least 2 tensors."
            )
        # Summed in float32, rounded once to the compute dtype.
        xs = [to_float32(cast_to_compute(self, x)) for x in inputs]
        if self.residual_weights is not None:
            if len(self.residual_weights) != len(xs):
                raise ValueError(
                    f"`weights` of {self.name} has {len(self.residual_weights)} "
                    f"entries for {len(xs)} inputs."
                )
            xs = [sops.multiply(x, w) for x, w in zip(xs, self.residual_weights)]
        y = xs[0]
        for x in xs[1:]:
            y = sops.add(y, x)
        return sops.cast(y, self.compute_dtype)

    def compute_output_spec(self, inputs):
        x = _as_spec(inputs[0])
        return spec_like(ScaledTensor(keras.KerasTensor(x.data.shape, dtype=self.compute_dtype), x.scale, x.grad_scale))

    def get_config(self):
        config = super().get_config()
        config.update({"weights": self.residual_weights})
        return config

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A ScaledAdd (unweighted) for a `keras.layers.Add`."""
        check_keras_layer(layer, keras.layers.Add, cls)
        kwargs = keras_base_kwargs(layer, {})
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_keras(self, **overrides):
        """A plain `keras.layers.Add`; weighted sums have no Keras
        counterpart and raise a ValueError naming `weights`."""
        if self.residual_weights is not None:
            raise ValueError(
                f"`weights` of {self.name!r} ({self.residual_weights}): a "
                f"weighted ScaledAdd has no keras.layers.Add counterpart."
            )
        kwargs = scaled_base_kwargs(self, {})
        kwargs.update(overrides)
        return keras.layers.Add(**kwargs)


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledDropout(ScaledLayer):
    """`keras.layers.Dropout` on ScaledTensors: scale unchanged, the data
    is dropped and divided by `1 - rate` (training only).

    Args:
        rate, noise_shape, seed: as in `keras.layers.Dropout`.
    """

    def __init__(self, rate, noise_shape=None, seed=None, **kwargs):
        super().__init__(**kwargs)
        if not 0 <= rate <= 1:
            raise ValueError(f"`rate` must be in [0, 1], got {rate!r}.")
        self.rate = rate
        self.noise_shape = noise_shape
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if rate > 0 else None

    def call(self, inputs, training=False):
        x = cast_to_compute(self, inputs)
        if not training or self.rate == 0:
            return x
        data = keras.random.dropout(
            x.data, self.rate, noise_shape=self.noise_shape, seed=self.seed_generator
        )
        return ScaledTensor(data, x.scale, x.grad_scale)

    def compute_output_spec(self, inputs, training=False):
        x = _as_spec(inputs)
        return spec_like(ScaledTensor(keras.KerasTensor(x.data.shape, dtype=self.compute_dtype), x.scale, x.grad_scale))

    def get_config(self):
        config = super().get_config()
        config.update(
            {"rate": self.rate, "noise_shape": self.noise_shape, "seed": self.seed}
        )
        return config

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A ScaledDropout with the rate, noise shape and seed of a
        `keras.layers.Dropout` (same seed: same masks)."""
        check_keras_layer(layer, keras.layers.Dropout, cls)
        kwargs = keras_base_kwargs(layer, {})
        kwargs.update(rate=layer.rate, noise_shape=layer.noise_shape, seed=layer.seed)
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_keras(self, **overrides):
        """A plain `keras.layers.Dropout` with this rate, noise shape, seed."""
        kwargs = scaled_base_kwargs(self, {})
        kwargs.update(rate=self.rate, noise_shape=self.noise_shape, seed=self.seed)
        kwargs.update(overrides)
        return keras.layers.Dropout(**kwargs)
