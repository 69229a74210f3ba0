"""Measuring a scaled model: `measure`, one record of `ScaleMonitor`.

The stats (`ksc.debug.stats`) of each scaled layer's weights, and with a
sample of its activations and gradients, as columns
`"<layer path>/<item>/<stat>"`; under JAX and TensorFlow one compiled
function per model and formats.
"""

import keras
import numpy as np
from keras import ops

from keras_scalify.backend import value_and_grad
from keras_scalify.callbacks.capture import _capturing
from keras_scalify.callbacks.capture import _no_grad
from keras_scalify.callbacks.capture import scaled_layers
from keras_scalify.core import pow2
from keras_scalify.core.formats import get_format
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.debug import stats
from keras_scalify.layers.base import TENSOR_KWARGS
from keras_scalify.layers.plain_io import _is_float_tensor
from keras_scalify.layers.variable import effective_grad_scale
from keras_scalify.layers.variable import read_tensor
from keras_scalify.ops.boundary import encode

# The columns of each layer (see `ScaleMonitor`): `<layer path>/<item>/<stat>`.
STATS = ("scale_exp", "rms", "underflow", "saturation")
# Weights read by a GEMM (measured in the matmul format); other weights
# (bias, gamma, beta) in the data format.
GEMM_WEIGHTS = ("kernel", "embeddings", "reverse_embeddings")
FORMAT_KEYS = ("matmul", "grad", "data")

_STAT_KEYS = {
    "scale_exp": "scale_exponent",
    "rms": "data_rms",
    "underflow": "underflow_fraction",
    "saturation": "saturation_fraction",
}


def layer_key(layer):
    """The name a layer's columns start with: its path (its name if it
    has none)."""
    return getattr(layer, "path", None) or layer.name


def _to_float(x):
    return float(np.asarray(ops.convert_to_numpy(x)))


def _stat_row(prefix, s):
    return {f"{prefix}/{k}": s[v] for k, v in _STAT_KEYS.items()}


def _first_input(args, kwargs):
    if args:
        return args[0]
    for k in TENSOR_KWARGS:
        if k in kwargs:
            return kwargs[k]
    return None


def _formats_of(layer, formats):
    """The (matmul, grad, data) formats of `layer`: `formats` where given,
    else its policy's."""
    return (
        formats.get("matmul") or layer.policy_dtype("matmul_dtype"),
        formats.get("grad") or layer.policy_dtype("grad_dtype"),
        formats.get("data") or layer.compute_dtype,
    )


def _item_name(kind, k):
    return kind if k == 0 else f"{kind}{k}"


def measure(model, formats=None, sample=None, loss=None, _cache=None):
    """One record of what `ScaleMonitor` watches, from `model`'s current
    weights (and a forward/backward pass on `sample`), as a dict of Python
    floats `{"<layer path>/<item>/<stat>": value}`. See `ScaleMonitor`.

    Under JAX the measurement is one compiled function of the model's
    variable values (`keras.StatelessScope`), under TensorFlow a
    `tf.function` reading the variables, cached in `_cache` (a dict) when
    given; under torch it runs eagerly."""
    formats = _check_formats(formats)
    x, y = _split_sample(sample) if sample is not None else (None, None)
    compile_ = {"jax": _jax_measure, "tensorflow": _tf_measure}.get(
        keras.backend.backend()
    )
    if compile_ is not None:
        key = (id(model), tuple(sorted(formats.items())), id(loss))
        fn = _cache.get(key) if _cache is not None else None
        if fn is None:
            fn = compile_(model, formats, loss)
            if _cache is not None:
                _cache[key] = fn
        row = fn(x, y)
    else:
        row = _measure_tensors(model, formats, x, y, loss)
    return {k: _to_float(v) for k, v in row.items()}


def _jax_measure(model, formats, loss):
    import jax

    variables = list(model.trainable_variables) + list(model.non_trainable_variables)

    keys = []  # the record's column order, set when `pure` is traced

    def pure(values, x, y):
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            row = _measure_tensors(model, formats, x, y, loss)
        keys[:] = list(row)
        return [row[k] for k in keys]

    jitted = jax.jit(pure)

    def run(x, y):
        values = jitted([v.value for v in variables], x, y)
        return dict(zip(keys, values))

    return run


def _tf_measure(model, formats, loss):
    import tensorflow as tf

    keys = []  # the record's column order, set when `pure` is traced

    def pure(x, y):
        row = _measure_tensors(model, formats, x, y, loss)
        keys[:] = list(row)
        return [row[k] for k in keys]

    compiled = tf.function(pure, reduce_retracing=True)

    def run(x, y):
        values = compiled(x, y)
        return dict(zip(keys, values))

    return run


def _measure_tensors(model, formats, x, y, loss):
    """`measure`'s record as a dict of scalar tensors."""
    row = {}
    for layer in scaled_layers(model):
        mm, _, data = _formats_of(layer, formats)
        key = layer_key(layer)
        for sv in layer.scaled_weights:
            fmt = mm if sv.name in GEMM_WEIGHTS else data
            s = stats(ScaledTensor(read_tensor(sv.data), read_tensor(sv.scale)), fmt)
            row.update(_stat_row(f"{key}/{sv.name}", s))
            gs = effective_grad_scale(read_tensor(sv.grad_scale), read_tensor(sv.scale))
            row[f"{key}/{sv.name}/grad_scale_exp"] = pow2.pow2_exponent(gs)
    if x is not None:
        row.update(_activation_stats(model, x, formats))
        if y is not None:
            row.update(_gradient_stats(model, x, y, formats, loss))
    return row


def _split_sample(sample):
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        return sample[0], sample[1]
    return sample, None


def _activation_stats(model, x, formats):
    """Stats of each scaled layer call's first input (matmul format) and
    first ScaledTensor output (data format), in inference mode."""
    row, calls = {}, {}

    def on_output(layer, args, kwargs, y):
        mm, _, data = _formats_of(layer, formats)
        key = layer_key(layer)
        k = calls[id(layer)] = calls.get(id(layer), -1) + 1
        first = _first_input(args, kwargs)
        if is_scaled(first) or _is_float_tensor(first):
            xin = first if is_scaled(first) else encode(first)
            row.update(_stat_row(f"{key}/{_item_name('input', k)}", stats(xin, mm)))
        row.update(_stat_row(f"{key}/{_item_name('output', k)}", stats(y, data)))
        return y

    with _no_grad(), _capturing(model, on_output):
        model(x, training=False)
    return row


def _loss_fn(model, loss):
    loss = loss if loss is not None else getattr(model, "loss", None)
    if loss is None or isinstance(loss, (dict, list, tuple)):
        raise ValueError(
            "ScaleMonitor needs a single loss to measure gradients on "
            "`sample=(x, y)`: pass `loss=` (the model's compiled loss is "
            f"{loss!r})."
        )
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    return lambda y, p: ops.mean(fn(y, p))


def _gradient_stats(model, x, y, formats, loss):
    """Stats of the cotangent reaching each scaled layer call's first
    ScaledTensor output (in data units, scale = its grad scale) in the
    grad format: the loss on `(x, y)` differentiated with respect to a
    zero added to that output's data."""
    fn = _loss_fn(model, loss)
    probes = []  # (layer, call index, grad scale, shape, dtype)
    calls = {}

    def find(layer, args, kwargs, y_):
        k = calls[id(layer)] = calls.get(id(layer), -1) + 1
        probes.append((layer, k, y_.grad_scale, tuple(y_.data.shape), y_.data.dtype))
        return y_

    with _no_grad(), _capturing(model, find):
        model(x, training=False)
    if not probes:
        return {}

    def objective(*zeros):
        it = iter(zeros)

        def add(layer, args, kwargs, y_):
            return ScaledTensor(y_.data + next(it), y_.scale, y_.grad_scale)

        with _capturing(model, add):
            pred = model(x, training=False)
        return fn(y, pred)

    zeros = [ops.zeros(p[3], keras.backend.standardize_dtype(p[4])) for p in probes]
    _, grads = value_and_grad(objective)(*zeros)
    row = {}
    for (layer, k, gs, _, _), g in zip(probes, grads):
        if g is None:
            continue
        _, gd, _ = _formats_of(layer, formats)
        s = stats(ScaledTensor(g, gs), gd)
        row.update(_stat_row(f"{layer_key(layer)}/{_item_name('grad', k)}", s))
    return row


def _check_formats(formats):
    if formats is None:
        return {}
    if not isinstance(formats, dict) or set(formats) - set(FORMAT_KEYS):
        raise ValueError(
            f"`formats` must be None or a dict with keys among {FORMAT_KEYS} "
            f"(dtype names, e.g. {{'matmul': 'float8_e4m3fn'}}), got {formats!r}."
        )
    out = {}
    for k, v in formats.items():
        if v is None:
            continue
        try:
            v = keras.backend.standardize_dtype(v)
            get_format(v)
        except Exception as e:
            raise ValueError(f"`formats[{k!r}]`: unknown format {v!r} ({e}).")
        out[k] = v
    return out
