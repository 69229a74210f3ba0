"""Model conversion: `scalify` (Keras → scaled) and `unscalify` (back).

`scalify(model)` replaces, in place, the Keras layers that have a scaled
counterpart (Dense, EinsumDense, Embedding, ReversibleEmbedding,
LayerNormalization, RMSNormalization, Activation, Add, Dropout,
MultiHeadAttention, Conv1D, Conv2D) by it, holding the same
(represented) weights, wherever they are referenced
(`convert_inplace.py`):

- the own layers of a plain Sequential/Functional model become scaled
  layers in scaled mode, and the root's `call` runs the graph with
  ScaledTensors whole between them (`convert_graph.call_graph`);
- inside every other layer or model (custom layers, keras-hub backbones
  and tasks, subclassed models) they become plain-I/O scaled layers.

The root becomes a `models.ScalifiedModel` (saving, weights, compile):
its `.keras` file holds the original's config and the `scalify` calls
that `load_model` replays.

`unscalify(model)` does the opposite: every scaled layer becomes its Keras
counterpart with the represented float32 weights, so the result loads
without keras_scalify.
"""

import keras

from keras_scalify import layers as scaled_layers
from keras_scalify import models
from keras_scalify.layers.base import name_scopes_of
from keras_scalify.convert_graph import _check_model
from keras_scalify.convert_graph import _finish
from keras_scalify.convert_graph import _is_graph_model
from keras_scalify.convert_graph import _rebuild
from keras_scalify.convert_graph import graph_of
from keras_scalify.convert_graph import records_scaled
from keras_scalify.convert_inplace import all_layers
from keras_scalify.convert_inplace import convert_in_place
from keras_scalify.convert_inplace import replace_layers
from keras_scalify.convert_inplace import walk_sublayers
from keras_scalify.convert_inplace import warn_unconverted
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.boundary import AsScaled
from keras_scalify.layers.boundary import ToArray
from keras_scalify.layers.embedding import ScaledEmbedding
from keras_scalify.layers.own_weights import scale_own_weights
from keras_scalify.layers.own_weights import unscale_own_weights
from keras_scalify.layers.regions import install_regions
from keras_scalify.layers.regions import uninstall_regions
from keras_scalify.layers.rescale import DynamicRescaleGrad
from keras_scalify.ops.symbolic import ScaledOperation
from keras_scalify.policies import ScaledDTypePolicy
from keras_scalify.policies import get as get_policy

# Keras class name -> scaled class name in `keras_scalify.layers`. A layer
# matches its class exactly, or a subclass that keeps the class's `call`,
# `build` and output-spec methods (keras-hub's `ReversibleEmbedding`); a
# subclass that changes them (keras-hub's `CachedMultiHeadAttention`) is a
# custom layer, converted inside.
_SCALED_NAMES = {
    "Dense": "ScaledDense",
    "EinsumDense": "ScaledEinsumDense",
    "ReversibleEmbedding": "ScaledReversibleEmbedding",
    "LayerNormalization": "ScaledLayerNormalization",
    "RMSNormalization": "ScaledRMSNormalization",
    "Embedding": "ScaledEmbedding",
    "Activation": "ScaledActivation",
    "Add": "ScaledAdd",
    "Dropout": "ScaledDropout",
    "MultiHeadAttention": "ScaledMultiHeadAttention",
    "Conv1D": "ScaledConv1D",
    "Conv2D": "ScaledConv2D",
}


def _keras_class(name):
    return getattr(keras.layers, name)


def _scaled_class(keras_name, layer):
    """The scaled class for `layer`, looked up in `keras_scalify.layers`
    (EinsumDense and MultiHeadAttention live in optional modules)."""
    name = _SCALED_NAMES[keras_name]
    cls = getattr(scaled_layers, name, None)
    if cls is None or not hasattr(cls, "from_keras"):
        raise ValueError(
            f"Layer {layer.name!r} ({keras_name}) cannot be converted: "
            f"`keras_scalify.layers.{name}` (with `from_keras`) is not "
            f"available in this installation. Pass "
            f"`exclude=[{layer.name!r}]` to `scalify` to keep it as a plain "
            f"Keras layer."
        )
    return cls


# The layers converted inside custom layers: those holding weights (GEMMs,
# lookups, norms).
_IN_PLACE = (
    "Dense",
    "EinsumDense",
    "ReversibleEmbedding",
    "Embedding",
    "LayerNormalization",
    "RMSNormalization",
    "MultiHeadAttention",
    "Conv1D",
    "Conv2D",
)

# Methods a subclass may override and still convert as its Keras class
# (construction and serialization: the scaled layer has its own).
_FREE_METHODS = ("__init__", "get_config", "from_config", "__repr__")


def _overridden_methods(layer, cls):
    """The methods of `cls` that `type(layer)` (a subclass) redefines."""
    names = set()
    for klass in type(layer).__mro__:
        if klass is cls or not issubclass(klass, cls):
            break
        names |= {
            n for n, v in vars(klass).items()
            if callable(v) and hasattr(cls, n) and n not in _FREE_METHODS
        }
    return names


def _convertible_name(layer):
    """The Keras class name `layer` converts as: its class, or a subclass
    that redefines none of the class's methods (a subclass overriding, say,
    `_compute_attention` would silently lose it)."""
    for keras_name in _SCALED_NAMES:
        cls = _keras_class(keras_name)
        if type(layer) is cls:
            return keras_name
    for keras_name in _SCALED_NAMES:
        cls = _keras_class(keras_name)
        if isinstance(layer, cls) and not _overridden_methods(layer, cls):
            return keras_name
    return None


# --- scalify -----------------------------------------------------------------


class _ScalifyStep:
    """The conversion `scalify(model, dtype, exclude)` makes (see there)."""

    def __init__(self, dtype, exclude):
        self.dtype = dtype
        self.exclude = exclude
        self.attached = []  # nested graph models given their root class

    def _excluded(self, layer):
        for item in self.exclude:
            if isinstance(item, str) and item == layer.name:
                return True
            if isinstance(item, type) and isinstance(layer, item):
                return True
        return False

    def _convert(self, layer, keras_name):
        cls = _scaled_class(keras_name, layer)
        overrides = {} if self.dtype is None else {"dtype": self.dtype}
        try:
            return cls.from_keras(layer, **overrides)
        except ValueError as e:
            raise ValueError(
                f"{e} (scalify: pass `exclude=[{layer.name!r}]` to keep "
                f"this layer as a plain Keras layer.)"
            ) from e

    def graph(self, model, mapping=None):
        """A Sequential/Functional `model`'s own layers, in place: each
        convertible one becomes a scaled layer in scaled mode (its graph
        then runs with ScaledTensors between them, `ScalifiedGraph`), a
        nested Sequential/Functional model likewise (in the same
        replacement: a layer may be shared with it), another nested model
        is scalified, every other layer converted inside."""
        top = mapping is None
        mapping = {} if top else mapping
        for layer in graph_of(model).operations:
            if (
                not isinstance(layer, keras.layers.Layer)  # a `keras.ops` node
                or isinstance(layer, (ScaledLayer, keras.layers.InputLayer))
                or id(layer) in mapping  # shared with a nested model
                or self._excluded(layer)
            ):
                continue
            if _is_graph_model(layer) and not isinstance(layer, models.ScalifiedModel):
                models.attach(layer, self.dtype, self.exclude)
                self.attached.append(layer)
                self.graph(layer, mapping)
            elif isinstance(layer, keras.Model):
                scalify(layer, dtype=self.dtype, exclude=self.exclude)
            elif _convertible_name(layer) is None:
                self.inside(layer)
            else:
                mapping[id(layer)] = (layer, self._convert(layer, _convertible_name(layer)))
        if top and mapping:
            replace_layers(model, mapping)

    def choose(self, layer):
        """In-place conversion inside custom layers (`convert_inplace`):
        a plain-I/O scaled layer, None to descend, False to keep."""
        if self._excluded(layer) or isinstance(layer, ScaledLayer):
            return False
        keras_name = _convertible_name(layer)
        if keras_name is None:
            return None
        if keras_name not in _IN_PLACE or not layer.built:
            # Weightless layers gain nothing from scaling between plain
            # code; an unbuilt layer was never called.
            return False
        with name_scopes_of(layer):
            try:
                new = self._convert(layer, keras_name)
            except ValueError as e:
                warn_unconverted(layer, e)
                return None
        new.enable_plain_io(_plain_dtype_of(layer), type(layer).__name__)
        return new

    def inside(self, root):
        """Converts the layers inside `root` in place; the plain layers left
        under a scaled policy compute in float32."""
        convert_in_place(root, self.choose)
        if self._excluded(root):
            return

        def own(parent, child):
            if self._excluded(child):
                return False
            policy = child.dtype_policy if self.dtype is None else get_policy(self.dtype)
            scale_own_weights(parent, child, policy)
            return True

        walk_sublayers(root, own)
        install_regions(root)
        _plain_policy_to_float32(root)

        def visit(parent, child):
            if self._excluded(child):
                return False  # kept as it is, policy included
            _plain_policy_to_float32(child)
            return True

        walk_sublayers(root, visit)


def scalify(model, dtype=None, exclude=()):
    """`model` computed with scaled layers.

    Dense, EinsumDense, Embedding, ReversibleEmbedding, LayerNormalization,
    RMSNormalization, Activation, Add, Dropout, MultiHeadAttention, Conv1D
    and Conv2D layers (the Keras classes, or subclasses that redefine none
    of their methods) become their
    `keras_scalify.layers` counterparts holding the same represented
    weights (`ScaledX.from_keras`), keeping their names.

    `model` is converted in place, as `model.quantize` does, and returned:
    keep a copy if you need the original.

    - The own layers of a plain Sequential or Functional model become
      scaled layers in scaled mode: ScaledTensors flow between them (the
      root's `call` runs the graph, `models.ScalifiedGraph`), every other
      layer of the graph receives the represented float32 values, and the
      model returns plain arrays.
    - Inside every other layer — custom layers, keras-hub transformer
      blocks and attention layers, Keras's MultiHeadAttention subclasses —
      and inside every other model (keras-hub Backbones and tasks,
      subclassed models), the convertible sublayers are replaced
      (attributes, lists, tracked layers, Functional graph nodes; a shared
      layer stays shared) by scaled layers with plain input and output
      (`ScaledLayer.enable_plain_io`), since the code around them runs
      `keras.ops` on plain tensors. Plain layers left under a scaled dtype
      policy compute in float32. While a custom layer holding converted
      layers runs (a transformer block), ScaledTensors flow between them
      and through its `keras.ops` code (scaled regions,
      `layers/regions.py`); it returns plain float32 values.

    A compiled model is compiled again with its compile config, its
    optimizer wrapped in a `ScaledOptimizer` when the model has scaled
    weights.

    Under the float32 policy the converted model's predictions equal the
    original's (up to float32 rounding). Set a scaled policy first
    (`keras.config.set_dtype_policy("scaled_fp8")`) or pass `dtype` to
    train in low precision.

    Args:
        model: a built `keras.Model`.
        dtype: None (keep each layer's dtype policy) or a policy (e.g.
            `"scaled_fp8"`) for the converted layers.
        exclude: layer names or classes to keep as plain Keras layers (with
            everything inside them).

    The model's root becomes a `models.ScalifiedModel` (its `.keras` file
    replays this call on the original; its `get_weights`/`set_weights`/
    `count_params` are the original's).

    Returns:
        `model`, converted.
    """
    if isinstance(exclude, (str, type)):
        exclude = (exclude,)
    exclude = tuple(exclude)
    _check_model(model, "scalify")
    _check_distribution(model)
    graph = _is_graph_model(model)
    if graph:
        graph_of(model)  # a Sequential without an input shape raises here
    first = not isinstance(model, models.ScalifiedModel)
    models.attach(model, dtype, exclude)
    step = _ScalifyStep(dtype, exclude)
    try:
        if graph:
            step.graph(model)
        else:
            step.inside(model)
    except Exception:
        # A layer refused before any was replaced: nothing changed.
        for nested in step.attached:
            models.detach(nested)
        if first:
            models.detach(model)
        raise
    return _finish(model, model)


def _check_distribution(model):
    """A model whose variables were laid out by a `keras.distribution` is
    converted inside that distribution's scope: the scaled layers' new
    variables take their layouts from it when they are created (outside
    it, they would live on one device beside the sharded ones)."""
    if keras.distribution.distribution() is not None:
        return
    laid_out = [v.path for v in model.variables if getattr(v, "_layout", None) is not None]
    if laid_out:
        raise ValueError(
            f"`model`'s variables were created under a keras.distribution "
            f"(e.g. {laid_out[0]!r}): call `scalify` inside the same "
            f"distribution's scope (`with distribution.scope(): "
            f"ksc.scalify(model, ...)`)."
        )


def _plain_dtype_of(layer):
    """The dtype a plain-I/O scaled layer returns in place of `layer`: its
    compute dtype, float32 for a scaled policy (the plain code around it
    then computes in float32, see `_plain_policy_to_float32`)."""
    if isinstance(layer.dtype_policy, ScaledDTypePolicy):
        return "float32"
    return layer.compute_dtype


def _plain_policy_to_float32(layer):
    """A plain (unconverted) layer under a scaled policy computes in
    float32: where no scale rule exists, values are decoded to float32.
    The policy is kept for `unscalify`."""
    if isinstance(layer, ScaledLayer):
        return
    policy = layer.dtype_policy
    if isinstance(policy, ScaledDTypePolicy):
        layer._keras_scalify_policy = policy
        layer.dtype_policy = "float32"


def _restore_policy(layer):
    policy = getattr(layer, "_keras_scalify_policy", None)
    if policy is not None:
        layer.dtype_policy = policy
        del layer._keras_scalify_policy


# --- unscalify ---------------------------------------------------------------


class _UnscalifyStep:
    """The conversion `unscalify` makes: in place (`graph`, `inside`), or,
    for a graph built by hand from scaled layers, one layer call of the
    rebuilt plain graph (`convert_graph._rebuild`)."""

    def __init__(self, called=None):
        self.called = called
        self.layers = {}

    def to_plain_for(self, layer):
        return None

    def graph(self, model, mapping=None):
        """A scalified Sequential/Functional `model`'s own layers back to
        Keras, in place, with those of the graph models nested in it (in
        the same replacement: a layer may be shared with them)."""
        top = mapping is None
        mapping = {} if top else mapping
        for layer in graph_of(model).operations:
            if isinstance(layer, keras.layers.InputLayer) or id(layer) in mapping:
                continue
            if _is_graph_model(layer) and not records_scaled(graph_of(layer)):
                self.graph(layer, mapping)
                models.detach(layer)
                continue
            new = self.new_layer(layer)
            if new is not layer:
                mapping[id(layer)] = (layer, new)
        if top and mapping:
            replace_layers(model, mapping)

    def choose(self, layer):
        """In-place: a plain-I/O scaled layer back to Keras (`to_keras`)."""
        if isinstance(layer, ScaledLayer):
            if layer.plain_io:
                with name_scopes_of(layer):
                    return layer.to_keras()
            raise ValueError(
                f"Layer {layer.name!r} ({type(layer).__name__}) is a scaled "
                f"layer inside a custom layer that calls it on ScaledTensors: "
                f"it has no plain replacement there; it cannot be unscalified."
            )
        return None

    def inside(self, root):
        uninstall_regions(root)
        convert_in_place(root, self.choose)
        for layer in all_layers(root):
            unscale_own_weights(layer)
            _restore_policy(layer)

    def new_layer(self, layer):
        if id(layer) in self.layers:
            return self.layers[id(layer)]
        if isinstance(layer, ScaledOperation):
            raise ValueError(
                f"The graph calls `keras_scalify.ops.{layer.function}` "
                f"({layer.name!r}), which has no plain Keras counterpart; "
                f"it cannot be unscalified."
            )
        if not isinstance(layer, keras.layers.Layer):
            new = layer  # a `keras.ops` node
        elif isinstance(layer, keras.Model):
            new = unscalify(layer)
        elif isinstance(layer, ScaledLayer):
            if not hasattr(layer, "to_keras"):
                raise ValueError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) has no "
                    f"plain Keras counterpart (`to_keras`); it cannot be "
                    f"unscalified."
                )
            new = layer.to_keras()
        else:
            new = layer
            self.inside(layer)
        self.layers[id(layer)] = new
        return new

    def __call__(self, layer, args, kwargs):
        if isinstance(layer, (AsScaled, ToArray, DynamicRescaleGrad)):
            # Identity on represented values.
            return args[0] if args else next(iter(kwargs.values()))
        if (
            type(layer) is ScaledEmbedding
            and kwargs.get("reverse")
        ):
            raise ValueError(
                f"Layer {layer.name!r} is used with `reverse=True` (tied "
                f"output projection), which keras.layers.Embedding lacks; "
                f"it cannot be unscalified."
            )
        new = self.new_layer(layer)
        if self.called is not None:
            self.called.append(new)
        return new(*args, **kwargs)

    def finish(self, outputs):
        return outputs


def unscalify(model):
    """`model` computing its represented values with plain Keras layers.

    Every scaled layer becomes its Keras counterpart (`to_keras`) with the
    represented float32 weights and a plain dtype policy (a scaled policy
    becomes float32), in place, and the dtype policies `scalify` changed
    are restored; the root gets its class back. The result contains no
    keras_scalify layer, so it can be saved and loaded, exported or served
    without keras_scalify.

    A Sequential/Functional graph built by hand from scaled layers, whose
    nodes pass ScaledTensors (`AsScaled`, `ToArray`, `DynamicRescaleGrad`
    between them), is rebuilt instead, without those boundary layers
    (identity on represented values): a new model is returned.

    Args:
        model: a built `keras.Model`.

    Returns:
        `model`, converted back, or the new plain model of a hand-built
        scaled graph.
    """
    _check_model(model, "unscalify")
    step = _UnscalifyStep()
    if _is_graph_model(model):
        if records_scaled(graph_of(model)):
            return _rebuild(model, _UnscalifyStep, "unscalify")
        step.graph(model)
    else:
        step.inside(model)
    models.detach(model)
    return model
