"""Two GPUs through `accelerate launch`: DDP and FSDP2 with the native, torchao and
TransformerEngine engines, each training a small decoder for 200 steps to within 5% of the same
run in bf16. Skipped unless two sm_89+ GPUs are visible (device kind nvidia-h200-x2).

Run: source .gpu/install.sh && python3 -m pytest tests/gpu/test_distributed.py -q -s
With FP8PLUG_RECORD_DIR=<dir> each run's summary is also written there as JSON (for docs/).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.processes import child_env
from tests.support.record import record

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_accelerate.py"
CONFIGS = ROOT / "examples" / "configs"
STEPS = 200
MAX_GAP = 0.05
TRAIN_ARGS = ["--steps", str(STEPS), "--batch", "8", "--seq", "64", "--vocab", "256", "--dim", "128",
              "--ffn", "512", "--lr", "3e-3"]

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def write_config(tmp_path, mode, precision, backend=None) -> Path:
    """A launch config for `mode` ("ddp" or "fsdp2") from the shipped examples."""
    if mode == "fsdp2":
        config = yaml.safe_load((CONFIGS / "2gpu_fsdp2_fp8.yaml").read_text())
    else:
        config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 1,
                  "num_processes": 2, "main_process_port": 0, "gpu_ids": "all"}
    config["mixed_precision"] = precision
    if precision == "fp8":
        config["fp8_config"] = {**config.get("fp8_config", {}), "backend": backend}
    else:
        config.pop("fp8_config", None)
    path = tmp_path / f"{mode}_{precision}_{backend}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(tmp_path, config):
    env = child_env(tmp_path)
    out = tmp_path / f"results_{config.stem}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(SCRIPT), *TRAIN_ARGS,
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    # each rank writes its own file (two ranks' long stdout lines can interleave)
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    assert sorted(results) == [0, 1], output[-5000:]
    return results


def tail(losses):
    return sum(losses[-10:]) / 10


_BF16 = {}


def bf16_final(tmp_path, mode):
    if mode not in _BF16:
        results = launch(tmp_path, write_config(tmp_path, mode, "bf16"))
        _BF16[mode] = tail(results[0]["losses"])
    return _BF16[mode]


@pytest.mark.parametrize("backend", ["native", "ao", "te"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_gpus_train_within_5_percent_of_bf16(tmp_path, mode, backend):
    reference = bf16_final(tmp_path, mode)
    results = launch(tmp_path, write_config(tmp_path, mode, "fp8", backend))
    first, second = results[0], results[1]
    expected_type = "DistributedType.FSDP" if mode == "fsdp2" else "DistributedType.MULTI_GPU"
    for result in (first, second):
        assert result["distributed_type"] == expected_type and result["world_size"] == 2
        assert result["mixed_precision"] == "fp8" and result["engine"] == backend
        assert result["converted"] >= 14
    assert first["losses"] == second["losses"]  # the all-reduced loss, the same on both ranks
    assert first["weights"]["keys"] == 22  # the plain architecture's keys, gathered on rank 0
    if mode == "ddp":
        assert first["weights"]["sha256"] == second["weights"]["sha256"]
    if backend == "native":  # delayed scaling: amaxes reduced across ranks, one state on both
        assert first["fp8_state"] is not None and first["fp8_state"] == second["fp8_state"]
    final = tail(first["losses"])
    gap = abs(final - reference) / reference
    record(f"{mode}_{backend}", {"mode": mode, "backend": backend, "steps": STEPS, "fp8_final_loss": final,
                                 "bf16_final_loss": reference, "relative_gap": gap,
                                 "first_loss": first["losses"][0]})
    assert final < first["losses"][0]
    assert gap <= MAX_GAP, (mode, backend, final, reference)
