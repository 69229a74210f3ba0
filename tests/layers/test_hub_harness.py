"""keras-hub's own test harness on converted models.

`keras_hub.src.tests.test_case.TestCase`, from the installed keras-hub (its
test files are not copied), runs `run_backbone_test`, `run_task_test` and
`run_model_saving_test` on the tiny models of `tests/hub_models.py` (one
per family of the README's coverage table) converted by
`ksc.scalify(model, dtype=policy)`, under `scaled_float32` and
`scaled_fp8`; each causal LM also runs `generate()` with its cache.

The harness builds every model itself: `cls(**init_kwargs)`, then reads
`cls.__name__` (the backbone's name must match it), calls
`instance.__class__.from_config` and `cls.from_config` (config round
trips), checks `isinstance(load_model(path), cls)` and builds
`cls(**init_kwargs, compile=False)` (a task that must refuse `fit`).
`scalified(cls, policy)` is what it gets instead of a keras-hub class: a
class named like `cls`, whose construction is
`ksc.scalify(cls(*args, **kwargs), dtype=policy)` — the converted model
itself, of the class `scalify` gives a converted root (a subclass of
`cls`) — and of which a model is an instance when `scalify` converted a
`cls` with `policy` (so the saving check also checks that `load_model`
replays the conversion). Nothing is patched in the harness or in the
models.

Checks that cannot hold by design (each skipped alone, the rest run):

- `run_backbone_test`'s mixed-precision check
  (`run_mixed_precision_check=False`): it builds the model under
  `mixed_float16`, `mixed_bfloat16` and `bfloat16` and asserts that every
  weight is stored in, and every sublayer computes in, that policy's
  dtypes. `scalify(model, dtype=policy)` sets the scaled policy on every
  converted layer: weights are stored in the scaled policy's master dtype
  (float32, or float16 under `scaled_fp8`) and converted layers compute in
  its dtype, whatever policy the model was built with. (Mixed precision
  of a converted model is the scaled policy itself.)

`run_backbone_test`'s quantization check runs (the harness itself skips
it on torch): it builds the model with Keras's int8/float8 quantized
policies, which `scalify` keeps as plain quantized layers (with a
warning), so the check's assertions on them hold.

Beside the harness: a converted backbone's `count_params()` is the plain
one's, and `generate()` (greedy) goes through `call_with_cache`, keeps the
prompt, and chooses at each step the argmax of the logits that one call
on the whole generated sequence gives (within 0.1 standard deviation of
the logits under scaled_fp8: the cached steps encode one token at a time,
with FP8 scales of their own).

Time: every family under both policies takes 5 to 20 min per backend on
a 2-core CPU, the byte-pair-tokenizer tasks (GPT-2 and the Qwens: 20-50 s
each in keras-hub's tokenizer, plain model or not) and jax's eager calls
most; the suite gives this file about a minute per backend. By default
each backend runs a slice (`DEFAULT`, below); `KSC_HUB_HARNESS=all` runs
everything.
"""

import io
import os
from unittest import mock

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from keras_scalify.models import ScalifiedModel
from tests import hub_models as hm

keras_hub = pytest.importorskip("keras_hub")
pytest.importorskip("grain")  # imported by keras-hub's test_case

from absl.testing import parameterized  # noqa: E402
from keras_hub.src.tests.test_case import TestCase  # noqa: E402

POLICIES = ("scaled_float32", "scaled_fp8")
BACKEND = keras.backend.backend()


# ----------------------------------------------------------------------------
# The class the harness gets.


class _Scalified(type):
    """Metaclass of `scalified(cls, policy)`."""

    def __call__(self, *args, **kwargs):
        return ksc.scalify(self.original(*args, **kwargs), dtype=self.policy)

    def __instancecheck__(self, obj):
        return (
            isinstance(obj, ScalifiedModel)
            and isinstance(obj, self.original)
            and [call["dtype"] for call in obj._ksc_scalify_calls] == [self.policy]
        )


def _from_config(config, custom_objects=None):
    # A converted model's config: the original's and the scalify calls.
    return ScalifiedModel.from_config(config, custom_objects)


def scalified(cls, policy):
    """What the harness gets for `cls`: constructing it gives
    `ksc.scalify(cls(...), dtype=policy)`; see the module docstring."""
    return _Scalified(
        cls.__name__,
        (),
        {
            "original": cls,
            "policy": policy,
            "from_config": staticmethod(_from_config),
            "__qualname__": f"scalified({cls.__name__}, {policy!r})",
        },
    )


# ----------------------------------------------------------------------------
# Families: the tiny backbones of tests/hub_models.py, with a task and a
# preprocessor (tokenizers built here from a few words; nothing downloaded).

SENTENCES = ["scales travel with the data", "every tensor has a scale"]
CORPUS = SENTENCES + ["the data is small"]  # the tokenizers' words
WORDS = sorted({w for s in CORPUS for w in s.split()})
PROMPT = "scales travel"
SEQ = 8  # the preprocessors' sequence length


def _sentencepiece(**special):
    """A SentencePiece proto (one piece per word) with `special` ids and
    pieces (`bos_id`, `bos_piece`, ...)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=buf,
        vocab_size=64,
        hard_vocab_limit=False,
        model_type="WORD",
        minloglevel=2,
        **special,
    )
    return buf.getvalue()


_LLAMA_SPECIAL = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
_GEMMA_SPECIAL = dict(
    pad_id=0, eos_id=1, bos_id=2, unk_id=3,
    pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
)


def _bpe(specials):
    """A byte-level BPE vocabulary and merges: a token per character of
    `WORDS` and for the word separator "Ġ", merged into the words (with
    and without a leading "Ġ")."""
    tokens = list(specials) + ["Ġ"] + sorted({c for w in WORDS for c in w})
    merges = []
    for word in WORDS:
        for pieces in (list(word), ["Ġ"] + list(word)):
            while len(pieces) > 1:
                merges.append(f"{pieces[0]} {pieces[1]}")
                pieces = [pieces[0] + pieces[1]] + pieces[2:]
                tokens.append(pieces[0])
    vocabulary = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    return vocabulary, list(dict.fromkeys(merges))


def _backbone(name, **overrides):
    """`hm.MODELS[name]()` with config entries replaced (the vocabulary
    size of a task's tokenizer)."""
    backbone = hm.MODELS[name]()
    if not overrides:
        return backbone
    config = {**backbone.get_config(), **overrides}
    keras.utils.set_random_seed(0)
    return type(backbone).from_config(config)


def _causal_lm(backbone_name, task_cls, tokenizer, preprocessor_cls=None, **kwargs):
    """`tokenizer()` makes the tokenizer. It is made again after the
    backbone: `keras.utils.set_random_seed` (the builders of
    tests/hub_models.py) resets TensorFlow's eager context, after which a
    SentencePiece tokenizer made before fails inside `tf.data`
    ("Resource ... SentencepieceOp ... does not exist"), keras_scalify or
    not."""
    backbone = _backbone(backbone_name, vocabulary_size=tokenizer().vocabulary_size())
    preprocessor_cls = preprocessor_cls or task_cls.preprocessor_cls
    preprocessor = preprocessor_cls(tokenizer(), sequence_length=SEQ, **kwargs)
    return task_cls, {"backbone": backbone, "preprocessor": preprocessor}


def _gpt2():
    vocabulary, merges = _bpe(["<|endoftext|>"])
    return _causal_lm(
        "gpt2_backbone", keras_hub.models.GPT2CausalLM,
        lambda: keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges),
    )


def _llama():
    proto = _sentencepiece(**_LLAMA_SPECIAL)
    return _causal_lm(
        "llama", keras_hub.models.LlamaCausalLM,
        lambda: keras_hub.models.LlamaTokenizer(proto=proto),
    )


def _mistral():
    proto = _sentencepiece(**_LLAMA_SPECIAL)
    return _causal_lm(
        "mistral", keras_hub.models.MistralCausalLM,
        lambda: keras_hub.models.MistralTokenizer(proto=proto),
    )


def _mixtral():
    proto = _sentencepiece(**_LLAMA_SPECIAL)
    return _causal_lm(
        "mixtral", keras_hub.models.MixtralCausalLM,
        lambda: keras_hub.models.MixtralTokenizer(proto=proto),
    )


def _gemma():
    proto = _sentencepiece(**_GEMMA_SPECIAL)
    return _causal_lm(
        "gemma", keras_hub.models.GemmaCausalLM,
        lambda: keras_hub.models.GemmaTokenizer(proto=proto),
    )


def _gemma3():
    proto = _sentencepiece(**_GEMMA_SPECIAL)
    return _causal_lm(
        "gemma3", keras_hub.models.Gemma3CausalLM,
        lambda: keras_hub.models.Gemma3Tokenizer(proto=proto, has_vision_tokens=False),
        image_converter=None,
    )


def _qwen():
    vocabulary, merges = _bpe(["<|endoftext|>"])
    return _causal_lm(
        "qwen", keras_hub.models.QwenCausalLM,
        lambda: keras_hub.models.QwenTokenizer(vocabulary=vocabulary, merges=merges),
    )


def _qwen3_moe():
    vocabulary, merges = _bpe(["<|endoftext|>", "<|im_end|>"])
    return _causal_lm(
        "qwen3_moe", keras_hub.models.Qwen3MoeCausalLM,
        lambda: keras_hub.models.Qwen3MoeTokenizer(vocabulary=vocabulary, merges=merges),
    )


def _bert():
    backbone = hm.bert()  # first: see `_causal_lm`
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        keras_hub.models.BertTokenizer(vocabulary=vocabulary), sequence_length=SEQ
    )
    return keras_hub.models.BertTextClassifier, {
        "backbone": backbone, "preprocessor": preprocessor, "num_classes": 2,
    }


def _vit():
    backbone = hm.vit()
    preprocessor = keras_hub.models.ViTImageClassifierPreprocessor(
        image_converter=keras_hub.layers.ViTImageConverter(
            image_size=(hm.IMAGE, hm.IMAGE), scale=1 / 255.0
        )
    )
    return keras_hub.models.ViTImageClassifier, {
        "backbone": backbone, "preprocessor": preprocessor, "num_classes": 2,
    }


def _images():
    return np.random.RandomState(0).uniform(0, 255, (2, hm.IMAGE, hm.IMAGE, 3)).astype("float32")


# family -> (its tests/hub_models.py builder, its task's builder: the task
# class and its `init_kwargs`)
FAMILIES = {
    "gpt2": ("gpt2_backbone", _gpt2),
    "llama": ("llama", _llama),
    "mistral": ("mistral", _mistral),
    "gemma": ("gemma", _gemma),
    "gemma3": ("gemma3", _gemma3),
    "qwen": ("qwen", _qwen),
    "mixtral": ("mixtral", _mixtral),
    "qwen3_moe": ("qwen3_moe", _qwen3_moe),
    "bert": ("bert", _bert),
    "vit": ("vit", _vit),
}
CAUSAL_LMS = [f for f in FAMILIES if f not in ("bert", "vit")]


def _backbone_output_shape(family):
    if family == "bert":
        return {"sequence_output": (2, SEQ, hm.HIDDEN), "pooled_output": (2, hm.HIDDEN)}
    if family == "vit":
        return (2, (hm.IMAGE // hm.PATCH) ** 2 + 1, hm.HIDDEN)  # + class token
    return (2, SEQ, hm.HIDDEN)


def _task_data(family, init_kwargs):
    """(train_data, expected output shape, a preprocessed input batch)."""
    preprocessor = init_kwargs["preprocessor"]
    if family == "vit":
        train = (_images(), np.array([0, 1]))
        return train, (2, 2), preprocessor(train[0])
    if family == "bert":
        train = (SENTENCES, np.array([0, 1]))
        return train, (2, 2), preprocessor(train[0])
    vocabulary_size = init_kwargs["backbone"].vocabulary_size
    x = SENTENCES
    if family == "gemma3":  # text-only Gemma3 takes prompts and responses
        x = {
            "prompts": [" ".join(s.split()[:2]) for s in SENTENCES],
            "responses": [" ".join(s.split()[2:]) for s in SENTENCES],
        }
    return (x,), (2, SEQ, vocabulary_size), preprocessor(x)[0]


# ----------------------------------------------------------------------------
# What runs by default (the suite's time), and the whole matrix on request.

_ALL = os.environ.get("KSC_HUB_HARNESS") == "all"
F32, FP8 = POLICIES
# backend -> check -> the (family, policy) cases run by default: a slice
# per backend, so that a run of the suite on the three backends covers
# every family's backbone (under scaled_fp8 on torch, where the harness is
# cheapest; under scaled_float32 on jax and TensorFlow for one family
# each), saving of every family's backbone and task, generate() on every
# causal LM (scaled_fp8 on torch, scaled_float32 on jax and TensorFlow)
# and run_task_test on four families, each check under both policies
# (about 45 s per backend on a 2-core CPU). The tasks of the
# byte-pair-tokenizer families (GPT-2 and the Qwens) take 20-50 s each in
# keras-hub's tokenizer, plain model or not: with KSC_HUB_HARNESS=all only.
DEFAULT = {
    "torch": {
        "backbone": {(f, FP8) for f in list(FAMILIES)[::2]},
        "backbone_saving": {
            ("gemma3", F32), ("qwen", FP8), ("gpt2", F32),
            ("bert", FP8), ("gemma", F32), ("mistral", FP8), ("llama", F32),
            ("mixtral", FP8), ("qwen3_moe", F32), ("vit", FP8),
        },
        "task_saving": {
            ("gemma3", FP8), ("qwen", F32), ("gpt2", FP8),
            ("bert", F32), ("gemma", FP8), ("mistral", F32), ("llama", FP8),
            ("mixtral", F32), ("qwen3_moe", FP8), ("vit", F32),
        },
        "task": {("gemma", FP8), ("vit", F32), ("llama", F32)},
        "generate": {(f, FP8) for f in CAUSAL_LMS},
    },
    "jax": {
        "backbone": {("llama", F32)},
        "generate": {("gemma3", F32)},
    },
    "tensorflow": {
        "backbone": {("mixtral", F32)},
        "generate": {("mistral", F32)},
    },
}


def _cases(families):
    return [
        (f"_{family}_{policy}", family, policy)
        for family in families
        for policy in POLICIES
    ]


def _maybe_skip(test, check, family, policy):
    if not _ALL and (family, policy) not in DEFAULT.get(BACKEND, {}).get(check, ()):
        test.skipTest("not in this backend's default slice; KSC_HUB_HARNESS=all runs it")


class HubHarnessTest(TestCase):
    @parameterized.named_parameters(_cases(FAMILIES))
    def test_backbone(self, family, policy):
        _maybe_skip(self, "backbone", family, policy)
        name = FAMILIES[family][0]
        plain = hm.MODELS[name]()
        init_kwargs = plain.get_config()
        cls = scalified(type(plain), policy)
        self.run_backbone_test(
            cls=cls,
            init_kwargs=init_kwargs,
            input_data=hm.make_inputs(name, seq=SEQ),
            expected_output_shape=_backbone_output_shape(family),
            # By design (module docstring): the policy is scalify's.
            run_mixed_precision_check=False,
        )
        # keras-hub's backbone tests also pin the parameter count: the
        # converted model counts as the plain one.
        self.assertEqual(cls(**init_kwargs).count_params(), plain.count_params())

    @parameterized.named_parameters(_cases(FAMILIES))
    def test_backbone_saving(self, family, policy):
        _maybe_skip(self, "backbone_saving", family, policy)
        name = FAMILIES[family][0]
        plain = hm.MODELS[name]()
        self.run_model_saving_test(
            cls=scalified(type(plain), policy),
            init_kwargs=plain.get_config(),
            input_data=hm.make_inputs(name, seq=SEQ),
        )

    @parameterized.named_parameters(_cases(FAMILIES))
    def test_task(self, family, policy):
        _maybe_skip(self, "task", family, policy)
        task_cls, init_kwargs = FAMILIES[family][1]()
        train_data, output_shape, _ = _task_data(family, init_kwargs)
        self.run_task_test(
            cls=scalified(task_cls, policy),
            init_kwargs=init_kwargs,
            train_data=train_data,
            expected_output_shape=output_shape,
        )

    @parameterized.named_parameters(_cases(FAMILIES))
    def test_task_saving(self, family, policy):
        _maybe_skip(self, "task_saving", family, policy)
        task_cls, init_kwargs = FAMILIES[family][1]()
        _, _, input_data = _task_data(family, init_kwargs)
        self.run_model_saving_test(
            cls=scalified(task_cls, policy),
            init_kwargs=init_kwargs,
            input_data=input_data,
        )

    @parameterized.named_parameters(_cases(CAUSAL_LMS))
    def test_generate(self, family, policy):
        """`generate()` runs through the cache (`call_with_cache`), keeps
        the prompt, and its greedy tokens are the full forward pass's
        predictions."""
        _maybe_skip(self, "generate", family, policy)
        task_cls, init_kwargs = FAMILIES[family][1]()
        preprocessor = init_kwargs["preprocessor"]
        lm = scalified(task_cls, policy)(**init_kwargs)
        lm.compile(sampler="greedy")
        with mock.patch.object(lm, "call_with_cache", wraps=lm.call_with_cache) as spy:
            # Strings in and out (the preprocessor's detokenizer).
            self.assertIn(PROMPT, lm.generate(PROMPT))
            # Token ids in and out.
            prompt = preprocessor.generate_preprocess([PROMPT])
            if family == "gemma3":
                # keras-hub 0.32's text-only Gemma3 returns `images: None`
                # from its generate step, which `generate` then fails to
                # concatenate (the plain model too): give it no images.
                prompt["images"] = np.zeros((1, 0, hm.IMAGE, hm.IMAGE, 3), "float32")
            lm.preprocessor = None
            out = lm.generate(prompt, stop_token_ids=None)
        self.assertGreater(spy.call_count, 0)
        n = int(np.sum(keras.ops.convert_to_numpy(prompt["padding_mask"])))
        tokens = keras.ops.convert_to_numpy(out["token_ids"])
        self.assertAllEqual(tokens[:, :n], prompt["token_ids"][:, :n])
        self.assertAllEqual(keras.ops.convert_to_numpy(out["padding_mask"]), np.ones((1, SEQ)))
        # The tokens decoded with the cache, one at a time, are the
        # argmax of the logits of the whole sequence computed at once.
        logits = lm({"token_ids": out["token_ids"], "padding_mask": out["padding_mask"]})
        logits = keras.ops.convert_to_numpy(logits)[0]
        chosen = logits[np.arange(n - 1, SEQ - 1), tokens[0, n:]]
        best = logits[n - 1 : SEQ - 1].max(axis=-1)
        spread = logits.std()
        tolerance = 1e-5 if policy == "scaled_float32" else 0.1
        np.testing.assert_array_less(best - chosen, tolerance * spread + 1e-30)
