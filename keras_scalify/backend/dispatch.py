"""Per-backend implementations of the few things `keras.ops` lacks."""

import keras
import numpy as np


def is_concrete(x):
    """True when `x` is a value (NumPy, Python, or an eager tensor)."""
    if isinstance(x, (float, int, np.ndarray, np.generic)):
        return True
    if keras.backend.is_keras_tensor(x):
        return False
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly() and not tf.is_symbolic_tensor(x)
    if backend == "torch":
        import torch

        if torch.compiler.is_compiling():
            return False
        return isinstance(x, torch.Tensor) and x.device.type != "meta"
    return True


def host_readable(x):
    """False for a jax array that no single process can read: sharded over
    devices of several processes (a multi-process `keras.distribution`
    layout) and not replicated. Such a value is converted on the devices,
    never through NumPy."""
    if keras.backend.backend() != "jax":
        return True
    import jax

    if not isinstance(x, jax.Array):
        return True
    return x.is_fully_addressable or x.is_fully_replicated


def value_and_grad(fn):
    """`fn(*args) -> scalar` to `(value, [d fn / d arg])` (all positional).

    Eager on every backend; call it inside `jax.jit` / `tf.function` to
    compile.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        def vg(*args):
            return jax.value_and_grad(fn, argnums=tuple(range(len(args))))(
                *args
            )

        return vg
    if backend == "tensorflow":
        import tensorflow as tf

        def vg(*args):
            args = [tf.convert_to_tensor(a) for a in args]
            with tf.GradientTape() as tape:
                for a in args:
                    tape.watch(a)
                value = fn(*args)
            return value, tape.gradient(value, args)

        return vg
    if backend == "torch":
        import torch

        def vg(*args):
            args = [
                keras.ops.convert_to_tensor(a).detach().clone().requires_grad_(True)
                for a in args
            ]
            value = fn(*args)
            grads = torch.autograd.grad(value, args, allow_unused=True)
            return value.detach(), list(grads)

        return vg
    raise NotImplementedError(f"value_and_grad: backend {backend}")


def jit(fn):
    """Compile `fn` with the backend's tracer: `jax.jit`, `tf.function`.

    On torch, eager execution is returned unchanged (`torch.compile` is
    exercised separately: its CPU compile time is too long for every test).
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.jit(fn)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


def torch_compile(fn):
    """`torch.compile(fn)` on torch; `jit(fn)` elsewhere."""
    if keras.backend.backend() == "torch":
        import torch

        return torch.compile(fn)
    return jit(fn)


def refresh_layer_params(layer):
    """Forget a layer's backend-side copy of its variable list after its
    sublayers were replaced in place. Torch: a Keras layer is a
    `torch.nn.Module` whose `torch_params` (a ParameterDict of every
    variable, sublayers' included) is built once; dropping it makes Keras
    rebuild it from the current variables on next use. Other backends keep
    no such copy."""
    if keras.backend.backend() != "torch":
        return
    modules = getattr(layer, "_modules", None)
    if modules is not None and "_torch_params" in modules:
        del modules["_torch_params"]
    layer.__dict__.pop("_torch_params", None)
