"""Scale propagation in a few ops: FP16 values and gradients that plain
FP16 loses, kept by keras_scalify.

    python examples/scale_propagation.py            # any KERAS_BACKEND

Prints, for a chain of 8 float16 matmuls on values ~1e-6 and for the
gradients (~1e-8) of a 16-layer float16 tanh MLP, the relative error of
plain float16 and of scaled float16 against float32.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_scalify as ksc  # noqa: E402
from keras_scalify import backend as kb  # noqa: E402


def rel_err(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def np_(x):
    return np.asarray(ops.convert_to_numpy(ops.cast(x, "float32")))


def matmul_chain(rng, n=8, width=64, tiny=2.0**-26):
    """Values ~1.5e-8 through 8 matmuls: the scales carry the magnitude."""
    w_scale = 1.0 / np.sqrt(width)
    x = rng.standard_normal((16, width))
    ws = [rng.standard_normal((width, width)) for _ in range(n)]
    ref = x * tiny
    for w in ws:
        ref = ref @ (w * w_scale)
    plain = ops.convert_to_tensor((x * tiny).astype("float16"))
    scaled = ksc.as_scaled(x.astype("float16"), tiny)
    rms = []
    for w in ws:
        plain = ops.matmul(plain, ops.convert_to_tensor((w * w_scale).astype("float16")))
        scaled = ksc.ops.matmul(scaled, ksc.as_scaled(w.astype("float16"), w_scale))
        rms.append(float(np.sqrt(np.mean(np_(scaled.data) ** 2))))
    return {
        "true magnitude": float(np.sqrt(np.mean(ref**2))),
        "plain float16 error": rel_err(np_(plain), ref),
        "scaled float16 error": rel_err(np_(ksc.to_array(scaled)), ref),
        "scaled data RMS range": (min(rms), max(rms)),
        "final scale": float(np_(scaled.scale)),
    }


def tiny_gradients(rng, depth=16, width=64, batch=32, factor=2.0**-27, steps=4):
    """Gradients ~1e-8 of a 16-layer float16 tanh MLP, no loss scaling."""
    w_scale = np.float32(1.0 / np.sqrt(width))
    ws = [
        (rng.standard_normal((width, width)) * 1.5).astype("float16")
        for _ in range(depth)
    ]
    x = rng.standard_normal((batch, width)).astype("float16")
    up = ops.convert_to_tensor(rng.standard_normal((batch, width)).astype("float32"))

    def ref_loss(*w):
        h = ops.convert_to_tensor(x.astype("float32"))
        for t in w:
            h = ops.tanh(ops.matmul(h, t))
        return ops.sum(h * up) * factor

    _, ref = kb.value_and_grad(ref_loss)(
        *[ops.convert_to_tensor(w.astype("float32") * w_scale) for w in ws]
    )

    def plain_loss(*w):
        h = ops.convert_to_tensor(x)
        for t in w:
            h = ops.tanh(ops.matmul(h, t))
        return ops.sum(ops.cast(h, "float32") * up) * factor

    _, plain = kb.value_and_grad(plain_loss)(
        *[ops.convert_to_tensor((w.astype("float32") * w_scale).astype("float16")) for w in ws]
    )

    def scaled_loss(state, gs, *w):
        h = ksc.ops.dynamic_rescale_l2_grad(ksc.as_scaled(x), state)
        for i, t in enumerate(w):
            h = ksc.ops.tanh(ksc.ops.matmul(h, ksc.ScaledTensor(t, w_scale, ops.stop_gradient(gs[i]))))
        return ops.sum(ksc.to_array(h) * up) * factor

    state, gs = ops.zeros((), "float32"), ops.ones((depth,), "float32")
    vg = kb.value_and_grad(scaled_loss)
    for _ in range(steps):  # delayed grad scales calibrate in ~2 steps
        _, grads = vg(state, gs, *[ops.convert_to_tensor(w) for w in ws])
        decoded = [np_(c) * float(np_(gs[i])) for i, c in enumerate(grads[2:])]
        gs = ops.stack(
            [ksc.ops.rescaling.next_grad_scale(c, gs[i], "l2") for i, c in enumerate(grads[2:])]
        )
        state = grads[0]
    ref = [np_(r) for r in ref]
    return {
        "true gradient RMS": float(np.sqrt(np.mean(ref[0] ** 2))),
        "plain float16 zeros": float(np.mean([np.mean(np_(g) == 0) for g in plain])),
        "plain float16 error": max(rel_err(np_(g), r) for g, r in zip(plain, ref)),
        "scaled float16 error": max(rel_err(d, r) for d, r in zip(decoded, ref)),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"backend: {keras.backend.backend()}, seed {args.seed}")
    print("\n8 float16 matmuls on values ~1.5e-8 (input scale 2^-26)")
    for k, v in matmul_chain(rng).items():
        print(f"  {k:24s} {v}")
    print("\ngradients of a 16-layer float16 tanh MLP, loss × 2^-27")
    for k, v in tiny_gradients(rng).items():
        print(f"  {k:24s} {v}")


if __name__ == "__main__":
    main()
