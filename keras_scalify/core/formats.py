"""Floating-point formats and saturating casts.

`FORMATS[name]` gives `max`, `smallest_normal` and `smallest_subnormal` for
`float8_e4m3fn`, `float8_e5m2`, `float16`, `bfloat16` and `float32`.
`saturating_cast(x, dtype)` clips finite values to `±max` before casting,
on every backend: without the clip, e4m3fn overflow is NaN in JAX,
TensorFlow and ml_dtypes but ±448 in torch, and e5m2/float16 overflow is
±inf. Non-finite values are never clipped: a fault upstream stays a fault.
"""

import collections

import ml_dtypes
import numpy as np
from keras import ops

from keras_scalify.backend import scalar as S
from keras_scalify.backend.scalar import dtype_name

FloatFormat = collections.namedtuple(
    "FloatFormat", ["name", "max", "smallest_normal", "smallest_subnormal"]
)


def _format(name, np_dtype):
    info = ml_dtypes.finfo(np_dtype)
    return FloatFormat(
        name,
        float(info.max),
        float(info.smallest_normal),
        float(info.smallest_subnormal),
    )


FORMATS = {
    "float8_e4m3fn": _format("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
    "float8_e5m2": _format("float8_e5m2", ml_dtypes.float8_e5m2),
    "float16": _format("float16", np.float16),
    "bfloat16": _format("bfloat16", ml_dtypes.bfloat16),
    "float32": _format("float32", np.float32),
}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")


def get_format(dtype):
    """The `FloatFormat` of `dtype` (a name or a backend dtype)."""
    name = dtype_name(dtype)
    if name not in FORMATS:
        raise ValueError(
            f"Unsupported format dtype={dtype!r}; expected one of "
            f"{sorted(FORMATS)}."
        )
    return FORMATS[name]


def _has_inf(fmt):
    """Whether the format encodes ±inf (every one here but e4m3fn)."""
    return fmt.name != "float8_e4m3fn"


def _keep_nonfinite(x, clipped, fmt):
    """`clipped` where `x` is finite; elsewhere `x` (±inf, NaN), or NaN in a
    format without inf (torch would cast inf to e4m3fn as ±448).

    `clipped - (x - x)` is `clipped` for finite `x` (-0 included) and NaN
    where `x` is ±inf or NaN, whatever the clip made of those: two
    elementwise passes (a select on `isfinite` took five on eager torch,
    where every pass is a kernel); formats with inf then put ±inf back."""
    out = clipped - (x - x)
    if _has_inf(fmt):
        out = ops.where(ops.isinf(x), x, out)
    return out


def saturating_cast(x, dtype):
    """Cast `x` to `dtype`, clipping finite values to the format's `±max`.

    Only finite overflow saturates: NaN stays NaN, ±inf stays ±inf (NaN in
    e4m3fn, which has no inf), so that a fault upstream reaches the
    optimizer's skip check. The clip is done in float32 (or in the input
    dtype when that is wider than float32). A cast to a format of wider
    range (float16 -> float32, E4M3 -> E5M2) cannot overflow and is a plain
    cast: no clip pass.
    """
    fmt = get_format(dtype)
    x = ops.convert_to_tensor(x)
    src = dtype_name(x.dtype)
    if src in FORMATS and FORMATS[src].max < fmt.max:
        if src in FP8_DTYPES and fmt.name != "float32":
            x = ops.cast(x, "float32")  # FP8 casts go through float32
        return ops.cast(x, fmt.name)
    owned = src not in ("float32", "float64")
    if owned:
        # Every narrower format's max fits in float32: clip there (FP8
        # casts go through float32).
        x = ops.cast(x, "float32")
    if owned and not _has_inf(fmt):
        # The float32 copy is ours: clipped in place (eager torch: two
        # weight-sized temporaries fewer per cast).
        nonfinite = x - x
        x = S.subtract_in_place(S.clip_in_place(x, -fmt.max, fmt.max), nonfinite)
    else:
        x = _keep_nonfinite(x, S.clip(x, -fmt.max, fmt.max), fmt)
    return ops.cast(x, fmt.name)


# Formats `saturating_round` handles: their subnormal spacing and its
# reciprocal are float32 normals (not so for bfloat16).
_ROUNDABLE = ("float8_e4m3fn", "float8_e5m2", "float16")


def saturating_round(x, dtype):
    """The float32 values of `saturating_cast(x, dtype)`, bit for bit, in
    float32 arithmetic (no FP8 tensor is formed).

    Clip finite values to `±max`, then round |x| to nearest-even on the format's grid:
    normals by rounding the float32 bit pattern to `m` mantissa bits
    (add `2^(22-m) - 1` plus the kept lowest bit, clear the low bits),
    subnormals by `round(|x| / q) * q` with `q` the subnormal spacing; the
    sign is copied back, non-finite values kept as by `saturating_cast`. XLA on CPU turns these into a few
    vector instructions, where its FP8 conversions take several times
    longer. `dtype`: float8_e4m3fn, float8_e5m2 or float16.
    """
    name = dtype_name(dtype)
    if name not in _ROUNDABLE:
        raise ValueError(
            f"saturating_round supports dtype in {sorted(_ROUNDABLE)}; got "
            f"dtype={dtype!r}."
        )
    fmt = FORMATS[name]
    q = fmt.smallest_subnormal  # the subnormal spacing
    m = int(np.log2(fmt.smallest_normal / q))  # mantissa bits
    fmax = fmt.max
    x0 = ops.cast(x, "float32")
    x = S.clip(x0, -fmax, fmax)
    a = ops.abs(x)
    shift = 23 - m
    bits = ops.view(a, "int32")
    lowest_kept = ops.bitwise_and(ops.right_shift(bits, shift), 1)
    bits = bits + ((1 << (shift - 1)) - 1) + lowest_kept
    normal = ops.view(ops.bitwise_and(bits, -(1 << shift)), "float32")
    subnormal = ops.round(a * (1.0 / q)) * q
    r = ops.where(a < fmt.smallest_normal, subnormal, normal)
    # The sign copied back as a bit (r's is clear): a float negation or a
    # sign test can lose -0 (seen under torch.compile on an H100).
    sign = ops.bitwise_and(ops.view(x, "int32"), -(2**31))
    r = ops.view(ops.bitwise_or(ops.view(r, "int32"), sign), "float32")
    return _keep_nonfinite(x0, r, fmt)
