"""A clear error when a plain Keras optimizer is given scaled weights.

The trainable `data` of a `ScaledVariable` is not the weight: the weight is
`data × scale`, and the data's gradient is `true_gradient / grad_scale`.
A plain optimizer would train the data parametrization (SGD's step would
grow with scale²) and overwrite the scales with their (zero) gradients.
`BaseOptimizer.build` is wrapped when the first `ScaledVariable` is made
so that any optimizer other than `ScaledOptimizer` raises when it is built
on such weights; `uninstall` restores it.
"""

from keras.src.optimizers.base_optimizer import BaseOptimizer

from keras_scalify.layers.variable import ON_FIRST_SCALED_VARIABLE

_ORIGINAL = {}


def scaled_variables_in(variables):
    return [v for v in variables if getattr(v, "_ksc_scaled_variable", None) is not None]


def _guarded_build(self, variables):
    if not getattr(self, "_ksc_accepts_scaled", False):
        scaled = scaled_variables_in(variables)
        if scaled:
            names = ", ".join(v.path for v in scaled[:3])
            raise TypeError(
                f"{type(self).__name__} was given scaled weights ({names}, ...) "
                "from keras_scalify layers. A plain Keras optimizer would "
                "train their data instead of the weights. Wrap it: "
                f"`keras_scalify.ScaledOptimizer(keras.optimizers.{type(self).__name__}(...))`."
            )
    return _ORIGINAL["build"](self, variables)


def install():
    """Wrap `BaseOptimizer.build` (idempotent)."""
    if "build" not in _ORIGINAL:
        _ORIGINAL["build"] = BaseOptimizer.build
        BaseOptimizer.build = _guarded_build


def uninstall():
    """Restore `BaseOptimizer.build`."""
    if "build" in _ORIGINAL:
        BaseOptimizer.build = _ORIGINAL.pop("build")


ON_FIRST_SCALED_VARIABLE.append(install)
