"""Every config fp8plug ships works in a process that also builds a plain accelerate.Accelerator.

`accelerate launch` exports each `fp8_config:` key as ACCELERATE_FP8_<KEY>, and any plain
accelerate.Accelerator in the launched process (Trainer builds one) reads ACCELERATE_FP8_BACKEND
and crashes on a value it does not know ('native', lower-case 'ao'). fp8plug's configs therefore
name the engine under `engine:` (ACCELERATE_FP8_ENGINE, which accelerate ignores); the old
`backend:` spelling is still read by fp8plug.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from fp8plug import FP8RecipeKwargs
from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
# the engine each shipped config names, and whether that engine can run on this CPU-only machine
EXPECTED = {"cpu_fp8": "native", "cpu_ddp_fp8": "native", "cpu_deepspeed_fp8": "native", "gpu_fp8": "te",
            "2gpu_fsdp2_fp8": "ao", "2gpu_deepspeed_fp8": "te", "cpu_2nodes_fp8": "native"}
# a config for several machines needs one launcher per machine: tests/cpu/test_multinode.py runs it
MULTI_NODE = {"cpu_2nodes_fp8"}

SCRIPT = '''
import json, os, sys
from pathlib import Path

import accelerate
import torch
import fp8plug
from fp8plug import BackendUnavailableError, FP8RecipeKwargs

order, out = sys.argv[1], Path(sys.argv[2])
# without cpu=True, processes launched by a MULTI_GPU config on a machine without a GPU do not join;
# with it, accelerate would drop a DeepSpeed config (fp8plug refuses that, and joins them over gloo)
cpu = not torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_DEEPSPEED") != "true"
result = {"recipe_backend": FP8RecipeKwargs().backend}


def plain():
    accelerator = accelerate.Accelerator(cpu=cpu)
    result["plain"] = {"mixed_precision": accelerator.mixed_precision, "fp8_backend": str(accelerator.fp8_backend)}
    result["rank"], result["processes"] = accelerator.process_index, accelerator.num_processes


def ours():
    try:
        accelerator = fp8plug.Accelerator(cpu=cpu)
    except BackendUnavailableError as error:  # a GPU engine on this CPU
        result["fp8plug"] = {"unavailable": str(error)}
        return
    result["fp8plug"] = {"mixed_precision": accelerator.mixed_precision, "engine": accelerator.fp8_engine.name}


for step in (plain, ours) if order == "plain-first" else (ours, plain):
    step()
out.mkdir(exist_ok=True)
(out / f"rank{result['rank']}.json").write_text(json.dumps(result))
accelerate.PartialState().destroy_process_group()  # before exit: gloo's threads can abort a rank there
'''


def launch(tmp_path, config, order):
    script = tmp_path / "both.py"
    script.write_text(SCRIPT)
    env = child_env(tmp_path, OMP_NUM_THREADS="1")
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(script), order,
           str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    return proc.returncode, results, proc.stdout + proc.stderr


def test_every_shipped_config_is_checked():
    assert {config.stem for config in CONFIGS} == set(EXPECTED)
    for config in CONFIGS:
        text = config.read_text()
        assert "\n  engine: " in text and "\n  backend: " not in text, config.name


@pytest.mark.slow
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.stem not in MULTI_NODE], ids=lambda path: path.stem)
def test_plain_accelerator_beside_fp8plugs(tmp_path, config):
    code, results, output = launch(tmp_path, config, "fp8plug-first")
    assert code == 0, output[-3000:]
    processes = 2 if "num_processes: 2" in config.read_text() else 1
    assert sorted(results) == list(range(processes)), output[-3000:]
    engine = EXPECTED[config.stem]
    for result in results.values():
        assert result["processes"] == processes and result["recipe_backend"] == engine
        assert result["plain"]["fp8_backend"] == "FP8BackendType.NO"  # accelerate saw no engine it cannot read
        if engine == "te":  # TransformerEngine needs a CUDA GPU; tests/gpu runs this config for real
            assert "cannot run here" in result["fp8plug"]["unavailable"]
        else:
            assert result["fp8plug"] == {"mixed_precision": "fp8", "engine": engine}


@pytest.mark.slow
def test_plain_accelerator_first_then_fp8plugs(tmp_path):
    """A plain Accelerator built first fixes accelerate's shared state at 'fp8'; fp8plug's then
    keeps that value (accelerate refuses a change) and still trains in FP8 with its engine."""
    code, results, output = launch(tmp_path, ROOT / "examples" / "configs" / "cpu_fp8.yaml", "plain-first")
    assert code == 0, output[-3000:]
    assert results[0]["fp8plug"] == {"mixed_precision": "fp8", "engine": "native"}


def test_engine_key_is_read_and_old_backend_key_still_is():
    with mock.patch.dict(os.environ, {"ACCELERATE_FP8_ENGINE": "NATIVE"}):
        assert FP8RecipeKwargs().backend == "native"
    with mock.patch.dict(os.environ, {"ACCELERATE_FP8_BACKEND": "native"}):  # the old spelling
        assert FP8RecipeKwargs().backend == "native"
    with mock.patch.dict(os.environ, {"ACCELERATE_FP8_ENGINE": "ao"}):
        assert FP8RecipeKwargs(backend="native").backend == "native"  # the script's argument wins
    with mock.patch.dict(os.environ, {"ACCELERATE_FP8_ENGINE": "tpu"}):
        with pytest.raises(ValueError, match=r"backend \(from ACCELERATE_FP8_ENGINE\): unknown backend 'tpu'"):
            FP8RecipeKwargs()
