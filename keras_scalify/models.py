"""The root of every model that `scalify` converts, and its `.keras` file.

A keras-hub backbone or task, or a subclassed model, is rebuilt by its own
class's `from_config` when a `.keras` file is loaded: its config holds
hyperparameters, not sublayers, so a plain `from_config` gives back the
plain model. `scalify` therefore gives the root of a model it converts a
subclass of the root's class (`ScalifiedModel` first in its MRO; for a
Sequential/Functional model `ScalifiedGraph`, which also runs the graph),
registered as `keras_scalify>ScalifiedModel`, whose config is

    {"model": <the original's serialized config, taken before conversion>,
     "scalify": [<the arguments of each scalify call>]}

and whose `from_config` deserializes the original, replays the `scalify`
calls, and returns the converted model. Keras then loads every variable
of the converted model (data in its master dtype, scales, grad scales,
delayed-rescaling states) and, for a compiled model, its optimizer's: the
loaded model is the saved one, bit for bit, and training resumes where it
stopped. `unscalify` gives the root its class back; save the unscalified
model for a file that loads without keras_scalify.

The class also makes the Keras workflow of such a model work as Keras's
own wrappers do: `get_weights`/`set_weights`/`count_params` are the
plain original's (a scaled weight as its represented float32 value);
`compile` with a plain optimizer (a keras-hub task's default included)
trains through `ScaledOptimizer`; `quantize(mode)` for serving quantizes
the unscalified model.
"""

import functools
import importlib

import keras

from keras.src.backend import set_keras_mask

from keras_scalify import convert
from keras_scalify.convert_graph import _is_graph_model
from keras_scalify.convert_graph import call_graph
from keras_scalify.convert_graph import graph_of
from keras_scalify.layers.weights import assign_weights
from keras_scalify.layers.weights import count_weight_params
from keras_scalify.layers.weights import weight_values
from keras_scalify.optimizers import ScaledOptimizer
from keras_scalify.optimizers.guard import scaled_variables_in

REGISTERED_NAME = "keras_scalify>ScalifiedModel"

_CLASSES = {}


class ScalifiedModel:
    """Mixin of the root of a scalified model (see the module)."""

    def get_config(self):
        if isinstance(self._ksc_original_config, Exception):
            raise NotImplementedError(
                f"{type(self).__name__} {self.name!r} cannot be saved: its "
                f"original class has no config "
                f"({type(self._ksc_original_config).__name__}: "
                f"{self._ksc_original_config}). Give it `get_config`, or "
                f"save its weights (`save_weights`)."
            )
        return {
            "model": self._ksc_original_config,
            "scalify": [dict(call) for call in self._ksc_scalify_calls],
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        model = keras.saving.deserialize_keras_object(
            config["model"], custom_objects=custom_objects
        )
        for call in config["scalify"]:
            model = convert.scalify(
                model,
                dtype=_deserialize_dtype(call["dtype"]),
                exclude=tuple(_deserialize_exclude(e) for e in call["exclude"]),
            )
        return model

    def compile(self, *args, **kwargs):
        """The class's own `compile` (a keras-hub task's defaults
        included); a plain Keras optimizer is then wrapped in
        `ScaledOptimizer`, as Keras wraps one in `LossScaleOptimizer` under
        `mixed_float16` (the compile config keeps the optimizer as given)."""
        super().compile(*args, **kwargs)
        optimizer = getattr(self, "optimizer", None)
        if (
            optimizer is not None
            and not isinstance(optimizer, ScaledOptimizer)
            and scaled_variables_in(self.trainable_variables)
        ):
            self.optimizer = ScaledOptimizer(optimizer)

    def export(self, filepath, *args, **kwargs):
        """Keras's `export`. Keras traces the model for serving with
        unknown dimensions (batch, sequence); a scaled contraction over an
        unknown size (attention over the sequence) has no scale rule, and
        that failure is re-raised naming the way through: `unscalify`,
        then export a plain copy built from the config and the weights."""
        try:
            return super().export(filepath, *args, **kwargs)
        except ValueError as e:
            if "needs a static size" not in str(e):
                raise
            raise ValueError(
                f"{type(self).__name__}.export traces the model with unknown "
                f"dimensions, and a scaled contraction needs its contracted "
                f"size known ({str(e).strip()}). Export a plain copy: "
                f"`keras_scalify.unscalify(model)` (in place, the trained "
                f"weights), then `plain = type(model).from_config("
                f"model.get_config()); plain.set_weights(model.get_weights()); "
                f"plain.export(...)` (a model converted in place keeps layer "
                f"lists that TensorFlow's SavedModel will not track)."
            ) from e

    def quantize(self, mode=None, *args, **kwargs):
        """Serving: `unscalify` (the plain model with the trained,
        represented weights), then Keras's `quantize` of it, in place.
        (Keras binds each layer's `quantize` on the instance when it is
        created: `attach` binds this one there, `detach` puts Keras's
        back.)"""
        convert.unscalify(self)
        return self.quantize(mode, *args, **kwargs)

    def get_weights(self):
        """The plain original's `get_weights()`: the same list, a scaled
        weight's represented float32 value in its place
        (`layers.weights.weight_values`)."""
        return weight_values(self)

    def set_weights(self, weights):
        """Sets weights from the plain original's `get_weights()` list (or
        this model's): a scaled weight's value is split into data and pow2
        scale; rescaling states are kept."""
        assign_weights(self, weights)

    def count_params(self):
        """Parameters as the plain original counts them (a scaled
        weight's data; scales and rescaling states are bookkeeping)."""
        return count_weight_params(self)

    def get_build_config(self):
        # The original's build config is inside `get_config()["model"]`.
        return None

    def compile_from_config(self, config):
        """Compiles with the saved compile config, through the model's own
        `compile` (keras-hub tasks override it, so Keras's
        `compile_from_config` would skip it), and builds the optimizer so
        that its saved variables load."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)


class ScalifiedGraph(ScalifiedModel):
    """Mixin of a scalified Sequential/Functional root. Its own layers are
    scaled layers in scaled mode where Keras's had a counterpart, and its
    graph runs with each ScaledTensor whole between them
    (`convert_graph.call_graph`: Keras's Functional would keep only a
    ScaledTensor's data); every other layer gets represented values, and
    the model returns plain arrays."""

    def call(self, inputs, training=None, mask=None, **kwargs):
        graph = graph_of(self)
        inputs = graph._standardize_inputs(inputs)
        if mask is not None:
            for x, m in zip(inputs, keras.tree.flatten(mask)):
                if m is not None:
                    set_keras_mask(x, m)
        outputs = call_graph(graph, inputs, training=training, **kwargs)
        if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
            return outputs[0]  # as Keras's Functional returns a singleton
        return outputs

    def compute_output_spec(self, *args, **kwargs):
        """Traced from `call` (plain float32 outputs)."""
        return keras.Operation.compute_output_spec(self, *args, **kwargs)


def attach(model, dtype, exclude):
    """Records a `scalify(model, dtype, exclude)` on the root `model`,
    before the conversion (the first call takes the original's config),
    and gives it its class's `ScalifiedModel` subclass."""
    call = {
        "dtype": _serialize_dtype(dtype),
        "exclude": [_serialize_exclude(e) for e in exclude],
    }
    if isinstance(model, ScalifiedModel):
        model._ksc_scalify_calls.append(call)
        return
    try:
        config = keras.saving.serialize_keras_object(model)
    except Exception as e:  # a model without a config: saving says so
        config = e
    else:
        config.pop("compile_config", None)  # compiled again by the outer config
    # (Plain attributes: not tracked by Keras, not torch module state.)
    object.__setattr__(model, "_ksc_original_config", config)
    object.__setattr__(model, "_ksc_scalify_calls", [call])
    object.__setattr__(model, "_ksc_keras_quantize", model.__dict__.get("quantize"))
    object.__setattr__(model, "__class__", _scalified_class(type(model), _is_graph_model(model)))
    object.__setattr__(model, "quantize", functools.partial(ScalifiedModel.quantize, model))


def detach(model):
    """The root's own class again (`unscalify`)."""
    if not isinstance(model, ScalifiedModel):
        return
    object.__setattr__(model, "__class__", type(model)._ksc_original_class)
    keras_quantize = model.__dict__.pop("_ksc_keras_quantize")
    if keras_quantize is None:
        object.__delattr__(model, "quantize")
    else:
        object.__setattr__(model, "quantize", keras_quantize)
    object.__delattr__(model, "_ksc_original_config")
    object.__delattr__(model, "_ksc_scalify_calls")


def _scalified_class(cls, graph):
    if cls not in _CLASSES:
        new = type(
            cls.__name__,
            (ScalifiedGraph if graph else ScalifiedModel, cls),
            {
                "__module__": __name__,
                "__qualname__": cls.__qualname__,
                "_ksc_original_class": cls,
            },
        )
        # Every such class is registered under one name; `from_config`
        # does not depend on which one the registry holds.
        package, name = REGISTERED_NAME.split(">")
        keras.saving.register_keras_serializable(package=package, name=name)(new)
        _CLASSES[cls] = new
    return _CLASSES[cls]


def _serialize_dtype(dtype):
    if dtype is None or isinstance(dtype, str):
        return dtype
    return keras.saving.serialize_keras_object(dtype)


def _deserialize_dtype(config):
    if config is None or isinstance(config, str):
        return config
    return keras.saving.deserialize_keras_object(config)


def _serialize_exclude(entry):
    if isinstance(entry, str):
        return entry
    if isinstance(entry, type):
        return {"module": entry.__module__, "class_name": entry.__qualname__}
    raise TypeError(
        f"`exclude` entries must be layer names or classes, got {entry!r}."
    )


def _deserialize_exclude(entry):
    if isinstance(entry, str):
        return entry
    obj = importlib.import_module(entry["module"])
    for part in entry["class_name"].split("."):
        obj = getattr(obj, part)
    return obj
