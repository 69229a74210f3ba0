"""Training memory per device of a keras-hub Llama under ModelParallel.

    KERAS_BACKEND=jax python benchmarks/memory_per_device.py [--d-model 2048]
        [--layers 16] [--heads 32] [--kv-heads 8] [--vocab 32000]
        [--mesh 2 4]

Bytes per device of the weights, their gradients and the AdamW state when
the model is sharded with `keras.distribution.ModelParallel` and keras-hub's
own `LlamaBackbone.get_layout_map` on a (batch, model) mesh, for:

- Keras `mixed_bfloat16`: float32 variables, float32 gradients and slots;
- Keras float8 (`quantize("float8")` on that model): the same float32
  kernels (Keras trains float8 with float32 weights and per-tensor scales;
  its amax histories, 3 × 1,024 float32 per layer, are left out);
- `scaled_fp8` (`ksc.scalify`, `ksc.ScaledOptimizer(AdamW)`): the policy's
  float16 master data (its gradients float16), float32 state, a float32
  scale and grad scale per weight (replicated);
- `scaled_fp8` with `ScaledOptimizer(state_dtype="float16")`: float16
  slots, each with a float32 scale.

The model is built on abstract variables (no storage: a 1B model costs
nothing), so the sizes are counted from shapes: each variable's bytes
divided by the devices its layout splits it over. Which weights become
scaled is read from `ksc.scalify` of a tiny Llama (keras-hub's own norms
stay plain float32). The accounting is checked against a real tiny model
sharded on 8 virtual CPU devices: its weights and optimizer variables,
summed from the bytes its first device holds. Variables a layout map does
not cover are replicated on every device (keras-hub's Llama map leaves out
the untied output projection `token_embedding/reverse_embeddings` and the
norms): "bytes per parameter" counts every device's copy.
"""

import argparse
import os
import platform
import re
import sys

if __name__ == "__main__" and "--no-check" not in sys.argv:  # (before jax starts)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
os.environ.setdefault("KERAS_BACKEND", "jax")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_scalify as ksc  # noqa: E402
from keras_scalify.policies.named import named_policy_fields  # noqa: E402

ADAM_SLOTS = 2  # AdamW's momentum and velocity per weight
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def backbone_config(args):
    return dict(
        vocabulary_size=args.vocab, num_layers=args.layers, num_query_heads=args.heads,
        num_key_value_heads=args.kv_heads, hidden_dim=args.d_model,
        intermediate_dim=args.intermediate or 4 * args.d_model,
    )


def _kind(path):
    """A variable's path without its layer index (`transformer_layer_3/...`
    → `transformer_layer/...`): the same kind in any model size."""
    return re.sub(r"transformer_layer_\d+", "transformer_layer", path)


def scaled_kinds():
    """The kinds of the Llama weights that `ksc.scalify` makes scaled."""
    import keras_hub

    keras.utils.set_random_seed(0)
    tiny = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32,
    )
    ksc.scalify(tiny, dtype="scaled_fp8")
    return {
        _kind(v.path) for v in tiny.trainable_variables
        if getattr(v, "_ksc_scaled_variable", None) is not None and v is v._ksc_scaled_variable.data
    }


def shards(layout, mesh_shape):
    """How many pieces a layout splits a variable into."""
    if layout is None:
        return 1
    sizes = dict(zip(layout.device_mesh.axis_names, mesh_shape))
    n = 1
    for axis in layout.axes:
        if axis is not None:
            n *= sizes[axis]
    return n


def per_weight_bytes(row, scaled, size, n):
    """Bytes on one device for a weight of `size` elements split in `n`:
    (weights, gradients, optimizer state)."""
    if row.startswith("Keras"):
        return 4 * size / n, 4 * size / n, ADAM_SLOTS * 4 * size / n
    fields = named_policy_fields("scaled_fp8")
    # (ScaledOptimizer keeps every float slot, a plain weight's too, in its
    # state dtype; a narrow slot has a replicated float32 scale.)
    state = "float16" if row.endswith("float16 state") else fields["state_dtype"]
    slots = ADAM_SLOTS * (_BYTES[state] * size / n + (0 if state == "float32" else 4))
    if not scaled:
        return 4 * size / n, 4 * size / n, slots
    master = _BYTES[fields["master_dtype"]]
    # (A scaled weight's scale and grad scale: replicated float32 scalars.)
    return master * size / n + 8, master * size / n, slots


ROWS = (
    "Keras mixed_bfloat16",
    "Keras float8",
    "scaled_fp8",
    "scaled_fp8, float16 state",
)


def account(variables, layout_for, mesh_shape, kinds):
    """{row: (weights, gradients, state, parameters)} summed over the
    trainable variables."""
    out = {}
    for row in ROWS:
        total = np.zeros(3)
        params = 0
        for v in variables:
            size = int(np.prod(v.shape))
            params += size
            n = shards(layout_for(v), mesh_shape) if len(v.shape) >= 2 else 1
            total += per_weight_bytes(row, _kind(v.path) in kinds, size, n)
        out[row] = (*total, params)
    return out


def abstract_llama(args):
    """The plain LlamaBackbone of `args` on abstract variables."""
    import keras_hub

    with keras.StatelessScope(initialize_variables=False):
        return keras_hub.models.LlamaBackbone(**backbone_config(args))


def check_on_devices(kinds, mesh_shape):
    """(accounted, held) bytes of the weights and AdamW state on the first
    device, for a tiny Llama really sharded on 8 virtual CPU devices under
    `scaled_fp8` and under `scaled_fp8` with float16 state."""
    import keras_hub

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], devices)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    config = dict(vocabulary_size=128, num_layers=2, num_query_heads=4, num_key_value_heads=4,
                  hidden_dim=64, intermediate_dim=128)
    results = []
    for row, state in (("scaled_fp8", None), ("scaled_fp8, float16 state", "float16")):
        with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
            keras.utils.set_random_seed(0)
            plain = keras_hub.models.LlamaBackbone(**config)
            plain_vars = [(v.path, tuple(v.shape)) for v in plain.trainable_variables]
            layouts = {v.path: v._layout for v in plain.trainable_variables}
            ksc.scalify(plain, dtype="scaled_fp8")
            optimizer = ksc.ScaledOptimizer(keras.optimizers.AdamW(1e-3), state_dtype=state)
            optimizer.build(plain.trainable_variables)
        device = devices[0]
        held = 0
        for v in list(plain.trainable_variables) + list(optimizer.variables):
            if "int" in v.dtype:  # (counters)
                continue
            for shard in v.value.addressable_shards:
                if str(shard.device) == str(device) or shard.device == device:
                    held += shard.data.nbytes
        Stub = type("V", (), {})
        stubs = []
        for path, shape in plain_vars:
            s = Stub()
            s.path, s.shape = path, shape
            stubs.append(s)
        w, _, st, _ = account(stubs, lambda v: layouts[v.path], mesh_shape, kinds)[row]
        results.append((row, w + st, held))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--mesh", type=int, nargs=2, default=[2, 4], metavar=("BATCH", "MODEL"))
    parser.add_argument("--no-check", action="store_true", help="skip the 8-device check")
    args = parser.parse_args(argv)
    import keras_hub

    print(
        f"backend: {keras.backend.backend()}; keras {keras.__version__}; keras-hub "
        f"{keras_hub.__version__}; machine: {platform.machine()}; Llama d={args.d_model}, "
        f"{args.layers} layers, {args.heads}/{args.kv_heads} heads, vocab {args.vocab}; "
        f"mesh (batch {args.mesh[0]}, model {args.mesh[1]})"
    )
    kinds = scaled_kinds()
    model = abstract_llama(args)
    # (The layouts only: the mesh need not be this machine's devices.)
    placeholders = np.array([f"device:{i}" for i in range(int(np.prod(args.mesh)))])
    mesh = keras.distribution.DeviceMesh(tuple(args.mesh), ["batch", "model"], placeholders)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    rows = account(model.trainable_variables, lambda v: layout_map[v.path], tuple(args.mesh), kinds)
    params = rows[ROWS[0]][3]
    print(f"\n{params / 1e9:.2f}B parameters; MiB per device on {np.prod(args.mesh)} devices:\n")
    print("| row | weights | gradients | AdamW state | total | bytes per parameter (all devices) | vs Keras mixed_bfloat16 |")
    print("|---|---|---|---|---|---|---|")
    base = sum(rows[ROWS[0]][:3])
    for row in ROWS:
        w, g, s, _ = rows[row]
        total = w + g + s
        per_param = total * np.prod(args.mesh) / params
        print(
            f"| {row} | {w / 2**20:.1f} | {g / 2**20:.1f} | {s / 2**20:.1f} | {total / 2**20:.1f} "
            f"| {per_param:.2f} | {total / base:.2f}× |"
        )
    if not args.no_check:
        print("\nCheck on a tiny Llama sharded on 8 virtual CPU devices (weights + AdamW state, device 0):")
        for row, accounted, held in check_on_devices(kinds, tuple(args.mesh)):
            print(
                f"- {row}: accounted {accounted:.0f} B, held {held} B (the difference: "
                f"scalars the table leaves out, the optimizer's learning rate and seed, "
                f"the scaled layers' rescale states)"
            )


if __name__ == "__main__":
    main()
