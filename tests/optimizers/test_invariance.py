"""Under `scaled_float32`, ScaledOptimizer(opt) trains a scaled model to the
same weights as `opt` trains the plain Keras model (DESIGN §10)."""

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from tests.conftest import on_gpu
from tests.optimizers.helpers import data
from tests.optimizers.helpers import keras_mlp
from tests.optimizers.helpers import represented_weights
from tests.optimizers.helpers import scaled_mlp

STEPS = 20
BATCH = 8


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(3e-2, decay_steps=5, decay_rate=0.5)


def _adamw_excluding_bias():
    opt = keras.optimizers.AdamW(1e-2, weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
    # What the inner optimizer does beyond its update rule.
    "adam_schedule_clipnorm": lambda: keras.optimizers.Adam(_schedule(), global_clipnorm=0.05),
    "sgd_clipvalue_ema": lambda: keras.optimizers.SGD(
        0.05, clipvalue=0.01, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=7
    ),
    "adamw_exclude_bias": _adamw_excluding_bias,
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "adafactor": lambda: keras.optimizers.Adafactor(1e-2),
}


def _train(model, optimizer, x, y):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return represented_weights(model)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_same_weights_as_plain_keras_after_20_steps(name):
    x, y = data(n=STEPS * BATCH)
    expected = _train(keras_mlp(), OPTIMIZERS[name](), x, y)
    model = scaled_mlp("scaled_float32")
    optimizer = ksc.ScaledOptimizer(OPTIMIZERS[name]())
    actual = _train(model, optimizer, x, y)
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == STEPS
    assert int(keras.ops.convert_to_numpy(optimizer.skipped_steps)) == 0
    assert len(actual) == len(expected)
    # (A GPU's float32 kernels sum in other orders for the two models:
    # seen 2e-6 of the largest weight on an H100.)
    floor = 1e-5 if on_gpu() else 1e-6
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=floor * np.max(np.abs(e)))
    # The weights moved: the test would catch an optimizer that did nothing.
    initial = represented_weights(keras_mlp())
    assert any(np.max(np.abs(a - i)) > 1e-4 for a, i in zip(actual, initial))


def test_learning_rate_is_the_inner_optimizers():
    inner = keras.optimizers.Adam(1e-3)
    opt = ksc.ScaledOptimizer(inner)
    opt.learning_rate = 5e-4
    assert float(keras.ops.convert_to_numpy(inner.learning_rate)) == pytest.approx(5e-4)
    assert opt.iterations is inner.iterations


@pytest.mark.parametrize("finite", [True, False])
def test_eager_torch_runs_the_inner_optimizers_own_update(finite):
    """On eager torch, a step that is taken runs Keras's own in-place
    `torch._foreach_*` update on the decoded values (the generic update,
    one assignment per slot and pass, made the MLP step 2.4x plain Keras);
    a skipped step runs none. JAX and TensorFlow keep the generic update."""
    x, y = data(n=8)
    model = scaled_mlp("scaled_float32")
    optimizer = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=optimizer, loss="mse")
    model.train_on_batch(x, y)  # builds the optimizer
    inner, calls = optimizer.inner_optimizer, []
    native = inner._ksc_native.get("_backend_update_step")
    if native is not None:
        inner._ksc_native["_backend_update_step"] = lambda *a: (calls.append(1), native(*a))[1]
    if not finite:
        y = y.copy()
        y[0, 0] = np.nan
    model.train_on_batch(x, y)
    on_torch = keras.backend.backend() == "torch"
    assert len(calls) == (1 if on_torch and finite else 0)
    assert int(keras.ops.convert_to_numpy(optimizer.skipped_steps)) == (0 if finite else 1)


def test_a_variables_own_grad_is_scaled_in_place_and_others_are_not():
    """On eager torch the gradients Keras's trainer passes (each variable's
    autograd `.grad`) are decoded in place, as `GradScaler` unscales them;
    a gradient the caller holds otherwise is left as it is. Same update
    either way."""
    x, y = data(n=8)
    results, calls = [], []
    for own in (False, True):
        model = scaled_mlp("scaled_float32")
        optimizer = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2))
        variables = model.trainable_variables
        grads = [np.full(v.shape, 0.25, "float32") for v in variables]
        tensors = [keras.ops.convert_to_tensor(g) for g in grads]
        if own and keras.backend.backend() == "torch":
            for v, t in zip(variables, tensors):
                v.value.grad = t
            tensors = [v.value.grad for v in variables]
        optimizer.apply(tensors, variables)
        results.append(represented_weights(model))
        calls.append([np.array_equal(keras.ops.convert_to_numpy(t), g) for t, g in zip(tensors, grads)])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    assert all(calls[0])
    if keras.backend.backend() == "torch":
        assert not all(calls[1])  # scaled by the grad scales in place


FOLDING = ("adam", "adamw_exclude_bias", "adam_schedule_clipnorm", "lion")


@pytest.mark.parametrize("name", FOLDING)
def test_updating_float32_data_with_a_scaled_learning_rate_changes_no_bit(name, monkeypatch):
    """On eager torch, Adam, AdamW and Lion update a float32 weight on its
    stored data with the learning rate divided by its scale
    (`backend.optimizer.scale_folds`: no decode, no re-encode). Weights,
    scales and slots are bit for bit those of the decoded update, across
    two rescaling steps; a plain Keras layer beside them trains as before.
    JAX and TensorFlow never fold."""
    from keras_scalify.backend import optimizer as backend_optimizer
    from keras_scalify.optimizers import scaled_optimizer

    x, y = data(n=25 * BATCH)
    results, folded = [], []
    spy = backend_optimizer.scale_folds

    def counting(*args):
        out = spy(*args)
        folded.append(sum(f is not None and f != 1.0 for f in out))
        return out

    monkeypatch.setattr(scaled_optimizer, "scale_folds", counting)
    for minimum in (2**62, 1):
        monkeypatch.setattr(backend_optimizer, "FOLD_MIN_ELEMENTS", minimum)
        folded.clear()
        scaled = scaled_mlp("scaled_float32")
        head = keras.layers.Dense(4, kernel_initializer="ones")
        model = keras.Model(scaled.inputs, head(scaled.outputs[0]))
        optimizer = ksc.ScaledOptimizer(OPTIMIZERS[name](), rescale_every=10)
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        results.append([keras.ops.convert_to_numpy(v) for v in model.weights + optimizer.variables])
        if minimum == 1:
            on_torch = keras.backend.backend() == "torch" and not on_gpu()
            assert (min(folded) > 0) if on_torch else (max(folded, default=0) == 0)
        else:
            assert max(folded, default=0) == 0
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_scale_folds_only_where_the_update_is_linear_in_the_learning_rate(monkeypatch):
    """`scale_folds`: Keras's torch Adam / AdamW / Lion without EMA; a
    group of weights sharing a scale at least FOLD_MIN_ELEMENTS large; a
    normal power of two within FOLD_MAX_EXPONENT binades of 1. Never on
    JAX or TensorFlow, nor for SGD with momentum (its slot holds the
    learning rate)."""
    from keras_scalify.backend import optimizer as backend_optimizer

    monkeypatch.setattr(backend_optimizer, "FOLD_MIN_ELEMENTS", 100)
    scales = [keras.ops.convert_to_tensor(np.float32(v)) for v in (0.25, 0.25, 0.5, 3.0, 2.0**40)]
    scales.append(None)
    sizes = [60, 60, 60, 500, 500, 500]

    def folds(optimizer):
        model = scaled_mlp("scaled_float32")
        ksc.ScaledOptimizer(optimizer).build(model.trainable_variables)
        return backend_optimizer.scale_folds(optimizer, scales, sizes)

    adam = folds(keras.optimizers.Adam())
    if keras.backend.backend() != "torch" or on_gpu():
        assert adam == [None] * 6
        return
    # 0.25 twice (120 elements) folds; 0.5 alone (60) does not; 3 is no
    # power of two; 2**40 is outside the window; None is no candidate.
    assert adam == [4.0, 4.0, None, None, None, None]
    assert folds(keras.optimizers.Lion())[:2] == [4.0, 4.0]
    assert folds(keras.optimizers.AdamW(weight_decay=0.1))[:2] == [4.0, 4.0]
    assert folds(keras.optimizers.SGD(momentum=0.9)) == [None] * 6
    assert folds(keras.optimizers.Adam(use_ema=True)) == [None] * 6
