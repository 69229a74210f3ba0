"""Custom rules of softmax-like and normalization ops (paper §3.2.1, App. C).

All are computed in float32 and cast back to the data dtype.
"""

import math

import numpy as np
from keras import ops

from keras_scalify.backend import fused
from keras_scalify.backend import scalar as S
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_calibrated
from keras_scalify.ops._common import check_input
from keras_scalify.ops._common import promote
from keras_scalify.ops._common import same_dtype
from keras_scalify.ops._common import scalars
from keras_scalify.ops._common import static_dim
from keras_scalify.ops._common import times
from keras_scalify.core import pow2
from keras_scalify.ops.arithmetic import _product_grad_scales
from keras_scalify.ops.arithmetic import _sum_scales
from keras_scalify.ops.arithmetic import add
from keras_scalify.ops.arithmetic import multiply
from keras_scalify.ops.boundary import to_array
from keras_scalify.ops.linalg import einsum
from keras_scalify.ops.linalg import operand_grad_scale
from keras_scalify.ops.math import _pointwise_factors
from keras_scalify.ops.math import pointwise
from keras_scalify.ops.math import tanh
from keras_scalify.ops.rescaling import delayed_rescale_grad
from keras_scalify.ops.rescaling import delayed_rescale_parts
from keras_scalify.ops.rescaling import grad_scale_and_factor
from keras_scalify.ops.rescaling import rebalance
from keras_scalify.ops.rescaling import with_grad_scale
from keras_scalify.ops.selection import where
from keras_scalify.ops.reduction import pow2_sqrt
from keras_scalify.ops.reduction import reduced_count
from keras_scalify.ops.shape import cast
from keras_scalify.ops.shape import repeat



def softmax(x, axis=-1):
    """Rule: `s = P(1/sqrt(n))`, `d = softmax(a·sa)/s`; `g = ga·P(sqrt(n))`.

    n is the size of `axis`. Rows sum to 1, so the data lies in
    [0, sqrt(n)] and its RMS in [1/sqrt(n), 1]: a uniform row and a one-hot
    row are equally far from unit scale (the paper's scale 1 leaves uniform
    rows at RMS 1/n). Backward, `p·(g - <p, g>)` shrinks gradients by about
    sqrt(n) at near-uniform rows, hence the grad scale.
    """
    check_input("x", x)
    if not is_scaled(x):
        return ops.softmax(x, axis=axis)
    _, ga = scalars(x)
    r = pow2_sqrt(reduced_count(x.data, axis))
    one = S.float32_scalar(1.0, x.data)
    return pointwise(x, lambda u: fused.softmax(u, axis=axis), *_softmax_scales(one, ga, r))


@S.memoize_scalars
def _softmax_scales(one, ga, r):
    """`(1/r, ga·r)`: the scale and grad scale of `softmax`'s output."""
    return one / r, ga * r


def log_softmax(x, axis=-1):
    """Rule: `s = 1`, `d = log_softmax(a·sa)`; `g = ga`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.log_softmax(x, axis=axis)
    _, ga = scalars(x)
    one = ops.ones((), "float32")
    return pointwise(x, lambda u: ops.log_softmax(u, axis=axis), one, ga)


def logsumexp(x, axis=None, keepdims=False):
    """Rule: `s = max(sa, 1)` (≈ max(x) for large x, ≈ log n for small), `d = lse(a·sa)/s`; `g = ga·P(n)`.

    The backward `softmax·g` spreads each gradient over the n reduced
    elements.
    """
    check_input("x", x)
    if not is_scaled(x):
        return ops.logsumexp(x, axis=axis, keepdims=keepdims)
    sa, ga = scalars(x)
    s = ops.maximum(sa, ops.ones((), "float32"))
    n = reduced_count(x.data, axis)
    ga = ga * (pow2.np_pow2_round_down(n) if isinstance(n, int) else pow2.pow2_round_down(n))
    return pointwise(
        x, lambda u: ops.logsumexp(u, axis=axis, keepdims=keepdims), s, ga
    )


def _normalize(x, axis, epsilon, center):
    import keras

    if epsilon is None:
        epsilon = keras.config.epsilon()
    sa, ga = scalars(x)
    a = pow2.as_dtype(x.data, "float32")
    inv_q, eps_d, g = _normalize_scalars(sa, ga, float(epsilon))
    if center and fused.applies(a, inv_q, eps_d):
        out = fused.normalize(a, _axes(axis), inv_q, eps_d)
    elif center:
        mean, var = ops.moments(a, axes=_axes(axis), keepdims=True)
        inv = ops.rsqrt((var * inv_q) * inv_q + eps_d)
        out = a * inv + (-mean * inv)
    else:
        ms = ops.mean(ops.square(a), axis=axis, keepdims=True)
        out = a * ops.rsqrt((ms * inv_q) * inv_q + eps_d)
    return ScaledTensor(pow2.as_dtype(out, x.dtype), inv_q, g)


@S.memoize_scalars
def _normalize_scalars(sa, ga, epsilon):
    """`(1/q, eps term, grad scale)` of the normalization rule for input
    scales `(sa, ga)`, as explained below."""
    # (X - E X)/sqrt(Var X + eps) == (a - E a)/sqrt(Var a + eps/sa²), with
    # eps/sa² computed as (eps/sa)/sa (sa² underflows float32 below 2^-63).
    # When eps dominates (sa < sqrt(eps)), eps/sa² may overflow: the factor
    # q = P(sqrt(eps))/sa > 1 goes to the output's scale instead,
    # `(a - E a)/sqrt(Var a/q² + eps/(sa·q)²) · (1/q)`, whose eps term is in
    # [1, 4). With q = 1 (the usual case) the operations are keras.ops's,
    # so the model is unchanged (the paper's variant drops eps/sa²). The eps
    # term is kept >= the smallest float32 normal: under a scale beyond
    # ~2^60 it would underflow to 0, and a constant row would give 0·inf.
    q = S.maximum(pow2.np_pow2_round_down(math.sqrt(epsilon)) / sa, 1.0)
    inv = 1.0 / (sa * q)
    eps_d = S.maximum((epsilon * inv) * inv, 2.0**-126)
    inv_q = 1.0 / q
    # Backward: dX ~ dY/σ with σ ≈ sa·q (unit data) → g = ga·sa·q; the data
    # cotangent is then plain autodiff (c = (g/q)/(ga·sa) = 1).
    return inv_q, eps_d, ga * sa * q


def _axes(axis):
    return sorted(axis) if isinstance(axis, (list, tuple)) else [axis]


def affine_layer_normalization(
    x, gamma, beta, axis=-1, epsilon=None, calibrated=None, grad_rescale=None
):
    """`add(multiply(layer_normalization(x, axis, epsilon), gamma, calibrated=(None, cg)),
    beta, calibrated=(None, cb))` for `calibrated = (cg, cb)` (or None):
    the three rules' scales, from their own scale arithmetic. Where
    `backend.fused.affine_normalize` applies (eager torch on the CPU, float32
    data, trailing axes, `q = 1`) the data is one fused node; elsewhere the
    three ops run. `gamma` and `beta` are ScaledTensors. `grad_rescale =
    (state, statistic)`: `x` first goes through `delayed_rescale_grad(x,
    state, statistic)`, whose re-expression of the cotangent and statistic
    run inside the fused node's backward where it applies."""
    cg, cb = (None, None) if calibrated is None else check_calibrated(calibrated, 2)
    if epsilon is None:
        import keras

        epsilon = keras.config.epsilon()
    # (The fused node's scalars, and the delayed rescale's parts, only
    # where it may run: elsewhere the rules below run once.)
    x0, delayed = x, None
    if is_scaled(x) and is_scaled(gamma) and is_scaled(beta) and fused.applies(x.data):
        if grad_rescale is not None:
            x, state, k, next_state = delayed_rescale_parts(x, *grad_rescale)
            delayed = (state, k, next_state)
        sa, ga = scalars(x)
        inv_q, eps_d, g_n = _normalize_scalars(sa, ga, float(epsilon))
        (sg, gg), (sb, gb) = scalars(gamma), scalars(beta)
        s_y = times(inv_q, sg)
        g_y, ca, cgam = _product_grad_scales(inv_q, g_n, sg, gg, s_y, [None, cg])
        s, g, fa, ba, fb, bb = _sum_scales(s_y, g_y, sb, gb, [None, cb])
        axes = [ax % len(x.shape) for ax in _axes(axis)]
        if sorted(axes) == list(range(len(x.shape) - len(axes), len(x.shape))):
            out = fused.affine_normalize(
                x.data, gamma.data, beta.data, inv_q, eps_d, (fa, fb, ba, ca, cgam, bb), delayed
            )
            if out is not None:
                return ScaledTensor(out, s, g)
    if grad_rescale is not None:
        x = delayed_rescale_grad(x0, *grad_rescale)
    y = layer_normalization(x, axis=axis, epsilon=epsilon)
    y = multiply(y, gamma, calibrated=None if calibrated is None else (None, cg))
    return add(y, beta, calibrated=None if calibrated is None else (None, cb))


def layer_normalization(x, axis=-1, epsilon=None):
    """Rule (no affine): `s = 1`, `d = (a - E a)/sqrt(Var a + eps/sa²)`; `g = ga·sa`.

    Equal to `keras.ops.layer_normalization(x, axis=axis, epsilon=epsilon)`
    on the represented values.
    """
    check_input("x", x)
    if not is_scaled(x):
        return ops.layer_normalization(x, axis=axis, epsilon=epsilon)
    return _normalize(x, axis, epsilon, center=True)


def rms_normalization(x, axis=-1, epsilon=None):
    """Rule (no affine): `s = 1`, `d = a/sqrt(E a² + eps/sa²)`; `g = ga·sa`."""
    check_input("x", x)
    if not is_scaled(x):
        return ops.rms_normalization(x, axis=axis, epsilon=epsilon)
    return _normalize(x, axis, epsilon, center=False)


# The value masked attention scores take, as in `keras.layers.Softmax`.
MASK_VALUE = -1e9
# Largest finite float32 magnitude used for the masked data (`mask_fill`):
# a tiny scores scale cannot turn the fill into -inf.
_F32_MAX = 3.0e38


@S.memoize_scalars
def _mask_fill_scalars(scale, grad_scale):
    """`(data, scale, grad_scale)` of the mask fill value for scores of
    this scale (`mask_fill`)."""
    s = S.where(S.greater(scale, 0.0), scale, S.ones_like(scale))
    data = S.maximum(S.divide(MASK_VALUE, s), -_F32_MAX)
    return data, s, grad_scale


def mask_fill(scores):
    """`MASK_VALUE` represented with the ScaledTensor `scores`' own scale
    (1 if that is 0), so `where(mask, scores, fill)` keeps the scores'
    scale; float32 data, clipped to the float32 range for tiny scales."""
    scale, grad_scale = S.stop_gradient(scores.scale), S.stop_gradient(scores.grad_scale)
    return ScaledTensor(*_mask_fill_scalars(scale, grad_scale))


def _probs_grad_scale(probs, value, combine_equation):
    """`(g, factor)`: the grad scale of the attention probabilities
    predicted from the values' side of `einsum(combine_equation, probs,
    value)` (`operand_grad_scale`: their cotangent is `d(out)·vᵀ`; softmax
    saturates at large scores, and the q/k rules cannot see the values'
    scale), and the factor that re-expresses their cotangent in the
    softmax rule's units (`with_grad_scale`)."""
    g = operand_grad_scale(combine_equation, (probs, value), 0)
    return grad_scale_and_factor(probs, g)


def _fused_masked_softmax(scores, mask, fill, value, combine_equation):
    """`masked_softmax`'s composition with its scales (`where` keeps the
    scores' scale, as the fill has it; `softmax`'s rule over the last
    axis; the last `where` keeps the probabilities'; with `value`,
    `with_grad_scale`, whose factor joins the node's backward one) where
    `backend.fused` runs it as one node (no fully masked row); None
    elsewhere."""
    n = static_dim(scores.shape[-1])
    if n is None:
        return None
    # (`fused` takes normal pow2 scales only: the fill then has the
    # scores' scale, `mask_fill`.)
    sa, ga = scalars(scores)
    one = S.float32_scalar(1.0, scores.data)
    s_out, g_out = _softmax_scales(one, ga, pow2_sqrt(n))
    back, inv_out = _pointwise_factors(g_out, ga, s_out, one)
    g = g_out
    if value is not None:
        g, factor = _probs_grad_scale(ScaledTensor(scores.data, s_out, g_out), value, combine_equation)
        back = times(back, factor)
    data = fused.masked_softmax(scores.data, mask, fill.data, (sa, inv_out, back))
    return None if data is None else ScaledTensor(data, s_out, g)


def masked_softmax(
    scores, mask=None, value=None, combine_equation=None, softmax_fn=None, zero_masked_rows=True
):
    """Attention probabilities from float32 ScaledTensor `scores`:
    `softmax_fn(where(mask, scores, fill))` (default: `softmax` over the
    last axis), `fill` being `MASK_VALUE` with the scores' scale
    (`mask_fill`: `where` rescales nothing). Rows whose every position is
    masked give zeros with `zero_masked_rows` (Keras's explicit
    MultiHeadAttention path) and a uniform row without (Keras's
    `dot_product_attention`). With `value`: the probabilities' grad scale
    predicted from `einsum(combine_equation, probs, value)`
    (`_probs_grad_scale`). On eager torch (CPU), a mask and the default
    softmax run as one node (`backend.fused.masked_softmax`) where no row
    is fully masked; the same values, scales and gradients."""
    softmax_fn = softmax_fn or softmax
    if mask is None:
        probs = softmax_fn(scores)
    else:
        fill = mask_fill(scores)
        if softmax_fn is softmax:
            fused_probs = _fused_masked_softmax(scores, mask, fill, value, combine_equation)
            if fused_probs is not None:
                return fused_probs
        probs = softmax_fn(where(mask, scores, fill))
        if zero_masked_rows:
            probs = where(mask, probs, 0.0)
    if value is None:
        return probs
    g, _ = _probs_grad_scale(probs, value, combine_equation)
    return with_grad_scale(probs, g)


# `dot_product_attention`'s combination of probabilities and values.
_COMBINE = "bnts,bsnh->btnh"


def _attention_keep(logits, mask, is_causal):
    """The boolean mask of kept logits (B, N, T, S) from `mask` and
    `is_causal` (a lower-triangular (T, S)), or None."""
    keep = None if mask is None else ops.cast(mask, "bool")
    if is_causal:
        t, s = logits.shape[-2], logits.shape[-1]
        causal = ops.tril(ops.ones((t, s), "bool"))
        keep = causal if keep is None else ops.logical_and(keep, causal)
    return keep


def _attention_probs(logits, bias, mask, is_causal):
    """Softmax over the last axis of float32 `logits` (B, N, T, S) after
    `bias` and the masks, as `keras.ops.dot_product_attention` does."""
    if bias is not None:
        logits = logits + ops.cast(bias, "float32")
    keep = _attention_keep(logits, mask, is_causal)
    if keep is not None:
        logits = ops.where(keep, logits, _LARGE_NEGATIVE)
    return fused.softmax(logits, axis=-1)


# Keras's fill for masked logits (float32): 0.7 × the float32 max, negated.
_LARGE_NEGATIVE = -0.7 * 3.38953e38


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    scale=None,
    is_causal=False,
    flash_attention=None,
    attn_logits_soft_cap=None,
):
    """Rule: logits `einsum(q, k)·scale` by the `einsum` rule (float32
    data; `scale` in the GEMMs' factors, `einsum(multiplier=)`); with
    masks only, `masked_softmax` (fully masked rows uniform, as Keras;
    the probabilities' grad scale from the values' side; one node on
    eager torch); with `bias` or a soft cap, the softmax of their true
    values in float32 (as `keras.ops.dot_product_attention`); then
    `einsum(probs, v)` by the
    `einsum` rule, rebalanced by `P(S**(1/4))` (S the key length; see
    `ScaledMultiHeadAttention`). Layout (B, T, N, H); fewer key/value heads
    than query heads (grouped-query attention) are repeated.
    `flash_attention` is ignored: the computation is unfused.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_input(name, x)
    if not any(is_scaled(x) for x in (query, key, value)):
        return ops.dot_product_attention(
            query, key, value, bias=bias, mask=mask, scale=scale,
            is_causal=is_causal, flash_attention=flash_attention,
            attn_logits_soft_cap=attn_logits_soft_cap,
        )
    like = next(x for x in (query, key, value) if is_scaled(x))
    query, key, value = same_dtype(
        [promote(x, like, n) for x, n in ((query, "query"), (key, "key"), (value, "value"))]
    )
    heads, kv_heads = query.shape[-2], key.shape[-2]
    if kv_heads != heads:
        key = repeat(key, heads // kv_heads, axis=-2)
        value = repeat(value, heads // kv_heads, axis=-2)
    if scale is None:
        scale = 1.0 / float(np.sqrt(query.shape[-1]))
    logits = einsum("btnh,bsnh->bnts", query, key, out_dtype="float32", multiplier=scale)
    if bias is None and attn_logits_soft_cap is None:
        probs = masked_softmax(
            logits, _attention_keep(logits, mask, is_causal), value, _COMBINE,
            zero_masked_rows=False,
        )
        probs = cast(probs, value.dtype)
    else:
        if attn_logits_soft_cap is not None:
            cap = float(attn_logits_soft_cap)
            logits = multiply(tanh(multiply(logits, 1.0 / cap)), cap)
        probs = ops.cast(_attention_probs(to_array(logits), bias, mask, is_causal), value.dtype)
    out = einsum(_COMBINE, probs, value)
    length = key.shape[-3]
    length = int(length) if isinstance(length, int) else 1
    return rebalance(out, pow2.np_pow2_round_down(max(length, 1) ** 0.25))
