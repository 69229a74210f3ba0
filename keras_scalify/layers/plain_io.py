"""Scaled layers inside plain Keras code: plain tensors in, plain out.

`scalify` converts the Dense, EinsumDense, Embedding, normalization and
attention layers that custom layers (keras-hub transformer blocks, Keras's
own MultiHeadAttention subclasses) hold as sublayers. The surrounding code
runs `keras.ops` on their outputs, which know nothing of ScaledTensors, so
such a layer is switched to plain input/output (`ScaledLayer.enable_plain_io`):

- each floating input is encoded exactly (scale 1) then a dynamic
  rescale by the pow2 of its RMS (`ops.boundary.encode`), so the data the
  layer computes on (and its FP8 GEMM operands) is unit-scaled whatever the
  magnitude the plain code hands it (0, inf and NaN pass through unscaled);
- the output's grad scale is re-anchored by a delayed rescale
  (`delayed_rescale_grad`) whose statistic is kept in the layer's
  `plain_io_grad_scale_state` weight (the route of `DynamicRescaleGrad`),
  so the cotangent reaching the layer's backward GEMMs is unit-scaled; the
  same state is the inputs' grad scale;
- the output is decoded with `to_array` into `dtype` (float32: the plain
  code around it runs in float32).

Values are exact under `scaled_float32` (every factor is a power of two):
a converted custom layer computes what the original did.
"""

import keras
from keras import ops

from keras_scalify.core import pow2
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.core.scaled_tensor import map_scaled
from keras_scalify.layers.attention import ScaledMultiHeadAttention
from keras_scalify.layers.base import TENSOR_KWARGS
from keras_scalify.ops.boundary import encode
from keras_scalify.ops.boundary import to_array
from keras_scalify.ops.rescaling import delayed_rescale_grad
from keras_scalify.layers.regions import in_region
from keras_scalify.layers.variable import read_tensor


def _is_float_tensor(x):
    if x is None or is_scaled(x) or not hasattr(x, "dtype"):
        return False
    return "float" in keras.backend.standardize_dtype(x.dtype)


def _anchor(outputs, state):
    """The first ScaledTensor of `outputs` re-anchored by `state`."""
    done = []

    def anchor(x):
        if done or not is_scaled(x):
            return x
        done.append(True)
        return delayed_rescale_grad(x, state)

    return map_scaled(anchor, outputs)


def _decode_outputs(outputs, state, dtype, anchor):
    """With `anchor`, the first ScaledTensor of `outputs` re-anchored by
    `state`; then every ScaledTensor decoded into `dtype`."""
    if anchor:
        outputs = _anchor(outputs, state)
    return map_scaled(lambda x: to_array(x, dtype) if is_scaled(x) else x, outputs)


def _input_masks(layer, args, kwargs):
    """The Keras masks (`_keras_mask`) of the floating inputs. Encoding
    drops them, so a layer that reads them (attention) refuses them; the
    others pass the first one on to their output, as Keras does for Dense,
    EinsumDense and the normalizations."""
    from keras.src.backend import get_keras_mask

    values = list(args) + [kwargs[k] for k in TENSOR_KWARGS if k in kwargs]
    masks = [
        m
        for m in (get_keras_mask(v) for v in values if _is_float_tensor(v))
        if m is not None
    ]
    if masks and isinstance(layer, ScaledMultiHeadAttention):
        raise ValueError(
            f"Layer {layer.name!r}: a converted attention layer does not "
            f"read the Keras masks attached to its inputs (`_keras_mask`); "
            f"pass `attention_mask` explicitly, or keep the layer plain with "
            f"`scalify(..., exclude=[{layer.name!r}])`."
        )
    return masks


def _set_keras_mask(outputs, mask):
    from keras.src.backend import set_keras_mask

    first = keras.tree.flatten(outputs)[0]
    set_keras_mask(first, mask)


def plain_io_call(layer, call, args, kwargs):
    """`call(*args, **kwargs)` (the scaled class's `call`) with plain
    floating inputs encoded and ScaledTensor outputs decoded (see above)."""
    dtype = layer._plain_io_dtype

    state = read_tensor(layer.plain_io_grad_scale_state)
    stop = pow2.pow2_round_down(ops.stop_gradient(state))
    g_in = ops.where(ops.greater(stop, 0.0), stop, ops.ones_like(stop))
    masks = _input_masks(layer, args, kwargs)
    encoded = []

    def encode_input(x):
        encoded.append(True)
        return encode(x, g_in)

    args = tuple(encode_input(a) if _is_float_tensor(a) else a for a in args)
    kwargs = {
        k: encode_input(v) if k in TENSOR_KWARGS and _is_float_tensor(v) else v
        for k, v in kwargs.items()
    }
    # Only a call with floating inputs feeds its output cotangent to GEMMs
    # (an embedding lookup sums it into the table in float32): one anchor,
    # so a tied embedding (lookup + reverse) updates its state once.
    fed = bool(encoded) or any(is_scaled(a) for a in args)
    fed = fed or any(is_scaled(v) for k, v in kwargs.items() if k in TENSOR_KWARGS)
    outputs = call(*args, **kwargs)
    if in_region():
        # Inside a custom layer that propagates scales: re-anchored only.
        return _anchor(outputs, state) if fed else outputs
    outputs = _decode_outputs(outputs, state, dtype, anchor=fed)
    if masks:
        _set_keras_mask(outputs, masks[0])
    return outputs
