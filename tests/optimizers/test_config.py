"""ScaledOptimizer: config, `.keras` files, bad arguments, plain optimizers."""

import os

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from tests.optimizers.helpers import data
from tests.optimizers.helpers import represented_weights
from tests.optimizers.helpers import scaled_mlp
from tests.optimizers.helpers import variable_values


def test_config_round_trip():
    opt = ksc.ScaledOptimizer(
        keras.optimizers.AdamW(2e-3, weight_decay=0.01),
        state_dtype="float16",
        rescale_every=5,
        stochastic_rounding=False,
        seed=7,
    )
    config = opt.get_config()
    clone = ksc.ScaledOptimizer.from_config(config)
    assert isinstance(clone.inner_optimizer, keras.optimizers.AdamW)
    assert clone.inner_optimizer.weight_decay == pytest.approx(0.01)
    assert (clone.state_dtype, clone.rescale_every, clone.stochastic_rounding, clone.seed) == (
        "float16", 5, False, 7,
    )
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(restored, ksc.ScaledOptimizer)


def test_keras_file_keeps_optimizer_state_and_training_resumes(tmp_path):
    x, y = data(n=64)
    model = scaled_mlp("scaled_float32")
    opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2), state_dtype="float16")
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, ksc.ScaledOptimizer)
    assert [v.name for v in loaded.optimizer.variables] == [v.name for v in opt.variables]
    for a, b in zip(variable_values(loaded.optimizer.variables), variable_values(opt.variables)):
        np.testing.assert_array_equal(a, b)
    # One more step from the same state gives the same weights.
    model.train_on_batch(x[:16], y[:16])
    loaded.train_on_batch(x[:16], y[:16])
    for a, b in zip(represented_weights(loaded), represented_weights(model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_plain_optimizer_on_scaled_weights_raises():
    x, y = data(n=16)
    model = keras.Sequential(
        [keras.Input((8,)), ksc.layers.ScaledDense(4, dtype="scaled_float32"), ksc.layers.ToArray()]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    with pytest.raises(TypeError, match="ScaledOptimizer"):
        model.fit(x, y, verbose=0)


def test_scalified_model_wraps_a_plain_optimizer():
    """A scalified model's `compile` wraps a plain optimizer, as Keras
    wraps one in `LossScaleOptimizer` under `mixed_float16`."""
    model = scaled_mlp("scaled_float32")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    assert isinstance(model.optimizer, ksc.ScaledOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.Adam)


def test_plain_keras_layers_train_beside_scaled_ones():
    x, y = data(n=32)
    inp = keras.Input((8,))
    hidden = ksc.layers.ScaledDense(16, dtype="scaled_float32")(ksc.layers.AsScaled()(inp))
    plain = keras.layers.Dense(4)
    both = keras.Model(inp, plain(ksc.layers.ToArray()(hidden)))
    both.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    before = plain.get_weights()[0].copy()
    both.fit(x, y, batch_size=8, verbose=0)
    assert np.max(np.abs(plain.get_weights()[0] - before)) > 1e-4


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"inner_optimizer": "adam"}, TypeError, "inner_optimizer"),
        ({"rescale_every": 0}, ValueError, "rescale_every"),
        ({"state_dtype": "float8_e4m3fn"}, ValueError, "state_dtype"),
        # Base arguments the wrapper would not honour: refused, not ignored.
        ({"clipnorm": 1e-6}, ValueError, "clipnorm.*inner optimizer"),
        ({"clipvalue": 1.0}, ValueError, "clipvalue"),
        ({"global_clipnorm": 1.0}, ValueError, "global_clipnorm"),
        ({"weight_decay": 0.1}, ValueError, "weight_decay"),
        ({"use_ema": True}, ValueError, "use_ema"),
        ({"loss_scale_factor": 128.0}, ValueError, "loss_scale_factor"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = {"inner_optimizer": keras.optimizers.SGD(0.1), **kwargs}
    with pytest.raises(error, match=match):
        ksc.ScaledOptimizer(**kwargs)


def test_wrapped_optimizers_are_refused():
    with pytest.raises(TypeError, match="inner_optimizer"):
        ksc.ScaledOptimizer(ksc.ScaledOptimizer(keras.optimizers.SGD(0.1)))
    built = keras.optimizers.SGD(0.1)
    built.build([keras.Variable(np.zeros(2, "float32"))])
    with pytest.raises(ValueError, match="built"):
        ksc.ScaledOptimizer(built)


def _stateless_step(opt, grads, model):
    """One `opt.stateless_apply` step, its results assigned back."""
    tv, ov = opt.stateless_apply(
        [v.value for v in opt.variables], grads, [v.value for v in model.trainable_variables]
    )
    for v, value in zip(model.trainable_variables, tv):
        v.assign(value)
    for v, value in zip(opt.variables, ov):
        v.assign(value)


@pytest.mark.skipif(
    keras.config.backend() == "tensorflow",
    reason="Keras refuses stateless_apply on TensorFlow (tf.distribute)",
)
def test_stateless_apply_equals_apply_with_ema_and_a_constraint():
    """`stateless_apply` (Keras's functional step) writes what `apply`
    writes, EMA averages and constrained weights included: inside a scope,
    the inner optimizer's writes are recorded, not lost (on eager torch,
    `apply` binds the ghosts to the decoded weights instead)."""
    from keras import ops

    x, _ = data()
    results = []
    for stateless in (False, True):
        model = scaled_mlp("scaled_float32")
        dense = next(l for l in model.layers if isinstance(l, ksc.layers.ScaledDense))
        dense.scaled_weights[0].data.constraint = keras.constraints.MaxNorm(1.0)
        opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2, use_ema=True))
        opt.build(model.trainable_variables)
        rng = np.random.default_rng(0)
        for _ in range(3):
            grads = [ops.convert_to_tensor(rng.standard_normal(v.shape).astype("float32")) for v in model.trainable_variables]
            if stateless:
                _stateless_step(opt, grads, model)
            else:
                opt.apply(grads, model.trainable_variables)
        results.append((represented_weights(model), variable_values(opt.variables)))
    (w1, o1), (w2, o2) = results
    for a, b in zip(w1 + o1, w2 + o2):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(
    keras.config.backend() == "tensorflow",
    reason="Keras refuses stateless_apply on TensorFlow (tf.distribute)",
)
def test_fp16_master_weights_rounded_into_their_storage_equal_stateless_apply(monkeypatch):
    """FP16 master weights rounded stochastically: `apply` writes what
    `stateless_apply` computes, bit for bit. On eager torch a taken step
    rounds each large weight chunk by chunk into its variable's own
    tensor: the step's writes do not include it."""
    from keras import ops

    from keras_scalify.backend import scalar
    from keras_scalify.optimizers import scaled_optimizer

    monkeypatch.setattr(scalar, "ELEMENTWISE_CHUNK", 64)  # the kernels chunk
    written = []
    assign_all = scaled_optimizer.assign_all
    monkeypatch.setattr(
        scaled_optimizer, "assign_all", lambda pairs: (written.extend(v for v, _ in pairs), assign_all(pairs))[1]
    )
    results = []
    for stateless in (False, True):
        model = scaled_mlp("scaled_fp8")
        opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2), seed=3)
        opt.build(model.trainable_variables)
        rng = np.random.default_rng(0)
        for _ in range(3):
            written.clear()
            grads = [ops.convert_to_tensor(rng.standard_normal(v.shape).astype(v.dtype)) for v in model.trainable_variables]
            if stateless:
                _stateless_step(opt, grads, model)
            else:
                opt.apply(grads, model.trainable_variables)
                kernels = [v for v in model.trainable_variables if v.dtype == "float16" and np.prod(v.shape) > 64]
                assert kernels
                in_writes = [any(w is k for w in written) for k in kernels]
                assert in_writes == [keras.backend.backend() != "torch"] * len(kernels)
        results.append(represented_weights(model))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
