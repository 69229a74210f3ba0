"""FP8 contractions: `fp8_einsum` and `fp8_matmul`, the rule of `einsum`
(`matmul`) with the GEMMs of `keras_scalify.backend.fp8`."""

from keras_scalify.backend import fp8
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_calibrated as _check_calibrated
from keras_scalify.ops._common import promote
from keras_scalify.ops.linalg.rules import _contract
from keras_scalify.ops.linalg.shapes import _check_out_dtype
from keras_scalify.ops.linalg.shapes import _einsum_shape
from keras_scalify.ops.linalg.shapes import _operands
from keras_scalify.ops.linalg.shapes import _parse_einsum


def _matmul_equation(a_ndim, b_ndim):
    if b_ndim != 2 or a_ndim < 1:
        raise ValueError(
            "`x2` of an FP8 matmul must be 2-D (a weight), and `x1` at least "
            f"1-D; got ranks {a_ndim} and {b_ndim}. Use fp8_einsum."
        )
    letters = "abcdefgh"[: a_ndim - 1]
    return f"{letters}k,kn->{letters}n"


def fp8_einsum(
    subscripts, x1, x2, forward_dtype="float8_e4m3fn", backward_dtype="float8_e5m2",
    route=None, out_dtype=None, calibrated=None,
):
    """`einsum` with FP8 operands: the scale rule of `einsum`; the data is
    cast (saturating) to `forward_dtype` for the GEMM, accumulated in
    float32, and the output gradient is cast to `backward_dtype` for the two
    backward GEMMs, all through `keras_scalify.backend.fp8` (route "auto",
    "native" or "simulate"). Output data in `out_dtype` (default `x1`'s
    dtype; "float32" keeps the accumulator for an epilogue that rounds
    once). `calibrated` as in `matmul`."""
    out_dtype = _check_out_dtype(out_dtype)

    ab = _operands(x1, x2)
    if ab is None:
        ab = (promote(x1, None, "x1"), promote(x2, None, "x2"))
    a, b = ab
    k = _parse_einsum(subscripts, [a.shape, b.shape])
    out_shape = _einsum_shape(subscripts, (a, b))
    _, gemms = fp8.fp8_gemms(
        subscripts.replace(" ", ""), a.shape, b.shape, forward_dtype, backward_dtype, route
    )
    out_dtype = a.dtype if out_dtype is None else out_dtype
    return _contract(
        None, [a, b], k, out_shape, gemms=gemms, out_dtype=out_dtype, quantized=True,
        calibrated=_check_calibrated(calibrated, 2),
    )


def fp8_matmul(
    x1, x2, forward_dtype="float8_e4m3fn", backward_dtype="float8_e5m2", route=None,
    out_dtype=None, calibrated=None,
):
    """`matmul` of an activation by a 2-D weight with FP8 operands (see
    `fp8_einsum`); the scale rule of `matmul`."""
    x1s = x1 if is_scaled(x1) else promote(x1, None, "x1")
    x2s = x2 if is_scaled(x2) else promote(x2, None, "x2")
    eq = _matmul_equation(len(x1s.shape), len(x2s.shape))
    return fp8_einsum(eq, x1s, x2s, forward_dtype, backward_dtype, route, out_dtype, calibrated)
