"""Scaled activations and the ScaledActivation layer."""

import keras

from keras_scalify import ops as sops
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.base import cast_to_compute
from keras_scalify.layers.keras_twin import check_keras_layer
from keras_scalify.layers.keras_twin import keras_base_kwargs
from keras_scalify.layers.keras_twin import scaled_base_kwargs
from keras_scalify.layers.base import spec_like

def _gelu(x):
    """`keras.activations.gelu`: the exact (erf) form by default."""
    return sops.gelu(x, approximate=False)


def _gelu_approximate(x):
    """keras-hub's `gelu_approximate`: the tanh form."""
    return sops.gelu(x, approximate=True)


# The gated activations among them, by `backend.fused` kind (a Dense
# layer's GEMM epilogue may compute them: `ops.linalg.contraction_plus`).
GATE_KINDS = {_gelu: "gelu", _gelu_approximate: "gelu_tanh", sops.silu: "silu"}


def gate_kind(activation):
    """The `backend.fused` kind of a scaled activation of `ACTIVATIONS`
    that is gated (GELU, SiLU), else None."""
    return GATE_KINDS.get(activation)


ACTIVATIONS = {
    "linear": None,
    "relu": sops.relu,
    "gelu": _gelu,
    "gelu_approximate": _gelu_approximate,
    "silu": sops.silu,
    "swish": sops.silu,
    "tanh": sops.tanh,
    "sigmoid": sops.sigmoid,
    "softmax": sops.softmax,
    "log_softmax": sops.log_softmax,
}


def get_activation(identifier):
    """A scaled activation by Keras name (None or "linear": identity)."""
    if identifier is None:
        return None
    if not isinstance(identifier, str):
        name = getattr(identifier, "__name__", None)
        if name == "_gelu":
            name = "gelu"
        if name in ACTIVATIONS and _is_builtin(identifier, name):
            return ACTIVATIONS[name]
        raise ValueError(
            f"`activation` must be one of {sorted(ACTIVATIONS)}, got "
            f"{identifier!r}."
        )
    if identifier not in ACTIVATIONS:
        raise ValueError(
            f"`activation` must be one of {sorted(ACTIVATIONS)}, got "
            f"{identifier!r}."
        )
    return ACTIVATIONS[identifier]


def _is_builtin(fn, name):
    """`fn` is Keras's activation `name` or our scaled one (a user function
    that happens to be called "relu" is not converted silently)."""
    if fn is ACTIVATIONS[name] or fn is _gelu:
        return True
    if name == "gelu_approximate":
        return getattr(fn, "__module__", "").startswith("keras_hub.")
    try:
        return keras.activations.get(name) is fn
    except Exception:
        return False


def keras_activation(identifier):
    """The Keras activation for a name of `activation_name`: keras-hub's
    function for "gelu_approximate" (Keras has no such name), else the
    identifier itself."""
    if identifier == "gelu_approximate":
        from keras_hub.src.utils.keras_utils import gelu_approximate

        return gelu_approximate
    return identifier


def activation_name(identifier):
    """The Keras name of a supported activation (call `get_activation`
    first to validate `identifier`)."""
    if identifier is None:
        return "linear"
    if isinstance(identifier, str):
        return identifier
    name = getattr(identifier, "__name__", None)
    return "gelu" if name == "_gelu" else name


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledActivation(ScaledLayer):
    """`keras.layers.Activation` on ScaledTensors (scale rules of `ksc.ops`).

    Args:
        activation: a name among relu, gelu, silu/swish, tanh, sigmoid,
            softmax, log_softmax, linear.
    """

    def __init__(self, activation, **kwargs):
        super().__init__(**kwargs)
        self._fn = get_activation(activation)
        self.activation = activation_name(activation)

    def call(self, inputs):
        x = cast_to_compute(self, inputs)
        return x if self._fn is None else self._fn(x)

    def compute_output_spec(self, inputs):
        x = _as_spec(inputs)
        return spec_like(type(x)(keras.KerasTensor(x.data.shape, dtype=self.compute_dtype), x.scale, x.grad_scale))

    def get_config(self):
        config = super().get_config()
        config.update({"activation": self.activation})
        return config

    @classmethod
    def from_keras(cls, layer, **overrides):
        """A ScaledActivation for a `keras.layers.Activation` (same name,
        dtype policy); an activation without a scaled rule raises a
        ValueError naming `activation`."""
        check_keras_layer(layer, keras.layers.Activation, cls)
        kwargs = keras_base_kwargs(layer, {})
        kwargs["activation"] = layer.activation
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_keras(self, **overrides):
        """A plain `keras.layers.Activation` with this activation."""
        kwargs = scaled_base_kwargs(self, {})
        kwargs["activation"] = self.activation
        kwargs.update(overrides)
        return keras.layers.Activation(**kwargs)


def _as_spec(inputs):
    if is_scaled(inputs):
        return inputs
    return ScaledTensor(
        inputs,
        keras.KerasTensor((), dtype="float32"),
        keras.KerasTensor((), dtype="float32"),
    )
