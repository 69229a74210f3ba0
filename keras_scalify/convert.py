"""Model conversion: `scalify` (Keras → scaled) and `unscalify` (back).

`scalify(model)` replaces the Keras layers that have a scaled counterpart
(Dense, EinsumDense, Embedding, ReversibleEmbedding, LayerNormalization,
RMSNormalization, Activation, Add, Dropout, MultiHeadAttention) by it,
holding the same (represented) weights:

- a plain Sequential/Functional model is rebuilt into a new one in which
  ScaledTensors flow between scaled layers, with `AsScaled` where a plain
  floating tensor (a model input, the output of an unconverted layer)
  enters a converted layer and `ToArray` before every unconverted layer
  that would receive a ScaledTensor and on every model output; its
  unconverted layers are reused (not copied);
- inside every other layer or model (custom layers, keras-hub backbones
  and tasks, subclassed models) the convertible sublayers are replaced in
  place (`convert_inplace.py`) by plain-I/O scaled layers.

Either way the root becomes a `models.ScalifiedModel` (saving, weights).

`unscalify(model)` does the opposite: every scaled layer becomes its Keras
counterpart with the represented float32 weights, boundary layers
(`AsScaled`, `ToArray`) and `DynamicRescaleGrad` (identity forward) are
removed, so the result loads without keras_scalify. The root of a model
converted in place saves as the original plus the `scalify` calls that
`load_model` replays (`keras_scalify/models.py`).

The graph walking and rebuilding is in `convert_graph.py`.
"""

import keras

from keras_scalify import layers as scaled_layers
from keras_scalify import models
from keras_scalify.layers.base import name_scopes_of
from keras_scalify.convert_graph import _check_model
from keras_scalify.convert_graph import _finish
from keras_scalify.convert_graph import _is_graph_model
from keras_scalify.convert_graph import _rebuild
from keras_scalify.convert_inplace import all_layers
from keras_scalify.convert_inplace import convert_in_place
from keras_scalify.convert_inplace import walk_sublayers
from keras_scalify.convert_inplace import warn_unconverted
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.core.scaled_tensor import map_scaled
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
    """One layer call of the scalified model (see `scalify`)."""

    def __init__(self, names, called, dtype, exclude):
        self.names = names
        self.called = called  # Sequential: layers in call order.
        self.dtype = dtype
        self.exclude = exclude
        self.layers = {}  # id(old layer) -> new layer
        self.converted = set()  # ids of new layers converted from Keras
        self.as_scaled = {}  # id(plain tensor) -> ScaledTensor
        self.to_array = {}  # id(ScaledTensor data) -> tensor

    def _excluded(self, layer):
        for item in self.exclude:
            if isinstance(item, str) and item == layer.name:
                return True
            if isinstance(item, type) and isinstance(layer, item):
                return True
        return False

    def new_layer(self, layer):
        if id(layer) in self.layers:
            return self.layers[id(layer)]
        if not isinstance(layer, keras.layers.Layer):
            # An Operation node (`keras.ops` call, `ScaledOperation`): kept.
            self.layers[id(layer)] = layer
            return layer
        excluded = self._excluded(layer)
        keras_name = None if excluded else _convertible_name(layer)
        if isinstance(layer, keras.Model) and not excluded:
            new = scalify(layer, dtype=self.dtype, exclude=self.exclude)
        elif keras_name is not None:
            new = self._convert(layer, keras_name)
            self.converted.add(id(new))
        else:
            # Kept, with the layers inside it converted in place.
            new = layer
            if not excluded:
                self.inside(layer)
        self.layers[id(layer)] = new
        return new

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

    def _record(self, layer):
        if self.called is not None:
            self.called.append(layer)

    def _boundary_kwargs(self, base):
        kwargs = {"name": self.names(base)}
        if self.dtype is not None:
            kwargs["dtype"] = self.dtype
        return kwargs

    def _wrap_as_scaled(self, x):
        if is_scaled(x) or not isinstance(x, keras.KerasTensor):
            return x
        if "float" not in keras.backend.standardize_dtype(x.dtype):
            return x
        if id(x) not in self.as_scaled:
            layer = AsScaled(**self._boundary_kwargs("as_scaled"))
            self._record(layer)
            self.as_scaled[id(x)] = layer(x)
        return self.as_scaled[id(x)]

    def _unwrap(self, x):
        if not is_scaled(x):
            return x
        if id(x.data) not in self.to_array:
            layer = ToArray(**self._boundary_kwargs("to_array"))
            self._record(layer)
            self.to_array[id(x.data)] = layer(x)
        return self.to_array[id(x.data)]

    def to_plain_for(self, layer):
        """`ToArray` for the inputs of unconverted plain layers (and of
        nested models, plain outside); None for scaled layers."""
        new = self.new_layer(layer)
        if hasattr(new, "_scaled_weights") or isinstance(new, ScaledOperation):
            return None
        return self._unwrap

    def __call__(self, layer, args, kwargs):
        new = self.new_layer(layer)
        if id(new) in self.converted and not isinstance(new, ScaledEmbedding):
            args = tuple(map_scaled(self._wrap_as_scaled, a) for a in args)
        self._record(new)
        return new(*args, **kwargs)

    def finish(self, outputs):
        return map_scaled(self._unwrap, outputs)


def scalify(model, dtype=None, exclude=()):
    """`model` computed with scaled layers.

    Dense, EinsumDense, Embedding, ReversibleEmbedding, LayerNormalization,
    RMSNormalization, Activation, Add, Dropout, MultiHeadAttention, Conv1D
    and Conv2D layers (the Keras classes, or subclasses that redefine none
    of their methods) become their
    `keras_scalify.layers` counterparts holding the same represented
    weights (`ScaledX.from_keras`), keeping their names.

    - A plain Sequential or Functional model is rebuilt: ScaledTensors flow
      between its converted layers, `AsScaled` is inserted where a plain
      floating tensor enters one, `ToArray` before every other layer that
      would receive a ScaledTensor and on every output. A new model is
      returned; its unconverted layers are `model`'s own (not copies).
    - Inside every other layer — custom layers, keras-hub transformer
      blocks and attention layers, Keras's MultiHeadAttention subclasses —
      and inside every other model (keras-hub Backbones and tasks,
      subclassed models), the convertible sublayers are replaced *in place*
      (attributes, lists, tracked layers, Functional graph nodes; a shared
      layer stays shared) by scaled layers with plain input and output
      (`ScaledLayer.enable_plain_io`), since the code around them runs
      `keras.ops` on plain tensors. Such a model is returned itself,
      converted. Plain layers left under a scaled dtype policy compute in
      float32. While a custom layer holding converted layers runs (a
      transformer block), ScaledTensors flow between them and through its
      `keras.ops` code (scaled regions, `layers/regions.py`); it returns
      plain float32 values.

    So `model` is modified wherever it contains custom layers or is not a
    plain Sequential/Functional model (as `model.quantize` does): keep a
    copy if you need the original. A compiled model is compiled again with
    its compile config, its optimizer wrapped in a `ScaledOptimizer` when
    the model has scaled weights.

    Under the float32 policy the converted model's predictions equal the
    original's (up to float32 rounding). Set a scaled policy first
    (`keras.config.set_dtype_policy("scaled_fp8")`) or pass `dtype` to
    train in low precision.

    Args:
        model: a built `keras.Model`.
        dtype: None (keep each layer's dtype policy) or a policy (e.g.
            `"scaled_fp8"`) for the converted and boundary layers.
        exclude: layer names or classes to keep as plain Keras layers (with
            everything inside them).

    Either way the returned model's root is a `models.ScalifiedModel`
    (its `.keras` file replays this call on the original; its
    `get_weights`/`set_weights`/`count_params` are the original's).

    Returns:
        A new `keras.Sequential` / Functional `keras.Model` for a plain one,
        else `model` itself.
    """
    if isinstance(exclude, (str, type)):
        exclude = (exclude,)
    exclude = tuple(exclude)
    _check_distribution(model)

    def make_step(names, called):
        return _ScalifyStep(names, called, dtype, exclude)

    if _is_graph_model(model):
        return _rebuild(model, make_step, "scalify", (dtype, exclude))
    _check_model(model, "scalify")
    models.attach(model, dtype, exclude)
    make_step(None, None).inside(model)
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
    """One layer call of the unscalified model (see `unscalify`)."""

    def __init__(self, names, called):
        self.called = called
        self.layers = {}

    def to_plain_for(self, layer):
        return None

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
    """A plain Keras model computing the represented values of `model`.

    Every scaled layer becomes its Keras counterpart (`to_keras`) with the
    represented float32 weights and a plain dtype policy (a scaled policy
    becomes float32); `AsScaled`, `ToArray` and `DynamicRescaleGrad`
    (identity on values) are removed from a rebuilt Sequential/Functional
    graph. Inside custom layers and other models the plain-I/O scaled
    layers `scalify` put there are replaced back in place, and the dtype
    policies it changed are restored. The result contains no keras_scalify
    layer, so it can be saved and loaded, exported or served without
    keras_scalify.

    Args:
        model: a built `keras.Model`.

    Returns:
        A new `keras.Sequential` / Functional `keras.Model` for a plain one,
        else `model` itself.
    """

    def make_step(names, called):
        return _UnscalifyStep(names, called)

    if _is_graph_model(model):
        return _rebuild(model, make_step, "unscalify")
    _check_model(model, "unscalify")
    make_step(None, None).inside(model)
    models.detach(model)
    return model
