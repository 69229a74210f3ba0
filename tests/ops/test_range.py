"""Dynamic range in float16: scale propagation keeps tiny values representable.

A chain of 8 matmuls whose *true* values are ~1e-6 and shrink further:
plain float16 (smallest subnormal 6e-8) loses them, the scaled chain keeps
its data near unit RMS and stays accurate. The reference is float64 NumPy on
the true values.
"""

import keras
import numpy as np
import pytest
import keras_scalify as ksc
from tests.conftest import data_of
from tests.conftest import rms
from tests.conftest import scale_of
from tests.conftest import to_np

B, K, LAYERS = 8, 64, 8
X_SCALE = 2.0**-20  # true input values ~ N(0, 1) * 2**-20 ~ 1e-6


def chain_problem(rng, w_scale):
    """float16 data of the input and the weights, and the float64 reference."""
    x = rng.standard_normal((B, K)).astype(np.float16)
    ws = [rng.standard_normal((K, K)).astype(np.float16) for _ in range(LAYERS)]
    ref = [x.astype(np.float64) * X_SCALE]
    for w in ws:
        ref.append(ref[-1] @ (w.astype(np.float64) * w_scale))
    return x, ws, ref[1:]


def scaled_chain(x, *ws):
    outs = [x]
    for w in ws:
        outs.append(ksc.ops.matmul(outs[-1], w))
    return outs[1:]


def plain_chain(x, *ws):
    outs = [x]
    for w in ws:
        outs.append(keras.ops.matmul(outs[-1], w))
    return outs[1:]


def run_both(run, rng, w_scale):
    x, ws, ref = chain_problem(rng, w_scale)
    sx = ksc.as_scaled(x, np.float32(X_SCALE))
    sws = [ksc.as_scaled(w, np.float32(w_scale)) for w in ws]
    scaled = run(scaled_chain, sx, *sws)

    px = keras.ops.convert_to_tensor(
        (x.astype(np.float32) * np.float32(X_SCALE)).astype(np.float16)
    )
    pws = [
        keras.ops.convert_to_tensor((w.astype(np.float32) * np.float32(w_scale)).astype(np.float16))
        for w in ws
    ]
    plain = run(plain_chain, px, *pws)
    return scaled, plain, ref


def rel_err(actual, reference):
    return rms(to_np(actual) - reference) / rms(reference)


# Each layer multiplies the true RMS by sqrt(K)·w_scale = 1/2: the true
# values fall from ~7e-7 to ~3e-9, below float16's smallest subnormal.
SHRINKING = 2.0**-4


def test_scaled_f16_chain_keeps_unit_data_rms_and_accuracy(run, rng):
    scaled, _, ref = run_both(run, rng, SHRINKING)
    assert rms(ref[-1]) < 1e-8  # the problem really is out of float16 range
    for i, (y, r) in enumerate(zip(scaled, ref)):
        assert y.dtype == "float16"
        d = data_of(y)
        assert np.all(np.isfinite(d))
        assert 0.25 <= rms(d) <= 4.0, f"layer {i}: data RMS {rms(d)}"
        # scale = sx·Π(sw·P(sqrt(64))) exactly
        assert scale_of(y) == X_SCALE * (SHRINKING * 8) ** (i + 1)
    assert rel_err(scaled[-1], ref[-1]) < 1e-2


def test_plain_f16_chain_underflows(run, rng):
    scaled, plain, ref = run_both(run, rng, SHRINKING)
    out = to_np(plain[-1])
    assert np.all(out == 0.0) or rel_err(plain[-1], ref[-1]) > 0.5
    assert rel_err(scaled[-1], ref[-1]) < 1e-2


def test_norm_preserving_f16_chain_is_accurate_where_plain_f16_is_not(run, rng):
    """Weights of true std 1/sqrt(K): true values stay ~1e-6 (float16
    subnormals), plain float16 keeps ~4 bits; the scaled chain ~11."""
    scaled, plain, ref = run_both(run, rng, 2.0**-3)
    for y in scaled:
        assert 0.25 <= rms(data_of(y)) <= 4.0
    err_scaled = rel_err(scaled[-1], ref[-1])
    err_plain = rel_err(plain[-1], ref[-1])
    assert err_scaled < 1e-2
    assert err_plain > 10 * err_scaled


# --- plain inputs at the boundary (issue 14, item 1) -------------------------
@pytest.mark.parametrize("policy", ["scaled_fp16", "scaled_fp8"])
@pytest.mark.parametrize("magnitude", [1e30, 2.0**20, 2.0**-30])
def test_plain_inputs_beyond_the_compute_format_are_carried_by_the_scale(rng, policy, magnitude):
    """Plain float32 inputs of a float16/FP8 layer (and of `AsScaled()`)
    are encoded with the pow2 of their RMS: 1e30 is neither clipped to
    65504 nor inf, 2**-30 is not flushed to 0."""
    x = rng.standard_normal((4, 16)).astype(np.float32)
    layer = ksc.layers.ScaledDense(8, use_bias=False, dtype=policy)
    unit = to_np(layer(x))
    tol = 1e-2 if policy == "scaled_fp16" else 0.15
    for first in (lambda v: v, ksc.layers.AsScaled(dtype=policy)):
        got = to_np(layer(first(x * np.float32(magnitude))))
        assert np.all(np.isfinite(got))
        assert rms(got / magnitude - unit) <= tol * rms(unit)


def test_cast_saturates_only_to_fp8_and_keeps_faults():
    x = ksc.as_scaled(np.asarray([1e6, -3.0, np.inf, np.nan], np.float32))
    f16 = data_of(ksc.ops.cast(x, "float16"))
    assert f16[0] == np.inf and f16[1] == -3.0 and f16[2] == np.inf and np.isnan(f16[3])
    e4 = data_of(ksc.ops.cast(x, "float8_e4m3fn"))
    assert e4[0] == 448.0 and e4[1] == -3.0 and np.isnan(e4[2]) and np.isnan(e4[3])
