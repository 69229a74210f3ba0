"""Conversion helpers shared by the scaled layers' `from_keras` /
`to_keras`: checks of the Keras layer, constructor arguments of the twin,
and the copy of built weights between a layer and its twin."""

from keras_scalify.layers.base import plain_shapes
from keras_scalify.layers.weights import weight_values
from keras_scalify.policies import ScaledDTypePolicy


def check_keras_layer(layer, keras_cls, scaled_cls):
    """Raise a TypeError unless `layer` is a `keras_cls` instance."""
    if not isinstance(layer, keras_cls):
        raise TypeError(
            f"`layer` of {scaled_cls.__name__}.from_keras must be a "
            f"keras.layers.{keras_cls.__name__}, got {type(layer).__name__}."
        )


def reject_options(layer, scaled_cls, names):
    """Raise a ValueError naming the first Keras option of `layer` that the
    scaled layer does not support (regularizers, constraints, LoRA,
    quantization): each of `names` must be None/False/0 on `layer`."""
    for name in names:
        value = getattr(layer, name, None)
        if value:
            raise ValueError(
                f"`{name}` of layer {layer.name!r} is not supported by "
                f"{scaled_cls.__name__} (got {value!r}): it must be "
                f"None or False. Remove it before converting."
            )
    mode = getattr(layer, "quantization_mode", None)
    if mode is not None:
        raise ValueError(
            f"`quantization_mode` of layer {layer.name!r} is {mode!r}: "
            f"{scaled_cls.__name__} converts float layers only."
        )
    if getattr(layer, "lora_enabled", False):
        raise ValueError(
            f"`lora_rank` of layer {layer.name!r}: LoRA is enabled, which "
            f"{scaled_cls.__name__} does not support; merge it first."
        )


def keras_base_kwargs(layer, overrides):
    """name, dtype policy and trainable of `layer`, then `overrides`."""
    kwargs = {
        "name": layer.name,
        "dtype": layer.dtype_policy,
        "trainable": layer.trainable,
    }
    kwargs.update(overrides)
    return kwargs


def plain_dtype(policy):
    """The dtype policy of a plain Keras copy of a scaled layer: a scaled
    policy becomes "float32" (the represented weights' dtype, readable
    without keras_scalify); a plain Keras policy is kept."""
    if isinstance(policy, ScaledDTypePolicy):
        return "float32"
    return policy


def scaled_base_kwargs(layer, overrides):
    """name, plain dtype policy and trainable of scaled `layer`, then
    `overrides` (for `to_keras`)."""
    kwargs = {
        "name": layer.name,
        "dtype": plain_dtype(layer.dtype_policy),
        "trainable": layer.trainable,
    }
    kwargs.update(overrides)
    return kwargs


def copy_built_weights(source, target):
    """Build `target` on the input shapes `source` was built on and give it
    `source`'s weights (represented float32 values); no-op if `source` is
    not built. Both layers list their weights in the same order."""
    if not source.built:
        return target
    config = source.get_build_config()
    if config:
        target.build_from_config(plain_shapes(config))
    elif not target.built:
        target.build(None)
    weights = weight_values(source)
    if weights or target.weights:
        target.set_weights(weights)
    return target
