"""Memoized scale arithmetic on eager torch: `memoize_scalars` returns
the tensors a pure function of scalars returned before for the same
argument values (keyed by the value keys of `backend.scalar.host`), and
`signature` keys a rule's static analysis by its operands' shapes,
dtypes and devices. JAX and TensorFlow trace the step: nothing to
memoize there."""

import weakref

from keras_scalify.backend.scalar.base import TORCH

if TORCH:
    from keras_scalify.backend.scalar.base import _PARAMETER
    from keras_scalify.backend.scalar.base import _TENSOR
    from keras_scalify.backend.scalar.base import _is_compiling
    from keras_scalify.backend.scalar.base import _is_inference
    from keras_scalify.backend.scalar.host import _HOST_READS_OFF
    from keras_scalify.backend.scalar.host import _KEY_ATTR
    from keras_scalify.backend.scalar.host import _MEMO_OFF
    from keras_scalify.backend.scalar.host import _MISS
    from keras_scalify.backend.scalar.host import _kept_key
    from keras_scalify.backend.scalar.host import _read_key
    from keras_scalify.backend.scalar.host import _stored_key
    from keras_scalify.backend.scalar.host import _value_key

    _PLAIN_KEYS = (type(None), bool, int, str)

    def _memo_key(x, tensors):
        """A hashable key of `x`'s value (0-d CPU tensors of float32, int32
        or bool without a gradient, Python scalars, None, strings, and
        lists or tuples of those; a tensor's value read with `item()`,
        which on a CPU is a memory read, or, on any device, the key kept on
        the tensor: a memo's result (`_keep`), a variable's detached scalar
        at its version (`detached_variable_value`), a cached constant), or
        `_MISS`. Each tensor found is appended to `tensors`. NaN has no key
        (it equals nothing); -0.0 has its own."""
        t = type(x)
        if t is _TENSOR or t is _PARAMETER:
            key = _stored_key(x)
            if key is None:
                key = _tensor_key(x)
                if key is _MISS:
                    return _MISS
            tensors.append(x)
            return key
        if t is tuple or t is list:
            keys = [t]
            for e in x:
                k = _memo_key(e, tensors)
                if k is _MISS:
                    return _MISS
                keys.append(k)
            return tuple(keys)
        if t is float:
            return _value_key("p", x)
        if t in _PLAIN_KEYS:
            return (t, x)
        return _MISS

    def _tensor_key(x):
        """`_memo_key` of a tensor, read from it for free (`_MISS` for
        other than a 0-d CPU float32 / int32 / bool tensor without a
        gradient, and inside `host_reads_disabled()`)."""
        if not x.is_cpu or _HOST_READS_OFF:
            return _MISS
        return _read_key(x)

    # The tensors some memo keeps (never written in place).
    _MEMO_TENSORS = weakref.WeakSet()

    def _memo_value(out, inputs):
        """Whether `out` may be returned again: 0-d tensors without a
        gradient, none of them one of the `inputs` unless a memo keeps it
        already (a variable's own tensor would change under the cache when
        the variable is written), Python scalars, None, and tuples or
        lists of those."""
        t = type(out)
        if t is _TENSOR:
            if out.dim() != 0 or out.requires_grad:
                return False
            return not any(out is x for x in inputs) or out in _MEMO_TENSORS
        if t is list or t is tuple:
            return all(_memo_value(e, inputs) for e in out)
        return t in _PLAIN_KEYS or t is float

    def _keep(out):
        """Record the tensors of a memoized result (`_MEMO_TENSORS`), each
        with its key (`_memo_key` reads no value from it again)."""
        if type(out) is _TENSOR:
            _MEMO_TENSORS.add(out)
            if _KEY_ATTR not in out.__dict__:  # (a cached constant has its own)
                out.__dict__[_KEY_ATTR] = _kept_key(out)
        elif type(out) is list or type(out) is tuple:
            for e in out:
                _keep(e)

    def memoize_scalars(fn):
        """`fn`, a pure function of scalars (scale arithmetic), with its
        results memoized by its arguments' values on eager torch.

        Scale rules compute the same scales step after step from the same
        inputs (weights' scales change at most once per optimizer step,
        activations' follow from them), and on eager torch each scalar op
        costs a dispatch (1-2 µs, and the Python around it). A call whose
        arguments are all 0-d CPU tensors (float32, int32, bool, without a
        gradient) or Python scalars, at least one a tensor, returns the
        tensors `fn` returned for the same values before (`item()` reads
        a CPU tensor without a device synchronization). Other calls (a
        GPU tensor, NaN, while `torch.compile` traces, in inference mode)
        run `fn`. The results are the same bit for bit: `fn` must depend
        on nothing but its arguments, and no one may write its results in
        place."""
        cache = {}

        def wrapper(*args):
            if _MEMO_OFF or _is_compiling() or _is_inference():
                return fn(*args)
            tensors = []
            try:
                key = _memo_key(args, tensors)
            except RuntimeError:  # e.g. `item()` under a functorch transform
                key = _MISS
            if key is _MISS or not tensors:
                return fn(*args)
            try:
                out = cache[key]
            except KeyError:
                out = fn(*args)
                if not _memo_value(out, tensors):
                    return out
                if len(cache) >= 4096:
                    cache.clear()
                cache[key] = out
                _keep(out)
            return list(out) if type(out) is list else out

        wrapper.__name__ = fn.__name__
        wrapper.__qualname__ = fn.__qualname__
        wrapper.__doc__ = fn.__doc__
        wrapper.__wrapped__ = fn
        return wrapper

    def signature(x):
        """A hashable key of what a rule's static analysis reads of tensor
        `x` (shape, dtype, device) on eager torch, where that analysis
        would otherwise run on every call: None elsewhere (a traced step
        runs it once per trace) and under `torch.compile`."""
        if (type(x) is not _TENSOR and type(x) is not _PARAMETER) or _is_compiling():
            return None
        return (x.shape, x.dtype, x.device)

else:
    def signature(x):
        """None: traced steps run a rule's static analysis once per trace."""
        return None

    def memoize_scalars(fn):
        """`fn` itself: JAX and TensorFlow trace the step, so its scale
        arithmetic runs once per trace, not per step. (Running each such
        function as one XLA call on TensorFlow, whose CPU steps Keras runs
        without XLA, measured no faster: 1.25-1.27x against 1.22-1.24x
        on the GPT.)"""
        return fn
