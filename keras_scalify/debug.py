"""Looking inside: statistics of ScaledTensors and of their gradients.

- `stats(x, dtype=None)`: data RMS, scale exponent, and the fractions of
  values that would underflow (|d| below half the smallest subnormal, so
  they round to 0) or saturate (|d| above max) in the format `dtype`
  (default: the data's own dtype).
- `scaled_value_and_grad(fn)`: gradients of `fn` with respect to its
  ScaledTensor arguments, returned as ScaledTensors
  `(cotangent_of_data, scale=grad_scale)`: `to_array` gives the true
  gradient, and `stats` shows how well it is scaled.
- `count_params(model)`: parameters counted as the Keras original counts
  them (a scaled weight by its data; scales and states are bookkeeping).
- `gemm_coverage(model, inputs)`: the share of a model's kernel GEMM FLOPs
  that run in scaled layers (and on an FP8 route), per layer.
"""

import contextlib

import numpy as np
from keras import ops

from keras_scalify import backend
from keras_scalify import layers as sl
from keras_scalify.core import pow2
from keras_scalify.core.formats import get_format
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.layers.weights import count_weight_params
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.own_weights import plain_kernel_owners
from keras_scalify.ops.boundary import to_array
from keras_scalify.ops.dispatch import record_contractions
from keras_scalify.ops.dispatch import record_dispatch


def stats(x, dtype=None):
    """A dict of float32 scalar tensors: `data_rms`, `scale_exponent`,
    `underflow_fraction`, `saturation_fraction`, `nonfinite_fraction`.

    A plain tensor counts as scale 1.
    """
    if not is_scaled(x):
        x = ScaledTensor(ops.convert_to_tensor(x), 1.0)
    fmt = get_format(dtype if dtype is not None else x.dtype)
    d = ops.cast(x.data, "float32")
    mag = ops.abs(d)
    finite = ops.isfinite(d)
    n = float(np.prod(x.shape)) if len(x.shape) else 1.0

    def frac(mask):
        return ops.sum(ops.cast(mask, "float32")) / n

    under = ops.logical_and(
        ops.greater(mag, 0.0), ops.less(mag, fmt.smallest_subnormal / 2)
    )
    over = ops.logical_and(finite, ops.greater(mag, fmt.max))
    safe = ops.where(finite, d, ops.zeros_like(d))
    return {
        "data_rms": ops.sqrt(ops.mean(ops.square(safe))),
        "scale_exponent": ops.cast(pow2.pow2_exponent(x.scale), "float32"),
        "underflow_fraction": frac(under),
        "saturation_fraction": frac(over),
        "nonfinite_fraction": frac(ops.logical_not(finite)),
    }


def scaled_value_and_grad(fn):
    """`fn(*args) -> loss` to `(loss, grads)`.

    `loss` may be a ScaledTensor (decoded with `to_array`). For each
    ScaledTensor argument the gradient is `ScaledTensor(cotangent of data,
    scale=grad_scale)`; plain arguments get plain gradients.
    """

    def vg(*args):
        metas = [(a.scale, a.grad_scale) if is_scaled(a) else None for a in args]
        leaves = [a.data if is_scaled(a) else a for a in args]

        def inner(*datas):
            rebuilt = [
                ScaledTensor(d, m[0], m[1]) if m is not None else d
                for d, m in zip(datas, metas)
            ]
            out = fn(*rebuilt)
            return to_array(out) if is_scaled(out) else out

        value, grads = backend.value_and_grad(inner)(*leaves)
        out = []
        for g, m in zip(grads, metas):
            out.append(ScaledTensor(g, m[1]) if m is not None and g is not None else g)
        return value, out

    return vg


# --- GEMM coverage -------------------------------------------------------


def count_params(model):
    """The number of parameters of `model` as its plain Keras original
    counts them (`layers.weights.count_weight_params`): a ScaledVariable by
    its data; weight scales, gradient scales and delayed-rescaling states
    are bookkeeping and not counted. Equal to the original's
    `count_params()` after `scalify`."""
    return count_weight_params(model)


def _einsum_flops(equation, x_shape, kernel_shape):
    """2 × the product of every index size of `x, kernel -> out`."""
    lhs = equation.split("->")[0].replace(" ", "")
    a, b = lhs.split(",")
    sizes = {}
    for letters, shape in ((a, x_shape), (b, kernel_shape)):
        letters = letters.replace("...", "")
        dims = list(shape)[-len(letters):] if letters else []
        for letter, d in zip(letters, dims):
            sizes[letter] = int(d)
    extra = 1
    if "..." in a:  # broadcast batch dims of the input
        for d in list(x_shape)[: len(x_shape) - len(a.replace("...", ""))]:
            extra *= int(d)
    return 2 * int(np.prod(list(sizes.values()))) * extra


def _contraction_flops(name, args):
    """FLOPs of a recorded `einsum(subscripts, a, b)` / `matmul(a, b)`."""
    shape = lambda t: tuple(int(d) for d in t.shape)  # noqa: E731
    if name == "einsum":
        return _einsum_flops(args[0], shape(args[1]), shape(args[2]))
    a, b = shape(args[0]), shape(args[1])
    batch = np.broadcast_shapes(a[:-2], b[:-2]) if len(a) > 2 or len(b) > 2 else ()
    return 2 * int(np.prod(batch)) * a[-2] * a[-1] * b[-1]


def _layer_flops(layer, args, kwargs, output):
    """FLOPs of the kernel GEMM of one call of `layer`, or None."""
    import keras

    x = args[0] if args else next(iter(kwargs.values()), None)
    shape = lambda t: tuple(int(d) for d in t.shape)  # noqa: E731
    if isinstance(layer, (keras.layers.EinsumDense, sl.ScaledEinsumDense)):
        kernel = layer.kernel
        return _einsum_flops(layer.equation, shape(x), kernel.shape)
    if isinstance(layer, (keras.layers.Dense, sl.ScaledDense)):
        return 2 * int(np.prod(shape(x))) * int(layer.units)
    if isinstance(
        layer, (keras.layers.ReversibleEmbedding, sl.ScaledEmbedding)
    ):
        if kwargs.get("reverse") or (len(args) > 1 and args[1]):
            return 2 * int(np.prod(shape(x))) * int(layer.input_dim)
        return None
    if isinstance(
        layer, (keras.layers.Conv1D, keras.layers.Conv2D, sl.ScaledConv1D, sl.ScaledConv2D)
    ):
        out = shape(output)
        kernel = shape(layer.kernel)
        return 2 * int(np.prod(out)) * int(np.prod(kernel[:-1]))
    return None


@contextlib.contextmanager
def _wrapped_calls(layers, wrap):
    """While open, each of `layers` runs `wrap(layer, call)` as its `call`
    (`call`: the one it had, its class's or an instance wrapper such as a
    scaled region's), which is put back afterwards."""
    saved = []
    for layer in layers:
        own = layer.__dict__.get("call")
        object.__setattr__(layer, "call", wrap(layer, layer.call))
        saved.append((layer, own))
    try:
        yield
    finally:
        for layer, own in saved:
            object.__delattr__(layer, "call")
            if own is not None:
                object.__setattr__(layer, "call", own)


def _watching_calls(model, record):
    """While open, every layer inside `model` reports each call to
    `record(layer, args, kwargs, outputs)`."""

    def wrap(layer, original):
        def call(*args, **kwargs):
            out = original(*args, **kwargs)
            record(layer, args, kwargs, out)
            return out

        return call

    return _wrapped_calls(model._flatten_layers(include_self=False, recursive=True), wrap)


def propagation(model, inputs):
    """How far scales propagate in one forward call of `model` on `inputs`.

    Returns a dict: `"rule"` and `"fallback"`, the `keras.ops` calls that
    met a ScaledTensor inside custom layers, by name (a fallback computed
    on decoded values, so no scale went through it); `"scaled_inputs"` and
    `"plain_inputs"`, how many calls of scaled layers converted inside
    custom layers received their first input as a ScaledTensor (handed on
    by the previous scaled layer or op) or as a plain tensor (encoded
    there, with a statistic measured).
    """
    inputs_seen = {"scaled_inputs": 0, "plain_inputs": 0}

    def record(layer, args, kwargs, out):
        if not getattr(layer, "plain_io", False):
            return
        first = args[0] if args else next(iter(kwargs.values()), None)
        if is_scaled(first):
            inputs_seen["scaled_inputs"] += 1
        elif first is not None and "float" in str(getattr(first, "dtype", "")):
            inputs_seen["plain_inputs"] += 1

    with _watching_calls(model, record), record_dispatch() as counts:
        model(inputs)
    return {**counts, **inputs_seen}


def gemm_coverage(model, inputs):
    """Where the GEMM FLOPs of one forward call of `model` on `inputs` run.

    Counts the kernel GEMMs of Dense, EinsumDense, Conv1D/Conv2D, tied
    output projections (`ReversibleEmbedding(..., reverse=True)`) and
    custom layers' own kernels (`keras.ops.einsum`/`matmul` with one of
    them: mixture-of-experts banks, `layers/own_weights.py`), plain or
    scaled, found anywhere inside `model`; attention's score and value
    products (no weights) are not counted. Returns a dict: `"scaled"` and
    `"total"` FLOPs, `"fraction"` (scaled / total), `"fp8"` (FLOPs of
    scaled GEMMs that took an FP8 route) and `"layers"`: `[(path, class
    name, flops, scaled, fp8_route)]` in call order.
    """
    rows = []

    def record(layer, args, kwargs, out):
        flops = _layer_flops(layer, args, kwargs, out)
        if flops is not None:
            rows.append((layer, flops))

    owners = plain_kernel_owners(model)
    with _watching_calls(model, record), record_contractions() as calls:
        model(inputs)
    # Contractions with custom layers' own kernels (`layers/own_weights.py`:
    # mixture-of-experts banks), plain or scaled.
    for name, args, contract in calls:
        operands = args[1:] if name == "einsum" else args
        if contract is not None:
            layer, route = contract.layer, contract.layer._ksc_weight_policy._fp8_route
        else:
            layer = next((owners[id(o)] for o in operands if id(o) in owners), None)
            route = None
        if layer is not None:
            flops = _contraction_flops(name, args)
            rows.append((layer, flops, contract is not None, route))
    table, scaled, fp8, total = [], 0, 0, 0
    for layer, flops, *own in rows:
        is_scaled = own[0] if own else isinstance(layer, ScaledLayer)
        route = own[1] if own else (layer.fp8_route if is_scaled else None)
        total += flops
        scaled += flops if is_scaled else 0
        fp8 += flops if route is not None else 0
        name = getattr(type(layer), "_scaled_class_name", type(layer).__name__)
        table.append((layer.path, name, flops, is_scaled, route))
    return {
        "scaled": scaled,
        "total": total,
        "fraction": scaled / total if total else 0.0,
        "fp8": fp8,
        "layers": table,
    }
