"""Reductions: over all elements (`mean`, `max`, `rms`; `rms_all` of many
tensors at once, `rms_all_on_host` read on the host), down to a
broadcast operand's shape (`sum_to`), and `stack` / `unstack`."""

import math

from keras import ops

# The package: `rms_all_on_host` calls `rms_all` there, where a benchmark
# wraps it to count its calls (`benchmarks/stats_count.py`).
from keras_scalify.backend import scalar
from keras_scalify.backend.scalar.base import TORCH


def _sum_to_ops(x, shape):
    """`sum_to` with `keras.ops`: the leading axes `x` has beyond `shape`,
    and those where `shape` is 1, summed."""
    shape = tuple(shape)
    lead = len(x.shape) - len(shape)
    axes = list(range(lead)) + [
        lead + i for i, d in enumerate(shape) if d == 1 and x.shape[lead + i] != 1
    ]
    if not axes:
        return ops.reshape(x, shape) if lead else x
    return ops.reshape(ops.sum(x, axis=axes, keepdims=True), shape)


if TORCH:
    import torch

    from keras_scalify.backend.scalar.base import _TENSOR
    from keras_scalify.backend.scalar.base import _is_compiling
    from keras_scalify.backend.scalar.host import _MEMO_OFF
    from keras_scalify.backend.scalar.host import _count_read

    def mean(x):
        """The mean over all elements."""
        if isinstance(x, torch.Tensor):
            return torch.mean(x)
        return ops.mean(x)

    def max(x):
        """The max over all elements (Keras's torch `max` reads `.values`
        of the result, a graph break under `torch.compile`)."""
        if isinstance(x, torch.Tensor):
            return torch.amax(x)
        return ops.max(x)

    def sum_to(x, shape):
        """`x` summed over its broadcast axes down to `shape` (the
        cotangent of an operand broadcast to `x`'s shape)."""
        if isinstance(x, torch.Tensor):
            return x.sum_to_size(shape) if tuple(x.shape) != tuple(shape) else x
        return _sum_to_ops(x, shape)

    def stack(xs):
        """The scalars or tensors `xs` stacked on a new first axis
        (`torch.stack` on torch tensors: `keras.ops.stack` walks the list
        for symbolic tensors, ~0.2 ms for a model's ~100 scales)."""
        xs = list(xs)
        if xs and all(isinstance(x, _TENSOR) for x in xs):
            return torch.stack(xs)
        return ops.stack(xs)

    def unstack(x):
        """The entries of `x` along its first axis (`stack`'s inverse)."""
        if isinstance(x, _TENSOR):
            return list(torch.unbind(x))
        return ops.unstack(x)

    def rms(x):
        """`sqrt(mean(x²))` over all elements of a float32 tensor, without
        the squared copy (`vector_norm`; it overflows to inf where the sum
        of squares does)."""
        if isinstance(x, torch.Tensor):
            return torch.linalg.vector_norm(x) * (1.0 / math.sqrt(x.numel() or 1))
        return ops.sqrt(ops.mean(ops.square(x)))

    def rms_all(xs):
        """`stack([rms(x) for x in xs])`; CPU float32 tensors outside
        `torch.compile` by one `torch._foreach_norm` (on a GPU its
        reduction order differs from `rms`'s: not bit for bit)."""
        xs = list(xs)
        if _float32_on_one_device(xs) and xs[0].is_cpu:
            return torch.stack(torch._foreach_norm(xs)) * _inverse_sqrt_sizes(xs)
        return stack([rms(x) for x in xs])

    _INVERSE_SQRT_SIZES = {}

    def _inverse_sqrt_sizes(xs):
        """float32 `1/√size` of each of `xs`, on their device (cached, not
        made per step)."""
        key = (tuple(x.numel() for x in xs), xs[0].device)
        out = _INVERSE_SQRT_SIZES.get(key)
        if out is None:
            if len(_INVERSE_SQRT_SIZES) > 64:
                _INVERSE_SQRT_SIZES.clear()
            sizes = [1.0 / math.sqrt(n or 1) for n in key[0]]
            out = _INVERSE_SQRT_SIZES[key] = torch.tensor(sizes, dtype=torch.float32, device=key[1])
        return out

    def rms_all_on_host(xs):
        """`rms_all(xs)` as Python floats (its float32 values): float32
        tensors on one device on eager torch, outside `memo_disabled()`:
        one read of the stacked vector (on a GPU, one synchronization,
        counted by `synchronizing_reads`). None elsewhere."""
        xs = list(xs)
        if _MEMO_OFF or not _float32_on_one_device(xs):
            return None
        _count_read(xs[0])
        return scalar.rms_all(xs).tolist()

    def _float32_on_one_device(xs):
        """Whether `xs` is a non-empty list of float32 tensors on one
        device, outside `torch.compile` (`rms_all`'s one `_foreach_norm`)."""
        return bool(xs) and not _is_compiling() and all(
            type(x) is _TENSOR and x.dtype == torch.float32 and x.device == xs[0].device for x in xs
        )

else:
    from keras_scalify.backend.scalar.base import _TF

    if _TF:
        import tensorflow as _tf

    def mean(x):
        """The mean over all elements."""
        return ops.mean(x)

    def stack(xs):
        """The scalars or tensors `xs` stacked on a new first axis."""
        return ops.stack(list(xs))

    def unstack(x):
        """The entries of `x` along its first axis (`stack`'s inverse)."""
        return ops.unstack(x)

    def max(x):
        """The max over all elements."""
        return ops.max(x)

    def sum_to(x, shape):
        """`x` summed over its broadcast axes down to `shape`."""
        return _sum_to_ops(x, shape)

    def rms_all(xs):
        """`stack([rms(x) for x in xs])`."""
        return stack([rms(x) for x in xs])

    def rms_all_on_host(xs):
        """None: the host has no tensor values here (see the torch one)."""
        return None

    def rms(x):
        """`sqrt(mean(x²))` over all elements (0 for an empty tensor). On
        TensorFlow a dense float32 tensor's sum of squares is
        `2·l2_loss(x)`: one pass without the squared copy (Grappler fuses
        neither `square` into `sum` nor a norm; the two passes were
        ~0.7 ms of a 9 ms MLP step). It overflows to inf where the sum of
        squares does."""
        if _TF and isinstance(x, _tf.Tensor) and x.dtype == _tf.float32:
            squares = _tf.nn.l2_loss(x) * 2.0
        else:
            squares = ops.sum(ops.square(x))
        if all(isinstance(d, int) for d in x.shape):
            return ops.sqrt(squares / float(math.prod(x.shape) or 1))
        n = ops.maximum(ops.cast(ops.size(x), squares.dtype), 1.0)
        return ops.sqrt(squares / n)
