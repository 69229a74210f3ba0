"""Under a float16 compute dtype, scaled layers do their elementwise
epilogue (bias, norm affine, activation, residual sum) in float32 and round
once to the compute dtype."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from tests.conftest import to_np


def _layers():
    return [
        ksc.layers.ScaledDense(16, activation="gelu", dtype="scaled_fp16"),
        ksc.layers.ScaledLayerNormalization(dtype="scaled_fp16"),
        ksc.layers.ScaledRMSNormalization(dtype="scaled_fp16"),
    ]


@pytest.mark.parametrize("layer", _layers(), ids=lambda l: type(l).__name__)
def test_output_is_the_float32_result_rounded_once(layer, rng):
    x = rng.standard_normal((4, 8, 16)).astype("float16")
    layer(ksc.as_scaled(x))
    # Biases/shifts that float16 cannot hold exactly (they stay float32).
    for sv in layer.scaled_weights:
        if sv.name in ("bias", "beta"):
            sv.assign(np.full(sv.shape, 1.0 / 3.0, np.float32))
    y = layer(ksc.as_scaled(x))
    assert y.dtype == "float16"
    f32 = type(layer).from_keras(layer.to_keras(), dtype="scaled_float32")
    want = to_np(f32(ksc.as_scaled(x.astype("float32"))))
    # One rounding of the float32 result (up to the GEMM's own float16
    # rounding for Dense): within float16's half-ulp plus a little.
    np.testing.assert_allclose(to_np(y), want, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(keras.config.backend() != "jax", reason="inspects a jaxpr (jax only)")
@pytest.mark.parametrize("layer", _layers(), ids=lambda l: type(l).__name__)
def test_parameter_gradients_are_summed_in_float32(layer, rng):
    import jax

    x = rng.standard_normal((4, 8, 16)).astype("float16")
    layer(ksc.as_scaled(x))
    tv = [v.value for v in layer.trainable_variables]
    ntv = [v.value for v in layer.non_trainable_variables]

    def loss(tv):
        y, _ = layer.stateless_call(tv, ntv, ksc.as_scaled(x))
        return ops.sum(ksc.to_array(y))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(tv)
    f16_sums = [
        e for e in jaxpr.jaxpr.eqns
        if e.primitive.name == "reduce_sum" and e.invars[0].aval.dtype == np.float16
    ]
    assert not f16_sums, f16_sums
