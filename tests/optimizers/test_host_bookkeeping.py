"""Eager torch on a CPU does the optimizer's scalar bookkeeping on the host
(`ScaledOptimizer._calibrate_on_host`, the rescaling test, `scale_loss`,
scale reads kept while unchanged): bit for bit what the tensor ops give,
which `backend.scalar.memo_disabled()` runs instead. Elsewhere both runs
take the tensor ops."""

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from keras_scalify.backend import scalar as S
from tests.optimizers.helpers import scaled_mlp
from tests.optimizers.helpers import variable_values


def _gradients(variables, step, rng):
    """A gradient per trainable variable, in its dtype: random, with an
    all-zero one (step 2), a NaN (step 3), an inf (step 4), and tiny ones
    (step 5), in the weights' data (a scale's gradient is not read)."""
    weights = [i for i, v in enumerate(variables) if "scale" not in v.path]
    out = []
    for i, v in enumerate(variables):
        g = rng.standard_normal(tuple(v.shape)).astype("float32")
        if step == 2 and i == weights[0]:
            g = np.zeros_like(g)
        if step == 3 and i == weights[1]:
            g.flat[0] = np.nan
        if step == 4 and i == weights[2]:
            g.flat[0] = np.inf
        if step == 5:
            g = g * np.float32(2.0**-20)
        out.append(keras.ops.cast(keras.ops.convert_to_tensor(g), v.dtype))
    return out


def _run(policy, host):
    model = scaled_mlp(policy)
    opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2), rescale_every=3)
    variables = model.trainable_variables
    opt.build(variables)
    rng = np.random.default_rng(0)
    states = []  # after every step
    for step in range(1, 9):
        grads = _gradients(variables, step, rng)
        loss = keras.ops.convert_to_tensor(np.float32([1.5, np.inf][step == 6]))
        if host:
            opt.apply(grads, variables)
            loss = opt.scale_loss(loss)
        else:
            with S.memo_disabled():
                opt.apply(grads, variables)
                loss = opt.scale_loss(loss)
        states += variable_values(model.weights + opt.variables) + [keras.ops.convert_to_numpy(loss)]
    assert int(keras.ops.convert_to_numpy(opt.skipped_steps)) == 2  # steps 3 and 4
    return states


@pytest.mark.parametrize(
    "policy",
    ["scaled_float32", ksc.ScaledDTypePolicy(compute_dtype="float32", master_dtype="float16")],
    ids=["float32", "float16 master"],
)
def test_host_bookkeeping_is_the_tensor_ops_bit_for_bit(policy):
    host, tensors = _run(policy, True), _run(policy, False)
    assert len(host) == len(tensors)
    for a, b in zip(host, tensors):
        np.testing.assert_array_equal(a, b)
    # (The steps exercise what they should: two skipped, a poisoned loss.)
    assert sum(np.isnan(x).all() for x in host if x.dtype == np.float32 and x.shape == ()) == 1


def test_scale_reads_follow_writes():
    """Memoized functions of a scale read give what the tensor ops give on
    its value, after the variable is written in place (on eager torch a
    read is kept while its variable holds the same tensor, and shares its
    storage: a write changes the value a read taken before it holds)."""
    from keras_scalify.layers.variable import effective_grad_scale

    def both(stored, scale):
        with S.memo_disabled():
            plain = keras.ops.convert_to_numpy(effective_grad_scale(stored, scale))
        return keras.ops.convert_to_numpy(effective_grad_scale(stored, scale)), plain

    model = scaled_mlp("scaled_float32")
    sv = model.layers[1].kernel
    sv.grad_scale.assign(np.float32(0.0))  # (effective grad scale: 1/scale)
    stored, scale = sv.read_stored_grad_scale(), sv.read_scale()
    for value in (0.25, 0.5):
        sv.scale.assign(np.float32(value))
        got, want = both(stored, scale)
        assert got == want
        got, want = both(sv.read_stored_grad_scale(), sv.read_scale())
        assert got == want == 1.0 / value
