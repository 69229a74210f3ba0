"""The scaled contractions: `matmul`, `dot`, `einsum`, `conv`, and
`rebalanced_einsum` (an einsum with a pow2 rebalance folded in),
`cast_contraction` (a weight cast inside the contraction)."""

from keras import ops

from keras_scalify.backend.gemm import contraction_gemms
from keras_scalify.backend.gemm import has_float32_gemm
from keras_scalify.backend.gemm import same
from keras_scalify.backend.scalar import dtype_name
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_calibrated as _check_calibrated
from keras_scalify.ops._common import check_input
from keras_scalify.ops._common import promote
from keras_scalify.ops._common import same_dtype
from keras_scalify.ops._common import static_count
from keras_scalify.ops._common import static_dim
from keras_scalify.ops.arithmetic import multiply
from keras_scalify.ops.casting import cast_on_forward
from keras_scalify.ops.linalg.rules import _cast_data
from keras_scalify.ops.linalg.rules import _contract
from keras_scalify.ops.linalg.rules import _split_multiplier
from keras_scalify.ops.linalg.shapes import _check_out_dtype
from keras_scalify.ops.linalg.shapes import _einsum_shape
from keras_scalify.ops.linalg.shapes import _gemm_args
from keras_scalify.ops.linalg.shapes import _operands
from keras_scalify.ops.linalg.shapes import _parse_einsum
from keras_scalify.ops.linalg.shapes import _result_shape
from keras_scalify.ops.linalg.shapes import _static_k
from keras_scalify.ops.linalg.shapes import _two_operand_equation
from keras_scalify.ops.linalg.shapes import _weight_equation
from keras_scalify.ops.rescaling import check_rebalance_factor
from keras_scalify.ops.rescaling import rebalance
from keras_scalify.ops.shape import cast as _cast


def cast_contraction(subscripts, x, w, operand_dtype, calibrated=None):
    """`einsum(subscripts, x, w)` (`matmul` for `subscripts=None`) on data
    cast to the 16/32-bit `operand_dtype`, `w`'s cast inside the
    contraction: the forward GEMM takes the cast data (output in
    `operand_dtype`), and `w`'s cotangent comes back in `w`'s own dtype,
    the GEMM's float32 result times its factor, never rounded to
    `operand_dtype` on the way: a float32 master weight's gradient beyond
    float16's range (outputs ~2^20 while its grad scale is a guess) stays
    finite. `x` is cast outside (`cast_on_forward`). Rule: as `einsum`
    (`matmul`); `calibrated` as in `matmul`."""
    operand_dtype = _check_out_dtype(operand_dtype)
    x = cast_on_forward(x, operand_dtype)
    a = x if is_scaled(x) else promote(x, w, "x")
    b = w if is_scaled(w) else promote(w, a, "w")
    if dtype_name(b.dtype) == operand_dtype:
        return _einsum(subscripts, (a, b), None, calibrated, None, None) if subscripts else matmul(
            a, b, calibrated=calibrated
        )
    if subscripts is None:
        subscripts = _weight_equation(a, b)
        if subscripts is None:
            raise ValueError(f"`w` must be 2-D for a matmul, got shape {tuple(b.shape)}.")
    subscripts = subscripts.replace(" ", "")
    k = _parse_einsum(subscripts, [a.shape, b.shape])
    out_shape = _einsum_shape(subscripts, (a, b))
    calibrated = _check_calibrated(calibrated, 2)
    equation = _two_operand_equation(subscripts, (a, b))
    if equation is not None and has_float32_gemm(operand_dtype):
        gemms = contraction_gemms(equation, tuple(static_dim(d) for d in b.shape))
        gemms = gemms._replace(quantize=(same, lambda d: _cast_data(d, operand_dtype), same))
        return _contract(
            None, [a, b], k, out_shape, gemms=gemms, out_dtype=operand_dtype, quantized=True,
            calibrated=calibrated,
        )

    def fn(*datas):
        return ops.einsum(subscripts, *datas)

    return _contract(fn, [a, b], k, out_shape, calibrated=calibrated, operand_dtype=operand_dtype)


def matmul(x1, x2, *, calibrated=None):
    """Rule: `s = sa·sb·P(sqrt(K))`, `d = (a @ b)/P(sqrt(K))`, K = x1.shape[-1].

    Example: `(3,5)·2 @ (5,2)·4` → scale 16 (2·4·P(√5)=2), data 2.5 for ones.
    `calibrated` (keyword, ours): one bool per operand, false where its grad
    scale is not a measurement (`ScaledVariable.calibrated`); it does not
    vote for the output's grad scale (`ops._common.votes`).
    """
    ab = _operands(x1, x2)
    if ab is None:
        return ops.matmul(x1, x2)
    a, b = ab
    out_shape = _result_shape(("matmul",), ops.matmul, (a, b))
    return _contract(
        ops.matmul, [a, b], _static_k(a.data, "x1"), out_shape,
        calibrated=_check_calibrated(calibrated, 2),
        **_gemm_args(_weight_equation(a, b), a, b),
    )


def dot(x1, x2):
    """Rule: as `matmul`, K = x1.shape[-1] (NumPy `dot` semantics)."""
    ab = _operands(x1, x2)
    if ab is None:
        return ops.dot(x1, x2)
    a, b = ab
    out_shape = _result_shape(("dot",), ops.dot, (a, b))
    return _contract(
        ops.dot, [a, b], _static_k(a.data, "x1"), out_shape,
        **_gemm_args(_weight_equation(a, b), a, b),
    )


def rebalanced_einsum(subscripts, a, b, factor, out_dtype=None):
    """`rebalance(einsum(subscripts, a, b, out_dtype=out_dtype), factor)`
    for a static power of two `factor`: where the GEMMs of
    `ops/_gemm.py` run the contraction, the factor joins the forward
    GEMM's (no node and no pass of its own, forward or backward);
    composed otherwise. The same scales and data bit for bit (a pow2
    factor commutes with rounding), except that a narrow output that the
    composition would overflow or flush before the factor is rounded
    once, after it."""
    check_rebalance_factor(factor)
    if not (is_scaled(a) or is_scaled(b)):
        return rebalance(einsum(subscripts, a, b, out_dtype=out_dtype), factor)
    return _einsum(subscripts, (a, b), out_dtype, None, None, factor)


def einsum(subscripts, *operands, out_dtype=None, calibrated=None, multiplier=None):
    """Rule: `s = Π s_i · P(sqrt(K))`, `d = einsum(data)/P(sqrt(K))`.

    K is the product of the sizes of the indices summed out (in an input,
    not in the output). `out_dtype` (ScaledTensor operands): the data dtype
    of the result, default the operands' result dtype; "float32" keeps the
    GEMM's float32 accumulator for float32 work that follows. `calibrated`:
    as in `matmul`. `multiplier` (ours; a finite nonzero Python number
    `k = m·P(k)`): the result is `multiply(einsum(...), k)`, with that
    rule's scales (`s·P(k)`, `g/P(k)`); where the two-operand GEMMs run as
    one custom gradient, `m` joins their factors (no pass of its own, each
    way: attention's `1/sqrt(d)`).
    """
    return _einsum(subscripts, operands, out_dtype, calibrated, multiplier, None)


def _einsum(subscripts, operands, out_dtype, calibrated, multiplier, out_factor):
    """`einsum`, then `rebalance(·, out_factor)` unless `out_factor` is None
    (`rebalanced_einsum`)."""
    if not isinstance(subscripts, str):
        raise TypeError(f"`subscripts` must be a string, got {subscripts!r}.")
    for i, x in enumerate(operands):
        check_input(f"operands[{i}]", x)
    out_dtype = _check_out_dtype(out_dtype)
    _split_multiplier(multiplier)  # checks it early
    if not any(is_scaled(x) for x in operands):
        out = ops.einsum(subscripts, *operands)
        out = out if multiplier is None else ops.multiply(out, multiplier)
        return out if out_dtype is None else ops.cast(out, out_dtype)
    like = next(x for x in operands if is_scaled(x))
    xs = same_dtype([promote(x, like, f"operands[{i}]") for i, x in enumerate(operands)])
    k = _parse_einsum(subscripts, [x.shape for x in xs])
    out_shape = _einsum_shape(subscripts, xs)

    def fn(*datas):
        return ops.einsum(subscripts, *datas)

    extra = _gemm_args(_two_operand_equation(subscripts, xs), *xs) if len(xs) == 2 else {}
    if extra and out_dtype is not None:
        extra["out_dtype"] = out_dtype
    calibrated = _check_calibrated(calibrated, len(xs))
    folded = multiplier if "gemms" in extra else None
    rebalanced = out_factor if "gemms" in extra else None
    out = _contract(
        fn, xs, k, out_shape, calibrated=calibrated, multiplier=folded, out_factor=rebalanced, **extra
    )
    if out_dtype is not None and out.dtype != out_dtype:
        out = _cast(out, out_dtype)
    if multiplier is not None and folded is None:
        out = multiply(out, multiplier)
    if out_factor is not None and rebalanced is None:
        out = rebalance(out, out_factor)
    return out


def conv(
    inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1, *,
    calibrated=None, operand_dtype=None,
):
    """Rule: as `matmul`, K the kernel's fan-in (`prod(kernel.shape[:-1])`,
    window × input channels per group): `s = sx·sw·P(sqrt(K))`,
    `d = conv(data)/P(sqrt(K))`. Arguments as `keras.ops.conv`;
    `calibrated` as in `matmul`. `operand_dtype` (keyword, ours): a
    16/32-bit float the convolution takes its data in, the kernel cast
    inside, its cotangent returned in its own dtype (`cast_contraction`)."""
    check_input("inputs", inputs)
    check_input("kernel", kernel)
    if not (is_scaled(inputs) or is_scaled(kernel)):
        return ops.conv(inputs, kernel, strides, padding, data_format, dilation_rate)
    like = inputs if is_scaled(inputs) else kernel
    operands = [promote(inputs, like, "inputs"), promote(kernel, like, "kernel")]
    if operand_dtype is None:
        x, w = same_dtype(operands)
    else:
        operand_dtype = _check_out_dtype(operand_dtype)
        x, w = cast_on_forward(operands[0], operand_dtype), operands[1]
    k = static_count(w.shape[:-1])

    def fn(a, b):
        return ops.conv(a, b, strides, padding, data_format, dilation_rate)

    out_shape = _result_shape(
        ("conv", repr((strides, padding, data_format, dilation_rate))), fn, (x, w)
    )
    return _contract(
        fn, [x, w], k, out_shape, calibrated=_check_calibrated(calibrated, 2),
        operand_dtype=operand_dtype,
    )
