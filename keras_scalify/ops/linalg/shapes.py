"""What a contraction reads of its operands: argument checks, result
shapes (Keras's shape inference, memoized), einsum parsing (the contracted
size K), and the equations the one-custom-gradient GEMMs of
`ops/_gemm.py` run (`_gemm_args`)."""

import functools
import string

import keras
from keras import ops

from keras_scalify.backend.gemm import contraction_gemms
from keras_scalify.backend.gemm import grad_equations
from keras_scalify.backend.gemm import has_float32_gemm
from keras_scalify.core.formats import FP8_DTYPES
from keras_scalify.core.formats import get_format
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_input
from keras_scalify.ops._common import promote
from keras_scalify.ops._common import result_dtype
from keras_scalify.ops._common import same_dtype
from keras_scalify.ops._common import static_dim


def _check_out_dtype(out_dtype):
    """`out_dtype` as a format name (None stays None); FP8 is refused."""
    if out_dtype is None:
        return None
    name = get_format(out_dtype).name
    if name in FP8_DTYPES:
        raise ValueError(f"`out_dtype` must be a 16/32-bit float, got {name}.")
    return name


def _operands(x1, x2):
    check_input("x1", x1)
    check_input("x2", x2)
    if not (is_scaled(x1) or is_scaled(x2)):
        return None
    like = x1 if is_scaled(x1) else x2
    return tuple(same_dtype([promote(x1, like, "x1"), promote(x2, like, "x2")]))


def _static_k(x, name):
    k = static_dim(x.shape[-1]) if len(x.shape) else 1
    if k is None:
        raise ValueError(
            f"`{name}` needs a static contracted dimension for its scale rule; "
            f"got shape {tuple(x.shape)}."
        )
    return int(k)


def _spec(x):
    return keras.KerasTensor(
        tuple(static_dim(d) for d in x.shape), dtype=x.dtype
    )


# Keras's shape inference on KerasTensors costs 0.1-0.5 ms per call (a
# symbolic einsum ~0.5 ms: more than a small GEMM); results are memoized per
# operation and static input shapes.
_RESULT_SHAPES = {}
_RESULT_SHAPES_MAX = 4096


def _result_shape(key, fn, xs):
    """`fn(*specs of xs).shape` for the operation named by `key` (a hashable
    tuple that fixes everything but the shapes), memoized."""
    shapes = tuple(tuple(static_dim(d) for d in x.shape) for x in xs)
    out = _RESULT_SHAPES.get((key, shapes))
    if out is None:
        if len(_RESULT_SHAPES) >= _RESULT_SHAPES_MAX:
            _RESULT_SHAPES.clear()
        out = tuple(fn(*[_spec(x) for x in xs]).shape)
        _RESULT_SHAPES[(key, shapes)] = out
    return out


def _einsum_shape(subscripts, xs):
    return _result_shape(("einsum", subscripts), lambda *a: ops.einsum(subscripts, *a), xs)


def _parse_einsum(subscripts, shapes):
    """The contracted size K of `einsum(subscripts)` on operands of these
    shapes (memoized by the static shapes)."""
    return _contracted_size(subscripts, tuple(tuple(static_dim(d) for d in s) for s in shapes))


@functools.lru_cache(maxsize=1024)
def _contracted_size(subscripts, shapes):
    subs = subscripts.replace(" ", "")
    if "->" in subs:
        ins, out = subs.split("->")
    else:
        ins, out = subs, None
    ins = ins.split(",")
    if len(ins) != len(shapes):
        raise ValueError(
            f"`subscripts` {subscripts!r} names {len(ins)} operands, got "
            f"{len(shapes)}."
        )
    sizes = {}
    free = iter(c for c in string.ascii_uppercase[::-1])
    for term, shape in zip(ins, shapes):
        letters = _expand_ellipsis(term, len(shape), free)
        for c, d in zip(letters, shape):
            sizes[c] = d
    counts = {}
    for term in ins:
        for c in term.replace("...", ""):
            counts[c] = counts.get(c, 0) + 1
    if out is None:
        out = "".join(sorted(c for c, n in counts.items() if n == 1))
    contracted = [c for c in counts if c not in out]
    k = 1
    for c in contracted:
        if static_dim(sizes[c]) is None:
            raise ValueError(
                f"einsum needs a static size for contracted index {c!r}."
            )
        k *= int(sizes[c])
    return k


def _expand_ellipsis(term, ndim, free):
    if "..." not in term:
        return term
    n = ndim - (len(term) - 3)
    return term.replace("...", "".join(next(free) for _ in range(n)))


def _weight_equation(a, b):
    """The einsum equation of `a @ b` for a 2-D `b` (None otherwise)."""
    if len(b.shape) != 2 or not 1 <= len(a.shape) <= 9:
        return None
    return "abcdefgh"[: len(a.shape) - 1] + "k,kn->" + "abcdefgh"[: len(a.shape) - 1] + "n"


def _two_operand_equation(subscripts, xs):
    """`subscripts` when the GEMMs of `ops/_gemm.py` can run it: explicit
    output, no ellipsis, every index in the other operand or the output,
    no broadcasting of size-1 dims (memoized by the static shapes)."""
    return _gemm_equation(subscripts, tuple(tuple(static_dim(d) for d in x.shape) for x in xs))


@functools.lru_cache(maxsize=1024)
def _gemm_equation(subscripts, shapes):
    subs = subscripts.replace(" ", "")
    if "->" not in subs or "." in subs:
        return None
    try:
        grad_equations(subs)
    except ValueError:
        return None
    sizes = {}
    for term, shape in zip(subs.split("->")[0].split(","), shapes):
        if len(term) != len(shape):
            return None
        for c, d in zip(term, shape):
            if sizes.setdefault(c, d) != d:
                return None
    return subs


def _gemm_args(equation, a, b):
    """`_contract` arguments for the one-custom-gradient GEMMs, or none
    when the equation or the dtypes need the generic path."""
    if equation is None or not has_float32_gemm(a.data, b.data):
        return {}
    gemms = contraction_gemms(equation, tuple(static_dim(d) for d in b.shape))
    return {"gemms": gemms, "out_dtype": result_dtype(a.data, b.data)}
