"""A small GPT trained in FP32, FP16 and FP8 — the rows of the paper's Table 3.

    KERAS_BACKEND=jax python examples/gpt.py --rows keras_fp32 3   # Keras float32 beside scaled_fp8
    KERAS_BACKEND=jax python examples/gpt.py            # all rows
    KERAS_BACKEND=jax python examples/gpt.py --quick    # one-minute smoke run
    python examples/gpt.py --text my.txt --steps 2000 --rows 0 3 keras_float8
    KERAS_BACKEND=jax python examples/gpt.py --arch llama   # a keras-hub Llama

A pre-LayerNorm GPT (token + position embeddings; per block LayerNorm →
causal multi-head attention → residual add, LayerNorm → Dense(4d, gelu) →
Dense(d) → residual add; final LayerNorm; output projection tied to the
token embedding) is built only from `keras_scalify` layers and trained as
a byte-level language model (vocabulary 256) on real English text: by
default the Python documentation topics shipped with every Python
(`pydoc_data.topics`, ~466 KB), or any text file (`--text`). The last 10%
of the bytes are held out for validation.

Rows (same seed, data order and initial weights within a backend):

| row | matmuls | master weights | optimizer state |
|---|---|---|---|
| #0 FP32 (`scaled_float32`) | f32 | f32 | f32 |
| #1 FP16 (`scaled_fp16`) | f16 (grads f16) | f32 | f32 |
| #2 + FP16 master | f16 | scaled f16 | f32 |
| #3 FP8 (`scaled_fp8`) | e4m3 fwd / e5m2 bwd | scaled f16 | f32 |
| #4 + FP16 optimizer state | e4m3 / e5m2 | scaled f16 | scaled f16 |

With `--arch llama` the model is instead a keras-hub `LlamaCausalLM`
(RMSNorm, rotary embeddings, grouped-query attention, SwiGLU feed-forward,
untied output projection) with the same width, depth and heads, built
from plain keras-hub layers and, for the scaled rows, converted with
`ksc.scalify` (in place: every Dense/EinsumDense/embedding inside the
transformer blocks becomes a scaled layer).

plus peers built from plain Keras layers with the same architecture:
`keras_fp32`, `keras_float8` (`model.quantize("float8")`, Keras's delayed
scaling with amax histories) and `keras_mixed_float16` (no loss scaling).
All rows use AdamW (`ksc.ScaledOptimizer(AdamW)` for scaled rows) with a
warm-up + cosine schedule.

Shows Keras's progress bar for each stretch of `--eval-every` steps
(`--quiet`: none), then prints a table of final train loss (mean of the
last 10% of evaluations) and validation loss (mean over fixed held-out
batches) per row, each relative to #0 (or to Keras float32 when #0 is not
run), the loss curves as a table (train / validation loss at each
evaluation), and writes them to `--plot` (PNG, needs matplotlib).
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_scalify as ksc  # noqa: E402
from keras_scalify import layers as kl  # noqa: E402

# --- rows ----------------------------------------------------------------------


def _custom(name, matmul, grad, state):
    return ksc.ScaledDTypePolicy(
        name,
        compute_dtype="float16",
        matmul_dtype=matmul,
        grad_dtype=grad,
        master_dtype="float16",
        state_dtype=state,
    )


ROWS = {
    "0": ("#0 FP32", "scaled", lambda: "scaled_float32"),
    "1": ("#1 FP16 matmuls", "scaled", lambda: "scaled_fp16"),
    "2": ("#2 + FP16 master weights", "scaled", lambda: _custom("scaled_fp16_master16", "float16", "float16", "float32")),
    "3": ("#3 FP8 matmuls + FP16 master", "scaled", lambda: "scaled_fp8"),
    "4": ("#4 + FP16 optimizer state", "scaled", lambda: _custom("scaled_fp8_state16", "float8_e4m3fn", "float8_e5m2", "float16")),
    "keras_fp32": ("Keras float32", "keras", lambda: "float32"),
    "keras_float8": ("Keras float8 (quantize)", "keras", lambda: "float32"),
    "keras_mixed_float16": ("Keras mixed_float16, no loss scaling", "keras", lambda: "mixed_float16"),
}

# --- data ----------------------------------------------------------------------


def load_text(path=None):
    """Bytes of `path`, or of the Python documentation topics."""
    if path:
        with open(path, "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8)
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def windows(data, starts, seq_len):
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = data[idx].astype("int32")
    return w[:, :-1], w[:, 1:]


# --- model ---------------------------------------------------------------------


class GPT(keras.Model):
    """Pre-LayerNorm GPT; `family` "scaled" (keras_scalify layers) or "keras"."""

    def __init__(self, family, vocab=256, seq_len=64, d=128, heads=4, depth=2, **kwargs):
        super().__init__(**kwargs)
        self.family, self.seq_len = family, seq_len
        scaled = family == "scaled"
        emb_init = keras.initializers.RandomNormal(stddev=0.02)
        Emb = kl.ScaledEmbedding if scaled else keras.layers.Embedding
        LN = kl.ScaledLayerNormalization if scaled else keras.layers.LayerNormalization
        MHA = kl.ScaledMultiHeadAttention if scaled else keras.layers.MultiHeadAttention
        Dense = kl.ScaledDense if scaled else keras.layers.Dense
        Add = kl.ScaledAdd if scaled else keras.layers.Add
        self.tok = Emb(vocab, d, embeddings_initializer=emb_init)
        self.pos = Emb(seq_len, d, embeddings_initializer=emb_init)
        self.blocks = []
        for _ in range(depth):
            self.blocks.append(
                (
                    LN(epsilon=1e-5),
                    MHA(heads, d // heads),
                    Add(),
                    LN(epsilon=1e-5),
                    Dense(4 * d, activation="gelu"),
                    Dense(d),
                    Add(),
                )
            )
        self.ln_f = LN(epsilon=1e-5)
        self.to_array = kl.ToArray() if scaled else None

    def call(self, tokens):
        t = ops.shape(tokens)[1]
        pos = self.pos(ops.arange(t))
        if self.family == "scaled":
            h = ksc.ops.add(self.tok(tokens), ksc.ops.expand_dims(pos, 0))
        else:
            h = ops.add(self.tok(tokens), pos[None])
        for ln1, attn, add1, ln2, up, down, add2 in self.blocks:
            a = ln1(h)
            if self.family == "keras":
                # Asking for the scores keeps Keras's explicit attention:
                # its fused path (jax.nn.dot_product_attention) cannot be
                # compiled for float16 on a CPU (F16_F16_F32 dot_general).
                a = attn(a, a, use_causal_mask=True, return_attention_scores=True)[0]
            else:
                a = attn(a, a, use_causal_mask=True)
            h = add1([h, a])
            h = add2([h, down(up(ln2(h)))])
        h = self.ln_f(h)
        if self.family == "scaled":
            return self.to_array(self.tok(h, reverse=True))
        return ops.matmul(h, ops.transpose(ops.cast(self.tok.embeddings, h.dtype)))


class HubLM(keras.Model):
    """A keras-hub causal LM on token arrays (all positions attended)."""

    def __init__(self, arch, vocab=256, seq_len=64, d=128, heads=4, depth=2, **kwargs):
        super().__init__(**kwargs)
        import keras_hub

        if arch != "llama":
            raise ValueError(f"`--arch` must be 'gpt' or 'llama', got {arch!r}.")
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=vocab,
            num_layers=depth,
            num_query_heads=heads,
            num_key_value_heads=heads,
            hidden_dim=d,
            intermediate_dim=4 * d,
            dropout=0,
        )
        self.lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)

    def call(self, tokens):
        return self.lm({"token_ids": tokens, "padding_mask": ops.ones_like(tokens)})


def build_model(args, family):
    """The row's model, built under the policy in force."""
    if args.arch == "gpt":
        model = GPT(family, seq_len=args.seq_len, d=args.width, heads=args.heads, depth=args.depth)
        model(np.zeros((1, args.seq_len), "int32"))
        return model
    model = HubLM(args.arch, seq_len=args.seq_len, d=args.width, heads=args.heads, depth=args.depth)
    model(np.zeros((1, args.seq_len), "int32"))
    if family == "scaled":
        ksc.scalify(model)  # the layers keep the scaled policy they were built under
    return model


# --- training ------------------------------------------------------------------


def make_optimizer(args, scaled):
    # Warm-up from lr/100, not 0: Keras float8 layers produce NaN when the
    # first steps have a learning rate of exactly 0 (observed on jax).
    schedule = keras.optimizers.schedules.CosineDecay(
        args.learning_rate / 100,
        decay_steps=max(args.steps - args.warmup, 1),
        warmup_target=args.learning_rate,
        warmup_steps=args.warmup,
        alpha=0.1,
    )
    inner = keras.optimizers.AdamW(schedule, weight_decay=0.01, global_clipnorm=1.0)
    return ksc.ScaledOptimizer(inner, seed=args.seed) if scaled else inner


def train_row(key, args, data_train, val_x, val_y):
    label, family, policy = ROWS[key]
    keras.config.set_dtype_policy(policy())
    try:
        keras.utils.set_random_seed(args.seed)
        model = build_model(args, family)
        if key == "keras_float8":
            model.quantize("float8")
        model.compile(
            optimizer=make_optimizer(args, family == "scaled"),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            auto_scale_loss=False,
        )
        rng = np.random.default_rng(args.seed)  # same batches for every row
        starts = rng.integers(0, len(data_train) - args.seq_len - 1, size=args.steps * args.batch_size)
        x, y = windows(data_train, starts, args.seq_len)
        chunk = args.eval_every * args.batch_size
        curve, train_losses = [], []
        if not args.quiet:
            print(f"--- {label} (policy {keras.config.dtype_policy().name}) ---", flush=True)
        t0 = time.time()
        for i in range(0, len(x), chunk):
            h = model.fit(
                x[i : i + chunk], y[i : i + chunk], batch_size=args.batch_size,
                epochs=1, shuffle=False, verbose=0 if args.quiet else 1,
            )
            train_losses.append(h.history["loss"][-1])
            val = model.evaluate(val_x, val_y, batch_size=args.batch_size, verbose=0)
            step = min(i + chunk, len(x)) // args.batch_size
            curve.append((step, train_losses[-1], val))
            if not args.quiet:
                print(f"  {label:38s} step {step:5d}  train {train_losses[-1]:.4f}  val {val:.4f}", flush=True)
        seconds = time.time() - t0
        tail = max(1, len(curve) // 10)
        final_train = float(np.mean([c[1] for c in curve[-tail:]]))
        skipped = None
        if isinstance(model.optimizer, ksc.ScaledOptimizer):
            skipped = int(ops.convert_to_numpy(model.optimizer.skipped_steps))
        return {
            "label": label, "train": final_train, "val": curve[-1][2],
            "curve": curve, "seconds": seconds, "skipped": skipped,
        }
    finally:
        keras.config.set_dtype_policy("float32")


def plot(results, path, arch="gpt"):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results.values():
        steps = [c[0] for c in r["curve"]]
        axes[0].plot(steps, [c[1] for c in r["curve"]], label=r["label"])
        axes[1].plot(steps, [c[2] for c in r["curve"]], label=r["label"])
    for ax, title in zip(axes, ("train loss", "validation loss")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    finite = [c[2] for r in results.values() for c in r["curve"] if np.isfinite(c[2])]
    if finite:
        lo = min(finite)
        for ax in axes:
            ax.set_ylim(lo - 0.1, min(max(finite), lo + 2.5))
    axes[1].legend(fontsize=7)
    fig.suptitle(f"byte-level {arch}, {keras.config.backend()} backend")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"loss curves written to {path}")


def format_curves(results):
    """The loss curves as a markdown table: train / validation loss per evaluation."""
    rows = list(results.values())
    lines = [
        "\nLoss curves (train / validation loss, nats per byte):\n",
        "| step | " + " | ".join(r["label"] for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for j, (step, *_rest) in enumerate(rows[0]["curve"]):
        cells = [f"{r['curve'][j][1]:.4f} / {r['curve'][j][2]:.4f}" for r in rows]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description="Table 3 rows on a small byte-level GPT.")
    p.add_argument("--text", default=None, help="a text file (default: pydoc_data.topics)")
    p.add_argument("--arch", default="gpt", choices=["gpt", "llama"],
                   help="gpt: keras_scalify/Keras layers; llama: a keras-hub LlamaCausalLM, scalified")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="gpt_loss.png")
    p.add_argument("--quick", action="store_true", help="a one-minute smoke run")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.width, args.depth, args.seq_len = 20, 32, 1, 32
        args.batch_size, args.eval_every, args.val_batches, args.warmup = 8, 10, 2, 5
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    data = load_text(args.text)
    split = int(0.9 * len(data))
    train, held = data[:split], data[split:]
    vstarts = np.linspace(0, len(held) - args.seq_len - 2, args.val_batches * args.batch_size).astype(int)
    val_x, val_y = windows(held, vstarts, args.seq_len)
    print(
        f"backend {keras.config.backend()} | {len(train)} train / {len(held)} validation bytes | "
        f"{args.arch} d={args.width} heads={args.heads} depth={args.depth} seq={args.seq_len} | "
        f"{args.steps} steps of batch {args.batch_size} | seed {args.seed}"
    )
    results = {}
    for key in args.rows:
        results[key] = train_row(key, args, train, val_x, val_y)
    base_key = "0" if "0" in results else "keras_fp32"
    base = results.get(base_key)
    base_name = ROWS[base_key][0] if base_key != "0" and base else "#0"
    print(f"\n| row | train loss | val loss | val vs {base_name} | skipped steps | time (s) |")
    print("|---|---|---|---|---|---|")
    for r in results.values():
        delta = f"{r['val'] - base['val']:+.3f}" if base else "—"
        skipped = "—" if r["skipped"] is None else str(r["skipped"])
        print(f"| {r['label']} | {r['train']:.4f} | {r['val']:.4f} | {delta} | {skipped} | {r['seconds']:.0f} |")
    print(format_curves(results))
    if args.plot:
        plot(results, args.plot, args.arch)
    return results


if __name__ == "__main__":
    main()
