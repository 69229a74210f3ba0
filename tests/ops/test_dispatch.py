"""`keras.ops` on ScaledTensors (`keras_scalify.ops.dispatch`): the scale
rule where `ksc.ops` has one, else the plain op on decoded values; plain
calls untouched; indexing; gradients in true units."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify import backend as kb
from keras_scalify.ops import dispatch
from tests.conftest import assert_close
from tests.conftest import on_gpu
from tests.conftest import spy_taken
from tests.conftest import to_np


def _st(rng, shape, scale=4.0, grad_scale=2.0**-3):
    data = rng.standard_normal(shape).astype("float32")
    return ksc.as_scaled(data, scale, grad_scale)


# name -> (call on operands, operands' shapes); each has a same-named rule.
RULED = {
    "add": (lambda a, b: ops.add(a, b), [(3, 4), (3, 4)]),
    "multiply": (lambda a, b: ops.multiply(a, b), [(3, 4), (3, 4)]),
    "matmul": (lambda a, b: ops.matmul(a, b), [(3, 4), (4, 5)]),
    "einsum": (lambda a, b: ops.einsum("btd,sd->bts", a, b), [(2, 3, 4), (5, 4)]),
    "softmax": (lambda a: ops.softmax(a, axis=-1), [(3, 4)]),
    "where": (lambda a, b: ops.where(ops.greater(a, 0.0), a, b), [(3, 4), (3, 4)]),
    "reshape": (lambda a: ops.reshape(a, (4, 3)), [(3, 4)]),
    "transpose": (lambda a: ops.transpose(a, (1, 0)), [(3, 4)]),
    "take": (lambda a: ops.take(a, np.array([2, 0]), axis=0), [(3, 4)]),
    "mean": (lambda a: ops.mean(a, axis=-1, keepdims=True), [(3, 4)]),
    "cast": (lambda a: ops.cast(a, "float16"), [(3, 4)]),
    "gelu": (lambda a: ops.gelu(a), [(3, 4)]),
    "gelu_erf": (lambda a: ops.gelu(a, approximate=False), [(3, 4)]),
    "silu": (lambda a: ops.silu(a), [(3, 4)]),
    "tanh": (lambda a: ops.tanh(a), [(3, 4)]),
    "concatenate": (lambda a, b: ops.concatenate([a, b], axis=-1), [(3, 4), (3, 2)]),
    "exp": (lambda a: ops.exp(a), [(3, 4)]),
    "conv": (lambda a, b: ops.conv(a, b, strides=2), [(2, 7, 6, 3), (3, 3, 3, 4)]),
    # What keras-hub blocks call (rotary embeddings, RMS norms, GQA).
    "rsqrt": (lambda a: ops.rsqrt(ops.square(a) + 1.0), [(3, 4)]),
    "reciprocal": (lambda a: ops.reciprocal(ops.square(a) + 0.5), [(3, 4)]),
    "sin": (lambda a: ops.sin(a), [(3, 4)]),
    "cos": (lambda a: ops.cos(a), [(3, 4)]),
    "var": (lambda a: ops.var(a, axis=-1, keepdims=True), [(3, 4)]),
    "split": (lambda a: ops.split(a, 2, axis=-1)[1], [(3, 4)]),
    "repeat": (lambda a: ops.repeat(a, 2, axis=1), [(3, 4)]),
    "tile": (lambda a: ops.tile(a, (2, 1)), [(3, 4)]),
    "broadcast_to": (lambda a: ops.broadcast_to(a, (2, 3, 4)), [(3, 4)]),
    "moveaxis": (lambda a: ops.moveaxis(a, 0, -1), [(2, 3, 4)]),
    "swapaxes": (lambda a: ops.swapaxes(a, 0, 2), [(2, 3, 4)]),
    "dot_product_attention": (
        lambda q, k, v: ops.dot_product_attention(q, k, v), [(2, 5, 4, 8), (2, 6, 4, 8), (2, 6, 4, 8)]
    ),
    "dot_product_attention_causal_gqa": (
        lambda q, k, v: ops.dot_product_attention(q, k, v, is_causal=True, scale=0.3),
        [(2, 5, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)],
    ),
    "dot_product_attention_bias": (
        lambda q, k, v: ops.dot_product_attention(
            q, k, v, bias=np.linspace(-1, 1, 30, dtype="float32").reshape(1, 1, 5, 6)
        ),
        [(2, 5, 4, 8), (2, 6, 4, 8), (2, 6, 4, 8)],
    ),
    "dot_product_attention_mask": (
        lambda q, k, v: ops.dot_product_attention(
            q, k, v, mask=np.tril(np.ones((5, 6), bool), 1)[None, None]
        ),
        [(2, 5, 4, 8), (2, 6, 4, 8), (2, 6, 4, 8)],
    ),
}

# Functions without a rule: decoded, computed plainly.
PLAIN = {
    "arctan": (lambda a: ops.arctan(a), [(3, 4)]),
    "log1p": (lambda a: ops.log1p(ops.abs(a)), [(3, 4)]),
    "cumsum": (lambda a: ops.cumsum(a, axis=0), [(3, 4)]),
    "layer_normalization_gamma": (
        lambda a: ops.layer_normalization(a, gamma=np.full((4,), 2.0, "float32")),
        [(3, 4)],
    ),
}


def _plain(fn, values):
    return fn(*[ops.convert_to_tensor(v) for v in values])


@pytest.mark.parametrize("name", sorted(RULED))
def test_keras_ops_apply_the_scale_rule(rng, name):
    fn, shapes = RULED[name]
    xs = [_st(rng, s) for s in shapes]
    out = fn(*xs)
    assert ksc.is_scaled(out), name
    expected = _plain(fn, [to_np(x).astype("float32") for x in xs])
    rtol = 1e-3 if name == "cast" else 1e-5
    assert_close(out, expected, rtol=rtol, atol_rel=rtol)


@pytest.mark.parametrize("name", sorted(RULED))
def test_rules_give_true_gradients(rng, name):
    """Through each rule, the gradient of a weighted sum with respect to
    every operand is the plain op's, whatever the scales."""
    fn, shapes = RULED[name]
    # cast: float16 rounds the data at its scale, the plain op the values.
    rtol = 2.0**-10 if name == "cast" else 1e-4
    values = [rng.standard_normal(s).astype("float32") for s in shapes]
    scales = [4.0, 2.0**-3, 2.0**5][: len(values)]
    grad_scales = [2.0**-3, 2.0**4, 1.0][: len(values)]
    out0 = _plain(fn, values)
    weights = ops.convert_to_tensor(rng.standard_normal(tuple(out0.shape)).astype("float32"))

    def loss(*xs):
        return ops.sum(ksc.to_array(fn(*xs)) * weights)

    def scaled_loss(*datas):
        xs = [ksc.as_scaled(d, s, g) for d, s, g in zip(datas, scales, grad_scales)]
        return loss(*xs)

    datas = [v / np.float32(s) for v, s in zip(values, scales)]
    v1, g1 = kb.value_and_grad(scaled_loss)(*datas)
    v0, g0 = kb.value_and_grad(lambda *xs: ops.sum(ops.cast(fn(*xs), "float32") * weights))(*values)
    assert_close(v1, v0, rtol=min(rtol, 1e-5) if name != "cast" else rtol, atol_rel=rtol)
    for a, b, s in zip(g1, g0, scales):
        assert_close(a, to_np(b) * s, rtol=rtol, atol_rel=rtol)


@pytest.mark.parametrize("fully_masked_row", [False, True])
def test_dot_product_attention_masked_softmax_node(rng, monkeypatch, fully_masked_row):
    """With masks only, the rule's masked softmax is one node on eager
    torch (CPU) where no row is fully masked: output, scales and gradients
    equal the composition's bit for bit; a fully masked row attends
    uniformly, as Keras's `dot_product_attention`."""
    from keras_scalify.backend import fused

    mask = np.tril(np.ones((5, 6), bool), 1)[None, None]
    if fully_masked_row:
        mask = np.repeat(mask, 2, axis=0)
        mask[1, :, 2] = False
    up = ops.convert_to_tensor(rng.standard_normal((2, 5, 4, 8)).astype("float32"))
    values = [rng.standard_normal(s).astype("float32") for s in [(2, 5, 4, 8), (2, 6, 4, 8), (2, 6, 4, 8)]]
    scales = [4.0, 2.0**-3, 2.0**5]

    def run(*datas):
        q, k, v = (ksc.as_scaled(d, s, 2.0**-2) for d, s in zip(datas, scales))
        return ops.dot_product_attention(q, k, v, mask=mask, is_causal=True)

    def loss(*datas):
        return ops.sum(ksc.to_array(run(*datas)) * up)

    args = [ops.convert_to_tensor(v) for v in values]
    taken = spy_taken(monkeypatch, fused, "masked_softmax")
    got = run(*args)
    _, got_grads = kb.value_and_grad(loss)(*args)
    on_cpu_torch = keras.backend.backend() == "torch" and args[0].device.type == "cpu"
    assert taken[0] == (on_cpu_torch and not fully_masked_row)
    monkeypatch.setattr(fused, "masked_softmax", lambda *a: None)
    want = run(*args)
    _, want_grads = kb.value_and_grad(loss)(*args)
    assert float(got.scale) == float(want.scale)
    np.testing.assert_array_equal(to_np(got.data), to_np(want.data))
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    # Keras's semantics on the represented values (uniform masked rows).
    true = (ops.convert_to_tensor(v * np.float32(s)) for v, s in zip(values, scales))
    plain = to_np(ops.dot_product_attention(*true, mask=mask, is_causal=True))
    represented = to_np(ksc.to_array(got))
    if fully_masked_row and on_gpu():
        # torch's fused attention kernels on CUDA give a fully masked row
        # zeros (seen on an H100), its CPU kernel and the rule a uniform
        # average: Keras itself differs by device there.
        represented[1, 2], plain[1, 2] = 0.0, 0.0
    assert_close(represented, plain, rtol=1e-5, atol_rel=1e-5)


def test_dot_product_attention_soft_cap(rng):
    """`attn_logits_soft_cap` (plain Keras supports it on TPUs only)
    against the unfused computation on the represented values."""
    q, k, v = (_st(rng, (2, 5, 4, 8), s, 1.0) for s in (4.0, 0.5, 2.0))
    out = ops.dot_product_attention(q, k, v, attn_logits_soft_cap=3.0)
    qn, kn, vn = (to_np(t) for t in (q, k, v))
    logits = np.einsum("btnh,bsnh->bnts", qn, kn) / np.sqrt(8.0)
    logits = np.tanh(logits / 3.0) * 3.0
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert_close(out, np.einsum("bnts,bsnh->btnh", p, vn), rtol=1e-5, atol_rel=1e-5)


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_keras_ops_without_a_rule_compute_on_decoded_values(rng, name):
    fn, shapes = PLAIN[name]
    xs = [_st(rng, s) for s in shapes]
    out = fn(*xs)
    assert not ksc.is_scaled(out)
    expected = _plain(fn, [to_np(x).astype("float32") for x in xs])
    assert_close(out, expected, rtol=1e-6)


def test_gradients_through_rules_and_plain_ops_are_true_gradients(rng):
    """Decoding is grad-scale aware: d loss / d data comes back in the
    operand's grad-scale units, so the true gradient is the plain one."""
    a = rng.standard_normal((3, 4)).astype("float32")
    w = rng.standard_normal((4, 4)).astype("float32")
    scale, grad_scale = 8.0, 2.0**-5

    def body(x):
        h = ops.matmul(x, w)  # rule
        h = ops.rsqrt(ops.square(h) + 1.0)  # square, add, rsqrt: rules
        h = ops.arctan(h[:, :3])  # indexing, then plain
        return ops.sum(h)

    def scaled_loss(data):
        return body(ksc.as_scaled(data, scale, grad_scale))

    def plain_loss(x):
        return body(x)

    v1, (g1,) = kb.value_and_grad(scaled_loss)(a / np.float32(scale))
    v0, (g0,) = kb.value_and_grad(plain_loss)(a)
    assert_close(v1, v0, rtol=1e-5)
    # cotangent of data = true gradient * scale / grad_scale ... times the
    # as_scaled boundary's s·g factor: d loss / d data = scale · true grad.
    assert_close(g1, to_np(g0) * scale, rtol=1e-5, atol_rel=1e-5)


def test_indexing_a_scaled_tensor(rng):
    x = _st(rng, (3, 4, 5))
    value = to_np(x)
    for key in [(slice(None), 0), (Ellipsis, slice(None, 2)), (None, 1), slice(1, 3)]:
        out = x[key]
        assert ksc.is_scaled(out)
        np.testing.assert_array_equal(to_np(out), value[key])
    # An int picks a field, as in any named tuple.
    assert x[0] is x.data and x[1] is x.scale


def test_plain_calls_are_untouched_and_dispatch_is_removable(rng):
    a = rng.standard_normal((3, 4)).astype("float32")
    assert getattr(keras.ops.add, "_keras_scalify_dispatch", False)
    original = keras.ops.add.__wrapped__
    np.testing.assert_array_equal(
        ops.convert_to_numpy(keras.ops.add(a, a)),
        ops.convert_to_numpy(original(a, a)),
    )
    x = _st(rng, (3, 4))
    ksc.uninstall_ops_dispatch()
    try:
        assert keras.ops.add is original
        import keras.src.ops as src_ops

        assert not getattr(src_ops.matmul, "_keras_scalify_dispatch", False)
    finally:
        ksc.install_ops_dispatch()
    assert ksc.is_scaled(keras.ops.add(x, x))


def test_custom_layer_on_scaled_tensors_in_a_model(rng):
    """A custom layer written with `keras.ops`, called on ScaledTensors
    between scaled layers (symbolically, then on data): it computes with
    the scale rules (a ScaledTensor comes out) and the model computes what
    the plain one does."""

    class Gate(keras.layers.Layer):
        def call(self, x):
            half = x.shape[-1] // 2
            return ops.multiply(x[..., :half], ops.sigmoid(x[..., half:]))

    def build(scaled):
        keras.utils.set_random_seed(3)
        inp = keras.Input((6,))
        if scaled:
            h = ksc.layers.ScaledDense(8, dtype="scaled_float32")(ksc.layers.AsScaled()(inp))
        else:
            h = keras.layers.Dense(8)(inp)
        h = Gate()(h)
        if scaled:
            assert ksc.is_scaled(h)
            out = ksc.layers.ScaledDense(3, dtype="scaled_float32")(h)
        else:
            out = keras.layers.Dense(3)(h)
        return keras.Model(inp, out)

    x = rng.standard_normal((5, 6)).astype("float32")
    plain, scaled = build(False), build(True)
    dense = lambda m: [l for l in m.layers if "Dense" in type(l).__name__]  # noqa: E731
    for a, b in zip(dense(scaled), dense(plain)):
        a.set_weights(b.get_weights())
    assert_close(scaled.predict(x, verbose=0), plain(x), rtol=1e-5, atol_rel=1e-5)


def test_dispatch_wraps_each_function_once():
    import keras.src.ops as src_ops

    assert keras.ops.einsum is keras.ops.numpy.einsum
    assert keras.ops.softmax is src_ops.softmax
    assert keras.ops.einsum.__wrapped__ is not keras.ops.einsum
    assert not getattr(keras.ops.einsum.__wrapped__, "_keras_scalify_dispatch", False)
    assert dispatch._rule("softmax") is ksc.ops.softmax


def test_calls_the_rule_cannot_take_fall_back_to_the_plain_op(rng):
    """Arguments bind to the original's signature: `layer_normalization(x,
    gamma)` must not pass `gamma` as the rule's `axis`; lists given by
    keyword are scanned too."""
    x = _st(rng, (3, 4))
    gamma = np.full((4,), 2.0, "float32")
    out = ops.layer_normalization(x, gamma)
    assert not ksc.is_scaled(out)
    expected = ops.layer_normalization(ops.convert_to_tensor(to_np(x).astype("float32")), gamma)
    assert_close(out, expected, rtol=1e-5, atol_rel=1e-5)
    both = ops.concatenate(xs=[x, x], axis=0)
    assert ksc.is_scaled(both)
    assert_close(both, np.concatenate([to_np(x)] * 2), rtol=1e-6)


class _TimesWeight(keras.layers.Layer):
    """`x · 2 · w`, on a ScaledTensor (`scaled=True`) or plainly."""

    def __init__(self, scaled, **kwargs):
        super().__init__(**kwargs)
        self.scaled = scaled

    def build(self, shape):
        self.w = self.add_weight(shape[-1:], initializer="ones")

    def call(self, x):
        if self.scaled:
            return ksc.to_array(ksc.as_scaled(x, 2.0) * self.w)
        return x * 2.0 * self.w


def test_a_keras_variable_operand_keeps_its_gradient(rng):
    """`ScaledTensor * layer.weight`: on torch the Variable object itself
    used to become the data, and its gradient was silently dropped."""
    x = rng.standard_normal((8, 4)).astype("float32")
    y = rng.standard_normal((8, 4)).astype("float32")
    weights = []
    for scaled in (False, True):
        model = keras.Sequential([keras.Input((4,)), _TimesWeight(scaled)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.train_on_batch(x, y)
        weights.append(to_np(model.layers[0].w))
    assert not np.allclose(weights[0], 1.0)
    assert_close(weights[1], weights[0], rtol=1e-6)


def test_importing_changes_no_keras_function():
    """`import keras_scalify` wraps only the policy-name functions (a fresh
    process: this one has made ScaledTensors); the first ScaledTensor
    installs the `keras.ops` dispatch, the plain-output and plain-layer
    wrappers, the first ScaledVariable the optimizer guard, and
    `ksc.patches.uninstall()` puts every original back."""
    import os
    import subprocess
    import sys

    script = (
        "import keras, numpy as np\n"
        "import keras.src.ops as src\n"
        "from keras.src.models.functional import Functional\n"
        "from keras.src.optimizers.base_optimizer import BaseOptimizer\n"
        "def now():\n"
        "    return (keras.ops.add, keras.ops.matmul, src.silu, Functional.__init__,\n"
        "            keras.layers.Layer._assert_input_compatibility, BaseOptimizer.build,\n"
        "            keras.config.set_dtype_policy)\n"
        "before = now()\n"
        "import keras_scalify as ksc\n"
        "assert now()[:6] == before[:6], 'import'\n"
        "assert ksc.patches.installed() == ['policy names'], ksc.patches.installed()\n"
        "x = ksc.as_scaled(np.ones((2, 2), 'float32'), 2.0)\n"
        "assert ksc.is_scaled(keras.ops.add(x, x))\n"
        "assert len(ksc.patches.installed()) == 4, ksc.patches.installed()\n"
        "ksc.layers.ScaledDense(2).build((None, 2))\n"
        "assert len(ksc.patches.installed()) == 5, ksc.patches.installed()\n"
        "ksc.patches.uninstall()\n"
        "assert now() == before, 'undo'\n"
        "assert ksc.patches.installed() == []\n"
        "print('OK')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, KERAS_BACKEND=keras.backend.backend()),
    )
    assert out.stdout.strip().endswith("OK"), out.stderr[-2000:]
