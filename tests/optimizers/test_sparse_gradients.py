"""Embedding gradients with repeated token ids: on TensorFlow they arrive as
`tf.IndexedSlices` holding one row per occurrence, and Keras's optimizers
(Adam's second moment, ...) treat them row by row, not as the summed dense
gradient. ScaledOptimizer must hand the inner optimizer the same kind of
gradient as plain Keras does, so that it trains to the same weights."""

import keras
import numpy as np
import pytest

import keras_scalify as ksc


def _token_model(vocab=16, dim=8, seq=6, seed=3):
    keras.utils.set_random_seed(seed)
    x = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim, name="emb")(x)
    h = keras.layers.Dense(dim, activation="relu", name="hidden")(h)
    return keras.Model(x, keras.layers.Dense(vocab, name="logits")(h))


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
    lambda: keras.optimizers.SGD(0.1, momentum=0.9),
], ids=["adamw", "sgd_momentum"])
def test_embedding_with_repeated_tokens_matches_plain_keras(make_optimizer):
    steps, batch, vocab, seq = 20, 4, 16, 6
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (steps * batch, seq)).astype("int32")
    y = rng.integers(0, vocab, (steps * batch, seq)).astype("int32")
    assert all(len(np.unique(x[i:i + batch])) < batch * seq for i in range(0, len(x), batch))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    plain = _token_model()
    scaled = ksc.scalify(_token_model(), dtype="scaled_float32")  # same seed: same weights
    plain.compile(make_optimizer(), loss)
    scaled.compile(ksc.ScaledOptimizer(make_optimizer()), loss)
    hp = plain.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    hs = scaled.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    # Adam divides by sqrt(v): float32 rounding differences of near-zero
    # gradient elements reach ~1e-5 of the weights; the bug moved the
    # embedding by ~0.4 of its max.
    for name in ("emb", "hidden", "logits"):
        for a, e in zip(scaled.get_layer(name).get_weights(), plain.get_layer(name).get_weights()):
            np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4 * np.max(np.abs(e)))
    np.testing.assert_allclose(hs.history["loss"], hp.history["loss"], rtol=1e-5)
