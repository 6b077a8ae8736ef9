"""Tensor parallelism with Accelerate's ParallelismConfig (tp_size=2, and dp_shard_size=2 with FSDP2
on four GPUs) for a transformers Llama loaded with tp_plan="auto": bf16 trains (the baseline; its
step time is printed), and fp8plug.Accelerator refuses the model at prepare with the fix (no fp8plug
engine carries a tensor-parallel plan over yet: fp8plug.integrations.tensor_parallel), instead of
crashing inside the step. Skipped with fewer than two GPUs; four run tp_size=2 x dp_shard_size=2
(device kind nvidia-h100-x4).

Run: source .gpu/install.sh && python3 -m pytest tests/gpu/test_tensor_parallel.py -q -s
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.processes import child_env

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "tensor_parallel_worker.py"


def _save_model(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)


def test_tensor_parallel_bf16_trains_and_fp8_is_refused_at_prepare(tmp_path):
    world = 4 if torch.cuda.device_count() >= 4 else 2
    _save_model(tmp_path / "model")
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(WORKER),
           "--model-dir", str(tmp_path / "model"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(tmp_path), capture_output=True, text=True, timeout=500)
    assert out.exists(), (proc.stdout + proc.stderr)[-5000:]
    result = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    losses = result["bf16_losses"]
    assert all(map(lambda x: x == x, losses)) and losses[-1] < losses[0]
    print(f"bf16 TP x{world}: median step {result['bf16_step_s'] * 1e3:.1f} ms")
    refusal = result["refusal"]
    assert refusal is not None, "fp8plug.Accelerator prepared a tensor-parallel model"
    assert "tp_size=2" in refusal and "dp_shard_size" in refusal and "backend=" in refusal
