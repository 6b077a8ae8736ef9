"""Tensor parallelism is refused at prepare, with the fix, for every engine
(fp8plug.integrations.tensor_parallel): a model whose Linears torch's parallelize_module sharded
over two gloo processes, a transformers Llama loaded there with tp_plan="auto", and Accelerate's
ParallelismConfig(tp_size=2) (which Accelerate itself accepts only on GPUs, so its config is read
here as prepare reads it)."""

import os
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from fp8plug.backends import get_backend
from fp8plug.integrations.tensor_parallel import check_no_tensor_parallel, tensor_parallel_size
from fp8plug.layers.rules import ConversionError


def _worker(rank, init_file, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fp8plug

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    accelerator = fp8plug.Accelerator(mixed_precision="fp8", cpu=True,
                                      kwargs_handlers=[fp8plug.FP8RecipeKwargs(backend="native")])
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        accelerator.prepare(model, optimizer)
        message = None
    except ConversionError as exc:
        message = str(exc)
    converted = any(type(m).__name__ == "NativeFP8Linear" for m in model.modules())
    # a transformers Llama loaded with tp_plan="auto" (its Linears' weights become DTensors)
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128)).save_pretrained(Path(out_dir, "llama"))
    dist.barrier()
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    llama = AutoModelForCausalLM.from_pretrained(Path(out_dir, "llama"), tp_plan="auto", device_mesh=tp_mesh)
    try:
        accelerator.prepare(llama)
        hf_message = None
    except ConversionError as exc:
        hf_message = str(exc)
    if rank == 0:
        Path(out_dir, "result.txt").write_text(repr(dict(message=message, converted=converted,
                                                         hf_message=hf_message)))
    dist.barrier()
    os._exit(0)  # gloo's teardown can hang at exit (see tests/cpu/test_coverage.py)


@pytest.mark.slow
def test_a_tensor_parallel_model_is_refused_at_prepare_naming_the_fix(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    result = eval(Path(tmp_path, "result.txt").read_text())
    message = result["message"]
    assert message is not None and not result["converted"]  # refused before anything was converted
    assert "tp_size=2" in message and "backend='native'" in message
    assert "dp_shard_size" in message and "fsdp_version=2" in message
    assert result["hf_message"] is not None and "tp_size=2" in result["hf_message"]


@pytest.mark.parametrize("backend", ["native", "ao"])
def test_parallelism_config_tp_size_is_refused_for_every_engine(backend):
    from accelerate.utils import ParallelismConfig

    engine = get_backend(backend)
    accelerator = types.SimpleNamespace(parallelism_config=ParallelismConfig(tp_size=2, dp_shard_size=2))
    with pytest.raises(ConversionError, match=rf"tp_size=2.*backend='{backend}'.*dp_shard_size"):
        check_no_tensor_parallel(accelerator, nn.Linear(16, 16), engine, "prepare(): argument 0: ")


def test_no_tensor_parallelism_passes():
    from accelerate.utils import ParallelismConfig

    accelerator = types.SimpleNamespace(parallelism_config=ParallelismConfig(dp_shard_size=2))
    assert tensor_parallel_size(accelerator, nn.Sequential(nn.Linear(16, 16))) is None
    assert tensor_parallel_size(types.SimpleNamespace(), nn.Linear(16, 16)) is None
