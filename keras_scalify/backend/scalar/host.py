"""What the host knows of scalar tensors' values. On eager torch: value
keys, kept on a tensor (a memo's result, a variable's detached scalar at
its version, a cached constant) or read for free from a 0-d CPU tensor;
`host_value` and the multiplies by one it lets the rules skip (`is_one`,
`unless_one`); `kept`; the scopes that turn memoization and free host
reads off (`memo_disabled`, `host_reads_disabled`); and the count of
reads that synchronize a device (`synchronizing_reads`). On JAX and
TensorFlow the host knows only Python numbers (`unless_one` may choose at
run time on a TensorFlow graph)."""

import contextlib
import itertools
import math

from keras_scalify.backend.scalar.base import TORCH

# The size from which `unless_one` skips a multiply by 1 at run time on a
# TensorFlow graph: below it, the conditional's own ops cost about as much
# as the pass.
UNLESS_ONE_MIN_ELEMENTS = 2**15


if TORCH:
    import torch

    from keras_scalify.backend.scalar.base import _NUMBERS
    from keras_scalify.backend.scalar.base import _TENSOR
    from keras_scalify.backend.scalar.base import _is_compiling
    from keras_scalify.backend.scalar.base import _is_inference

    _KEY_CODES = {torch.float32: "f", torch.int32: "i", torch.bool: "b"}
    _MISS = object()
    _MEMO_OFF = []  # non-empty inside `memo_disabled()`

    _HOST_READS_OFF = []  # non-empty inside `host_reads_disabled()`
    _TOKENS = itertools.count()
    _SYNCHRONIZING_READS = [0]

    # The attribute under which a memoized result's tensor keeps its key
    # (its value never changes: no one writes a memo's results in place).
    _KEY_ATTR = "_ksc_memo_key"
    # The attribute under which a variable's detached scalar keeps its key
    # with the version it holds for (`detached_variable_value`).
    _VERSIONED_KEY_ATTR = "_ksc_versioned_memo_key"

    @contextlib.contextmanager
    def memo_disabled():
        """A scope in which `memoize_scalars` functions compute every call
        and `host_value` reads nothing (to compare a result with that of
        the tensor ops it shortcuts)."""
        _MEMO_OFF.append(True)
        try:
            yield
        finally:
            _MEMO_OFF.pop()

    @contextlib.contextmanager
    def host_reads_disabled():
        """A scope in which CPU tensors are read as a GPU's: no free read
        (`host_value` of a tensor whose value the host has not kept is
        None, a memo takes no key from one), and the reads the host does
        to keep a value count in `synchronizing_reads`. Runs a GPU's code
        paths on a CPU (tests)."""
        _HOST_READS_OFF.append(True)
        try:
            yield
        finally:
            _HOST_READS_OFF.pop()

    def _stored_key(x):
        """The key kept on tensor `x` (a memo's result, a variable's
        detached scalar at its current version, a cached constant; an
        identity token included), or None."""
        attrs = x.__dict__
        key = attrs.get(_KEY_ATTR)
        if key is None:
            versioned = attrs.get(_VERSIONED_KEY_ATTR)
            if versioned is not None and versioned[0] == x._version:
                key = versioned[1]
        return key

    def _known_key(x):
        """The value key the host keeps for tensor `x` (`_stored_key`), or
        None (none kept, or an identity token)."""
        key = _stored_key(x)
        return None if key is None or key[0] == "t" else key

    def _key_value(key):
        """The Python value of a value key (`_value_key`)."""
        return math.copysign(key[1], key[2]) if len(key) == 3 else key[1]

    def _read_key(x):
        """The value key of a 0-d float32 / int32 / bool tensor `x` without
        a gradient, read with `item()` on any device (on a GPU a device
        synchronization, counted by `synchronizing_reads`); `_MISS` for
        others, for NaN and on the meta device (a symbolic call's, no
        values)."""
        code = _KEY_CODES.get(x.dtype)
        if code is None or x.dim() != 0 or x.requires_grad or x.is_meta:
            return _MISS
        _count_read(x)
        return _value_key(code, x.item())

    def _kept_key(x):
        """The key of a tensor whose value never changes under it (a memo's
        result, a variable's detached scalar at one version), read once
        (`_read_key`: on a GPU one synchronization, after which memos hit
        on it and `host_value` knows it as on a CPU); where it cannot be
        read, a key never given before (`_TOKENS`: memos still hit on it
        by identity)."""
        key = _read_key(x)
        return ("t", next(_TOKENS)) if key is _MISS else key

    def _count_read(x):
        if not x.is_cpu or _HOST_READS_OFF:
            _SYNCHRONIZING_READS[0] += 1

    def on_host(x):
        """Whether tensor `x` is on the CPU, outside `host_reads_disabled()`
        (which runs a GPU's paths on a CPU): the CPU-only fused nodes of
        `backend.fused` take it."""
        return x.device.type == "cpu" and not _HOST_READS_OFF

    def synchronizing_reads():
        """How many values the host has read from tensors where a read is
        not free (a GPU's, or any inside `host_reads_disabled()`): each a
        device synchronization on a GPU."""
        return _SYNCHRONIZING_READS[0]

    def _value_key(code, v):
        if v != v:
            return _MISS
        if v == 0 and code != "b":
            return (code, v, math.copysign(1.0, v))
        return (code, v)

    def host_value(x):
        """The value of scalar `x` as a Python float where the host has it
        for free: a Python number, a 0-d CPU tensor without gradient on
        eager torch (`item()` there reads memory, no device sync), or a
        0-d tensor on any device whose value the host has kept
        (`_known_key`: a memo's result, a variable's detached scalar, a
        cached constant). None elsewhere (another GPU tensor,
        `torch.compile`, a tensor that needs a gradient, inside
        `memo_disabled()`)."""
        if type(x) in _NUMBERS:
            return float(x)
        if _MEMO_OFF or type(x) is not _TENSOR or x.ndim != 0 or x.requires_grad or _is_compiling():
            return None
        key = _known_key(x)
        if key is not None:
            return _key_value(key)
        if x.is_cpu and not _HOST_READS_OFF:
            return x.item()
        return None

    def is_one(x):
        """Whether scalar `x` is known on the host to be exactly 1
        (`host_value`): a multiply by it can then be skipped, which saves
        a pass over the data it would scale."""
        return host_value(x) == 1.0

    def unless_one(factor, x, times):
        """`times()` (`x` times `factor`), or `x` where `factor` is known on
        the host to be 1 (`is_one`)."""
        return x if is_one(factor) else times()

    def kept(x):
        """`x`, a 0-d tensor of scale arithmetic computed from data (e.g. a
        bias's rebalancing `P(max|data|)`), with its value key kept on it
        (`_kept_key`: read once, on a GPU a synchronization) where the
        memoized rules it feeds would otherwise find no key (on a GPU, or
        inside `host_reads_disabled()`), so that they hit as on a CPU.
        No one may write `x` in place afterwards."""
        if (
            type(x) is _TENSOR
            and x.ndim == 0
            and not x.requires_grad
            and not _MEMO_OFF
            and (not x.is_cpu or _HOST_READS_OFF)
            and not x.is_meta
            and not _is_compiling()
            and not _is_inference()
            and _KEY_ATTR not in x.__dict__
        ):
            x.__dict__[_KEY_ATTR] = _kept_key(x)
        return x

else:
    from keras_scalify.backend.scalar.base import _TF

    if _TF:
        import tensorflow as _tf

    def host_value(x):
        """A Python number's value; None for tensors (traced backends)."""
        return float(x) if type(x) in (int, float, bool) else None

    def is_one(x):
        """Whether `x` is the Python number 1."""
        return host_value(x) == 1.0

    def unless_one(factor, x, times):
        """`times()` (`x` times `factor`), or `x` where `factor` is 1.

        On a TensorFlow graph that XLA does not compile, for a tensor `x`
        of at least `UNLESS_ONE_MIN_ELEMENTS` elements, the choice is made
        at run time (`tf.cond`, lowered to a switch: the untaken branch
        does not run): a factor of 1, which eager torch sees on the host
        and skips, no longer costs a pass there either (the rescales of
        the GPT of `step_time.py`, ~5 ms of its 2-thread op time per
        step). XLA and jax fuse the multiply into its neighbours, where a
        conditional would split the fusion."""
        if is_one(factor):
            return x
        if _TF and _runtime_choice(x, factor):
            return _tf.cond(_tf.equal(factor, 1.0), lambda: _tf.identity(x), times)
        return times()

    def _runtime_choice(x, factor):
        """Whether `unless_one` chooses with `tf.cond`: a large static-shape
        tensor and a scalar factor of a TensorFlow graph (a `tf.function`
        trace) that XLA does not compile. `control_flow_util`'s XLA test
        is TensorFlow's internal one (no public equivalent): where it is
        missing, no conditional is built."""
        if not (isinstance(x, _tf.Tensor) and isinstance(factor, _tf.Tensor)) or _tf.executing_eagerly():
            return False
        n = x.shape.num_elements()
        if n is None or n < UNLESS_ONE_MIN_ELEMENTS or factor.shape.rank != 0:
            return False
        try:
            from tensorflow.python.ops import control_flow_util
        except ImportError:
            return False
        return not control_flow_util.GraphOrParentsInXlaContext(_tf.compat.v1.get_default_graph())

    def kept(x):
        """`x` (nothing is kept on the host here)."""
        return x

    def memo_disabled():
        """A scope without memoization: there is none here."""
        return contextlib.nullcontext()

    def host_reads_disabled():
        """A scope without host reads: there are none here."""
        return contextlib.nullcontext()

    def synchronizing_reads():
        """No value is read on the host here: 0."""
        return 0
