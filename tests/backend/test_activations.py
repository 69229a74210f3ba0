"""`keras_scalify.backend.activations.gated`: `a·gate(a·s)` and its
derivative `f'(a·s)` match float64 at every scale, including the scales
where `a·s` overflows or is subnormal in float32 (the fused torch node
clips `u` in its backward; the composition of `keras.ops` elsewhere)."""

import math

import numpy as np
import pytest
from keras import ops

from keras_scalify.backend import value_and_grad
from keras_scalify.backend.activations import KINDS
from keras_scalify.backend.activations import gated
from tests.conftest import to_np

A = np.array(
    [0.0, 1e-3, -1e-3, 0.3, -0.3, 1.0, -1.0, 2.5, -2.5, 7.0, -7.0, 40.0, -40.0],
    np.float32,
)
SCALES = [2.0**-140, 2.0**-100, 2.0**-20, 1.0, 2.0**20, 2.0**100, 2.0**127]

_K = math.sqrt(2.0 / math.pi)


def _gate64(u, kind):
    if kind == "gelu":
        return 0.5 * (1.0 + math.erf(u / math.sqrt(2.0)))
    if kind == "gelu_tanh":
        return 0.5 * (1.0 + math.tanh(_K * (u + 0.044715 * u**3))) if abs(u) < 20 else float(u > 0)
    return 1.0 / (1.0 + math.exp(-u)) if u > -700 else 0.0


def _reference(a, s, kind):
    """float64 `a·g(u)` and `f'(u) = g(u) + u·g'(u)` (by a central
    difference in u, relative step 1e-6; exact where g saturates)."""
    values, slopes = [], []
    for x in a.astype(np.float64):
        u = x * s
        values.append(x * _gate64(u, kind))
        h = max(abs(u), 1.0) * 1e-6
        f = lambda v: v * _gate64(v, kind)
        slopes.append((f(u + h) - f(u - h)) / (2 * h))
    return np.array(values), np.array(slopes)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("s", SCALES, ids=lambda s: f"2^{int(math.log2(s))}")
def test_gated_matches_float64(kind, s):
    want, want_slope = _reference(A, s, kind)
    scale = ops.convert_to_tensor(np.float32(s))
    value, (slope,) = value_and_grad(
        lambda a: ops.sum(gated(a, scale, kind))
    )(ops.convert_to_tensor(A))
    got = to_np(gated(ops.convert_to_tensor(A), scale, kind))
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(to_np(slope)))
    # float32 gates lose the far negative tail (1 + erf(u/√2) cancels):
    # errors are measured against |a|, the magnitude the output is added at.
    np.testing.assert_array_less(np.abs(got - want), 2e-5 * np.abs(want) + 1e-6 * np.abs(A) + 1e-45)
    np.testing.assert_allclose(to_np(slope), want_slope, rtol=1e-4, atol=1e-5)


def test_gated_unknown_kind_is_named():
    with pytest.raises(ValueError, match="kind"):
        gated(ops.ones((2,)), ops.ones(()), "relu")
