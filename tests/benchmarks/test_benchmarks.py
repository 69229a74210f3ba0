"""Smoke tests of `benchmarks/step_time.py`, `benchmarks/stats_count.py`,
`benchmarks/reliability.py`
and `benchmarks/fp8_matmul.py` on the current backend, with tiny sizes
(seconds, not minutes)."""

import importlib.util
import os
import re

import keras
import pytest

from tests.conftest import on_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def step_time():
    return _load("step_time")


@pytest.fixture(scope="module")
def stats_count():
    return _load("stats_count")


TINY = ["--steps", "2", "--rounds", "1", "--warmup", "1", "--batch-size", "4"]


def _table_rows(text):
    """`{row name: [cells]}` of the markdown table rows in `text`."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_step_time_mlp(step_time, capsys):
    results = step_time.main(
        ["--model", "mlp", "--mlp-input", "8", "--mlp-width", "16", *TINY]
    )
    out = capsys.readouterr().out
    assert "backend: " in out and "device: " in out
    rows = _table_rows(out)
    assert "ms/step" in rows["row"] and rows["row"][6] == "first step (s)"
    names = [r[0] for r in step_time.ROWS]
    assert set(names) <= set(rows)
    for name, _, _, counterpart in step_time.ROWS:
        ms, ratio = results["mlp"][name]
        assert ms is not None and ms > 0, (name, rows[name])
        assert float(rows[name][0]) > 0
        assert re.match(r"(\d+|n/a)$", rows[name][5]), rows[name]  # page faults/step
        first = float(rows[name][6])  # first step (s): where jax / TensorFlow compile
        if keras.backend.backend() != "torch":
            assert first > float(rows[name][0]) / 1e3, rows[name]
        if counterpart is not None:
            bf16 = rf"; \d+\.\d\dx {step_time.BF16_ROW}" if name.startswith("scaled_fp8") else ""
            assert re.match(rf"\d+\.\d\dx {counterpart}{bf16}$", rows[name][1]), rows[name]
            assert ratio > 0
    # The issues' targets are printed next to their ratios.
    backend = keras.backend.backend()
    bound = "1.25" if backend == "torch" else "1.15"
    assert rows["scaled_float32"][2] == f"<= {bound}x on {backend}"
    assert rows["scaled_float32"][3] in ("met", "NOT met")
    for fp8_row in ("scaled_fp8", "scaled_fp8, float32 storage"):
        assert rows[fp8_row][2] == "<= 1.00x"
        assert rows[fp8_row][3] in ("met", "NOT met")


def test_step_time_reports_rows_that_cannot_run(step_time, capsys, monkeypatch):
    """A row whose model fails to build or run is a table row saying why;
    with no row left to time, the table still prints (a GPU run once met
    an integer division by zero there)."""

    def broken(*args):
        raise RuntimeError("no device memory")

    monkeypatch.setattr(step_time, "build", broken)
    results = step_time.main(["--model", "mlp", "--rows", "Keras float32", "scaled_float32", *TINY])
    rows = _table_rows(capsys.readouterr().out)
    for name in ("Keras float32", "scaled_float32"):
        assert rows[name][:2] == ["failed", "RuntimeError: no device memory"]
        assert results["mlp"][name] == (None, None)


def test_keep_heap_sets_glibcs_options_and_reports_a_refusal(step_time):
    """`--keep-heap`: no heap trimming and no mmap below glibc's 32 MB cap,
    through `mallopt` (a stand-in C library here: the real call would
    change this test process's allocator for the rest of the suite)."""

    class Libc:
        def __init__(self, answer):
            self.answer, self.calls = answer, []

        def mallopt(self, param, value):
            self.calls.append((param, value))
            return self.answer

    libc = Libc(1)
    step_time.keep_heap(libc)
    assert libc.calls == [(-1, 2**31 - 1), (-3, 32 * 2**20)]
    with pytest.raises(RuntimeError, match="mallopt"):
        step_time.keep_heap(Libc(0))


def test_ratios_pair_the_rows_round_by_round(step_time):
    """A row's ratio is the median of its per-round ratios to its
    counterpart: rounds in a slower phase of the machine (2x from the
    third on) leave it at 1.1, and so does a round where the machine
    slowed between the two rows (the second, an outlier), where the
    whole-run medians' ratio would read 2.2 / 1.0 = 2.2."""
    by_round = {"scaled": [1.1, 2.2, 2.2, 2.2, 1.1], "keras": [1.0, 1.0, 2.0, 2.0, 1.0]}
    by_round = {k: [float(t) for t in v] for k, v in by_round.items()}
    assert step_time.paired_ratio(by_round, "scaled", "keras") == pytest.approx(1.1)
    assert step_time.paired_ratio(by_round, "keras", "scaled") == pytest.approx(1 / 1.1)


def test_step_time_jit_compile(step_time, capsys):
    """`--jit-compile`: every row compiled with `jit_compile=True` (torch:
    `torch.compile` through Keras) runs and is timed."""
    results = step_time.main(
        ["--model", "mlp", "--mlp-input", "8", "--mlp-width", "16", "--mlp-depth", "1",
         *TINY, "--jit-compile", "--rows", "Keras float32", "scaled_float32"]
    )
    out = capsys.readouterr().out
    assert "jit_compile=True" in out
    ms, ratio = results["mlp"]["scaled_float32"]
    assert ms > 0 and ratio > 0


def test_step_time_breakdown(step_time, capsys):
    """`--breakdown`: on eager torch the forward, loss, backward and
    optimizer of each row timed apart, with what train_on_batch costs
    beyond them; on jax the jitted parts; elsewhere a note."""
    step_time.main(
        ["--model", "mlp", "--mlp-input", "8", "--mlp-width", "16", "--mlp-depth", "1",
         *TINY, "--breakdown", "--rows", "Keras float32", "scaled_float32"]
    )
    out = capsys.readouterr().out
    backend = keras.config.backend()
    if backend == "tensorflow":
        assert "--breakdown is implemented on jax and on eager torch only" in out
        return
    title = "torch breakdown" if backend == "torch" else "jax breakdown"
    rows = _table_rows(out.split(title)[1])
    header = rows.pop("row")
    assert set(rows) == {"Keras float32", "scaled_float32"}
    parts = len(step_time.TORCH_PARTS) if backend == "torch" else 2
    assert len(header) == parts + (3 if backend == "torch" else 2)
    for cells in rows.values():
        values = [float(c) for c in cells]
        assert all(v > 0 for v in values[:parts]), cells
        # The sum column adds the parts.
        assert abs(values[parts] - sum(values[:parts])) < 0.02, cells


def _op_counts(step_time, capsys, *extra):
    step_time.main(
        ["--model", "mlp", "--mlp-input", "8", "--mlp-width", "16", "--mlp-depth", "1",
         *TINY, "--op-count", "--rows", "Keras float32", "scaled_float32", *extra]
    )
    out = capsys.readouterr().out
    if keras.config.backend() != "torch":
        assert "--op-count is implemented on torch only" in out
        return None
    table = out.split("aten operators per train_on_batch")[1]
    counts = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "row":
            counts[cells[0]] = [float(c) for c in cells[1:]]
    return counts


def test_step_time_op_count(step_time, capsys):
    """`--op-count`: a table of aten operators, 0-d tensor ops and
    synchronizing reads per step on torch (a scaled step dispatches more
    than Keras's); elsewhere a note that it is torch-only."""
    counts = _op_counts(step_time, capsys)
    if counts is None:
        return
    assert counts["scaled_float32"][0] > counts["Keras float32"][0] > 0
    # On a GPU: kernel launches, host waits and kernel ms too.
    assert all(len(c) == (6 if on_gpu() else 3) for c in counts.values()), counts
    if on_gpu():
        assert all(c[3] > 0 and c[5] > 0 for c in counts.values()), counts
    else:  # (a CPU reads for free)
        assert all(c[2] == 0 for c in counts.values()), counts


def test_step_time_op_count_scalar_paths(step_time, capsys):
    """`--scalar-path`: a GPU's path run on a CPU (host reads off) keeps the
    scale values it reads, and its memos hit: fewer 0-d tensor ops than
    the tensor ops' path (no memo), at the price of synchronizing reads."""
    off = _op_counts(step_time, capsys, "--scalar-path", "host-reads-off")
    if off is None:
        return
    tensor_ops = _op_counts(step_time, capsys, "--scalar-path", "tensor-ops")
    assert off["scaled_float32"][1] < 0.5 * tensor_ops["scaled_float32"][1], (off, tensor_ops)
    assert off["scaled_float32"][2] > 0 and tensor_ops["scaled_float32"][2] == 0, (off, tensor_ops)


def test_step_time_gpt(step_time, capsys):
    # Two rows keep the (jax / tensorflow) compile time of the test short.
    results = step_time.main(
        [
            "--model", "gpt", "--vocab", "16", "--seq-len", "4", "--d-model", "8",
            "--heads", "2", "--layers", "1", *TINY,
            "--rows", "Keras float32", "scaled_float32",
        ]
    )
    out = capsys.readouterr().out
    assert "tied output projection" in out
    rows = _table_rows(out)
    assert rows["Keras float32"][1] == "baseline"
    assert rows["scaled_float32"][1].endswith("x Keras float32")
    assert "Keras float8" not in rows
    ms, ratio = results["gpt"]["scaled_float32"]
    assert ms > 0 and ratio > 0


@pytest.mark.parametrize("model", ["gpt2-hub", "llama-hub"])
def test_step_time_keras_hub(step_time, capsys, model):
    """`--model gpt2-hub / llama-hub`: a tiny keras-hub causal LM, Keras's
    and `ksc.scalify`'d, trained and timed."""
    pytest.importorskip("keras_hub")
    results = step_time.main(
        [
            "--model", model, "--vocab", "16", "--seq-len", "4", "--d-model", "8",
            "--heads", "2", "--layers", "1", *TINY,
            "--rows", "Keras float32", "scaled_float32",
        ]
    )
    out = capsys.readouterr().out
    assert "keras-hub " + ("GPT2CausalLM" if model == "gpt2-hub" else "LlamaCausalLM") in out
    rows = _table_rows(out)
    assert rows["scaled_float32"][1].endswith("x Keras float32")
    ms, ratio = results[model]["scaled_float32"]
    assert ms > 0 and ratio > 0


def test_stats_count(stats_count, capsys):
    result = stats_count.main(
        ["--d-model", "8", "--heads", "2", "--seq-len", "4", "--amax-history-length", "16"]
    )
    out = capsys.readouterr().out
    assert "backend: " in out
    assert "Target (issue): at most 2" in out
    rows = _table_rows(out)
    from_model = [k for k in rows if "from the model" in k]
    measured = [k for k in rows if k.startswith("**activation") and "measured" in k]
    assert from_model and measured
    # Keras float8: inputs + output-gradient amax per quantized GEMM (6 in a
    # block: query, key, value, attention output, 2 MLP Dense).
    assert rows[from_model[0]] == ["12", "2"]
    assert rows[measured[0]] == ["12", "2"]
    assert result["target_met"]
    # Scaling state per Dense: 3 scales + 3 amax histories of 1024 float32
    # for Keras float8; a float32 scale and grad scale per scaled weight.
    assert result["keras_dense_bytes"] == 3 * 4 + 3 * 4 * 1024
    assert result["scaled_kernel_bytes"] == 8
    assert result["scaled_dense_bytes"] == 16
    assert any("amax history 16" in k for k in rows)


def test_fp8_matmul(capsys):
    _load("fp8_matmul").main(["--sizes", "32", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "backend: " in out
    lines = [line for line in out.splitlines() if line.strip().startswith("32 ")]
    labels = " ".join(lines)
    assert "float32 matmul" in labels and "fp8 simulate" in labels
    # One row per distinct route of "auto", "native" and "simulate"; the
    # one "auto" took is marked.
    from keras_scalify.backend import fp8

    routes = {fp8.resolve_route("ak,kn->an", (32, 32), (32, 32), r) for r in fp8.ROUTES}
    # Routes that round apart from their GEMM (simulate, torch's
    # `_scaled_mm`) also get a "GEMM only" row.
    apart = {r for r in routes if r in ("simulate", "torch-scaled_mm")}
    assert len(lines) == 2 + len(routes) + len(apart)
    assert {line.split()[2].rstrip(",") for line in lines if "GEMM only" in line} == apart
    auto = fp8.resolve_route("ak,kn->an", (32, 32), (32, 32), "auto")
    assert f"fp8 {auto} (auto)" in labels


def test_hub_coverage_table(capsys):
    pytest.importorskip("keras_hub")
    rows = _load("hub_coverage").main(["--models", "llama"])
    out = capsys.readouterr().out
    table = _table_rows(out)
    assert any(k.startswith("llama (LlamaBackbone)") for k in table)
    (row,) = rows
    assert row["scaled"] == "100.0%" and row["fp8"] == "100.0%"
    assert row["params"] == "same"
    # Scales propagate inside Llama's blocks: the MLP and the attention
    # output projection get ScaledTensors; every op on them has a rule.
    handed_on, calls = (int(v) for v in row["handed_on"].split("/"))
    assert calls == 14 and handed_on >= 8
    by_rule, decoded = (int(v) for v in row["ops"].split(" / "))
    assert by_rule > 0 and decoded == 0


def test_reliability_rows():
    """`benchmarks/reliability.py`: the quick rows on this backend (the
    README's table runs them all)."""
    rel = _load("reliability")
    for what, n, result in rel.saturation() + rel.bad_input():
        assert result in ("ok", f"{n}/{n}"), what
    assert rel._skipped_bit_for_bit("scaled_fp8", rel.FAULTS[1][1])
    ((_, n, result),) = rel.tiny_inputs_fp8(steps=20, bias=-10.0)
    assert int(result) == 0


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA's compiled step (jax)")
def test_compiled_step_counts_a_tiny_llama(capsys):
    pytest.importorskip("keras_hub")
    compiled_step = _load("compiled_step")
    results = compiled_step.main(
        ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "8",
         "--batch-size", "2", "--vocab", "64", "--rows", "Keras mixed_bfloat16", "scaled_fp8"]
    )
    rows = _table_rows(capsys.readouterr().out)
    assert {"Keras mixed_bfloat16", "scaled_fp8"} <= set(rows)
    keras_row, scaled_row = results
    for r in results:
        assert r["kernels"] > 0 and r["bytes"] > 0 and r["compile_s"] > 0
        assert 0 <= r["scalar_kernels"] <= r["kernels"]
    # What a GPU multiplies: bfloat16 dots for Keras, FP8 for the scaled
    # model's kernels (the attention products stay wider).
    assert keras_row["dots"]["16-bit"] > 0.5 and keras_row["dots"]["fp8"] == 0
    assert scaled_row["dots"]["fp8"] > 0.5
    assert keras_row["weights"] == 12  # a 1-layer Llama's weight arrays


def test_compiled_step_kernel_count_reads_loops_and_branches():
    compiled_step = _load("compiled_step")
    hlo = """HloModule m

%body (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  ROOT %a = f32[] add(%p, %p)
}

%b1 (q: f32[4]) -> f32[4] {
  %q = f32[4] parameter(0)
  %m = f32[4] multiply(%q, %q)
  ROOT %n = f32[4] negate(%m)
}

ENTRY %main (x: f32[4], s: f32[]) -> f32[4] {
  %x = f32[4] parameter(0)
  %s = f32[] parameter(1)
  %w = f32[] while(%s), condition=%body, body=%body
  %c = f32[4] conditional(%s, %x, %x), branch_computations={%b1, %b1}
  ROOT %f = f32[4] fusion(%c, %w), kind=kLoop, calls=%b1
}
"""
    # the loop body's add (a scalar), the larger branch's two ops, the fusion
    assert compiled_step.kernel_counts(hlo) == (4, 1)


def test_memory_per_device_table(capsys):
    """`benchmarks/memory_per_device.py` on a small abstract Llama (the
    8-device check is left to the script): scaled_fp8 holds half of Keras's
    bytes for the weights it scales, and float16 state halves the state."""
    pytest.importorskip("keras_hub")
    if keras.backend.backend() != "jax":
        pytest.skip("keras.distribution layouts: jax")
    module = _load("memory_per_device")
    module.main(["--d-model", "512", "--layers", "2", "--heads", "8", "--kv-heads", "4",
                 "--intermediate", "1024", "--vocab", "4096", "--no-check"])
    rows = _table_rows(capsys.readouterr().out)
    keras_total = float(rows["Keras mixed_bfloat16"][3])
    fp8 = [float(c) for c in rows["scaled_fp8"][:4]]
    fp8_half = [float(c) for c in rows["scaled_fp8, float16 state"][:4]]
    assert fp8[0] < 0.6 * float(rows["Keras mixed_bfloat16"][0])
    assert fp8_half[2] < 0.6 * fp8[2]
    assert fp8_half[3] < fp8[3] < keras_total
