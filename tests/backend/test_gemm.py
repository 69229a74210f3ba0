"""The GEMMs of a scaled contraction (`backend/gemm.py`, `ops/_gemm.py`):
matrix products in disguise run as 2-D GEMMs, results and gradients equal
plain Keras, and a weight gradient takes no pass after its GEMM."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify import backend as kb
from keras_scalify.backend.gemm import as_matmul
from keras_scalify.backend.gemm import grad_equations
from tests.conftest import to_np


@pytest.mark.parametrize(
    "equation, nk",
    [
        ("ak,kn->an", 1),
        ("abk,kn->abn", 1),
        ("abc,cde->abde", 1),  # attention projections
        ("abcd,cde->abe", 2),  # attention output
        ("abc,cd->abd", 1),
        ("ab,cb->ac", None),  # contracted last in both: not a plain product
        ("bqhd,bkhd->bhqk", None),  # batch indices
        ("abc,cd->adb", None),  # output order differs
        ("ab,bc->c", None),  # `a` summed within one operand
    ],
)
def test_as_matmul(equation, nk):
    assert as_matmul(equation) == nk


def test_grad_equations_and_unsupported_ones():
    assert grad_equations("ak,kn->an") == ("an,kn->ak", "ak,an->kn")
    with pytest.raises(ValueError, match="FP8 GEMMs"):
        grad_equations("ab,bc->c", "FP8")


CASES = [
    ("abk,kn->abn", (2, 3, 8), (8, 4)),
    ("abc,cde->abde", (2, 3, 8), (8, 2, 4)),
    ("abcd,cde->abe", (2, 3, 4, 2), (4, 2, 5)),
    ("bqhd,bkhd->bhqk", (2, 3, 2, 4), (2, 5, 2, 4)),
    # Attention's products (scores, context) and other batched or
    # transposed forms (eager torch: `batched_gemms`).
    ("aecd,abcd->acbe", (2, 5, 3, 4), (2, 6, 3, 4)),
    ("acbe,aecd->abcd", (2, 3, 6, 5), (2, 5, 3, 4)),
    ("abc,dc->abd", (2, 3, 4), (5, 4)),
    ("bij,bjk->bik", (3, 4, 5), (3, 5, 6)),
    ("abc,acd->adb", (2, 3, 4), (2, 4, 5)),
]


@pytest.mark.parametrize("equation, a_shape, b_shape", CASES, ids=[c[0] for c in CASES])
def test_scaled_einsum_values_and_gradients_equal_keras(equation, a_shape, b_shape, rng, run):
    a = rng.standard_normal(a_shape).astype("float32")
    b = rng.standard_normal(b_shape).astype("float32")
    out_shape = np.einsum(equation, a, b).shape
    up = rng.standard_normal(out_shape).astype("float32")

    def scaled(x, w):
        y = ksc.ops.einsum(equation, ksc.as_scaled(x, 2.0**-3), ksc.as_scaled(w, 2.0**5))
        return ops.sum(ksc.to_array(y) * ops.convert_to_tensor(up))

    def plain(x, w):
        y = ops.einsum(equation, x * 2.0**-3, w * 2.0**5)
        return ops.sum(y * ops.convert_to_tensor(up))

    args = [ops.convert_to_tensor(a), ops.convert_to_tensor(b)]
    got = run(kb.value_and_grad(scaled), *args)
    want = run(kb.value_and_grad(plain), *args)
    np.testing.assert_allclose(to_np(got[0]), to_np(want[0]), rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(to_np(g), to_np(w), rtol=1e-5, atol=1e-6 * np.abs(to_np(w)).max())


@pytest.mark.parametrize("equation, a_shape, b_shape", CASES, ids=[c[0] for c in CASES])
def test_host_known_factor_is_the_gemms_alpha_bit_for_bit(equation, a_shape, b_shape, rng):
    """Where the host knows a GEMM's pow2 factor (eager torch),
    the GEMM takes it as its `alpha` (`addmm`/`baddbmm`, no multiply of
    its own): values and gradients are those of the multiply path
    (`memo_disabled` turns host reads off) bit for bit. Elsewhere both
    runs take the multiply path."""
    from keras_scalify.backend import scalar as S

    a = ops.convert_to_tensor(rng.standard_normal(a_shape).astype("float32"))
    b = ops.convert_to_tensor(rng.standard_normal(b_shape).astype("float32"))
    up = ops.convert_to_tensor(rng.standard_normal(np.einsum(equation, np.zeros(a_shape), np.zeros(b_shape)).shape).astype("float32"))

    def scaled(x, w):
        y = ksc.ops.einsum(equation, ksc.as_scaled(x, 2.0**-3), ksc.as_scaled(w, 2.0**5))
        return ops.sum(y.data * up)

    calls = []
    if keras.config.backend() == "torch":
        import torch
        from torch.overrides import TorchFunctionMode

        class Count(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                calls.append(getattr(func, "__name__", ""))
                return func(*args, **(kwargs or {}))

        # (On any device: the factors come from Python numbers, whose
        # values the host keeps, `backend.scalar.host_value`; reads off,
        # as on a GPU, the kept values alone decide.)
        with Count(), S.host_reads_disabled():
            got = kb.value_and_grad(scaled)(a, b)
        assert {"addmm", "baddbmm"} & set(calls), calls
    else:
        got = kb.value_and_grad(scaled)(a, b)
    with S.memo_disabled():
        want = kb.value_and_grad(scaled)(a, b)
    np.testing.assert_array_equal(to_np(got[0]), to_np(want[0]))
    for g, w in zip(got[1], want[1]):
        np.testing.assert_array_equal(to_np(g), to_np(w))


@pytest.mark.parametrize(
    "equation, batched",
    [
        ("aecd,abcd->acbe", True),
        ("abc,dc->abd", True),
        ("bij,bjk->bik", True),
        ("ak,kn->an", False),  # a product of matrices: `matmul`
        ("ab,cb->ac", False),  # (transposed matrices too)
        ("ab,bc->c", False),  # `a` summed within one operand
        ("ab,cd->abcd", False),  # nothing contracted
    ],
)
def test_batched_gemms_on_eager_torch_only(equation, batched):
    """Eager torch runs the contractions that are not a product of two
    matrices as `bmm` on operands laid out once (`layout`); other
    backends keep the einsum (XLA lays it out)."""
    from keras_scalify.backend.gemm import plain_gemms

    if equation == "ab,bc->c":
        with pytest.raises(ValueError, match="summed within one operand"):
            plain_gemms(equation)
        return
    gemms = plain_gemms(equation)
    assert (gemms.layout is not None) == (batched and keras.config.backend() == "torch")


@pytest.mark.skipif(keras.config.backend() != "jax", reason="inspects a jaxpr (jax only)")
def test_weight_gradient_comes_out_of_its_gemm_scaled(rng):
    """The pow2 factor of a float32 weight gradient goes on the smaller
    activation, so no multiply runs over the weight-shaped result."""
    import jax

    x = rng.standard_normal((8, 256)).astype("float32")
    w = rng.standard_normal((256, 512)).astype("float32")

    def loss(wd):
        y = ksc.ops.matmul(ksc.as_scaled(x, 2.0**-2), ksc.ScaledTensor(wd, 2.0**-4, 2.0**-7))
        return ops.sum(ksc.to_array(y))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(w)
    weight_sized = [
        e for e in jaxpr.eqns
        if e.primitive.name == "mul" and tuple(e.outvars[0].aval.shape) == w.shape
    ]
    assert not weight_sized, weight_sized


@pytest.mark.parametrize("equation, a_shape, b_shape", CASES[:4] + [("acbe,aecd->abcd", (2, 3, 6, 5), (2, 5, 3, 4))])
def test_rebalanced_einsum_is_rebalance_of_einsum_bit_for_bit(equation, a_shape, b_shape, rng, monkeypatch):
    """Attention's combine rebalance joins the GEMM's forward factor
    (`ops.linalg.rebalanced_einsum`): the same data, scale and grad scale,
    and the same operand gradients, as `rebalance(einsum(...))`, with no
    rescale of its own."""
    from keras_scalify.ops import rescaling
    from keras_scalify.ops.linalg import rebalanced_einsum

    a = ops.convert_to_tensor(rng.standard_normal(a_shape).astype("float32"))
    b = ops.convert_to_tensor(rng.standard_normal(b_shape).astype("float32"))
    up = ops.convert_to_tensor(rng.standard_normal(np.einsum(equation, np.zeros(a_shape), np.zeros(b_shape)).shape).astype("float32"))

    def run(combine):
        def forward(x, w):
            return combine(ksc.as_scaled(x, 2.0**-3, 2.0**4), ksc.as_scaled(w, 2.0**5, 2.0**-2))

        grads = kb.value_and_grad(lambda x, w: ops.sum(forward(x, w).data * up))(a, b)
        return forward(a, b), grads

    y_want, want = run(lambda x, w: ksc.ops.rebalance(ksc.ops.einsum(equation, x, w), 8.0))
    with monkeypatch.context() as m:
        def refuse(*args):
            raise AssertionError("a rescale node ran")

        m.setattr(rescaling, "rescale", refuse)
        y_got, got = run(lambda x, w: rebalanced_einsum(equation, x, w, 8.0))
    for field in range(3):
        np.testing.assert_array_equal(to_np(y_got[field]), to_np(y_want[field]))
    for g, w in zip(got[1], want[1]):
        np.testing.assert_array_equal(to_np(g), to_np(w))
    with pytest.raises(ValueError, match="power of two"):
        rebalanced_einsum(equation, ksc.as_scaled(a), ksc.as_scaled(b), 3.0)


@pytest.mark.skipif(keras.config.backend() != "torch", reason="eager torch's batched GEMMs only")
def test_batched_gemm_keeps_its_laid_out_operands_for_the_backward(rng):
    """The scores product of attention (`batched_gemms`): its operands are
    laid out once, before the custom gradient, which keeps them (not the
    originals, laid out again in the backward); the gradients still equal
    plain Keras's (the other tests)."""
    import torch

    equation = "aecd,abcd->acbe"
    a = ops.convert_to_tensor(rng.standard_normal((2, 5, 3, 4)).astype("float32")).requires_grad_()
    b = ops.convert_to_tensor(rng.standard_normal((2, 6, 3, 4)).astype("float32")).requires_grad_()
    y = ksc.ops.einsum(equation, ksc.as_scaled(a), ksc.as_scaled(b)).data
    node = y.grad_fn
    while node is not None and not hasattr(node, "saved_tensors"):
        node = node.next_functions[0][0]
    shapes = [tuple(t.shape) for t in node.saved_tensors if t.ndim == 4]
    # (a as batch, rows, contracted; b as batch, contracted, columns)
    assert shapes == [(2, 3, 5, 4), (2, 3, 4, 6)], shapes


def test_a_zero_factor_keeps_non_finite_cotangents(rng):
    """An operand of scale 0 gives its GEMMs a factor 0: an inf in the
    cotangent must still reach the gradients as NaN (`0·inf`), as the
    multiply path gives it; BLAS's `alpha = 0` skips the product, so a
    zero factor is never the GEMM's `alpha`."""
    from keras_scalify.backend import scalar as S

    a = ops.convert_to_tensor(rng.standard_normal((4, 3)).astype("float32"))
    b = ops.convert_to_tensor(rng.standard_normal((3, 5)).astype("float32"))
    up = rng.standard_normal((4, 5)).astype("float32")
    up[1, 2] = np.inf
    up = ops.convert_to_tensor(up)

    def loss(x, w):
        y = ksc.ops.einsum("mk,kn->mn", ksc.as_scaled(x, 0.0), ksc.as_scaled(w, 1.0))
        return ops.sum(y.data * up)

    got = kb.value_and_grad(loss)(a, b)
    with S.memo_disabled():
        want = kb.value_and_grad(loss)(a, b)
    for g, w in zip(got[1], want[1]):
        assert np.isnan(to_np(w)).any()
        np.testing.assert_array_equal(to_np(g), to_np(w))
