"""FP8 experts under DDP and FSDP2 on two CPU processes (gloo), launched by the real `accelerate
launch` (tests/support/moe_distributed_worker.py: one launch runs both), against the same training
in one process on the same global batch (docs/moe.md, "Distributed training"). About 30 s, most of
it two processes importing torch, transformers and accelerate on a busy CPU.

Tolerances (bounds 50 dB, 15 dB, 0.2%, FSDP2 1%; measured on the CPU: above 80 dB, 19-21 dB,
0.02%, FSDP2 0.13%): DDP's gradient is the mean of the ranks' own FP8 gradients, so it matches the
mean of two one-process runs on the halves to float32 rounding (an FP8 rounding flipped by it
counts too); against one process on the whole batch it differs by FP8 scaling (the Linears'
per-tensor scales and the experts' weight-gradient scales per expert and column come from each
rank's tokens). FSDP2 computes in bf16 (Accelerate's FSDP2 policy for
mixed_precision="fp8" is param_dtype bf16) against fp32 weights under autocast in one process."""

import pytest
import torch

from tests.support import moe_distributed_worker as worker
from tests.support.processes import child_env

STEPS = 3
pytestmark = pytest.mark.slow  # the module's launch: two processes, about 30 s


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_distributed")
    proc = worker.launch(tmp / "out", ["ddp", "fsdp2"], STEPS, child_env(tmp, OMP_NUM_THREADS="1"), cpu=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return {phase: worker.read(tmp / "out", phase) for phase in ("ddp", "fsdp2")}


@pytest.fixture(scope="module")
def reference():
    return worker.references(STEPS, cpu=True)


def test_ddp_gradients_and_losses_match_one_process_on_the_global_batch(launched, reference):
    worker.check_ddp(launched["ddp"], reference, STEPS, halves_sqnr=50, whole_sqnr=15, loss_rtol=2e-3)


def test_fsdp2_shards_experts_by_expert_and_trains_them_in_fp8(launched, reference):
    worker.check_fsdp2(launched["fsdp2"], reference, STEPS, loss_rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fsdp2_full_state_dict_loads_into_a_plain_model_exactly(launched, dtype):
    worker.check_full_state_dict(launched["fsdp2"], dtype)
