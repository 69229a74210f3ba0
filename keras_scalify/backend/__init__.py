"""Backend-specific code: the only place that branches on the backend.

- `host_readable(x)`: whether one process can read `x` into NumPy (not a
  jax array sharded across processes).
- `is_concrete(x)`: whether `x` holds values now (eager), so that input
  checks on values (finite, power of two) can run; traced tensors skip them.
- `jit(fn)`: `jax.jit` / `tf.function` / eager torch (`torch_compile(fn)`
  for `torch.compile`).
- `refresh_layer_params(layer)`: drop torch's cached parameter list of a
  layer whose sublayers were replaced in place.
- `value_and_grad(fn)`: `fn(*args) -> scalar` to `(value, grads)` with
  respect to every positional argument, on the current backend.
"""

import keras

from keras_scalify.backend.dispatch import host_readable
from keras_scalify.backend.dispatch import is_concrete
from keras_scalify.backend.dispatch import jit
from keras_scalify.backend.dispatch import refresh_layer_params
from keras_scalify.backend.dispatch import torch_compile
from keras_scalify.backend.dispatch import value_and_grad

__all__ = [
    "host_readable",
    "is_concrete",
    "jit",
    "name",
    "refresh_layer_params",
    "torch_compile",
    "value_and_grad",
]


def name():
    return keras.backend.backend()
