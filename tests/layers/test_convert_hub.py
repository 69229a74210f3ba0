"""`scalify` on keras-hub models (tiny configs, random weights, nothing
downloaded): conversion inside transformer blocks, GEMM coverage, float32
invariance, low-precision training, saving, `unscalify`, `generate()`."""

import functools

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from tests import hub_models as hm

pytest.importorskip("keras_hub")

ALL = list(hm.MODELS)
# Trained in the (slower) training tests: one per family of blocks.
TRAINED = ["gpt2_causal_lm", "llama", "gemma", "bert", "vit", "mixtral", "qwen3_moe"]
MOE = ["mixtral", "qwen3_moe"]


def _np(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype=np.float64)


def _outputs(model, x):
    return [_np(t) for t in keras.tree.flatten(model(x))]


def _head(backbone):
    """A Functional model on a backbone's (sequence) output."""
    out = backbone.output
    if isinstance(out, dict):
        out = out["sequence_output"]
    return keras.Model(backbone.input, out)


def _fit(name, model, steps=20, optimizer=None):
    x = hm.make_inputs(name, batch=4)
    rs = np.random.RandomState(1)
    if name == "gpt2_causal_lm":
        net = model
        y = rs.randint(0, hm.VOCAB, x["token_ids"].shape)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        net = _head(model)
        shape = keras.tree.flatten(net(x))[0].shape
        y = rs.normal(size=shape).astype("float32")
        loss = "mse"
    net.compile(optimizer=optimizer, loss=loss)
    # Built before `fit`: Keras on TensorFlow otherwise builds it inside the
    # first trace of the step, which tf.function then traces again (~15 s
    # for a scaled model here; that path is the keras-hub rows' of
    # tests/benchmarks/test_benchmarks.py).
    net.optimizer.build(net.trainable_variables)
    history = net.fit(x, y, epochs=steps, batch_size=4, verbose=0, shuffle=False)
    return history.history["loss"]


@functools.lru_cache(maxsize=None)
def _plain_adamw(name):
    """The unconverted model's losses over 20 AdamW steps and its outputs
    after them (shared by the tests that compare against it)."""
    plain = hm.MODELS[name]()
    losses = _fit(name, plain, 20, keras.optimizers.AdamW(1e-3))
    return losses, _outputs(plain, hm.make_inputs(name))


def _keras_layers(model, classes):
    return [
        layer
        for layer in model._flatten_layers(recursive=True)
        if type(layer) in classes
    ]


@pytest.mark.parametrize("name", ALL)
def test_scalify_converts_keras_hub_models(name):
    model = hm.MODELS[name]()
    x = hm.make_inputs(name)
    n_params = model.count_params()
    before = ksc.debug.gemm_coverage(model, x)
    assert before["scaled"] == 0 and before["total"] > 0

    out = ksc.scalify(model, dtype="scaled_fp8")
    assert out is model  # converted in place, class and methods kept
    assert ksc.debug.count_params(model) == n_params  # tied layers stay shared
    kernel_classes = (
        keras.layers.Dense,
        keras.layers.EinsumDense,
        keras.layers.Embedding,
        keras.layers.ReversibleEmbedding,
        keras.layers.MultiHeadAttention,
    )
    assert not _keras_layers(model, kernel_classes)
    coverage = ksc.debug.gemm_coverage(model, x)
    assert coverage["total"] == before["total"]
    assert coverage["fraction"] >= 0.9, coverage["layers"]
    assert coverage["fp8"] == coverage["scaled"]  # every scaled GEMM in FP8
    unscaled = {row[1] for row in coverage["layers"] if not row[3]}
    assert unscaled <= {"Conv2D"}  # ViT's patching convolution
    assert all(np.isfinite(o).all() for o in _outputs(model, x))


@pytest.mark.parametrize("name", MOE)
def test_moe_experts_are_scaled_and_auxiliary_losses_stay_plain(name):
    """The experts' kernels (a custom layer's own weights, contracted with
    `keras.ops.einsum`) become ScaledVariables; the routers' auxiliary
    losses (`add_loss` on scaled logits) leave the regions as plain
    tensors equal to the plain model's."""
    plain, scaled = hm.MODELS[name](), hm.MODELS[name]()
    x = hm.make_inputs(name)
    plain_out = _np(plain(x, training=True))
    ksc.scalify(scaled, dtype="scaled_float32")
    scaled_out = _np(scaled(x, training=True))
    np.testing.assert_allclose(scaled_out, plain_out, rtol=1e-5, atol=1e-5 * np.abs(plain_out).max())
    assert len(scaled.losses) == len(plain.losses) == hm.LAYERS
    for a, b in zip(plain.losses, scaled.losses):
        assert tuple(b.shape) == ()
        np.testing.assert_allclose(_np(b), _np(a), rtol=1e-5)
    experts = [
        layer for layer in scaled._flatten_layers(recursive=True) if "experts" in type(layer).__name__.lower()
    ]
    assert len(experts) == hm.LAYERS
    for layer in experts:
        kernels = [v for v in layer.trainable_variables if len(v.shape) == 3]
        assert kernels and all(getattr(v, "_ksc_scaled_variable", None) is not None for v in kernels)
    # unscalify puts plain variables back, with the same values.
    ksc.unscalify(scaled)
    for layer in experts:
        assert not any(hasattr(v, "_ksc_scaled_variable") for v in layer.trainable_variables)
    np.testing.assert_allclose(_np(scaled(x, training=True)), plain_out, rtol=1e-5, atol=1e-5 * np.abs(plain_out).max())


@pytest.mark.parametrize("name", ALL)
def test_float32_outputs_and_gradients_equal_the_original(name):
    plain, scaled = hm.MODELS[name](), hm.MODELS[name]()
    ksc.scalify(scaled, dtype="scaled_float32")
    x = hm.make_inputs(name)
    for a, b in zip(_outputs(plain, x), _outputs(scaled, x)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    if name in TRAINED:
        return  # gradients checked by 20 AdamW steps below
    # Gradients: one SGD step of learning rate 1 moves each weight by its
    # gradient.
    lp = _fit(name, plain, 1, keras.optimizers.SGD(1.0))
    ls = _fit(name, scaled, 1, ksc.ScaledOptimizer(keras.optimizers.SGD(1.0)))
    np.testing.assert_allclose(ls, lp, rtol=1e-5)
    for a, b in zip(_outputs(plain, x), _outputs(scaled, x)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


@pytest.mark.parametrize("name", TRAINED)
def test_float32_adamw_steps_equal_plain_keras(name):
    scaled = ksc.scalify(hm.MODELS[name](), dtype="scaled_float32")
    lp, plain_outputs = _plain_adamw(name)
    ls = _fit(name, scaled, 20, ksc.ScaledOptimizer(keras.optimizers.AdamW(1e-3)))
    np.testing.assert_allclose(ls, lp, rtol=1e-4)
    x = hm.make_inputs(name)
    for a, b in zip(plain_outputs, _outputs(scaled, x)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


@pytest.mark.parametrize("policy", ["scaled_fp16", "scaled_fp8"])
@pytest.mark.parametrize("name", ["gpt2_causal_lm", "llama"])
def test_low_precision_trains_like_float32(name, policy):
    reference, _ = _plain_adamw(name)
    model = ksc.scalify(hm.MODELS[name](), dtype=policy)
    losses = _fit(name, model, 20, ksc.ScaledOptimizer(keras.optimizers.AdamW(1e-3)))
    assert np.all(np.isfinite(losses))
    assert abs(losses[-1] - reference[-1]) < 0.05
    assert losses[-1] < losses[0] - 0.3  # it trained


def test_causal_lm_generate_save_load_and_unscalify(tmp_path):
    name = "gpt2_causal_lm"
    lm = hm.MODELS[name]()
    x = hm.make_inputs(name)
    original = _outputs(lm, x)
    ksc.scalify(lm, dtype="scaled_fp8")
    embedding = lm.backbone.token_embedding
    assert isinstance(embedding, ksc.layers.ScaledReversibleEmbedding)
    assert embedding.plain_io
    prompt = {
        "token_ids": x["token_ids"][:1],
        "padding_mask": np.array([[1, 1, 1, 0, 0, 0, 0, 0]], "int32"),
    }
    generated = lm.generate(prompt, max_length=8, stop_token_ids=None)
    tokens = np.asarray(generated["token_ids"])
    assert tokens.shape == (1, 8)
    np.testing.assert_array_equal(tokens[0, :3], prompt["token_ids"][0, :3])

    # `.keras`: `load_model` replays the scalify call on the keras-hub
    # model and loads every scaled variable: the scaled predictions come
    # back bit for bit (tests/layers/test_checkpoint.py: training too).
    scaled = _outputs(lm, x)
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.backbone.token_embedding, ksc.layers.ScaledReversibleEmbedding)
    for a, b in zip(scaled, _outputs(loaded, x)):
        np.testing.assert_array_equal(b, a)

    # unscalify: plain layers again; the weights are the scaled model's
    # (float16 master weights under scaled_fp8), so predictions are the
    # original's to float16 weight rounding.
    back = ksc.unscalify(lm)
    assert back is lm
    assert not [
        layer
        for layer in lm._flatten_layers(recursive=True)
        if isinstance(layer, ksc.layers.ScaledLayer)
    ]
    for a, b in zip(original, _outputs(lm, x)):
        np.testing.assert_allclose(b, a, rtol=1e-2, atol=1e-2 * np.abs(a).max())


def test_unscalify_float32_returns_the_original_predictions():
    name = "llama"
    model = hm.MODELS[name]()
    x = hm.make_inputs(name)
    original = _outputs(model, x)
    ksc.unscalify(ksc.scalify(model, dtype="scaled_float32"))
    assert type(model.transformer_layers[0]._self_attention_layer._query_dense) is (
        keras.layers.EinsumDense
    )
    for a, b in zip(original, _outputs(model, x)):
        np.testing.assert_array_equal(b, a)


def test_scalify_inside_a_functional_model_around_a_backbone():
    """A plain Functional model holding a keras-hub backbone: the graph is
    rebuilt (its head converted, ScaledTensor-aware), the backbone converted
    in place."""
    backbone = hm.MODELS["llama"]()
    x = hm.make_inputs("llama")
    h = backbone(backbone.input)
    out = keras.layers.Dense(4, name="head")(h)
    model = keras.Model(backbone.input, out)
    expected = _outputs(model, x)
    new = ksc.scalify(model, dtype="scaled_float32")
    assert isinstance(new.get_layer("head"), ksc.layers.ScaledDense)
    assert ksc.debug.gemm_coverage(new, x)["fraction"] == 1.0
    for a, b in zip(expected, _outputs(new, x)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())


def test_task_built_on_a_scalified_backbone_and_outside_callers():
    """Plain-I/O layers record plain symbolic outputs, so a task model can
    be built on a converted backbone; a backbone whose layer a task's graph
    also calls is refused (convert the task), not half-converted."""
    import keras_hub

    backbone = ksc.scalify(hm.MODELS["gpt2_backbone"](), dtype="scaled_fp8")
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    x = hm.make_inputs("gpt2_causal_lm")
    assert all(np.isfinite(o).all() for o in _outputs(lm, x))
    assert ksc.debug.gemm_coverage(lm, x)["fraction"] == 1.0

    lm = hm.MODELS["gpt2_causal_lm"]()
    old = lm.backbone.token_embedding
    with pytest.raises(ValueError, match="outermost"):
        ksc.scalify(lm.backbone, dtype="scaled_fp8")
    assert lm.backbone.token_embedding is old  # nothing replaced
    ksc.scalify(lm, dtype="scaled_fp8")
    with pytest.raises(RuntimeError, match="replaced in place"):
        old(np.zeros((1, 2), "int32"))
