"""FP8Trainer on the GPU with each engine, resuming from a checkpoint, 2-process NCCL under
`accelerate launch`, and the shipped GPU configs beside a plain accelerate.Accelerator.
tests/cpu/test_trainer.py and tests/cpu/test_launch_configs.py are the CPU versions.

Run: source .gpu/install.sh && python3 -m pytest tests/gpu/test_trainer.py -q
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cpu.test_launch_configs import launch as launch_both
from tests.support.hf import fresh
from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "trainer_fp8.py"
ENGINES = ["native", "ao", "te"]


def environment(tmp_path):
    return child_env(tmp_path)


def one_gpu_environment(tmp_path):
    """One GPU visible, for a single process: one that sees two is refused (FP8TrainerMixin:
    Trainer would train under nn.DataParallel, which never converts the model)."""
    return child_env(tmp_path, CUDA_VISIBLE_DEVICES="0")


def check_against_bf16(result, backend):
    assert result["engine"] == backend and result["device"] == "cuda", result
    assert result["converted"] == 14 and result["skipped"] == ["lm_head"]
    assert result["last_loss"] < 0.85 * result["first_loss"], result
    bf16_last = result["bf16_losses"][-1]
    assert abs(result["last_loss"] - bf16_last) < 0.05 * bf16_last, (result["last_loss"], bf16_last)
    assert result["fp8_state_saved"] and result["reloaded_tied"]
    # eval in high precision: the reloaded plain model's logits (TE's own GEMM: to rounding)
    assert result["reloaded_logits_rel_diff"] <= (0.0 if backend == "native" else 1e-2), result


@pytest.mark.parametrize("backend", ENGINES)
def test_fp8_trainer_one_gpu(tmp_path, backend):
    cmd = [sys.executable, str(EXAMPLE), "--device", "cuda", "--backend", backend, "--steps", "30", "--compare-bf16"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=one_gpu_environment(tmp_path), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    line = [entry for entry in proc.stdout.splitlines() if entry.startswith("result: ")][-1]
    check_against_bf16(json.loads(line[len("result: "):]), backend)


@pytest.mark.parametrize("backend", ENGINES)
def test_resume_from_checkpoint_on_gpu(tmp_path, backend):
    from fp8plug import FP8RecipeKwargs
    from fp8plug.integrations.trainer import FP8Trainer
    from tests.cpu.test_trainer import Counting, arguments, losses, tiny_llama

    def run(out, resume=None):
        fresh()  # two Trainers in one process
        args = arguments(out, use_cpu=False, max_steps=6, save_strategy="steps", save_steps=4)
        args._n_gpu = 1  # one GPU on a machine with more (one process seeing several is refused)
        trainer = FP8Trainer(model=tiny_llama(seed=0 if resume is None else 7), args=args, train_dataset=Counting(12),
                             fp8_recipe=FP8RecipeKwargs(backend=backend, auto_filter=False))
        trainer.train(resume_from_checkpoint=resume)
        assert trainer.accelerator.device.type == "cuda" and len(trainer.accelerator.fp8_reports[0].converted) >= 14
        return losses(trainer, after_step=4)

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-4"))
    assert len(full) == 2
    # GPU kernels need not be bit-reproducible run to run; a lost FP8 state shows far above this
    assert resumed == pytest.approx(full, rel=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("backend", ["native", "te"])
def test_two_gpus_nccl_under_accelerate_launch(tmp_path, backend):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "fp8", "--dynamo_backend", "no", "--main_process_port", "0",
           str(EXAMPLE), "--backend", backend, "--steps", "30", "--compare-bf16", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=environment(tmp_path), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["processes"] == 2
        check_against_bf16(result, backend)
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"]  # DDP over NCCL kept them equal


@pytest.mark.parametrize("config", ["gpu_fp8", "2gpu_fsdp2_fp8"])
def test_gpu_configs_beside_a_plain_accelerator(tmp_path, config):
    if config.startswith("2gpu") and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    code, results, output = launch_both(tmp_path, ROOT / "examples" / "configs" / f"{config}.yaml", "fp8plug-first")
    assert code == 0, output[-3000:]
    engine = {"gpu_fp8": "te", "2gpu_fsdp2_fp8": "ao"}[config]
    for result in results.values():
        assert result["fp8plug"] == {"mixed_precision": "fp8", "engine": engine}
        assert result["plain"]["fp8_backend"] == "FP8BackendType.NO"
