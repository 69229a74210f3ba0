"""Boundary layers between plain tensors and ScaledTensors."""

import keras
import numpy as np
from keras import ops

from keras_scalify.core import pow2
from keras_scalify.core.scaled_tensor import ON_FIRST_SCALED_TENSOR
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.core.scaled_tensor import map_scaled
from keras_scalify.layers.base import ScaledLayer
from keras_scalify.layers.base import cast_to_compute
from keras_scalify.layers.base import contains_scaled
from keras_scalify.layers.base import scaled_spec
from keras_scalify.layers.regions import in_region
from keras_scalify.ops.boundary import as_scaled
from keras_scalify.ops.boundary import to_array


@keras.saving.register_keras_serializable(package="keras_scalify")
class AsScaled(ScaledLayer):
    """Plain tensor → ScaledTensor representing the same values.

    Args:
        scale: `None` (default): measured, as scaled layers treat plain
            inputs (`layers.base.cast_to_compute`): scale 1, or the pow2 of
            the inputs' RMS when the compute dtype is narrower than theirs,
            so values beyond it (1e30 into float16) are represented. A
            power of two: a static scale, the data is `inputs / scale`
            (exact) cast to the compute dtype (overflow gives ±inf).
        grad_scale: the pow2 gradient scale of the output (default 1).
    """

    def __init__(self, scale=None, grad_scale=1.0, **kwargs):
        super().__init__(**kwargs)
        for name, v in (("scale", scale), ("grad_scale", grad_scale)):
            if v is None and name == "scale":
                continue
            v = float(v)
            if not (np.isfinite(v) and v > 0 and pow2.np_pow2_round_down(v) == v):
                raise ValueError(
                    f"`{name}` must be a positive finite power of two, got {v}."
                )
        self.scale = None if scale is None else float(scale)
        self.grad_scale = float(grad_scale)

    def call(self, inputs):
        if is_scaled(inputs):
            return inputs
        # Python floats (validated powers of two in float32's range): no
        # NumPy in `call`, which `torch.compile` traces.
        gs = self.grad_scale
        if self.scale is None:
            return cast_to_compute(self, inputs, gs)
        x = ops.convert_to_tensor(inputs)
        x = ops.cast(x, "float32") * (1.0 / self.scale)
        x = ops.cast(x, self.compute_dtype)
        return as_scaled(x, self.scale, gs)

    def compute_output_spec(self, inputs):

        shape = inputs.data.shape if is_scaled(inputs) else inputs.shape
        return scaled_spec(shape, self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({"scale": self.scale, "grad_scale": self.grad_scale})
        return config


@keras.saving.register_keras_serializable(package="keras_scalify")
class ToArray(ScaledLayer):
    """ScaledTensor → plain tensor `data * scale` (multiplied in float32).

    Args:
        dtype_out: output dtype (default float32).
    """

    def __init__(self, dtype_out="float32", **kwargs):
        super().__init__(**kwargs)
        self.dtype_out = dtype_out

    def call(self, inputs):
        return to_array(inputs, self.dtype_out)

    def compute_output_spec(self, inputs):
        shape = inputs.data.shape if is_scaled(inputs) else inputs.shape
        return keras.KerasTensor(shape, dtype=self.dtype_out)

    def get_config(self):
        config = super().get_config()
        config.update({"dtype_out": self.dtype_out})
        return config


# --- a clear error when a built-in Keras layer receives a ScaledTensor ------
#
# A ScaledTensor is a named tuple, so Keras's `Layer.__call__` flattens it
# into three tensors before any method of ours runs: a plain `Dense` then
# fails with "expects 1 input(s), but it received 3 input tensors", a
# `LayerNormalization` with "Cannot convert '((),)' to a shape", and an
# `Activation` somewhere inside the backend. Keras checks the first
# positional argument of every call with `Layer._assert_input_compatibility`
# before building or calling the layer; the guard below wraps that method
# and raises a TypeError naming `ToArray` when a built-in Keras layer (not a
# ScaledLayer, a `Lambda`, which may compute with `keras_scalify.ops`, or a
# model) receives a ScaledTensor. Custom layers are left alone: they may
# handle ScaledTensors themselves.

_GUARD_SKIP = ("Lambda", "InputLayer")


def plain_layer_error(layer):
    """The TypeError raised when plain Keras `layer` receives a ScaledTensor."""
    return TypeError(
        f"Layer {layer.name!r} ({type(layer).__name__}) is a plain Keras "
        f"layer and received a ScaledTensor. Insert a "
        f"`keras_scalify.layers.ToArray()` layer before it to pass it the "
        f"represented values, use its scaled counterpart from "
        f"`keras_scalify.layers`, or convert the whole model with "
        f"`keras_scalify.scalify(model)`, which inserts the boundaries."
    )


def _is_guarded(layer):
    if isinstance(layer, (ScaledLayer, keras.Model)):
        return False
    if "_ksc_plain_call" in layer.__dict__ and in_region():
        return False  # inside a converted custom layer: decoded (regions.py)
    cls = type(layer)
    if not cls.__module__.startswith("keras."):
        return False
    return cls.__name__ not in _GUARD_SKIP


def install_plain_layer_guard():
    """Wrap `keras.layers.Layer._assert_input_compatibility` (once) so that a
    built-in Keras layer called on a ScaledTensor raises `plain_layer_error`.
    Valid calls are unaffected: the wrapper only adds a check."""
    layer_cls = keras.layers.Layer
    original = getattr(layer_cls, "_assert_input_compatibility", None)
    if original is None or getattr(original, "_keras_scalify_guard", False):
        return

    def _assert_input_compatibility(self, arg_0):
        if contains_scaled(arg_0) and _is_guarded(self):
            raise plain_layer_error(self)
        return original(self, arg_0)

    _assert_input_compatibility._keras_scalify_guard = True
    _assert_input_compatibility.__wrapped__ = original
    layer_cls._assert_input_compatibility = _assert_input_compatibility


def uninstall_plain_layer_guard():
    """Restore `Layer._assert_input_compatibility` (undo
    `install_plain_layer_guard`)."""
    layer_cls = keras.layers.Layer
    wrapper = getattr(layer_cls, "_assert_input_compatibility", None)
    if getattr(wrapper, "_keras_scalify_guard", False):
        layer_cls._assert_input_compatibility = wrapper.__wrapped__


ON_FIRST_SCALED_TENSOR.append(install_plain_layer_guard)


# --- models return plain tensors --------------------------------------------
#
# Keras's losses, metrics and `predict` know nothing of ScaledTensors: a
# model whose last layer is a scaled layer would hand a named tuple of three
# tensors to `compile`'s loss ("The path: (0,) in the `loss` argument can't
# be found") and to `predict`. Sequential and Functional models are both
# built by `Functional.__init__(inputs, outputs)` (a Sequential builds one
# when its input shape is known), so that constructor is wrapped: every
# symbolic ScaledTensor among `outputs` is passed through a `ToArray` layer
# first, and the model returns the represented float32 values. Models whose
# outputs are plain are built exactly as before. `uninstall_plain_outputs()`
# restores the constructor.


def _plain_outputs(outputs):
    """`outputs` with every symbolic ScaledTensor passed through `ToArray`."""

    def plain(x):
        if is_scaled(x) and isinstance(x.data, keras.KerasTensor):
            return ToArray()(x)
        return x

    return map_scaled(plain, outputs)


def _functional_cls():
    from keras.src.models.functional import Functional

    return Functional


def install_plain_outputs():
    """Wrap `Functional.__init__` (once) so that models built from symbolic
    ScaledTensor outputs end with `ToArray` (see the note above)."""
    cls = _functional_cls()
    original = cls.__init__
    if getattr(original, "_keras_scalify_outputs", False):
        return

    # Keras's `functional_like_constructor` inspects this signature when
    # it reloads Functional subclasses: keep the original's.
    def __init__(self, inputs, outputs, name=None, **kwargs):
        if contains_scaled(outputs):
            outputs = _plain_outputs(outputs)
        return original(self, inputs, outputs, name=name, **kwargs)

    __init__._keras_scalify_outputs = True
    __init__.__wrapped__ = original
    cls.__init__ = __init__


def uninstall_plain_outputs():
    """Restore `Functional.__init__` (undo `install_plain_outputs`)."""
    cls = _functional_cls()
    wrapper = cls.__init__
    if getattr(wrapper, "_keras_scalify_outputs", False):
        cls.__init__ = wrapper.__wrapped__


ON_FIRST_SCALED_TENSOR.append(install_plain_outputs)
