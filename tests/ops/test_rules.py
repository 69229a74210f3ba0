"""Forward scale rules of `keras_scalify.ops`, read like DESIGN.md §4.

Each row: input data, input scales and shapes -> the exact output scale
(compared with `==`: scales are powers of two) and the output data to the
data dtype's tolerance. Every row runs eagerly and compiled (`run`).
"""

import math

import keras
import numpy as np
import pytest

import keras_scalify as ksc
from tests.conftest import assert_close
from tests.conftest import data_of
from tests.conftest import grad_scale_of
from tests.conftest import scale_of
from tests.conftest import to_np

kops = ksc.ops

TOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}


def st(values, scale, dtype="float32", grad_scale=None):
    """A ScaledTensor with data `values` (cast to `dtype`) and `scale`."""
    data = np.asarray(values, dtype=np.float64).astype(dtype)
    gs = None if grad_scale is None else np.float32(grad_scale)
    return ksc.as_scaled(data, np.float32(scale), gs)


def ones(shape, scale, dtype="float32"):
    return st(np.ones(shape), scale, dtype)


def check(out, scale, data, dtype="float32", rtol=None):
    assert ksc.is_scaled(out), f"expected a ScaledTensor, got {type(out)}"
    assert scale_of(out) == scale, f"scale {scale_of(out)} != {scale}"
    assert out.dtype == dtype, f"data dtype {out.dtype} != {dtype}"
    d = data_of(out)
    data = np.broadcast_to(np.asarray(data, np.float64), d.shape)
    rtol = TOL[dtype] if rtol is None else rtol
    np.testing.assert_allclose(d, data, rtol=rtol, atol=0)


# --------------------------------------------------------------------------
# The rule table: (id, fn, inputs, expected scale, expected data, data dtype)
# --------------------------------------------------------------------------

_I = np.arange(40, dtype=np.float64).reshape(8, 5) / 8.0 - 2.0  # (8, 5)
_MASK = np.array([True, False, True, False])

RULES = [
    # add / subtract: s = P(sqrt(sa² + sb²)), data rescaled to it.
    ("add_ones_2_4", kops.add, [ones((4,), 2), ones((4,), 4)], 4.0, 1.5, "float32"),
    (
        "add_4_2",
        kops.add,
        [st([-1, 2], 4), st([1.5, 4.5], 2)],
        4.0,
        [-0.25, 4.25],
        "float32",
    ),
    (
        "subtract_4_2",
        kops.subtract,
        [st([-1, 2], 4), st([1.5, 4.5], 2)],
        4.0,
        [-1.75, -0.25],
        "float32",
    ),
    ("add_equal_scales_1_1", kops.add, [ones((2,), 1), ones((2,), 1)], 1.0, 2.0, "float32"),
    ("add_equal_scales_8_8", kops.add, [ones((2,), 8), ones((2,), 8)], 8.0, 2.0, "float32"),
    ("add_scale_0_and_0", kops.add, [ones((3,), 0), ones((3,), 0)], 0.0, 0.0, "float32"),
    ("add_scale_0_and_4", kops.add, [ones((3,), 0), ones((3,), 4)], 4.0, 1.0, "float32"),
    (
        "add_f16_scales_2_1024",
        kops.add,
        [st([1, -2, 3], 2, "float16"), st([1, -2, 3], 1024, "float16")],
        1024.0,
        np.array([1, -2, 3]) * (1 + 2 / 1024),
        "float16",
    ),
    # multiply / divide: s = sa·sb / sa/sb, data a·b / a/b.
    (
        "multiply_4_2",
        kops.multiply,
        [st([-2, 2], 4), st([1.5, 1.5], 2)],
        8.0,
        [-3, 3],
        "float32",
    ),
    (
        "divide_4_2",
        kops.divide,
        [st([-3, 3], 4), st([1.5, -2], 2)],
        2.0,
        [-2, -1.5],
        "float32",
    ),
    (
        "divide_1_8",
        kops.divide,
        [st([1, 2], 1), st([4, 4], 8)],
        0.125,
        [0.25, 0.5],
        "float32",
    ),
    ("negative", kops.negative, [st([1, -2], 4)], 4.0, [-1, 2], "float32"),
    ("abs", kops.abs, [st([1, -2], 4)], 4.0, [1, 2], "float32"),
    ("square", kops.square, [st([1, -3], 4)], 16.0, [1, 9], "float32"),
    ("power_3_scale_2", lambda x: kops.power(x, 3), [st([1, -2], 2)], 8.0, [1, -8], "float32"),
    ("power_2_scale_half", lambda x: kops.power(x, 2), [st([3], 0.5)], 0.25, [9], "float32"),
    ("power_0", lambda x: kops.power(x, 0), [st([3, -2], 4)], 1.0, [1, 1], "float32"),
    ("sqrt_scale_4", kops.sqrt, [st([1, 4, 9], 4)], 2.0, [1, 2, 3], "float32"),
    (
        "sqrt_scale_2",
        kops.sqrt,
        [st([1, 2, 8], 2)],
        1.0,
        np.sqrt([2, 4, 16]),
        "float32",
    ),
    (
        "sqrt_scale_2^-7",
        kops.sqrt,
        [st([1, 2], 2.0**-7)],
        2.0**-4,
        np.sqrt([2, 4]),
        "float32",
    ),
    # matmul / dot / einsum: s = sa·sb·P(sqrt(K)), data (A@B)/P(sqrt(K)).
    (
        "matmul_3x5_5x2",
        kops.matmul,
        [ones((3, 5), 2), ones((5, 2), 4)],
        16.0,
        2.5,
        "float32",
    ),
    (
        "matmul_K1024_scales_128_64",
        kops.matmul,
        [ones((2, 1024), 128), ones((1024, 2), 64)],
        262144.0,
        32.0,
        "float32",
    ),
    (
        "matmul_batched_K8",
        kops.matmul,
        [ones((2, 3, 8), 1), ones((2, 8, 4), 2)],
        4.0,
        4.0,
        "float32",
    ),
    (
        "matmul_broadcast_batch_K16",
        kops.matmul,
        [ones((2, 4, 16), 0.5), ones((16, 2), 0.5)],
        1.0,
        4.0,
        "float32",
    ),
    (
        "matmul_f16_K64",
        kops.matmul,
        [ones((2, 64), 2.0**-20, "float16"), ones((64, 2), 2.0**-10, "float16")],
        2.0**-27,
        8.0,
        "float16",
    ),
    ("dot_vectors_K16", kops.dot, [ones((16,), 2), ones((16,), 2)], 16.0, 4.0, "float32"),
    ("dot_matrices_K4", kops.dot, [ones((2, 4), 1), ones((4, 3), 8)], 16.0, 2.0, "float32"),
    (
        "einsum_ij_jk_K16",
        lambda a, b: kops.einsum("ij,jk->ik", a, b),
        [ones((2, 16), 2), ones((16, 3), 2)],
        16.0,
        4.0,
        "float32",
    ),
    (
        "einsum_bij_bjk_K64",
        lambda a, b: kops.einsum("bij,bjk->bik", a, b),
        [ones((2, 3, 64), 1), ones((2, 64, 4), 0.25)],
        2.0,
        8.0,
        "float32",
    ),
    (
        "einsum_bhqd_bhkd_K32",
        lambda q, k: kops.einsum("bhqd,bhkd->bhqk", q, k),
        [ones((1, 2, 4, 32), 1), ones((1, 2, 8, 32), 1)],
        4.0,
        8.0,
        "float32",
    ),
    (
        "einsum_two_contracted_K_4x16",
        lambda a, b: kops.einsum("ijk,jkl->il", a, b),
        [ones((2, 4, 16), 1), ones((4, 16, 3), 1)],
        8.0,
        8.0,
        "float32",
    ),
    (
        "einsum_elementwise_K1",
        lambda a, b: kops.einsum("ij,ij->ij", a, b),
        [st([[1, 2]], 2), st([[3, 4]], 4)],
        8.0,
        [[3, 8]],
        "float32",
    ),
    # sum / mean: s = sa·P(sqrt(N)) (mean: · 1/N split exactly).
    ("sum_5_scale_2", kops.sum, [st([1, 2, 3, 4, 5], 2)], 4.0, 7.5, "float32"),
    ("sum_8x16_all", kops.sum, [ones((8, 16), 1)], 8.0, 16.0, "float32"),
    ("sum_8x16_all_scale_8", kops.sum, [ones((8, 16), 8)], 64.0, 16.0, "float32"),
    ("sum_8x16_axis1", lambda x: kops.sum(x, axis=1), [ones((8, 16), 1)], 4.0, 4.0, "float32"),
    (
        "sum_8x16_axis0_keepdims",
        lambda x: kops.sum(x, axis=0, keepdims=True),
        [ones((8, 16), 1)],
        2.0,
        np.full((1, 16), 4.0),
        "float32",
    ),
    ("mean_4x8", kops.mean, [ones((4, 8), 1)], 0.125, 8.0, "float32"),
    ("mean_4x8_axis1_scale_4", lambda x: kops.mean(x, axis=1), [ones((4, 8), 4)], 1.0, 4.0, "float32"),
    (
        "mean_3_non_pow2",
        kops.mean,
        [st([3, 6, 9], 1)],
        0.25,  # P(sqrt 3) = 1, 1/3 = (4/3)·2**-2
        18 * (4 / 3),
        "float32",
    ),
    ("max_keeps_scale", kops.max, [st([1, -5, 3], 8)], 8.0, 3.0, "float32"),
    ("min_keeps_scale", kops.min, [st([1, -5, 3], 8)], 8.0, -5.0, "float32"),
    (
        "max_axis0",
        lambda x: kops.max(x, axis=0),
        [st([[1, -5], [0, 3]], 0.5)],
        0.5,
        [1, 3],
        "float32",
    ),
    # maximum / minimum / where / concat / stack / clip: s = max(s_i).
    (
        "maximum_4_2",
        kops.maximum,
        [st([-1, 2], 4), st([1.5, 4.5], 2)],
        4.0,
        [0.75, 2.25],
        "float32",
    ),
    (
        "minimum_4_2",
        kops.minimum,
        [st([-1, 2], 4), st([1.5, 4.5], 2)],
        4.0,
        [-1, 2],
        "float32",
    ),
    (
        "maximum_x_static_zero",
        lambda x: kops.maximum(x, 0.0),
        [st([-1, 2, -3, 4], 2.0**-10)],
        2.0**-10,
        [0, 2, 0, 4],
        "float32",
    ),
    (
        "maximum_static_zero_x",
        lambda x: kops.maximum(0.0, x),
        [st([-1, 2, -3, 4], 2.0**12)],
        2.0**12,
        [0, 2, 0, 4],
        "float32",
    ),
    (
        "minimum_x_static_zero",
        lambda x: kops.minimum(x, 0.0),
        [st([-1, 2, -3, 4], 2.0**-10)],
        2.0**-10,
        [-1, 0, -3, 0],
        "float32",
    ),
    (
        "where_mask_x_static_zero",
        lambda x: kops.where(_MASK, x, 0.0),
        [st([-1, 2, -3, 4], 2.0**-10)],
        2.0**-10,
        [-1, 0, -3, 0],
        "float32",
    ),
    (
        "where_mask_static_zero_x",
        lambda x: kops.where(_MASK, 0.0, x),
        [st([-1, 2, -3, 4], 2.0**9)],
        2.0**9,
        [0, 2, 0, 4],
        "float32",
    ),
    (
        "where_mask_x_zero_tensor_scale_0",
        lambda x, z: kops.where(_MASK, x, z),
        [st([-1, 2, -3, 4], 2.0**-10), ones((4,), 0)],
        2.0**-10,
        [-1, 0, -3, 0],
        "float32",
    ),
    (
        "where_mask_4_2",
        lambda a, b: kops.where(_MASK, a, b),
        [st([1, 2, 3, 4], 2), st([8, 8, 8, 8], 4)],
        4.0,
        [0.5, 8, 1.5, 8],
        "float32",
    ),
    (
        "concatenate_0.5_2",
        lambda a, b: kops.concatenate([a, b], axis=0),
        [ones((2, 3), 0.5), ones((1, 3), 2)],
        2.0,
        [[0.25] * 3, [0.25] * 3, [1.0] * 3],
        "float32",
    ),
    (
        "concatenate_axis1",
        lambda a, b: kops.concatenate([a, b], axis=1),
        [ones((2, 1), 8), ones((2, 2), 1)],
        8.0,
        [[1, 0.125, 0.125]] * 2,
        "float32",
    ),
    (
        "stack_1_4",
        lambda a, b: kops.stack([a, b], axis=1),
        [st([2, 4], 1), st([1, 2], 4)],
        4.0,
        [[0.5, 1], [1, 2]],
        "float32",
    ),
    (
        "clip_scale_4_bounds_1_2",
        lambda x: kops.clip(x, -1.0, 2.0),
        [st([-1, 0.125, 1], 4)],
        4.0,
        [-0.25, 0.125, 0.5],
        "float32",
    ),
    (
        "clip_bounds_larger_than_scale",
        lambda x: kops.clip(x, -8.0, 8.0),
        [st([-4, 1, 4], 1)],
        8.0,  # the bound 8 = 1·2**3 has scale 8
        [-0.5, 0.125, 0.5],
        "float32",
    ),
    # shape, indexing, cast: scale unchanged.
    ("reshape", lambda x: kops.reshape(x, (5, 8)), [st(_I, 0.25)], 0.25, _I.reshape(5, 8), "float32"),
    ("transpose", kops.transpose, [st(_I, 0.25)], 0.25, _I.T, "float32"),
    (
        "transpose_axes",
        lambda x: kops.transpose(x, (1, 0, 2)),
        [st(_I.reshape(2, 4, 5), 2)],
        2.0,
        _I.reshape(2, 4, 5).transpose(1, 0, 2),
        "float32",
    ),
    ("expand_dims", lambda x: kops.expand_dims(x, 1), [st(_I, 16)], 16.0, _I[:, None], "float32"),
    ("squeeze", lambda x: kops.squeeze(x, 0), [st(_I[None], 16)], 16.0, _I, "float32"),
    ("slice", lambda x: kops.slice(x, (2, 1), (4, 2)), [st(_I, 2.0**-9)], 2.0**-9, _I[2:6, 1:3], "float32"),
    ("take", lambda x: kops.take(x, np.array([3, 0, 3]), axis=0), [st(_I, 8)], 8.0, _I[[3, 0, 3]], "float32"),
    ("cast_f32_to_f16", lambda x: kops.cast(x, "float16"), [st(_I, 2.0**20)], 2.0**20, _I, "float16"),
    ("cast_f16_to_f32", lambda x: kops.cast(x, "float32"), [st(_I, 2.0**-20, "float16")], 2.0**-20, _I, "float32"),
    ("cast_f32_to_bf16", lambda x: kops.cast(x, "bfloat16"), [st(_I, 4)], 4.0, _I, "bfloat16"),
    (
        "cast_f32_to_f16_overflows_to_inf",
        lambda x: kops.cast(x, "float16"),
        [st([1e6, -1e6, 1.0], 2)],
        2.0,
        [np.inf, -np.inf, 1.0],
        "float16",
    ),
    # transcendental functions: scale 1 (tanh, erf: min(s, 1)).
    ("exp", kops.exp, [st([0, 1, -1], 2)], 1.0, np.exp([0, 2, -2]), "float32"),
    (
        "exp_f16_scale_2^19",
        kops.exp,
        [st([0, -1, -2, -32768], 2.0**19, "float16")],
        1.0,
        [1, 0, 0, 0],
        "float16",
    ),
    ("log", kops.log, [st([1, 2, 0.5], 4)], 1.0, np.log([4, 8, 2]), "float32"),
    ("sigmoid", kops.sigmoid, [st([0, 1, -1], 8)], 1.0, 1 / (1 + np.exp([0, -8, 8])), "float32"),
    ("tanh_scale_8", kops.tanh, [st([0, 0.125, -0.0625], 8)], 1.0, np.tanh([0, 1, -0.5]), "float32"),
    (
        "tanh_scale_2^-10",
        kops.tanh,
        [st([0, 1, -3], 2.0**-10)],
        2.0**-10,
        np.tanh(np.array([0, 1, -3]) * 2.0**-10) * 2.0**10,
        "float32",
    ),
    ("erf_scale_4", kops.erf, [st([0, 0.25], 4)], 1.0, [0, math.erf(1)], "float32"),
    (
        "erf_scale_half",
        kops.erf,
        [st([0, 1], 0.5)],
        0.5,
        [0, 2 * math.erf(0.5)],
        "float32",
    ),
    # gated activations: scale unchanged, d = a·g(a·sa).
    ("relu", kops.relu, [st([-1, 2, 0], 2.0**-12)], 2.0**-12, [0, 2, 0], "float32"),
    (
        "gelu_tanh",
        kops.gelu,
        [st([-1, 2, 0], 2)],
        2.0,
        np.array([-1, 2, 0])
        * 0.5
        * (
            1
            + np.tanh(
                math.sqrt(2 / math.pi)
                * (np.array([-2, 4, 0]) + 0.044715 * np.array([-2, 4, 0]) ** 3)
            )
        ),
        "float32",
    ),
    (
        "gelu_erf",
        lambda x: kops.gelu(x, approximate=False),
        [st([-1, 2, 0], 2)],
        2.0,
        [
            -1 * 0.5 * (1 + math.erf(-2 / math.sqrt(2))),
            2 * 0.5 * (1 + math.erf(4 / math.sqrt(2))),
            0,
        ],
        "float32",
    ),
    (
        "silu",
        kops.silu,
        [st([-1, 2, 0], 0.5)],
        0.5,
        np.array([-1, 2, 0]) / (1 + np.exp(-np.array([-0.5, 1, 0]))),
        "float32",
    ),
    (
        "silu_f16_scale_2^20",
        kops.silu,
        [st([-1, 2, 0], 2.0**20, "float16")],
        2.0**20,
        [0, 2, 0],
        "float16",
    ),
    # softmax-like and normalizations: scale 1 (logsumexp: max(s, 1)).
    (
        "softmax_scale_8",
        kops.softmax,
        [st([[0, 0.25, -0.25]], 8)],
        1.0,
        np.exp([[0, 2, -2]]) / np.exp([0, 2, -2]).sum(),
        "float32",
    ),
    (
        "log_softmax_scale_2^-3",
        kops.log_softmax,
        [st([[0, 8]], 0.125)],
        1.0,
        [[-np.log1p(np.e), 1 - np.log1p(np.e)]],
        "float32",
    ),
    ("logsumexp_ones10_scale_4", kops.logsumexp, [ones((10,), 4)], 4.0, 6.302585092994046 / 4, "float32"),
    ("logsumexp_scale_half", kops.logsumexp, [ones((4,), 0.5)], 1.0, 0.5 + math.log(4), "float32"),
    (
        "layer_normalization_scale_2^10",
        lambda x: kops.layer_normalization(x, epsilon=0.0),
        [st([[1, 2, 3, 4]], 2.0**10)],
        1.0,
        (np.array([[1, 2, 3, 4]]) - 2.5) / np.sqrt(1.25),
        "float32",
    ),
    (
        "rms_normalization_scale_2^-10",
        lambda x: kops.rms_normalization(x, epsilon=0.0),
        [st([[1, -1, 1, -1], [2, 2, 2, 2]], 2.0**-10)],
        1.0,
        [[1, -1, 1, -1], [1, 1, 1, 1]],
        "float32",
    ),
]


# Rows whose reference is a transcendental computed in float64 NumPy: the
# backends' float32 tanh/erf/exp differ by a few ulps, and gelu/silu of a
# negative input cancel (1 + tanh(u) is small), so allow 2e-5 there.
TRANSCENDENTAL_RTOL = {
    r[0]: 2e-5
    for r in RULES
    if r[0].split("_")[0] in ("exp", "log", "sigmoid", "tanh", "erf", "gelu", "silu", "softmax", "logsumexp")
    and r[5] == "float32"
}


@pytest.mark.parametrize(
    "name, fn, inputs, scale, data, dtype", RULES, ids=[r[0] for r in RULES]
)
def test_rule_gives_exact_scale_and_data(run, name, fn, inputs, scale, data, dtype):
    out = run(fn, *inputs)
    check(out, scale, data, dtype, rtol=TRANSCENDENTAL_RTOL.get(name))


# --------------------------------------------------------------------------
# Contraction size K: the output scale is P(sqrt(K)) for unit scales.
# --------------------------------------------------------------------------


K_SWEEP = [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (15, 2.0), (16, 4.0),
           (63, 4.0), (64, 8.0), (255, 8.0), (256, 16.0), (4096, 64.0)]


def test_matmul_scale_is_pow2_round_down_of_sqrt_k(run):
    """Unit scales: 1 for K=1..3, 2 for 4..15, 4 for 16..63, 8 for 64..255."""
    operands = []
    for k, _ in K_SWEEP:
        operands += [ones((2, k), 1), ones((k, 1), 1)]

    def all_k(*xs):
        return [kops.matmul(xs[i], xs[i + 1]) for i in range(0, len(xs), 2)]

    outs = run(all_k, *operands)
    for (k, scale), out in zip(K_SWEEP, outs):
        assert scale_of(out) == scale, f"K={k}: scale {scale_of(out)} != {scale}"
        np.testing.assert_allclose(data_of(out), k / scale, rtol=1e-6, err_msg=f"K={k}")


# --------------------------------------------------------------------------
# Zero scale, special constants, overflow safety in low precision.
# --------------------------------------------------------------------------


def test_add_of_two_zero_scale_tensors_has_no_nan(run):
    out = run(kops.add, st([1.0, 3.0], 0), st([2.0, -3.0], 0))
    assert scale_of(out) == 0.0
    assert not np.any(np.isnan(data_of(out)))
    assert np.all(to_np(out) == 0.0)


def test_add_f16_with_large_scale_ratio_stays_finite(run):
    big = np.array([60000.0, -60000.0, 1.0])
    out = run(kops.add, st(big, 2, "float16"), st(big, 1024, "float16"))
    assert scale_of(out) == 1024.0
    assert np.all(np.isfinite(data_of(out)))
    np.testing.assert_allclose(to_np(out), big * 1026, rtol=1e-3)


def test_exp_f16_with_scale_2p19_is_exact_without_nan(run):
    out = run(kops.exp, st([0, -1, -2, -32768], 2.0**19, "float16"))
    d = data_of(out)
    assert not np.any(np.isnan(d))
    np.testing.assert_array_equal(d, [1.0, 0.0, 0.0, 0.0])


def test_log_f16_with_scale_2p19_gives_minus_inf_and_13_17(run):
    out = run(kops.log, st([0, 1], 2.0**19, "float16"))
    assert scale_of(out) == 1.0
    d = data_of(out)
    assert d[0] == -np.inf
    np.testing.assert_allclose(d[1], 19 * math.log(2), rtol=1e-3)
    np.testing.assert_allclose(d[1], 13.17, atol=5e-3)


@pytest.mark.parametrize("value, expected", [(1e4, 448.0), (-1e4, -448.0), (300.0, 288.0)])
def test_cast_to_float8_e4m3fn_saturates(run, value, expected):
    out = run(lambda x: kops.cast(x, "float8_e4m3fn"), st([value, 1.0], 4))
    assert out.dtype == "float8_e4m3fn"
    assert scale_of(out) == 4.0
    d = data_of(out)
    assert not np.any(np.isnan(d))
    np.testing.assert_array_equal(d, [expected, 1.0])
    np.testing.assert_array_equal(to_np(out), [4 * expected, 4.0])


def test_logsumexp_ones10_scale_4_value(run):
    out = run(kops.logsumexp, ones((10,), 4))
    assert scale_of(out) == 4.0
    np.testing.assert_allclose(to_np(out), 6.302585, rtol=1e-6)


def test_sqrt_of_scale_2_multiplies_data_by_sqrt2(run):
    out = run(kops.sqrt, st([1.0, 4.0], 2))
    assert scale_of(out) == 1.0
    np.testing.assert_allclose(data_of(out), np.sqrt(2) * np.array([1, 2]), rtol=1e-6)


def test_sqrt_of_zero_scale_is_zero_without_nan(run):
    out = run(kops.sqrt, st([1.0, 4.0], 0))
    assert scale_of(out) == 0.0
    assert not np.any(np.isnan(to_np(out)))
    np.testing.assert_array_equal(to_np(out), [0.0, 0.0])


# --------------------------------------------------------------------------
# Mixed operands: Python scalars (exact mantissa·pow2) and plain tensors (s=1).
# --------------------------------------------------------------------------

MIXED = [
    ("mul_2.0_scale4", lambda x: x * 2.0, [1, 2], 4, 8.0, [1, 2]),
    ("mul_3.0_scale1", lambda x: kops.multiply(x, 3.0), [1, 2], 1, 2.0, [1.5, 3]),
    ("rmul_3.0_scale1", lambda x: 3.0 * x, [1, 2], 1, 2.0, [1.5, 3]),
    ("mul_0.5_scale1", lambda x: x * 0.5, [1, 2], 1, 0.5, [1, 2]),
    ("mul_int_6_scale2", lambda x: x * 6, [1, 2], 2, 8.0, [1.5, 3]),
    ("div_by_4.0", lambda x: x / 4.0, [1, 2], 8, 2.0, [1, 2]),
    ("div_by_3.0", lambda x: kops.divide(x, 3.0), [3, 6], 8, 4.0, [2, 4]),
    ("add_1.0_scale_4", lambda x: x + 1.0, [1, 2], 4, 4.0, [1.25, 2.25]),
    ("sub_from_1.0", lambda x: 1.0 - x, [1, 2], 1, 1.0, [0, -1]),
    ("mul_neg_3.0", lambda x: x * -3.0, [1, 2], 1, 2.0, [-1.5, -3]),
]


@pytest.mark.parametrize(
    "fn, values, scale, out_scale, out_data",
    [r[1:] for r in MIXED],
    ids=[r[0] for r in MIXED],
)
def test_python_scalar_is_split_exactly(run, fn, values, scale, out_scale, out_data):
    x = st(values, scale)
    out = run(fn, x)
    check(out, out_scale, out_data)
    # the composite value is exact
    expected = to_np(fn(np.asarray(values, np.float32) * np.float32(scale)))
    np.testing.assert_allclose(to_np(out), expected, rtol=1e-6)


def test_multiply_by_0p1_is_an_exact_decomposition(run):
    x = st([1.0, 3.0, -7.0], 4)
    out = run(lambda t: t * 0.1, x)
    # 0.1 = 1.6 · 2**-4 (mantissa rounded once to float32)
    assert scale_of(out) == 4 * 2.0**-4
    np.testing.assert_array_equal(
        data_of(out),
        (np.array([1.0, 3.0, -7.0], np.float32) * np.float32(1.6)).astype(np.float64),
    )
    np.testing.assert_allclose(to_np(out), np.array([0.4, 1.2, -2.8]), rtol=1e-6)


@pytest.mark.parametrize("k", [1.0 / math.sqrt(32.0), -0.3, 4.0])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_einsum_multiplier_is_multiply_by_the_constant(run, k, dtype):
    # einsum(multiplier=k) has the scale and grad scale of multiply(einsum, k);
    # its data is the same product rounded once (k's mantissa joins the GEMM
    # factor), so within one rounding of the composition's.
    rng = np.random.default_rng(0)
    q = st(rng.standard_normal((2, 3, 4, 8)), 0.5, dtype, grad_scale=2.0**-3)
    key = st(rng.standard_normal((2, 3, 5, 8)), 4.0, dtype, grad_scale=2.0**5)
    eq = "bhqd,bhkd->bhqk"
    fused = run(lambda a, b: kops.einsum(eq, a, b, out_dtype="float32", multiplier=k), q, key)
    composed = run(lambda a, b: kops.einsum(eq, a, b, out_dtype="float32") * k, q, key)
    assert scale_of(fused) == scale_of(composed) == 0.5 * 4.0 * 2.0 * 2.0 ** math.floor(math.log2(abs(k)))
    assert grad_scale_of(fused) == grad_scale_of(composed)
    assert fused.dtype == composed.dtype == "float32"
    np.testing.assert_allclose(data_of(fused), data_of(composed), rtol=2e-7, atol=0)
    expected = np.einsum(eq, to_np(q), to_np(key)) * k
    # The error bound of an 8-term dot product with float32 accumulation
    # (`dtype`'s data exact): (n + 2)·u·Σ|q·key|·|k| (no cancellation-free
    # elementwise rtol: a cancelling sum rounds relatively more).
    u = 2.0**-24 if dtype == "float32" else 2.0**-11
    bound = (8 + 2) * u * np.einsum(eq, np.abs(to_np(q)), np.abs(to_np(key))) * abs(k)
    assert np.all(np.abs(to_np(fused) - expected) <= bound)


@pytest.mark.parametrize("op", ["add", "multiply", "maximum", "matmul"])
def test_plain_tensor_counts_as_scale_1(run, op):
    a = st([[1.0, -2.0], [3.0, 4.0]], 16)
    b_val = np.array([[0.5, 2.0], [-1.0, 8.0]], np.float32)
    b = keras.ops.convert_to_tensor(b_val)
    fn = getattr(kops, op)
    out = run(fn, a, b)
    a_val = np.array([[1.0, -2.0], [3.0, 4.0]]) * 16
    expected_scale = {
        "add": 16.0,  # P(sqrt(256 + 1)) = 16
        "multiply": 16.0,
        "maximum": 16.0,
        "matmul": 16.0,  # 16 · 1 · P(sqrt 2) = 16
    }[op]
    ref = {
        "add": a_val + b_val,
        "multiply": a_val * b_val,
        "maximum": np.maximum(a_val, b_val),
        "matmul": a_val @ b_val,
    }[op]
    assert scale_of(out) == expected_scale
    np.testing.assert_allclose(to_np(out), ref, rtol=1e-6)
    # reversed operand order gives the same scale
    out_r = run(fn, b, a)
    assert scale_of(out_r) == expected_scale


def test_plain_tensor_add_rescales_only_the_plain_operand(run):
    b = keras.ops.convert_to_tensor(np.array([4.0, 8.0], np.float32))
    out = run(kops.add, st([1.0, 1.0], 4), b)
    check(out, 4.0, [2.0, 3.0])


def test_no_scaled_input_calls_plain_keras_op():
    x = keras.ops.convert_to_tensor(np.array([1.0, 2.0], np.float32))
    out = kops.add(x, x)
    assert not ksc.is_scaled(out)
    np.testing.assert_array_equal(to_np(out), [2.0, 4.0])


# --------------------------------------------------------------------------
# Comparisons: plain booleans, correct for mixed scales.
# --------------------------------------------------------------------------

# a = [1, 2, 3, 4]·4 = [4, 8, 12, 16]; b = [8, 4, 6, 1]·2 = [16, 8, 12, 2]
_A = ([1, 2, 3, 4], 4)
_B = ([8, 4, 6, 1], 2)
_VA = np.array([4.0, 8, 12, 16])
_VB = np.array([16.0, 8, 12, 2])


@pytest.mark.parametrize(
    "name, ref",
    [
        ("equal", np.equal),
        ("not_equal", np.not_equal),
        ("less", np.less),
        ("less_equal", np.less_equal),
        ("greater", np.greater),
        ("greater_equal", np.greater_equal),
    ],
)
def test_comparison_returns_plain_bool_for_mixed_scales(run, name, ref):
    fn = getattr(kops, name)
    out = run(fn, st(*_A), st(*_B))
    assert not ksc.is_scaled(out)
    assert keras.backend.standardize_dtype(out.dtype) == "bool"
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(out), ref(_VA, _VB))
    # against a static scalar and a plain tensor
    out_s = run(lambda x: fn(x, 12.0), st(*_A))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(out_s), ref(_VA, 12.0))
    plain = keras.ops.convert_to_tensor(_VB.astype(np.float32))
    out_p = run(fn, st(*_A), plain)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(out_p), ref(_VA, _VB))


def test_comparison_with_static_zero_keeps_tiny_scale(run):
    x = st([-1.0, 0.0, 1.0], 2.0**-120)
    out = run(lambda t: kops.greater(t, 0.0), x)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(out), [False, False, True])


# --------------------------------------------------------------------------
# Gradient-scale rules (the forward pass fixes each output's grad_scale).
# --------------------------------------------------------------------------


def gs(values, scale, grad_scale, shape=None):
    v = np.asarray(values, np.float64)
    if shape is not None:
        v = np.broadcast_to(v, shape)
    return st(v, scale, grad_scale=grad_scale)


GRAD_RULES = [
    # add: g = pow2 geometric mean (floored exponent mean) of ga, gb.
    ("add_mean_2^2_2^5", kops.add, [gs(1, 1, 4.0, (2,)), gs(1, 1, 32.0, (2,))], 8.0),
    ("add_mean_2^-2_2^-5", kops.add, [gs(1, 1, 0.25, (2,)), gs(1, 1, 2.0**-5, (2,))], 2.0**-4),
    ("subtract_mean", kops.subtract, [gs(1, 2, 1.0, (2,)), gs(1, 8, 4.0, (2,))], 2.0),
    # multiply: g = mean(ga/sb, gb/sa)
    ("multiply", kops.multiply, [gs(1, 2, 4.0, (2,)), gs(1, 8, 32.0, (2,))], 2.0),
    ("multiply_python_scalar", lambda x: x * 6.0, [gs(1, 2, 4.0, (2,))], 1.0),
    # divide: g = mean(ga·sb, gb·sb²/sa)
    ("divide", kops.divide, [gs(1, 2, 1.0, (2,)), gs(1, 4, 1.0, (2,))], 4.0),
    ("divide_python_scalar", lambda x: x / 6.0, [gs(1, 2, 4.0, (2,))], 16.0),
    # matmul (4,8)@(8,16): n_a = N = 16, n_b = M = 4
    # g = mean(ga/(sb·P(√16)), gb/(sa·P(√4))) = mean(4/16, 2**-3/4) = 2**-4
    ("matmul", kops.matmul, [gs(1, 2, 4.0, (4, 8)), gs(1, 4, 2.0**-3, (8, 16))], 2.0**-4),
    # same rule through einsum
    (
        "einsum",
        lambda a, b: kops.einsum("ij,jk->ik", a, b),
        [gs(1, 2, 4.0, (4, 8)), gs(1, 4, 2.0**-3, (8, 16))],
        2.0**-4,
    ),
    # with_grad_scale: g = the given power of two; 0 keeps ga
    ("with_grad_scale", lambda x: kops.with_grad_scale(x, 2.0**-40), [gs(1, 2, 8.0, (2,))], 2.0**-40),
    ("with_grad_scale_0", lambda x: kops.with_grad_scale(x, 0.0), [gs(1, 2, 8.0, (2,))], 8.0),
    # the grad scale of a (4,8) operand predicted from its (8,16) partner:
    # g_b/(s_a·P(√4)) · s_b · P(√16) = (2**-3/4) · 4 · 4 = 0.5
    (
        "operand_grad_scale",
        lambda a, b: ksc.ScaledTensor(
            a.data, a.scale, ksc.ops.linalg.operand_grad_scale("ij,jk->ik", (a, b), 0)
        ),
        [gs(1, 2, 4.0, (4, 8)), gs(1, 4, 2.0**-3, (8, 16))],
        0.5,
    ),
    ("negative", kops.negative, [gs(1, 2, 8.0, (2,))], 8.0),
    ("square", kops.square, [gs(1, 4, 8.0, (2,))], 2.0),
    ("power_3", lambda x: kops.power(x, 3), [gs(1, 2, 8.0, (2,))], 2.0),
    ("sqrt", kops.sqrt, [gs(1, 16, 2.0, (2,))], 8.0),
    ("sum", kops.sum, [gs(1, 2, 8.0, (4, 8))], 8.0),
    ("mean_4x8", kops.mean, [gs(1, 2, 8.0, (4, 8))], 256.0),  # ga/p, p = 1/32
    ("max", kops.max, [gs(1, 2, 8.0, (4,))], 8.0),
    ("maximum", kops.maximum, [gs(1, 2, 8.0, (2,)), gs(1, 2, 0.5, (2,))], 2.0),
    ("concatenate", lambda a, b: kops.concatenate([a, b]), [gs(1, 2, 8.0, (2,)), gs(1, 2, 2.0, (2,))], 4.0),
    ("reshape", lambda x: kops.reshape(x, (8,)), [gs(1, 2, 8.0, (2, 4))], 8.0),
    ("exp", kops.exp, [gs(0, 4, 8.0, (2,))], 8.0),
    ("log", kops.log, [gs(1, 4, 8.0, (2,))], 32.0),  # ga·sa
    ("tanh", kops.tanh, [gs(0, 4, 8.0, (2,))], 8.0),
    ("gelu", kops.gelu, [gs(1, 4, 8.0, (2,))], 8.0),
    ("softmax", kops.softmax, [gs([1, 2], 4, 8.0)], 8.0),
    # normalization: g = ga·sa
    ("layer_normalization", kops.layer_normalization, [gs([[1, 2, 3, 4]], 8, 0.5)], 4.0),
    ("rms_normalization", kops.rms_normalization, [gs([[1, 2, 3, 4]], 2.0**-3, 2.0)], 0.25),
]


@pytest.mark.parametrize(
    "fn, inputs, grad_scale",
    [r[1:] for r in GRAD_RULES],
    ids=[r[0] for r in GRAD_RULES],
)
def test_grad_scale_rule(run, fn, inputs, grad_scale):
    out = run(fn, *inputs)
    assert grad_scale_of(out) == grad_scale


def test_assert_close_helper_is_strict():
    """Guard: the shared helper rejects a 1e-5 relative difference."""
    with pytest.raises(AssertionError):
        assert_close(np.array([1.0 + 1e-5]), np.array([1.0]))


# --------------------------------------------------------------------------
# Low precision and extreme scales: the rule's result is representable, so
# the data must be too.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, ref",
    [("greater", [True, False]), ("less", [False, True]), ("equal", [False, False]),
     ("not_equal", [True, True])],
)
def test_comparison_f16_far_apart_scales_is_exact(run, name, ref):
    """1·2**-30 > 0 and -1·2**-30 < 0: comparisons are exact in float32
    (module docstring), even when float16 data cannot share one scale."""
    a = st([1.0, -1.0], 2.0**-30, "float16")
    b = st([0.0, 0.0], 1.0, "float16")
    out = run(getattr(kops, name), a, b)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(out), ref)


F16_BIG_REDUCTIONS = [
    # ones (256, 256): N = 65536, P(sqrt N) = 256: data 256 fits float16 even
    # though the raw data sum 65536 does not (float16 max 65504).
    ("sum_65536_ones", kops.sum, [ones((256, 256), 1, "float16")], 256.0, 256.0),
    ("mean_65536_ones", kops.mean, [ones((256, 256), 1, "float16")], 2.0**-8, 256.0),
    (
        "matmul_K65536_ones",
        kops.matmul,
        [ones((1, 65536), 1, "float16"), ones((65536, 1), 1, "float16")],
        256.0,
        256.0,
    ),
]


@pytest.mark.parametrize(
    "fn, inputs, scale, data",
    [r[1:] for r in F16_BIG_REDUCTIONS],
    ids=[r[0] for r in F16_BIG_REDUCTIONS],
)
def test_f16_reduction_rescales_before_the_data_overflows(run, fn, inputs, scale, data):
    out = run(fn, *inputs)
    check(out, scale, data, "float16")


@pytest.mark.parametrize("name", ["layer_normalization", "rms_normalization"])
@pytest.mark.parametrize("epsilon", [None, 1e-3])
def test_normalization_at_scale_2p_minus_64_matches_float64(run, name, epsilon):
    """Values ~1e-19 are normal float32 numbers; eps dominates, so the
    factor P(sqrt(eps))/sa goes to the output's scale (eps/sa² = eps·2**128
    would be finite here, but overflows below 2**-70)."""
    d = np.array([[1.0, 2.0, 3.0, 5.0]], np.float32)
    x = d.astype(np.float64) * 2.0**-64
    eps = keras.config.epsilon() if epsilon is None else epsilon
    if name == "layer_normalization":
        ref = (x - x.mean()) / np.sqrt(x.var() + eps)
    else:
        ref = x / np.sqrt(np.mean(x * x) + eps)
    out = run(lambda t: getattr(kops, name)(t, epsilon=epsilon), st(d, 2.0**-64))
    sqrt_eps = 2.0 ** np.floor(np.log2(np.sqrt(eps)))
    assert scale_of(out) == 2.0**-64 / sqrt_eps
    np.testing.assert_allclose(to_np(out), ref, rtol=1e-5)
