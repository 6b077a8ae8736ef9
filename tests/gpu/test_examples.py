"""The examples in examples/ run unchanged on a GPU (`--device cuda`), with each engine that runs
there. tests/cpu/test_examples.py runs them on the CPU; this is the same check with real FP8 GEMMs.
Skipped unless a CUDA GPU with compute capability 8.9+ is visible (tests/gpu/conftest.py).

Run: source .gpu/install.sh && python3 -m pytest tests/gpu/test_examples.py -q
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ENGINES = ["native", "ao", "te"]


def run(tmp_path, name, *args, expect_ok=True, timeout=400):
    """Run examples/<name> on the GPU; return (parsed `result:` line or None, output)."""
    env = child_env(tmp_path)
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), "--device", "cuda", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if not expect_ok:
        assert proc.returncode != 0, output[-4000:]
        return None, output
    assert proc.returncode == 0, output[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("result: ")]
    assert len(lines) == 1, output[-4000:]
    return json.loads(lines[0][len("result: "):]), output


@pytest.mark.parametrize("backend", ENGINES)
def test_hf_llama_on_gpu(tmp_path, backend):
    result, output = run(tmp_path, "hf_llama_fp8.py", "--backend", backend, "--steps", "30",
                         "--save-dir", str(tmp_path / "llama"))
    assert result["engine"] == backend and result["device"] == "cuda", output[-2000:]
    assert result["converted"] == 14 and result["skipped"] == ["lm_head"]
    assert result["last_loss"] < 0.9 * result["first_loss"], result
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "llama" / "model.safetensors")
    assert not [key for key in saved if key.endswith("_extra_state")]  # plain keys, TE included


@pytest.mark.parametrize("backend", ENGINES)
def test_convert_by_hand_on_gpu(tmp_path, backend):
    result, output = run(tmp_path, "convert_by_hand.py", "--backend", backend)
    assert result["engine"] == backend and result["device"] == "cuda"
    assert result["converted"] == ["up", "down"], output[-2000:]
    assert set(result["skipped"]) == {"odd", "head"}
    assert result["plain_keys"] is True
    assert result["eval_diff"] <= 1e-2, result  # eval in high precision: the plain model's output
    assert result["last_loss"] < 0.5 * result["first_loss"], result


@pytest.mark.parametrize("extra", [[], ["--compile", "--iters", "20"]], ids=["eager", "compiled"])
def test_torchao_seed_loops_on_gpu(tmp_path, extra):
    result, output = run(tmp_path, "torchao_seed_loop.py", *extra)
    assert result["dynamic"]["layers"]["w1"] == "AOFloat8Linear", output[-2000:]
    assert result["delayed"]["layers"]["w1"] == "NativeFP8Linear"
    for loop in ("dynamic", "delayed"):
        assert result[loop]["last_loss"] < 0.8 * result[loop]["first_loss"], result


@pytest.mark.parametrize("recipe", ["config", "rowwise"])
def test_olmo_core_float8_on_gpu(tmp_path, recipe):
    result, output = run(tmp_path, "olmo_core_float8.py", "--recipe", recipe)
    assert result["converted"] == 14 and result["skipped"] == ["lm_head"], output[-2000:]
    assert result["last_loss"] < result["first_loss"], result


def test_olmo_core_mxfp8_is_refused_clearly_below_blackwell(tmp_path):
    import torch

    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("a Blackwell GPU may run MXFP8")
    _, output = run(tmp_path, "olmo_core_float8.py", "--recipe", "mxfp8", expect_ok=False)
    assert "MXFP8 training cannot run here" in output, output[-2000:]
