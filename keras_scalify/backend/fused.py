"""Fused elementwise steps of the scale rules, per backend.

On JAX and TensorFlow each is the composition of `keras.ops` (XLA and
Grappler fuse it; autodiff differentiates it): `gated` composes it here,
and where `applies(...)` is false the caller composes `scaled_sum`,
`scaled_product` and `normalize` from its own rules. On eager torch each
is one autograd node (`torch.autograd.Function`) that makes fewer passes over the
data and records one node instead of several, each with Keras's
custom-gradient wrapper.

**Gated activations** `a·gate(a·s)` (`s` a constant scale).
`gated(a, s, kind)` returns `a·gate(u)` with `u = a·s`, for float32 `a` and
a float32 scalar `s` whose gradient is not taken. Its derivative in `a` is
`f'(u)` for `f(u) = u·gate(u)` (gelu, silu), whatever `s` is.

- JAX and TensorFlow: the composition of `keras.ops`, which XLA / Grappler
  fuse, and autodiff differentiates.
- Eager torch: one autograd node. The forward computes the gate without
  recording a graph (a GELU with a host-known `s <= 1`: torch's GELU
  kernel at `a·s`, over `s`; else the erf GELU as `a·erfc(-a·s/√2)/2`);
  the backward is
  torch's own fused `gelu_backward` / `silu_backward` at `u`, clipped to
  where the derivative is exactly saturated in float32 (so `u = ±inf` from
  an overflowing `a·s` gives 1 or 0, not NaN). The composition records ~8
  elementwise passes and as many autograd nodes: on the GPT's
  [16, 64, 512] activations (one CPU thread) 2.8 ms forward and backward,
  this node 1.7 ms, Keras's fused GELU 0.36 ms.
- A GEMM epilogue (a Dense layer's, `ops._gemm.scaled_gemms_plus`) that
  can fold `s` into its own factors produces `u` itself, where
  `gate_epilogue(s, kind)` gives the host's `s`: then `gated_value(u, s,
  kind)` is `f(u)/s` and `gated_value_derivative(grad, u, kind)` the
  cotangent of `a`, with no pass to form `u` forward or backward (eager
  torch; elsewhere `gate_epilogue` is None).

**Rescaled sum** `scaled_sum(a, fa, ba, b, fb, bb, sign)`: `a·fa + sign·b·fb`
with backward `cotangent·ba` and `sign·cotangent·bb` (summed to each
operand's shape), for float32 data and float32 scalar factors (the scale
rule of `add`/`subtract`). Torch: one `addcmul` pass over the larger
operand (the composition: a multiply per operand, then the sum).

**Normalization** `normalize(a, axes, inv_q, eps)`: the centred
layer norm of float32 data with a rescaled variance (the rule of
`layer_normalization`), its variance taken around the mean. Torch, over
trailing axes: one node whose backward is torch's fused layer-norm
backward (the composition: ~11 passes).

**Normalization with its affine** `affine_normalize(a, gamma, beta,
inv_q, eps, factors)`: `normalize(a)·gamma·fa + beta·fb` (the rules of
`layer_normalization`, `multiply` and `add` in a row). Torch, on the CPU
over trailing axes with `inv_q = 1` and host-known factors: torch's
`native_layer_norm` with the factors folded into its weight and bias, and
one `native_layer_norm_backward` (the composition: 4 nodes, ~9 passes
each way); elsewhere None, and the caller composes the rules.

**Masked softmax** `masked_softmax(a, mask, fill, (sa, inv_out, back))`:
attention's masked scores through the rules of `where`, `softmax` and
`where`. Torch, on the CPU where no row is fully masked: one node (one
`where`, torch's softmax and its fused backward) instead of ~5 passes each
way; elsewhere None, and the caller composes the rules.

**Softmax** `softmax(u, axis)`: a softmax whose saturated rows are
exactly one-hot, so their backward is exactly 0 (the scores' scale,
2^(2k) for an attention input at 2^k, multiplies whatever is left there
into the input gradient). TensorFlow without oneDNN (it turns oneDNN on
only for CPUs with AVX-512 VNNI/BF16, AVX-VNNI or AMX, so on AMD EPYC it
is off): `exp(u - max) / sum` with IEEE division, since the Eigen kernel
multiplies by an approximate reciprocal (a one-hot row read 1 - 2^-24,
and attention's input gradient at k = 20 came out 2^18 off). Elsewhere
the backend's own softmax (oneDNN's, JAX's and torch's divide exactly or
multiply by an exact `1/sum`; the composition cost TensorFlow's GPT step
~6% where oneDNN's kernel is exact anyway).

**Bias add in the GEMM node** `bias_in_gemm(x, w)`: whether a Dense
layer's bias add (and, on eager torch, its activation) joins its GEMMs'
custom gradient (`ops.linalg.contraction_plus`): eager torch and
TensorFlow, for float32 tensors (TensorFlow's CPU graphs fuse no
elementwise chain); not JAX (XLA fuses the composition).

**Product with cotangent factors** `scaled_product(a, ca, b, cb)`: `a·b`
with backward `cotangent·b·ca` and `cotangent·a·cb` (the rule of
`multiply`), float32 data. Torch: the factor is applied to the smaller
side (the composition: two extra passes in the backward).
"""

import functools
import math

from keras import ops
from keras.backend import backend as keras_backend

from keras_scalify.backend import scalar as S
from keras_scalify.backend.scalar import TORCH

KINDS = ("gelu", "gelu_tanh", "silu")

# |u| beyond which the gate and f'(u) are exactly 1 (or 0) in float32.
_SATURATED = {"gelu": 16.0, "gelu_tanh": 20.0, "silu": 128.0}

_TANH_K = math.sqrt(2.0 / math.pi)

# The scales `s` at which a GELU is torch's own kernel at `a·s` over `s`
# (eager torch, `s` known on the host).
_GELU_KERNEL_SCALES = (2.0**-64, 1.0)


def gate(u, kind):
    """The gate `g(u)` of `kind`, with `keras.ops` (bounded for every `u`,
    ±inf included)."""
    if kind == "gelu":
        return 0.5 * (1.0 + ops.erf(u * (1.0 / math.sqrt(2.0))))
    if kind == "gelu_tanh":
        # Clipped where tanh is exactly ±1, so that u**3 stays finite.
        c = _SATURATED[kind]
        u = S.clip(u, -c, c)
        return 0.5 * (1.0 + ops.tanh(_TANH_K * (u + 0.044715 * u * u * u)))
    if kind == "silu":
        return ops.sigmoid(u)
    raise ValueError(f"gated: `kind` must be one of {KINDS}, got {kind!r}.")


def softmax(u, axis=-1):
    """Softmax over `axis` with exactly one-hot saturated rows (docstring
    of the module)."""
    if not _eigen_softmax():
        return ops.softmax(u, axis=axis)
    e = ops.exp(u - ops.stop_gradient(ops.max(u, axis=axis, keepdims=True)))
    return ops.divide(e, ops.sum(e, axis=axis, keepdims=True))


@functools.lru_cache(maxsize=None)
def _eigen_softmax():
    """Whether TensorFlow runs its Eigen softmax kernel here (oneDNN off;
    TensorFlow's own flag, read once). Where the flag cannot be read, the
    exact composition is taken."""
    if keras_backend() != "tensorflow":
        return False
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return True
    return not _pywrap_util_port.IsMklEnabled()


def _gated_ops(a, s, kind):
    return a * gate(a * s, kind)


if TORCH:
    import torch

    def _forward(a, s, kind):
        """`a·gate(a·s)` without recording a graph, in few passes. For a
        GELU whose `s` the host knows in `_GELU_KERNEL_SCALES` (`u = a·s`
        cannot overflow, nor lose bits but where `|a| < 2**-62`): torch's
        fused GELU of `u` over `s`, 3 passes, in place after the first
        (0.38 ms on [16, 64, 512], one CPU thread, against 0.59 for the
        composition below). Otherwise the erf GELU as `a·erfc(a·(-s/√2))·0.5`
        (`s/√2` rounds as `1/√2` does, `s` being a power of two; `erfc`
        keeps the far negative tail that `1 + erf` cancels)."""
        scale = S.host_value(s)
        if kind != "silu" and scale is not None and _GELU_KERNEL_SCALES[0] <= scale <= 1.0:
            # torch's own (vectorized) GELU kernel in place on `u = a·s`,
            # then `·1/s`: both factors exact powers of two.
            approximate = "tanh" if kind == "gelu_tanh" else "none"
            u = torch.ops.aten.gelu_(torch.mul(a, s), approximate=approximate)
            return u if scale == 1.0 else u.mul_(1.0 / scale)
        if kind == "gelu":
            w = torch.mul(a, s * (-1.0 / math.sqrt(2.0))).erfc_()
            return w.mul_(a).mul_(0.5)
        if kind == "silu":
            return torch.mul(a, s).sigmoid_().mul_(a)
        return a * gate(a * s, kind)

    def _derivative(grad, a, s, kind):
        """`grad·f'(a·s)`. `a·s` is clipped where it may overflow (`s`
        above 1, or not known on the host): an infinite `u` would give
        `inf·0 = NaN`. (With `|s| <= 1` only an infinite `a` gives an
        infinite `u`, and its NaN derivative propagates the fault.)"""
        c = _SATURATED[kind]
        scale = S.host_value(s)
        u = a if scale == 1.0 else a * s
        if scale is None or not abs(scale) <= 1.0:
            u = torch.clamp(u, -c, c) if u is a else u.clamp_(-c, c)
        # Written into `u` where it is this call's own temporary (a fresh
        # weight-sized output costs more than the pass, memory being cold).
        out = {} if u is a else {"grad_input": u}
        if kind == "silu":
            op = torch.ops.aten.silu_backward
            return (op.grad_input if out else op.default)(grad, u, **out)
        approximate = "tanh" if kind == "gelu_tanh" else "none"
        op = torch.ops.aten.gelu_backward
        return (op.grad_input if out else op.default)(grad, u, approximate=approximate, **out)

    class _Gated(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, s, kind):
            ctx.save_for_backward(a, s)
            ctx.kind = kind
            return _forward(a, s, kind)

        @staticmethod
        def backward(ctx, grad):
            a, s = ctx.saved_tensors
            return _derivative(grad, a, s, ctx.kind), None, None

    def gate_epilogue(s, kind):
        """For a GEMM epilogue that can produce `u = a·s` itself (the
        pow2 `s` folded into its factors): `s` as a Python float where
        `gated_value` then computes `gated(a, s, kind)` exactly, a scale
        known on the host in `_GELU_KERNEL_SCALES` (`u` cannot overflow
        where `a` does not, nor lose bits but where `|a| < 2**-62`);
        else None."""
        scale = S.host_value(s)
        if kind in KINDS and scale is not None and _GELU_KERNEL_SCALES[0] <= scale <= 1.0:
            return scale
        return None

    def gated_value(u, scale, kind):
        """`f(u)/scale` with `f(u) = u·gate(u)`, torch's kernel, without
        recording a graph: `gated(a, s, kind)` for `u = a·s` and `scale`
        from `gate_epilogue`."""
        if kind == "silu":
            # (As `gated` rounds it: `u·sigmoid(u)`, not torch's SiLU kernel.)
            out = torch.sigmoid(u).mul_(u)
        else:
            approximate = "tanh" if kind == "gelu_tanh" else "none"
            out = torch.ops.aten.gelu(u, approximate=approximate)
        return out if scale == 1.0 else out.mul_(1.0 / scale)

    def gated_value_derivative(grad, u, kind):
        """`grad·f'(u)`: the cotangent of `a` from that of `gated_value`'s
        result, `u = a·s` with `|s| <= 1` (an infinite `u` comes from an
        infinite `a`, whose NaN derivative propagates the fault). `u` is
        left as it is (a retained graph may run the backward again)."""
        if kind == "silu":
            return torch.ops.aten.silu_backward(grad, u)
        approximate = "tanh" if kind == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_backward(grad, u, approximate=approximate)

    def gated(a, s, kind):
        """`a·gate(a·s)` (module docstring); `s` gets no gradient."""
        if kind not in KINDS:
            gate(a, kind)  # raises the error naming `kind`
        if not (isinstance(a, torch.Tensor) and isinstance(s, torch.Tensor)):
            return _gated_ops(a, s, kind)
        return _Gated.apply(a, s.detach(), kind)

    class _ScaledSum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, fa, ba, b, fb, bb, sign):
            ctx.shapes = (a.shape, b.shape)
            ctx.save_for_backward(ba, bb)
            ctx.sign = sign
            # (A factor of exactly 1 is not applied: no pass of its own.)
            if b.numel() <= a.numel():
                if sign > 0 and S.is_one(fb):
                    return torch.addcmul(b, a, fa)
                return torch.addcmul(b * (fb if sign > 0 else -fb), a, fa)
            return torch.addcmul(a if S.is_one(fa) else a * fa, b, fb, value=sign)

        @staticmethod
        def backward(ctx, g):
            ba, bb = ctx.saved_tensors
            shape_a, shape_b = ctx.shapes
            ga = gb = None
            if ctx.needs_input_grad[0]:
                ga = S.sum_to(g if S.is_one(ba) else g * ba, shape_a)
            if ctx.needs_input_grad[3]:
                gb = S.sum_to(g, shape_b)
                if ctx.sign < 0 or not S.is_one(bb):
                    gb = gb * (bb if ctx.sign > 0 else -bb)
            return ga, None, None, gb, None, None, None

    class _ScaledProduct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, ca, b, cb):
            ctx.save_for_backward(a, ca, b, cb)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, ca, b, cb = ctx.saved_tensors
            ga = gb = None
            if ctx.needs_input_grad[0]:
                ga = _cotangent(g, b, ca, a.shape)
            if ctx.needs_input_grad[2]:
                gb = _cotangent(g, a, cb, b.shape)
            return ga, None, gb, None

    def _cotangent(g, other, factor, shape):
        """`sum_to(g·other, shape)·factor`, the factor on the smaller side
        (on the product itself: in place, it is this call's own)."""
        if S.is_one(factor):
            return S.sum_to(g * other, shape)
        if other.numel() < g.numel():
            return S.sum_to(g * (other * factor), shape)
        return S.multiply_in_place(S.sum_to(g * other, shape), factor)

    def _centred_and_rstd(a, axes, inv_q, eps):
        mean = torch.mean(a, dim=axes, keepdim=True)
        c = a - mean
        var = torch.mean(c * c, dim=axes, keepdim=True)
        return c, torch.rsqrt(var * inv_q * inv_q + eps)

    class _Normalize(torch.autograd.Function):
        """`normalize` over trailing axes as one autograd node: the
        forward is the composition's, the backward torch's fused layer-norm
        backward (`native_layer_norm_backward`) at the centred input
        `c·inv_q` with mean 0 and `rstd = r`, which is the derivative of
        `c·r` with `r = rsqrt(Var·inv_q² + eps)`:
        `r·(g - mean(g) - c·inv_q²·r²·mean(g·c))`. (Autograd through the
        composition runs ~11 passes: on the GPT's [16, 64, 128]
        activations, one CPU thread, 0.99 ms forward and backward against
        0.16 for this node.)"""

        @staticmethod
        def forward(ctx, a, inv_q, eps, n):
            axes = list(range(a.ndim - n, a.ndim))
            c, r = _centred_and_rstd(a, axes, inv_q, eps)
            ctx.save_for_backward(c, inv_q, r)
            ctx.n = n
            return c * r

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            c, inv_q, r = ctx.saved_tensors
            shape = list(c.shape[c.ndim - ctx.n:])
            ga, _, _ = torch.ops.aten.native_layer_norm_backward(
                g, c if S.is_one(inv_q) else c * inv_q, shape, torch.zeros_like(r), r, None, None,
                [True, False, False]
            )
            return ga, None, None, None

    def normalize(a, axes, inv_q, eps):
        """`(a - E a)·rsqrt(Var a · inv_q · inv_q + eps)` over `axes`
        (kept; `inv_q²` alone may underflow), the variance in two passes
        (exact for rows with a large mean). Measured on the GPT's
        [16, 64, 128] activations, one CPU thread: 0.05 ms forward against
        0.09 ms for Keras's torch `moments` (E[a²] - E[a]²) with the
        composition, and 0.7 ms for `torch.var_mean` (Welford). Over
        trailing axes, one autograd node (`_Normalize`); `inv_q` and `eps`
        get no gradient."""
        n = a.ndim
        axes = sorted(ax % n for ax in axes)
        if axes == list(range(n - len(axes), n)):
            return _Normalize.apply(a, inv_q, eps, len(axes))
        c, r = _centred_and_rstd(a, axes, inv_q, eps)
        return c * r

    def applies(*xs):
        """Whether `scaled_sum`, `scaled_product` and `normalize` take
        these operands: float32 torch tensors (else the caller composes
        the rule)."""
        return all(isinstance(x, torch.Tensor) and x.dtype == torch.float32 for x in xs)

    class _AffineNormalize(torch.autograd.Function):
        """`affine_normalize` as one node: torch's fused layer norm forward
        and backward, the pow2 factors folded into its weight and bias
        vectors."""

        @staticmethod
        def forward(ctx, a, gamma, beta, eps, factors, state, delayed):
            f_gamma, f_beta, c_input, c_gamma, c_beta = factors
            shape = list(gamma.shape)
            out, mean, rstd = torch.native_layer_norm(a, shape, gamma * f_gamma, beta * f_beta, eps)
            ctx.save_for_backward(a, mean, rstd, gamma)
            ctx.factors = (c_input, c_gamma, c_beta)
            ctx.delayed = delayed
            return out

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            a, mean, rstd, gamma = ctx.saved_tensors
            c_input, c_gamma, c_beta = ctx.factors
            need = ctx.needs_input_grad
            # (The bias argument only has to be defined for its gradient:
            # its values are not read.)
            ga, g_gamma, g_beta = torch.ops.aten.native_layer_norm_backward(
                g, a, list(gamma.shape), mean, rstd, gamma * c_input, gamma,
                [need[0] or need[5], need[1], need[2]],
            )
            if g_gamma is not None:
                g_gamma = g_gamma.mul_(c_gamma)
            if g_beta is not None:
                g_beta = g_beta.mul_(c_beta)
            g_state = None
            if ctx.delayed is not None:
                # The delayed rescale of the input: the next grad scale from
                # the cotangent in its output's units, then the cotangent
                # re-expressed (in place: the node's own result).
                k, next_state = ctx.delayed
                g_state = next_state(ga) if need[5] else None
                ga = ga if k == 1.0 or not need[0] else ga.mul_(k)
            return (ga if need[0] else None), g_gamma, g_beta, None, None, g_state, None

    def _normal_pow2s(values):
        """Whether every value is a power of two in float32's normal range
        (so that their products below stay exact and finite)."""
        return all(v is not None and 2.0**-126 <= v <= 2.0**127 for v in values)

    def affine_normalize(a, gamma, beta, inv_q, eps, factors, delayed=None):
        """`normalize(a, trailing axes, inv_q, eps)·gamma·fa + beta·fb`
        (the rules of `layer_normalization`, `multiply` and `add` in a row)
        as one node, or None where it does not apply (the caller composes
        the rules): float32 CPU tensors, `gamma` and `beta` of the trailing
        shape of `a`, `inv_q = 1`, and every scalar known on the host.
        `factors = (fa, fb, ba, ca, cb, bb)`: the sum's forward and
        backward factors and the product's cotangent factors. Backward:
        `a` gets the layer-norm derivative of `g·ba·gamma·ca`, `gamma`
        `sum(g·xhat)·ba·cb`, `beta` `sum(g)·bb` (the composition's
        cotangents, with its pow2 factors multiplied together). `delayed =
        (state, k, next_state)` (`ops.rescaling.delayed_rescale_parts`):
        the input's delayed gradient rescale runs in the backward too: the
        state's gradient is `next_state` of the input cotangent, which is
        then multiplied by `k` in place (a host-known normal power of two;
        else None). Measured on the GPT's [16, 64, 128] activations, one
        CPU thread: the composition runs 4 nodes and ~9 passes each way."""
        if not (applies(a, gamma, beta) and S.on_host(a)):
            return None
        n = gamma.ndim
        if tuple(beta.shape) != tuple(gamma.shape) or tuple(a.shape[a.ndim - n:]) != tuple(gamma.shape):
            return None
        fa, fb, ba, ca, cb, bb = (S.host_value(f) for f in factors)
        if S.host_value(inv_q) != 1.0 or not _normal_pow2s((fa, fb, ba, ca, cb, bb)):
            return None
        eps = S.host_value(eps)
        c = (ba * ca, ba * cb, bb)
        if eps is None or not _normal_pow2s(c):
            return None
        state = node_delayed = None
        if delayed is not None:
            state, k, next_state = delayed
            k = S.host_value(k)
            if not _normal_pow2s((k,)):
                return None
            node_delayed = (k, next_state)
        return _AffineNormalize.apply(a, gamma, beta, eps, (fa, fb) + c, state, node_delayed)

    class _MaskedSoftmax(torch.autograd.Function):
        """`masked_softmax` as one node: one `where`, torch's softmax and
        its fused backward, the factors in place."""

        @staticmethod
        def forward(ctx, a, mask, fill, sa, inv_out, back):
            u = torch.where(mask, a, fill)
            if sa != 1.0:
                u.mul_(sa)
            p = torch.softmax(u, -1)
            ctx.save_for_backward(p)
            ctx.back = back
            return p * inv_out if inv_out != 1.0 else p.clone()

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, g):
            (p,) = ctx.saved_tensors
            ga = torch._softmax_backward_data(g, p, -1, torch.float32)
            return (ga if ctx.back == 1.0 else ga.mul_(ctx.back)), None, None, None, None, None

    def masked_softmax(a, mask, fill, factors):
        """`where(mask, softmax(where(mask, a, fill)·sa)·inv_out, 0)` over
        the last axis, backward `softmax'(g)·back` (the rules of `where`,
        `softmax` and `where` in a row, attention's masked scores), as one
        node; None where it does not apply (the caller composes the
        rules): float32 CPU `a`, a bool `mask` that broadcasts to it and
        leaves no row fully masked (the last `where` is then the identity,
        and the masked positions' cotangent is 0 through the softmax's),
        `factors = (sa, inv_out, back)` normal powers of two known on the
        host. Measured on the GPT's [16, 4, 64, 64] causal scores, one CPU
        thread: 0.77 ms forward and backward, against 1.7 for the
        composition's passes (5 each way)."""
        if not (applies(a, fill) and S.on_host(a) and mask.dtype == torch.bool):
            return None
        if fill.ndim != 0 or torch.broadcast_shapes(mask.shape, a.shape) != a.shape:
            return None
        sa, inv_out, back = (S.host_value(f) for f in factors)
        if not _normal_pow2s((sa, inv_out, back)):
            return None
        if not bool(torch.all(torch.any(mask, dim=-1))):
            return None
        return _MaskedSoftmax.apply(a, mask, fill, sa, inv_out, back)

    def scaled_sum(a, fa, ba, b, fb, bb, sign=1.0):
        """`a·fa + sign·b·fb`; backward `g·ba`, `sign·g·bb` (docstring)."""
        return _ScaledSum.apply(a, fa, ba, b, fb, bb, sign)

    def bias_in_gemm(*xs):
        """Whether a Dense layer's bias add (and activation) joins its
        GEMMs' custom gradient (`ops.linalg.contraction_plus`): for
        float32 tensors (`applies`), whose composition's passes eager
        torch runs one by one."""
        return applies(*xs)

    def scaled_product(a, ca, b, cb):
        """`a·b`; backward `g·b·ca`, `g·a·cb` (module docstring)."""
        return _ScaledProduct.apply(a, ca, b, cb)

else:
    import keras

    _TF = keras.backend.backend() == "tensorflow"

    def gated(a, s, kind):
        """`a·gate(a·s)` (module docstring); `s` gets no gradient."""
        return _gated_ops(a, ops.stop_gradient(s), kind)

    def applies(*xs):
        """No fused sum or product here: the caller composes the rule."""
        return False

    def bias_in_gemm(*xs):
        """Whether a Dense layer's bias add (and activation) joins its
        GEMMs' custom gradient (`ops.linalg.contraction_plus`): on
        TensorFlow for float32 tensors, whose CPU graphs fuse no
        elementwise chain (the sum's factors then join the GEMMs', which
        apply them to the smaller operand, instead of a pass over the
        output each way); not on JAX, where XLA fuses the composition
        (the node measured ~3% slower on the MLP of `step_time.py`)."""
        return _TF and all(S.has_dtype(x, "float32") for x in xs)

    def gate_epilogue(s, kind):
        """None: the caller applies `gated` (XLA / Grappler fuse it)."""
        return None

    def masked_softmax(a, mask, fill, factors):
        """Not fused here (XLA / Grappler fuse the composition)."""
        return None

    def affine_normalize(a, gamma, beta, inv_q, eps, factors, delayed=None):
        """None: the caller composes the rules (XLA / Grappler fuse them)."""
        return None

