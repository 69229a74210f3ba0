"""What keras_scalify skips, what it saturates and what it refuses.

    KERAS_BACKEND=jax python benchmarks/reliability.py

Prints one Markdown table (the README's "Reliability" section) for the
backend it runs on: injected faults under `model.fit`-style training
(`train_on_batch`) with `ScaledOptimizer`, each checked bit for bit; tiny
inputs under FP8; inputs whose magnitude lives in the scale; where
saturation happens; and bad arguments, each checked for an error that names
the argument. Every row is counted here, nothing is typed in.
"""

import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_scalify as ksc  # noqa: E402
from keras_scalify.backend import dispatch  # noqa: E402
from fp8_matmul import cpu_model  # noqa: E402

POLICIES = ("scaled_float32", "scaled_fp16", "scaled_fp8")


def _model(policy, bias=0.0, epsilon=1e-3):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = ksc.layers.AsScaled(dtype=policy)(inputs)
    init = keras.initializers.Constant(bias)
    h = ksc.layers.ScaledDense(16, activation="relu", bias_initializer=init, dtype=policy)(h)
    h = ksc.layers.ScaledLayerNormalization(epsilon=epsilon, dtype=policy)(h)
    h = ksc.layers.ScaledDense(4, dtype=policy)(h)
    model = keras.Model(inputs, ksc.layers.ToArray(dtype=policy)(h))
    opt = ksc.ScaledOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=opt, loss="mse")
    return model, opt


def _data(n=32):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 8)).astype("float32")
    return x, (x[:, :4] * 0.5).astype("float32")


def _state(model, opt):
    """Everything a skipped step must leave as it was (grad scales and
    counters excepted)."""
    skip = {id(opt.skipped_steps), id(opt._seed_generator.state), id(opt._iterations)}
    vs = [v for v in model.weights if "grad_scale" not in v.path]
    vs += [v for v in opt.variables if id(v) not in skip]
    return [np.array(ops.convert_to_numpy(v)) for v in vs]


def _skipped_bit_for_bit(policy, corrupt):
    model, opt = _model(policy)
    x, y = _data()
    for i in range(4):
        model.train_on_batch(x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8])
    before = _state(model, opt)
    bx, by = corrupt(x[:8].copy(), y[:8].copy())
    model.train_on_batch(bx, by)
    same = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, _state(model, opt)))
    skipped = int(ops.convert_to_numpy(opt.skipped_steps)) == 1
    model.train_on_batch(x[:8], y[:8])
    goes_on = int(ops.convert_to_numpy(opt.skipped_steps)) == 1 and np.all(
        np.isfinite(model.predict_on_batch(x[:8]))
    )
    return same and skipped and goes_on


def _set(value, where):
    def corrupt(x, y):
        (x if where == "x" else y)[0, 0] = value
        return x, y

    return corrupt


FAULTS = [
    ("NaN in the inputs", _set(np.nan, "x")),
    ("inf in the inputs", _set(np.inf, "x")),
    ("NaN in the targets", _set(np.nan, "y")),
    ("target 1e30 (loss inf, gradient finite)", _set(1e30, "y")),
]


def faults():
    rows = []
    for name, corrupt in FAULTS:
        ok = sum(_skipped_bit_for_bit(p, corrupt) for p in POLICIES)
        rows.append((f"{name}: step skipped bit for bit, training goes on", f"{len(POLICIES)} policies", f"{ok}/{len(POLICIES)}"))
    return rows


def beyond_format():
    """Finite inputs far outside float16: carried by the scale, step taken."""
    ok, cases = 0, 0
    for policy in POLICIES[1:]:
        for factor in (1e30, 2.0**20, 2.0**-30):
            model, opt = _model(policy)
            x, y = _data()
            loss = model.train_on_batch(x[:8] * np.float32(factor), y[:8])
            cases += 1
            ok += bool(np.isfinite(loss)) and int(ops.convert_to_numpy(opt.skipped_steps)) == 0
    return [("inputs ×1e30, ×2^20, ×2^-30 under fp16/fp8: step taken, loss finite", str(cases), f"{ok}/{cases}")]


def tiny_inputs_fp8(steps=100, eps=1e-3, bias=0.0):
    model, opt = _model("scaled_fp8", bias, eps)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((steps * 16, 8)).astype("float32")
    y = x[:, :4] * 0.5
    model.fit(x * np.float32(2.0**-16), y, batch_size=16, epochs=1, verbose=0)
    skipped = int(ops.convert_to_numpy(opt.skipped_steps))
    dead = ", first layer's ReLUs dead (bias -10)" if bias < 0 else ""
    what = f"inputs ×2^-16 under scaled_fp8, LayerNorm epsilon {eps:g}{dead}: steps skipped (target ≤ 2)"
    return [(what, f"{steps} steps", str(skipped))]


def magnitudes(ks=(-100, -60, -20, 0, 20, 60, 100)):
    """ScaledDense on `as_scaled(x, 2**k)`, fresh weights: forward and input
    gradient against float64."""
    tol = {"scaled_fp16": 5e-3, "scaled_fp8": 0.1}
    rng = np.random.default_rng(2)
    x0 = rng.standard_normal((4, 8)).astype("float32")
    ct = rng.standard_normal((4, 16)).astype("float32")
    ok, cases = 0, 0
    for policy, t in tol.items():
        keras.utils.set_random_seed(3)
        layer = ksc.layers.ScaledDense(16, dtype=policy)
        layer(ksc.as_scaled(x0, 1.0))
        w = layer._kernel.numpy().astype(np.float64)
        for k in ks:
            s = np.float32(2.0**k)
            ct_t = ops.convert_to_tensor(ct)

            def loss(xd):
                return ops.sum(ops.multiply(ksc.to_array(layer(ksc.as_scaled(xd, s))), ct_t))

            _, (g,) = dispatch.value_and_grad(loss)(ops.convert_to_tensor(x0))
            y = np.asarray(ops.convert_to_numpy(ops.stop_gradient(ksc.to_array(layer(ksc.as_scaled(x0, s))))), np.float64)
            dx = np.asarray(ops.convert_to_numpy(g), np.float64) / float(s)
            y_ref = (x0.astype(np.float64) * 2.0**k) @ w
            dx_ref = ct.astype(np.float64) @ w.T
            rel = [np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in ((y, y_ref), (dx, dx_ref))]
            cases += 1
            ok += all(np.isfinite(r) and r < t for r in rel)
    return [("ScaledDense on inputs at 2^k, k in [-100, 100], fp16/fp8: forward and input gradient match float64", str(cases), f"{ok}/{cases}")]


def saturation():
    def data(values, dtype):
        x = ksc.ops.cast(ksc.as_scaled(np.float32(values), 1.0), dtype)
        return np.asarray(ops.convert_to_numpy(ops.cast(x.data, "float32")))

    d16 = data([1e5, np.inf, np.nan], "float16")
    d8 = data([1e5, np.inf], "float8_e4m3fn")
    ok16 = np.isinf(d16[0]) and np.isinf(d16[1]) and np.isnan(d16[2])
    ok8 = d8[0] == 448.0 and np.isnan(d8[1])
    return [
        ("data 1e5, inf, NaN cast to float16: overflow is inf, faults kept (no clipping)", "3", "ok" if ok16 else "FAIL"),
        ("data 1e5 cast to E4M3 (an FP8 GEMM operand): saturates to 448; inf stays a fault (NaN)", "2", "ok" if ok8 else "FAIL"),
    ]


def _names_argument(fn, arg):
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"`{arg}`" in str(e) or f"'{arg}'" in str(e) or arg in str(e)
    return False


BAD = [
    ("ScaledTensor(data, scale=3)", lambda: ksc.ScaledTensor(np.ones(2, "float32"), np.float32(3.0), np.float32(1.0)), "scale"),
    ("ScaledTensor(None, 1)", lambda: ksc.ScaledTensor(None, np.float32(1.0), np.float32(1.0)), "data"),
    ("as_scaled(x, 2^-160)", lambda: ksc.as_scaled(np.ones(2, "float32"), 2.0**-160), "scale"),
    ("as_scaled(None)", lambda: ksc.as_scaled(None), "x"),
    ("as_scaled('a')", lambda: ksc.as_scaled("a"), "x"),
    ("ops.add(x, None)", lambda: ksc.ops.add(ksc.as_scaled(np.ones(2, "float32")), None), "x2"),
    ("ops.exp(None)", lambda: ksc.ops.exp(None), "x"),
    ("ScaledDTypePolicy('scaled_fp9')", lambda: ksc.ScaledDTypePolicy("scaled_fp9"), "scaled_fp9"),
    ("ScaledOptimizer(stochastic_rounding='no')", lambda: ksc.ScaledOptimizer(keras.optimizers.SGD(), stochastic_rounding="no"), "stochastic_rounding"),
    ("ScaledOptimizer(seed='abc')", lambda: ksc.ScaledOptimizer(keras.optimizers.SGD(), seed="abc"), "seed"),
    ("ScaledOptimizer(state_dtype='nonsense')", lambda: ksc.ScaledOptimizer(keras.optimizers.SGD(), state_dtype="nonsense"), "state_dtype"),
    ("ScaledDense(4)(a scalar)", lambda: ksc.layers.ScaledDense(4)(np.float32(1.0)), "min_ndim"),
]


def bad_input():
    ok = sum(_names_argument(fn, arg) for _, fn, arg in BAD)
    return [("bad arguments (" + ", ".join(f"`{n}`" for n, _, _ in BAD[:4]) + ", ...): raise early, naming the argument", str(len(BAD)), f"{ok}/{len(BAD)}")]


def main():
    rows = faults() + beyond_format()
    rows += tiny_inputs_fp8(eps=1e-12) + tiny_inputs_fp8(eps=1e-3) + tiny_inputs_fp8(eps=1e-3, bias=-10.0)
    rows += magnitudes() + saturation() + bad_input()
    print(f"backend: {keras.backend.backend()}, CPU: {cpu_model()} ({platform.machine()})\n")
    print("| what is tried | cases | result |")
    print("|---|---|---|")
    for what, n, result in rows:
        print(f"| {what} | {n} | {result} |")


if __name__ == "__main__":
    main()
