"""In-place replacement of layers: how `scalify` and `unscalify` convert
every model.

Sequential/Functional models, keras-hub backbones and tasks, and any
custom layer hold Dense / EinsumDense / Embedding / normalization /
attention layers as sublayers (attributes, lists, Functional graphs).
`replace_layers(root, mapping)` puts each new layer wherever its old one
is referenced (`convert_in_place(root, choose)` chooses them first):

- attributes of every layer in the tree (on torch, Keras layers are torch
  modules and keep sublayers in `_modules`), lists, tuples and dicts held
  in them, and Keras's tracker (`_layers`, what `_flatten_layers`,
  `weights` and saving walk);
- the nodes of every Functional graph that calls the layer
  (`node.operation`, the graph's `_operations`, the history of the
  symbolic tensors it produced, the graph's node keys; a Sequential's
  own graph included), so a Backbone's graph calls the new layer, a model
  built later on its outputs finds it, and the new layer inherits the old
  one's nodes.

A layer used in several places (a tied embedding called by a backbone and
by its task's output projection) is converted once and stays shared. No
layer is rebuilt from its config: the classes, attributes and methods of
the containing layers (`generate()`, preprocessors, presets' `get_config`)
are kept.
"""

import warnings

import keras

from keras_scalify.backend import refresh_layer_params

# How deep `_swap` looks into containers held by a layer's attributes.
_MAX_DEPTH = 4


def walk_sublayers(root, visit):
    """Calls `visit(parent, child)` for every direct sublayer of every layer
    reached from `root`; `visit` returns True to descend into `child`."""
    seen = {id(root)}
    stack = [root]
    while stack:
        parent = stack.pop()
        for child in parent._flatten_layers(include_self=False, recursive=False):
            if id(child) in seen:
                continue
            seen.add(id(child))
            if visit(parent, child):
                stack.append(child)


def all_layers(root):
    """`root` and every layer reachable from it, once each."""
    return list(root._flatten_layers(include_self=True, recursive=True))


def convert_in_place(root, choose):
    """Replaces sublayers of `root` in place.

    `choose(layer)` returns a new layer to put in place of `layer`, None to
    descend into it (a composite), or False to leave it and its sublayers
    alone. Returns `{id(old): (old, new)}`.
    """
    mapping = {}

    def visit(parent, child):
        new = choose(child)
        if new is None:
            return True
        if new is not False and new is not child:
            mapping[id(child)] = (child, new)
        return False

    walk_sublayers(root, visit)
    if mapping:
        replace_layers(root, mapping)
    return mapping


def replace_layers(root, mapping):
    """Puts `new` wherever `old` is referenced in `root`'s layer tree, for
    every `(old, new)` of `mapping` (keyed by `id(old)`)."""
    parents = _with_sequential_graphs(all_layers(root))
    _check_graphs(root, parents, mapping)
    for parent in parents:
        tracker = getattr(parent, "_tracker", None)
        if tracker is not None and "layers" in tracker.config:
            for old, new in mapping.values():
                if tracker.is_in_store("layers", old):
                    if tracker.is_in_store("layers", new):
                        tracker.untrack(old)
                    else:
                        tracker.replace_tracked_value("layers", old, new)
        for name, value in list(vars(parent).items()):
            if name in ("_tracker", "_inbound_nodes", "_outbound_nodes"):
                continue
            swapped = _swap(value, mapping, 0)
            if swapped is not value:
                object.__setattr__(parent, name, swapped)
    for old, new in mapping.values():
        for node in old._inbound_nodes:
            if node.operation is old:
                node.operation = new
            for tensor in node.outputs:
                history = getattr(tensor, "_keras_history", None)
                if history is not None and history.operation is old:
                    tensor._keras_history = history._replace(operation=new)
        new._inbound_nodes = list(old._inbound_nodes)
        new._outbound_nodes = list(old._outbound_nodes)
    _rekey_graph_nodes(parents, mapping)
    for parent in parents:
        refresh_layer_params(parent)
    for old, _ in mapping.values():
        object.__setattr__(old, "call", _replaced(old))


def _with_sequential_graphs(layers):
    """`layers` and the Functional graph each Sequential among them runs
    (not a tracked sublayer: Keras rebuilds it from the layer list)."""
    graphs = [
        layer._functional
        for layer in layers
        if isinstance(layer, keras.Sequential) and layer._functional is not None
    ]
    return layers + graphs


def _rekey_graph_nodes(parents, mapping):
    """A Functional graph keeps the keys of its nodes (`_nodes`: the
    operation's id and the node's index, what its `get_config` looks up):
    the keys of a replaced layer's nodes name the new layer."""
    ids = {str(key): str(id(new)) for key, (_, new) in mapping.items()}
    for graph in parents:
        keys = getattr(graph, "_nodes", None)
        if not isinstance(keys, set):
            continue
        rekeyed = set()
        for key in keys:
            op, sep, index = key.partition("_ib-")
            rekeyed.add(ids.get(op, op) + sep + index)
        graph._nodes = rekeyed


def _check_graphs(root, parents, mapping):
    """Refuse to replace a layer that a graph outside `root` calls: that
    graph would call the new layer while tracking the old one's weights.
    (The layers a Sequential holds are exempt: Keras rebuilds its graph
    when it is built again, and the discarded graph's nodes stay on them,
    indistinguishable from another model's.)"""
    inside = {
        id(node)
        for layer in parents
        for nodes in getattr(layer, "_nodes_by_depth", {}).values()
        for node in nodes
    }
    in_sequential = {
        id(layer)
        for parent in parents
        if isinstance(parent, keras.Sequential)
        for layer in parent._layers
    }
    for old, _ in mapping.values():
        if id(old) in in_sequential:
            continue
        if any(id(node) not in inside for node in old._inbound_nodes):
            raise ValueError(
                f"Layer {old.name!r} is also called by a model outside "
                f"{root.name!r} (e.g. a task model around this backbone): "
                f"convert the outermost model instead."
            )


def _replaced(old):
    """The `call` of a layer replaced in place: an error, not stale
    values, if anything still calls it."""

    def call(*args, **kwargs):
        raise RuntimeError(
            f"Layer {old.name!r} was replaced in place by `scalify` / "
            f"`unscalify`; call the model it belonged to (the layer now in "
            f"its place is the one to use)."
        )

    return call


def _swap(value, mapping, depth):
    """`value` with layers of `mapping` replaced (containers in place)."""
    if isinstance(value, keras.layers.Layer):
        item = mapping.get(id(value))
        return value if item is None else item[1]
    if depth >= _MAX_DEPTH:
        return value
    if isinstance(value, (list, dict)):
        items = enumerate(value) if isinstance(value, list) else value.items()
        for k, v in list(items):
            s = _swap(v, mapping, depth + 1)
            if s is not v:
                _set_item(value, k, s)
        return value
    if isinstance(value, tuple):
        items = [_swap(v, mapping, depth + 1) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    return value


def _set_item(container, key, value):
    """`container[key] = value` without Keras's tracking (the tracker was
    updated already, and is locked once a layer is built). TensorFlow's
    own list/dict wrappers keep their items elsewhere: plain assignment."""
    if type(container) in (list, dict) or type(container).__module__.startswith(
        "keras."
    ):
        base = list if isinstance(container, list) else dict
        base.__setitem__(container, key, value)
    else:
        container[key] = value


def warn_unconverted(layer, error):
    """A layer `scalify` could not convert stays plain: say so."""
    warnings.warn(
        f"scalify: layer {layer.name!r} ({type(layer).__name__}) is kept as "
        f"a plain Keras layer: {error}",
        stacklevel=3,
    )
