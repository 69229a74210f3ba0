"""Inputs whose magnitude lives in the scale (`as_scaled(x, 2**k)`, k in
[-100, 100]): forward values, input gradients and weight gradients of the
scaled layers match float64 NumPy references to the format's tolerance
(issue 14, item 4). Fresh layers: every weight's grad scale is still the
uncalibrated guess, the case where a contraction's output grad scale used
to be off by 2^(k/2)."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify import backend as kb
from keras_scalify.layers.variable import effective_grad_scale
from tests.conftest import to_np

KS = [-100, -60, -20, 0, 20, 60, 100]
# Attention multiplies the input by itself: its scores carry 2^(2k), which a
# float32 scale holds for |2k| < 126.
KS_ATTENTION = [-60, -40, -20, 0, 20, 40, 60]
TOL = {"scaled_float32": 1e-5, "scaled_fp16": 5e-3, "scaled_fp8": 0.1}
# Attention rounds x, the kernels, q, k, the probabilities and v to E4M3
# (relative step 2^-3) on a tiny case (B·T = 6 rows), and its softmax
# amplifies logit errors: 0.1-0.19 off float64. Still far below the 0.5 of
# a wrong power of two, and inf/NaN/0 fail. FP8 at k > 0 is left out: the
# logits are ~2^(2k), and E4M3's step on q and k moves them by far more
# than 1, so which key wins a near-tie changes (torch at k = 20: output
# 0.23 off float64, input gradient 0.46): FP8 attention, not the scales.
ATTENTION_FP8_TOL = 0.25
B, T, D, H, KD = 2, 3, 8, 2, 4


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def _pow2(x):
    return np.float32(2.0 ** np.floor(np.log2(np.sqrt(np.mean(np.square(x))))))


def _run(layer, x0, k, ct, call, gx=1.0):
    """(output, input gradient, {weight: true gradient}) as float64, the
    input carried as `as_scaled(x0, 2**k, grad_scale=gx)`."""
    s = np.float32(2.0**k)
    gx = np.float32(gx)
    svs = {id(sv.data): sv for sv in _scaled_weights(layer)}
    tv = [v for v in layer.trainable_variables if not v.overwrite_with_gradient]
    ntv = list(layer.non_trainable_variables) + [
        v for v in layer.trainable_variables if v.overwrite_with_gradient
    ]

    def loss(xd, *values):
        mapping = list(zip(tv, values)) + [(v, ops.convert_to_tensor(v)) for v in ntv]
        with keras.StatelessScope(state_mapping=mapping):
            y = call(layer, ksc.as_scaled(xd, s, gx))
        return ops.sum(ops.multiply(ksc.to_array(y), ops.convert_to_tensor(ct)))

    x = ops.convert_to_tensor(x0)
    _, grads = kb.value_and_grad(loss)(x, *[ops.convert_to_tensor(v) for v in tv])
    y = call(layer, ksc.as_scaled(x, s))
    y = to_np(ops.stop_gradient(y.data)).astype(np.float64) * float(to_np(ops.stop_gradient(y.scale)))
    # `as_scaled` returns d loss / d data = scale · d loss / d x.
    dx = to_np(grads[0]).astype(np.float64) / float(s)
    dw = {}
    for v, g in zip(tv, grads[1:]):
        sv = svs.get(id(v))
        if sv is None:
            continue
        gs = to_np(effective_grad_scale(ops.convert_to_tensor(sv.grad_scale), ops.convert_to_tensor(sv.scale)))
        dw[_key(layer, sv)] = to_np(g).astype(np.float64) * float(gs)
    return y, dx, dw


def _scaled_weights(layer):
    return [sv for l in layer._flatten_layers() for sv in l.scaled_weights]


def _key(layer, sv):
    """The weight's path below `layer` ("kernel", "query/kernel")."""
    return sv.data.path[len(layer.name) + 1 :]


def _weights(layer):
    return {_key(layer, sv): sv.numpy().astype(np.float64) for sv in _scaled_weights(layer)}


def _dense_ref(w, x, ct):
    kernel, bias = w["kernel"], w["bias"]
    y = x @ kernel + bias
    return y, ct @ kernel.T, {"kernel": x.reshape(-1, x.shape[-1]).T @ ct.reshape(-1, ct.shape[-1]), "bias": ct.sum((0, 1))}


def _layer_norm_ref(w, x, ct, eps=1e-3):
    gamma, beta = w["gamma"], w["beta"]
    mu = x.mean(-1, keepdims=True)
    sigma = np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    xh = (x - mu) / sigma
    y = xh * gamma + beta
    g = ct * gamma
    dx = (g - g.mean(-1, keepdims=True) - xh * (g * xh).mean(-1, keepdims=True)) / sigma
    return y, dx, {"gamma": (ct * xh).sum((0, 1)), "beta": ct.sum((0, 1))}


def _mha_ref(w, x, ct):
    ws = {n: w[f"{n}/kernel"] for n in ("query", "key", "value")}
    bs = {n: w[f"{n}/bias"] for n in ("query", "key", "value")}
    wo, bo = w["attention_output/kernel"], w["attention_output/bias"]
    proj = {n: np.einsum("btd,dhk->bthk", x, ws[n]) + bs[n] for n in ws}
    q, k_, v = proj["query"] / np.sqrt(KD), proj["key"], proj["value"]
    sc = np.einsum("bthk,bshk->bhts", q, k_)
    a = np.exp(sc - sc.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    c = np.einsum("bhts,bshk->bthk", a, v)
    y = np.einsum("bthk,hkd->btd", c, wo) + bo
    dc = np.einsum("btd,hkd->bthk", ct, wo)
    da = np.einsum("bthk,bshk->bhts", dc, v)
    dv = np.einsum("bhts,bthk->bshk", a, dc)
    dsc = a * (da - (da * a).sum(-1, keepdims=True))
    dq = np.einsum("bhts,bshk->bthk", dsc, k_) / np.sqrt(KD)
    dk = np.einsum("bhts,bthk->bshk", dsc, q)
    d = {"query": dq, "key": dk, "value": dv}
    dx = sum(np.einsum("bthk,dhk->btd", d[n], ws[n]) for n in ws)
    dw = {f"{n}/kernel": np.einsum("btd,bthk->dhk", x, d[n]) for n in ws}
    dw["attention_output/kernel"] = np.einsum("bthk,btd->hkd", c, ct)
    return y, dx, dw


def _calibrate(layer, dx_ref, dw_ref):
    """The grad scales training would have measured (the optimizer for the
    weights, a rescale point for the input): pow2 of each true RMS."""
    for sv in _scaled_weights(layer):
        ref = dw_ref.get(_key(layer, sv))
        if ref is not None and np.any(ref):
            sv.grad_scale.assign(_pow2(ref))
    return _pow2(dx_ref)


LAYERS = {
    "dense": (lambda p: ksc.layers.ScaledDense(D, bias_initializer="random_normal", dtype=p), lambda l, x: l(x), _dense_ref, KS),
    "layer_norm": (
        lambda p: ksc.layers.ScaledLayerNormalization(
            gamma_initializer="random_normal", beta_initializer="random_normal", dtype=p
        ),
        lambda l, x: l(x),
        _layer_norm_ref,
        KS,
    ),
    "attention": (
        lambda p: ksc.layers.ScaledMultiHeadAttention(num_heads=H, key_dim=KD, dtype=p),
        lambda l, x: l(x, x),
        _mha_ref,
        KS_ATTENTION,
    ),
}


def _case(name, policy, k, rng):
    make, call, ref, _ = LAYERS[name]
    keras.utils.set_random_seed(3)
    layer = make(policy)
    x0 = rng.standard_normal((B, T, D)).astype("float32")
    ct = rng.standard_normal((B, T, D)).astype("float32")
    call(layer, ksc.as_scaled(x0, 1.0))  # build
    refs = ref(_weights(layer), x0.astype(np.float64) * 2.0**k, ct.astype(np.float64))
    return layer, x0, ct, call, refs


def _tol(name, policy):
    return ATTENTION_FP8_TOL if (name, policy) == ("attention", "scaled_fp8") else TOL[policy]


def _checked_weights(name, policy, k, dw_ref):
    """Reference weight gradients the test compares. Left out: weights
    whose true gradient is below float32's range (attention's query/key
    kernels at 2^-60: ~1e-54), and, in 16-bit and FP8, attention's
    query/key kernels once the softmax saturates (k > 0): their gradients
    (2^-80 at k = 5) are set by probabilities of e^-50, whose logits
    (~2^(2k)) float16 q and k round by ~0.25."""
    out = {}
    for n, g in dw_ref.items():
        if np.sqrt(np.mean(g**2)) <= 1e-30:
            continue
        if name == "attention" and policy != "scaled_float32" and k > 0 and n.split("/")[0] in ("query", "key"):
            continue
        out[n] = g
    return out


CASES = [
    (n, p, k)
    for n, (_, _, _, ks) in LAYERS.items()
    for p in TOL
    for k in ks
    if not (n, p) == ("attention", "scaled_fp8") or k <= 0
]


@pytest.mark.parametrize("name,policy,k", CASES)
def test_extreme_magnitudes_match_float64_once_grad_scales_are_measured(name, policy, k, rng):
    layer, x0, ct, call, (y_ref, dx_ref, dw_ref) = _case(name, policy, k, rng)
    gx = _calibrate(layer, dx_ref, dw_ref)
    y, dx, dw = _run(layer, x0, k, ct, call, gx)
    tol = _tol(name, policy)
    assert _rel(y, y_ref) < tol, ("forward", _rel(y, y_ref))
    assert _rel(dx, dx_ref) < tol, ("input gradient", _rel(dx, dx_ref))
    assert set(dw_ref) <= set(dw)
    for n, g in _checked_weights(name, policy, k, dw_ref).items():
        assert _rel(dw[n], g) < tol, (n, _rel(dw[n], g))


@pytest.mark.parametrize("name,policy,k", [c for c in CASES if c[0] != "layer_norm"])
def test_a_fresh_layer_gives_exact_input_gradients_at_any_magnitude(name, policy, k, rng):
    """Before any measurement. Dense: a weight's guessed grad scale does not
    vote for the output's (it used to put the output cotangent at 2^(k/2)
    in float16 data: inf at k >= 40, 0 at k <= -40). Attention: the
    probabilities take their grad scale from the values' side (the scores'
    rules put it 2^(2k) off: inf in float16 from k = 5, 0 below k = -40)."""
    layer, x0, ct, call, (y_ref, dx_ref, _) = _case(name, policy, k, rng)
    y, dx, _ = _run(layer, x0, k, ct, call)
    assert _rel(y, y_ref) < _tol(name, policy)
    assert _rel(dx, dx_ref) < _tol(name, policy)


@pytest.mark.parametrize("policy,k", [(p, k) for p in TOL for k in KS])
def test_layer_norm_where_epsilon_dominates(policy, k, rng):
    """A scale far below sqrt(eps): eps/sa² no longer overflows (it gave
    zero outputs and gradients in float32 at 2^-100); the output carries
    the factor in its scale."""
    layer, x0, ct, call, (y_ref, _, _) = _case("layer_norm", policy, k, rng)
    y, _, _ = _run(layer, x0, k, ct, call)
    assert _rel(y, y_ref) < TOL[policy]
    x = ksc.as_scaled(x0, np.float32(2.0**k))
    y_norm = to_np(ops.stop_gradient(ksc.ops.layer_normalization(x, epsilon=1e-3).to_array()))
    ref = x0.astype(np.float64) * 2.0**k
    ref = (ref - ref.mean(-1, keepdims=True)) / np.sqrt(ref.var(-1, keepdims=True) + 1e-3)
    assert _rel(y_norm, ref) < 1e-5 or np.abs(ref).max() < 1e-30


# The unit roundoff of each 16-bit format: the loss of a model whose inputs,
# weights and activations are rounded to it is within a few of them of float32's.
_UNIT_ROUNDOFF = {"scaled_fp16": 2.0**-11, "scaled_bf16": 2.0**-8}


def _dense_models():
    layers = lambda ns, dtype: [  # noqa: E731
        keras.Input((16,)), ns.Dense(32, activation="relu", **dtype), ns.Dense(4, **dtype)
    ]
    return (16,), (4,), layers


def _conv_models():
    layers = lambda ns, dtype: [  # noqa: E731
        keras.Input((8, 2)), ns.Conv1D(8, 3, activation="relu", **dtype), ns.Conv1D(4, 6, **dtype)
    ]
    return (8, 2), (1, 4), layers


class _Scaled:
    Dense, Conv1D = ksc.layers.ScaledDense, ksc.layers.ScaledConv1D


@pytest.mark.parametrize("models", [_dense_models, _conv_models], ids=["dense", "conv"])
@pytest.mark.parametrize("policy", sorted(_UNIT_ROUNDOFF))
def test_outputs_past_float16_train_from_the_first_step(policy, models):
    """A model whose inputs, outputs and targets are ~2^20 (an MSE ~2^41,
    far past float16's range) trains from its first step under a 16-bit
    policy: while its weights' grad scales are still guesses, their
    gradients (~2^33 in data units) come back in the float32 master dtype
    instead of overflowing the matmul dtype, so no step is skipped, and
    the losses follow float32 Keras's from the same weights."""
    in_shape, out_shape, layers = models()
    rs = np.random.RandomState(0)
    x = (rs.normal(size=(64,) + in_shape) * 2.0**20).astype("float32")
    y = (rs.normal(size=(64,) + out_shape) * 2.0**20).astype("float32")

    def train(model, optimizer):
        model.compile(optimizer=optimizer, loss="mse")
        return [float(model.train_on_batch(x, y)) for _ in range(6)]

    scaled = keras.Sequential(layers(_Scaled, {"dtype": policy}))
    plain = keras.Sequential(layers(keras.layers, {}))
    for s_layer, p_layer in zip(scaled.layers, plain.layers):
        p_layer.set_weights([to_np(s_layer.kernel.value), to_np(s_layer.bias.value)])
    optimizer = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-3))
    got = train(scaled, optimizer)
    want = train(plain, keras.optimizers.Adam(1e-3))
    assert int(to_np(optimizer.skipped_steps)) == 0, got
    np.testing.assert_allclose(got, want, rtol=16 * _UNIT_ROUNDOFF[policy])
