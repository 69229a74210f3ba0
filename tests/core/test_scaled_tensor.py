"""ScaledTensor, as_scaled and to_array: construction, input checks,
structure flow (keras.tree, compiled functions, Functional models) and the
arithmetic operators."""

import keras
import numpy as np
import pytest
from keras.src.backend import standardize_dtype

import keras_scalify as ksc
from keras_scalify import backend as kb
from keras_scalify import ScaledTensor
from tests.conftest import assert_close
from tests.conftest import data_of
from tests.conftest import grad_scale_of
from tests.conftest import scale_of
from tests.conftest import to_np


def f32(values):
    return np.asarray(values, dtype=np.float32)


def dtype_of(x):
    return standardize_dtype(x.dtype)


# --- construction ------------------------------------------------------------
def test_construction_shape_dtype_ndim():
    data = keras.ops.cast(np.ones((2, 3, 4), np.float32), "float16")
    st = ScaledTensor(data, np.float32(4.0))
    assert st.shape == (2, 3, 4)
    assert st.dtype == "float16"
    assert st.ndim == 3
    assert scale_of(st) == 4.0


def test_default_grad_scale_is_one_float32_scalar():
    st = ScaledTensor(keras.ops.ones((2,)), np.float32(2.0))
    assert grad_scale_of(st) == 1.0
    assert dtype_of(st.grad_scale) == "float32"
    assert tuple(st.grad_scale.shape) == ()


@pytest.mark.parametrize("scale", [2.0, 8, np.float64(0.25), np.float16(0.5)])
def test_scale_is_stored_as_float32_scalar(scale):
    st = ScaledTensor(keras.ops.ones((2,)), scale, 4.0)
    assert dtype_of(st.scale) == "float32"
    assert dtype_of(st.grad_scale) == "float32"
    assert tuple(st.scale.shape) == ()
    assert scale_of(st) == float(scale)
    assert grad_scale_of(st) == 4.0


def test_scaled_tensor_from_integer_data_raises_type_error():
    with pytest.raises(TypeError, match="data"):
        ScaledTensor(keras.ops.convert_to_tensor(np.ones(2, np.int32)), 1.0)


# --- as_scaled / to_array ----------------------------------------------------
def test_as_scaled_keeps_data_and_represents_data_times_scale():
    x = f32([1.0, -1.5, 3.0])
    st = ksc.as_scaled(x, 8.0)
    assert ksc.is_scaled(st)
    np.testing.assert_array_equal(data_of(st), x)
    assert scale_of(st) == 8.0
    assert grad_scale_of(st) == 1.0
    out = ksc.to_array(st)
    assert dtype_of(out) == "float32"
    np.testing.assert_array_equal(to_np(out), x * 8.0)


def test_as_scaled_without_scale_uses_scale_one():
    st = ksc.as_scaled(f32([0.5, 7.0]))
    assert scale_of(st) == 1.0
    np.testing.assert_array_equal(to_np(st), [0.5, 7.0])


def test_to_array_multiplies_float16_data_in_float32():
    data = keras.ops.cast(f32([60000.0, -60000.0, 1.0]), "float16")
    st = ksc.as_scaled(data, 2.0**10)
    assert st.dtype == "float16"
    out = ksc.to_array(st)
    assert dtype_of(out) == "float32"
    np.testing.assert_array_equal(to_np(out), [6.144e7, -6.144e7, 1024.0])
    assert np.all(np.isfinite(to_np(out)))


def test_to_array_with_dtype_casts_after_the_float32_multiply():
    data = keras.ops.cast(f32([60000.0, 1.0]), "float16")
    st = ksc.as_scaled(data, 2.0**10)
    out = ksc.to_array(st, "float16")
    assert dtype_of(out) == "float16"
    np.testing.assert_array_equal(to_np(out), [np.inf, 1024.0])
    small = ksc.as_scaled(keras.ops.cast(f32([2.0**-20]), "float16"), 2.0**16)
    np.testing.assert_array_equal(to_np(ksc.to_array(small, "float16")),
                                  [2.0**-4])


def test_to_array_of_a_plain_tensor_returns_it():
    x = f32([1.0, 2.0])
    np.testing.assert_array_equal(to_np(ksc.to_array(x)), x)
    assert dtype_of(ksc.to_array(x, "float16")) == "float16"


def test_as_scaled_python_float_splits_into_mantissa_and_pow2():
    st = ksc.as_scaled(2.1)
    assert scale_of(st) == 2.0
    np.testing.assert_allclose(data_of(st), 1.05, rtol=1e-7)
    assert dtype_of(st.data) == "float32"
    np.testing.assert_allclose(to_np(st), 2.1, rtol=1e-7)
    st = ksc.as_scaled(-0.3)
    assert scale_of(st) == 0.25
    np.testing.assert_allclose(data_of(st), -1.2, rtol=1e-7)


def test_as_scaled_of_a_scaled_tensor_returns_it_unchanged():
    st = ksc.as_scaled(f32([1.0, 2.0]), 4.0)
    assert ksc.as_scaled(st) is st


def test_as_scaled_of_a_scaled_tensor_with_a_new_scale_raises():
    st = ksc.as_scaled(f32([1.0, 2.0]), 4.0)
    with pytest.raises(ValueError, match="scale"):
        ksc.as_scaled(st, 2.0)


def test_numpy_array_protocol_gives_represented_values():
    st = ksc.as_scaled(f32([1.0, -2.0]), 0.5)
    np.testing.assert_array_equal(np.asarray(st), [0.5, -1.0])


def test_zero_scale_is_allowed():
    st = ksc.as_scaled(f32([0.0, 0.0]), 0.0)
    assert scale_of(st) == 0.0
    np.testing.assert_array_equal(to_np(st), [0.0, 0.0])


# --- bad input ---------------------------------------------------------------
@pytest.mark.parametrize(
    "scale", [np.ones(2, np.float32), np.ones((1, 1), np.float32)]
)
def test_non_scalar_scale_raises_value_error(scale):
    with pytest.raises(ValueError, match="scale"):
        ksc.as_scaled(f32([1.0, 2.0]), scale=scale)


@pytest.mark.parametrize(
    "scale", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"]
)
def test_non_finite_scale_raises_value_error(scale):
    with pytest.raises(ValueError, match="scale"):
        ksc.as_scaled(f32([1.0]), scale=scale)


@pytest.mark.parametrize("scale", [3.0, 0.3, 1.5, 1000.0])
def test_non_power_of_two_scale_raises_value_error(scale):
    with pytest.raises(ValueError, match="power of two"):
        ksc.as_scaled(f32([1.0]), scale=scale)


@pytest.mark.parametrize("scale", [-2.0, -1.0])
def test_negative_scale_raises_value_error(scale):
    with pytest.raises(ValueError, match="scale"):
        ksc.as_scaled(f32([1.0]), scale=scale)


def test_integer_data_raises_type_error():
    with pytest.raises(TypeError):
        ksc.as_scaled(np.array([1, 2], np.int32), 2.0)
    with pytest.raises(TypeError):
        ksc.as_scaled(keras.ops.convert_to_tensor(np.array([1, 2], np.int32)))


def test_bool_data_raises_type_error():
    with pytest.raises(TypeError):
        ksc.as_scaled(True)
    with pytest.raises(TypeError):
        ksc.as_scaled(np.array([True, False]), 1.0)


@pytest.mark.parametrize("grad_scale", [0.0, -4.0, 3.0, np.inf])
def test_bad_grad_scale_raises_value_error(grad_scale):
    with pytest.raises(ValueError, match="grad_scale"):
        ksc.as_scaled(f32([1.0]), 2.0, grad_scale=grad_scale)


def test_grad_scale_is_stored():
    st = ksc.as_scaled(f32([1.0]), 2.0, grad_scale=2.0**-8)
    assert grad_scale_of(st) == 2.0**-8


# --- gradients through the boundary ------------------------------------------
def test_gradient_through_as_scaled_and_to_array_is_the_true_gradient():
    w = f32([1.0, -2.0, 3.0])

    def loss(x):
        st = ksc.as_scaled(x, 4.0, grad_scale=2.0**-6)
        return keras.ops.sum(keras.ops.multiply(ksc.to_array(st), w))

    value, (grad,) = kb.value_and_grad(loss)(f32([1.0, 1.0, 0.5]))
    assert float(keras.ops.convert_to_numpy(value)) == 4.0 * (1 - 2 + 1.5)
    np.testing.assert_array_equal(to_np(grad), 4.0 * w)


# --- structure ---------------------------------------------------------------
def test_keras_tree_sees_three_leaves():
    st = ksc.as_scaled(f32([1.0, 2.0]), 4.0, grad_scale=2.0)
    leaves = keras.tree.flatten(st)
    assert len(leaves) == 3
    np.testing.assert_array_equal(to_np(leaves[0]), [1.0, 2.0])
    assert float(to_np(leaves[1])) == 4.0
    assert float(to_np(leaves[2])) == 2.0


def test_keras_tree_map_structure_keeps_the_type():
    st = ksc.as_scaled(f32([1.0, 2.0]), 4.0)
    out = keras.tree.map_structure(lambda t: t, st)
    assert type(out) is ScaledTensor
    np.testing.assert_array_equal(to_np(out), [4.0, 8.0])
    nested = keras.tree.map_structure(lambda t: t, {"a": [st, st]})
    assert type(nested["a"][1]) is ScaledTensor


def test_keras_tree_pack_sequence_as_rebuilds_scaled_tensor():
    st = ksc.as_scaled(f32([1.0, 2.0]), 4.0)
    out = keras.tree.pack_sequence_as(st, keras.tree.flatten(st))
    assert type(out) is ScaledTensor
    assert scale_of(out) == 4.0


def test_scaled_tensor_passes_in_and_out_of_a_compiled_function():
    def fn(st, y):
        return ScaledTensor(st.data * y, st.scale * 2.0, st.grad_scale)

    st = ksc.as_scaled(f32([1.0, -3.0]), 0.5, grad_scale=8.0)
    out = kb.jit(fn)(st, keras.ops.convert_to_tensor(f32([2.0, 2.0])))
    assert type(out) is ScaledTensor
    assert scale_of(out) == 1.0
    assert grad_scale_of(out) == 8.0
    np.testing.assert_array_equal(to_np(out), [2.0, -6.0])


def test_scaled_ops_inside_a_compiled_function(run):
    def fn(a, b):
        return ksc.to_array(a * b + a)

    a = ksc.as_scaled(f32([1.0, 2.0]), 4.0)
    b = ksc.as_scaled(f32([3.0, -1.0]), 0.5)
    np.testing.assert_allclose(to_np(run(fn, a, b)),
                               [4 * 1.5 + 4, 8 * -0.5 + 8], rtol=1e-6)


def test_scaled_tensor_through_torch_compile():
    # One call only: torch.compile is slow on CPU (jit elsewhere).
    def fn(st):
        shifted = ScaledTensor(st.data + 1.0, st.scale, st.grad_scale)
        return ksc.to_array(shifted)

    st = ksc.as_scaled(f32([1.0, 2.0, 3.0, 4.0]), 2.0**-3)
    out = kb.torch_compile(fn)(st)
    np.testing.assert_array_equal(to_np(out), [0.25, 0.375, 0.5, 0.625])


# --- operators ---------------------------------------------------------------
@pytest.fixture
def ab(rng):
    a_np = rng.standard_normal((4, 4)).astype(np.float32)
    b_np = (rng.uniform(0.5, 2.0, (4, 4))
            * rng.choice([-1.0, 1.0], (4, 4))).astype(np.float32)
    a = ksc.as_scaled(a_np, 2.0**3)
    b = ksc.as_scaled(b_np, 2.0**-2)
    return a, b, a_np.astype(np.float64) * 8, b_np.astype(np.float64) / 4


OPERATOR_CASES = [
    ("add", lambda a, b: a + b, lambda a, b: a + b),
    ("sub", lambda a, b: a - b, lambda a, b: a - b),
    ("mul", lambda a, b: a * b, lambda a, b: a * b),
    ("div", lambda a, b: a / b, lambda a, b: a / b),
    ("matmul", lambda a, b: a @ b, lambda a, b: a @ b),
    ("neg", lambda a, b: -a, lambda a, b: -a),
    ("abs", lambda a, b: abs(a), lambda a, b: np.abs(a)),
    ("pow2", lambda a, b: a**2, lambda a, b: a**2),
    ("pow3", lambda a, b: b**3, lambda a, b: b**3),
]


@pytest.mark.parametrize(
    "name, op, ref", OPERATOR_CASES, ids=[c[0] for c in OPERATOR_CASES]
)
def test_operators_dispatch_to_scaled_ops(ab, name, op, ref):
    a, b, a_ref, b_ref = ab
    out = op(a, b)
    assert type(out) is ScaledTensor
    assert out.shape == (4, 4)
    assert_close(out, ref(a_ref, b_ref), rtol=1e-5)


def test_add_is_not_tuple_concatenation(ab):
    a, _, a_ref, _ = ab
    out = a + a
    assert type(out) is ScaledTensor and len(out) == 3
    assert_close(out, 2 * a_ref)


def test_operator_scales_follow_the_rules(ab):
    a, b, _, _ = ab
    assert scale_of(a * b) == 2.0**3 * 2.0**-2
    assert scale_of(a / b) == 2.0**3 / 2.0**-2
    assert scale_of(-a) == 2.0**3
    assert scale_of(abs(a)) == 2.0**3
    assert scale_of(a**2) == 2.0**6


@pytest.mark.parametrize(
    "op, ref",
    [
        (lambda a: 2.0 * a, lambda a: 2.0 * a),
        (lambda a: a * 3.0, lambda a: a * 3.0),
        (lambda a: 1.0 + a, lambda a: 1.0 + a),
        (lambda a: 1.0 - a, lambda a: 1.0 - a),
        (lambda a: a / 4.0, lambda a: a / 4.0),
        (lambda a: 1.0 / a, lambda a: 1.0 / a),
    ],
)
def test_operators_with_python_scalars_on_either_side(op, ref):
    a_np = f32([1.0, -2.0, 0.5, 4.0])
    a = ksc.as_scaled(a_np, 2.0)
    out = op(a)
    assert type(out) is ScaledTensor
    assert_close(out, ref(a_np.astype(np.float64) * 2.0), rtol=1e-6)


def _plain():
    return keras.ops.convert_to_tensor(f32(np.full((4, 4), 0.5)))


def test_operators_with_a_plain_tensor_on_the_right(ab):
    a, _, a_ref, _ = ab
    plain = _plain()
    for out, ref in [(a + plain, a_ref + 0.5), (a - plain, a_ref - 0.5),
                     (a * plain, a_ref * 0.5), (a / plain, a_ref / 0.5),
                     (a @ plain, a_ref @ np.full((4, 4), 0.5))]:
        assert type(out) is ScaledTensor
        assert_close(out, ref, rtol=1e-5)


def test_operators_with_a_plain_backend_tensor_on_the_left(ab):
    # Needs the backend tensor's operator to defer to ScaledTensor.__r*__.
    a, _, a_ref, _ = ab
    plain = _plain()
    for out, ref in [(plain + a, 0.5 + a_ref), (plain - a, 0.5 - a_ref),
                     (plain * a, 0.5 * a_ref), (plain / a, 0.5 / a_ref),
                     (plain @ a, np.full((4, 4), 0.5) @ a_ref)]:
        assert type(out) is ScaledTensor
        assert_close(out, ref, rtol=1e-5)


# --- Functional model --------------------------------------------------------
class ToScaled(keras.layers.Layer):
    """Plain -> ScaledTensor: data = x / scale, scale a fixed power of two."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale

    def call(self, x):
        return ksc.as_scaled(x / self.scale, self.scale)


class FromScaled(keras.layers.Layer):
    """ScaledTensor -> plain (float32)."""

    def call(self, x):
        if not ksc.is_scaled(x):
            raise TypeError(f"expected a ScaledTensor, got {type(x)}")
        return ksc.to_array(x)


class ScaledDouble(keras.layers.Layer):
    """ScaledTensor -> ScaledTensor: doubles the scale, keeps the data."""

    def call(self, x):
        return ScaledTensor(x.data, x.scale * 2.0, x.grad_scale)


def _x():
    return np.arange(8, dtype=np.float32).reshape(2, 4) - 3.0


def test_functional_model_passes_a_scaled_tensor_between_layers():
    inp = keras.Input((4,))
    mid = ToScaled(2.0**4)(inp)
    assert type(mid) is ScaledTensor
    out = FromScaled()(ScaledDouble()(mid))
    model = keras.Model(inp, out)
    x = _x()
    np.testing.assert_array_equal(to_np(model(x)), 2 * x)
    np.testing.assert_array_equal(model.predict(x, verbose=0), 2 * x)


def test_functional_model_with_a_scaled_tensor_output_returns_values():
    """A model built on a ScaledTensor output ends with a `ToArray` of its
    own (`install_plain_outputs`): it returns the represented values."""
    inp = keras.Input((4,))
    model = keras.Model(inp, ToScaled(2.0**-3)(inp))
    assert type(model.layers[-1]).__name__ == "ToArray"
    out = model(_x())
    assert type(out) is not ScaledTensor
    np.testing.assert_array_equal(to_np(out), _x())


# Keras's Layer.__call__ maps `dtype_policy.convert_input` over every leaf
# of the input structure, so a layer whose compute dtype is float16 casts
# the float32 scale to float16 (2**20 -> inf, 2**-30 -> 0); the ScaledTensor
# rebuilt by keras.tree shows float32 again, hiding the damage. Either the
# public `autocast=False` constructor argument or the private attribute
# `layer._convert_input_args = False` switches that conversion off.
@pytest.mark.parametrize("scale", [2.0**20, 2.0**-30])
def test_keras_autocast_of_float16_layer_input_destroys_the_scale(scale):
    inp = keras.Input((4,))
    consumer = FromScaled(dtype="mixed_float16")
    model = keras.Model(inp, consumer(ToScaled(scale)(inp)))
    got = to_np(model(_x() * scale))
    assert not np.array_equal(got, _x() * scale)


@pytest.mark.parametrize("setting", ["autocast_false", "no_convert_input"])
@pytest.mark.parametrize("scale", [2.0**20, 2.0**-30])
def test_float16_layer_without_input_conversion_keeps_the_scale(scale,
                                                                 setting):
    inp = keras.Input((4,))
    if setting == "autocast_false":
        consumer = FromScaled(dtype="mixed_float16", autocast=False)
    else:
        consumer = FromScaled(dtype="mixed_float16")
        consumer._convert_input_args = False
    model = keras.Model(inp, consumer(ToScaled(scale)(inp)))
    x = _x() * scale
    np.testing.assert_array_equal(to_np(model(x)), x)
    np.testing.assert_array_equal(model.predict(x, verbose=0), x)
