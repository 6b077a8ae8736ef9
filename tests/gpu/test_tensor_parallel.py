"""Tensor parallelism in FP8 with the native engine, through Accelerate's ParallelismConfig (tp_size=2,
and dp_shard_size=2 with FSDP2 on four GPUs) for a transformers Llama loaded with tp_plan="auto":
bf16 TP (the baseline), then fp8plug's native engine eager and compiled, each 200 steps on the same
batches; the FP8 losses (mean of the last 10 steps) within 1% of bf16's, every converted GEMM in
FP8. Skipped with fewer than two GPUs (NCCL); four run tp_size=2 x dp_shard_size=2.

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
STEPS = 200
BOUND = 0.01  # FP8 within 1% of bf16 TP, on the mean of the last 10 steps


def _save_model(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)


def tail(losses, n=10):
    return sum(losses[-n:]) / n


def test_tensor_parallel_fp8_native_trains_within_one_percent_of_bf16(tmp_path):
    world = 4 if torch.cuda.device_count() >= 4 else 2
    _save_model(tmp_path / "model")
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(WORKER),
           "--model-dir", str(tmp_path / "model"), "--out", str(out), "--steps", str(STEPS)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(tmp_path), capture_output=True, text=True, timeout=1200)
    assert out.exists(), (proc.stdout + proc.stderr)[-5000:]
    result = json.loads(out.read_text())
    errors = {mode: r["error"] for mode, r in result.items() if isinstance(r, dict) and "error" in r}
    assert not errors, (errors, (proc.stdout + proc.stderr)[-5000:])
    bf16 = tail(result["bf16"]["losses"])
    assert result["bf16"]["losses"][-1] < result["bf16"]["losses"][0] - 1
    for mode in ("fp8-eager", "fp8-compiled"):
        r = result[mode]
        if not r["fp8_gemms"]:
            print({k: v for k, v in r.items() if k != "losses"}, (proc.stdout + proc.stderr)[-6000:])
        assert r["fp8_gemms"] > 0 and r["high_precision_gemms"] == 0, (mode, r)
        gap = (tail(r["losses"]) - bf16) / bf16
        print(f"TP x{world} {mode}: loss {tail(r['losses']):.4f} vs bf16 {bf16:.4f} ({gap:+.2%}), "
              f"median step {r['step_s'] * 1e3:.1f} ms vs bf16 {result['bf16']['step_s'] * 1e3:.1f} ms")
        assert abs(gap) < BOUND, (mode, gap)
