"""The keras-hub workflow on converted tasks: `fit` with the task's own
compile (its default optimizer) or `compile(optimizer="adamw")`, and
`quantize` for serving."""

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from tests import hub_models as hm

keras_hub = pytest.importorskip("keras_hub")


def _causal_lm():
    return keras_hub.models.LlamaCausalLM(backbone=hm.llama(), preprocessor=None)


def _classifier():
    return keras_hub.models.BertTextClassifier(
        backbone=hm.bert(), num_classes=3, preprocessor=None
    )


TASKS = {"llama_causal_lm": (_causal_lm, "llama"), "bert_classifier": (_classifier, "bert")}


def _data(name):
    make, family = TASKS[name]
    x = hm.make_inputs(family, batch=4)
    rs = np.random.RandomState(0)
    if name == "llama_causal_lm":
        return x, rs.randint(0, hm.VOCAB, x["token_ids"].shape)
    return x, rs.randint(0, 3, (4,))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_converted_task_fits_with_its_own_compile(name):
    if name == "bert_classifier" and keras.backend.backend() != "torch":
        pytest.skip(
            "suite time (55-62 s on jax/TensorFlow): the task's own compile "
            "and its wrapping are backend-independent code; the causal LM "
            "fits on every backend, the classifier on torch"
        )
    model = TASKS[name][0]()
    ksc.scalify(model, dtype="scaled_fp8")
    assert isinstance(model.optimizer, ksc.ScaledOptimizer)  # the task's default, wrapped
    x, y = _data(name)
    losses = model.fit(x, y, epochs=3, batch_size=4, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses))
    # A plain optimizer given to `compile` is wrapped too; the settings kept.
    model.compile(
        optimizer="adamw",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    assert isinstance(model.optimizer, ksc.ScaledOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.AdamW)
    losses = model.fit(x, y, epochs=5, batch_size=4, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.skipif(
    keras.backend.backend() == "tensorflow",
    reason="suite time: 64 s of eager int8 calls on TensorFlow; unscalify and "
    "Keras's quantize are backend-independent code, run on jax and torch",
)
def test_quantize_serves_the_plain_model_quantized():
    plain, scaled = _causal_lm(), _causal_lm()
    ksc.scalify(scaled, dtype="scaled_float32")  # the same represented weights
    x, _ = _data("llama_causal_lm")
    cls = type(plain)
    scaled.quantize("int8")
    plain.quantize("int8")
    assert type(scaled) is cls
    modes = lambda m: [  # noqa: E731
        layer.quantization_mode for layer in m._flatten_layers(recursive=True)
        if getattr(layer, "quantization_mode", None)
    ]
    assert modes(scaled) == modes(plain) and "int8" in modes(scaled)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(scaled(x)), keras.ops.convert_to_numpy(plain(x)), rtol=1e-5, atol=1e-5
    )


def test_a_scaled_layer_refuses_quantize_naming_unscalify():
    layer = ksc.layers.ScaledDense(4, dtype="scaled_fp8")
    layer.build((2, 8))
    with pytest.raises(ValueError, match="unscalify"):
        layer.quantize("int8")


def test_export_says_how_to_serve_a_converted_causal_lm(tmp_path):
    """Keras's `export` of a converted keras-hub causal LM (traced with an
    unknown sequence length, which a scaled attention contraction cannot
    take) raises naming the way through, and that way exports the trained
    model: `unscalify`, a plain copy from the config and the weights."""
    pytest.importorskip("tensorflow")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("export's SavedModel is checked on TensorFlow")
    import tensorflow as tf

    lm = keras_hub.models.LlamaCausalLM(backbone=hm.llama(), preprocessor=None)
    ksc.scalify(lm, dtype="scaled_fp8")
    with pytest.raises(ValueError, match="unscalify"):
        lm.export(str(tmp_path / "scaled"))
    x = hm.make_inputs("llama", batch=2)
    ksc.unscalify(lm)
    want = np.asarray(lm.predict(x, verbose=0))
    plain = type(lm).from_config(lm.get_config())
    plain.set_weights(lm.get_weights())
    plain.export(str(tmp_path / "plain"))
    restored = tf.saved_model.load(str(tmp_path / "plain"))
    got = restored.serve(x)
    np.testing.assert_array_equal(np.asarray(got), want)
