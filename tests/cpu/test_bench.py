"""`fp8plug bench` and the training-step benchmark, as CPU smoke tests: options are parsed and
checked, every case becomes a row (failures with their reason), the speed-up column is bf16 ms
over engine ms, and JSON / CSV / markdown come out readable."""

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8plug import bench
from fp8plug.tuning.hardware import DeviceInfo

ROOT = Path(__file__).resolve().parents[2]
CPU = DeviceInfo("cpu", "test-cpu")


# --- parsing -------------------------------------------------------------------------------------


def test_parse_shapes_accepts_lists_and_presets():
    assert bench.parse_shapes("16384x8192x8192, 32X16x48") == [(16384, 8192, 8192), (32, 16, 48)]
    assert bench.parse_shapes("llama70b") == bench.LLAMA70B_SHAPES
    assert bench.parse_shapes("tiny") == [(256, 256, 256)]
    assert len(bench.parse_shapes("sweep")) >= 6


@pytest.mark.parametrize("text, needle", [
    ("16x16", "is not MxKxN"),
    ("axbxc", "is not MxKxN"),
    ("16x16x16x16", "is not MxKxN"),
    ("0x16x16", "dimension <= 0"),
    ("16x-16x16", "dimension <= 0"),
    ("", "empty"),
    (",", "no shape"),
])
def test_parse_shapes_errors_name_the_option_and_the_form(text, needle):
    with pytest.raises(ValueError, match=needle) as info:
        bench.parse_shapes(text)
    assert str(info.value).startswith("--shapes:")


def test_bad_shapes_on_the_command_line_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--shapes", "16x16"])
    assert info.value.code == 2
    assert "--shapes" in capsys.readouterr().err


def test_parse_modes():
    assert bench.parse_modes("compiled, eager") == ["compiled", "eager"]
    with pytest.raises(ValueError, match="--modes: fast"):
        bench.parse_modes("eager,fast")


def test_resolve_engines_by_name_and_scaling():
    specs, unavailable = bench.resolve_engines("native:dynamic,torchao,fp8-gemm,te:current", CPU)
    labels = [s.label for s in specs]
    assert labels == ["native:dynamic", "ao:tensorwise", "fp8-gemm", "te:current"]
    assert not specs[0].default_scaling and specs[1].default_scaling
    assert "te" in unavailable  # TransformerEngine cannot run on a CPU: its rows will say why


def test_resolve_engines_auto_skips_what_cannot_run():
    specs, unavailable = bench.resolve_engines(None, CPU)
    labels = [s.label for s in specs]
    assert "native:delayed" in labels and labels[-1] == "fp8-gemm"
    assert not any(s.backend in unavailable for s in specs)
    assert {"te", "msamp"} <= set(unavailable)
    everything, _ = bench.resolve_engines("all", CPU)
    assert {"native:delayed", "native:dynamic"} <= {s.label for s in everything}


@pytest.mark.parametrize("text, needle", [
    ("fp4", "unknown engine 'fp4'"),
    ("native:columnwise", "'columnwise' is not a fp8plug native"),
    (",", "nothing to run"),
])
def test_resolve_engines_errors(text, needle):
    with pytest.raises(ValueError, match=needle):
        bench.resolve_engines(text, CPU)


def test_bad_engine_makes_run_return_2(capsys):
    assert bench.main(["--engines", "fp4", "--device", "cpu"]) == 2
    assert "--engines: unknown engine" in capsys.readouterr().err


def test_python_m_fp8plug_bench_runs_main():
    """`python -m fp8plug.bench` (fp8plug/bench/__main__.py) is `fp8plug bench`: same options, same
    exit status."""
    proc = subprocess.run([sys.executable, "-m", "fp8plug.bench", "--engines", "fp4", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "fp8plug bench: --engines: unknown engine 'fp4'" in proc.stderr


# --- running -------------------------------------------------------------------------------------


def _run(tmp_path, *extra):
    json_path, csv_path = tmp_path / "bench.json", tmp_path / "bench.csv"
    status = bench.main([
        "--device", "cpu", "--warmup", "1", "--repeats", "2", "--no-progress",
        "--json", str(json_path), "--csv", str(csv_path), *extra,
    ])
    return status, json.loads(json_path.read_text()), list(csv.DictReader(csv_path.open()))


def _check_speedups(rows):
    bf16 = {(r["shape"], r["mode"]): r["ms"] for r in rows if r["engine"] == "bf16"}
    checked = 0
    for r in rows:
        if r["ms"] is None:
            assert r["speedup"] is None and r["error"]
            continue
        assert r["ms"] > 0 and r["tflops"] > 0
        assert r["tflops"] == pytest.approx(6 * r["M"] * r["K"] * r["N"] / (r["ms"] * 1e-3) / 1e12)
        assert r["speedup"] == pytest.approx(bf16[(r["shape"], r["mode"])] / r["ms"], rel=1e-12)
        checked += 1
    return checked


def test_bench_smoke_eager_json_csv_and_table(tmp_path, capsys):
    status, data, csv_rows = _run(
        tmp_path, "--shapes", "32x32x32,48x32x64,32x24x32", "--engines", "native,fp8-gemm,te", "--modes", "eager",
    )
    out = capsys.readouterr().out
    assert status == 0
    rows = data["rows"]
    assert [(r["shape"], r["engine"]) for r in rows[:4]] == [
        ("32x32x32", "bf16"), ("32x32x32", "native:delayed"), ("32x32x32", "fp8-gemm"), ("32x32x32", "te:delayed")]
    assert len(rows) == 12
    assert _check_speedups(rows) == 8  # bf16, native and the GEMM bound at two shapes, bf16 at the third
    by = {(r["shape"], r["engine"]): r for r in rows}
    # te cannot run on a CPU: a row with the reason, not a crash
    assert by[("32x32x32", "te:delayed")]["error"].startswith("unavailable:")
    # K=24 is not a multiple of 16: native leaves the Linear alone, and the row says so
    assert by[("32x24x32", "native:delayed")]["error"].startswith("not converted (0: in_features=24")
    assert by[("32x24x32", "bf16")]["ms"] > 0
    assert all(r["vs_bf16_compiled"] is None for r in rows)  # no compiled baseline was measured
    assert data["meta"]["device"] == "x86_64 (CPU)" or "(CPU)" in data["meta"]["device"]
    assert data["meta"]["timing"] == "wall clock" and data["meta"]["repeats"] == 2
    # CSV: the same rows, the same numbers
    assert [r["engine"] for r in csv_rows] == [r["engine"] for r in rows]
    for c, r in zip(csv_rows, rows):
        if r["ms"] is not None:
            assert float(c["ms"]) == pytest.approx(r["ms"]) and float(c["speedup"]) == pytest.approx(r["speedup"])
        else:
            assert c["ms"] == "" and c["error"] == r["error"]
    # the table: on a CPU the ratios are labelled as emulation, never as an FP8 speed-up
    assert "vs bf16 (FP8 emulated)" in out and "TFLOP/s" in out and "native:delayed" in out and "unavailable:" in out
    assert "FP8 GEMMs emulated" in out.splitlines()[0] and data["meta"]["fp8_gemms"] == "emulated"
    assert "bf16's time / this row's (bigger is faster)" in out and "no FP8 speed-up" in out


def test_table_ratio_is_a_speed_up_and_says_so_where_fp8_hardware_ran():
    rows = [dict(shape="16x16x16", mode="eager", engine=engine, ms=ms, tflops=1.0, error=None)
            for engine, ms in (("bf16", 3.0), ("native:dynamic", 2.0))]
    table = bench.format_table(bench.add_speedups(rows))
    assert "1.50x" in table  # bf16's 3 ms / FP8's 2 ms: bigger is faster
    assert "emulated" not in table and "(bigger is faster)" in table


def test_rounds_report_each_case_once_at_the_median_of_its_rounds(tmp_path, capsys):
    status, data, csv_rows = _run(tmp_path, "--shapes", "32x32x32", "--engines", "native,te", "--modes", "eager",
                                  "--rounds", "3")
    assert status == 0 and data["meta"]["rounds"] == 3
    rows = data["rows"]
    assert [r["engine"] for r in rows] == ["bf16", "native:delayed", "te:delayed"] == [r["engine"] for r in csv_rows]
    for r in rows[:2]:
        assert len(r["ms_rounds"]) == 3 and r["ms"] == sorted(r["ms_rounds"])[1]
    assert _check_speedups(rows) == 2
    assert rows[2]["ms"] is None and rows[2]["error"].startswith("unavailable:")
    assert bench.main(["--device", "cpu", "--rounds", "0", "--no-progress"]) == 2
    assert "--rounds: must be >= 1." in capsys.readouterr().err


def test_a_case_failing_in_one_round_is_reported_failed():
    from fp8plug.bench import merge_rounds

    def row(ms, error=None):
        return dict(shape="16x16x16", M=16, K=16, N=16, mode="eager", engine="native:delayed", ms=ms,
                    tflops=None, error=error)

    (merged,) = merge_rounds([row(1.0), row(None, "CUDA out of memory at this shape"), row(3.0)])
    assert merged["ms"] is None and merged["error"] == "CUDA out of memory at this shape"
    assert merged["ms_rounds"] == [1.0, None, 3.0]


@pytest.mark.slow
def test_bench_smoke_compiled(tmp_path):
    status, data, _ = _run(tmp_path, "--shapes", "32x32x32", "--engines", "native:dynamic", "--modes", "compiled")
    assert status == 0
    rows = data["rows"]
    assert [(r["mode"], r["engine"]) for r in rows] == [("compiled", "bf16"), ("compiled", "native:dynamic")]
    assert all(r["error"] is None for r in rows), rows
    assert _check_speedups(rows) == 2
    assert all(r["vs_bf16_compiled"] == r["speedup"] for r in rows)


def test_compile_flag_adds_the_compiled_mode():
    parser = bench.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--device", "cpu", "--compile"])
    device, shapes, modes, warmup, repeats = bench.settings(args)
    assert modes == ["eager", "compiled"] and shapes == bench.CPU_SHAPES
    assert (warmup, repeats) == (2, 5)


def test_cli_bench_subcommand(tmp_path, capsys):
    from fp8plug.cli import main as cli_main

    status = cli_main(["bench", "--device", "cpu", "--shapes", "32x32x32", "--engines", "native", "--warmup", "0",
                       "--repeats", "1", "--no-progress", "--json", str(tmp_path / "b.json")])
    assert status == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["engine"] for r in rows] == ["bf16", "native:delayed"] and all(r["ms"] for r in rows)


# --- the training-step benchmark --------------------------------------------------------------------


@pytest.mark.slow
def test_train_step_tiny_smoke(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "training" / "train_step.py"), "--tiny", "--engines", "native,te",
         "--no-subprocess", "--steps", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "train_step.json").read_text())
    rows = {r["label"]: r for r in data["rows"]}
    assert list(rows) == ["bf16", "fp8plug native", "raw native", "fp8plug te", "raw te"]
    for label in ("bf16", "fp8plug native", "raw native"):
        r = rows[label]
        assert r["error"] is None, r
        assert r["tokens_per_s"] > 0 and 0 < r["loss"] < 10
    # 2 blocks x 7 projections in FP8; the head is kept in bf16 on every FP8 path
    assert rows["fp8plug native"]["fp8_modules"] == rows["raw native"]["fp8_modules"] == 14
    assert rows["bf16"]["speedup"] == 1.0
    assert rows["fp8plug native"]["overhead_pct"] == pytest.approx(
        (rows["raw native"]["tokens_per_s"] / rows["fp8plug native"]["tokens_per_s"] - 1) * 100)
    assert rows["raw te"]["error"].startswith("unavailable:")  # no TransformerEngine on a CPU
    md = (tmp_path / "train_step.md").read_text()
    assert "| fp8plug native |" in md and "overhead vs raw" in md


def test_timing_option():
    """--timing picks queued (default) or synced GPU timing; anything else is refused. The timing
    itself needs a GPU (tests/gpu runs the bench); on the CPU both are wall clock."""
    import argparse

    from fp8plug.bench import Timer, add_arguments

    parser = add_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).timing == "queued"
    assert parser.parse_args(["--timing", "synced"]).timing == "synced"
    with pytest.raises(SystemExit):
        parser.parse_args(["--timing", "sometimes"])
    with pytest.raises(ValueError, match="--timing: 'sometimes' is not one of queued, synced"):
        Timer(torch.device("cpu"), 1, 1, "sometimes")
    calls = []
    assert Timer(torch.device("cpu"), 1, 3, "synced")(lambda: calls.append("step"), lambda: calls.append("reset")) >= 0
    assert calls == ["reset", "step"] * 4


def test_a_delayed_case_runs_its_scaling_update_like_training():
    """The bench times what a training step does: with delayed scaling the end-of-step update
    runs after each backward, so the timed steps cast with the scales it sets (not the first
    step's fallback forever, which was what native:delayed had measured)."""
    from fp8plug.backends.native.engine import NativeFP8Linear
    from fp8plug.bench.cases import EngineSpec, linear_case

    step, reset = linear_case(EngineSpec("native:delayed", "native", "delayed"), (32, 32, 32), "eager",
                              torch.device("cpu"))
    for _ in range(3):
        reset()
        step()
    from fp8plug.backends.native import engine as native

    # the case's model is tracked for the end-of-step update like any converted model
    layers = [m for model in native._TRACKED for m in model.modules() if isinstance(m, NativeFP8Linear)]
    assert layers and int(layers[-1].fp8_step.min()) == 3


def test_step_profile_says_where_the_gpu_was_idle():
    sys.path.insert(0, str(ROOT / "benchmarks" / "training"))
    try:
        from gpu_time_by_kind import gpu_idle_ms, idle_gaps
    finally:
        sys.path.pop(0)
    # two steps (us): a cast, a 300 us wait, a GEMM overlapped by a copy on another stream, a 100 us gap
    kernels = []
    for base in (0, 10_000):
        kernels += [("cast", base, base + 100), ("gemm", base + 400, base + 1000), ("copy", base + 500, base + 1200),
                    ("adam", base + 1300, base + 1500)]
    gaps = idle_gaps(kernels, steps=2)  # largest first
    assert gaps[0] == dict(after="adam", before="cast", ms=4.25, count=0.5)  # between the two steps
    assert gaps[1] == dict(after="cast", before="gemm", ms=0.3, count=1.0)
    # the copy ended last before the optimizer's gap, not the GEMM it overlapped
    assert gaps[2] == dict(after="copy", before="adam", ms=0.1, count=1.0)
    assert sum(g["ms"] for g in gaps) == pytest.approx(gpu_idle_ms(kernels, steps=2))


def test_step_profile_groups_kernels_by_what_they_do():
    sys.path.insert(0, str(ROOT / "benchmarks" / "training"))
    try:
        from gpu_time_by_kind import group_of
    finally:
        sys.path.pop(0)
    # cuBLAS names operand types after nvjet_sm90_: q e4m3, r e5m2, t bf16, s float32
    assert group_of("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT") == "gemm-fp8"
    assert group_of("nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN") == "gemm-fp8"
    assert group_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    # cuDNN's attention kernels carry "sm90_" like GEMMs, and are attention
    assert group_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"
    assert group_of("cast_transpose_optimized_kernel(__nv_bfloat16 const*, __nv_fp8_e4m3*)") == "cast"
    assert group_of("cast_both_layouts") == "cast"
    assert group_of("sm90_xmma_gemm_e4m3e4m3_bf16") == "gemm-fp8"
    assert group_of("triton_poi_fused__to_copy_4") == "triton"
    assert group_of("void at::native::multi_tensor_apply_kernel<FusedOptimizer>") == "optimizer"
