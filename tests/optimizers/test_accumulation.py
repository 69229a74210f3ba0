"""Gradient accumulation: `ScaledOptimizer(opt, gradient_accumulation_steps=k)`
(or `opt` built with it) trains as Keras's own accumulation does."""

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from tests.conftest import on_gpu
from tests.optimizers.helpers import data
from tests.optimizers.helpers import keras_mlp
from tests.optimizers.helpers import represented_weights
from tests.optimizers.helpers import scaled_mlp

STEPS = 4
BATCH = 8
MICRO_STEPS = 12


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(3e-2, decay_steps=2, decay_rate=0.5)


OPTIMIZERS = {
    "adam": lambda **kw: keras.optimizers.Adam(1e-2, **kw),
    "sgd_momentum_schedule_clipnorm": lambda **kw: keras.optimizers.SGD(
        _schedule(), momentum=0.9, global_clipnorm=0.05, **kw
    ),
}


def _train(model, optimizer, x, y):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return represented_weights(model)


def _assert_weights_equal(actual, expected):
    assert len(actual) == len(expected)
    floor = 1e-5 if on_gpu() else 1e-6
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=floor * np.max(np.abs(e)))


@pytest.mark.parametrize("name, where", [("adam", "wrapper"), ("sgd_momentum_schedule_clipnorm", "inner")])
def test_same_weights_as_keras_accumulation(name, where):
    x, y = data(n=MICRO_STEPS * BATCH)
    expected = _train(keras_mlp(), OPTIMIZERS[name](gradient_accumulation_steps=STEPS), x, y)
    if where == "wrapper":
        optimizer = ksc.ScaledOptimizer(OPTIMIZERS[name](), gradient_accumulation_steps=STEPS)
    else:
        optimizer = ksc.ScaledOptimizer(OPTIMIZERS[name](gradient_accumulation_steps=STEPS))
    assert optimizer.gradient_accumulation_steps == STEPS
    actual = _train(scaled_mlp("scaled_float32"), optimizer, x, y)
    # `iterations` counts updates, as Keras's does under accumulation.
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == MICRO_STEPS // STEPS
    _assert_weights_equal(actual, expected)


def test_weights_move_only_every_k_micro_steps():
    x, y = data(n=BATCH)
    model = scaled_mlp("scaled_fp16")
    model.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2), gradient_accumulation_steps=3), loss="mse")
    initial = represented_weights(model)
    for _ in range(2):
        model.train_on_batch(x, y)
        for a, i in zip(represented_weights(model), initial):
            np.testing.assert_array_equal(a, i)
    model.train_on_batch(x, y)
    assert any(np.max(np.abs(a - i)) > 1e-4 for a, i in zip(represented_weights(model), initial))


@pytest.mark.parametrize("dtype, bound", [("scaled_fp16", 2.0**-6), ("scaled_fp8", 2.0**-1)])
def test_low_precision_accumulation_follows_keras(dtype, bound):
    """FP16 master weights and FP16 accumulators (`state_dtype`) after 3
    accumulated updates, against Keras's float32 run, relative to how far
    the weights moved: FP16 within ~16 roundings of 2**-11 (measured 2**-8.6
    on an Intel Xeon); FP8's E4M3 GEMMs (2**-4 each) dominate theirs
    (measured up to 0.25, as without accumulation), which still catches an
    update of the sum instead of the mean (3x the move) or a lost micro-step."""
    x, y = data(n=MICRO_STEPS * BATCH)
    expected = _train(keras_mlp(), keras.optimizers.SGD(0.05, gradient_accumulation_steps=STEPS), x, y)
    initial = represented_weights(keras_mlp())
    optimizer = ksc.ScaledOptimizer(keras.optimizers.SGD(0.05), gradient_accumulation_steps=STEPS)
    actual = _train(scaled_mlp(dtype), optimizer, x, y)
    assert int(keras.ops.convert_to_numpy(optimizer.skipped_steps)) == 0
    for a, e, i in zip(actual, expected, initial):
        moved = np.max(np.abs(e - i))
        assert np.max(np.abs(a - e)) <= bound * moved


def test_a_skipped_micro_step_does_not_count():
    x, y = data(n=BATCH)
    bad = np.full_like(x, np.nan)
    reference, model = scaled_mlp("scaled_float32"), scaled_mlp("scaled_float32")
    for m, batches in ((reference, [x, x, x]), (model, [x, bad, x, x])):
        m.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2), gradient_accumulation_steps=3), loss="mse")
        for b in batches:
            m.train_on_batch(b, y)
    assert int(keras.ops.convert_to_numpy(model.optimizer.skipped_steps)) == 1
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 1
    _assert_weights_equal(represented_weights(model), represented_weights(reference))


def test_config_round_trip():
    opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-3, gradient_accumulation_steps=4))
    config = opt.get_config()
    assert config["gradient_accumulation_steps"] == 4
    again = ksc.ScaledOptimizer.from_config(config)
    assert again.gradient_accumulation_steps == 4
    assert again.inner_optimizer.gradient_accumulation_steps == 4


@pytest.mark.parametrize(
    "kwargs, inner_steps, match",
    [
        ({"gradient_accumulation_steps": 1}, None, "integer >= 2"),
        ({"gradient_accumulation_steps": 2.5}, None, "integer >= 2"),
        ({"gradient_accumulation_steps": 2}, 3, "differs"),
    ],
)
def test_bad_accumulation_steps(kwargs, inner_steps, match):
    inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=inner_steps)
    with pytest.raises(ValueError, match=match):
        ksc.ScaledOptimizer(inner, **kwargs)


@pytest.mark.skipif(
    keras.backend.backend() == "tensorflow",
    reason="suite time (18 s); TensorFlow's accumulation is tested on the MLP above",
)
def test_a_keras_hub_causal_lm_accumulates_with_its_own_compile():
    """A converted keras-hub task compiled with `AdamW(...,
    gradient_accumulation_steps=2)` (wrapped by `compile`) has the losses of
    the plain task under Keras's accumulation (scaled_float32)."""
    keras_hub = pytest.importorskip("keras_hub")
    from tests import hub_models as hm

    x = hm.make_inputs("llama", batch=2)
    y = np.random.RandomState(0).randint(0, hm.VOCAB, x["token_ids"].shape)
    losses = {}
    for scaled in (False, True):
        lm = keras_hub.models.LlamaCausalLM(backbone=hm.llama(), preprocessor=None)
        if scaled:
            ksc.scalify(lm, dtype="scaled_float32")
        lm.compile(
            optimizer=keras.optimizers.AdamW(1e-2, gradient_accumulation_steps=2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[],
        )
        losses[scaled] = [float(np.ravel(lm.train_on_batch(x, y))[0]) for _ in range(6)]
    assert isinstance(lm.optimizer, ksc.ScaledOptimizer)
    assert int(keras.ops.convert_to_numpy(lm.optimizer.iterations)) == 3
    # Micro-steps 1-2 see the initial weights, 3-4 one update, 5-6 two.
    assert losses[True][0] == pytest.approx(losses[True][1], rel=1e-6)
    assert losses[True][2] < losses[True][1]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
