"""`scalify` / `unscalify`: Sequential and Functional models, boundaries,
unconverted layers, nested models, shared layers, options and errors."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify.layers import AsScaled
from keras_scalify.layers import DynamicRescaleGrad
from keras_scalify.layers import ScaledAdd
from keras_scalify.layers import ScaledDense
from keras_scalify.layers import ScaledEmbedding
from keras_scalify.layers import ScaledLayerNormalization
from keras_scalify.layers import ToArray
from tests.conftest import to_np

RTOL = 1e-5


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _predict(model, x):
    """Inference outputs (an eager call: faster than compiling `predict`)."""
    return to_np(model(ops.convert_to_tensor(x), training=False))


def _close(a, b, rtol=RTOL):
    floor = 1e-5 * float(np.max(np.abs(b)))
    np.testing.assert_allclose(a, b, rtol=rtol, atol=floor)


def _rel_err(a, b):
    """Normwise relative error (low-precision comparisons)."""
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _scalify_layers(model):
    return [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if type(layer).__module__.startswith("keras_scalify")
    ]


def _types(model):
    return [type(layer).__name__ for layer in model.layers]


def _mlp():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="gelu"),
            keras.layers.LayerNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Activation("tanh"),
            keras.layers.Dense(8),
        ],
        name="mlp",
    )


def _residual_with_plain_layers():
    inp = keras.Input((2, 8), name="x")
    h = keras.layers.LayerNormalization(name="ln")(inp)
    h = keras.layers.Dense(8, activation="gelu", name="up")(h)
    h = keras.layers.Add(name="residual")([inp, h])
    h = keras.layers.Flatten(name="flatten")(h)  # not converted
    h = keras.layers.Dense(16, name="mid")(h)
    h = keras.layers.Reshape((2, 8), name="reshape")(h)  # not converted
    h = keras.layers.Lambda(lambda t: ops.tanh(t) * 2.0, name="lambda")(h)  # not converted
    out = keras.layers.Dense(8, name="head")(h)
    return keras.Model(inp, out, name="residual")


def test_sequential_mlp():
    model = _mlp()
    x = _x((8, 8))
    expected = _predict(model, x)
    weights = model.get_weights()
    n_params = model.count_params()
    scaled = ksc.scalify(model)
    # In place, as `quantize`: the same object, its layers scaled, no
    # boundary layers (the root runs the graph with ScaledTensors whole).
    assert scaled is model and isinstance(scaled, keras.Sequential)
    assert _types(scaled) == [
        "ScaledDense", "ScaledLayerNormalization", "ScaledDropout",
        "ScaledDense", "ScaledActivation", "ScaledDense",
    ]
    assert scaled.layers[0].units == 16 and not scaled.layers[0].plain_io
    _close(_predict(scaled, x), expected)
    assert scaled.count_params() == n_params
    for a, b in zip(scaled.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    # Back to plain Keras: no keras_scalify layer, same predictions.
    plain = ksc.unscalify(scaled)
    assert plain is model and type(plain) is keras.Sequential
    assert not _scalify_layers(plain)
    assert _types(plain) == ["Dense", "LayerNormalization", "Dropout", "Dense", "Activation", "Dense"]
    _close(_predict(plain, x), expected)
    for a, b in zip(plain.get_weights(), weights):
        np.testing.assert_array_equal(a, b)


def test_the_scaled_graph_passes_scaled_tensors_whole(monkeypatch):
    """Between two scaled layers the ScaledTensor is passed as it is (no
    decode/encode); a plain layer gets the represented float32 values."""
    model = _residual_with_plain_layers()
    ksc.scalify(model)
    received = {}
    for layer in model.layers:
        call = layer.call

        def spy(*args, _call=call, _name=layer.name, **kwargs):
            received[_name] = type(args[0]).__name__
            return _call(*args, **kwargs)

        monkeypatch.setattr(layer, "call", spy)
    _predict(model, _x((2, 2, 8)))
    assert received["up"] == "ScaledTensor"  # from the scaled LayerNorm
    assert received["mid"] != "ScaledTensor"  # from Flatten: plain
    assert received["flatten"] != "ScaledTensor"
    assert received["lambda"] != "ScaledTensor"


def test_functional_residual_with_plain_layers():
    model = _residual_with_plain_layers()
    x = _x((8, 2, 8))
    expected = _predict(model, x)
    scaled = ksc.scalify(model)
    assert scaled is model
    types = _types(scaled)
    assert "AsScaled" not in types and "ToArray" not in types
    assert {"ScaledAdd", "ScaledLayerNormalization", "Flatten", "Reshape", "Lambda"} <= set(types)
    _close(_predict(scaled, x), expected)
    plain = ksc.unscalify(scaled)
    assert not _scalify_layers(plain)
    _close(_predict(plain, x), expected)


def test_scalify_is_idempotent_on_scaled_models():
    model = _residual_with_plain_layers()
    x = _x((8, 2, 8))
    expected = _predict(model, x)
    twice = ksc.scalify(ksc.scalify(model))
    assert twice is model and len(model._ksc_scalify_calls) == 2
    _close(_predict(twice, x), expected)


class _Halve(keras.layers.Layer):
    """A custom (plain Keras) layer that computes on ScaledTensors."""

    def call(self, x):
        return ksc.ops.multiply(x, 0.5)


def test_custom_layer_receiving_scaled_tensors_keeps_them():
    """A graph built by hand with boundary layers: its nodes record
    ScaledTensors, and the custom layer that got one still does."""
    inp = keras.Input((8,))
    h = ScaledDense(8, name="sd")(AsScaled()(inp))
    h = _Halve(name="halve")(h)
    out = ToArray()(keras.layers.Dense(8, name="d")(ToArray()(h)))
    model = keras.Model(inp, out)
    x = _x((8, 8))
    expected = _predict(model, x)
    scaled = ksc.scalify(model)
    assert isinstance(scaled.get_layer("d"), ScaledDense)
    assert _types(scaled).count("ToArray") == 2
    _close(_predict(scaled, x), expected)
    # unscalify of a graph that records ScaledTensors: a new plain graph.
    plain = ksc.unscalify(scaled)
    assert plain is not model and "ToArray" not in _types(plain)


def test_sequential_built_by_calling():
    model = keras.Sequential([keras.layers.Dense(8), keras.layers.LayerNormalization()])
    x = _x((8, 8))
    expected = _predict(model, x)
    scaled = ksc.scalify(model)
    assert _types(scaled) == ["ScaledDense", "ScaledLayerNormalization"]
    _close(_predict(scaled, x), expected)


def test_nested_and_shared_layers():
    inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu")], name="inner")
    shared = keras.layers.Dense(8, name="shared")
    inp = keras.Input((8,))
    a = shared(inp)
    b = shared(inner(a))
    out = keras.layers.Add()([a, b])
    model = keras.Model(inp, out)
    x = _x((8, 8))
    expected = _predict(model, x)
    scaled = ksc.scalify(model)
    new_shared = scaled.get_layer("shared")
    assert isinstance(new_shared, ScaledDense)
    assert len(new_shared._inbound_nodes) == 2  # still one shared layer
    assert scaled.get_layer("inner") is inner
    assert isinstance(inner.layers[0], ScaledDense)
    _close(_predict(scaled, x), expected)
    plain = ksc.unscalify(scaled)
    assert not _scalify_layers(plain)
    _close(_predict(plain, x), expected)


def test_embedding_attention_model():
    tokens = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(20, 8, name="emb")(tokens)
    a = keras.layers.LayerNormalization(name="ln")(h)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")(a, a)
    h = keras.layers.Add()([h, a])
    h = keras.layers.EinsumDense("btd,dk->btk", output_shape=(None, 8), bias_axes="k", name="ein")(h)
    out = keras.layers.RMSNormalization(name="rms")(h)
    model = keras.Model(tokens, out)
    x = np.random.default_rng(0).integers(0, 20, (8, 8)).astype("int32")
    expected = _predict(model, x)
    scaled = ksc.scalify(model)
    for name, cls in [("emb", "ScaledEmbedding"), ("mha", "ScaledMultiHeadAttention"),
                      ("ein", "ScaledEinsumDense"), ("rms", "ScaledRMSNormalization")]:
        assert type(scaled.get_layer(name)).__name__ == cls
    _close(_predict(scaled, x), expected)
    plain = ksc.unscalify(scaled)
    assert not _scalify_layers(plain)
    _close(_predict(plain, x), expected)


def test_exclude_and_unsupported_options():
    def model():
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8, kernel_regularizer="l2", name="reg"),
             keras.layers.Dense(8, name="out")]
        )

    bad = model()
    with pytest.raises(ValueError, match="kernel_regularizer.*exclude"):
        ksc.scalify(bad)
    # A refused conversion changes nothing.
    assert type(bad) is keras.Sequential and _types(bad) == ["Dense", "Dense"]
    plain = model()
    x = _x((8, 8))
    expected = _predict(plain, x)
    scaled = ksc.scalify(plain, exclude=["reg"])
    assert _types(scaled) == ["Dense", "ScaledDense"]
    _close(_predict(scaled, x), expected)
    by_class = ksc.scalify(model(), exclude=keras.layers.Dense)
    assert not _scalify_layers(by_class)


def test_dtype_override():
    model = _mlp()
    x = _x((8, 8))
    expected = _predict(model, x)
    scaled = ksc.scalify(model, dtype="scaled_fp8")
    dense = scaled.layers[0]
    assert dense.dtype_policy.name == "scaled_fp8"
    assert dense.kernel.data.dtype == "float16"
    # E4M3 matmul inputs: ~2^-4 relative rounding per element.
    assert _rel_err(_predict(scaled, x), expected) < 0.15


@pytest.fixture
def policy_guard():
    yield
    keras.config.set_dtype_policy("float32")


def test_compiled_model_stays_compiled():
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse")
    scaled = ksc.scalify(model)
    assert scaled.compiled
    assert isinstance(scaled.optimizer, ksc.ScaledOptimizer)
    assert isinstance(scaled.optimizer.inner_optimizer, keras.optimizers.SGD)
    loss = scaled.train_on_batch(_x((8, 8)), _x((8, 8)))
    assert np.isfinite(loss)


def test_unscalify_hand_built_scaled_model(policy_guard):
    keras.mixed_precision.set_dtype_policy("scaled_fp16")
    inp = keras.Input((8,))
    h = AsScaled(scale=0.5)(inp)
    h = ScaledDense(8, activation="relu")(h)
    h = DynamicRescaleGrad()(h)
    h = ScaledLayerNormalization()(h)
    h = ScaledAdd()([h, ScaledDense(8)(h)])
    out = ToArray()(h)
    model = keras.Model(inp, out)
    keras.config.set_dtype_policy("float32")
    plain = ksc.unscalify(model)
    assert not _scalify_layers(plain)
    assert all(layer.dtype_policy.name == "float32" for layer in plain.layers)
    x = _x((8, 8))
    # float16 activations in the scaled model, float32 in the plain one.
    assert _rel_err(_predict(plain, x), _predict(model, x)) < 1e-2


def test_unscalify_rejects_tied_projection():
    tokens = keras.Input((8,), dtype="int32")
    emb = ScaledEmbedding(10, 8)
    logits = ToArray()(emb(emb(tokens), reverse=True))
    with pytest.raises(ValueError, match="reverse"):
        ksc.unscalify(keras.Model(tokens, logits))


def test_bad_models():
    with pytest.raises(ValueError, match="build"):
        ksc.scalify(keras.Sequential([keras.layers.Dense(2)]))

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(ValueError, match="built"):
        ksc.scalify(Sub())
    with pytest.raises(TypeError, match="keras.Model"):
        ksc.scalify(keras.layers.Dense(2))


def test_subclassed_model_converts_in_place():
    """A subclassed model's sublayers are replaced in place by plain-I/O
    scaled layers; the model object, its `call` and outputs are kept."""

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(4, activation="relu")
            self.blocks = [keras.layers.Dense(4), keras.layers.LayerNormalization()]

        def call(self, x):
            h = self.d(x)
            for layer in self.blocks:
                h = layer(h)
            return ops.tanh(h) + x[..., :4]

    sub = Sub()
    x = _x((3, 6))
    expected = _predict(sub, x)
    n_params = sub.count_params()
    out = ksc.scalify(sub, dtype="scaled_float32")
    assert out is sub
    assert isinstance(sub.d, ScaledDense) and sub.d.plain_io
    assert isinstance(sub.blocks[0], ScaledDense)
    assert isinstance(sub.blocks[1], ksc.layers.ScaledLayerNormalization)
    assert not any(
        type(layer) in (keras.layers.Dense, keras.layers.LayerNormalization)
        for layer in sub._flatten_layers(recursive=True)
    )
    _close(_predict(sub, x), expected)
    # Represented weights: the same count (scales are bookkeeping).
    assert ksc.debug.count_params(sub) == n_params
    back = ksc.unscalify(sub)
    assert back is sub and type(sub.d) is keras.layers.Dense
    _close(_predict(sub, x), expected)


def test_unconverted_layers_are_kept_not_cloned():
    """Layers scalify does not convert (scaled layers already there, plain
    layers without a counterpart) are the model's own: no config round trip
    (keras-hub layers whose config does not round-trip convert too)."""
    inp = keras.Input((8,))
    h = ScaledDense(8, name="sd")(inp)
    h = ToArray()(h)
    out = keras.layers.Reshape((2, 4), name="reshape")(h)
    model = keras.Model(inp, out)
    sd, reshape = model.get_layer("sd"), model.get_layer("reshape")
    new = ksc.scalify(model)
    assert new.get_layer("sd") is sd
    assert new.get_layer("reshape") is reshape


def test_wrappers_and_ops_nodes_in_a_scalified_graph():
    """Keras wrappers ask their layer for output shapes (TimeDistributed);
    `keras.ops` nodes and `x + y` between KerasTensors are kept as they
    are, fed plain values."""
    inp = keras.Input((3, 6))
    h = keras.layers.TimeDistributed(keras.layers.Dense(5), name="td")(inp)
    h = ops.tanh(h) + h
    out = keras.layers.Dense(2, name="head")(h)
    model = keras.Model(inp, out)
    x = _x((4, 3, 6))
    expected = _predict(model, x)
    new = ksc.scalify(model, dtype="scaled_float32")
    assert isinstance(new.get_layer("head"), ScaledDense)
    assert isinstance(new.get_layer("td").layer, ScaledDense)
    _close(_predict(new, x), expected)


def test_plain_io_layer_called_twice_keeps_a_pow2_grad_scale():
    """A converted layer called twice in a step gets two statistics summed
    into its state; the grad scale it reads is still a power of two."""

    class Twice(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d = keras.layers.Dense(4)

        def call(self, x):
            return self.d(self.d(x))

    inp = keras.Input((4,))
    model = keras.Model(inp, Twice(name="twice")(inp))
    model = ksc.scalify(model, dtype="scaled_fp16")
    dense = model.get_layer("twice").d
    assert dense.plain_io
    model.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.SGD(1e-2)), loss="mse")
    x = _x((16, 4))
    history = model.fit(x, x, epochs=3, batch_size=8, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    state = float(to_np(dense.plain_io_grad_scale_state))
    assert state > 0
    from keras_scalify.core import pow2

    rounded = float(to_np(pow2.pow2_round_down(np.float32(state))))
    assert rounded <= state < 2 * 2 * rounded  # two powers of two summed


def test_functional_subclass_round_trips_with_keras_scalify_imported(tmp_path):
    """The Functional constructor keras_scalify wraps keeps its signature,
    which Keras reads to reload Functional subclasses."""

    @keras.saving.register_keras_serializable(package="test_convert")
    class MyFunctional(keras.Model):
        def __init__(self, inputs, outputs, name=None, **kwargs):
            super().__init__(inputs, outputs, name=name, **kwargs)

    inp = keras.Input((3,))
    model = MyFunctional(inp, keras.layers.Dense(2)(inp))
    path = str(tmp_path / "f.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = _x((2, 3))
    _close(_predict(loaded, x), _predict(model, x))


def test_converted_attention_refuses_implicit_keras_masks():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.emb = keras.layers.Embedding(10, 8, mask_zero=True)
            self.mha = keras.layers.MultiHeadAttention(2, 4)

        def call(self, t):
            h = self.emb(t)
            return self.mha(h, h)

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def call(self, t):
            return self.block(t)

    model = Sub()
    tokens = np.array([[1, 2, 3, 0, 0]], "int32")
    model(tokens)
    with pytest.warns(UserWarning, match="mask_zero"):
        ksc.scalify(model, dtype="scaled_float32")
    with pytest.raises(ValueError, match="attention_mask"):
        model(tokens)


def test_a_subclass_redefining_a_method_is_not_converted_as_its_base():
    """An attention subclass that keeps `call` but redefines
    `_compute_attention` would silently lose it as a ScaledMultiHeadAttention:
    it stays its own class, with its projections converted inside."""

    class Doubled(keras.layers.MultiHeadAttention):
        def _compute_attention(self, *args, **kwargs):
            out, scores = super()._compute_attention(*args, **kwargs)
            return out * 2.0, scores

    class Plain(keras.layers.MultiHeadAttention):
        def get_config(self):
            return super().get_config()

    class Holder(keras.Model):
        def __init__(self):
            super().__init__()
            self.doubled = Doubled(num_heads=2, key_dim=4)
            self.plain = Plain(num_heads=2, key_dim=4)

        def call(self, x):
            return self.doubled(x, x) + self.plain(x, x)

    model = Holder()
    x = _x((2, 3, 8))
    expected = _predict(model, x)
    ksc.scalify(model, dtype="scaled_float32")
    assert type(model.doubled) is Doubled
    assert isinstance(model.doubled._query_dense, ksc.layers.ScaledEinsumDense)
    assert isinstance(model.plain, ksc.layers.ScaledMultiHeadAttention)
    _close(_predict(model, x), expected)


def test_a_graph_with_dict_inputs_and_outputs_trains_and_reloads_exactly(tmp_path):
    """The scalified graph takes and returns the original's structures
    (inputs by name, a dict of outputs), compiles with per-output losses
    and reloads from `.keras` with the same outputs, bit for bit."""
    a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(8)(a), b])
    y1 = keras.layers.Dense(3, name="y1")(h)
    y2 = keras.layers.LayerNormalization(name="y2")(keras.layers.Dense(5)(h))
    model = keras.Model({"a": a, "b": b}, {"x": y1, "y": y2})
    x = {"a": _x((4, 8)), "b": _x((4, 4), seed=1)}
    expected = {k: to_np(v) for k, v in model(x).items()}
    ksc.scalify(model, dtype="scaled_float32")
    got = {k: to_np(v) for k, v in model(x).items()}
    for k in expected:
        _close(got[k], expected[k])
    model.compile(optimizer="adam", loss={"x": "mse", "y": "mse"})
    assert isinstance(model.optimizer, ksc.ScaledOptimizer)
    model.fit(x, {"x": _x((4, 3), 2), "y": _x((4, 5), 3)}, epochs=2, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, ksc.models.ScalifiedModel)
    before, after = model(x), loaded(x)
    for k in before:
        np.testing.assert_array_equal(to_np(after[k]), to_np(before[k]))
