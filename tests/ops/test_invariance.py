"""Float32 invariance: every scaled op computes the plain Keras op's values.

For each op exported by `keras_scalify.ops`, inputs are ScaledTensors with
float32 data and scales 2**k; `to_array(ksc.ops.f(scaled))` must equal
`keras.ops.f(represented values)` to rtol 1e-6 (`assert_close`, with its
absolute floor of 1e-6·max|expected| for values that cancel near 0), eagerly
and compiled. Power-of-two rescalings commute with float32 rounding, so the
two computations round identically wherever no value leaves float32's
normal range.

Each table row: (name, fn_scaled, fn_plain, inputs[, rtol]). `inputs` lists
input kinds (see `build`); the scaled and plain functions take the same
positional operands, ScaledTensors for one and their values for the other.
"""

import math

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from keras_scalify import backend as kb
from tests.conftest import assert_close
from tests.conftest import scale_of
from tests.conftest import to_np

kops = ksc.ops
K_VALUES = [-20, -7, 0, 9, 20]
# Exponent of the second operand's scale: mixes scales (and equal scales at 9).
K2 = {-20: 5, -7: -20, 0: 3, 9: 9, 20: -7}

SHAPE = (4, 8)
_MASK = np.random.default_rng(7).random(SHAPE) < 0.5
_IDX = np.array([3, 0, 2, 3, 1])


# --------------------------------------------------------------------------
# Input kinds. Each gives (data, exponent) for the scale-exponent k.
#   n / n2 : data N(0,1), scale 2**k / 2**K2[k]
#   p / p2 : data |N(0,1)| + 1/4 (positive), scale 2**k / 2**K2[k]
#   u      : *value* 2·N(0,1) at every k (data = value·2**-k, scale 2**k),
#            for functions whose interesting range is O(1) (exp, tanh, ...)
#   tie    : scale 2**K2[k]; half its values equal the previous operand's
#            values exactly (for comparisons)
# A kind may carry a shape: ("n", (8, 16)).
# --------------------------------------------------------------------------


def _one(kind, shape, rng, k, prev):
    if kind == "n":
        return rng.standard_normal(shape), k
    if kind == "n2":
        return rng.standard_normal(shape), K2[k]
    if kind == "p":
        return np.abs(rng.standard_normal(shape)) + 0.25, k
    if kind == "p2":
        return np.abs(rng.standard_normal(shape)) + 0.25, K2[k]
    if kind == "u":
        v = 2.0 * rng.standard_normal(shape).astype(np.float32)
        return v * 2.0**-k, k
    if kind == "tie":
        d_prev, k_prev = prev
        tied = d_prev * 2.0 ** (k_prev - K2[k])
        other = np.round(rng.standard_normal(shape) * 4) / 4 * 2.0 ** (k_prev - K2[k])
        return np.where(_MASK, tied, other), K2[k]
    raise ValueError(kind)


def build(inputs, rng, k):
    """ScaledTensors and the plain tensors of their represented values."""
    scaled, plain, prev = [], [], None
    for spec in inputs:
        kind, shape = (spec, SHAPE) if isinstance(spec, str) else spec
        data, e = _one(kind, shape, rng, k, prev)
        data = np.asarray(data, np.float32)
        prev = (data, e)
        scale = np.float32(2.0**e)
        value = data * scale  # exact: pow2 multiply, values stay normal
        assert np.all(np.isfinite(value))
        scaled.append(ksc.as_scaled(data, scale))
        plain.append(keras.ops.convert_to_tensor(value))
    return scaled, plain


# --------------------------------------------------------------------------
# The table.
# --------------------------------------------------------------------------


def _pair(name):
    return (name, getattr(kops, name), getattr(keras.ops, name), ["n", "n2"])


def _unary(name, kind="n"):
    return (name, getattr(kops, name), getattr(keras.ops, name), [kind])


def _cmp(name):
    return (name, getattr(kops, name), getattr(keras.ops, name), ["n", "tie"], "bool")


TABLE = [
    # arithmetic
    _pair("add"),
    _pair("subtract"),
    _pair("multiply"),
    ("divide", kops.divide, keras.ops.divide, ["n", "p2"]),
    ("add_scalar_1.5", lambda x: kops.add(x, 1.5), lambda x: keras.ops.add(x, 1.5), ["n"]),
    ("subtract_from_scalar_3.0", lambda x: kops.subtract(3.0, x), lambda x: keras.ops.subtract(3.0, x), ["n"]),
    ("multiply_scalar_0.1", lambda x: kops.multiply(x, 0.1), lambda x: keras.ops.multiply(x, 0.1), ["n"]),
    ("multiply_scalar_-3.0", lambda x: kops.multiply(-3.0, x), lambda x: keras.ops.multiply(-3.0, x), ["n"]),
    ("divide_by_scalar_3.0", lambda x: kops.divide(x, 3.0), lambda x: keras.ops.divide(x, 3.0), ["n"]),
    ("add_plain_tensor", lambda x, y: kops.add(x, ksc.to_array(y)), keras.ops.add, ["n", "n2"]),
    ("matmul_plain_tensor", lambda x, y: kops.matmul(ksc.to_array(x), y), keras.ops.matmul, ["n", ("n2", (8, 16))]),
    _unary("negative"),
    _unary("abs"),
    _unary("square"),
    _unary("sqrt", "p"),
    ("power_2", lambda x: kops.power(x, 2), lambda x: keras.ops.power(x, 2), ["n"]),
    ("power_3", lambda x: kops.power(x, 3), lambda x: keras.ops.power(x, 3), ["n"]),
    # contractions
    ("matmul", kops.matmul, keras.ops.matmul, ["n", ("n2", (8, 16))]),
    ("matmul_batched", kops.matmul, keras.ops.matmul, [("n", (2, 4, 8)), ("n2", (2, 8, 4))]),
    ("dot_matrix_vector", kops.dot, keras.ops.dot, ["n", ("n2", (8,))]),
    ("dot_matrices", kops.dot, keras.ops.dot, ["n", ("n2", (8, 4))]),
    (
        "einsum_bij_bjk",
        lambda a, b: kops.einsum("bij,bjk->bik", a, b),
        lambda a, b: keras.ops.einsum("bij,bjk->bik", a, b),
        [("n", (2, 4, 8)), ("n2", (2, 8, 4))],
    ),
    (
        "einsum_bhqd_bhkd",
        lambda q, k: kops.einsum("bhqd,bhkd->bhqk", q, k),
        lambda q, k: keras.ops.einsum("bhqd,bhkd->bhqk", q, k),
        [("n", (1, 2, 4, 8)), ("n2", (1, 2, 4, 8))],
    ),
    (
        "conv",
        lambda x, w: kops.conv(x, w, padding="same"),
        lambda x, w: keras.ops.conv(x, w, padding="same"),
        [("n", (2, 6, 5, 3)), ("n2", (3, 3, 3, 4))],
    ),
    # reductions
    ("sum_all", kops.sum, keras.ops.sum, ["n"]),
    ("sum_axis1", lambda x: kops.sum(x, axis=1), lambda x: keras.ops.sum(x, axis=1), ["n"]),
    ("mean_all", kops.mean, keras.ops.mean, ["n"]),
    (
        "mean_axis0_keepdims",
        lambda x: kops.mean(x, axis=0, keepdims=True),
        lambda x: keras.ops.mean(x, axis=0, keepdims=True),
        ["n"],
    ),
    ("max_axis1", lambda x: kops.max(x, axis=1), lambda x: keras.ops.max(x, axis=1), ["n"]),
    ("min_all", kops.min, keras.ops.min, ["n"]),
    # selections
    _pair("maximum"),
    _pair("minimum"),
    ("maximum_static_zero", lambda x: kops.maximum(x, 0.0), lambda x: keras.ops.maximum(x, 0.0), ["n"]),
    (
        "where",
        lambda a, b: kops.where(_MASK, a, b),
        lambda a, b: keras.ops.where(_MASK, a, b),
        ["n", "n2"],
    ),
    (
        "where_static_zero",
        lambda a: kops.where(_MASK, a, 0.0),
        lambda a: keras.ops.where(_MASK, a, 0.0),
        ["n"],
    ),
    ("clip", lambda x: kops.clip(x, -1.0, 1.5), lambda x: keras.ops.clip(x, -1.0, 1.5), ["u"]),
    (
        "concatenate",
        lambda a, b: kops.concatenate([a, b], axis=0),
        lambda a, b: keras.ops.concatenate([a, b], axis=0),
        ["n", ("n2", (2, 8))],
    ),
    (
        "stack",
        lambda a, b: kops.stack([a, b], axis=1),
        lambda a, b: keras.ops.stack([a, b], axis=1),
        ["n", "n2"],
    ),
    # shape, indexing, dtype
    ("reshape", lambda x: kops.reshape(x, (8, 4)), lambda x: keras.ops.reshape(x, (8, 4)), ["n"]),
    ("transpose", kops.transpose, keras.ops.transpose, ["n"]),
    ("expand_dims", lambda x: kops.expand_dims(x, 1), lambda x: keras.ops.expand_dims(x, 1), ["n"]),
    ("squeeze", lambda x: kops.squeeze(x, 1), lambda x: keras.ops.squeeze(x, 1), [("n", (4, 1, 8))]),
    (
        "slice",
        lambda x: kops.slice(x, (1, 2), (2, 4)),
        lambda x: keras.ops.slice(x, (1, 2), (2, 4)),
        ["n"],
    ),
    (
        "take",
        lambda x: kops.take(x, _IDX, axis=0),
        lambda x: keras.ops.take(x, _IDX, axis=0),
        ["n"],
    ),
    ("cast_float32", lambda x: kops.cast(x, "float32"), lambda x: keras.ops.cast(x, "float32"), ["n"]),
    # float16 rounding of the *data*: the value keeps float16's relative
    # precision at every scale (plain keras.ops.cast would overflow at 2**20;
    # see test_cast_float16_equals_keras_cast_in_float16_range).
    ("cast_float16", lambda x: kops.cast(x, "float16"), lambda x: x, ["n"], 2.0**-11),
    # transcendental functions
    _unary("exp", "u"),
    _unary("log", "p"),
    _unary("tanh", "u"),
    _unary("sigmoid", "u"),
    _unary("erf", "u"),
    # activations
    _unary("relu"),
    ("gelu_tanh", lambda x: kops.gelu(x, approximate=True), lambda x: keras.ops.gelu(x, approximate=True), ["n"]),
    ("gelu_erf", lambda x: kops.gelu(x, approximate=False), lambda x: keras.ops.gelu(x, approximate=False), ["n"]),
    ("gelu_tanh_unit_values", lambda x: kops.gelu(x), lambda x: keras.ops.gelu(x), ["u"]),
    _unary("silu"),
    # softmax family and normalizations
    _unary("softmax", "u"),
    ("softmax_axis0", lambda x: kops.softmax(x, axis=0), lambda x: keras.ops.softmax(x, axis=0), ["u"]),
    _unary("log_softmax", "u"),
    ("logsumexp", kops.logsumexp, keras.ops.logsumexp, ["u"]),
    (
        "logsumexp_axis1",
        lambda x: kops.logsumexp(x, axis=1),
        lambda x: keras.ops.logsumexp(x, axis=1),
        ["n"],
    ),
    _unary("layer_normalization"),
    (
        "layer_normalization_eps_1e-3",
        lambda x: kops.layer_normalization(x, epsilon=1e-3),
        lambda x: keras.ops.layer_normalization(x, epsilon=1e-3),
        ["n"],
    ),
    _unary("rms_normalization"),
    (
        "rms_normalization_eps_1e-3",
        lambda x: kops.rms_normalization(x, epsilon=1e-3),
        lambda x: keras.ops.rms_normalization(x, epsilon=1e-3),
        ["n"],
    ),
    # what keras-hub blocks call (rotary embeddings, RMS norms, GQA)
    _unary("rsqrt", "p"),
    _unary("reciprocal", "p"),
    _unary("sin", "u"),
    _unary("cos", "u"),
    ("var_all", kops.var, keras.ops.var, ["n"]),
    (
        "var_axis1_keepdims",
        lambda x: kops.var(x, axis=1, keepdims=True),
        lambda x: keras.ops.var(x, axis=1, keepdims=True),
        ["n"],
    ),
    ("split", lambda x: kops.split(x, 2, axis=1)[1], lambda x: keras.ops.split(x, 2, axis=1)[1], ["n"]),
    ("repeat", lambda x: kops.repeat(x, 2, axis=0), lambda x: keras.ops.repeat(x, 2, axis=0), ["n"]),
    ("tile", lambda x: kops.tile(x, (1, 2)), lambda x: keras.ops.tile(x, (1, 2)), ["n"]),
    (
        "broadcast_to",
        lambda x: kops.broadcast_to(x, (3, 4, 8)),
        lambda x: keras.ops.broadcast_to(x, (3, 4, 8)),
        ["n"],
    ),
    ("moveaxis", lambda x: kops.moveaxis(x, 0, 1), lambda x: keras.ops.moveaxis(x, 0, 1), ["n"]),
    ("swapaxes", lambda x: kops.swapaxes(x, 0, 1), lambda x: keras.ops.swapaxes(x, 0, 1), ["n"]),
    (
        "dot_product_attention",
        lambda q, k, v: kops.dot_product_attention(q, k, v, is_causal=True),
        lambda q, k, v: keras.ops.dot_product_attention(q, k, v, is_causal=True),
        [("u", (2, 4, 2, 8)), ("u", (2, 4, 2, 8)), ("n2", (2, 4, 2, 8))],
        1e-5,
    ),
    # comparisons (plain booleans)
    _cmp("equal"),
    _cmp("not_equal"),
    _cmp("less"),
    _cmp("less_equal"),
    _cmp("greater"),
    _cmp("greater_equal"),
]

ROWS = {row[0]: row for row in TABLE}


# Compiled functions are cached per table function so that the five scales
# share one trace (the scale is a traced input, the shapes are equal).
_COMPILED = {}


def call(run, fn, *args):
    if run.mode == "eager":
        return fn(*args)
    key = id(fn)
    if key not in _COMPILED:
        _COMPILED[key] = (fn, kb.jit(fn))
    return _COMPILED[key][1](*args)


@pytest.mark.parametrize("k", K_VALUES, ids=[f"2^{k}" for k in K_VALUES])
@pytest.mark.parametrize("name", list(ROWS))
def test_scaled_op_equals_keras_op(run, rng, name, k):
    _, fn_scaled, fn_plain, inputs, *rest = ROWS[name]
    scaled, plain = build(inputs, rng, k)
    out = call(run, fn_scaled, *scaled)
    ref = call(run, fn_plain, *plain)
    if rest and rest[0] == "bool":
        assert not ksc.is_scaled(out)
        assert keras.backend.standardize_dtype(out.dtype) == "bool"
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(out), keras.ops.convert_to_numpy(ref)
        )
        return
    assert ksc.is_scaled(out), f"{name} returned {type(out)}"
    assert tuple(out.shape) == tuple(ref.shape)
    s = scale_of(out)
    assert s > 0 and math.frexp(s)[0] == 0.5, f"scale {s} is not a power of two"
    assert_close(out, ref, rtol=rest[0] if rest else 1e-6)


def test_every_exported_op_has_a_row():
    """The table covers every keras.ops counterpart exported by
    keras_scalify.ops (rescaling/casting helpers have no keras.ops twin)."""
    exported = {
        n
        for n in dir(kops)
        if not n.startswith("_")
        and callable(getattr(kops, n))
        and hasattr(keras.ops, n)
    }
    assert len(exported) >= 45
    missing = sorted(
        n for n in exported if not any(r == n or r.startswith(n + "_") for r in ROWS)
    )
    assert not missing, f"no invariance row for: {missing}"


@pytest.mark.parametrize("k", K_VALUES)
def test_comparison_inputs_really_tie(rng, k):
    """Guard for the comparison rows: half the values are exactly equal."""
    _, plain = build(["n", "tie"], rng, k)
    a, b = (keras.ops.convert_to_numpy(p) for p in plain)
    assert np.array_equal(a == b, _MASK)


def test_cast_float16_equals_keras_cast_in_float16_range(run, rng):
    """Where the values are normal float16 numbers (scale 1), the scaled
    float16 cast equals keras.ops.cast exactly."""
    (x,), (v,) = build(["n"], rng, 0)
    out = call(run, ROWS["cast_float16"][1], x)
    ref = keras.ops.cast(v, "float16")
    assert out.dtype == "float16"
    np.testing.assert_array_equal(to_np(out), to_np(ref))
