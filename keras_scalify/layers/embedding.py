"""ScaledEmbedding, with a tied output projection for language models."""

import keras
from keras import ops

from keras_scalify import ops as sops
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.base import scaled_spec
from keras_scalify.layers.keras_twin import check_keras_layer
from keras_scalify.layers.keras_twin import copy_built_weights
from keras_scalify.layers.keras_twin import keras_base_kwargs
from keras_scalify.layers.keras_twin import reject_options
from keras_scalify.layers.keras_twin import scaled_base_kwargs
from keras_scalify.layers.dense import policy_matmul
from keras_scalify.layers.base import cast_to_compute


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledEmbedding(ScaledLayer):
    """`keras.layers.Embedding` returning ScaledTensors.

    `call(tokens)` looks rows up (scale rule of `take`: the table's scale);
    `call(x, reverse=True)` is the tied output projection `x @ tableᵀ`
    (logits over the vocabulary), sharing one weight and one grad scale
    with the lookup, so the summed gradient stays exact.

    Args:
        input_dim, output_dim, embeddings_initializer: as in
            `keras.layers.Embedding`.
    """

    def __init__(
        self, input_dim, output_dim, embeddings_initializer="uniform", **kwargs
    ):
        super().__init__(**kwargs)
        for name, v in (("input_dim", input_dim), ("output_dim", output_dim)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"`{name}` must be a positive int, got {v!r}.")
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, input_shape=None):
        self._embeddings = self.add_scaled_weight(
            "embeddings", (self.input_dim, self.output_dim), self.embeddings_initializer
        )

    @property
    def embeddings(self):
        return self._embeddings

    @property
    def embeddings_value(self):
        return self._embeddings.value

    def call(self, inputs, reverse=False):
        if reverse:
            x = cast_to_compute(self, inputs)
            if x.shape[-1] is not None and x.shape[-1] != self.output_dim:
                raise ValueError(
                    f"`inputs` of {self.name} (reverse=True) must have last "
                    f"dimension {self.output_dim}, got shape {x.shape}."
                )
            table = sops.transpose(self._embeddings.read())
            return policy_matmul(self, None, x, table, calibrated=self._embeddings.calibrated)
        if is_scaled(inputs):
            raise TypeError(
                f"`inputs` of {self.name} must be integer token ids, got a "
                f"ScaledTensor (use reverse=True for the output projection)."
            )
        dtype = keras.backend.standardize_dtype(getattr(inputs, "dtype", "int32"))
        if "int" not in dtype:
            inputs = ops.cast(inputs, "int32")
        # The lookup reads a float32 copy of the table (exact): its gradient,
        # a scatter-add of every token's row, then sums in float32 and is
        # rounded once to the master dtype (a float16 scatter-add is both
        # less accurate and, on XLA CPU, several times slower).
        table = sops.cast(self._embeddings.read(), "float32")
        return sops.cast(sops.take(table, inputs, axis=0), self.compute_dtype)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            shape = tuple((inputs.data if is_scaled(inputs) else inputs).shape[:-1]) + (self.input_dim,)
        else:
            shape = tuple(inputs.shape) + (self.output_dim,)
        return scaled_spec(shape, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "input_dim": self.input_dim,
                "output_dim": self.output_dim,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
            }
        )
        return config

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A ScaledEmbedding with the config and table of a
        `keras.layers.Embedding`. `mask_zero=True`, regularizers,
        constraints, LoRA and quantization raise a ValueError naming the
        argument."""
        check_keras_layer(layer, keras.layers.Embedding, cls)
        reject_options(layer, cls, _UNSUPPORTED_EMBEDDING)
        kwargs = keras_base_kwargs(layer, {})
        kwargs.update(
            input_dim=layer.input_dim,
            output_dim=layer.output_dim,
            embeddings_initializer=keras.initializers.serialize(
                layer.embeddings_initializer
            ),
        )
        kwargs.update(overrides)
        return copy_built_weights(layer, cls(**kwargs))

    def to_keras(self, **overrides):
        """A plain `keras.layers.Embedding` with this config and the
        represented table (the lookup only: Keras's Embedding has no
        `reverse` projection)."""
        kwargs = scaled_base_kwargs(self, {})
        kwargs.update(
            input_dim=self.input_dim,
            output_dim=self.output_dim,
            embeddings_initializer=keras.initializers.serialize(
                self.embeddings_initializer
            ),
        )
        kwargs.update(overrides)
        return copy_built_weights(self, keras.layers.Embedding(**kwargs))


_UNSUPPORTED_EMBEDDING = (
    "mask_zero",
    "embeddings_regularizer",
    "activity_regularizer",
    "embeddings_constraint",
    "lora_rank",
)


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledReversibleEmbedding(ScaledEmbedding):
    """`keras.layers.ReversibleEmbedding` returning ScaledTensors.

    As `ScaledEmbedding`, plus Keras's options for the output projection:
    `tie_weights=False` gives it its own `reverse_embeddings` weight
    (`output_dim × input_dim`); `logit_soft_cap=c` returns
    `tanh(logits / c) · c` (scale rules of `divide` by a constant and
    `tanh`: output scale at most 1·c). `reverse_dtype` is kept for
    `to_keras`; the projection's dtypes are the policy's (FP8 operands under
    `scaled_fp8`).
    """

    def __init__(
        self,
        input_dim,
        output_dim,
        tie_weights=True,
        embeddings_initializer="uniform",
        reverse_dtype=None,
        logit_soft_cap=None,
        **kwargs,
    ):
        super().__init__(
            input_dim, output_dim, embeddings_initializer, **kwargs
        )
        self.tie_weights = bool(tie_weights)
        self.reverse_dtype = reverse_dtype
        if logit_soft_cap is not None and not logit_soft_cap > 0:
            raise ValueError(
                f"`logit_soft_cap` must be None or > 0, got {logit_soft_cap!r}."
            )
        self.logit_soft_cap = logit_soft_cap

    def build(self, input_shape=None):
        super().build(input_shape)
        self._reverse_embeddings = None
        if not self.tie_weights:
            self._reverse_embeddings = self.add_scaled_weight(
                "reverse_embeddings",
                (self.output_dim, self.input_dim),
                self.embeddings_initializer,
            )

    @property
    def reverse_embeddings(self):
        return self._reverse_embeddings

    def call(self, inputs, reverse=False):
        if not reverse or self.tie_weights:
            y = super().call(inputs, reverse=reverse)
        else:
            x = cast_to_compute(self, inputs)
            y = policy_matmul(
                self, None, x, self._reverse_embeddings.read(),
                calibrated=self._reverse_embeddings.calibrated,
            )
        if reverse and self.logit_soft_cap is not None:
            cap = float(self.logit_soft_cap)
            y = sops.multiply(sops.tanh(sops.divide(y, cap)), cap)
        return y

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "tie_weights": self.tie_weights,
                "reverse_dtype": self.reverse_dtype,
                "logit_soft_cap": self.logit_soft_cap,
            }
        )
        return config

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A ScaledReversibleEmbedding with the config and weights of a
        `keras.layers.ReversibleEmbedding` (or of a subclass that keeps its
        `call`, as keras-hub's)."""
        check_keras_layer(layer, keras.layers.ReversibleEmbedding, cls)
        overrides = dict(overrides)
        for name in ("tie_weights", "reverse_dtype", "logit_soft_cap"):
            overrides.setdefault(name, getattr(layer, name))
        return super().from_keras(layer, **overrides)

    def to_keras(self, **overrides):
        """A plain `keras.layers.ReversibleEmbedding` with this config and
        the represented weights."""
        kwargs = scaled_base_kwargs(self, {})
        kwargs.update(
            input_dim=self.input_dim,
            output_dim=self.output_dim,
            tie_weights=self.tie_weights,
            embeddings_initializer=keras.initializers.serialize(
                self.embeddings_initializer
            ),
            reverse_dtype=self.reverse_dtype,
            logit_soft_cap=self.logit_soft_cap,
        )
        kwargs.update(overrides)
        return copy_built_weights(
            self, keras.layers.ReversibleEmbedding(**kwargs)
        )
