"""`keras_scalify.ops` on symbolic inputs (`keras.Input`, Functional API).

Called with a `keras.KerasTensor` anywhere among its arguments (a plain
one, or inside a ScaledTensor or a list), a `keras_scalify.ops` function
runs as a Keras `Operation` node, as `keras.ops` functions do: its output
(a ScaledTensor of KerasTensors, or a KerasTensor) is computed by tracing
the function (`Operation.compute_output_spec`), and the node is replayed
on data when the Functional model runs. `ScaledOperation` is serializable,
so such models save and load.
"""

import functools

import keras

from keras_scalify import ops as sops
from keras_scalify.core.scaled_tensor import ScaledTensor


_KERAS_TENSOR = keras.KerasTensor
_NESTED = (ScaledTensor, list, tuple)


def _symbolic(x, depth=0):
    """Whether `x` is a KerasTensor, or holds one within two levels of
    ScaledTensors, lists and tuples."""
    if isinstance(x, _KERAS_TENSOR):
        return True
    t = type(x)
    if t is ScaledTensor:  # (the usual case first: three tensors)
        a, b, c = x
        if not (type(a) in _NESTED or type(b) in _NESTED or type(c) in _NESTED):
            return isinstance(a, _KERAS_TENSOR) or isinstance(b, _KERAS_TENSOR) or isinstance(c, _KERAS_TENSOR)
    if depth < 2 and (t is ScaledTensor or t in (list, tuple)):
        return any(_symbolic(v, depth + 1) for v in x)
    return False


def _has_symbolic(args, kwargs):
    for a in args:
        if _symbolic(a):
            return True
    for v in kwargs.values():
        if _symbolic(v):
            return True
    return False


def _is_leaf(x):
    return isinstance(x, keras.KerasTensor) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, str)
    )


def _flatten(value, leaves):
    """`value` as a JSON-able template; its tensors appended to `leaves`.
    A ScaledTensor's three fields stay together (`{"scaled": [i, j, k]}`)."""
    if type(value) is ScaledTensor:
        start = len(leaves)
        leaves.extend(value)
        return {"scaled": [start, start + 1, start + 2]}
    if _is_leaf(value):
        leaves.append(value)
        return {"leaf": len(leaves) - 1}
    if type(value) in (list, tuple):
        return {type(value).__name__: [_flatten(v, leaves) for v in value]}
    if isinstance(value, dict):
        return {"dict": {k: _flatten(v, leaves) for k, v in value.items()}}
    return {"const": value}


def _unflatten(template, leaves):
    (kind, body), = template.items()
    if kind == "scaled":
        return ScaledTensor(*[leaves[i] for i in body])
    if kind == "leaf":
        return leaves[body]
    if kind in ("list", "tuple"):
        items = [_unflatten(t, leaves) for t in body]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _unflatten(t, leaves) for k, t in body.items()}
    return body


def _repack(x):
    """A symbolic output flattened to `[data, scale, grad_scale]` (Keras
    turns named tuples into lists) as a ScaledTensor again."""
    if type(x) in (list, tuple) and len(x) == 3:
        data, scale, grad_scale = x
        if all(isinstance(v, keras.KerasTensor) for v in x) and all(
            tuple(v.shape) == () and v.dtype == "float32"
            for v in (scale, grad_scale)
        ):
            return ScaledTensor(data, scale, grad_scale)
    return x


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledOperation(keras.Operation):
    """The node of a `keras_scalify.ops` function in a Functional graph."""

    def __init__(self, function, arguments, name=None):
        super().__init__(name=name)
        self.function = function
        # `{"args": [...], "kwargs": {...}}` templates over the tensors the
        # node is called on (see `_flatten`).
        self.arguments = arguments

    def call(self, *leaves):
        args = _unflatten(self.arguments["args"], leaves)
        kwargs = _unflatten(self.arguments["kwargs"], leaves)
        return getattr(sops, self.function)(*args, **kwargs)

    def get_config(self):
        return {
            "function": self.function,
            "arguments": self.arguments,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def symbolic_aware(fn):
    """`fn` (a `keras_scalify.ops` function), run as a `ScaledOperation`
    when called on symbolic tensors."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _has_symbolic(args, kwargs):
            leaves = []
            arguments = {
                "args": _flatten(tuple(args), leaves),
                "kwargs": _flatten(dict(kwargs), leaves),
            }
            return _repack(ScaledOperation(fn.__name__, arguments)(*leaves))
        return fn(*args, **kwargs)

    wrapper._keras_scalify_symbolic = True
    return wrapper
