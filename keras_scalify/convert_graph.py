"""Walking and rebuilding a plain Sequential/Functional model's graph.

The machinery behind `scalify`/`unscalify` (`convert.py`) for a plain
Sequential or Functional model: `_rebuild` walks its graph node by node
(`_Walker`), calling a conversion step (`make_step`) on each layer call,
and builds a new model of the same kind from the results; plus the checks
and finishing touches (recompiling, with a `ScaledOptimizer` when the new
model has scaled weights) shared with in-place conversion.

Rebuilding walks the model's graph rather than using
`keras.models.clone_model`: Keras records a layer's outputs as a flat list
of tensors, so a ScaledTensor (a named tuple) returned for a single plain
output would be cut to its `data` by `clone_model`'s bookkeeping.
"""

import keras
from keras import tree

from keras_scalify import models
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.core.scaled_tensor import map_scaled
from keras_scalify.optimizers import ScaledOptimizer
from keras_scalify.optimizers.guard import scaled_variables_in


def _is_graph_model(model):
    """A plain Sequential or Functional model (not a subclass): its graph is
    rebuilt by `scalify`. Every other model is converted in place."""
    from keras.src.models.functional import Functional

    cls = getattr(type(model), "_ksc_original_class", type(model))
    return cls in (keras.Sequential, keras.Model, Functional) and (
        isinstance(model, keras.Sequential) or hasattr(model, "_nodes_by_depth")
    )


# --- graph walking -----------------------------------------------------------


def _is_symbolic_scaled(x):
    return is_scaled(x) and isinstance(x.data, keras.KerasTensor)


def _scaled_units(model):
    """`{id(data): (id(scale), id(grad_scale))}` for every ScaledTensor of
    KerasTensors that the model's layers receive or the model returns."""
    units = {}

    def scan(x):
        if _is_symbolic_scaled(x):
            units[id(x.data)] = (id(x.scale), id(x.grad_scale))
        elif isinstance(x, dict):
            for v in x.values():
                scan(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                scan(v)

    for nodes in model._nodes_by_depth.values():
        for node in nodes:
            scan(node.arguments.args)
            scan(node.arguments.kwargs)
    scan(model._outputs_struct)
    return units


def _group_outputs(leaves, units):
    """Groups a node's flat output tensors into units: a ScaledTensor's
    three leaves (data first) or a single tensor. Returns `[(id, n)]`."""
    out, i = [], 0
    while i < len(leaves):
        key = id(leaves[i])
        if key in units and i + 2 < len(leaves) and units[key] == (
            id(leaves[i + 1]),
            id(leaves[i + 2]),
        ):
            out.append((key, 3))
            i += 3
        else:
            out.append((key, 1))
            i += 1
    return out


def _unit_leaves(x):
    """Flattens `x` with ScaledTensors kept whole."""
    if is_scaled(x):
        return [x]
    if isinstance(x, dict):
        return [u for k in sorted(x) for u in _unit_leaves(x[k])]
    if isinstance(x, (list, tuple)):
        return [u for v in x for u in _unit_leaves(v)]
    return [x]


class _Walker:
    """Rebuilds a Functional model, one node at a time.

    `values` maps the id of an original tensor (of a ScaledTensor's data
    for a scaled unit) to its new value, a tensor or a ScaledTensor.
    `step(layer, args, kwargs)` returns the new outputs of one node.
    """

    def __init__(self, step):
        self.step = step
        # ids of the scale / grad-scale tensors of scaled units already
        # computed (the unit itself is stored under its data's id).
        self.covered = set()

    def fill(self, structure, values, to_plain=None):
        """`structure` with the original tensors replaced by new values.
        With `to_plain`, a new ScaledTensor standing for an originally
        plain tensor is passed through it (for unconverted consumers);
        arguments that were ScaledTensors already stay scaled."""

        def lookup(x):
            if is_scaled(x) and all(v is None for v in x):
                # Keras fills `<arg>_mask` kwargs by mapping `get_keras_mask`
                # over each tensor argument: for a ScaledTensor argument the
                # node records ScaledTensor(None, None, None), i.e. no mask.
                return None
            if _is_symbolic_scaled(x):
                return values[id(x.data)]
            if isinstance(x, keras.KerasTensor):
                value = values[id(x)]
                if to_plain is not None and is_scaled(value):
                    value = to_plain(value)
                return value
            return x

        return map_scaled(lookup, structure)

    def run(self, model, new_inputs):
        units = _scaled_units(model)
        values = {}
        for old, new in zip(model.inputs, tree.flatten(new_inputs)):
            values[id(old)] = new
        for depth in sorted(model._nodes_by_depth, reverse=True):
            for node in model._nodes_by_depth[depth]:
                if not node.operation or node.is_input:
                    continue
                if any(
                    id(x) not in values and id(x) not in self.covered
                    for x in node.input_tensors
                ):
                    continue  # Not computable from the inputs.
                to_plain = self.step.to_plain_for(node.operation)
                args = self.fill(node.arguments.args, values, to_plain)
                kwargs = self.fill(node.arguments.kwargs, values, to_plain)
                outputs = self.step(node.operation, args, kwargs)
                self._store(node, outputs, units, values)
        return self.fill(model._outputs_struct, values)

    def _store(self, node, outputs, units, values):
        groups = _group_outputs(node.outputs, units)
        new_units = _unit_leaves(outputs)
        if len(groups) == len(new_units):
            for (key, n), new in zip(groups, new_units):
                values[key] = new
                if n == 3:
                    self.covered.update(units[key])
            return
        flat = tree.flatten(outputs)
        if len(flat) == len(node.outputs):
            for old, new in zip(node.outputs, flat):
                values[id(old)] = new
            return
        raise ValueError(
            f"Layer {node.operation.name!r} returned {len(new_units)} "
            f"outputs where the original returned {len(groups)}."
        )


# --- shared helpers ----------------------------------------------------------


class _Names:
    """Unique layer names in the new model."""

    def __init__(self, model):
        self.used = {layer.name for layer in _all_layers(model)}

    def __call__(self, base):
        name, i = base, 1
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name


def _all_layers(model):
    return list(model._flatten_layers(include_self=False, recursive=True))


def _model_input_struct(model):
    return tree.map_structure(
        lambda x: keras.Input(batch_shape=x.shape, dtype=x.dtype, name=x.name),
        model._inputs_struct,
    )


def _finish(model, new):
    if getattr(model, "compiled", False):
        config = model.get_compile_config()
        config["optimizer"] = _scaled_optimizer_config(config.get("optimizer"), new)
        new.compile_from_config(config)
    return new


def _scaled_optimizer_config(config, model):
    """A plain optimizer's config, wrapped in a `ScaledOptimizer` when
    `model` has scaled weights (a plain optimizer cannot train them)."""
    if config is None or not scaled_variables_in(model.trainable_variables):
        return config
    optimizer = keras.saving.deserialize_keras_object(config)
    if isinstance(optimizer, ScaledOptimizer):
        return config
    return keras.saving.serialize_keras_object(ScaledOptimizer(optimizer))


def _sequential_graph(model):
    """The Functional graph Keras keeps for a built Sequential `model`."""
    graph = getattr(model, "_functional", None)
    if graph is None:
        raise ValueError(
            f"`model` {model.name!r} is a Sequential model without an input "
            f"shape: build it (start it with `keras.Input(...)` or call it on "
            f"data) before converting it."
        )
    return graph


def _check_model(model, fn_name):
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` of {fn_name} must be a keras.Model, got "
            f"{type(model).__name__}."
        )
    if not model.built:
        raise ValueError(
            f"`model` {model.name!r} of {fn_name} must be built: build it by "
            f"calling it on data (or start a Sequential with "
            f"`keras.Input(...)`) first."
        )


def _rebuild(model, make_step, fn_name, scalify_args=None):
    """Sequential → Sequential, Functional → Functional, via `make_step`;
    with `scalify_args` (`dtype, exclude`), the new model's root becomes a
    `ScalifiedModel` of `model` (`models.attach`)."""
    _check_model(model, fn_name)
    names = _Names(model)
    sequential = isinstance(model, keras.Sequential)
    graph = _sequential_graph(model) if sequential else model
    new_inputs = _model_input_struct(graph)
    called = [] if sequential else None  # Sequential: layers in call order.
    step = make_step(names, called)
    outputs = step.finish(_Walker(step).run(graph, new_inputs))
    if sequential:
        new = keras.Sequential([new_inputs] + called, name=model.name)
    else:
        new = keras.Model(new_inputs, outputs, name=model.name)
    if scalify_args is not None:
        models.attach(new, *scalify_args, original=model)
    return _finish(model, new)
