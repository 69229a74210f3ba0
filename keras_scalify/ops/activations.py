"""Custom rules of gated activations `f(x) = x·g(x)` (paper App. C.1).

Rule: scale and grad scale unchanged, `d = a·g(a·sa)`. The gate is
evaluated in float32 on the represented value; it is bounded, so a huge
`a·sa` cannot overflow the result.
"""

import math

from keras import ops

from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_input
from keras_scalify.ops._common import stop


def _gated(x, gate):
    a = ops.cast(x.data, "float32")
    u = a * stop(x.scale)
    return ScaledTensor(ops.cast(a * gate(u), x.dtype), x.scale, x.grad_scale)


def relu(x):
    """Rule: scale unchanged, `d = relu(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.relu(x)
    return ScaledTensor(ops.relu(x.data), x.scale, x.grad_scale)


def _gelu_gate(approximate):
    # tanh form: the gate is exactly 0 or 1 in float32 beyond |u| = 20;
    # clipping there changes no value and keeps u**3 (and its gradient)
    # finite. The erf form needs no clip: erf and its derivative
    # exp(-u²) are finite for every u, ±inf included.
    if approximate:
        k = math.sqrt(2.0 / math.pi)

        def gate(u):
            u = ops.clip(u, -20.0, 20.0)
            return 0.5 * (1.0 + ops.tanh(k * (u + 0.044715 * u * u * u)))

        return gate
    return lambda u: 0.5 * (1.0 + ops.erf(u * (1.0 / math.sqrt(2.0))))


def gelu(x, approximate=True):
    """Rule: scale unchanged, `d = a·Φ(a·sa)` (tanh approximation by default, as Keras)."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.gelu(x, approximate=approximate)
    return _gated(x, _gelu_gate(approximate))


def silu(x):
    """Rule: scale unchanged, `d = a·sigmoid(a·sa)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.silu(x)
    return _gated(x, ops.sigmoid)
