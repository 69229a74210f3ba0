"""Capturing the calls of a model's scaled layers.

`scaled_layers` finds the layers `ScaleMonitor` watches; `_capturing`
hands each call's inputs and first ScaledTensor output to a function
(`measuring.py` reads the activations and gradients through it).
"""

import contextlib

import keras

from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.core.scaled_tensor import map_scaled
from keras_scalify.debug import _wrapped_calls
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.plain_io import _input_masks
from keras_scalify.layers.plain_io import _set_keras_mask
from keras_scalify.layers.regions import _region
from keras_scalify.layers.regions import in_region
from keras_scalify.ops.boundary import to_array


def scaled_layers(model):
    """The scaled layers inside `model` (inside custom layers and scaled
    layers too), each once, in `_flatten_layers` order."""
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if isinstance(layer, ScaledLayer)
    ]


def _replace_first_scaled(outputs, fn):
    """`outputs` with its first ScaledTensor replaced by `fn(it)`."""
    done = []

    def replace(x):
        if done or not is_scaled(x):
            return x
        done.append(True)
        return fn(x)

    return map_scaled(replace, outputs)


@contextlib.contextmanager
def _capturing(model, on_output):
    """While open, each call of a scaled layer inside `model` reports its
    inputs and its first ScaledTensor output to `on_output(layer, args,
    kwargs, y)`, which returns the tensor to hand on in place of `y`.

    A plain-I/O layer (converted inside a custom layer) called outside a
    scaled region decodes its ScaledTensor on the way out; here it is
    called in a region, so that its ScaledTensor (re-anchored as it would
    be) is seen, then decoded exactly as the layer does. The layers' `call`
    (their class's or an instance attribute) is restored afterwards.
    """
    def wrap(layer, original):
        def call(*args, **kwargs):
            plain = layer.plain_io and not in_region()
            if plain:
                masks = _input_masks(layer, args, kwargs)
                with _region(True):
                    out = original(*args, **kwargs)
            else:
                out = original(*args, **kwargs)
            out = _replace_first_scaled(
                out, lambda y: on_output(layer, args, kwargs, y)
            )
            if plain:
                dtype = layer._plain_io_dtype
                out = map_scaled(
                    lambda t: to_array(t, dtype) if is_scaled(t) else t, out
                )
                if masks:
                    _set_keras_mask(out, masks[0])
            return out

        return call

    with _wrapped_calls(scaled_layers(model), wrap):
        yield


@contextlib.contextmanager
def _no_grad():
    if keras.backend.backend() == "torch":
        import torch

        with torch.no_grad():
            yield
    else:
        yield
