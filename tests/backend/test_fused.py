"""`keras_scalify.backend.fused`: `gated` (`a·gate(a·s)` and its derivative
`f'(a·s)` match float64 at every scale, including the scales where `a·s`
overflows or is subnormal in float32: the fused torch node clips `u` in its
backward; the composition of `keras.ops` elsewhere), and the rules that
use the fused sum and product (`add`, `subtract`, `multiply` of operands
with different scales, broadcast: values and gradients equal plain Keras's
on every backend, through the torch nodes on torch)."""

import math

import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify.backend import value_and_grad
from keras_scalify.backend.fused import KINDS
from keras_scalify.backend.fused import gated
from tests.conftest import to_np

A = np.array(
    [0.0, 1e-3, -1e-3, 0.3, -0.3, 1.0, -1.0, 2.5, -2.5, 7.0, -7.0, 40.0, -40.0],
    np.float32,
)
SCALES = [2.0**-140, 2.0**-100, 2.0**-20, 1.0, 2.0**20, 2.0**100, 2.0**127]

_K = math.sqrt(2.0 / math.pi)


def _gate64(u, kind):
    if kind == "gelu":
        return 0.5 * (1.0 + math.erf(u / math.sqrt(2.0)))
    if kind == "gelu_tanh":
        return 0.5 * (1.0 + math.tanh(_K * (u + 0.044715 * u**3))) if abs(u) < 20 else float(u > 0)
    return 1.0 / (1.0 + math.exp(-u)) if u > -700 else 0.0


def _reference(a, s, kind):
    """float64 `a·g(u)` and `f'(u) = g(u) + u·g'(u)` (by a central
    difference in u, relative step 1e-6; exact where g saturates)."""
    values, slopes = [], []
    for x in a.astype(np.float64):
        u = x * s
        values.append(x * _gate64(u, kind))
        h = max(abs(u), 1.0) * 1e-6
        f = lambda v: v * _gate64(v, kind)
        slopes.append((f(u + h) - f(u - h)) / (2 * h))
    return np.array(values), np.array(slopes)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("s", SCALES, ids=lambda s: f"2^{int(math.log2(s))}")
def test_gated_matches_float64(kind, s):
    want, want_slope = _reference(A, s, kind)
    scale = ops.convert_to_tensor(np.float32(s))
    value, (slope,) = value_and_grad(
        lambda a: ops.sum(gated(a, scale, kind))
    )(ops.convert_to_tensor(A))
    got = to_np(gated(ops.convert_to_tensor(A), scale, kind))
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(to_np(slope)))
    # float32 gates lose the far negative tail (1 + erf(u/√2) cancels):
    # errors are measured against |a|, the magnitude the output is added at.
    np.testing.assert_array_less(np.abs(got - want), 2e-5 * np.abs(want) + 1e-6 * np.abs(A) + 1e-45)
    np.testing.assert_allclose(to_np(slope), want_slope, rtol=1e-4, atol=1e-5)


def test_gated_unknown_kind_is_named():
    with pytest.raises(ValueError, match="kind"):
        gated(ops.ones((2,)), ops.ones(()), "relu")


BINARY = [
    ("add", ksc.ops.add, ops.add),
    ("subtract", ksc.ops.subtract, ops.subtract),
    ("multiply", ksc.ops.multiply, ops.multiply),
]
# (shape of x1, shape of x2): same shape, x2 broadcast (a bias), x1 broadcast.
SHAPES = [((4, 6), (4, 6)), ((3, 4, 6), (6,)), ((6,), (3, 4, 6))]
# (scale, grad scale) of each operand.
# "unit": every factor of the rule is 1, which the torch node does not apply.
OPERAND_SCALES = [
    ((2.0**-20, 2.0**6), (2.0**8, 2.0**-3)),
    ((1.0, 1.0), (2.0**-4, 2.0**9)),
    ((1.0, 1.0), (1.0, 1.0)),
]


@pytest.mark.parametrize("scales", OPERAND_SCALES, ids=["far", "near", "unit"])
@pytest.mark.parametrize("shapes", SHAPES, ids=["same", "x2_broadcast", "x1_broadcast"])
@pytest.mark.parametrize("name,scaled_fn,plain_fn", BINARY, ids=[b[0] for b in BINARY])
def test_binary_rules_match_plain_keras(name, scaled_fn, plain_fn, shapes, scales):
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype("float32") for s in shapes]
    out_shape = np.broadcast_shapes(*shapes)
    upstream = ops.convert_to_tensor(rng.standard_normal(out_shape).astype("float32"))

    def scaled(*args):
        ys = [
            ksc.as_scaled(a * np.float32(1.0 / s), np.float32(s), np.float32(g))
            for a, (s, g) in zip(args, scales)
        ]
        return ops.sum(ksc.to_array(scaled_fn(*ys)) * upstream)

    def plain(*args):
        return ops.sum(plain_fn(*args) * upstream)

    args = [ops.convert_to_tensor(x) for x in xs]
    value, grads = value_and_grad(scaled)(*args)
    want, want_grads = value_and_grad(plain)(*args)
    np.testing.assert_allclose(to_np(value), to_np(want), rtol=1e-5)
    for g, w in zip(grads, want_grads):
        assert tuple(g.shape) == tuple(w.shape)
        np.testing.assert_allclose(to_np(g), to_np(w), rtol=1e-5, atol=1e-6)


# --- normalize (layer_normalization's rule) -------------------------------------

def _layer_norm_grad64(x, g, axes, eps):
    """float64 values and input gradient of `(x - E x)/sqrt(Var x + eps)`
    over `axes`, for the upstream `g`."""
    x, g = x.astype(np.float64), g.astype(np.float64)
    mean = x.mean(axis=axes, keepdims=True)
    c = x - mean
    rstd = 1.0 / np.sqrt((c * c).mean(axis=axes, keepdims=True) + eps)
    xhat = c * rstd
    gx = rstd * (g - g.mean(axis=axes, keepdims=True) - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    return xhat, gx


@pytest.mark.parametrize("axes", [[-1], [1, 2], [1]], ids=["last", "last_two", "middle"])
@pytest.mark.parametrize(
    "s", [2.0**-30, 2.0**-12, 1.0, 2.0**40], ids=lambda s: f"2^{int(math.log2(s))}"
)
def test_layer_normalization_values_and_gradient_match_float64(axes, s):
    """Through the fused torch node (trailing axes) or the composition:
    values and input gradients of `ksc.ops.layer_normalization` equal the
    float64 layer norm of the represented values, at input scales where
    the eps term is rescaled (`q > 1`: 2^-30, 2^-12) and where it is not,
    on rows with a large mean."""
    eps = 1e-3
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((3, 5, 8)) + 20.0 * rng.standard_normal((3, 5, 1))).astype("float32")
    upstream = rng.standard_normal(data.shape).astype("float32")
    want, want_grad = _layer_norm_grad64(data * np.float64(s), upstream, tuple(axes), eps)
    up = ops.convert_to_tensor(upstream)

    def normalized(d):
        y = ksc.ops.layer_normalization(ksc.as_scaled(d, np.float32(s)), axis=axes, epsilon=eps)
        return ksc.to_array(y)

    _, (grad,) = value_and_grad(lambda d: ops.sum(normalized(d) * up))(ops.convert_to_tensor(data))
    np.testing.assert_allclose(to_np(normalized(ops.convert_to_tensor(data))), want, rtol=1e-4, atol=1e-4)
    # d/d(data) = s · d/dx
    np.testing.assert_allclose(to_np(grad), want_grad * s, rtol=1e-3, atol=1e-3 * s * np.abs(want_grad).max())


# --- affine_layer_normalization (ScaledLayerNormalization's call) -------------

@pytest.mark.parametrize("state", [None, 0.0, 2.0**-9], ids=["no_rescale", "state_0", "state_2^-9"])
@pytest.mark.parametrize("axes", [[-1], [1, 2], [1]], ids=["last", "last_two", "middle"])
@pytest.mark.parametrize(
    "s", [2.0**-12, 1.0, 2.0**40], ids=lambda s: f"2^{int(math.log2(s))}"
)
def test_affine_layer_normalization_matches_its_three_rules(axes, s, state):
    """`affine_layer_normalization` (one torch node over trailing axes with
    q = 1; the composition elsewhere) gives the values, scales and
    gradients of `layer_normalization`, `multiply(gamma)` and `add(beta)`
    in a row, for gamma and beta far from unit scale, their grad scales
    calibrated or not; with `grad_rescale=(state, "l2")` preceded by
    `delayed_rescale_grad` (inside the node's backward on torch), the
    state's gradient (the next grad scale) included."""
    from keras_scalify.ops.nn import affine_layer_normalization
    from keras_scalify.ops.rescaling import delayed_rescale_grad

    rng = np.random.default_rng(2)
    data = (rng.standard_normal((3, 5, 8)) + 20.0 * rng.standard_normal((3, 5, 1))).astype("float32")
    pshape = [data.shape[a] for a in axes]
    bshape = [data.shape[a] if a in [ax % 3 for ax in axes] else 1 for a in range(3)]
    gamma = (1.0 + rng.standard_normal(pshape)).astype("float32")
    beta = rng.standard_normal(pshape).astype("float32")
    upstream = ops.convert_to_tensor(rng.standard_normal(data.shape).astype("float32"))
    trailing = axes != [1]
    calibrated = (ops.convert_to_tensor(True), ops.convert_to_tensor(False))

    def params(g, b):
        g = ksc.as_scaled(g, np.float32(2.0**-3), np.float32(2.0**5))
        b = ksc.as_scaled(b, np.float32(2.0**4), np.float32(2.0**-7))
        if not trailing:
            g, b = ksc.ops.reshape(g, bshape), ksc.ops.reshape(b, bshape)
        return g, b

    def fused(d, g, b, st):
        x = ksc.as_scaled(d, np.float32(s), np.float32(2.0**3))
        g, b = params(g, b)
        rescale = None if state is None else (st, "l2")
        return affine_layer_normalization(
            x, g, b, axis=axes, epsilon=1e-3, calibrated=calibrated, grad_rescale=rescale
        )

    def composed(d, g, b, st):
        x = ksc.as_scaled(d, np.float32(s), np.float32(2.0**3))
        if state is not None:
            x = delayed_rescale_grad(x, st, "l2")
        g, b = params(g, b)
        y = ksc.ops.layer_normalization(x, axis=axes, epsilon=1e-3)
        y = ksc.ops.multiply(y, g, calibrated=(None, calibrated[0]))
        return ksc.ops.add(y, b, calibrated=(None, calibrated[1]))

    st = np.float32(0.0 if state is None else state)
    args = [ops.convert_to_tensor(v) for v in (data, gamma, beta, st)]
    got, want = fused(*args), composed(*args)
    assert float(got.scale) == float(want.scale) and float(got.grad_scale) == float(want.grad_scale)
    np.testing.assert_allclose(to_np(got.data), to_np(want.data), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda *a: ops.sum(f(*a).data * upstream)
    _, got_grads = value_and_grad(loss(fused))(*args)
    _, want_grads = value_and_grad(loss(composed))(*args)
    n = 3 if state is None else 4
    for g, w in zip(got_grads[:n], want_grads[:n]):
        scale = np.abs(to_np(w)).max()
        np.testing.assert_allclose(to_np(g), to_np(w), rtol=1e-4, atol=1e-5 * scale)
    if state is not None:  # the next grad scale: a power of two, not the old state
        assert float(to_np(got_grads[3])) > 0 and float(to_np(got_grads[3])) != state
