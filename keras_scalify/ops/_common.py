"""Shared machinery of the scale rules: promotion and gradient rescaling.

Gradient convention (docs/design.md): the cotangent of `x.data` is
`true_gradient / x.grad_scale`. For an op `Y = F(X)` computed on data as
`Yd = F_d(Xd)`, plain autodiff of `F_d` gives `dL/dXd = J_d^T dL/dYd`; the
convention then needs the extra pow2 factor

    c = (s_Y * gs_Y) / (s_X * gs_X)

on the input's cotangent. `scale_grad(xd, c)` applies it (identity forward),
and `rescale(xd, f, b)` fuses a forward pow2 multiply with a backward one so
that no low-precision intermediate under- or overflows.
"""

import math

import numpy as np
from keras import ops

from keras_scalify.backend.scalar import dtype_name
from keras_scalify.backend import scalar as S
from keras_scalify.core import pow2
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled

_LOW = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _mul_pow2(x, factor):
    """`x * factor` for a float32 pow2 scalar, rounding once in x's dtype
    (`x` itself where the factor is 1: no pass, `backend.scalar.unless_one`)."""
    dtype = dtype_name(x.dtype)
    if dtype in _LOW:
        return S.unless_one(factor, x, lambda: S.cast(S.multiply(S.cast(x, "float32"), factor), dtype))
    return S.unless_one(factor, x, lambda: S.multiply(x, pow2.as_dtype(factor, dtype)))


def _upstream(args, upstream):
    if upstream is None:
        (upstream,) = args
    return upstream


@ops.custom_gradient
def _rescale_fwd_bwd(x, fwd, bwd):
    def grad(*args, upstream=None, variables=None):
        g = _upstream(args, upstream)
        return _mul_pow2(g, bwd), None, None

    return _mul_pow2(x, fwd), grad


@ops.custom_gradient
def _rescale_bwd(x, bwd):
    def grad(*args, upstream=None, variables=None):
        g = _upstream(args, upstream)
        return _mul_pow2(g, bwd), None

    return S.identity_in_custom_gradient(x), grad


def _f32(v, like):
    """Factor `v` (a scalar tensor or Python number) as a float32 tensor
    without gradient; a number is placed on the device of `like`."""
    if is_static_scalar(v):
        return S.float32_scalar(v, like)
    return S.stop_gradient(pow2.as_dtype(v, "float32"))


def rescale(x, fwd, bwd):
    """Forward `x * fwd`, backward `cotangent * bwd` (pow2 float32 scalars);
    `x` itself where both are known to be 1 (no custom-gradient node)."""
    if S.is_one(fwd) and S.is_one(bwd):
        return x
    return _rescale_fwd_bwd(x, _f32(fwd, x), _f32(bwd, x))


def scale_grad(x, bwd):
    """Identity forward, `cotangent * bwd` backward; `x` itself where `bwd`
    is known to be 1."""
    if S.is_one(bwd):
        return x
    return _rescale_bwd(x, _f32(bwd, x))


def safe_div(a, b):
    """`a / b`, and 0 where `b == 0` (zero-scale tensors stay NaN-free).
    One `keras.ops` call (`divide_no_nan`): on eager torch each op on a
    scalar scale costs more in dispatch than in arithmetic."""
    return S.divide_no_nan(a, b)


@S.memoize_scalars
def times(*xs):
    """The product of scale scalars, memoized: a rule's scale arithmetic
    outside its own memoized function (on eager torch a hit runs no op,
    and on a GPU the product's value stays known on the host, so the
    memoized rules downstream hit as on a CPU)."""
    out = xs[0]
    for x in xs[1:]:
        out = out * x
    return out


@S.memoize_scalars
def logical_not(x):
    """`not x` of a bool scalar (memoized, as `times`)."""
    return S.logical_not(x)


@S.memoize_scalars
def grad_factor(s_out, gs_out, s_in, gs_in):
    """The cotangent factor `c = (s_out * gs_out) / (s_in * gs_in)`."""
    return safe_div(s_out * gs_out, s_in * gs_in)


@S.memoize_scalars
def pow2_mean(*scales):
    """Power of two at the (floored) mean exponent: a geometric mean
    (`pow2_from_exponent(floor(mean(pow2_exponent(s))))`), computed on the
    biased exponents: `floor(Σ(E_i - 127)/n) + 127 = floor(ΣE_i/n)`, so
    the bias is neither removed nor restored (fewer scalar ops)."""
    total = pow2.biased_exponent(scales[0])
    for s in scales[1:]:
        total = S.add(total, pow2.biased_exponent(s))
    if len(scales) > 1:
        total = S.floor_divide(total, len(scales))
    return pow2.pow2_from_biased_exponent(total)


@S.memoize_scalars
def votes(preds, calibrated):
    """The predictions of an output's grad scale that count: an operand
    whose grad scale was not measured (`calibrated[i]` false: a weight whose
    gradient was never measured, or was last all zero or non-finite) takes
    the mean of the others' instead of its own. A guess is off by whatever
    its partner's scale is (2^100 for an input carried at 2^100), and its
    vote would move the output's grad scale by half of that."""
    if calibrated is None:
        return preds
    out = []
    for i, (p, c) in enumerate(zip(preds, calibrated)):
        others = [q for j, q in enumerate(preds) if j != i]
        if c is None or c is True or not others:
            out.append(p)
        else:
            out.append(S.where(c, p, pow2_mean(*others)))
    return out


def check_calibrated(calibrated, n):
    """`calibrated` (one bool per operand, or None) as a list."""
    if calibrated is None:
        return None
    calibrated = list(calibrated)
    if len(calibrated) != n:
        raise ValueError(
            f"`calibrated` needs one entry per operand ({n}), got {len(calibrated)}."
        )
    return calibrated


def pow2_max(*scales):
    out = scales[0]
    for s in scales[1:]:
        out = S.maximum(out, s)
    return out


def static_pow2_sqrt(n):
    """`pow2_round_down(sqrt(n))` for a static size `n` (a Python float)."""
    return pow2.np_pow2_round_down(math.sqrt(max(int(n), 1)))


def static_dim(d):
    """`d` as a Python int, or None when unknown or symbolic."""
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
        return int(d)
    return None


def static_count(shape):
    """Static element count of `shape` (unknown or symbolic dims count as
    1: they only enter grad-scale heuristics, never a forward scale)."""
    n = 1
    for d in shape:
        d = static_dim(d)
        if d is not None:
            n *= d
    return n


def stop(x):
    return S.stop_gradient(x)


def scalars(x):
    """`(scale, grad_scale)` of a ScaledTensor with gradients stopped."""
    return stop(x.scale), stop(x.grad_scale)


def check_input(name, x):
    """Raise a clear TypeError for non-float inputs."""
    if is_scaled(x) or _is_python_float(x):
        return
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a float, got a bool.")
    if isinstance(x, (int, np.integer)):
        return
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(
            f"`{name}` must be a floating-point tensor or a ScaledTensor, got "
            f"{x!r}."
        )
    try:
        dtype = dtype_name(
            getattr(x, "dtype", None) or np.asarray(x).dtype
        )
    except ValueError:
        raise TypeError(
            f"`{name}` must be a floating-point tensor or a ScaledTensor, got "
            f"{type(x).__name__} {x!r:.80}."
        ) from None
    if not _is_float(dtype):
        raise TypeError(
            f"`{name}` must be a floating-point tensor or a ScaledTensor, got "
            f"dtype {dtype}."
        )


def _is_float(dtype):
    return dtype in ("float16", "bfloat16", "float32", "float64") + _LOW


def _is_python_float(x):
    return isinstance(x, (float, np.floating)) and not isinstance(x, bool)


def is_static_scalar(x):
    return isinstance(x, (float, int, np.floating, np.integer)) and not (
        isinstance(x, (bool, np.bool_))
    )


def static_scalar(x, like):
    """A Python scalar as an exact ScaledTensor (mantissa * pow2).

    Its `grad_scale` is `like`'s: constants carry no gradient, so they
    never pull the propagated gradient scale.
    """
    s, m = pow2.np_pow2_decompose(float(x))
    data = ops.cast(ops.convert_to_tensor(m, "float32"), like.dtype)
    return ScaledTensor(data, s, stop(like.grad_scale))


def is_anyscale(x):
    """A static constant that every scale represents: 0 or ±inf."""
    return is_static_scalar(x) and (float(x) == 0.0 or math.isinf(float(x)))


def promote(x, like=None, name="x"):
    """Any operand as a ScaledTensor.

    - ScaledTensor: unchanged.
    - Python scalar: exact mantissa * pow2 split, no gradient.
    - plain tensor: scale 1 (`as_scaled`), with `like`'s grad_scale.
    """
    check_input(name, x)
    if is_scaled(x):
        return x
    if is_static_scalar(x):
        if like is None:
            raise TypeError(f"`{name}`: at least one operand must be scaled.")
        return static_scalar(x, like)
    # (Local: ops.boundary imports _common.)
    from keras_scalify.ops.boundary import as_scaled

    gs = None if like is None else stop(like.grad_scale)
    return as_scaled(x, grad_scale=gs)


def result_dtype(*xs):
    """The dtype Keras gives an op on tensors of these dtypes."""
    import keras

    return keras.backend.result_type(*[dtype_name(x.dtype) for x in xs])


def same_dtype(xs):
    """ScaledTensors `xs` with their data in one dtype, Keras's promotion
    of theirs (TensorFlow and torch refuse mixed dtypes themselves)."""
    if len({x.dtype for x in xs}) <= 1:
        return list(xs)
    dtype = result_dtype(*[x.data for x in xs])
    return [
        x if x.dtype == dtype else ScaledTensor(ops.cast(x.data, dtype), x.scale, x.grad_scale)
        for x in xs
    ]


def scaled(data, scale, grad_scale):
    return ScaledTensor(data, scale, grad_scale)
