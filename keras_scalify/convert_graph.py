"""Running and rebuilding a Sequential/Functional model's graph.

`_Walker` walks a graph node by node, keeping each ScaledTensor whole:
Keras's own `Functional` bookkeeping records a layer's outputs as a flat
list of tensors, so a ScaledTensor (a named tuple of three tensors)
returned where the graph recorded one plain output would be cut to its
`data`. Two uses:

- `call_graph`: the forward pass of a Sequential/Functional model that
  `scalify` converted in place (`models.ScalifiedGraph.call`): scaled
  layers receive ScaledTensors whole, every other operation their
  represented values, and the model returns plain arrays;
- `_rebuild`: `unscalify` of a graph built by hand from scaled layers and
  boundary layers, whose nodes record ScaledTensors: a new plain model.

Plus the checks and finishing touches (recompiling, with a
`ScaledOptimizer` when the model has scaled weights) that `scalify` and
`unscalify` share.
"""

import keras
from keras import tree

from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.core.scaled_tensor import map_scaled
from keras_scalify.ops.boundary import to_array
from keras_scalify.ops.symbolic import ScaledOperation
from keras_scalify.optimizers import ScaledOptimizer
from keras_scalify.optimizers.guard import scaled_variables_in


def _is_graph_model(model):
    """A plain Sequential or Functional model (not a subclass): `scalify`
    converts its own layers to scaled mode and runs its graph itself
    (`call_graph`); inside every other model, layers take plain I/O."""
    from keras.src.models.functional import Functional

    cls = getattr(type(model), "_ksc_original_class", type(model))
    return cls in (keras.Sequential, keras.Model, Functional) and (
        isinstance(model, keras.Sequential) or hasattr(model, "_nodes_by_depth")
    )


# --- graph walking -----------------------------------------------------------


def _is_symbolic_scaled(x):
    return is_scaled(x) and isinstance(x.data, keras.KerasTensor)


def graph_of(model):
    """The Functional graph that runs `model` (a Sequential's own)."""
    return _sequential_graph(model) if isinstance(model, keras.Sequential) else model


def records_scaled(graph):
    """Whether `graph` (built by hand from scaled layers) records
    ScaledTensors between its nodes."""
    return bool(_scaled_units(graph))


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
    """Runs a Functional graph one node at a time (to call it, or, on
    KerasTensors, to rebuild it).

    `values` maps the id of an original tensor (of a ScaledTensor's data
    for a scaled unit) to its new value, a tensor or a ScaledTensor.
    `step(layer, args, kwargs)` returns the new outputs of one node.
    """

    def __init__(self, step, units=None):
        self.step = step
        # `_scaled_units` of the graph (computed per run when not given).
        self.units = units

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
        units = _scaled_units(model) if self.units is None else self.units
        # ids of the scale / grad-scale tensors of scaled units already
        # computed (the unit itself is stored under its data's id).
        covered = set()
        values = {}
        for old, new in zip(model.inputs, tree.flatten(new_inputs)):
            values[id(old)] = new
        for depth in sorted(model._nodes_by_depth, reverse=True):
            for node in model._nodes_by_depth[depth]:
                if not node.operation or node.is_input:
                    continue
                if any(
                    id(x) not in values and id(x) not in covered
                    for x in node.input_tensors
                ):
                    continue  # Not computable from the inputs.
                to_plain = self.step.to_plain_for(node.operation)
                args = self.fill(node.arguments.args, values, to_plain)
                kwargs = self.fill(node.arguments.kwargs, values, to_plain)
                outputs = self.step(node.operation, args, kwargs)
                self._store(node, outputs, units, values, covered)
        return self.fill(model._outputs_struct, values)

    def _store(self, node, outputs, units, values, covered):
        groups = _group_outputs(node.outputs, units)
        new_units = _unit_leaves(outputs)
        if len(groups) == len(new_units):
            for (key, n), new in zip(groups, new_units):
                values[key] = new
                if n == 3:
                    covered.update(units[key])
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


def _rebuild(model, make_step, fn_name):
    """Sequential → Sequential, Functional → Functional, via `make_step`."""
    _check_model(model, fn_name)
    sequential = isinstance(model, keras.Sequential)
    graph = graph_of(model)
    new_inputs = _model_input_struct(graph)
    called = [] if sequential else None  # Sequential: layers in call order.
    step = make_step(called)
    outputs = step.finish(_Walker(step).run(graph, new_inputs))
    if sequential:
        new = keras.Sequential([new_inputs] + called, name=model.name)
    else:
        new = keras.Model(new_inputs, outputs, name=model.name)
    return _finish(model, new)


# --- the forward pass of a graph converted in place --------------------------


def takes_scaled(operation):
    """Whether a graph node's operation computes on ScaledTensors: a scaled
    layer in scaled mode or a `keras_scalify.ops` node."""
    if isinstance(operation, ScaledOperation):
        return True
    return hasattr(operation, "_scaled_weights") and not operation.plain_io


def _represented(x):
    return to_array(x) if is_scaled(x) else x


class _CallStep:
    """One node of `call_graph`: a scaled layer gets ScaledTensors whole,
    every other operation (plain layers, nested models, `keras.ops`
    nodes) the represented float32 values. `context`: the call-context
    arguments (`training`, ...) passed to the operations that take them,
    as Keras's Functional does."""

    def __init__(self, context):
        self.context = context

    def to_plain_for(self, operation):
        return None if takes_scaled(operation) else _represented

    def __call__(self, operation, args, kwargs):
        takes = getattr(operation, "_call_context_args", ())
        for name, value in self.context.items():
            if name in takes and value is not None:
                kwargs[name] = value
        return operation(*args, **kwargs)


def call_graph(graph, inputs, **context):
    """`graph`'s outputs on `inputs` (flat, in `graph.inputs` order), with
    ScaledTensors kept whole between its nodes and decoded on the outputs
    (`data * scale` in float32). `context`: `training` and Keras's other
    call-context arguments."""
    units = getattr(graph, "_ksc_units", None)
    if units is None:  # the graph is fixed once converted: found once
        units = _scaled_units(graph)
        object.__setattr__(graph, "_ksc_units", units)
    outputs = _Walker(_CallStep(context), units).run(graph, inputs)
    return map_scaled(_represented, outputs)
