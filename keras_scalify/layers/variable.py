"""`ScaledVariable`: a weight stored as data × pow2 scale."""

import keras
import numpy as np
from keras import ops

from keras_scalify.backend import host_readable
from keras_scalify.backend import scalar as S
from keras_scalify.core import pow2
from keras_scalify.core.formats import FP8_DTYPES
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.ops._common import rescale

MASTER_DTYPES = ("float32", "float16", "bfloat16")

# What the first ScaledVariable made in this process runs, once (the
# optimizer guard registers here: `keras_scalify/patches.py`).
ON_FIRST_SCALED_VARIABLE = []


def read_tensor(variable):
    """The current value of a Keras variable as a backend tensor, read
    outside the op that uses it (`backend.scalar.variable_value`)."""
    return S.variable_value(variable)


@S.memoize_scalars
def effective_grad_scale(grad_scale, scale):
    """The grad scale in use: `|grad_scale|`, or `1/scale` while it is 0.

    The state's sign says whether it was measured: > 0, the statistic of
    the last gradient; < 0, moved without a measurement (the gradient was
    all zero or non-finite); 0, never measured."""
    return S.where(S.equal(grad_scale, 0.0), 1.0 / scale, S.abs(grad_scale))


@S.memoize_scalars
def _is_calibrated(grad_scale):
    """`grad_scale > 0`: the stored grad scale is a measurement."""
    return S.greater(grad_scale, 0.0)


@S.memoize_scalars
def _rebalanced(p, scale):
    """`(1/p, 1, scale·p)` for a weight whose data's max `m` has `p =
    P(m)`; `(1, 1, 0)` for an all-zero (or non-finite) max, whose `p` is 0
    (or inf). (Keyed on `p`, not `m`, the memo hits from step to step.)"""
    nonzero = S.logical_and(S.greater(p, 0.0), S.isfinite(p))
    k = S.where(nonzero, p, 1.0)
    return 1.0 / k, S.ones_like(k), S.where(nonzero, scale * k, 0.0)


def scale_of_rms(r):
    """The pow2 scale of a weight whose RMS is `r` (a Python float): `r`
    rounded down to a power of two; 1 for an all-zero (or non-finite)
    weight, so that updates can grow it."""
    return np.float32(pow2.np_pow2_round_down(r) if r > 0 and np.isfinite(r) else 1.0)


def split_value(value):
    """Exact pow2 split of a float32 array: `(data, scale)` with unit-RMS
    data (`scale_of_rms`)."""
    value = np.asarray(value, dtype=np.float32)
    scale = scale_of_rms(float(np.sqrt(np.mean(np.square(value, dtype=np.float64)))) if value.size else 0.0)
    return value / scale, scale


class ScaledVariable:
    """A weight represented as `data * scale`, both tracked Keras variables.

    - `data`: trainable, in the master dtype (float32, float16 or bfloat16),
      unit RMS at initialization, `autocast=False`;
    - `scale`: float32 scalar power of two: the initializer's RMS;
    - `grad_scale`: float32 scalar, the weight gradient's pow2 scale (the
      cotangent of `data` is `true_gradient / |grad_scale|`); 0 means "not
      calibrated", read as `1/scale` (the plain autodiff gradient of data);
      negative, moved without a measurement (see `effective_grad_scale`).

    `scale` and `grad_scale` are trainable (when the weight is) with
    `overwrite_with_gradient=True` and no gradient of their own: only
    `keras_scalify.ScaledOptimizer` writes them (it re-splits the weight and
    calibrates its gradient scale), and under JAX's stateless `fit` an
    optimizer can only write trainable variables. A plain Keras optimizer
    given these weights raises (see `keras_scalify.optimizers.guard`).

    `value` is the represented float32 tensor; `assign(value)` re-splits it
    exactly. Create it inside a layer's `build` with `layer.add_scaled_weight`.
    """

    def __init__(
        self,
        layer,
        name,
        shape,
        initializer,
        master_dtype="float32",
        trainable=True,
        state_dtype="float32",
    ):
        while ON_FIRST_SCALED_VARIABLE:
            ON_FIRST_SCALED_VARIABLE.pop(0)()
        master_dtype = keras.backend.standardize_dtype(master_dtype)
        if master_dtype in FP8_DTYPES or master_dtype not in MASTER_DTYPES:
            raise ValueError(
                f"`master_dtype` must be one of {MASTER_DTYPES} for a weight that "
                f"an optimizer updates, got {master_dtype!r}."
            )
        init = keras.initializers.get(initializer)
        value = np.asarray(
            ops.convert_to_numpy(init(shape, dtype="float32")), dtype=np.float32
        )
        data, scale = split_value(value)
        self.name = name
        self.master_dtype = master_dtype
        self.state_dtype = keras.backend.standardize_dtype(state_dtype)
        self.data = layer.add_weight(
            name=name,
            shape=shape,
            initializer=_constant(data),
            dtype=master_dtype,
            trainable=trainable,
            autocast=False,
        )
        self.scale = layer.add_weight(
            name=f"{name}_scale",
            shape=(),
            initializer=_constant(scale),
            dtype="float32",
            trainable=trainable,
            autocast=False,
            overwrite_with_gradient=trainable,
        )
        self.grad_scale = layer.add_weight(
            name=f"{name}_grad_scale",
            shape=(),
            initializer="zeros",
            dtype="float32",
            trainable=trainable,
            autocast=False,
            overwrite_with_gradient=trainable,
        )
        # The optimizer finds the weight from any of its variables.
        for v in self.variables:
            v._ksc_scaled_variable = self

    @property
    def shape(self):
        return tuple(self.data.shape)

    @property
    def variables(self):
        return [self.data, self.scale, self.grad_scale]

    def read(self, rebalance=False):
        """The weight as a ScaledTensor (for use inside `call`).

        `rebalance=True` (for biases and shifts, which are added to
        activations): the scale is re-read from the data's max, exactly, and
        an all-zero weight gets scale 0, so that a zero-initialized bias
        does not pull the scale of the sum it joins (`add` takes
        `sqrt(sa² + sb²)`). One max over a vector: no activation statistic.
        """
        if rebalance:
            stored, inv_k = self.read_rebalanced()
            return ScaledTensor(rescale(stored.data, inv_k, 1.0), stored.scale, stored.grad_scale)
        data = read_tensor(self.data)
        scale = self.read_scale()
        return ScaledTensor(data, scale, effective_grad_scale(self.read_stored_grad_scale(), scale))

    def read_rebalanced(self):
        """`read(rebalance=True)` with the data's factor left to the op
        that uses it: `(stored, f)`, the stored data with the rebalanced
        scale and grad scale, and the pow2 `f` by which the data is
        multiplied forward (its cotangent by nothing):
        `read(rebalance=True)` is `ScaledTensor(rescale(stored.data, f, 1),
        stored.scale, stored.grad_scale)`. A GEMM node folds `f` into its
        own factors (`ops.linalg.contraction_plus(c_factor=)`): no node
        and no pass of its own."""
        data = read_tensor(self.data)
        scale = self.read_scale()
        gs = effective_grad_scale(self.read_stored_grad_scale(), scale)
        # (Of the data without its gradient: no autograd nodes.)
        m = S.max(S.abs(pow2.as_dtype(S.stop_gradient(data), "float32")))
        # (`kept`: on a GPU `m` is read once, and the memos below hit as on
        # a CPU.)
        inv_k, _, scale = _rebalanced(pow2.pow2_round_down(S.kept(m)), scale)
        return ScaledTensor(data, scale, gs), inv_k

    @property
    def calibrated(self):
        """Bool scalar: whether the weight's grad scale is the statistic of
        its last gradient (not the `1/scale` guess, nor moved after an
        all-zero or non-finite gradient). Contractions, `add` and
        `multiply` take it as `calibrated=` so that a guess does not vote
        for the grad scale of their output."""
        return _is_calibrated(self.read_stored_grad_scale())

    def read_scale(self):
        """The scale's value, without gradient (the same tensor while it
        is unchanged: `backend.scalar.detached_variable_value`)."""
        return S.detached_variable_value(self.scale)

    def read_stored_grad_scale(self):
        """The stored grad scale's value, without gradient (as
        `read_scale`)."""
        return S.detached_variable_value(self.grad_scale)

    @property
    def value(self):
        """The represented float32 tensor `data * scale`."""
        return ops.cast(ops.convert_to_tensor(self.data), "float32") * ops.convert_to_tensor(self.scale)

    def numpy(self):
        return np.asarray(ops.convert_to_numpy(self.value))

    def assign(self, value):
        """Store `value` (float32-like) as unit-RMS data × pow2 scale."""
        if not host_readable(value):  # (sharded across processes)
            self._assign_on_devices(value)
            return
        value = np.asarray(value, dtype=np.float32)
        if value.shape != self.shape:
            raise ValueError(
                f"`value` for weight {self.name!r} must have shape {self.shape}, "
                f"got {value.shape}."
            )
        data, scale = split_value(value)
        self.data.assign(data.astype(self.data.dtype))
        self.scale.assign(scale)

    def _assign_on_devices(self, value):
        """`assign` of a value no process can read whole: the RMS reduced on
        the devices (a replicated scalar every process reads), the data
        divided there, keeping the value's sharding."""
        if tuple(value.shape) != self.shape:
            raise ValueError(
                f"`value` for weight {self.name!r} must have shape {self.shape}, "
                f"got {tuple(value.shape)}."
            )
        value = ops.cast(value, "float32")
        scale = scale_of_rms(float(ops.convert_to_numpy(ops.sqrt(ops.mean(ops.square(value))))))
        self.data.assign(ops.cast(value / scale, self.data.dtype))
        self.scale.assign(scale)

    def __repr__(self):
        return f"<ScaledVariable {self.name} shape={self.shape} master={self.master_dtype}>"


def _constant(value):
    value = np.asarray(value)

    def init(shape, dtype=None):
        return ops.cast(ops.convert_to_tensor(value.reshape(shape)), dtype)

    return init
