"""Looking inside: statistics of ScaledTensors and of their gradients.

- `stats(x, dtype=None)`: data RMS, scale exponent, and the fractions of
  values that would underflow (|d| below half the smallest subnormal, so
  they round to 0) or saturate (|d| above max) in the format `dtype`
  (default: the data's own dtype).
- `scaled_value_and_grad(fn)`: gradients of `fn` with respect to its
  ScaledTensor arguments, returned as ScaledTensors
  `(cotangent_of_data, scale=grad_scale)`: `to_array` gives the true
  gradient, and `stats` shows how well it is scaled.
"""

import numpy as np
from keras import ops

from keras_scalify import backend
from keras_scalify.core import pow2
from keras_scalify.core.formats import get_format
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops.boundary import to_array


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


def format_stats(x, dtype=None, name="tensor"):
    """`stats` as one printable line (eager only)."""
    s = {k: float(ops.convert_to_numpy(v)) for k, v in stats(x, dtype).items()}
    return (
        f"{name}: rms={s['data_rms']:.3g} scale=2^{int(s['scale_exponent'])} "
        f"underflow={s['underflow_fraction']:.2%} "
        f"saturated={s['saturation_fraction']:.2%} "
        f"nonfinite={s['nonfinite_fraction']:.2%}"
    )


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
