"""Tiny keras-hub models with random weights, for tests.

`MODELS` maps a name to a zero-arg builder; every builder seeds Keras with
`keras.utils.set_random_seed(0)` first, so two calls give identical weights.
`make_inputs(name)` returns deterministic NumPy inputs for that model.

No presets are loaded (nothing is downloaded). Dropout is 0 everywhere so
that calls are deterministic whatever the `training` flag.
"""

import keras
import numpy as np

VOCAB = 96
SEQ_LEN = 16  # max sequence length, where the model has one
HIDDEN = 32
HEADS = 2
KV_HEADS = 1
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 64
LAYERS = 2
IMAGE = 16
PATCH = 4


def _hub():
    import keras_hub

    return keras_hub


def _gpt2():
    return _hub().models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE,
        dropout=0.0,
        max_sequence_length=SEQ_LEN,
    )


def gpt2_backbone():
    keras.utils.set_random_seed(0)
    return _gpt2()


def gpt2_causal_lm():
    keras.utils.set_random_seed(0)
    return _hub().models.GPT2CausalLM(backbone=_gpt2(), preprocessor=None)


def llama():
    keras.utils.set_random_seed(0)
    return _hub().models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_query_heads=HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE,
        num_key_value_heads=KV_HEADS,
        dropout=0,
    )


def mistral():
    keras.utils.set_random_seed(0)
    return _hub().models.MistralBackbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_query_heads=HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE,
        num_key_value_heads=KV_HEADS,
        sliding_window=SEQ_LEN,
        dropout=0,
    )


def gemma():
    keras.utils.set_random_seed(0)
    return _hub().models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE,
        head_dim=HEAD_DIM,
        dropout=0,
    )


def gemma3():
    """Text-only Gemma3 (no vision encoder)."""
    keras.utils.set_random_seed(0)
    return _hub().models.Gemma3Backbone(
        vocabulary_size=VOCAB,
        image_size=IMAGE,  # unused without a vision encoder
        num_layers=LAYERS,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE,
        head_dim=HEAD_DIM,
        sliding_window_size=SEQ_LEN,
        vision_encoder=None,
        dropout=0,
    )


def qwen():
    """Qwen2 architecture (`keras_hub.models.QwenBackbone`)."""
    keras.utils.set_random_seed(0)
    return _hub().models.QwenBackbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE,
        dropout=0,
    )


def mixtral():
    """Mixtral: 4 experts, top 2 (a mixture-of-experts family)."""
    keras.utils.set_random_seed(0)
    return _hub().models.MixtralBackbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_query_heads=HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE,
        num_key_value_heads=KV_HEADS,
        num_experts=4,
        top_k=2,
        sliding_window=SEQ_LEN,
        dropout=0,
    )


def qwen3_moe():
    """Qwen3-MoE: 4 experts, top 2 (another mixture-of-experts family)."""
    keras.utils.set_random_seed(0)
    return _hub().models.Qwen3MoeBackbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE,
        moe_intermediate_dim=INTERMEDIATE // 2,
        num_experts=4,
        head_dim=HEAD_DIM,
        top_k=2,
        dropout=0,
    )


def bert():
    keras.utils.set_random_seed(0)
    return _hub().models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        num_heads=HEADS,
        hidden_dim=HIDDEN,
        intermediate_dim=INTERMEDIATE,
        dropout=0.0,
        max_sequence_length=SEQ_LEN,
    )


def vit():
    keras.utils.set_random_seed(0)
    return _hub().models.ViTBackbone(
        image_shape=(IMAGE, IMAGE, 3),
        patch_size=PATCH,
        num_layers=LAYERS,
        num_heads=HEADS,
        hidden_dim=HIDDEN,
        mlp_dim=INTERMEDIATE,
    )


MODELS = {
    "gpt2_backbone": gpt2_backbone,
    "gpt2_causal_lm": gpt2_causal_lm,
    "llama": llama,
    "mistral": mistral,
    "gemma": gemma,
    "gemma3": gemma3,
    "qwen": qwen,
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "bert": bert,
    "vit": vit,
}


def make_inputs(name, batch=2, seq=8):
    """Deterministic NumPy inputs accepted by `MODELS[name]()(...)`/`predict`.

    Token models get a dict with "token_ids" (int32) and "padding_mask"
    (int32, last position of the second row padded); BERT also gets
    "segment_ids". ViT gets a float32 image batch (batch, 16, 16, 3).
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; have {sorted(MODELS)}")
    rs = np.random.RandomState(0)
    if name == "vit":
        return rs.uniform(0.0, 1.0, (batch, IMAGE, IMAGE, 3)).astype("float32")
    if seq > SEQ_LEN:
        raise ValueError(f"seq={seq} exceeds max sequence length {SEQ_LEN}")
    token_ids = rs.randint(1, VOCAB, size=(batch, seq)).astype("int32")
    padding_mask = np.ones((batch, seq), dtype="int32")
    if batch > 1 and seq > 1:
        padding_mask[1, -1] = 0
        token_ids[1, -1] = 0
    inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
    if name == "bert":
        segment_ids = np.zeros((batch, seq), dtype="int32")
        segment_ids[:, seq // 2 :] = 1
        inputs["segment_ids"] = segment_ids
    return inputs
