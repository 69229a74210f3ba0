"""What `ScaledOptimizer` needs from Keras's optimizer internals.

The wrapped (inner) Keras optimizer runs its own update rule on float32
*stand-ins* ("ghost" variables) whose values are supplied through a
`keras.StatelessScope`: the decoded weights and optimizer slots. Three
things make that work on every backend:

- `ghost_variable`: a Keras variable with a shape and a float32 dtype but no
  storage (created the way Keras creates variables lazily, and never
  initialized); outside a scope that maps it, it reads as zeros.
- `use_generic_updates`: the backend optimizer classes route updates around
  `Variable.assign` (TensorFlow writes to the `tf.Variable` for
  `tf.distribute`; torch updates tensors in place with `torch._foreach_*`).
  Binding the backend-independent `BaseOptimizer` methods on the inner
  optimizer makes every write a `Variable.assign`, which a `StatelessScope`
  records. EMA overwrites are selected with `ops.where` instead of
  `ops.cond` (a TensorFlow cond branch cannot record scope updates).
- `run_if`: the step's update where the backend can branch on the skip
  decision (a host read on eager PyTorch, a `tf.cond` on TensorFlow, as
  one XLA computation there for large models), so a taken step writes
  without selects and a skipped one writes nothing; elsewhere the update
  selects each write.
- `assign_all`: the step's writes, in one `torch._foreach_copy_` on eager
  PyTorch.
- `host_bool`: on eager PyTorch, a bool tensor read once on the host (as
  Keras's `LossScaleOptimizer` does there through `ops.cond`), so a
  finite step writes its updates without selects and a skipped one writes
  none (`run_if`); JAX, TensorFlow graphs and `torch.compile` keep the
  tensor.
- `bound_ghosts`: on eager PyTorch's native update, the ghosts read as
  the decoded tensors themselves (no scope).
- `scale_folds`: on eager PyTorch's native update by Adam, AdamW or Lion,
  a float32 weight is updated on its stored data with the learning rate
  divided by its scale, instead of being decoded and re-encoded.
- `GuardedScope`: a `keras.StatelessScope` whose every recorded update is
  `where(guard, new, old)`. A skipped step then leaves the inner
  optimizer's slots unchanged *within* the update, so its weight update
  reads the very slot values that are stored (XLA updates donated buffers
  in place: a weight update reading the unselected slots next to the
  stored ones cost a copy of every slot per step).
"""


import contextlib
import functools
import math
import types

import keras
from keras import ops
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.optimizers.base_optimizer import BaseOptimizer

from keras_scalify.backend import scalar as S

_GENERIC = (
    "assign",
    "assign_add",
    "assign_sub",
    "_var_key",
    "_apply_weight_decay",
    "_backend_update_step",
)


def ghost_variable(shape, name, path=None, layout=None):
    """A float32 Keras variable of `shape` that holds no storage (`path`:
    the model variable it stands for, so slots are named after it;
    `layout`: that variable's layout under a `keras.distribution`, which
    Keras's `add_variable_from_reference` gives the slots made for it)."""
    with keras.StatelessScope(initialize_variables=False):
        v = keras.Variable(
            initializer="zeros", shape=shape, dtype="float32", trainable=False, name=name
        )
    pending = global_state.get_global_attribute("uninitialized_variables", [])
    if any(p is v for p in pending):
        pending[:] = [p for p in pending if p is not v]
    if path is not None:
        v._path = path
    if layout is not None:
        v._layout = layout
    v._ksc_ghost = True
    return v


def refuse_tf_distribute():
    """Raise under a TensorFlow `tf.distribute` strategy (other than the
    default): `ScaledOptimizer` writes every update with `Variable.assign`
    in the replica (no cross-replica all-reduce of the gradients, no
    `extended.update` of mirrored variables), and its inner optimizer's
    slots are made for ghost weights, which a strategy cannot colocate."""
    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf

    if tf.distribute.has_strategy():  # (a strategy other than the default)
        raise ValueError(
            f"ScaledOptimizer does not support tf.distribute (running under "
            f"{type(tf.distribute.get_strategy()).__name__}): its update "
            "does not all-reduce gradients across replicas. Train on one "
            "device, or on JAX with keras.distribution (DataParallel, "
            "ModelParallel), which it supports."
        )


def is_ghost(variable):
    return getattr(variable, "_ksc_ghost", False)


def use_generic_updates(optimizer):
    """Make `optimizer` write every update through `Variable.assign`."""
    optimizer._ksc_native = {
        name: getattr(optimizer, name)
        for name in _NATIVE
        if getattr(type(optimizer), name) is not getattr(BaseOptimizer, name)
    }
    for name in _GENERIC:
        setattr(optimizer, name, types.MethodType(getattr(BaseOptimizer, name), optimizer))
    optimizer._backend_apply_gradients = types.MethodType(_apply_gradients, optimizer)


# The torch optimizers' own update: `torch._foreach_*` in place on each
# variable's `.value` (in a StatelessScope, the mapped tensor).
_NATIVE = ("_backend_update_step", "_apply_weight_decay")


@contextlib.contextmanager
def native_updates(optimizer, guard):
    """On eager PyTorch with `guard` True (the step is taken): `optimizer`
    runs Keras's own in-place `torch._foreach_*` update (under
    `torch.no_grad`) on the values the scope maps (decoded weights and
    slots: tensors of this step, or float32 data decoded in its own
    variable, which is then updated there), instead of
    one `Variable.assign` per slot and per pass (2.4x the plain Keras MLP
    step). Elsewhere the generic updates stay: JAX and TensorFlow have no
    such path, and a guard that is a tensor needs recorded assignments.
    Yields whether the native update runs (the mapped values are then this
    step's tensors, updated in place)."""
    native = getattr(optimizer, "_ksc_native", {})
    if guard is not True or keras.backend.backend() != "torch" or not native:
        yield False
        return
    import torch

    generic = {name: optimizer.__dict__[name] for name in native}
    optimizer.__dict__.update(native)
    try:
        # (Weights are updated in place in their variables.)
        with torch.no_grad():
            yield True
    finally:
        optimizer.__dict__.update(generic)


@functools.cache
def _scale_folding_types():
    """Keras's torch optimizers whose native update writes a variable
    once, as `variable += learning_rate · f(gradient, slots, iterations)`,
    with slots that never see the learning rate or the variable (found by
    reading `keras/src/backend/torch/optimizers`; a subclass may differ,
    so exact types only). Their weight decay multiplies the variable by a
    factor."""
    from keras.src.backend.torch.optimizers import torch_adam
    from keras.src.backend.torch.optimizers import torch_adamw
    from keras.src.backend.torch.optimizers import torch_lion

    return (torch_adam.Adam, torch_adamw.AdamW, torch_lion.Lion)


# Elements of the weights that share one folded scale below which their
# decode and re-encode (two passes) cost no more than one more run of
# Keras's update (~12 `torch._foreach_*` calls and its scalar ops). On a
# 2-core Xeon the two passes took ~0.75 ns per element (the MLP of
# `benchmarks/step_time.py`, 1.86M elements in one group: its optimizer
# step 19.8 -> 18.4 ms); the GPT's two groups of 131k and 262k elements
# gained nothing measurable.
FOLD_MIN_ELEMENTS = 2**19

# The largest |log2| of a folded scale.
FOLD_MAX_EXPONENT = 32


def _folds_scales(optimizer):
    return (
        not optimizer.use_ema
        and bool(getattr(optimizer, "_ksc_native", None))
        and type(optimizer) in _scale_folding_types()
    )


def scale_folds(optimizer, scales, sizes):
    """For eager PyTorch's bound native update (`native_updates`,
    `bound_ghosts`): per weight, `1/scale` as a Python float where the
    weight may be updated on its stored float32 data `d` (`W = d·scale`)
    with the learning rate times that factor, else None.

    `optimizer` must be Keras's torch Adam, AdamW or Lion (exact type,
    without EMA). Their update of `d` with `learning_rate / scale` is
    their update of `W` divided by `scale`, bit for bit: every factor is a
    power of two, and an exact pow2 product commutes with rounding (an
    intermediate within 2**FOLD_MAX_EXPONENT of float32's subnormal range
    could differ; the window keeps realistic steps far from it). Weight
    decay multiplies `d` as it would `W`. So two passes per weight
    (decode, re-encode) go. A group of weights sharing a factor is folded
    when it holds at least FOLD_MIN_ELEMENTS elements (each group runs
    the update once more).

    Args:
        scales: per candidate weight its pow2 scale (a 0-d tensor, folded
            where the host knows its value: `backend.scalar.host_value`),
            or None for a weight that is not a candidate (not float32
            data, a constraint).
        sizes: their element counts.
    """
    out = [None] * len(scales)
    if keras.backend.backend() != "torch" or not _folds_scales(optimizer):
        return out
    import torch

    if torch.compiler.is_compiling():
        return out
    groups = {}
    for i, scale in enumerate(scales):
        # (Known on the host: a CPU read, or a value kept on any device.)
        value = None if scale is None else S.host_value(scale)
        if value is None:
            continue
        # A normal pow2 whose reciprocal moves the learning rate by at most
        # 2**FOLD_MAX_EXPONENT.
        mantissa, exponent = math.frexp(value)
        if mantissa != 0.5 or abs(exponent - 1) > FOLD_MAX_EXPONENT:
            continue
        groups.setdefault(value, []).append(i)
    for value, members in groups.items():
        if sum(sizes[i] for i in members) >= FOLD_MIN_ELEMENTS:
            for i in members:
                out[i] = 1.0 / value
    return out


@contextlib.contextmanager
def bound_ghosts(pairs, lr_factors=None):
    """For eager PyTorch's native update (`native_updates`): each ghost
    of `(ghost, tensor)` in `pairs` reads as `tensor` itself while the
    block runs (its storage: Keras's private `Variable._value`, which
    `Variable.value` returns outside a scope), so the update changes
    these tensors in place and the optimizer's other variables are updated
    where they are, with no `StatelessScope` mapping every value (~200
    per step of the GPT in `benchmarks/step_time.py`, ~0.4 ms of
    conversions and checks). The ghosts hold no storage again after.

    `lr_factors`: `{id(ghost): factor}` of the ghosts bound to stored data
    whose update runs with the learning rate times `factor`
    (`scale_folds`)."""
    lr_factors = lr_factors or {}
    for ghost, tensor in pairs:
        ghost._value = tensor
        if id(ghost) in lr_factors:
            ghost._ksc_lr_factor = lr_factors[id(ghost)]
    try:
        yield
    finally:
        for ghost, _ in pairs:
            ghost._value = None
            ghost.__dict__.pop("_ksc_lr_factor", None)


def host_bool(x):
    """`x` (a bool scalar tensor) as a Python bool on eager PyTorch, where
    every select over a weight is a full pass of its own (4 per weight per
    step: 1/3 of an MLP step); None elsewhere (keep the tensor)."""
    if keras.backend.backend() != "torch":
        return None
    import torch

    if torch.compiler.is_compiling():
        return None
    return bool(x)


def owned_gradient(gradient, variable):
    """Whether `gradient` is `variable`'s own autograd `.grad` (eager
    PyTorch: Keras's torch trainer passes these, and clears them before
    the next backward pass): the optimizer may then scale it in place, as
    `torch.amp.GradScaler` unscales gradients, instead of writing a
    weight-sized copy. False elsewhere."""
    if keras.backend.backend() != "torch":
        return False
    value = getattr(variable, "value", None)
    return gradient is not None and gradient is getattr(value, "grad", None)


# Weight elements above which TensorFlow runs the optimizer step as one XLA
# computation (`run_if(fuse=True)`).
FUSE_MIN_ELEMENTS = 2**20


def run_if(pred, update, fuse=False):
    """Run `update(guard)` so that its writes take effect only where the
    bool scalar tensor `pred` holds.

    - Eager PyTorch: `pred` is read on the host; `update(True)` runs or
      nothing does.
    - TensorFlow (outside a stateless scope): `update(True)` runs in the
      true branch of a `tf.cond`, as Keras's `LossScaleOptimizer` applies
      its step there: no `where(pred, new, old)` over every weight and
      slot. With `fuse` (inside a `tf.function`), the branch is one XLA
      computation (`jit_compile=True`), which fuses the decode, update and
      re-encode passes over each weight: worth it when the weights are
      large (the MLP of `benchmarks/step_time.py`, 1.9M weights: 9.3 → 8.3
      ms per step); with many small weights one XLA launch costs more than
      TensorFlow's executor running the small updates side by side (the
      GPT there, 0.4M weights in 35 variables: 20.2 → 21.7 ms).
    - JAX, `torch.compile`, stateless scopes: `update(pred)`, which
      selects each write.
    """
    known = host_bool(pred)
    if known is not None:
        if known:
            update(True)
        return
    if keras.backend.backend() == "tensorflow" and not in_stateless_scope():
        import tensorflow as tf

        def taken():
            if fuse and tf.inside_function():
                tf.function(lambda: update(True), jit_compile=True, autograph=False)()
            else:
                update(True)
            return tf.constant(True)

        tf.cond(pred, taken, lambda: tf.constant(False))
        return
    update(pred)


def assign_all(pairs):
    """`variable.assign(value)` for each `(variable, value)`. On eager
    PyTorch outside a stateless scope, one `torch._foreach_copy_` into the
    variables' tensors, as Keras's torch optimizers write their updates
    (`Variable.assign` converts and checks each value: ~10 µs apiece,
    ~180 per GPT step)."""
    pairs = list(pairs)
    if keras.backend.backend() == "torch" and pairs:
        import torch

        if not torch.compiler.is_compiling() and not in_stateless_scope():
            # A float32 slot updated in place by the native update is the
            # variable's own tensor: nothing to copy.
            pairs = [(t, x) for t, x in ((S.variable_value(v), x) for v, x in pairs) if x is not t]
            if pairs:
                with torch.no_grad():
                    torch._foreach_copy_(
                        [t for t, _ in pairs], [torch.as_tensor(x, device=t.device) for t, x in pairs]
                    )
                S.note_written(pairs)
            return
    for variable, value in pairs:
        variable.assign(value)


def cond(pred, true_fn, false_fn):
    """`keras.ops.cond`, except where both branches run and `where`
    selects:
    - under `torch.compile`, where Keras's cond is a Python `if` on a
      tensor (a graph break per call);
    - on jax under a `keras.distribution`: a branch that reduces a sharded
      weight holds collectives, and XLA's CPU runtime ran a conditional's
      collectives unreliably: across processes (gloo) they mismatched (a
      2-process ModelParallel run aborted with "collective mismatch"), and
      within one process of 8 devices a run hung now and then
      (`examples/distributed.py`). The branches here are a weight-sized
      read at most (the rescale's RMS)."""
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        if torch.compiler.is_compiling():
            return ops.where(pred, true_fn(), false_fn())
    if backend == "jax":
        import jax

        if jax.process_count() > 1 or keras.distribution.distribution() is not None:
            return ops.where(pred, true_fn(), false_fn())
    return ops.cond(pred, true_fn, false_fn)


class GuardedScope(keras.StatelessScope):
    """A `keras.StatelessScope` that keeps each variable's current value
    where the bool tensor `guard` is false."""

    def __init__(self, guard, state_mapping=None, **kwargs):
        super().__init__(state_mapping=state_mapping, **kwargs)
        self.guard = guard

    def add_update(self, update):
        variable, value = update
        old = self.get_current_value(variable)
        if old is not None and self.guard is not True:
            value = ops.where(self.guard, value, old)
        super().add_update((variable, value))


def _apply_gradients(self, grads, trainable_variables):
    """Clip, decay, update, then EMA: Keras's order, without `ops.cond`."""
    grads = self._clip_gradients(grads)
    self._apply_weight_decay(trainable_variables)
    # Ghosts bound with a learning-rate factor (`scale_folds`) are updated
    # in groups that share it.
    groups = {}
    for grad, variable in zip(grads, trainable_variables):
        factor = getattr(variable, "_ksc_lr_factor", 1.0)
        groups.setdefault(factor, ([], []))
        groups[factor][0].append(grad)
        groups[factor][1].append(variable)
    learning_rate = self.learning_rate
    for factor, (group_grads, group_vars) in groups.items():
        lr = learning_rate if factor == 1.0 else learning_rate * factor
        self._backend_update_step(group_grads, group_vars, lr)
    if self.use_ema:
        self._update_model_variables_moving_average(self._trainable_variables)
        if self.ema_overwrite_frequency:
            due = ops.equal((self.iterations + 1) % self.ema_overwrite_frequency, 0)
            for var, average in zip(
                self._trainable_variables, self._model_variables_moving_average
            ):
                var.assign(ops.where(due, average.value, var.value))
