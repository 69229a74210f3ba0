"""Custom rules of gated activations `f(x) = x·g(x)` (paper App. C.1).

Rule: scale and grad scale unchanged, `d = a·g(a·sa)`. The gate is
evaluated in float32 on the represented value; it is bounded, so a huge
`a·sa` cannot overflow the result.
"""

from keras import ops

from keras_scalify.backend.fused import gated
from keras_scalify.core.pow2 import as_dtype
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_input


def _gated(x, kind):
    d = gated(as_dtype(x.data, "float32"), x.scale, kind)
    return ScaledTensor(as_dtype(d, x.dtype), x.scale, x.grad_scale)


def relu(x):
    """Rule: scale unchanged, `d = relu(a)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.relu(x)
    return ScaledTensor(ops.relu(x.data), x.scale, x.grad_scale)


def gelu(x, approximate=True):
    """Rule: scale unchanged, `d = a·Φ(a·sa)` (tanh approximation by default, as Keras)."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.gelu(x, approximate=approximate)
    return _gated(x, "gelu_tanh" if approximate else "gelu")


def silu(x):
    """Rule: scale unchanged, `d = a·sigmoid(a·sa)`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.silu(x)
    return _gated(x, "silu")
