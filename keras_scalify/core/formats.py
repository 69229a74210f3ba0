"""Floating-point formats and saturating casts.

`FORMATS[name]` gives `max`, `smallest_normal` and `smallest_subnormal` for
`float8_e4m3fn`, `float8_e5m2`, `float16`, `bfloat16` and `float32`.
`saturating_cast(x, dtype)` clips to `±max` before casting, on every
backend: without the clip, e4m3fn overflow is NaN in JAX, TensorFlow and
ml_dtypes but ±448 in torch, and e5m2/float16 overflow is ±inf.
"""

import collections

import ml_dtypes
import numpy as np
from keras import ops
from keras.src.backend import standardize_dtype

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
    name = standardize_dtype(dtype)
    if name not in FORMATS:
        raise ValueError(
            f"Unsupported format dtype={dtype!r}; expected one of "
            f"{sorted(FORMATS)}."
        )
    return FORMATS[name]


def saturating_cast(x, dtype):
    """Cast `x` to `dtype`, clipping to the format's `±max` first.

    NaN stays NaN; ±inf becomes ±max. The clip is done in float32 (or in
    the input dtype when that is wider than float32). A cast to a format of
    wider range (float16 -> float32, E4M3 -> E5M2) cannot overflow and is
    a plain cast: no clip pass, ±inf stays ±inf.
    """
    fmt = get_format(dtype)
    x = ops.convert_to_tensor(x)
    src = standardize_dtype(x.dtype)
    if src in FORMATS and FORMATS[src].max < fmt.max:
        if src in FP8_DTYPES and fmt.name != "float32":
            x = ops.cast(x, "float32")  # FP8 casts go through float32
        return ops.cast(x, fmt.name)
    if src in FP8_DTYPES:
        x = ops.cast(x, "float32")
        src = "float32"
    if src not in ("float32", "float64"):
        # Every narrower format's max fits in float32: clip there.
        x = ops.cast(x, "float32")
    x = ops.clip(x, -fmt.max, fmt.max)
    return ops.cast(x, fmt.name)
