"""Scaled regions (`keras_scalify/layers/regions.py`): inside a custom layer
converted in place, ScaledTensors flow between the converted sublayers and
through the layer's own `keras.ops` code; plain Keras layers get decoded
values (Dropout: the data, scale kept); a layer holding a model opens no
region; the region decodes what it returns."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify.layers import regions
from tests.conftest import assert_close
from tests.conftest import to_np


class Block(keras.layers.Layer):
    """A pre-norm MLP block with a gated unit, written as keras-hub writes
    them: sublayers plus `keras.ops` and Python operators."""

    def __init__(self, width=16, rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization()
        self.gate = keras.layers.Dense(width)
        self.up = keras.layers.Dense(width)
        self.down = keras.layers.Dense(8)
        self.softmax = keras.layers.Softmax()
        self.dropout = keras.layers.Dropout(rate, seed=3)

    def build(self, shape):
        for layer, s in ((self.norm, shape), (self.gate, shape), (self.up, shape)):
            layer.build(s)
        self.down.build(shape[:-1] + (self.up.units,))

    def call(self, x, training=False):
        h = self.norm(x)
        gated = ops.silu(self.gate(h)) * self.up(h)
        mixed = gated * self.softmax(gated)  # a plain Keras layer inside
        y = self.dropout(self.down(ops.reshape(mixed, ops.shape(mixed))), training=training)
        return x + y


class Wrapper(keras.layers.Layer):
    """A custom layer holding a Functional model and a Dense: no region
    (the model's graph nodes run backend ops, not `keras.ops`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        inp = keras.Input((4, 8))
        self.inner = keras.Model(inp, keras.layers.Dense(8)(inp))
        self.dense = keras.layers.Dense(8)

    def build(self, shape):
        self.dense.build(shape)

    def call(self, x):
        return self.inner(self.dense(x)) * 0.5


def _model(make, seed=1):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4, 8))
    return keras.Model(inp, keras.layers.Dense(8)(make()(inp)))


def _x(rng):
    return rng.standard_normal((2, 4, 8)).astype("float32")


def _input_grad(model, x):
    from keras_scalify import backend as kb

    _, (grad,) = kb.value_and_grad(lambda t: ops.sum(ops.square(model(t))))(x)
    return to_np(grad)


def test_scales_flow_between_converted_sublayers(rng):
    x = _x(rng)
    model = ksc.scalify(_model(Block), dtype="scaled_fp8")
    prop = ksc.debug.propagation(model, x)
    # norm gets the plain block input; gate and up the norm's ScaledTensor,
    # down the product of ScaledTensors.
    assert prop["plain_inputs"] == 1 and prop["scaled_inputs"] == 3
    assert {"silu", "reshape"} <= set(prop["rule"]) and not prop["fallback"]
    out = model(x)
    assert not ksc.is_scaled(out) and np.all(np.isfinite(to_np(out)))


@pytest.mark.parametrize("make", [Block, Wrapper])
def test_float32_outputs_and_gradients_equal_the_original(rng, make):
    x = _x(rng)
    original = _model(make)
    converted = ksc.scalify(_model(make), dtype="scaled_float32")
    assert_close(to_np(converted(x)), to_np(original(x)), rtol=1e-5, atol_rel=1e-5)
    assert_close(_input_grad(converted, x), _input_grad(original, x), rtol=1e-5, atol_rel=1e-5)


def test_dropout_in_a_region_drops_the_same_values(rng):
    x = _x(rng)
    original = _model(lambda: Block(rate=0.5))
    converted = ksc.scalify(_model(lambda: Block(rate=0.5)), dtype="scaled_float32")
    assert_close(
        to_np(converted(x, training=True)), to_np(original(x, training=True)),
        rtol=1e-5, atol_rel=1e-5,
    )


def test_a_layer_holding_a_model_passes_it_plain_values(rng):
    seen = []
    model = ksc.scalify(_model(Wrapper), dtype="scaled_fp16")
    wrapper = model.layers[1]
    inner_call = wrapper.inner.call

    def spy(*args, **kwargs):
        seen.append(ksc.is_scaled(args[0]))
        return inner_call(*args, **kwargs)

    object.__setattr__(wrapper.inner, "call", spy)
    model(_x(rng))
    object.__setattr__(wrapper.inner, "call", inner_call)
    assert seen == [False]  # the Dense's ScaledTensor was decoded


def test_unscalify_and_debug_tools_leave_the_wrappers_right(rng):
    x = _x(rng)
    model = _model(Block)
    expected = to_np(model(x))
    model = ksc.scalify(model, dtype="scaled_float32")
    wrapped = [l for l in model._flatten_layers() if "_ksc_plain_call" in l.__dict__]
    assert wrapped
    ksc.debug.gemm_coverage(model, x)  # wraps calls too, then restores them
    assert all("call" in l.__dict__ for l in wrapped)
    model = ksc.unscalify(model)
    assert not any("call" in l.__dict__ for l in model._flatten_layers())
    assert not regions.in_region()
    assert_close(to_np(model(x)), expected, rtol=1e-5, atol_rel=1e-5)


def test_keras_hub_rotary_embedding_runs_on_the_data(rng):
    """keras-hub's RotaryEmbedding (a rotation of feature pairs: linear,
    RMS kept) runs on a ScaledTensor's data in a region, the scales kept,
    the data's dtype kept; outside a region it is the plain layer."""
    keras_hub = pytest.importorskip("keras_hub")
    from keras_hub.src.layers.modeling.rotary_embedding import RotaryEmbedding

    layer = RotaryEmbedding()
    assert regions._kind(layer) is regions._cast_data_call
    call = regions._cast_data_call(layer.call)
    data = rng.standard_normal((2, 5, 3, 8)).astype("float32")
    x = ksc.as_scaled(ops.cast(data, "float16"), 2.0**-7, 2.0**3)
    with regions._region(True):
        out = call(x)
    assert ksc.is_scaled(out) and ksc.core.formats.dtype_name(out.data.dtype) == "float16"
    assert float(out.scale) == 2.0**-7 and float(out.grad_scale) == 2.0**3
    want = layer(ops.cast(ops.cast(data, "float16"), "float32"))
    assert_close(to_np(out), to_np(want) * 2.0**-7, rtol=2.0**-10, atol_rel=2.0**-10)
    plain = call(ops.convert_to_tensor(data))
    assert_close(to_np(plain), to_np(layer(data)), rtol=0, atol_rel=0)
    # Subclasses may change `call`: not taken by name.
    sub = type("MyRotary", (RotaryEmbedding,), {})()
    assert regions._kind(sub) is regions._transparent_call


@pytest.mark.parametrize("name", ["llama.llama_layernorm.LlamaLayerNorm", "qwen.qwen_layernorm.QwenLayerNorm"])
def test_keras_hub_rms_norms_take_the_rule(rng, name):
    """keras-hub's RMS norms in a region: the `rms_normalization` rule times
    the `scale` weight; the represented output and the gradients of the
    input and of `scale` are the plain layer's."""
    pytest.importorskip("keras_hub")
    import importlib

    from keras_scalify import backend as kb

    module, cls = name.rsplit(".", 1)
    layer = getattr(importlib.import_module(f"keras_hub.src.models.{module}"), cls)(epsilon=1e-5)
    layer.build((2, 5, 8))
    layer.scale.assign(rng.standard_normal(8).astype("float32"))
    assert regions._kind(layer) is regions._rms_norm_call
    call = regions._rms_norm_call(layer.call)
    data = rng.standard_normal((2, 5, 8)).astype("float32")
    up = ops.convert_to_tensor(rng.standard_normal((2, 5, 8)).astype("float32"))

    def scaled_loss(d):
        with regions._region(True):
            out = call(ksc.as_scaled(d, 2.0**-20, 2.0**6))
        assert ksc.is_scaled(out)
        return ops.sum(ksc.to_array(out) * up)

    def plain_loss(x):
        return ops.sum(layer.call(x) * up)

    v1, (g1,) = kb.value_and_grad(scaled_loss)(data)
    v0, (g0,) = kb.value_and_grad(plain_loss)(data * np.float32(2.0**-20))
    assert_close(v1, v0, rtol=1e-5, atol_rel=1e-5)
    assert_close(to_np(g1), to_np(g0) * 2.0**-20, rtol=1e-5, atol_rel=1e-5)
