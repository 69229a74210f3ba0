"""Scale propagation through custom layers: scaled regions.

Inside a custom layer that `scalify` converted in place (a keras-hub
transformer block, an attention layer), the converted sublayers are
plain-I/O (`layers/plain_io.py`). A *region* lets ScaledTensors flow
between them instead: while the outermost such layer runs, converted
sublayers return their ScaledTensors (grad scale re-anchored, not
decoded), the layer's own code runs `keras.ops` and Python operators on
them (`ops/dispatch.py`: the scaled rule where there is one, else the plain
op on decoded values), and the region decodes what it returns.

`install_regions(root)` sets a `call` wrapper (an instance attribute;
`uninstall_regions` removes it) on each layer under `root` that is not a
scaled layer:

- a *composite*: a custom layer, not a model, with converted layers below
  it and no model below it (a Functional model's graph nodes call backend
  ops, not `keras.ops`, so no ScaledTensor may reach one). Outside a region
  it opens one and decodes its outputs to float32 on the way out; inside
  one it runs as is. Models and layers holding models open no region:
  their code sees plain values, their composites open their own regions;
- a layer whose own kernels `scalify` scaled (`layers/own_weights.py`):
  a composite whose attributes hold the weights' reads while it runs;
- a *leaf* (no converted layer below) called in a region: a Keras layer
  gets its ScaledTensor inputs decoded (Dropout, and keras-hub's rotary
  embedding: applied to the data, the scale kept; keras-hub's RMS norms:
  the `rms_normalization` rule); a layer from elsewhere (written with
  `keras.ops`) runs on the ScaledTensors as they are.
"""

import contextlib
import functools
import threading

import keras

from keras_scalify import ops as sops
from keras_scalify.backend import scalar as S
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.core.scaled_tensor import map_scaled
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.own_weights import has_own_weights
from keras_scalify.layers.own_weights import weight_reads
from keras_scalify.ops.boundary import to_array
from keras_scalify.ops.dispatch import dispatching
from keras_scalify.ops.dispatch import weight_reads as registered

_STATE = threading.local()


def in_region():
    """Whether a scaled region is open (this thread)."""
    return getattr(_STATE, "open", False)


@contextlib.contextmanager
def _region(open_):
    previous = in_region()
    _STATE.open = open_
    try:
        yield
    finally:
        _STATE.open = previous


def _decode(x):
    if not is_scaled(x):
        return x
    # Keras maps a call's masks over the inputs' structure: a ScaledTensor
    # input gets a `ScaledTensor(None, None, None)` mask.
    return None if x.data is None else to_array(x)


def _decode_all(args, kwargs):
    return map_scaled(_decode, args), map_scaled(_decode, kwargs)


def _composite_call(call):
    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        if in_region():
            return call(*args, **kwargs)
        with _region(True):
            outputs = call(*args, **kwargs)
        return map_scaled(_decode, outputs)

    return wrapper


def _own_weights_call(call):
    """A custom layer whose own kernels `scalify` scaled
    (`layers/own_weights.py`): a composite whose attributes hold the
    weights' reads while it runs, their contractions the policy's GEMMs."""
    layer = call.__self__

    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        reads = weight_reads(layer)
        kept = {attr: layer.__dict__[attr] for attr, _, _ in reads}
        opened = not in_region()
        try:
            for attr, read, _ in reads:
                object.__setattr__(layer, attr, read)
            with _region(True), registered([(read, c) for _, read, c in reads]):
                outputs = call(*args, **kwargs)
        finally:
            for attr, value in kept.items():
                object.__setattr__(layer, attr, value)
        return map_scaled(_decode, outputs) if opened else outputs

    return wrapper


def _leaf_call(call):
    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        if in_region():
            args, kwargs = _decode_all(args, kwargs)
        return call(*args, **kwargs)

    return wrapper


def _data_call(call, in_compute_dtype=False):
    """A layer linear in its input that keeps its RMS (Dropout's mask;
    keras-hub's rotary embedding, a rotation of feature pairs): applied to
    a ScaledTensor's data, the scale and grad scale kept. Exact for pow2
    scales (`L(s·d) = s·L(d)`), and the cotangent `Lᵀ(g)` keeps the grad
    scale's units. `in_compute_dtype`: the data is cast to the layer's
    compute dtype for the call (its own tensors are in it) and back."""

    @functools.wraps(call)
    def wrapper(inputs, *args, **kwargs):
        if not (in_region() and is_scaled(inputs)):
            return call(inputs, *args, **kwargs)
        data, dtype = inputs.data, inputs.data.dtype
        if in_compute_dtype:
            data = keras.ops.cast(data, call.__self__.compute_dtype)
        data = call(data, *args, **kwargs)
        if data.dtype != dtype:
            data = keras.ops.cast(data, dtype)
        return ScaledTensor(data, inputs.scale, inputs.grad_scale)

    return wrapper


def _cast_data_call(call):
    """`_data_call` in the layer's compute dtype (keras-hub's layers)."""
    return _data_call(call, in_compute_dtype=True)


def _rms_norm_call(call):
    """keras-hub's RMS norms of Llama, Mistral and Qwen (`cast(x, float32)
    · rsqrt(mean(x²) + eps) · scale`, cast to the compute dtype): on a
    ScaledTensor, the `rms_normalization` rule (unit output scale, `eps`
    re-expressed in the data's units: exact) times the plain `scale`
    weight, instead of the six rules of its code."""
    layer = call.__self__

    @functools.wraps(call)
    def wrapper(inputs, *args, **kwargs):
        if args or kwargs or not (in_region() and is_scaled(inputs)):
            return call(inputs, *args, **kwargs)
        x = sops.rms_normalization(sops.cast(inputs, "float32"), axis=-1, epsilon=layer.epsilon)
        # (The weight read outside the rule's custom gradient: an eager
        # TensorFlow tape refuses a variable read inside one.)
        scale = S.variable_value(layer.scale)
        return sops.cast(sops.multiply(x, scale), layer.compute_dtype)

    return wrapper


def _transparent_call(call):
    """A layer written with `keras.ops` (not one of Keras's own): runs on
    ScaledTensors as they are, through the ops dispatch."""
    return call


# Layers applied to a ScaledTensor's data (`_data_call`): Keras's, and
# keras-hub's by (module, class name) (keras-hub is optional; a
# subclass may change `call`, so only these exact classes).
_DATA_LAYERS = (keras.layers.Dropout,)
_DATA_LAYER_NAMES = {("keras_hub.src.layers.modeling.rotary_embedding", "RotaryEmbedding")}
# keras-hub's RMS norms with a `scale` weight (see `_rms_norm_call`).
_RMS_NORM_NAMES = {
    ("keras_hub.src.models.llama.llama_layernorm", "LlamaLayerNorm"),
    ("keras_hub.src.models.mistral.mistral_layer_norm", "MistralLayerNormalization"),
    ("keras_hub.src.models.qwen.qwen_layernorm", "QwenLayerNorm"),
}


def _kind(layer):
    """The wrapper for `layer`'s call (None: left as it is)."""
    if isinstance(layer, (ScaledLayer, keras.Model)):
        return None
    if has_own_weights(layer):
        return _own_weights_call
    below = layer._flatten_layers(include_self=False, recursive=True)
    if any(isinstance(sub, ScaledLayer) or has_own_weights(sub) for sub in below):
        if any(isinstance(sub, keras.Model) for sub in below):
            return None
        return _composite_call
    if type(layer) in _DATA_LAYERS:
        return _data_call
    name = (type(layer).__module__, type(layer).__name__)
    if name in _DATA_LAYER_NAMES:
        return _cast_data_call
    if name in _RMS_NORM_NAMES:
        return _rms_norm_call
    if type(layer).__module__.startswith("keras."):
        return _leaf_call
    return _transparent_call


def _plain_add_loss(add_loss):
    """`add_loss` of a layer in a region: a ScaledTensor loss (a router's
    auxiliary loss computed on scaled logits) is decoded first; Keras would
    flatten it into three losses (data, scale, grad scale)."""

    @functools.wraps(add_loss)
    def wrapper(loss):
        return add_loss(map_scaled(_decode, loss))

    return wrapper


def _dispatch_held_functions(layer):
    """A layer built before `keras_scalify` was imported may hold original
    `keras.ops` functions as attributes (keras-hub's `activation =
    ops.silu`): they get their dispatch wrappers, so that its code runs
    the same whatever the import order (the originals are kept for
    `uninstall_regions`)."""
    held = {}
    for attr, value in list(vars(layer).items()):
        wrapper = dispatching(value)
        if wrapper is not None:
            held[attr] = value
            object.__setattr__(layer, attr, wrapper)
    object.__setattr__(layer, "_ksc_held_functions", held)


def install_regions(root):
    """Wraps the `call` of the layers in `root`'s tree (`root` included)
    as composites or leaves (see above), and their `add_loss` so that
    losses leave a region as plain tensors."""
    for layer in root._flatten_layers(include_self=True, recursive=True):
        if "_ksc_plain_call" in layer.__dict__:
            continue
        wrap = _kind(layer)
        if wrap is None:
            continue
        object.__setattr__(layer, "_ksc_plain_call", layer.call)
        object.__setattr__(layer, "call", wrap(layer.call))
        object.__setattr__(layer, "add_loss", _plain_add_loss(layer.add_loss))
        _dispatch_held_functions(layer)


def uninstall_regions(root):
    """Removes the wrappers `install_regions` set."""
    for layer in root._flatten_layers(include_self=True, recursive=True):
        if "_ksc_plain_call" in layer.__dict__:
            object.__delattr__(layer, "call")
            object.__delattr__(layer, "add_loss")
            object.__delattr__(layer, "_ksc_plain_call")
            for attr, original in layer.__dict__.pop("_ksc_held_functions").items():
                object.__setattr__(layer, attr, original)
