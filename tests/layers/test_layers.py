"""Scaled layers against their Keras counterparts: `from_keras`/`to_keras`,
float32 invariance (outputs and input gradients), a pre-LN transformer MLP
block, unit scale at init, bad input, configs, and FP8 training with
`model.fit`."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify import backend as kb
from keras_scalify.layers import AsScaled
from keras_scalify.layers import DynamicRescaleGrad
from keras_scalify.layers import ScaledActivation
from keras_scalify.layers import ScaledAdd
from keras_scalify.layers import ScaledDense
from keras_scalify.layers import ScaledDropout
from keras_scalify.layers import ScaledEmbedding
from keras_scalify.layers import ScaledLayerNormalization
from keras_scalify.layers import ScaledRMSNormalization
from keras_scalify.layers import ToArray
from keras_scalify.layers.activation import ACTIVATIONS
from tests.conftest import assert_close
from tests.conftest import data_of
from tests.conftest import rms
from tests.conftest import to_np

RTOL = 1e-5
ATOL_REL = 1e-5  # absolute floor: 1e-5 x max|expected| (cancellations)


@pytest.fixture
def policy():
    """`policy(name)` sets the global dtype policy; restored to float32."""
    yield keras.mixed_precision.set_dtype_policy
    keras.config.set_dtype_policy("float32")


def _randn(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype("float32")


def _randomize(layer, rng):
    """Non-default weights (gamma ≠ 1, beta ≠ 0, ...) for a built layer."""
    layer.set_weights(
        [_randn(rng, w.shape, 0.5) + (1.0 if "gamma" in w.path or "scale" in w.path else 0.0)
         for w in layer.weights]
    )


def _jax_jit(fn):
    """`jax.jit(fn)` on JAX, where compiling one function is much faster
    than eager dispatch (which compiles every primitive for every new
    shape); `fn` elsewhere (eager TF and torch are fast)."""
    return kb.jit(fn) if keras.backend.backend() == "jax" else fn


def _grads(fn, *args):
    """`(value, grads)` of `fn` w.r.t. every arg."""
    value, grads = _jax_jit(kb.value_and_grad(fn))(*[ops.convert_to_tensor(a) for a in args])
    return to_np(value), [to_np(g) for g in grads]


def _check_same(scaled_fn, keras_fn, args, rng, out_shape):
    """Outputs and gradients w.r.t. every arg of `scaled_fn` (returning a
    ScaledTensor) and `keras_fn`, with one fixed upstream."""
    up = ops.convert_to_tensor(_randn(rng, out_shape))
    tensors = [ops.convert_to_tensor(a) for a in args]

    def s_fwd(*a):
        y = scaled_fn(*a)
        assert ksc.is_scaled(y)
        return ksc.to_array(y)

    def s_loss(*a):
        return ops.sum(s_fwd(*a) * up)

    def k_loss(*a):
        return ops.sum(keras_fn(*a) * up)

    y_s = _jax_jit(s_fwd)(*tensors)
    y_k = _jax_jit(keras_fn)(*tensors)
    assert_close(y_s, y_k, rtol=RTOL, atol_rel=ATOL_REL)
    v_s, g_s = _grads(s_loss, *args)
    v_k, g_k = _grads(k_loss, *args)
    assert_close(v_s, v_k, rtol=RTOL, atol_rel=ATOL_REL)
    for a, b in zip(g_s, g_k):
        assert np.all(np.isfinite(a))
        assert_close(a, b, rtol=RTOL, atol_rel=ATOL_REL)


# --- from_keras / to_keras: same config, same represented weights -----------


def _keras_layers():
    return {
        "dense": (lambda: keras.layers.Dense(6, activation="gelu", bias_initializer="ones"), (3, 5, 8)),
        "dense_nobias": (lambda: keras.layers.Dense(6, use_bias=False), (3, 8)),
        "layer_norm": (lambda: keras.layers.LayerNormalization(epsilon=1e-5), (3, 5, 8)),
        "layer_norm_axes": (lambda: keras.layers.LayerNormalization(axis=[1, 2], center=False), (3, 5, 8)),
        "rms_norm": (lambda: keras.layers.RMSNormalization(epsilon=1e-5), (3, 5, 8)),
        "embedding": (lambda: keras.layers.Embedding(11, 8), (3, 5)),
        "conv1d": (lambda: keras.layers.Conv1D(4, 3, padding="same", activation="relu"), (2, 9, 3)),
        "conv2d": (lambda: keras.layers.Conv2D(4, (3, 2), strides=2, data_format="channels_first"), (2, 3, 8, 7)),
    }


@pytest.mark.parametrize("name", sorted(_keras_layers()))
def test_from_keras_and_to_keras_keep_config_and_weights(name, rng):
    make, shape = _keras_layers()[name]
    k = make()
    k.build(shape)
    _randomize(k, rng)
    cls = {
        "dense": ScaledDense, "dense_nobias": ScaledDense,
        "layer_norm": ScaledLayerNormalization, "layer_norm_axes": ScaledLayerNormalization,
        "rms_norm": ScaledRMSNormalization, "embedding": ScaledEmbedding,
        "conv1d": ksc.layers.ScaledConv1D, "conv2d": ksc.layers.ScaledConv2D,
    }[name]
    s = cls.from_keras(k)
    assert type(s) is cls and s.built and s.name == k.name
    # Represented weights: exact (the pow2 split is lossless in float32).
    for a, b in zip(s.get_weights(), k.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    # Every data part is unit RMS, every scale a power of two.
    for sv in s.scaled_weights:
        d = data_of(sv.read())
        if np.any(d):
            assert 0.5 <= rms(d) < 2.0
        sc = float(to_np(sv.scale))
        assert 2.0 ** np.round(np.log2(sc)) == sc
    back = s.to_keras()
    assert type(back) is type(k) and back.name == k.name
    config_k = {key: v for key, v in k.get_config().items() if key != "dtype"}
    config_b = {key: v for key, v in back.get_config().items() if key != "dtype"}
    assert config_b == config_k
    for a, b in zip(back.get_weights(), k.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_unbuilt_from_keras_copies_config():
    s = ScaledDense.from_keras(keras.layers.Dense(7, activation="relu", name="d7"))
    assert not s.built
    assert (s.units, s.activation, s.name) == (7, "relu", "d7")
    assert ScaledDropout.from_keras(keras.layers.Dropout(0.3, seed=5)).get_config()["seed"] == 5
    assert ScaledAdd.from_keras(keras.layers.Add()).residual_weights is None
    assert ScaledActivation.from_keras(keras.layers.Activation("swish")).activation == "silu"


def test_from_keras_overrides_dtype(policy):
    k = keras.layers.Dense(4)
    k.build((2, 8))
    s = ScaledDense.from_keras(k, dtype="scaled_fp16")
    assert s.dtype_policy.name == "scaled_fp16"
    np.testing.assert_allclose(s.get_weights()[0], k.get_weights()[0], rtol=1e-3)
    # A scaled policy becomes a plain float32 one in to_keras.
    assert s.to_keras().dtype_policy.name == "float32"


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: keras.layers.Dense(4, kernel_regularizer="l2"), "kernel_regularizer"),
        (lambda: keras.layers.Dense(4, bias_constraint="non_neg"), "bias_constraint"),
        (lambda: keras.layers.Dense(4, activity_regularizer="l1"), "activity_regularizer"),
        (lambda: keras.layers.Dense(4, lora_rank=2), "lora_rank"),
        (lambda: keras.layers.Dense(4, activation="elu"), "activation"),
        (lambda: keras.layers.Activation("softplus"), "activation"),
        (lambda: keras.layers.Embedding(10, 4, mask_zero=True), "mask_zero"),
        (lambda: keras.layers.Embedding(10, 4, embeddings_regularizer="l2"), "embeddings_regularizer"),
        (lambda: keras.layers.LayerNormalization(gamma_constraint="non_neg"), "gamma_constraint"),
    ],
)
def test_from_keras_rejects_unsupported_options(make, arg):
    k = make()
    cls = {
        "Dense": ScaledDense, "Activation": ScaledActivation,
        "Embedding": ScaledEmbedding, "LayerNormalization": ScaledLayerNormalization,
    }[type(k).__name__]
    with pytest.raises(ValueError, match=arg):
        cls.from_keras(k)


def test_to_keras_rejects_what_keras_lacks():
    with pytest.raises(ValueError, match="weights"):
        ScaledAdd(weights=[0.5, 0.5]).to_keras()


def test_from_keras_rejects_other_layer_types():
    with pytest.raises(TypeError, match="keras.layers.Dense"):
        ScaledDense.from_keras(keras.layers.LayerNormalization())


def test_user_function_named_like_an_activation_is_not_converted():
    def relu(x):
        return x * 2.0

    with pytest.raises(ValueError, match="activation"):
        ScaledDense(4, activation=relu)


# --- float32 invariance: outputs and input gradients -------------------------


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "softmax"])
def test_dense_matches_keras(activation, rng):
    k = keras.layers.Dense(6, activation=activation)
    k.build((3, 4, 8))
    _randomize(k, rng)
    s = ScaledDense.from_keras(k)
    _check_same(s, k, [_randn(rng, (3, 4, 8))], rng, (3, 4, 6))


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: keras.layers.Conv1D(5, 3, activation="gelu"), (2, 9, 3)),
        (lambda: keras.layers.Conv2D(4, 3, padding="same", dilation_rate=2), (2, 8, 7, 3)),
        (lambda: keras.layers.Conv2D(4, 2, strides=2, data_format="channels_first"), (2, 3, 8, 6)),
    ],
)
def test_conv_matches_keras(make, shape, rng):
    k = make()
    k.build(shape)
    _randomize(k, rng)
    s = ksc.layers.ScaledConv1D.from_keras(k) if len(shape) == 3 else ksc.layers.ScaledConv2D.from_keras(k)
    x = _randn(rng, shape)
    _check_same(s, k, [x], rng, tuple(_keras_output_or_skip(k, x).shape))


def _keras_output_or_skip(layer, x):
    """`layer(x)`, or a skip where Keras's own layer cannot run here:
    TensorFlow's CPU convolution without oneDNN (TensorFlow enables oneDNN
    only on CPUs with AVX-512 VNNI/BF16, AVX-VNNI or AMX: not on AMD EPYC)
    takes channels-last inputs only."""
    try:
        return layer(x)
    except Exception as e:  # the backend's own error type
        if "NHWC" not in str(e):
            raise
        line = next(l for l in str(e).splitlines() if "NHWC" in l)
        pytest.skip(
            f"Keras's own {type(layer).__name__} cannot run on this CPU "
            f"with this backend: {line.strip()[:200]}"
        )


def test_conv_rejects_what_it_lacks():
    with pytest.raises(ValueError, match="groups"):
        ksc.layers.ScaledConv2D.from_keras(keras.layers.Conv2D(4, 3, groups=2))
    with pytest.raises(ValueError, match="padding"):
        ksc.layers.ScaledConv1D(4, 3, padding="causal")
    with pytest.raises(ValueError, match="kernel_size"):
        ksc.layers.ScaledConv2D(4, (3, 0))


def test_dense_matches_keras_on_scaled_input(rng):
    """A ScaledTensor input with scale 2^-6: same values, and the gradient
    w.r.t. its data is the true gradient times the scale."""
    k = keras.layers.Dense(5, activation="gelu")
    k.build((4, 8))
    _randomize(k, rng)
    s = ScaledDense.from_keras(k)
    x = _randn(rng, (4, 8))
    sc = 2.0**-6
    _check_same(
        lambda d: s(ksc.as_scaled(d, sc)),
        lambda d: k(d * sc),
        [x / sc],
        rng,
        (4, 5),
    )


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"axis": [1, 2]}, {"center": False}, {"scale": False, "epsilon": 1e-6}, {"axis": 1}],
)
def test_layer_normalization_matches_keras(kwargs, rng):
    k = keras.layers.LayerNormalization(**kwargs)
    k.build((3, 5, 8))
    _randomize(k, rng)
    s = ScaledLayerNormalization.from_keras(k)
    reference = k
    if kwargs.get("axis") == 1 and keras.backend.backend() == "torch":
        # Keras's torch LayerNormalization rejects a single non-last axis
        # ("expected input with shape [*, 5]"): compare with the formula.
        reference = _layer_norm_formula(k, axis=1)
    _check_same(s, reference, [_randn(rng, (3, 5, 8), 3.0)], rng, (3, 5, 8))


def _layer_norm_formula(k, axis):
    gamma, beta = (ops.reshape(ops.convert_to_tensor(w), (1, -1, 1)) for w in k.get_weights())

    def fn(x):
        # Two passes (Keras's torch `moments` takes E[x²] - E[x]², which
        # loses digits to cancellation on rows with a large mean).
        mean = ops.mean(x, axis=axis, keepdims=True)
        var = ops.mean(ops.square(x - mean), axis=axis, keepdims=True)
        return (x - mean) * ops.rsqrt(var + k.epsilon) * gamma + beta

    return fn


def test_rms_normalization_matches_keras(rng):
    k = keras.layers.RMSNormalization()
    k.build((3, 5, 8))
    _randomize(k, rng)
    s = ScaledRMSNormalization.from_keras(k)
    _check_same(s, k, [_randn(rng, (3, 5, 8), 0.1)], rng, (3, 5, 8))


def test_embedding_matches_keras(rng):
    k = keras.layers.Embedding(13, 8)
    k.build((2, 5))
    _randomize(k, rng)
    s = ScaledEmbedding.from_keras(k)
    tokens = rng.integers(0, 13, (2, 5)).astype("int32")
    assert_close(s(tokens), k(tokens), rtol=RTOL, atol_rel=ATOL_REL)
    # The tied projection x @ tableᵀ and its input gradient.
    table = ops.convert_to_tensor(k.get_weights()[0])
    _check_same(
        lambda x: s(x, reverse=True),
        lambda x: ops.matmul(x, ops.transpose(table)),
        [_randn(rng, (2, 5, 8))],
        rng,
        (2, 5, 13),
    )


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_matches_keras(name, rng):
    from keras_scalify.layers.activation import keras_activation

    if name == "gelu_approximate":
        pytest.importorskip("keras_hub", reason="gelu_approximate is keras-hub's")

    k = keras.layers.Activation(keras_activation(name))
    s = ScaledActivation.from_keras(k)
    _check_same(s, k, [_randn(rng, (4, 7), 2.0)], rng, (4, 7))


@pytest.mark.parametrize("n", [2, 3])
def test_add_matches_keras(n, rng):
    k = keras.layers.Add()
    s = ScaledAdd.from_keras(k)
    # Very different magnitudes exercise the add scale rule.
    args = [_randn(rng, (4, 6), 4.0**i) for i in range(n)]
    _check_same(lambda *a: s(list(a)), lambda *a: k(list(a)), args, rng, (4, 6))


def test_dropout_matches_keras(rng):
    x = _randn(rng, (8, 16))
    k = keras.layers.Dropout(0.5, seed=3)
    s = ScaledDropout.from_keras(k)
    # Inference: identity, gradient identity.
    _check_same(s, k, [x], rng, (8, 16))
    # Training: the same seed draws the same mask.
    y_k = to_np(keras.layers.Dropout(0.5, seed=3)(x, training=True))
    y_s = to_np(ScaledDropout(0.5, seed=3)(x, training=True))
    np.testing.assert_allclose(y_s, y_k, rtol=RTOL)
    assert 0.2 < np.mean(y_k == 0) < 0.8


def _mlp_block_layers(rng, d=16, hidden=64):
    ln = keras.layers.LayerNormalization()
    up = keras.layers.Dense(hidden, activation="gelu")
    down = keras.layers.Dense(d)
    ln.build((None, d))
    up.build((None, d))
    down.build((None, hidden))
    for layer in (ln, up, down):
        _randomize(layer, rng)
    return ln, up, down


def test_transformer_mlp_block_matches_keras(rng):
    """x + Dense(gelu(Dense(LN(x)))) from scaled layers == the Keras block."""
    ln, up, down = _mlp_block_layers(rng)
    add = keras.layers.Add()
    s_ln, s_up, s_down = (
        ScaledLayerNormalization.from_keras(ln),
        ScaledDense.from_keras(up),
        ScaledDense.from_keras(down),
    )
    s_add = ScaledAdd()

    def scaled_block(x):
        return s_add([x, s_down(s_up(s_ln(x)))])

    def keras_block(x):
        return add([x, down(up(ln(x)))])

    _check_same(scaled_block, keras_block, [_randn(rng, (4, 5, 16))], rng, (4, 5, 16))


# --- unit scale at init --------------------------------------------------------


@pytest.mark.parametrize("policy_name", ["float32", "scaled_fp8"])
def test_unit_scale_at_init(policy_name, policy, rng):
    policy(policy_name)
    d = 128
    x = ops.convert_to_tensor(_randn(rng, (64, d)))
    tokens = ops.convert_to_tensor(rng.integers(0, 1000, (64, 16)).astype("int32"))
    layers = {
        "dense": ScaledDense(4 * d),
        "dense_gelu": ScaledDense(d, activation="gelu"),
        "layer_norm": ScaledLayerNormalization(),
        "rms_norm": ScaledRMSNormalization(),
        "ln": ScaledLayerNormalization(),
        "up": ScaledDense(4 * d, activation="gelu"),
        "down": ScaledDense(d),
        "embedding": ScaledEmbedding(1000, d),
    }
    for name, layer in layers.items():
        layer.build({"up": (None, d), "down": (None, 4 * d), "embedding": None}.get(name, (None, d)))

    def forward(x, tokens):
        out = {name: layers[name](x) for name in ("dense", "dense_gelu", "layer_norm", "rms_norm")}
        out["embedding"] = layers["embedding"](tokens)
        branch = layers["down"](layers["up"](layers["ln"](x)))
        out["mlp_block"] = ScaledAdd()([x, branch])
        return {k: ops.cast(y.data, "float32") for k, y in out.items()}

    for name, data in _jax_jit(forward)(x, tokens).items():
        r = rms(to_np(data))
        assert 0.25 <= r <= 4.0, (name, r)


# --- bad input -------------------------------------------------------------------


def test_dense_wrong_input_dim():
    layer = ScaledDense(4)
    layer(np.ones((2, 8), "float32"))
    with pytest.raises(ValueError, match="inputs"):
        layer(np.ones((2, 6), "float32"))


def test_layer_normalization_axis_out_of_range():
    with pytest.raises(ValueError, match="axis"):
        ScaledLayerNormalization(axis=3)(np.ones((2, 8), "float32"))
    with pytest.raises(ValueError, match="axis"):
        ScaledRMSNormalization(axis=-3)(np.ones((2, 8), "float32"))


def test_fp8_master_dtype_is_rejected():
    with pytest.raises(ValueError, match="master_dtype"):
        ksc.ScaledDTypePolicy(master_dtype="float8_e4m3fn")
    layer = ScaledDense(4)
    with pytest.raises(ValueError, match="master_dtype"):
        ksc.ScaledVariable(layer, "w", (2, 2), "ones", master_dtype="float8_e4m3fn")


def test_plain_keras_layer_receiving_a_scaled_tensor_names_to_array(rng):
    x = ksc.as_scaled(_randn(rng, (4, 8)), 2.0)
    for layer in (keras.layers.Dense(3), keras.layers.LayerNormalization(), keras.layers.Activation("relu")):
        with pytest.raises(TypeError, match="ToArray"):
            layer(x)
    # Symbolically, while building a Functional model.
    inp = keras.Input((8,))
    h = AsScaled()(inp)
    with pytest.raises(TypeError, match="ToArray"):
        keras.layers.Dense(3)(h)
    # With the boundary it works.
    out = keras.layers.Dense(3)(ToArray()(h))
    assert tuple(out.shape) == (None, 3)


def test_embedding_rejects_scaled_tokens():
    with pytest.raises(TypeError, match="token"):
        ScaledEmbedding(10, 4)(ksc.as_scaled(np.ones((2, 3), "float32")))


# --- configs -----------------------------------------------------------------------


def _all_scaled_layers():
    layers = [
        ScaledDense(5, activation="gelu", use_bias=False, kernel_initializer="he_normal"),
        ScaledLayerNormalization(axis=[1, 2], epsilon=1e-5, center=False, grad_rescale=None),
        ScaledRMSNormalization(epsilon=1e-4, grad_rescale="max"),
        ScaledEmbedding(10, 4, embeddings_initializer="normal"),
        ScaledActivation("silu"),
        ScaledAdd(weights=[0.5, 0.25]),
        ScaledDropout(0.25, noise_shape=(None, 1), seed=7),
        AsScaled(scale=0.25, grad_scale=8.0),
        ToArray(dtype_out="float16"),
        DynamicRescaleGrad("l1"),
    ]
    if hasattr(ksc.layers, "ScaledEinsumDense"):
        layers.append(ksc.layers.ScaledEinsumDense("abc,cd->abd", output_shape=(None, 4), bias_axes="d"))
    if hasattr(ksc.layers, "ScaledMultiHeadAttention"):
        layers.append(ksc.layers.ScaledMultiHeadAttention(num_heads=2, key_dim=4))
    return layers


@pytest.mark.parametrize("layer", _all_scaled_layers(), ids=lambda l: type(l).__name__)
def test_config_round_trip(layer):
    config = layer.get_config()
    clone = type(layer).from_config(config)
    assert type(clone) is type(layer)
    assert clone.get_config() == config
    # Through Keras's own (de)serialization, by registered name.
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(restored) is type(layer)
    assert restored.get_config() == config


def test_config_keeps_scaled_policy(policy):
    layer = ScaledDense(3, dtype="scaled_fp8")
    clone = ScaledDense.from_config(layer.get_config())
    assert clone.dtype_policy == layer.dtype_policy
    assert clone.policy_dtype("matmul_dtype") == "float8_e4m3fn"


# --- FP8 training with model.fit ---------------------------------------------


def test_fp8_sequential_trains_with_fit(policy):
    policy("scaled_fp8")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 8)).astype("float32")
    w = rng.standard_normal((8, 1)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * x[:, :1]).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            AsScaled(),
            ScaledDense(32, activation="gelu"),
            ScaledLayerNormalization(),
            ScaledDense(16),
            ToArray(),
            keras.layers.Dense(1),
        ]
    )
    dense = model.layers[1]
    assert dense.dtype_policy.name == "scaled_fp8"
    assert dense.policy_dtype("matmul_dtype") == "float8_e4m3fn"
    assert dense.kernel.data.dtype == "float16"
    model.compile(optimizer=ksc.ScaledOptimizer(keras.optimizers.Adam(3e-3)), loss="mse")
    history = model.fit(x, y, batch_size=32, epochs=6, verbose=0).history["loss"]
    assert np.all(np.isfinite(history)), history
    assert history[-1] < 0.6 * history[0], history
    pred = model.predict(x[:16], verbose=0)
    assert np.all(np.isfinite(pred))
    for v in model.weights:
        assert np.all(np.isfinite(to_np(v))), v.path


def test_eager_calls_pass_scaled_tensors_through_keras_as_single_values(monkeypatch):
    """An eager call of a built scaled layer hands Keras's `Layer.__call__`
    its ScaledTensor arguments (alone or in a list of them) as opaque
    values, so Keras's tree walks never rebuild one; `call` gets them back
    and the outputs are those of `call` itself."""
    from keras.src import tree

    from keras_scalify.layers.base import contains_scaled

    rng = np.random.default_rng(0)
    x = ksc.as_scaled(ops.convert_to_tensor(rng.standard_normal((2, 3)).astype("float32")), 4.0)
    dense, add = ScaledDense(5), ScaledAdd()
    dense(x), add([x, x])  # built
    want = [dense.call(x), add.call([x, x])]
    walked = []
    original = tree.flatten

    def flatten(structure):
        walked.append(contains_scaled(structure))
        return original(structure)

    monkeypatch.setattr(tree, "flatten", flatten)
    got = [dense(x), add([x, x])]
    assert walked and not any(walked)
    for g, w in zip(got, want):
        assert ksc.is_scaled(g)
        for a, b in zip(g, w):
            np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
