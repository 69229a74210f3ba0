"""One custom gradient for the three GEMMs of a scaled contraction.

`scaled_gemms(gemms, a, b, factors, out_dtype)` computes
`gemms.forward(a, b) · f_out` and, backward, `gemms.grad_a(g, b) · f_a` and
`gemms.grad_b(a, g) · f_b`, each GEMM returning float32 and each `f` a
float32 power of two from the scale rule (`ops/linalg/rules.py`). A pow2 factor
costs no pass of its own:

- a factor the host knows (eager torch on the CPU, `backend.scalar.host_value`)
  is the GEMM's own `alpha` (`addmm`/`baddbmm`, `Gemms.alpha`): BLAS
  multiplies each accumulated block by it as it writes the result, the
  bits of the product times the factor, in no extra pass;
- otherwise, low-precision operands or quantizing GEMMs (FP8): the factor multiplies
  the float32 GEMM result in the same pass that rounds it to the data
  dtype (the result never under/overflows a narrow format first);
- float32 operands and a plain GEMM: the factor multiplies the result,
  where the elementwise ops that follow (bias, activation, their
  gradients) absorb it, unless an operand is at least `OPERAND_RATIO`
  times smaller: then that operand, which is exact (a pow2 factor
  commutes with float32 rounding). A Dense layer's weight gradient thus
  comes out of its GEMM already scaled, instead of taking another pass
  over the weight-sized result.

A cotangent autograd will not ask for (eager torch: an operand without
`requires_grad`, such as a model's input) is not computed: the first
layer's input-gradient GEMM is skipped, as Keras's Dense skips it.
"""

OPERAND_RATIO = 4

import functools

from keras import ops

from keras_scalify.backend.scalar import dtype_name
from keras_scalify.backend import fused
from keras_scalify.backend.gemm import same
from keras_scalify.backend import scalar as S
from keras_scalify.core.pow2 import as_dtype
from keras_scalify.ops._common import _upstream
from keras_scalify.ops._common import static_count


# The float32 normal range: a factor the GEMM takes as `alpha`. (BLAS
# skips the product for `alpha = 0`, so a zero factor would turn an
# inf/NaN cotangent into zeros where the multiply gives NaN: it keeps the
# multiply, as do inf and NaN factors.)
_NORMAL_MIN, _NORMAL_MAX = 2.0**-126, 2.0**127


def _apply(gemm, x, y, factor, out_shape, dtype, exact, alpha=False):
    """`gemm(x, y) · factor` in `dtype` (see the module docstring). A
    factor known to be 1 is not applied; one the host knows, with `alpha`
    (the GEMMs take it, `Gemms.alpha`, and it is a power of two), is the
    GEMM's own `alpha` when it is a normal float32 (`_NORMAL_MIN`); on
    the GEMM's own result it is applied in place (eager torch). A factor
    of 1 at run time is skipped on TensorFlow graphs
    (`backend.scalar.unless_one`)."""
    host = S.host_value(factor)
    if host == 1.0:
        return as_dtype(gemm(x, y), dtype)
    if alpha and host is not None and _NORMAL_MIN <= abs(host) <= _NORMAL_MAX:
        return as_dtype(gemm(x, y, alpha=host), dtype)
    # (A factor the host knows is not 1 here, and is not read again.)
    unless_one = S.unless_one if host is None else (lambda f, v, times: times())
    if exact:
        smaller = _operand_to_scale(tuple(x.shape), tuple(y.shape), tuple(out_shape))
        if smaller == 0:
            return gemm(unless_one(factor, x, lambda: S.multiply(x, factor)), y)
        if smaller == 1:
            return gemm(x, unless_one(factor, y, lambda: S.multiply(y, factor)))
    out = gemm(x, y)
    return as_dtype(unless_one(factor, out, lambda: S.multiply_in_place(out, factor)), dtype)


def _operand_to_scale(x_shape, y_shape, out_shape):
    """The operand (0 or 1) an exact GEMM's factor multiplies, the one at
    least `OPERAND_RATIO` times smaller than the result, or None (the
    result). Memoized by the static shapes (a GEMM's three shapes recur
    every step)."""
    try:
        return _operand_to_scale_cached(x_shape, y_shape, out_shape)
    except TypeError:  # a symbolic size (`torch.compile`) has no hash
        return _operand_to_scale_cached.__wrapped__(x_shape, y_shape, out_shape)


@functools.lru_cache(maxsize=1024)
def _operand_to_scale_cached(x_shape, y_shape, out_shape):
    sizes = [static_count(x_shape), static_count(y_shape)]
    smaller = 0 if sizes[0] <= sizes[1] else 1
    return smaller if sizes[smaller] * OPERAND_RATIO <= static_count(out_shape) else None


def _all_float32(*xs):
    return all(dtype_name(x.dtype) == "float32" for x in xs)


@S.memoize_scalars
def _with_sum_factors(factors, sum_factors):
    """The GEMM factors `(f_out·fa, f_a·ba, f_b·ba)` of a contraction whose
    output `y` joins a sum `y·fa + c·fb` with backward factor `ba`."""
    (f_out, f_a, f_b), (fa, ba) = factors, sum_factors
    return f_out * fa, f_a * ba, f_b * ba


def _laid_out(layout, i, x):
    """`x` laid out by `layout[i]` (`backend.gemm.Gemms.layout`), once per
    pass: the laid-out copies are not kept for the backward, whose own
    arguments Keras's custom gradient keeps already (with
    `Gemms.laid_grads`, those arguments are the laid-out operands:
    `scaled_gemms`)."""
    return x if layout is None else layout[i](x)


@S.memoize_scalars
def _scaled_by(factors, k):
    """Each factor times the Python float `k`."""
    return tuple(f * k for f in factors)


def scaled_gemms_plus(gemms, a, b, c, factors, sum_factors, out_shape, gate=None):
    """`scaled_gemms(...)·fa + c·fb` as one custom gradient, for float32
    operands and output (a Dense layer's bias add, the `add` rule):
    `sum_factors = (fa, ba, fb, bb)`, the sum's forward and backward
    factors. The sum's factors join the GEMMs' (`fa` the forward one, `ba`
    both backward ones: the cotangent is not rescaled by a pass of its
    own), `c·fb` is added to the GEMM's own result (in place on eager
    torch), and `c`'s cotangent is `sum_to(g, c.shape)·bb`.

    `gate = (kind, s)`: the gated activation of that rule follows, for the
    sum's pow2 scale `s` (a Python float from `backend.fused.gate_epilogue`):
    the forward factors also take `s`, so that the GEMM's own result is the
    activation's input `u = y·s`, and the node returns `f(u)/s`
    (`fused.gated_value`); backward, the cotangent of `y` is
    `fused.gated_value_derivative` of `g` at `u`. No pass forms `u` forward
    or backward (the composition: one each way)."""
    fa, ba, fb, bb = sum_factors
    f_out, f_a, f_b = _with_sum_factors(tuple(factors), (fa, ba))
    if gate is not None:
        f_out, fb = _scaled_by((f_out, fb), gate[1])
    a_shape, b_shape, c_shape = tuple(a.shape), tuple(b.shape), tuple(c.shape)
    need_a, need_b, need_c = S.needs_gradient(a), S.needs_gradient(b), S.needs_gradient(c)

    lay = gemms.layout

    @ops.custom_gradient
    def fn(a, b, c, f_out, f_a, f_b, fb, bb):
        def grad(*args, upstream=None, variables=None):
            g = _upstream(args, upstream)
            if gate is not None:
                g = fused.gated_value_derivative(g, u, gate[0])
            ga = gb = gc = None
            g_gemm = _laid_out(lay, 2, g)
            if need_a:
                ga = _apply(gemms.grad_a, g_gemm, _laid_out(lay, 1, b), f_a, a_shape, "float32", True, gemms.alpha)
            if need_b:
                gb = _apply(gemms.grad_b, _laid_out(lay, 0, a), g_gemm, f_b, b_shape, "float32", True, gemms.alpha)
            if need_c:
                gc = S.multiply(S.sum_to(g, c_shape), bb)
            return ga, gb, gc, None, None, None, None, None

        y = _apply(gemms.forward, _laid_out(lay, 0, a), _laid_out(lay, 1, b), f_out, out_shape, "float32", True, gemms.alpha)
        y = S.add_in_place(y, c if S.is_one(fb) else S.multiply(c, fb))
        if gate is None:
            return y, grad
        u = y  # (the backward's)
        return fused.gated_value(y, gate[1], gate[0]), grad

    return fn(a, b, c, f_out, f_a, f_b, fb, bb)


def scaled_gemms(
    gemms, a, b, factors, out_shape, out_dtype, quantized=False, pow2_factors=True, gate=None
):
    """Forward `gemms.forward(a, b)·f_out` in `out_dtype`; the cotangents of
    `a` and `b` are `grad_a(g, b)·f_a` and `grad_b(a, g)·f_b` in their
    dtypes. `factors = (f_out, f_a, f_b)`: float32 scalar tensors, powers
    of two unless `pow2_factors=False` (a static multiplier's mantissa
    joined them). `quantized`: the GEMMs round their operands (FP8). In
    either case a factor is never moved onto an operand (it would not
    commute with the rounding). With `gemms.quantize`, `a` and `b` are
    rounded once in the forward and `g` once in the backward
    (`backend.gemm.Gemms`). `gate`: as in `scaled_gemms_plus` (float32
    operands and output)."""
    out_dtype = dtype_name(out_dtype)
    f_out, f_a, f_b = factors
    if gate is not None:
        (f_out,) = _scaled_by((f_out,), gate[1])
    exact = pow2_factors and not quantized and _all_float32(a, b) and out_dtype == "float32"
    alpha = pow2_factors and gemms.alpha
    a_shape, b_shape = tuple(a.shape), tuple(b.shape)
    a_dtype, b_dtype = dtype_name(a.dtype), dtype_name(b.dtype)
    q = gemms.quantize
    # (Eager torch: a cotangent autograd will not ask for is not computed.)
    need_a, need_b = S.needs_gradient(a), S.needs_gradient(b)

    lay = gemms.layout
    grad_a, grad_b = gemms.grad_a, gemms.grad_b
    if gemms.laid_grads is not None and q is None and _all_float32(a, b):
        # The operands laid out once, outside the custom gradient: autograd
        # keeps the laid-out ones for the backward (not the originals, laid
        # out again there) and takes the cotangents back through the layout
        # (views; the GEMMs return them in the laid-out shapes). (Narrower
        # operands would be kept as their float32 copies: not done.)
        a, b = lay[0](a), lay[1](b)
        a_shape, b_shape = tuple(a.shape), tuple(b.shape)
        grad_a, grad_b = gemms.laid_grads
        lay = (same, same, lay[2])

    @ops.custom_gradient
    def fn(a, b, f_out, f_a, f_b):
        if q is not None:  # rounded once, kept for the backward
            a, b = q[0](a), q[1](b)

        def grad(*args, upstream=None, variables=None):
            g = _upstream(args, upstream)
            if gate is not None:
                g = fused.gated_value_derivative(g, u, gate[0])
            if q is not None:
                g = q[2](g)
            g = _laid_out(lay, 2, g)
            ga = gb = None
            if need_a:
                ga = _apply(grad_a, g, _laid_out(lay, 1, b), f_a, a_shape, a_dtype, exact, alpha)
            if need_b:
                gb = _apply(grad_b, _laid_out(lay, 0, a), g, f_b, b_shape, b_dtype, exact, alpha)
            return ga, gb, None, None, None

        y = _apply(gemms.forward, _laid_out(lay, 0, a), _laid_out(lay, 1, b), f_out, out_shape, out_dtype, exact, alpha)
        if gate is None:
            return y, grad
        u = y  # (the backward's)
        return fused.gated_value(y, gate[1], gate[0]), grad

    return fn(a, b, f_out, f_a, f_b)
