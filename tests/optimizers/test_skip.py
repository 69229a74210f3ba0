"""Non-finite gradients: the step is skipped, bit for bit."""

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from tests.optimizers.helpers import data
from tests.optimizers.helpers import scaled_mlp
from tests.optimizers.helpers import variable_values


def _trained_model(policy="scaled_float32", state_dtype=None):
    x, y = data(n=32)
    model = scaled_mlp(policy)
    opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2), state_dtype=state_dtype)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 4 real steps
    return model, opt, x, y


def _state(model, opt):
    """Weights (data and scale) and optimizer state; not the grad scales
    and delayed-rescaling states, which update on every step."""
    weights = [v for v in model.weights if "grad_scale" not in v.path]
    # Counters of every call (skipped ones too) and the rounding seed.
    skip = {id(opt.skipped_steps), id(opt._seed_generator.state), id(opt._iterations)}
    return variable_values(weights + [v for v in opt.variables if id(v) not in skip])


def _assert_skipped(model, opt, before):
    after = _state(model, opt)
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert int(keras.ops.convert_to_numpy(opt.skipped_steps)) == 1
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 4


def test_nan_batch_under_train_on_batch_is_skipped():
    model, opt, x, y = _trained_model()
    before = _state(model, opt)
    bad = x[:8].copy()
    bad[3, 2] = np.nan  # NaN loss and gradients
    model.train_on_batch(bad, y[:8])
    _assert_skipped(model, opt, before)
    # Training goes on.
    model.train_on_batch(x[:8], y[:8])
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 5


def test_injected_nan_gradient_is_skipped_with_fp16_state():
    policy = ksc.ScaledDTypePolicy(
        compute_dtype="float16", matmul_dtype="float16", grad_dtype="float16",
        master_dtype="float16", state_dtype="float16",
    )
    model, opt, _, _ = _trained_model(policy)
    before = _state(model, opt)
    variables = opt._trainable_variables
    grads = [np.zeros(v.shape, "float32") for v in variables]
    grads[0] = grads[0].copy()
    grads[0].flat[0] = np.inf
    opt.apply(grads, variables)
    _assert_skipped(model, opt, before)


def test_grad_scale_recovers_on_a_skipped_step():
    model, opt, x, y = _trained_model()
    kernel = model.layers[0].kernel
    gs = float(keras.ops.convert_to_numpy(kernel.grad_scale))
    grads = [np.zeros(v.shape, "float32") for v in opt._trainable_variables]
    i = [id(v) for v in opt._trainable_variables].index(id(kernel.data))
    grads[i] = np.full(kernel.shape, np.inf, "float32")
    opt.apply(grads, opt._trainable_variables)
    # Overflowing cotangents: the grad scale grows by 2**12, stored negative
    # (moved, not measured: it does not vote for its layer's outputs).
    assert float(keras.ops.convert_to_numpy(kernel.grad_scale)) == -gs * 2.0**12
    assert not bool(keras.ops.convert_to_numpy(kernel.calibrated))


def test_gradient_whose_float32_norm_overflows_is_skipped():
    """Finite elements whose sum of squares overflows float32 (in data
    units, 1e20 where ~1 is expected) count as an overflow: the step is
    skipped and the grad scale grows by 2**12, as for an inf."""
    model, opt, x, y = _trained_model()
    before = _state(model, opt)
    kernel = model.layers[0].kernel
    gs = float(keras.ops.convert_to_numpy(kernel.grad_scale))
    grads = [np.zeros(v.shape, "float32") for v in opt._trainable_variables]
    i = [id(v) for v in opt._trainable_variables].index(id(kernel.data))
    grads[i] = np.full(kernel.shape, 1e20, "float32")
    opt.apply(grads, opt._trainable_variables)
    _assert_skipped(model, opt, before)
    assert float(keras.ops.convert_to_numpy(kernel.grad_scale)) == -gs * 2.0**12


# --- faults in the data (issue 14, items 1-2) --------------------------------
@pytest.mark.parametrize("policy", ["scaled_fp16", "scaled_fp8"])
def test_inf_in_the_inputs_is_skipped_not_saturated(policy):
    """The input's cast to the compute dtype keeps an inf (it used to clip
    it to 65504, and the LayerNorm hid the clipped row)."""
    model, opt, x, y = _trained_model(policy)
    before = _state(model, opt)
    bad = x[:8].copy()
    bad[0, 0] = np.inf
    model.train_on_batch(bad, y[:8])
    _assert_skipped(model, opt, before)
    model.train_on_batch(x[:8], y[:8])
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == 5


@pytest.mark.parametrize("policy", ["scaled_float32", "scaled_fp16", "scaled_fp8"])
def test_non_finite_loss_is_skipped_even_with_finite_gradients(policy):
    """mse against 1e30: the loss is inf but its gradient is finite (and
    E5M2 saturates it); `scale_loss` makes the gradients NaN."""
    model, opt, x, y = _trained_model(policy)
    before = _state(model, opt)
    bad = y[:8].copy()
    bad[0, 0] = 1e30
    loss = model.train_on_batch(x[:8], bad)
    assert not np.isfinite(loss)
    _assert_skipped(model, opt, before)


def test_scale_loss_is_the_loss_when_finite_and_poisons_it_otherwise():
    opt = ksc.ScaledOptimizer(keras.optimizers.SGD(0.1))
    finite = keras.ops.convert_to_numpy(opt.scale_loss(keras.ops.convert_to_tensor(np.float32(2.5))))
    assert finite == np.float32(2.5)
    for bad in (np.inf, -np.inf, np.nan):
        got = keras.ops.convert_to_numpy(opt.scale_loss(keras.ops.convert_to_tensor(np.float32(bad))))
        assert np.isnan(got)


# --- one layer's grad scale (issue 14, item 3) --------------------------------
def test_tiny_inputs_under_fp8_train_without_skips():
    """Inputs ×2**-16 under scaled_fp8: they are encoded with their RMS at
    the boundary (they used to underflow E4M3, the first kernel's gradient
    was 0, its grad scale sank to the 2**-126 floor and 47 of 100 steps
    were skipped while it climbed back)."""
    x, y = data(n=160)
    model = scaled_mlp("scaled_fp8")
    opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss="mse")
    history = model.fit(x * np.float32(2.0**-16), y, batch_size=16, epochs=10, verbose=0)
    assert int(keras.ops.convert_to_numpy(opt.skipped_steps)) <= 2
    assert history.history["loss"][-1] < history.history["loss"][0]
    for v in model.weights:
        if "grad_scale" in v.path and "state" not in v.path:
            assert float(keras.ops.convert_to_numpy(v)) > 2.0**-40, v.path


@pytest.mark.parametrize("master, moves", [("float32", False), ("float16", True)])
def test_an_all_zero_gradient_holds_the_grad_scale_unless_it_may_be_underflow(master, moves):
    """A float32 gradient of zeros is a zero (an unused weight): its grad
    scale is kept. A float16 one may be an underflow: lowered by 2**12.
    Either way it was not measured: stored negative, no vote."""
    policy = ksc.ScaledDTypePolicy(compute_dtype="float32", master_dtype=master)
    model, opt, _, _ = _trained_model(policy)
    kernel = model.layers[0].kernel
    gs = float(keras.ops.convert_to_numpy(kernel.grad_scale))
    # As autodiff gives them: in each variable's dtype.
    grads = [keras.ops.zeros(v.shape, v.dtype) for v in opt._trainable_variables]
    opt.apply(grads, opt._trainable_variables)
    after = float(keras.ops.convert_to_numpy(kernel.grad_scale))
    assert after == -(gs * 2.0**-12 if moves else gs)
    assert not bool(keras.ops.convert_to_numpy(kernel.calibrated))


def test_dead_units_do_not_drag_their_layer_into_skipped_steps():
    """A first layer whose ReLUs are all dead (bias -10, inputs ×2**-16):
    its kernel, bias and the next LayerNorm's gamma get all-zero float16
    gradients step after step, so their grad scales sink by 2**12 per step.
    They used to vote for the grad scales of their layers' outputs, whose
    cotangents then overflowed (0·inf = NaN in gamma's gradient): every
    other step was skipped (45 of 100 on JAX in `benchmarks/reliability.py`).
    Unmeasured grad scales no longer vote."""
    keras.utils.set_random_seed(0)
    policy = "scaled_fp8"
    inputs = keras.Input((8,))
    h = ksc.layers.AsScaled(dtype=policy)(inputs)
    h = ksc.layers.ScaledDense(16, activation="relu", bias_initializer=keras.initializers.Constant(-10.0), dtype=policy)(h)
    h = ksc.layers.ScaledLayerNormalization(dtype=policy)(h)
    h = ksc.layers.ScaledDense(4, dtype=policy)(h)
    model = keras.Model(inputs, ksc.layers.ToArray(dtype=policy)(h))
    opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=opt, loss="mse")
    x, y = data(n=480)
    model.fit(x * np.float32(2.0**-16), y, batch_size=16, epochs=1, verbose=0)
    assert int(keras.ops.convert_to_numpy(opt.skipped_steps)) == 0
    first = model.layers[2]
    assert float(keras.ops.convert_to_numpy(first.kernel.grad_scale)) < 0  # sank, unmeasured


@pytest.mark.parametrize("policy", ["scaled_float32", "scaled_fp8"])
def test_fused_update_matches_and_skips(monkeypatch, policy):
    """With every model counted as large (on TensorFlow the taken step is
    then one XLA computation, `backend.optimizer.run_if(fuse=True)`), the
    model trains as with the unfused step, rescaling steps included, and a
    NaN batch is still skipped bit for bit."""
    from keras_scalify.optimizers import scaled_optimizer

    x, y = data(n=96)
    trained = []
    for threshold in (0, 2**62):
        monkeypatch.setattr(scaled_optimizer, "FUSE_MIN_ELEMENTS", threshold)
        model = scaled_mlp(policy)
        opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2), rescale_every=3, seed=1)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)  # 12 steps
        trained.append((model, opt))
    (fused, fopt), (plain, popt) = trained
    for a, b in zip(_state(fused, fopt), _state(plain, popt)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    before = _state(fused, fopt)
    bad = x[:8].copy()
    bad[0, 0] = np.nan
    fused.train_on_batch(bad, y[:8])
    for a, b in zip(before, _state(fused, fopt)):
        np.testing.assert_array_equal(a, b)
    assert int(keras.ops.convert_to_numpy(fopt.skipped_steps)) == 1
