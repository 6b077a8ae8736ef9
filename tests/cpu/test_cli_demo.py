"""`fp8plug env` and the README's demo: FP8 training of a tiny LM within 10% of bf16's loss."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.threads import one_thread  # noqa: F401 - autouse: the demo's tiny model on one torch thread

ROOT = Path(__file__).resolve().parents[2]


def test_env_reports_every_engine_and_the_choice():
    result = subprocess.run([sys.executable, "-m", "fp8plug", "env"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for needle in ("Python", "torch", "accelerate", "device", "msamp", "te ", "ao ", "native", "automatic choice:"):
        assert needle in out, needle
    assert "TransformerEngine" in out and "MS-AMP" in out and "torchao" in out


def test_env_report_function_names_the_device():
    from fp8plug.cli import env_report

    assert "CPU" in env_report("cpu")


def test_env_says_fp8_gemms_are_emulated_on_a_cpu_and_how_fast():
    from fp8plug.cli import env_report

    line = [line for line in env_report("cpu").splitlines() if line.startswith("FP8 GEMMs")][0]
    assert "emulated; a 512x128x512 GEMM takes" in line and "ms in bf16" in line
    # no "x" figure: an emulated FP8 time over a CPU's bf16 time is no speed-up
    assert not re.search(r"\dx\b", line) and "no FP8 speed-up" in line


def run_demo(capsys, steps):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import fp8_demo
    finally:
        sys.path.pop(0)
    status = fp8_demo.main(["--steps", str(steps)])
    return status, capsys.readouterr().out


def test_demo_labels_its_cpu_timings_as_emulation(capsys):
    _, out = run_demo(capsys, 2)
    time_line = [line for line in out.splitlines() if line.startswith("time:")][0]
    assert "FP8 GEMMs are emulated on a CPU" in time_line and "no FP8 speed-up" in time_line
    assert not re.search(r"\dx\b", time_line)


@pytest.mark.slow
def test_demo_fp8_loss_within_ten_percent_of_bf16(capsys):
    status, out = run_demo(capsys, 100)
    assert "engine: native" in out and "converted 14 Linear layers" in out
    final = [line for line in out.splitlines() if line.startswith("final loss")][0]
    gap = float(final.rsplit("relative gap", 1)[1].strip().rstrip("%")) / 100
    assert gap <= 0.10 and status == 0


def test_env_says_whether_the_speed_filter_acts(monkeypatch):
    from fp8plug.cli import auto_filter_status, env_report
    from fp8plug.tuning.hardware import DeviceInfo

    monkeypatch.delenv("FP8PLUG_AUTO_FILTER", raising=False)
    assert "auto_filter  off" in env_report("cpu")
    h100 = DeviceInfo("cuda", "NVIDIA H100", (9, 0))
    assert auto_filter_status("native", h100).startswith("on: Linears predicted below 0.85x")
    # at the scaling the automatic choice runs native with, as the Accelerator does
    assert auto_filter_status("native", h100, "dynamic").startswith("on:")
    assert auto_filter_status("native", h100, "rowwise").startswith("on:")  # its own constants
    assert auto_filter_status("native", h100, "rowwise_with_gw_hp").startswith("off")  # none measured
    monkeypatch.setenv("FP8PLUG_AUTO_FILTER", "false")
    assert auto_filter_status("native", h100).startswith("off")
    monkeypatch.setenv("FP8PLUG_AUTO_FILTER", "true")
    assert "no calibrated cost model" in auto_filter_status("native", DeviceInfo("cpu", "x86_64"))
