"""The weights of a layer or model as its plain Keras twin lists them:
each ScaledVariable once (its represented value), the delayed-rescaling
states (bookkeeping) left out; and the weight that holds such a state."""

import keras
import numpy as np

from keras_scalify.backend import host_readable

# The delayed-rescaling states a scaled layer may hold (bookkeeping, not
# weights of the Keras counterpart).
STATE_ATTRS = ("grad_scale_state", "plain_io_grad_scale_state")


def weight_groups(root):
    """`root.weights` (a layer or a model) as its Keras twin lists them:
    each ScaledVariable once, in place of its three parts, and the
    delayed-rescaling states (bookkeeping) left out."""
    skip = set()
    for layer in root._flatten_layers(include_self=True, recursive=True):
        for attr in STATE_ATTRS:
            state = getattr(layer, attr, None)
            if state is not None:
                skip.add(id(state))
    seen, out = set(), []
    for v in root.weights:
        if id(v) in skip:
            continue
        item = getattr(v, "_ksc_scaled_variable", None) or v
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out


def assign_weights(root, weights):
    """`set_weights(weights)` of `root`'s Keras twin (`weight_groups`
    order): a scaled weight's value is split into data and pow2 scale."""
    groups = weight_groups(root)
    if len(weights) != len(groups):
        raise ValueError(
            f"`weights` must have {len(groups)} arrays for {root.name!r} "
            f"(its Keras twin's `get_weights()`), got {len(weights)}."
        )
    for item, value in zip(groups, weights):
        if tuple(item.shape) != tuple(np.shape(value)):
            path = item.data.path if hasattr(item, "data") else item.path
            raise ValueError(
                f"`weights` entry for {path!r} must have shape "
                f"{tuple(item.shape)}, got {tuple(np.shape(value))}."
            )
    for item, value in zip(groups, weights):
        item.assign(value)


def count_weight_params(root):
    """`count_params()` of `root`'s Keras twin: a scaled weight counts its
    data's size; scales, gradient scales and rescaling states are
    bookkeeping and not counted."""
    return int(sum(np.prod(w.shape) for w in weight_groups(root)))


def weight_values(root):
    """`get_weights()` of `root`'s Keras twin (`weight_groups` order): a
    scaled weight's represented float32 value. Device tensors of the same
    values where a process cannot read them into NumPy (a weight sharded
    across the processes of a `keras.distribution`)."""
    values = [w.value for w in weight_groups(root)]
    if all(host_readable(v) for v in values):
        return [np.asarray(keras.ops.convert_to_numpy(v)) for v in values]
    return values


def add_grad_scale_state(layer, name="grad_scale_state"):
    """The float32 state of a delayed gradient rescale: trainable with
    `overwrite_with_gradient`, the only route out of the backward pass that
    survives JAX's stateless `fit` (docs/design.md §3)."""
    return layer.add_weight(
        name=name,
        shape=(),
        initializer="zeros",
        dtype="float32",
        trainable=True,
        autocast=False,
        overwrite_with_gradient=True,
    )
