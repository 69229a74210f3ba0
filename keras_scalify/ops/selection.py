"""Scale rules of selections: maximum, minimum, where, clip, concatenate, stack.

Rule: `s = max(s_i)` and each input rescaled to it, `d_i·s_i/s`; gradient
scale `g = mean(g_i)`. A static 0 or ±inf (any scale represents it) takes
the other operand's scale, so `where(mask, x, 0)` and `maximum(x, 0)` keep
`x`'s scale; a zero tensor (scale 0) does the same through `max`.
"""

from keras import ops

from keras_scalify.backend import scalar as S
from keras_scalify.core.scaled_tensor import ScaledTensor
from keras_scalify.core.scaled_tensor import is_scaled
from keras_scalify.ops._common import check_input
from keras_scalify.ops._common import is_anyscale
from keras_scalify.ops._common import pow2_max
from keras_scalify.ops._common import pow2_mean
from keras_scalify.ops._common import promote
from keras_scalify.ops._common import rescale
from keras_scalify.ops._common import safe_div
from keras_scalify.ops._common import scalars


def _common_scale(xs, names):
    """Rescale every operand to the max scale; static 0/inf pass as is."""
    for x, n in zip(xs, names):
        check_input(n, x)
    like = next(x for x in xs if is_scaled(x))
    scaled = [promote(x, like, n) for x, n in zip(xs, names) if not is_anyscale(x)]
    sc = [scalars(x) for x in scaled]
    s = pow2_max(*[s_i for s_i, _ in sc])
    g = pow2_mean(*[g_i for _, g_i in sc])
    datas, it = [], iter(zip(scaled, sc))
    for x in xs:
        if is_anyscale(x):
            datas.append(float(x))
            continue
        xi, (s_i, g_i) = next(it)
        datas.append(rescale(xi.data, safe_div(s_i, s), safe_div(g, g_i)))
    return datas, s, g, like


def _constant(c, like_data):
    return S.full_scalar(c, like_data) if isinstance(c, float) else c


def _binary(fn, x1, x2):
    (a, b), s, g, like = _common_scale([x1, x2], ["x1", "x2"])
    ref = a if not isinstance(a, float) else b
    return ScaledTensor(fn(_constant(a, ref), _constant(b, ref)), s, g)


def maximum(x1, x2):
    """Rule: `s = max(sa, sb)`, `d = max(a·sa/s, b·sb/s)`; static 0 keeps the other scale."""
    if not (is_scaled(x1) or is_scaled(x2)):
        return ops.maximum(x1, x2)
    return _binary(ops.maximum, x1, x2)


def minimum(x1, x2):
    """Rule: `s = max(sa, sb)`, `d = min(a·sa/s, b·sb/s)`; static 0 keeps the other scale."""
    if not (is_scaled(x1) or is_scaled(x2)):
        return ops.minimum(x1, x2)
    return _binary(ops.minimum, x1, x2)


def where(condition, x1, x2):
    """Rule: `s = max(sa, sb)`, `d = where(c, a·sa/s, b·sb/s)`; `where(c, x, 0)` keeps `x`'s scale.

    `condition` is a plain boolean tensor.
    """
    if is_scaled(condition):
        raise TypeError("`condition` must be a plain boolean tensor.")
    if not (is_scaled(x1) or is_scaled(x2)):
        return ops.where(condition, x1, x2)
    return _binary(lambda a, b: ops.where(condition, a, b), x1, x2)


def clip(x, x_min, x_max):
    """Rule: `minimum(maximum(x, x_min), x_max)`: the max of the scales."""
    if not is_scaled(x):
        return ops.clip(x, x_min, x_max)
    return minimum(maximum(x, x_min), x_max)


def concatenate(xs, axis=0):
    """Rule: `s = max(s_i)`, `d = concat(d_i·s_i/s)`; `g = mean(g_i)`.

    Example: scales (0.5, 2) → scale 2, the first block's data × 0.25.
    """
    xs = list(xs)
    if not any(is_scaled(x) for x in xs):
        return ops.concatenate(xs, axis=axis)
    datas, s, g, _ = _common_scale(xs, [f"xs[{i}]" for i in range(len(xs))])
    return ScaledTensor(ops.concatenate(datas, axis=axis), s, g)


def stack(x, axis=0):
    """Rule: `s = max(s_i)`, `d = stack(d_i·s_i/s)`; `g = mean(g_i)`."""
    xs = list(x)
    if not any(is_scaled(t) for t in xs):
        return ops.stack(xs, axis=axis)
    datas, s, g, _ = _common_scale(xs, [f"x[{i}]" for i in range(len(xs))])
    return ScaledTensor(ops.stack(datas, axis=axis), s, g)
