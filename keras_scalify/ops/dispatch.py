"""`keras.ops` on ScaledTensors: a scale rule where one exists, else plain.

Keras code — custom layers, keras-hub blocks, `Lambda` layers, Keras's own
layers — calls `keras.ops` functions, which know nothing of ScaledTensors
(a named tuple would be packed into one array of three). When the
process makes its first ScaledTensor (not at import: `import keras_scalify`
leaves `keras.ops` as it is), keras_scalify wraps the public functions of
`keras.ops` (and of the `keras.src.ops` namespace Keras's own layers use)
so that a call with a ScaledTensor among its arguments (directly, or in a
list/tuple/dict argument):

- goes to the `keras_scalify.ops` function of the same name when there is
  one and the call's arguments fit its signature (`add`, `multiply`,
  `matmul`, `einsum`, `softmax`, `where`, `reshape`, `transpose`, `take`,
  `mean`, `cast`, `gelu`, `silu`, `tanh`, ... — each states its rule), and
  returns a ScaledTensor;
- otherwise decodes every ScaledTensor argument with `to_array` (float32
  values, gradients in true units: grad-scale aware) and calls the original
  function, so any Keras code is correct and only loses scaling where no
  rule exists.

A call without ScaledTensor arguments goes straight to the original
function: unrelated Keras code computes exactly as before (the cost is one
scan of the positional arguments). `ScaledTensor[...]` with a slice,
`...`, `None`, a tuple of those or an index tensor indexes the data (scale
unchanged); an int index keeps its tuple meaning (fields), since pytree
libraries rely on it. `uninstall_ops_dispatch()` puts every original
function back.
"""

import contextlib
import importlib
import inspect
import types

from keras_scalify import ops as sops
from keras_scalify.core.scaled_tensor import ON_FIRST_SCALED_TENSOR
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import map_scaled
from keras_scalify.ops.boundary import to_array

# The namespaces whose functions are wrapped: the public API modules and
# the package namespace Keras's own layers call (`from keras.src import ops`).
_MODULES = (
    "keras.ops",
    "keras.ops.numpy",
    "keras.ops.nn",
    "keras.ops.math",
    "keras.ops.linalg",
    "keras.ops.core",
    "keras.src.ops",
)

# Functions that never see a ScaledTensor as data (control flow and
# structure utilities take user functions and nested structures).
_SKIP = {
    "cond",
    "while_loop",
    "fori_loop",
    "scan",
    "associative_scan",
    "map",
    "switch",
    "vectorized_map",
    "custom_gradient",
    "stop_gradient",
    "is_tensor",
    "dtype",
    "convert_to_numpy",
}

_patched = []  # (module, name, original)


def _scaled_in(a):
    if type(a) is ScaledTensor:
        return True
    if type(a) in (list, tuple):
        return any(type(v) is ScaledTensor for v in a)
    if type(a) is dict:
        return any(type(v) is ScaledTensor for v in a.values())
    return False


def _has_scaled(args, kwargs):
    for a in args:
        if _scaled_in(a):
            return True
    if kwargs:
        for v in kwargs.values():
            if _scaled_in(v):
                return True
    return False


def _decode(x):
    """`x` with every ScaledTensor decoded (`to_array`)."""
    return map_scaled(lambda v: to_array(v) if type(v) is ScaledTensor else v, x)


def _shape(x):
    """`keras.ops.shape` of a ScaledTensor: its data's."""
    from keras import ops

    return ops.shape(x.data)


def _zeros_like(x, dtype=None):
    """Zeros of the data's shape (a plain tensor: no value to scale)."""
    from keras import ops

    return ops.zeros_like(x.data, dtype=dtype)


def _ones_like(x, dtype=None):
    """Ones of the data's shape (a plain tensor)."""
    from keras import ops

    return ops.ones_like(x.data, dtype=dtype)


# Rules beyond the same-named `keras_scalify.ops` functions.
_EXTRA_RULES = {"shape": _shape, "zeros_like": _zeros_like, "ones_like": _ones_like}


def _rule(name):
    if name in _EXTRA_RULES:
        return _EXTRA_RULES[name]
    fn = getattr(sops, name, None)
    if not callable(fn) or isinstance(fn, types.ModuleType):
        return None
    if name in ("as_scaled", "to_array"):
        return None
    return fn


def _rule_arguments(signature, rule_params, args, kwargs):
    """The call's arguments by name (bound to the original function's
    signature), or None when one of them is not a parameter of the rule:
    `layer_normalization(x, gamma)` must not bind `gamma` to the rule's
    `axis`."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    if not set(bound.arguments) <= rule_params:
        return None
    return bound


# Open `record_dispatch()` contexts: each counts rule / fallback calls.
_RECORDERS = []


def _record(kind, name):
    for counts in _RECORDERS:
        counts[kind][name] = counts[kind].get(name, 0) + 1


@contextlib.contextmanager
def record_dispatch():
    """Counts, while open, the `keras.ops` calls on ScaledTensors by name:
    `{"rule": {name: n}, "fallback": {name: n}}` (fallback: computed on
    decoded values, so the scale is not propagated through that op)."""
    counts = {"rule": {}, "fallback": {}}
    _RECORDERS.append(counts)
    try:
        yield counts
    finally:
        _RECORDERS.remove(counts)


# Weight reads of custom layers' own kernels (`layers/own_weights.py`):
# id(read) -> (read, contract). While registered, a `keras.ops.einsum` or
# `matmul` with one as an operand runs `contract(subscripts_or_none,
# operands, index)` (the layer policy's GEMM) instead of the rule.
_WEIGHT_READS = {}
_CONTRACTIONS = ("einsum", "matmul")


@contextlib.contextmanager
def weight_reads(pairs):
    """Registers `(read, contract)` pairs while open (see above)."""
    for read, contract in pairs:
        _WEIGHT_READS[id(read)] = (read, contract)
    try:
        yield
    finally:
        for read, _ in pairs:
            _WEIGHT_READS.pop(id(read), None)


# Open `record_contractions()` lists.
_CONTRACTION_RECORDERS = []


@contextlib.contextmanager
def record_contractions():
    """Records, while open, every `keras.ops.einsum` / `matmul` call as
    `(name, args, contract)`: `contract` is the registered weight read's
    (see `weight_reads`) among its operands, else None."""
    calls = []
    _CONTRACTION_RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _CONTRACTION_RECORDERS.remove(calls)


def _record_contraction(name, args):
    operands = args[1:] if name == "einsum" else args
    entry = next(
        (_WEIGHT_READS[id(x)] for x in operands if id(x) in _WEIGHT_READS),
        None,
    )
    for calls in _CONTRACTION_RECORDERS:
        calls.append((name, args, None if entry is None else entry[1]))


def _weight_contraction(name, args, kwargs):
    """The registered `contract` of a weight operand of this call, or None
    (positional two-operand calls only)."""
    if kwargs:
        return None
    if name == "einsum":
        if len(args) != 3 or not isinstance(args[0], str):
            return None
        subscripts, operands = args[0], args[1:]
    elif len(args) == 2:
        subscripts, operands = None, args
    else:
        return None
    for i, x in enumerate(operands):
        entry = _WEIGHT_READS.get(id(x))
        if entry is not None and entry[0] is x:
            return entry[1](subscripts, operands, i)
    return None


def _make_wrapper(name, original):
    rule = _rule(name)
    signature = rule_params = None
    if rule is not None:
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):
            rule = None
        else:
            rule_params = set(inspect.signature(rule).parameters)

    def wrapper(*args, **kwargs):
        if _CONTRACTION_RECORDERS and name in _CONTRACTIONS:
            _record_contraction(name, args)
        if not _has_scaled(args, kwargs):
            return original(*args, **kwargs)
        if _WEIGHT_READS and name in _CONTRACTIONS:
            out = _weight_contraction(name, args, kwargs)
            if out is not None:
                return out
        if rule is not None:
            bound = _rule_arguments(signature, rule_params, args, kwargs)
            if bound is not None:
                if _RECORDERS:
                    _record("rule", name)
                return rule(*bound.args, **bound.kwargs)
        if _RECORDERS:
            _record("fallback", name)
        return original(*_decode(args), **_decode(kwargs))

    wrapper.__name__ = getattr(original, "__name__", name)
    wrapper.__qualname__ = getattr(original, "__qualname__", name)
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    wrapper._keras_scalify_dispatch = True
    return wrapper


def install_ops_dispatch():
    """Wrap the `keras.ops` functions (once; see the module docstring).
    Runs by itself when the first ScaledTensor is made; a Keras function
    that no ScaledTensor reaches computes as before, the wrapper calling
    it."""
    if _patched:
        return
    wrappers = {}
    for module_name in _MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, fn in list(vars(module).items()):
            if name.startswith("_") or name in _SKIP:
                continue
            if not isinstance(fn, types.FunctionType):
                continue
            if getattr(fn, "_keras_scalify_dispatch", False):
                continue
            if id(fn) not in wrappers:
                wrappers[id(fn)] = _make_wrapper(name, fn)
            _patched.append((module, name, fn))
            setattr(module, name, wrappers[id(fn)])


def dispatching(fn):
    """The dispatch wrapper of `fn` when `fn` is an original `keras.ops`
    function that is wrapped now, else None: Keras code that took a
    reference before `keras_scalify` was imported (a layer's `activation =
    ops.silu`) holds the original."""
    if not isinstance(fn, types.FunctionType):
        return None
    install_ops_dispatch()  # (a region may run before any ScaledTensor exists)
    for module, name, original in _patched:
        if original is fn:
            return getattr(module, name)
    return None


def uninstall_ops_dispatch():
    """Put every original `keras.ops` function back, until
    `install_ops_dispatch()` runs again: called by you, or by the next
    scaled region (a converted keras-hub block), whose Keras code needs it
    (`dispatching`)."""
    while _patched:
        module, name, original = _patched.pop()
        setattr(module, name, original)


def getitem(x, key):
    """`x[key]` of a ScaledTensor (not an int key): the data indexed, scale
    and grad scale unchanged (indexing does not change values)."""
    return ScaledTensor(x.data[key], x.scale, x.grad_scale)


ON_FIRST_SCALED_TENSOR.append(install_ops_dispatch)
