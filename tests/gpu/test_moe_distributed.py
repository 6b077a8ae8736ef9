"""FP8 experts under DDP and FSDP2 on two GPUs (NCCL), launched by `accelerate launch` with two
processes (tests/support/moe_distributed_worker.py, one launch for both), against the same
training in one process on one GPU: the checks of tests/cpu/test_moe_distributed.py with the
grouped GEMMs of torch._scaled_grouped_mm (sm_90). Bounds looser than the CPU's: on the GPU the
token gathers' backward accumulates with atomics, in no fixed order, and bf16 outputs round that."""

import pytest
import torch

from tests.support import moe_distributed_worker as worker
from tests.support.processes import child_env

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="torch._scaled_grouped_mm with rowwise scales needs sm_90"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

STEPS = 10


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_distributed")
    proc = worker.launch(tmp / "out", ["ddp", "fsdp2"], STEPS, child_env(tmp), cpu=False, timeout=500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return {phase: worker.read(tmp / "out", phase) for phase in ("ddp", "fsdp2")}


@pytest.fixture(scope="module")
def reference():
    return worker.references(STEPS, cpu=False)


def test_ddp_gradients_and_losses_match_one_process_on_the_global_batch(launched, reference):
    worker.check_ddp(launched["ddp"], reference, STEPS, halves_sqnr=30, whole_sqnr=12, loss_rtol=1e-2)


def test_fsdp2_shards_experts_by_expert_and_trains_them_in_fp8(launched, reference):
    worker.check_fsdp2(launched["fsdp2"], reference, STEPS, loss_rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fsdp2_full_state_dict_loads_into_a_plain_model_exactly(launched, dtype):
    worker.check_full_state_dict(launched["fsdp2"], dtype)
