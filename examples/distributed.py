"""A scaled keras-hub Llama trained by several processes with `keras.distribution` (jax).

    python examples/distributed.py --launch --devices-per-process 4     # 2 processes x 4 CPU devices
    python examples/distributed.py --launch --num-processes 1 --devices-per-process 8  # 1 x 8, same mesh

Multi-host, one process per host on its accelerators (`--coordinator`: a
free port on process 0's host):

    python examples/distributed.py --num-processes 2 --process-id 0 --coordinator 10.0.0.1:1234
    python examples/distributed.py --num-processes 2 --process-id 1 --coordinator 10.0.0.1:1234

The device mesh is ("batch", "model") = (devices // M, M), M = `--model`
(default 4) dividing `--devices-per-process`: the "model" axis lies within
each process and the "batch" axis spans the processes (data parallelism).
keras-hub's `LlamaBackbone.get_layout_map` shards the weights over both
axes, so each process holds part of every large weight and of its
optimizer slots (`scalify` splits such weights on the devices). `keras.distribution.initialize` calls
`jax.distributed.initialize`; jax on CPU reduces across processes with its
gloo collectives (the default in jax 0.10). Keras's jax trainer builds the
global batch with `jax.make_array_from_process_local_data`: each process
passes `train_on_batch` its own rows of the global batch (here a fixed
random one). `ksc.scalify` runs with the distribution set, so the scaled
layers' new variables (scales) are laid out by it too. Process 0 prints
the losses as JSON. `--devices-per-process` forces that many virtual CPU
devices (leave it out on accelerators).
"""

import argparse
import json
import os
import socket
import subprocess
import sys

FLAGS = ("--num-processes", "--devices-per-process", "--model", "--steps", "--policy", "--batch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (default localhost:<free port>)")
    p.add_argument("--devices-per-process", type=int, default=None, help="virtual CPU devices per process")
    p.add_argument("--model", type=int, default=4, help='size of the "model" mesh axis (within a process)')
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--policy", default="scaled_fp8", help='a scaled policy, or "none" for plain Keras')
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--launch", action="store_true", help="spawn all the processes on localhost")
    return p.parse_args(argv)


def launch(args):
    """Runs this program as `--num-processes` local processes; returns the worst exit code."""
    if args.coordinator is None:
        with socket.socket() as s:  # a free port for the coordinator
            s.bind(("localhost", 0))
            args.coordinator = f"localhost:{s.getsockname()[1]}"
    common = [f"--coordinator={args.coordinator}"]
    for flag in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            common.append(f"{flag}={value}")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *common, f"--process-id={i}"])
             for i in range(args.num_processes)]
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


def main(args):
    if args.devices_per_process:
        # Set before jax starts: virtual CPU devices, and a long collective
        # timeout (a busy CPU may reach a collective long after its peers).
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
            f" --xla_force_host_platform_device_count={args.devices_per_process}"
            " --xla_cpu_collective_timeout_seconds=900 --xla_cpu_collective_call_terminate_timeout_seconds=900")
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras
    import keras_hub
    import numpy as np

    import keras_scalify as ksc

    keras.utils.set_random_seed(0)  # the same initial weights in every process
    if args.num_processes > 1:
        keras.distribution.initialize(args.coordinator, args.num_processes, args.process_id)
    n_proc, pid = jax.process_count(), jax.process_index()
    if jax.local_device_count() % args.model or args.batch % n_proc:
        raise ValueError("--model must divide the devices per process, and --num-processes the batch")

    devices = keras.distribution.list_devices()  # global, process by process
    mesh = keras.distribution.DeviceMesh((len(devices) // args.model, args.model), ["batch", "model"], devices)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    keras.distribution.set_distribution(distribution)

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=128, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=64, intermediate_dim=128)
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    if args.policy != "none":
        ksc.scalify(lm, dtype=args.policy)  # with the distribution set
    lm.compile(optimizer=keras.optimizers.AdamW(1e-3), weighted_metrics=[],  # → ksc.ScaledOptimizer
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    # One fixed global batch; this process feeds its rows of it.
    rs = np.random.RandomState(0)
    tokens = rs.randint(0, 128, (args.batch, 16)).astype("int32")
    labels = rs.randint(0, 128, (args.batch, 16)).astype("int32")
    rows = slice(pid * args.batch // n_proc, (pid + 1) * args.batch // n_proc)
    x = {"token_ids": tokens[rows], "padding_mask": np.ones_like(tokens[rows])}
    losses = [float(np.ravel(lm.train_on_batch(x, labels[rows]))[0]) for _ in range(args.steps)]
    if pid == 0:
        # Variables no process holds whole (weights, slots, sharded over
        # the processes as well).
        split = sum(not v.value.is_fully_addressable for v in lm.variables + lm.optimizer.variables)
        print(json.dumps({"processes": n_proc, "devices": len(devices), "mesh": list(mesh.shape),
                          "policy": args.policy, "losses": losses, "split_variables": split}), flush=True)


if __name__ == "__main__":
    args = parse_args()
    sys.exit(launch(args) if args.launch else main(args))
