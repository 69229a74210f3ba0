"""`.keras` checkpoints of keras-hub models converted in place: `load_model`
gives back the converted model bit for bit (every variable, predictions),
and training resumed from the file (optimizer state included) continues
with the losses of the run that was not interrupted."""

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from tests import hub_models as hm

keras_hub = pytest.importorskip("keras_hub")

POLICIES = ["scaled_fp16", "scaled_fp8"]


def _llama_causal_lm():
    return keras_hub.models.LlamaCausalLM(backbone=hm.llama(), preprocessor=None)


def _data(name):
    x = hm.make_inputs("llama" if name == "llama_causal_lm" else name, batch=2)
    rs = np.random.RandomState(3)
    if name == "llama_causal_lm":
        return x, rs.randint(0, hm.VOCAB, x["token_ids"].shape).astype("int32")
    return x, rs.normal(size=x["token_ids"].shape + (hm.HIDDEN,)).astype("float32")


def _build(name, policy):
    model = _llama_causal_lm() if name == "llama_causal_lm" else hm.gemma()
    ksc.scalify(model, dtype=policy)
    if name == "llama_causal_lm":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        loss = "mse"
    model.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.AdamW(1e-3)), loss=loss)
    return model


def _values(model):
    return [
        (v.path, np.asarray(keras.ops.convert_to_numpy(v)))
        for v in model.variables
        if "seed_generator" not in v.path  # RNG state: not saved by Keras
    ]


def _losses(model, x, y, steps):
    return [model.train_on_batch(x, y, return_dict=True)["loss"] for _ in range(steps)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["llama_causal_lm", "gemma"])
def test_save_load_is_exact_and_training_resumes(name, policy, tmp_path):
    x, y = _data(name)
    model = _build(name, policy)
    _losses(model, x, y, 3)  # trained: moved scales, states and Adam moments
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)

    assert type(loaded) is type(model)
    assert isinstance(loaded, ksc.models.ScalifiedModel)
    assert isinstance(loaded.optimizer, ksc.ScaledOptimizer)
    saved, back = _values(model), _values(loaded)
    assert [p for p, _ in back] == [p for p, _ in saved]
    for (p, a), (_, b) in zip(saved, back):
        assert a.dtype == b.dtype, p
        np.testing.assert_array_equal(b, a, err_msg=p)
    opt_saved = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    opt_back = [keras.ops.convert_to_numpy(v) for v in loaded.optimizer.variables]
    assert len(opt_back) == len(opt_saved)
    for a, b in zip(opt_saved, opt_back):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))

    for a, b in zip(keras.tree.flatten(model(x)), keras.tree.flatten(loaded(x))):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(b), keras.ops.convert_to_numpy(a)
        )
    np.testing.assert_array_equal(_losses(loaded, x, y, 5), _losses(model, x, y, 5))


def test_unscalify_gives_the_class_back_and_a_plain_file(tmp_path):
    model = _llama_causal_lm()
    cls = type(model)
    ksc.scalify(model, dtype="scaled_fp8")
    assert type(model) is not cls and isinstance(model, cls)
    plain = _llama_causal_lm()
    assert model.count_params() == plain.count_params()  # scales not counted
    assert model.get_config()["scalify"] == [{"dtype": "scaled_fp8", "exclude": []}]
    ksc.unscalify(model)
    assert type(model) is cls
    path = str(tmp_path / "plain.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is cls
    assert not [
        layer
        for layer in loaded._flatten_layers(recursive=True)
        if isinstance(layer, ksc.layers.ScaledLayer)
    ]


def test_scalify_calls_and_exclusions_are_replayed_on_load(tmp_path):
    model = hm.llama()
    ksc.scalify(model, dtype="scaled_fp16", exclude=["token_embedding"])
    ksc.scalify(model, dtype="scaled_fp16", exclude=[keras.layers.Embedding])
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_config()["scalify"] == model.get_config()["scalify"]
    assert type(loaded.token_embedding) is type(model.token_embedding)
    assert not isinstance(loaded.token_embedding, ksc.layers.ScaledLayer)
    x, _ = _data("llama")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(model(x))
    )
