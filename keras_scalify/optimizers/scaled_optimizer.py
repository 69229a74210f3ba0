"""`ScaledOptimizer`: any Keras optimizer on scaled weights."""

import math

import keras
import numpy as np
from keras import ops
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.utils import tracking

from keras_scalify.backend import scalar as S
from keras_scalify.backend.scalar import dtype_name
from keras_scalify.backend.optimizer import ghost_variable
from keras_scalify.backend.optimizer import is_ghost
from keras_scalify.backend.optimizer import native_updates
from keras_scalify.backend.optimizer import owned_gradient
from keras_scalify.backend.optimizer import GuardedScope
from keras_scalify.backend.optimizer import assign_all
from keras_scalify.backend.optimizer import bound_ghosts
from keras_scalify.backend.optimizer import host_bool
from keras_scalify.backend.optimizer import refuse_tf_distribute
from keras_scalify.backend.optimizer import run_if
from keras_scalify.backend.optimizer import scale_folds
from keras_scalify.backend.optimizer import FUSE_MIN_ELEMENTS
from keras_scalify.backend.optimizer import use_generic_updates
from keras_scalify.layers.variable import effective_grad_scale
from keras_scalify.layers.variable import read_tensor
from keras_scalify.ops.rescaling import grad_scale_from_statistic
from keras_scalify.ops.rescaling import host_grad_scale
from keras_scalify.optimizers import state

STATE_DTYPES = ("float32", "float16", "bfloat16")


@keras.saving.register_keras_serializable(package="keras_scalify")
class ScaledOptimizer(keras.optimizers.Optimizer):
    """Runs a Keras optimizer on the weights that scaled layers represent.

    Each step, for every `ScaledVariable`:
    1. the gradient is decoded, `G = g_data · grad_scale` (float32), and the
       weight `W = data · scale`;
    2. the inner optimizer's own `apply` runs on these float32 values (its
       clipping, weight decay, learning-rate schedule, EMA, `iterations`),
       with its slots decoded from their stored form;
    3. the new `W` is stored back as `data × scale` with the scale unchanged
       (moved to the data's RMS every `rescale_every` steps, exactly), in the
       master dtype, rounded stochastically when that is float16/bfloat16;
       slots are stored in `state_dtype`, re-scaled from their max each
       step when that is float16/bfloat16;
    4. the weight's gradient scale is set from this gradient's RMS, so the
       next gradient arrives near unit RMS in data units.

    If any gradient is not finite the step is skipped: weights, slots and
    the inner optimizer's variables keep their values bit for bit and
    `skipped_steps` counts it; gradient scales and delayed-rescaling states
    still update, which is how they recover. Plain (unscaled) trainable
    variables are updated by the inner optimizer as usual.

    Args:
        inner_optimizer: an unbuilt `keras.optimizers.Optimizer` (SGD, Adam,
            AdamW, Lion, Adafactor, ...). It is owned by this optimizer.
        state_dtype: storage of optimizer slots: "float32", "float16" or
            "bfloat16". Default: the `state_dtype` of the scaled layers'
            policy (float32 for plain policies).
        rescale_every: move each weight's scale to its data's RMS every this
            many steps (>= 1).
        stochastic_rounding: round float16/bfloat16 master weights
            stochastically (else to nearest, which loses updates below half
            a unit in the last place).
        seed: seed of the stochastic rounding.
        name: the optimizer's name.
        gradient_accumulation_steps: update every this many steps (>= 2)
            with the mean of their gradients, as Keras does; it may be set
            on the inner optimizer instead. The sums are stored in
            `state_dtype`.
    """

    def __init__(
        self,
        inner_optimizer,
        state_dtype=None,
        rescale_every=10,
        stochastic_rounding=True,
        seed=None,
        name=None,
        **kwargs,
    ):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer) or isinstance(
            inner_optimizer, (ScaledOptimizer, keras.optimizers.LossScaleOptimizer)
        ):
            raise TypeError(
                "`inner_optimizer` must be a Keras optimizer such as "
                "keras.optimizers.AdamW(...) (not a ScaledOptimizer or a "
                f"LossScaleOptimizer), got {inner_optimizer!r}."
            )
        if inner_optimizer.built:
            raise ValueError(
                "`inner_optimizer` must not be built yet: ScaledOptimizer "
                "builds it on the decoded weights."
            )
        steps = _accumulation_steps(kwargs.pop("gradient_accumulation_steps", None), inner_optimizer)
        # The wrapper accumulates (decoded gradients, in `state_dtype`
        # slots); the inner optimizer applies their mean, and counts
        # micro-steps as Keras's accumulation does (its `iterations` the
        # updates, its learning-rate schedule the micro-steps).
        inner_optimizer.gradient_accumulation_steps = steps
        _refuse_base_arguments(kwargs)
        if state_dtype is not None:
            state_dtype = _check_state_dtype(state_dtype, "state_dtype")
        if not isinstance(rescale_every, (int, np.integer)) or isinstance(rescale_every, bool) or rescale_every < 1:
            raise ValueError(f"`rescale_every` must be an integer >= 1, got {rescale_every!r}.")
        super().__init__(learning_rate=0.0, name=name, gradient_accumulation_steps=steps, **kwargs)
        self.inner_optimizer = inner_optimizer
        self.state_dtype = state_dtype
        self.rescale_every = int(rescale_every)
        if not isinstance(stochastic_rounding, (bool, np.bool_)):
            raise TypeError(
                f"`stochastic_rounding` must be True or False, got "
                f"{stochastic_rounding!r}."
            )
        if seed is not None and (
            not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
        ):
            raise TypeError(f"`seed` must be None or an int, got {seed!r}.")
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = seed
        self._ksc_accepts_scaled = True
        self._inner_key = inner_optimizer._var_key
        use_generic_updates(inner_optimizer)

    # --- build ----------------------------------------------------------------

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        if self.built:
            return
        refuse_tf_distribute()
        var_list = list(var_list)
        resolved = self._resolve_state_dtype(var_list)
        self._entries = []  # per variable: (kind, sv or None, inner variable)
        inner_vars = []
        for v in var_list:
            sv = getattr(v, "_ksc_scaled_variable", None)
            if sv is not None and v is sv.data:
                ghost = ghost_variable(v.shape, v.name, v.path, getattr(v, "_layout", None))
                ghost.constraint = v.constraint
                self._entries.append(("weight", sv, ghost))
                inner_vars.append(ghost)
            elif sv is not None:
                self._entries.append(("scale", sv, None))
            elif v.overwrite_with_gradient:
                self._entries.append(("overwrite", None, None))
            else:
                self._entries.append(("plain", None, v))
                inner_vars.append(v)
        self._inner_vars = inner_vars
        # The element counts of the scaled weights, in `_entries` order.
        self._weight_sizes = [math.prod(sv.data.shape) for kind, sv, _ in self._entries if kind == "weight"]
        self._resolved_state_dtype = resolved
        self._slots = []  # (ghost, stored data, stored scale or None)
        self._accumulators = []  # the same, per inner variable
        self._slot_sink = self._slots
        inner = self.inner_optimizer
        inner.add_variable = self._make_slot
        # (Without its own accumulators: the wrapper's replace them.)
        steps, inner.gradient_accumulation_steps = inner.gradient_accumulation_steps, None
        try:
            inner.build(inner_vars)
            if steps:
                self._slot_sink = self._accumulators
                for v in inner_vars:
                    inner.add_variable_from_reference(v, "gradient_accumulator")
        finally:
            del inner.add_variable
            inner.gradient_accumulation_steps = steps
        self._translate_weight_decay_exclusions()
        self._seed_generator = keras.random.SeedGenerator(self.seed)
        self._skipped_steps = self.add_variable(
            shape=(), initializer="zeros", dtype="int32", name="skipped_steps"
        )
        # (Keras's base build would add float32 accumulators of every
        # variable, scales included: the ones above replace them.)
        steps, self.gradient_accumulation_steps = self.gradient_accumulation_steps, None
        try:
            super().build(var_list)
        finally:
            self.gradient_accumulation_steps = steps

    def _resolve_state_dtype(self, var_list):
        if self.state_dtype is not None:
            return self.state_dtype
        found = {
            v._ksc_scaled_variable.state_dtype
            for v in var_list
            if getattr(v, "_ksc_scaled_variable", None) is not None
        }
        if len(found) > 1:
            raise ValueError(
                f"The scaled layers' policies ask for optimizer state in {sorted(found)}: "
                "pass `state_dtype` to ScaledOptimizer."
            )
        return _check_state_dtype(found.pop() if found else "float32", "policy state_dtype")

    def _make_slot(self, shape, initializer="zeros", dtype=None, aggregation="none", layout=None, name=None):
        """Stands in for the inner optimizer's `add_variable` during its build:
        float slots become a float32 ghost (what the inner rule sees) plus
        stored data (and a pow2 scale) owned by this optimizer. The stored
        data takes `layout` (its weight's, under a `keras.distribution`);
        the scalar scale is replicated."""
        if dtype is not None and not _is_float(dtype):
            return type(self.inner_optimizer).add_variable(
                self.inner_optimizer, shape, initializer, dtype, aggregation, layout, name
            )
        shape = tuple(shape)
        ghost = ghost_variable(shape, name, layout=layout)
        init = keras.initializers.get(initializer)
        dtype = self._resolved_state_dtype

        def encoded(part):
            def initializer(shape, dtype=None):
                value = ops.cast(init(shape, dtype="float32"), "float32")
                return state.encode_slot(value, dtype_)[part]

            dtype_ = dtype
            return initializer

        stored = self.add_variable(
            shape=shape, initializer=encoded(0), dtype=dtype, aggregation=aggregation, name=name,
            layout=layout,
        )
        stored_scale = None
        if dtype != "float32":
            stored_scale = self.add_variable(
                shape=(),
                initializer=lambda shape, dtype=None: ops.reshape(encoded(1)(tuple(ghost.shape)), shape),
                dtype="float32",
                aggregation=aggregation,
                name=f"{name}_scale",
            )
        self._slot_sink.append((ghost, stored, stored_scale))
        return ghost

    def _translate_weight_decay_exclusions(self):
        """`exclude_from_weight_decay(var_list=...)` recorded model variables;
        the inner optimizer now sees their ghosts."""
        inner = self.inner_optimizer
        excluded = getattr(inner, "_exclude_from_weight_decay", None)
        if not excluded:
            return
        for kind, sv, v in self._entries:
            model_var = sv.data if kind == "weight" else v
            if kind in ("weight", "plain") and self._inner_key(model_var) in excluded:
                excluded.add(id(v))

    # --- the inner optimizer's view --------------------------------------------

    @property
    def variables(self):
        own = list(self._variables)
        if getattr(self, "_seed_generator", None) is not None:
            own.append(self._seed_generator.state)
        return own + [v for v in self.inner_optimizer.variables if not is_ghost(v)]

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def skipped_steps(self):
        """How many steps were skipped for non-finite gradients (0 before
        the optimizer is built: a model without trainable weights never
        builds it on TensorFlow)."""
        if not self.built:
            return ops.zeros((), "int32")
        return self._skipped_steps

    def scale_loss(self, loss):
        """The inner optimizer's `scale_loss`, times a factor that is 1 when
        the loss is finite and NaN otherwise: its gradients are then NaN
        and the step is skipped. A finite gradient of an infinite loss
        (mse against 1e30) would otherwise be applied. Keras's trainers
        call it on every backend; a custom loop must call it itself."""
        loss = self.inner_optimizer.scale_loss(loss)
        if loss is None:
            return loss
        known = S.host_value(S.stop_gradient(loss))
        if known is not None and math.isfinite(known):
            return loss  # (the factor would be 1; eager torch on a CPU)
        finite = ops.all(ops.isfinite(ops.stop_gradient(loss)))
        one = ops.ones((), loss.dtype)
        return loss * ops.where(finite, one, one * float("nan"))

    # --- apply -----------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "ScaledOptimizer must be built (or given `trainable_variables`) "
                    "before `apply(grads)`."
                )
            trainable_variables = self._trainable_variables
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
            self._check_variables_are_known(trainable_variables)
        grads = list(grads)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                f"`grads` has {len(grads)} entries for {len(trainable_variables)} variables."
            )
        by_index = {self._get_variable_index(v): g for g, v in zip(grads, trainable_variables)}
        with keras.name_scope(self.name, caller=self):
            self._apply(by_index)

    def _apply(self, by_index):
        inner_grads, checks, always = [], [], []
        weights = []  # (sv, ghost, scale)
        measured = []  # (index in inner_grads, sv, scale, gradient)
        for i, (kind, sv, v) in enumerate(self._entries):
            g = by_index.get(i)
            if kind == "scale":
                continue
            if kind == "overwrite":
                if g is not None:
                    always.append((self._trainable_variables[i], g))
                continue
            if kind == "weight":
                # (Detached: on eager torch a scale variable's tensor
                # requires a gradient, which no memoized scalar function
                # or host read takes: 3 scalar ops per weight per step.)
                scale = sv.read_scale()
                weights.append((sv, v, scale))
                if g is not None:
                    measured.append((len(inner_grads), sv, scale, g))
            elif g is not None:
                checks.append(ops.all(ops.isfinite(g)))
            inner_grads.append(g)
        if measured:
            checks.append(self._calibrate(measured, inner_grads, always))
        # (A check the host decided is a Python bool.)
        if any(c is False for c in checks):
            finite = False
        else:
            tensors = [c for c in checks if c is not True]
            finite = tensors[0] if tensors else (True if checks else ops.ones((), "bool"))
            for c in tensors[1:]:
                finite = S.logical_and(finite, c)

        # A skipped step writes nothing but the grad scales and counters.
        taken = finite
        if self.gradient_accumulation_steps:
            taken, inner_grads = self._accumulate(inner_grads, finite)
        elements = sum(self._weight_sizes)
        run_if(
            taken,
            lambda guard: self._update(weights, inner_grads, guard),
            fuse=elements >= FUSE_MIN_ELEMENTS,
        )
        assign_all(always)
        if finite is not True:  # (a Python bool where the host decided)
            self._skipped_steps.assign_add(ops.cast(ops.logical_not(finite), "int32"))
        self._iterations.assign_add(1)

    def _accumulate(self, inner_grads, finite):
        """Gradient accumulation as Keras's: each finite micro-step adds its
        decoded gradients to the accumulators (stored in `state_dtype`);
        every `gradient_accumulation_steps`-th one instead hands the inner
        optimizer `(g + accumulated) / steps` and resets them. A skipped
        micro-step does not count: the inner optimizer's micro-step
        counter (Keras's private `_iterations`, which its `iterations`
        divides by the steps) moves on the others. Returns `(whether the
        update runs, its gradients)`."""
        steps = self.gradient_accumulation_steps
        counter = self.inner_optimizer._iterations
        count = read_tensor(counter)
        due = ops.equal((count + 1) % steps, 0)
        known = host_bool(due)
        due = due if known is None else known
        accs = [
            state.decode(read_tensor(d), None if s is None else read_tensor(s))
            for _, d, s in self._accumulators
        ]
        sums = [None if g is None else ops.add(g, acc) for g, acc in zip(inner_grads, accs)]

        def write(guard):
            # (A due step's update counts itself.)
            writes = [(counter, _select(due, count, count + 1))]
            for total, acc, (_, d, s) in zip(sums, accs, self._accumulators):
                # (A variable without a gradient keeps its sum until reset.)
                kept = acc if total is None else total
                data, scale = state.encode_slot(
                    _select(due, ops.zeros_like(kept), kept), self._resolved_state_dtype
                )
                writes += [(d, data)] + ([] if s is None else [(s, scale)])
            if guard is not True:
                writes = [(v, ops.where(guard, x, read_tensor(v))) for v, x in writes]
            assign_all(writes)

        run_if(finite, write)
        grads = [None if total is None else total / steps for total in sums]
        return _logical_and(finite, due), grads

    def _calibrate(self, measured, inner_grads, always):
        """Decode the scaled weights' gradients into `inner_grads` and queue
        their next grad scales in `always`; returns whether all are finite.

        One reduction per gradient: its RMS calibrates the grad scale and,
        in true units, decides the skip (a NaN, an inf or a float32
        overflow of the norm). The scalar bookkeeping runs once on the
        vector of all weights (a few ops per step instead of ~40 per
        weight)."""
        # Each gradient cast to float32 once, for its statistic and its
        # decode (a narrower one's copy is then scaled in place).
        as_float32 = [S.cast(g, "float32") for _, _, _, g in measured]
        # A float32 gradient cannot underflow to all zeros.
        underflows = [dtype_name(g.dtype) != "float32" for _, _, _, g in measured]
        in_place = [
            dtype_name(g.dtype) != "float32" or owned_gradient(g, sv.data)
            for _, sv, _, g in measured
        ]
        host = self._calibrate_on_host(measured, as_float32, underflows, in_place, inner_grads, always)
        if host is not None:
            return host
        scales = S.stack([scale for _, _, scale, _ in measured])
        stored = S.stack([read_tensor(sv.grad_scale) for _, sv, _, _ in measured])
        gs = effective_grad_scale(stored, scales)
        stats = S.rms_all(as_float32)  # `data_statistic(g, "l2")` of each
        if all(underflows) or not any(underflows):
            underflows = underflows[0]
        else:
            underflows = ops.convert_to_tensor(np.array(underflows))
        new_gs = grad_scale_from_statistic(stats, gs, underflows)
        # Stored negative when not measured (an all-zero or non-finite
        # gradient): it then no longer votes for the grad scales of its
        # layer's outputs (`votes`).
        ok = S.logical_and(S.isfinite(stats), S.greater(stats, 0.0))
        new_gs = S.unstack(S.where(ok, new_gs, -new_gs))
        gs_each = S.unstack(gs)
        # `multiply`, not `*`: on TensorFlow an Embedding's gradient is a
        # `tf.IndexedSlices` (one row per token, repeats included), which
        # `*` densifies (summing the repeats); the inner optimizer must
        # get it as in plain Keras, whose sparse update differs (Adam
        # squares rows). A float32 copy of a narrower gradient, and a
        # variable's own `.grad` on eager torch, are scaled in place (as
        # one batch).
        scaled = iter(
            S.multiply_all_in_place(
                [g32 for g32, p in zip(as_float32, in_place) if p],
                [gs for gs, p in zip(gs_each, in_place) if p],
            )
        )
        for (i, sv, _, _), g32, new, g_scale, p in zip(measured, as_float32, new_gs, gs_each, in_place):
            always.append((sv.grad_scale, new))
            inner_grads[i] = next(scaled) if p else S.multiply(g32, g_scale)
        return ops.all(S.isfinite(stats * gs))

    def _calibrate_on_host(self, measured, as_float32, underflows, in_place, inner_grads, always):
        """`_calibrate` with its scalar bookkeeping in Python, bit for bit,
        where the host has the statistics and scales (eager torch:
        `backend.scalar.rms_all_on_host`, one read of the statistics'
        vector, a synchronization on a GPU; the scales' values kept on
        the host, `host_value`) instead of ~20 tensor ops on them and a
        tensor per weight. Float32 arithmetic by NumPy; a grad scale that does
        not change is not written. Returns whether all gradients are
        finite (a Python bool), or None where the host cannot (then the
        tensor ops run)."""
        stats = S.rms_all_on_host(as_float32)
        if stats is None:
            return None
        scales = [S.host_value(scale) for _, _, scale, _ in measured]
        stored = [S.host_value(sv.read_stored_grad_scale()) for _, sv, _, _ in measured]
        if any(v is None for v in scales + stored):
            return None
        f32 = lambda values: np.asarray(values, dtype=np.float32)
        with np.errstate(all="ignore"):  # (inf and NaN are the answers)
            # `effective_grad_scale`, and the skip test `isfinite(stat·gs)`.
            gs = np.where(f32(stored) == 0, np.float32(1) / f32(scales), np.abs(f32(stored)))
            finite = bool(np.isfinite(f32(stats) * gs).all())
        gs = gs.tolist()
        for (_, sv, _, _), v, g, old, under in zip(measured, stats, gs, stored, underflows):
            new = host_grad_scale(v, g, under)
            if not (math.isfinite(v) and v > 0.0):
                new = -new  # (not measured: see `_calibrate`)
            if new != old:
                always.append((sv.grad_scale, S.float32_scalar(new, as_float32[0])))
        scaled = iter(
            S.multiply_all_in_place(
                [g32 for g32, p in zip(as_float32, in_place) if p],
                [g for g, p in zip(gs, in_place) if p],
            )
        )
        for (i, _, _, _), g32, g, p in zip(measured, as_float32, gs, in_place):
            inner_grads[i] = next(scaled) if p else S.multiply(g32, S.float32_scalar(g, g32))
        return finite

    def _update(self, weights, inner_grads, guard):
        """The inner optimizer's step and the re-encoded weights and slots,
        each write selected by `guard` (a bool tensor, or True)."""
        inner = self.inner_optimizer
        # Measured on the stored data, before the update (which may write
        # it in place).
        # (Accumulating, the inner optimizer counts the updates.)
        counter = self.iterations if self.gradient_accumulation_steps else self._iterations
        step = S.host_value(read_tensor(counter))
        if step is not None:  # (eager torch on a CPU)
            rescale = int(step) % self.rescale_every == 0
        else:
            rescale = ops.equal(counter % self.rescale_every, 0)
            known = host_bool(rescale)
            rescale = rescale if known is None else known
        if rescale is False:  # eager torch, between rescaling steps
            new_scales = [scale for _, _, scale in weights]
        else:
            factors = state.rescale_factors([read_tensor(sv.data) for sv, _, _ in weights], rescale)
            new_scales = [scale * k for (_, _, scale), k in zip(weights, factors)]
        with native_updates(inner, guard) as native:
            # (Inside an outer scope, e.g. `stateless_apply`, its writes
            # must be recorded: the scope path.)
            bound = native and not in_stateless_scope()
            stored = [read_tensor(sv.data) for sv, _, _ in weights]
            # Bound, a float32 weight whose scale the update's learning
            # rate can carry is updated on its stored data: no decode, no
            # re-encode (`scale_folds`).
            folds = [None] * len(weights)
            if bound:
                folds = scale_folds(
                    inner,
                    [
                        scale if sv.master_dtype == "float32" and ghost.constraint is None else None
                        for sv, ghost, scale in weights
                    ],
                    self._weight_sizes,
                )
            # The native update owns what it updates: float32 data is
            # decoded in place in its variable, updated there and
            # re-encoded there (no weight-sized temporary, no copy back).
            decoded = state.decode_all(
                stored,
                [None if f is not None else scale for (_, _, scale), f in zip(weights, folds)],
                [native and sv.master_dtype == "float32" for sv, _, _ in weights],
            )
            ghosts = [(ghost, value) for (_, ghost, _), value in zip(weights, decoded)]
            # (A slot without a scale is float32, read as it is.)
            ghosts += [
                (ghost, read_tensor(d) if s is None else state.decode(read_tensor(d), read_tensor(s)))
                for ghost, d, s in self._slots
            ]
            if bound:
                # The ghosts are these tensors; the plain and the inner
                # optimizer's own variables are updated where they are.
                factors = {id(ghost): f for (_, ghost, _), f in zip(weights, folds) if f is not None}
                with bound_ghosts(ghosts, factors):
                    inner.apply(inner_grads, self._inner_vars)
                values = {id(ghost): value for ghost, value in ghosts}
                new_of = lambda ghost: values[id(ghost)]
            else:
                inner_real = [v for v in inner.variables if not is_ghost(v)]
                mapping = ghosts + [(v, read_tensor(v)) for kind, _, v in self._entries if kind == "plain"]
                mapping += [(v, read_tensor(v)) for v in inner_real]
                # Every value the inner optimizer writes is already selected
                # by `guard`; only re-encoded values are selected again.
                with GuardedScope(guard, state_mapping=mapping, initialize_variables=False) as scope:
                    inner.apply(inner_grads, self._inner_vars)
                new_of = scope.get_current_value
            # (Still native: the re-encoding may write in place.)

            def commit(var, value):
                return var, (value if guard is True else ops.where(guard, value, read_tensor(var)))

            encoded = state.encode_weights(
                [new_of(ghost) for _, ghost, _ in weights],
                new_scales,
                [sv.master_dtype for sv, _, _ in weights],
                self._rounding_keys(weights),
                owned=guard is True and native,
                # (Bound: the stored data was decoded and is read no more;
                # a rounded weight is written into it. An error after this
                # would leave new data beside old scales and slots, as the
                # in-place float32 update already could.)
                intos=stored if bound else None,
                units=[None if f is None else 1.0 / f for f in folds],
            )
            writes = []
            for (sv, _, old_scale), (data, scale), src in zip(weights, encoded, stored):
                # (Bound, data re-encoded in its own tensor is not written
                # again, nor a scale the host sees unchanged.)
                if not (bound and data is src):
                    writes.append(commit(sv.data, data))
                known = S.host_value(old_scale) if bound else None
                if known is None or S.host_value(scale) != known:
                    writes.append(commit(sv.scale, scale))
            if not bound:
                writes += [(v, new_of(v)) for kind, _, v in self._entries if kind == "plain"]
                writes += [(v, new_of(v)) for v in inner_real]
            for ghost, d, s in self._slots:
                if s is None and bound:
                    continue  # (float32, updated in its own tensor)
                data, scale = state.encode_slot(new_of(ghost), self._resolved_state_dtype)
                # float32: stored as computed (bound, its own tensor was
                # the ghost, updated in place).
                if s is None:
                    if not bound:
                        writes.append((d, data))
                    continue
                writes += [commit(d, data), commit(s, scale)]
            assign_all(writes)

    def _rounding_keys(self, weights):
        """One int32 stochastic-rounding key per weight (None: round to
        nearest), all drawn at once from the seed generator."""
        rounded = [
            self.stochastic_rounding and sv.master_dtype != "float32" for sv, _, _ in weights
        ]
        if not any(rounded):
            return [None] * len(weights)
        keys = keras.random.randint(
            (len(weights),), -(2**31), 2**31 - 1, dtype="int32", seed=self._seed_generator
        )
        return [keys[i] if r else None for i, r in enumerate(rounded)]

    def finalize_variable_values(self, var_list):
        """With EMA: store each weight's moving average as the weight."""
        inner = self.inner_optimizer
        if not inner.use_ema:
            return
        stored = {id(g): (d, s) for g, d, s in self._slots}
        for kind, sv, v in self._entries:
            if kind not in ("weight", "plain"):
                continue
            average = inner._model_variables_moving_average[inner._get_variable_index(v)]
            d, s = stored[id(average)]
            value = state.decode(read_tensor(d), None if s is None else read_tensor(s))
            if kind == "weight":
                sv.assign(ops.convert_to_numpy(value))
            else:
                v.assign(value)

    # --- config ----------------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        del config["learning_rate"]
        config.update(
            {
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "state_dtype": self.state_dtype,
                "rescale_every": self.rescale_every,
                "stochastic_rounding": self.stochastic_rounding,
                "seed": self.seed,
            }
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


# Keras optimizer arguments the wrapper does not apply itself, with their
# defaults (what `get_config` stores and `from_config` passes back).
_INNER_ARGUMENTS = {
    "weight_decay": None,
    "clipnorm": None,
    "clipvalue": None,
    "global_clipnorm": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
}
_UNSUPPORTED_ARGUMENTS = {"loss_scale_factor": None}


def _refuse_base_arguments(kwargs):
    """A base-optimizer argument given to the wrapper with a value it would
    not honour raises: clipping, weight decay and EMA belong to the inner
    optimizer (its `apply` runs them on the decoded weights); loss scaling
    is not supported."""
    for key, value in kwargs.items():
        if key in _INNER_ARGUMENTS and value != _INNER_ARGUMENTS[key]:
            raise ValueError(
                f"ScaledOptimizer does not apply `{key}` itself: set it on the "
                f"inner optimizer, e.g. `ScaledOptimizer(keras.optimizers."
                f"AdamW(..., {key}={value!r}))`."
            )
        if key in _UNSUPPORTED_ARGUMENTS and value != _UNSUPPORTED_ARGUMENTS[key]:
            raise ValueError(
                f"ScaledOptimizer does not support `{key}` (got {value!r})."
            )


def _accumulation_steps(steps, inner):
    """The gradient accumulation steps given to the wrapper or set on
    `inner` (Keras's rule: an int >= 2, or None)."""
    inner_steps = inner.gradient_accumulation_steps
    if steps is not None and inner_steps is not None and steps != inner_steps:
        raise ValueError(
            f"`gradient_accumulation_steps={steps!r}` differs from the inner "
            f"optimizer's ({inner_steps!r}): set it in one place."
        )
    steps = inner_steps if steps is None else steps
    if steps is None:
        return None
    if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 2:
        raise ValueError(f"`gradient_accumulation_steps` must be an integer >= 2, got {steps!r}.")
    return int(steps)


def _logical_and(a, b):
    """`a and b` of bools that are Python bools (decided on the host) or
    bool tensors."""
    if a is False or b is False:
        return False
    if a is True:
        return b
    return a if b is True else S.logical_and(a, b)


def _select(pred, a, b):
    """`where(pred, a, b)`; `a` or `b` itself where `pred` is a Python bool."""
    if pred is True or pred is False:
        return a if pred else b
    return ops.where(pred, a, b)


def _is_float(dtype):
    return "float" in keras.backend.standardize_dtype(dtype)


def _check_state_dtype(dtype, arg):
    try:
        name = keras.backend.standardize_dtype(dtype)
    except Exception:
        raise ValueError(
            f"`{arg}` must be one of {STATE_DTYPES}, got {dtype!r} (not a "
            f"dtype)."
        ) from None
    if name not in STATE_DTYPES:
        raise ValueError(f"`{arg}` must be one of {STATE_DTYPES}, got {dtype!r}.")
    return name


def _constant(value):
    value = np.asarray(value)

    def init(shape, dtype=None):
        return ops.cast(ops.convert_to_tensor(value.reshape(shape)), dtype)

    return init
