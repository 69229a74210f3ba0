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
}

# Functions without a rule: decoded, computed plainly.
PLAIN = {
    "rsqrt": (lambda a: ops.rsqrt(ops.abs(a) + 1.0), [(3, 4)]),
    "sin": (lambda a: ops.sin(a), [(3, 4)]),
    "split": (lambda a: ops.split(a, 2, axis=-1)[1], [(3, 4)]),
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
        h = ops.rsqrt(ops.square(h) + 1.0)  # square: rule; add: rule; rsqrt: plain
        h = ops.sin(h[:, :3])  # indexing, then plain
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
