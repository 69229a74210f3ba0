"""FP8 GEMM dispatch: every route agrees with the simulation, and tests
prove which route ran."""

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

import keras_scalify as ksc
from keras_scalify import backend as kb
from keras_scalify.backend import fp8
from keras_scalify.backend import fp8_rounding
from tests.conftest import on_gpu
from tests.conftest import to_np

BACKEND = keras.config.backend()


def _native_route():
    if BACKEND == "jax":
        import jax

        # On CPU, XLA upcasts FP8 dot operands to float32: the FP8 values
        # go to a bfloat16 dot instead (exact, and faster where the CPU
        # has bfloat16 units).
        if jax.default_backend() == "cpu":
            return "jax-dot_general-bf16"
        return "jax-dot_general-fp8"
    if BACKEND == "tensorflow":
        import tensorflow as tf

        # The 2-D GEMMs of these tests, on a CPU: bfloat16 as on jax.
        return "tensorflow-xla" if tf.config.list_physical_devices("GPU") else "tensorflow-xla-bf16"
    import torch

    # torch's CPU `_scaled_mm` is a slow reference kernel: the simulation
    # runs on CPU (the torch route itself is tested on CPU below).
    return "torch-scaled_mm" if torch.cuda.is_available() else "simulate"


NATIVE = _native_route()


def _auto_route():
    """"auto": native, except on a CPU without bfloat16 units (bfloat16
    GEMMs slower than float32 there), where it simulates."""
    if NATIVE in ("jax-dot_general-bf16", "tensorflow-xla-bf16") and not fp8.cpu_has_bfloat16():
        return "simulate" if BACKEND == "jax" else "tensorflow-xla-f32"
    return NATIVE


AUTO = _auto_route()


def _loss_and_grads(route, x, w, up, einsum=None, compiled=False):
    def loss(xd, wd):
        xs, ws = ksc.as_scaled(xd), ksc.as_scaled(wd, 2.0**-4)
        if einsum is None:
            y = ksc.ops.fp8_matmul(xs, ws, route=route)
        else:
            y = ksc.ops.fp8_einsum(einsum, xs, ws, route=route)
        return ops.sum(ksc.to_array(y) * ops.convert_to_tensor(up))

    vg = kb.value_and_grad(loss)
    if compiled:
        vg = kb.jit(vg)
    v, g = vg(ops.convert_to_tensor(x), ops.convert_to_tensor(w))
    return [to_np(v)] + [to_np(t) for t in g]


def _tol():
    """Native route vs simulation: each product of FP8 values is exact in
    float32, so on a CPU only the summation order differs (1e-6); an
    H100's FP8 GEMMs return ~14 significant bits (seen: outputs on a 2^-16
    grid at 0.25), so 2^-11 there."""
    return 2.0**-11 if on_gpu() else 1e-6


SHAPES = [((8, 32), (32, 48)), ((2, 4, 64), (64, 16)), ((5, 100), (100, 24))]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("x_shape,w_shape", SHAPES, ids=["2d", "3d", "K100_N24"])
def test_native_route_matches_simulation(x_shape, w_shape, compiled, rng):
    x = rng.standard_normal(x_shape).astype("float32")
    w = rng.standard_normal(w_shape).astype("float32")
    up = rng.standard_normal(x_shape[:-1] + w_shape[-1:]).astype("float32")
    sim = _loss_and_grads("simulate", x, w, up, compiled=compiled)
    nat = _loss_and_grads("native", x, w, up, compiled=compiled)
    # On CUDA `_scaled_mm` needs K and N in multiples of 16: K = 100 falls
    # back to the simulation (test_torch_route_falls_back_...).
    unsupported = NATIVE == "torch-scaled_mm" and (w_shape[0] % 16 or w_shape[1] % 16)
    assert fp8.last_fp8_route() == ("simulate" if unsupported else NATIVE)
    for a, b in zip(nat, sim):
        np.testing.assert_allclose(a, b, rtol=_tol(), atol=_tol() * np.max(np.abs(b)))


def test_einsum_route_matches_simulation(rng):
    x = rng.standard_normal((2, 8, 16)).astype("float32")
    w = rng.standard_normal((16, 4, 8)).astype("float32")
    up = rng.standard_normal((2, 8, 4, 8)).astype("float32")
    sim = _loss_and_grads("simulate", x, w, up, einsum="abc,cde->abde")
    nat = _loss_and_grads("native", x, w, up, einsum="abc,cde->abde")
    for a, b in zip(nat, sim):
        np.testing.assert_allclose(a, b, rtol=_tol(), atol=_tol() * np.max(np.abs(b)))


def test_simulation_quantizes_forward_e4m3_and_backward_e5m2(rng):
    """The simulated route is the reference: its forward is exactly the
    float32 product of E4M3-rounded operands (and it differs from the
    unquantized product)."""
    x = rng.standard_normal((8, 32)).astype("float32")
    w = rng.standard_normal((32, 16)).astype("float32")
    def q(t):
        t8 = ksc.core.saturating_cast(ops.convert_to_tensor(t), "float8_e4m3fn")
        return to_np(ops.cast(t8, "float32"))

    y = to_np(ksc.to_array(ksc.ops.fp8_matmul(ksc.as_scaled(x), ksc.as_scaled(w), route="simulate")))
    np.testing.assert_allclose(y, q(x) @ q(w), rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(y - x @ w)) > 1e-3


@pytest.mark.parametrize("route", ["simulate", "native"])
def test_overflowing_inputs_stay_finite(route, rng):
    x = rng.standard_normal((8, 32)).astype("float32")
    x[0, :5] = 1e30
    x[1, :5] = -1e30
    w = rng.standard_normal((32, 16)).astype("float32")
    up = (rng.standard_normal((8, 16)) * 1e30).astype("float32")
    for t in _loss_and_grads(route, x, w, up):
        assert np.all(np.isfinite(t))


def _simulated(gemm, *operands):
    """A GEMM of the simulation's `Gemms` (which take operands already
    rounded: `quantize`) on unrounded operands: `gemm` is "forward" or
    "grad_a"."""
    sim = fp8._route_gemms("simulate", "ak,kn->an", "float8_e4m3fn", "float8_e5m2")
    qa, qb, qg = sim.quantize
    first = qa if gemm == "forward" else qg
    return getattr(sim, gemm)(first(operands[0]), qb(operands[1]))


def _count_calls(monkeypatch, module, name):
    """Record the `dtype` argument of every call to `module.name`."""
    calls = []
    original = getattr(module, name)

    def counting(x, dtype):
        calls.append(dtype)
        return original(x, dtype)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_simulation_rounds_each_operand_once(monkeypatch, rng):
    # `a` and `b` rounded once in the forward (and kept for the backward),
    # the cotangent once for both backward GEMMs: 3 roundings, not 6.
    calls = _count_calls(monkeypatch, fp8, "quantized_float32")
    x = rng.standard_normal((8, 32)).astype("float32")
    w = rng.standard_normal((32, 16)).astype("float32")
    up = rng.standard_normal((8, 16)).astype("float32")
    _loss_and_grads("simulate", x, w, up)
    assert calls == ["float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.skipif(BACKEND != "torch", reason="torch route only")
def test_torch_scaled_mm_is_called_for_all_three_gemms(monkeypatch, rng):
    import torch

    # The route is taken on CUDA only; forced here to run its GEMMs on CPU.
    monkeypatch.setattr(fp8, "_torch_route_ok", lambda *a: True)
    casts = _count_calls(monkeypatch, fp8_rounding, "saturating_cast")
    calls = []
    original = torch._scaled_mm

    def counting(a, b, *args, **kwargs):
        calls.append((a.dtype, b.dtype, b.stride()))
        return original(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    x = rng.standard_normal((8, 32)).astype("float32")
    w = rng.standard_normal((32, 16)).astype("float32")
    up = rng.standard_normal((8, 16)).astype("float32")
    _loss_and_grads("native", x, w, up)
    assert len(calls) == 3
    # Each operand cast to FP8 once: x and w forward, the cotangent backward.
    assert casts == ["float8_e4m3fn", "float8_e4m3fn", "float8_e5m2"]
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert calls[0][:2] == (e4, e4)  # forward
    assert sorted(str(c[:2]) for c in calls[1:]) == sorted(str(p) for p in [(e5, e4), (e4, e5)])
    # Second operand column-major (stride of dim 0 is 1) for cuBLASLt.
    assert all(c[2][0] == 1 for c in calls)


@pytest.mark.skipif(BACKEND != "torch", reason="torch route only")
def test_torch_route_matches_simulation_and_is_cuda_only(monkeypatch, rng):
    import torch

    eq = "ak,kn->an"
    if not torch.cuda.is_available():
        assert fp8.resolve_route(eq, (8, 64), (64, 32)) == "simulate"
    monkeypatch.setattr(fp8, "_torch_route_ok", lambda *a: True)
    x = rng.standard_normal((2, 4, 32)).astype("float32")
    w = rng.standard_normal((32, 48)).astype("float32")
    up = rng.standard_normal((2, 4, 48)).astype("float32")
    sim = _loss_and_grads("simulate", x, w, up)
    nat = _loss_and_grads("native", x, w, up)
    assert fp8.last_fp8_route() == "torch-scaled_mm"
    for a, b in zip(nat, sim):
        np.testing.assert_allclose(a, b, rtol=_tol(), atol=_tol() * np.max(np.abs(b)))


@pytest.mark.skipif(BACKEND != "torch", reason="torch route only")
def test_torch_route_falls_back_when_cuda_shape_is_unsupported(monkeypatch):
    """Route selection under CUDA rules (checked on CPU by faking the device)."""
    import torch
    import keras.src.backend.torch.core as tcore

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tcore, "get_device", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    eq = "ak,kn->an"
    assert fp8.resolve_route(eq, (8, 64), (64, 32)) == "torch-scaled_mm"
    assert fp8.resolve_route(eq, (8, 100), (100, 24)) == "simulate"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert fp8.resolve_route(eq, (8, 64), (64, 32)) == "simulate"


@pytest.mark.skipif(BACKEND != "jax", reason="jax route only")
@pytest.mark.parametrize(
    "route, operand", [("jax-dot_general-fp8", "f8E4M3FN"), ("jax-dot_general-bf16", "bf16")]
)
def test_jax_dots_take_the_route_operands(route, operand, rng):
    """Each jax route's forward dot: FP8 operands (GPU), or bfloat16 ones
    holding the FP8 values (CPU); float32 results either way."""
    import jax

    x = ops.convert_to_tensor(rng.standard_normal((8, 32)).astype("float32"))
    w = ops.convert_to_tensor(rng.standard_normal((32, 16)).astype("float32"))
    gemms = fp8._route_gemms(route, "ak,kn->an", "float8_e4m3fn", "float8_e5m2")

    text = jax.jit(gemms.forward).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots and all(f"tensor<8x32x{operand}>" in line for line in dots), dots
    assert all("-> tensor<8x16xf32>" in line for line in dots), dots
    if operand == "bf16":
        # Rounded to E4M3 in float32 arithmetic: no FP8 tensor on the CPU.
        assert "f8E4M3FN" not in text
    np.testing.assert_allclose(
        to_np(gemms.forward(x, w)), to_np(_simulated("forward", x, w)), rtol=1e-6, atol=1e-6
    )


@pytest.mark.skipif(BACKEND != "jax", reason="jax route only")
def test_jax_route_follows_the_platform():
    import jax

    want = "jax-dot_general-bf16" if jax.default_backend() == "cpu" else "jax-dot_general-fp8"
    assert fp8.resolve_route("ak,kn->an", (2, 16), (16, 16), "native") == want


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tensorflow route only")
@pytest.mark.parametrize(
    "route, dot_operand",
    [("tensorflow-xla", "f32[8,32]"), ("tensorflow-xla-bf16", "bf16[8,32]"), ("tensorflow-xla-f32", "f32[8,32]")],
)
def test_tensorflow_routes_are_compiled_with_xla(route, dot_operand, rng):
    """Rounding and GEMM in one XLA function; FP8 tensors only on the
    route meant for GPUs (XLA's FP8 GEMM rewrite needs them)."""
    x = ops.convert_to_tensor(rng.standard_normal((8, 32)).astype("float32"))
    w = ops.convert_to_tensor(rng.standard_normal((32, 16)).astype("float32"))
    gemms = fp8._route_gemms(route, "ak,kn->an", "float8_e4m3fn", "float8_e5m2")
    y = gemms.forward(x, w)
    fn = fp8.tf_xla_function("ak,kn->an", route)
    assert fn is not None
    hlo = fn.experimental_get_compiler_ir(x, w)(stage="hlo")
    assert ("f8e4m3fn" in hlo.lower()) == (route == "tensorflow-xla")
    dots = [line for line in hlo.splitlines() if " dot(" in line]
    assert dots and all(dot_operand in line and "f32[8,16]" in line for line in dots), dots
    np.testing.assert_allclose(to_np(y), to_np(_simulated("forward", x, w)), rtol=1e-6, atol=1e-6)
    # The backward GEMMs take the E5M2 cotangent: their own XLA functions.
    g = ops.convert_to_tensor(rng.standard_normal((8, 16)).astype("float32"))
    np.testing.assert_allclose(to_np(gemms.grad_a(g, w)), to_np(_simulated("grad_a", g, w)), rtol=1e-6, atol=1e-6)
    assert fp8.tf_xla_function("an,kn->ak", route, ("float8_e5m2", "float8_e4m3fn")) is not None


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tensorflow route only")
def test_tensorflow_matmul_flags():
    assert fp8.tf_matmul_flags("mk,kn->mn") == (False, False)
    assert fp8.tf_matmul_flags("mn,kn->mk") == (False, True)
    assert fp8.tf_matmul_flags("mk,mn->kn") == (True, False)
    assert fp8.tf_matmul_flags("mk,kn->nm") is None
    assert fp8.tf_matmul_flags("abc,cd->abd") is None


def test_cpu_bfloat16_units_are_read_from_the_cpu_flags(tmp_path):
    def has(flags):
        path = tmp_path / f"cpuinfo{len(flags)}"
        path.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
        return fp8.cpu_has_bfloat16(str(path))

    assert has("avx2 avx512f avx512_bf16")
    assert has("avx2 amx_bf16 amx_tile")
    assert not has("avx2 fma f16c")
    assert not fp8.cpu_has_bfloat16(str(tmp_path / "missing"))


def test_auto_route_simulates_on_a_cpu_without_bfloat16_units(monkeypatch):
    eq = "ak,kn->an"
    assert fp8.resolve_route(eq, (2, 16), (16, 16), "auto") == AUTO
    if NATIVE not in ("jax-dot_general-bf16", "tensorflow-xla-bf16"):
        pytest.skip(f"native route {NATIVE} is not a CPU bfloat16 route")
    monkeypatch.setattr(fp8, "cpu_has_bfloat16", lambda: False)
    want = "simulate" if BACKEND == "jax" else "tensorflow-xla-f32"
    assert fp8.resolve_route(eq, (2, 16), (16, 16), "auto") == want
    assert fp8.resolve_route(eq, (2, 16), (16, 16), "native") == NATIVE
    monkeypatch.setattr(fp8, "cpu_has_bfloat16", lambda: True)
    assert fp8.resolve_route(eq, (2, 16), (16, 16), "auto") == NATIVE


def test_simulation_rounding_is_saturating_cast_bit_for_bit(monkeypatch):
    # Each backend's rounding (jax: float32 arithmetic; torch: an add and
    # subtract of a per-element power-of-two constant, a chunk at a time:
    # chunks of 1000 here, the last one partial) against its own saturating cast, on values
    # over 16 decades, float32 bit patterns, and each format's ties,
    # boundaries, subnormals, ±0, ±inf and NaN.
    from tests.core.test_formats import _edge_values

    monkeypatch.setattr(fp8_rounding, "ELEMENTWISE_CHUNK", 1000)
    x = _edge_values()
    assert x.size % 1000
    for dtype in ("float8_e4m3fn", "float8_e5m2"):
        for source in ("float32", "float16", "bfloat16", "float64"):
            t = ops.cast(ops.convert_to_tensor(x), source)
            got = ops.convert_to_numpy(fp8_rounding.quantized_float32(t, dtype))
            want = ops.convert_to_numpy(ops.cast(ksc.core.saturating_cast(t, dtype), "float32"))
            assert got.dtype == np.float32 and got.shape == x.shape
            same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
            assert same.all(), (dtype, source, x[~same][:5], got[~same][:5], want[~same][:5])
    # A float64 input beyond float32's range is clipped, not made inf
    # (where the backend keeps float64: jax without x64 does not).
    big = ops.convert_to_tensor(np.array([1e300, -1e300, 3.0], np.float64))
    if ksc.core.formats.dtype_name(big.dtype) == "float64":
        got = ops.convert_to_numpy(fp8_rounding.quantized_float32(big, "float8_e4m3fn"))
        np.testing.assert_array_equal(got, np.float32([448.0, -448.0, 3.0]))
    empty = fp8_rounding.quantized_float32(ops.zeros((0, 3)), "float8_e4m3fn")
    assert tuple(empty.shape) == (0, 3)
    # Compiled (`torch.compile` casts there and back), same bits.
    t = ops.convert_to_tensor(x)
    got = ops.convert_to_numpy(kb.torch_compile(lambda v: fp8_rounding.quantized_float32(v, "float8_e5m2"))(t))
    want = ops.convert_to_numpy(fp8_rounding.quantized_float32(t, "float8_e5m2"))
    assert ((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))).all()


@pytest.mark.skipif(BACKEND != "torch", reason="torch route only")
def test_e5m2_from_bits_is_the_saturating_cast_bit_for_bit(monkeypatch):
    """The E5M2 cast the torch route takes under `torch.compile` on CUDA
    (where the compiled cast saturates ±inf): built from float16 bits,
    equal to `saturating_cast` bit for bit, ±inf and NaN kept."""
    import torch

    from tests.core.test_formats import _edge_values

    x = ops.convert_to_tensor(_edge_values())
    want = ksc.core.saturating_cast(x, "float8_e5m2").view(torch.uint8)
    got = fp8_rounding.e5m2_from_bits(ksc.core.saturating_round(x, "float8_e5m2")).view(torch.uint8)
    nan = torch.isnan(x)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.isnan(got.view(torch.float8_e5m2).float()[nan]).all()
    inf = ops.convert_to_tensor(np.float32([np.inf, -np.inf, 1e9, 3.0]))
    monkeypatch.setattr(fp8_rounding, "_compiled_cast_saturates_inf", lambda x: True)
    out = fp8_rounding._torch_saturating_cast(inf, "float8_e5m2").float()
    np.testing.assert_array_equal(out.cpu().numpy(), [np.inf, -np.inf, 57344.0, 3.0])


def test_simulation_rounds_in_float32_arithmetic_on_jax(rng):
    """jax (always compiled) rounds to FP8 in float32 arithmetic, TF
    casts to FP8 and back, torch rounds the bit pattern. Same values."""
    x = rng.standard_normal((8, 32)).astype("float32") * 100
    got = to_np(fp8_rounding.quantized_float32(ops.convert_to_tensor(x), "float8_e4m3fn"))
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    if BACKEND == "jax":
        import jax

        text = jax.jit(lambda t: fp8_rounding.quantized_float32(t, "float8_e5m2")).lower(x).as_text()
        assert "f8E5M2" not in text and "round_nearest_even" in text


def test_route_setting_and_bad_route():
    assert fp8.get_fp8_route() == "auto"
    with fp8.fp8_route("simulate"):
        assert fp8.resolve_route("ak,kn->an", (2, 16), (16, 16)) == "simulate"
    assert fp8.get_fp8_route() == "auto"
    with pytest.raises(ValueError, match="route"):
        fp8.set_fp8_route("fastest")


def test_unsupported_einsum_is_a_clear_error(rng):
    x = ksc.as_scaled(rng.standard_normal((4, 8)).astype("float32"))
    w = ksc.as_scaled(rng.standard_normal((8, 3)).astype("float32"))
    with pytest.raises(ValueError, match="FP8"):
        ksc.ops.fp8_einsum("ab,bc->c", x, w)


def test_fp8_matmul_needs_a_2d_weight(rng):
    x = ksc.as_scaled(rng.standard_normal((2, 4, 8)).astype("float32"))
    with pytest.raises(ValueError, match="x2"):
        ksc.ops.fp8_matmul(x, x)


def test_layer_reports_its_route(rng):
    layer = ksc.layers.ScaledDense(16, dtype="scaled_fp8")
    x = rng.standard_normal((4, 32)).astype("float32")
    layer(x)
    assert layer.fp8_route == AUTO
    with fp8.fp8_route("native"):
        layer(x)
    assert layer.fp8_route == NATIVE
    with fp8.fp8_route("simulate"):
        layer(x)
    assert layer.fp8_route == "simulate"
    plain = ksc.layers.ScaledDense(16)
    plain(x)
    assert plain.fp8_route is None


@pytest.mark.skipif(not on_gpu(), reason="needs a GPU with FP8 GEMMs (CI has none)")
def test_gpu_fp8_routes(rng):
    """On a GPU: the native route is chosen, E5M2 × E4M3 backward GEMMs run,
    layouts are accepted, and the results match the simulation."""
    for x_shape, w_shape in [((64, 128), (128, 256)), ((64, 100), (100, 24))]:
        x = rng.standard_normal(x_shape).astype("float32")
        w = rng.standard_normal(w_shape).astype("float32")
        up = rng.standard_normal(x_shape[:-1] + w_shape[-1:]).astype("float32")
        sim = _loss_and_grads("simulate", x, w, up)
        nat = _loss_and_grads("native", x, w, up)
        for a, b in zip(nat, sim):
            np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * np.max(np.abs(b)))
