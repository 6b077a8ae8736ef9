"""Every script in examples/ runs on the CPU at a tiny size and does what it says.

Each example is run as a user would run it (a subprocess, `--device cpu`), and its last line,
`result: {json}`, is checked: the engine, which layers were converted or skipped, and that the
loss fell. The Hugging Face example also runs once under `accelerate launch` with the one-process
CPU config. No network: the Hugging Face hub is switched off.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def environment(tmp_path):
    return child_env(tmp_path)


def run(tmp_path, args, timeout=180):
    """Run a command in tmp_path; return the parsed `result:` line (its exit status must be 0)."""
    proc = subprocess.run(args, cwd=tmp_path, env=environment(tmp_path), capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("result: ")]
    assert len(lines) == 1, output[-4000:]
    return json.loads(lines[0][len("result: "):]), proc.stdout


def example(tmp_path, name, *args):
    return run(tmp_path, [sys.executable, str(EXAMPLES / name), "--device", "cpu", *args])


def test_hf_llama_trains_with_the_native_engine(tmp_path):
    result, stdout = example(tmp_path, "hf_llama_fp8.py", "--steps", "12", "--save-dir", str(tmp_path / "llama"))
    assert result["engine"] == "native" and result["device"] == "cpu"
    assert result["converted"] == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert result["skipped"] == ["lm_head"]  # the Accelerator's default keeps the output head in bf16
    assert result["last_loss"] < 0.95 * result["first_loss"]
    assert len(result["generated"]) == 5  # greedy generation from a 7-token prompt ran
    # the saved checkpoint is a plain LlamaForCausalLM's
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "llama" / "model.safetensors")
    assert "model.layers.0.mlp.up_proj.weight" in saved
    assert not [key for key in saved if "fp8" in key or key.endswith("_extra_state")]


@pytest.mark.slow
def test_hf_llama_under_accelerate_launch_with_the_cpu_config(tmp_path):
    config = EXAMPLES / "configs" / "cpu_fp8.yaml"
    assert config.exists()
    result, _ = run(tmp_path, [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                               str(EXAMPLES / "hf_llama_fp8.py"), "--steps", "6"])
    assert result["engine"] == "native"  # from the config file's fp8_config, not the script
    assert result["converted"] == 14 and result["last_loss"] < result["first_loss"]


def test_trainer_fp8_trains_saves_and_matches_bf16(tmp_path):
    result, stdout = example(tmp_path, "trainer_fp8.py", "--steps", "16", "--compare-bf16")
    assert result["engine"] == "native" and result["device"] == "cpu" and result["processes"] == 1
    assert result["converted"] == 14 and result["skipped"] == ["lm_head"]
    assert result["last_loss"] < 0.85 * result["first_loss"]
    bf16_last = result["bf16_losses"][-1]
    assert abs(result["last_loss"] - bf16_last) < 0.03 * bf16_last  # FP8 tracks plain Trainer in bf16
    # the checkpoint loads into plain transformers: tie kept, same logits; FP8 state saved beside it
    assert result["reloaded_same_logits"] and result["reloaded_tied"] and result["fp8_state_saved"]
    assert "skipped   lm_head: the output head stays in high precision" in stdout  # the report is printed


def test_convert_by_hand(tmp_path):
    result, stdout = example(tmp_path, "convert_by_hand.py", "--steps", "20")
    assert result["engine"] == "native"
    assert result["converted"] == ["up", "down"]
    assert "not divisible by 16" in result["skipped"]["odd"]
    assert result["skipped"]["head"] == "listed in modules_to_ignore"
    assert result["plain_keys"] is True
    assert result["eval_diff"] == 0.0  # eval runs the very same high-precision ops as the plain model
    assert result["last_loss"] < 0.5 * result["first_loss"]
    assert "native: converted 2 Linear layers, skipped 2 Linear layers" in stdout  # the ConversionReport is printed
    assert "after unconvert_model, FP8 layers left: False" in stdout


def test_torchao_seed_loops(tmp_path):
    result, _ = example(tmp_path, "torchao_seed_loop.py")
    dynamic, delayed = result["dynamic"], result["delayed"]
    assert dynamic["layers"] == {"w1": "AOFloat8Linear", "w2": "AOFloat8Linear", "odd": "Linear", "output": "Linear"}
    assert delayed["layers"] == {"w1": "NativeFP8Linear", "w2": "NativeFP8Linear", "odd": "Linear", "output": "Linear"}
    for run_result in (dynamic, delayed):
        assert run_result["last_loss"] < 0.6 * run_result["first_loss"]


def test_olmo_core_float8_config(tmp_path):
    result, _ = example(tmp_path, "olmo_core_float8.py", "--steps", "20")
    assert result["recipe"] == "config"
    assert result["converted"] == 14 and result["skipped"] == ["lm_head"]
    assert result["last_loss"] < result["first_loss"]
