"""benchmarks/distributed/fsdp2_llama.py on the CPU: the FLOP count behind its MFU
(bench_model.py), the parent's row bookkeeping (row_launcher.py: deadline, rows cut short)
without launching anything, and tiny rows launched for real (two gloo processes, FSDP2 switched
on by hand as the script does on a CPU): a Llama row, whose JSON must hold every reported field,
a finite loss and every weight in the optimizer, and the MoE model (`--model toy`, moe_llm.py's
Mixtral) on real text, bf16 against FP8 experts."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "distributed" / "fsdp2_llama.py"
sys.path.insert(0, str(SCRIPT.parent))
import bench_model  # noqa: E402
import fsdp2_llama  # noqa: E402  (before row_launcher: it puts the benchmarks' folders on sys.path)
import row_launcher  # noqa: E402

TINY = ["--layers", "2", "--hidden", "128", "--intermediate", "256", "--heads", "4", "--kv-heads", "2",
        "--vocab", "256", "--seq", "32"]


def test_parameter_count_and_flops_are_llama3_8b():
    args = fsdp2_llama.parse_args([])
    total, non_embedding, active = bench_model.parameter_counts(args.spec)
    assert total == 8_030_261_248  # Llama-3-8B
    assert non_embedding == active == total - 128256 * 4096
    assert bench_model.flops_per_token(args.spec) == 6 * non_embedding + 12 * 32 * 4096 * 8192


@pytest.mark.parametrize("model", ["toy", "mixtral", "qwen3moe"])
def test_moe_parameter_counts_are_the_built_models(model):
    """parameter_counts against the model moe_llm.py's builder makes (on meta, one layer): all of
    them, and those a token runs through (top_k of the experts)."""
    args = fsdp2_llama.parse_args(["--model", model, "--layers", "1"])
    built = bench_model.build_meta_model(args.spec)
    total, non_embedding, active = bench_model.parameter_counts(args.spec)
    assert total == sum(p.numel() for p in built.parameters())
    assert non_embedding == total - built.get_input_embeddings().weight.numel()
    experts = built.model.layers[0].mlp.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // args.spec["experts"]
    assert active == non_embedding - (args.spec["experts"] - args.spec["top_k"]) * per_expert


def test_model_sizes_and_their_defaults():
    mixtral = fsdp2_llama.parse_args(["--model", "mixtral", "--layers", "1"])
    assert mixtral.spec["experts"] == 8 and mixtral.spec["layers"] == 1 and mixtral.spec["seq"] == 2048
    assert mixtral.spec["checkpointing"] is False  # as moe_llm.py runs it
    assert fsdp2_llama.parse_args([]).spec["checkpointing"] is True
    with pytest.raises(SystemExit):
        fsdp2_llama.parse_args(["--model", "mixtral", "--intermediate", "512"])  # the Llama's size
    with pytest.raises(SystemExit):
        fsdp2_llama.parse_args(["--model", "toy", "--data", "text"])  # vocab 256: below the byte-level alphabet


def test_rows_past_the_deadline_are_reported_not_run(tmp_path, monkeypatch):
    args = fsdp2_llama.parse_args(["--rows", "bf16-eager,fp8plug-regional", "--deadline", "1", "--nproc", "2",
                                   "--json", str(tmp_path / "out.json")])
    monkeypatch.setattr(row_launcher, "spawn", lambda *a: pytest.fail("a row was launched past the deadline"))
    rows = row_launcher.run_rows(args, dict(spec=args.spec), fsdp2_llama.child_command, fsdp2_llama.PROCESS_START)
    assert [r["error"].startswith("not run") for r in rows] == [True, True]
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == rows


def test_the_deadline_counts_from_the_start_not_from_each_row(monkeypatch):
    """Rows of 20 s each (a clock the launches advance), --deadline 100 s from `start`, 60 s a row at
    least: three rows run (100, 80 and 60 s left before each), the fourth is not (40 s left)."""
    clock = [0.0]

    def launch(row, args, timeout, command):
        clock[0] += 20.0
        return dict(row=row, tokens_per_s=1.0, loss=1.0)

    monkeypatch.setattr(row_launcher.time, "time", lambda: clock[0])
    monkeypatch.setattr(row_launcher, "spawn", launch)
    args = fsdp2_llama.parse_args(["--rows", "bf16-eager,bf16-regional,fp8plug-eager,fp8plug-regional",
                                   "--deadline", "100", "--min-row-s", "60", "--nproc", "1"])
    rows = row_launcher.run_rows(args, dict(spec=args.spec), fsdp2_llama.child_command, 0.0)
    assert ["error" in r for r in rows] == [False, False, False, True]
    assert rows[3]["error"].startswith("not run: 40 s left")


def test_a_row_cut_short_reports_the_steps_it_finished(tmp_path):
    args = fsdp2_llama.parse_args(["--steps", "10", "--warmup", "2", "--nproc", "1"] + TINY)
    progress = dict(first_step_s=50.0, fp8_modules=14, step_ms_all=[9000.0, 100.0, 100.0, 120.0, 100.0],
                    losses=[6.0, 5.9, 5.8, 5.7, 5.6])
    (tmp_path / "row.json.progress").write_text(json.dumps(progress))
    row = row_launcher.partial("bf16-eager", tmp_path, args, "timed out after 60 s")
    assert row["error"] == "timed out after 60 s after 5 of 10 steps"
    assert row["step_ms"] == 100.0 and row["tokens_per_s"] == 32 / 0.1
    assert row["first_step_s"] == 50.0 and row["loss"] == pytest.approx(5.8)
    assert "tok/s/GPU" in row_launcher.table(dict(spec=args.spec, nproc=1, steps=10, warmup=2, peak_tflops=989.0,
                                                 flops_per_token=1e9), [row])


@pytest.mark.slow
def test_tiny_rows_on_two_cpu_processes(tmp_path):
    """fp8plug rows end to end, eager and under Accelerate's regional compilation (compiled in
    place before sharding; fp8plug compiles the loss too, fp8plug.hf.regional_loss): two processes
    each, the model built on meta, sharded, materialised, trained 4 steps (about 60-90 s a row on
    two busy cores, mostly imports; aot_eager keeps the compilation short)."""
    out = tmp_path / "fsdp2.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--nproc", "2", "--rows", "fp8plug-eager,fp8plug-regional",
         "--steps", "4", "--warmup", "1", "--compile-backend", "aot_eager", "--json", str(out), *TINY],
        capture_output=True, text=True, timeout=700, cwd=str(ROOT), env=child_env(tmp_path, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["meta"]["nproc"] == 2 and "| fp8plug-eager |" in proc.stdout
    assert [row["row"] for row in data["rows"]] == ["fp8plug-eager", "fp8plug-regional"]
    for row in data["rows"]:
        assert row["error"] is None, row["row"]
        for field in ("tokens_per_s", "mfu", "first_step_s", "loss", "loss_last", "fp8_modules", "linears",
                      "step_ms", "init_sums", "world_size", "engine"):
            assert row.get(field) is not None, (row["row"], field)
        assert math.isfinite(row["loss"]) and 0 < row["loss"] < 10
        assert row["world_size"] == 2 and row["params_not_stepped"] == 0
        assert row["parameters"] == bench_model.parameter_counts(data["meta"]["spec"])[0]
        assert 0 < row["fp8_modules"] <= row["linears"] == 2 * 7 + 1
        assert row["fp8_gemms"] > 0 and len(row["step_ms_all"]) == 4
        assert row["final_sums"] != row["init_sums"]  # the optimizer moved the weights


@pytest.mark.slow
def test_moe_rows_on_real_text_on_two_cpu_processes(tmp_path):
    """moe_llm.py's toy Mixtral under FSDP2 on two processes, 6 steps of real text: bf16 (its experts
    transformers' grouped_mm on bf16 gathered weights) against fp8plug's native engine, both
    compiled whole (aot_eager); the FP8 row's experts must have run their grouped GEMMs in FP8
    (about a minute on two busy cores, mostly imports)."""
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "toy", "--vocab", "512", "--device", "cpu", "--nproc", "2",
         "--rows", "bf16-usercompiled,fp8plug-native-usercompiled", "--steps", "6", "--warmup", "1",
         "--compile-backend", "aot_eager", "--data", "text", "--text-mb", "1", "--text-cache", str(tmp_path / "text"),
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=str(ROOT), env=child_env(tmp_path, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["meta"]["data"] == "text" and data["meta"]["text"]["train_tokens"] > 10_000
    bf16, fp8 = data["rows"]
    for row in (bf16, fp8):
        assert row["error"] is None, row["error"]
        assert len(row["losses"]) == 6 and all(math.isfinite(x) for x in row["losses"])
        assert row["losses"][0] > 5  # about ln(512) from random weights: real text, not the synthetic task
        assert row["params_not_stepped"] == 0 and row["final_sums"] != row["init_sums"]
        assert row["master_dtypes"] == ["float32"] and row["gathered_dtype"] == "bfloat16"
    assert bf16["experts_implementation"] == "grouped_mm" and bf16.get("experts_total") is None
    assert fp8["experts_implementation"] == "fp8plug_fp8_experts"
    assert fp8["experts_fp8"] == fp8["experts_total"] == 2, fp8.get("experts_note")
    # counted from zero: every call of the 8 converted Linears and the 2 x 2 expert projections, 6 steps
    assert fp8["fp8_gemms"] == 6 * (8 + 2 * 2) and fp8["high_precision_gemms"] == 0
    assert fp8["loss_vs_bf16_of"] == "bf16-usercompiled" and abs(fp8["loss_vs_bf16_pct"]) < 5
    # held-out text after training, evaluated alike (eval mode: high precision) in both rows
    assert all(4 < row["heldout_loss"] < 8 for row in (bf16, fp8)) and abs(fp8["heldout_vs_bf16_pct"]) < 5
    assert "| fp8plug-native-usercompiled | native |" in proc.stdout and "| 2/2 |" in proc.stdout


def test_tp_option_is_checked():
    with pytest.raises(SystemExit):
        fsdp2_llama.parse_args(["--tp", "2", "--strategy", "zero3", "--rows", "bf16-eager"])
    with pytest.raises(SystemExit):
        fsdp2_llama.parse_args(["--tp", "2", "--nproc", "3"])
    args = fsdp2_llama.parse_args(["--tp", "2", "--nproc", "4"])
    assert "--tp" in fsdp2_llama.child_command("bf16-eager", args, Path("x.json"))
    assert row_launcher.parallelism(dict(tp=2, nproc=4)) == "tensor parallel 2 x FSDP2 2"


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_tensor_parallel_row_on_cpu_processes(tmp_path, nproc):
    """--tp 2 on two processes (tensor parallelism alone) and four (tp 2 x FSDP2 2): the meta model
    sharded with its transformers tp_plan, Accelerate's ParallelismConfig(tp_size=2,
    dp_shard_size=nproc/2) set as on a GPU, the native engine's FP8 Linears on the DTensor shards
    (under FSDP2: the weights FSDP2 unsharded onto the tp mesh), 4 steps."""
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--nproc", str(nproc), "--tp", "2", "--rows",
         "fp8plug-native-eager",
         "--steps", "4", "--warmup", "1", "--json", str(out), *TINY],
        capture_output=True, text=True, timeout=400, cwd=str(ROOT), env=child_env(tmp_path, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    heading = "tensor parallel 2 over 2" if nproc == 2 else "tensor parallel 2 x FSDP2 2 over 4"
    assert data["meta"]["tp"] == 2 and heading in proc.stdout
    (row,) = data["rows"]
    assert row["error"] is None and row["tp_size"] == 2 and row["engine"] == "native"
    assert row["fp8_gemms"] > 0 and row["high_precision_gemms"] == 0
    assert 0 < row["fp8_modules"] <= row["linears"] == 2 * 7 + 1
    assert math.isfinite(row["loss"]) and 0 < row["loss"] < 10 and row["params_not_stepped"] == 0
    assert row["final_sums"] != row["init_sums"] and row["world_size"] == nproc
