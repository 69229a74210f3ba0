"""Scaled FP16 master weights and optimizer state (paper Table 3 #2, #4)."""

import importlib.util
import os

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify.core.rounding import stochastic_cast
from keras_scalify.layers import ScaledDense
from tests.conftest import rms
from tests.conftest import to_np


def _memory_benchmark():
    """`benchmarks/memory.py`, whose regression the README table reports."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("memory_benchmark", os.path.join(root, "benchmarks", "memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _policy(master, state):
    """FP16 matmuls and gradients with the given master and state dtypes."""
    return _memory_benchmark().policy(master, state)


def _f64(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")), dtype=np.float64)


# --- stochastic rounding -------------------------------------------------------


@pytest.mark.parametrize("dtype, dropped", [("float16", 13), ("bfloat16", 16)])
def test_stochastic_cast_is_unbiased_and_lands_on_neighbours(dtype, dropped):
    ulp = 2.0 ** -(23 - dropped)  # of values in [1, 2)
    x = np.full(1 << 16, 1.0 + 0.3 * ulp, np.float32)
    y = _f64(stochastic_cast(x, dtype, keras.random.SeedGenerator(0)))
    assert set(np.unique(y)) == {1.0, 1.0 + ulp}
    # Mean of 65536 Bernoulli(0.3) draws: std 0.0018 (in ulps).
    assert abs((y.mean() - 1.0) / ulp - 0.3) < 0.01
    neg = _f64(stochastic_cast(-x, dtype, keras.random.SeedGenerator(1)))
    assert abs((neg.mean() + 1.0) / ulp + 0.3) < 0.01


def test_stochastic_cast_exact_values_and_saturation():
    x = np.array([0.0, 1.0, -2.5, 65504.0, 1e6, -np.inf, 2.0**-14], np.float32)
    y = _f64(stochastic_cast(x, "float16", 3))
    np.testing.assert_array_equal(y, [0.0, 1.0, -2.5, 65504.0, 65504.0, -65504.0, 2.0**-14])
    np.testing.assert_array_equal(_f64(stochastic_cast(x, "float32", 3)), x.astype(np.float64))
    with pytest.raises(ValueError, match="dtype"):
        stochastic_cast(x, "float8_e4m3fn")


# --- updates below FP16 resolution -----------------------------------------


def _ones_layer(policy):
    layer = ScaledDense(64, use_bias=False, kernel_initializer="ones", dtype=policy)
    layer.build((None, 64))
    return layer


@pytest.mark.parametrize("stochastic", [True, False])
def test_updates_below_fp16_resolution_are_kept_on_average(stochastic):
    # Weights 1.0 stored in FP16 (ulp 2**-10); SGD steps of 2**-14, a
    # sixteenth of an ulp, 64 times: the weights should move by 2**-8.
    layer = _ones_layer(_policy("float16", "float32"))
    kernel = layer.kernel
    assert kernel.data.dtype == "float16" and float(to_np(kernel.scale)) == 1.0
    opt = ksc.ScaledOptimizer(
        keras.optimizers.SGD(1.0), rescale_every=10**6, stochastic_rounding=stochastic, seed=0
    )
    true_grad = np.full((64, 64), 2.0**-14, np.float32)
    for _ in range(64):
        # The data's cotangent is the true gradient over the grad scale.
        gs = float(to_np(kernel.grad_scale)) or 1.0 / float(to_np(kernel.scale))
        opt.apply([true_grad / gs], [kernel.data])
    moved = 1.0 - kernel.numpy().astype(np.float64)
    if stochastic:
        # Each element: 4 ulps expected, Binomial(64, 1/16) std 1.9 ulps;
        # the mean of 4096 elements has std 0.03 ulps.
        assert abs(moved.mean() / 2.0**-8 - 1.0) < 0.05
    else:
        assert np.all(moved == 0.0)  # round-to-nearest loses every step


# --- scaled FP16 optimizer state -------------------------------------------


def test_fp16_adam_second_moment_does_not_underflow():
    layer = _ones_layer(_policy("float16", "float16"))
    opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-3))
    rng = np.random.default_rng(0)
    g = (rng.standard_normal((64, 64)) * 1e-5).astype(np.float32)
    opt.apply([g], [layer.kernel.data])  # uncalibrated grad scale: 1/scale = 1
    stored = {v.path.rsplit("/", 1)[-1]: v for v in opt.variables}
    v_data = stored["dense_kernel_velocity" if "dense_kernel_velocity" in stored else
                    next(k for k in stored if k.endswith("kernel_velocity"))]
    v_scale = stored[v_data.path.rsplit("/", 1)[-1] + "_scale"]
    assert v_data.dtype == "float16"
    expected = 0.001 * g.astype(np.float64) ** 2  # (1 - beta_2) g², ~1e-13
    assert float(np.max(expected)) < 6e-8  # below FP16's smallest subnormal
    decoded = _f64(v_data) * float(to_np(v_scale))
    big = expected > 1e-6 * expected.max()
    np.testing.assert_allclose(decoded[big], expected[big], rtol=2e-3)
    # The max lands in [2**14, 2**15): FP16's full range below it is used.
    assert 2.0**14 <= float(np.max(_f64(v_data))) < 2.0**15


# --- training to the same loss (MLP regression) --------------------------------


def test_fp16_master_and_state_reach_the_fp32_master_loss():
    """Adam at lr 1e-4 makes steps below FP16's resolution of the weights:
    #2 (FP16 master) and #4 (+ FP16 state) end within 1% of #1's loss;
    without stochastic rounding #2 is measurably worse."""
    bench = _memory_benchmark()
    row1 = bench.regression_loss(_policy("float32", "float32"))
    row2 = bench.regression_loss(_policy("float16", "float32"))
    row4 = bench.regression_loss(_policy("float16", "float16"))
    row2_nearest = bench.regression_loss(_policy("float16", "float32"), stochastic=False)
    assert abs(row2 / row1 - 1) < 0.01, (row1, row2)
    assert abs(row4 / row1 - 1) < 0.01, (row1, row4)
    assert row2_nearest > 1.02 * row1, (row1, row2_nearest)


# --- weight rescaling and gradient-scale calibration ----------------------------


def test_weights_rescale_to_unit_rms_every_n_steps():
    layer = _ones_layer(_policy("float16", "float32"))
    kernel = layer.kernel
    opt = ksc.ScaledOptimizer(keras.optimizers.SGD(1.0), rescale_every=2, stochastic_rounding=False)
    g = np.full((64, 64), 0.75, np.float32)  # weights 1, 0.25, -0.5, -1.25, -2, -2.75
    scales = []
    for _ in range(5):
        gs = float(to_np(kernel.grad_scale)) or 1.0 / float(to_np(kernel.scale))
        before = kernel.numpy().astype(np.float64)
        opt.apply([g / gs], [kernel.data])
        after = kernel.numpy().astype(np.float64)
        np.testing.assert_allclose(after, before - 0.75, rtol=0, atol=0)  # exact
        scales.append(float(to_np(kernel.scale)))
    # Steps 0, 2 and 4 move the scale by P(rms) of the stored data before
    # the update: |d| = 1 -> x1; |d| = 0.5 -> x0.5; |d| = 2 / 0.5 = 4 -> x4.
    assert scales == [1.0, 1.0, 0.5, 0.5, 2.0]
    assert 1.0 <= rms(to_np(kernel.data)) < 2.0  # 2.75 / 2


def test_grad_scale_is_calibrated_from_the_gradient_rms():
    layer = _ones_layer(_policy("float32", "float32"))
    kernel = layer.kernel
    opt = ksc.ScaledOptimizer(keras.optimizers.SGD(0.0))
    g = np.full((64, 64), 3e-5, np.float32)
    opt.apply([g], [kernel.data])  # grad scale 1/scale = 1 in use
    # P(rms) = 2**-16 (3e-5 = 1.97 * 2**-16): next cotangents near unit RMS.
    assert float(to_np(kernel.grad_scale)) == 2.0**-16


def test_encode_weights_multiplies_by_an_exact_reciprocal_and_keeps_scales_normal():
    from keras_scalify.optimizers import state

    value = np.array([3.0, -1.5, 1e-3, 0.0], np.float32)
    for scale in (2.0**-20, 1.0, 2.0**40):
        ((data, s),) = state.encode_weights(
            [ops.convert_to_tensor(value)], [ops.convert_to_tensor(np.float32(scale))], ["float32"], [None]
        )
        assert float(ops.convert_to_numpy(s)) == scale
        np.testing.assert_array_equal(ops.convert_to_numpy(data), value / np.float32(scale))
    # A subnormal scale is raised to 2**-126: 1/scale stays finite, and
    # data × scale still decodes to the value.
    tiny = np.array([1e-37, -2e-37], np.float32)
    ((data, s),) = state.encode_weights(
        [ops.convert_to_tensor(tiny)], [ops.convert_to_tensor(np.float32(2.0**-140))], ["float32"], [None]
    )
    assert float(ops.convert_to_numpy(s)) == 2.0**-126
    d = ops.convert_to_numpy(data)
    assert np.all(np.isfinite(d))
    np.testing.assert_array_equal(d * np.float32(2.0**-126), tiny)
