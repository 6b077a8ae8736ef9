"""fsdp2_llama.py's rows under DeepSpeed ZeRO-3 (`--strategy zero3`): the plugin, and the model,
optimizer and schedule prepared; fsdp2_llama.py builds the row's Accelerator with that plugin and
its training loop runs them as it runs the FSDP2 rows.

A module of its own so that fsdp2_llama.py holds the FSDP2 rows and the loop every strategy
shares; what ZeRO-3 changes is written here once: the model built inside `deepspeed.zero.Init`
(bench_model.build_zero3_model), Accelerate's DeepSpeedPlugin, the optimizer that steps ZeRO-3's
own flat partitions, and `DeepSpeedEngine.compile` for `-usercompiled`.
"""

from __future__ import annotations

import os
import time
import types

from bench_model import build_zero3_model, weight_sums
from hf_llama_measure import model_facts
from hf_llama_task import warmup_schedule


def zero3_plugin(spec: dict):
    """DeepSpeed ZeRO-3 as Accelerate's DeepSpeedPlugin sets it up: bf16 (the mixed precision
    fills it in), no offload, the row's micro-batch; the model is partitioned by zero.Init in
    build_zero3_model, not by Accelerate's zero3_init_flag (which acts only inside from_pretrained)."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=1, gradient_clipping=None, zero3_init_flag=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=spec["batch"], train_batch_size=spec["batch"] * world,
                                   steps_per_print=10**9)
    return plugin


def prepare_zero3(mode: str, engine, spec: dict, args, t0: float, accelerator, out: dict):
    """The model built partitioned, its optimizer and schedule prepared by Accelerate under
    DeepSpeed, `out` given the row's facts; compiled through DeepSpeedEngine.compile where `mode`
    is usercompiled (its hooks stay outside the graph). (model, optimizer, scheduler)."""
    import torch

    device = accelerator.device
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    kind = str(accelerator.distributed_type)
    if accelerator.num_processes != launched or "DEEPSPEED" not in kind:
        # accelerate.Accelerator on CPU processes, for one, runs each alone and without DeepSpeed
        raise RuntimeError(f"Accelerate did not run DeepSpeed over the {launched} launched processes "
                           f"({kind}, {accelerator.num_processes} processes)")
    model = build_zero3_model(spec, accelerator, device)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = warmup_schedule(optimizer, args.steps)
    everything = types.SimpleNamespace(param_groups=[{"params": list(model.parameters())}])
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    out.update(parameters=params, linears=linears, prepared_s=time.time() - t0, init_sums=weight_sums(model, device))
    # ZeRO-3 steps its own flat fp32 partitions of every parameter given to prepare
    out.update(model_facts(model, everything, accelerator, engine), params_not_stepped=None)
    if mode == "usercompiled":
        model.compile(backend=args.compile_backend)
    return model, optimizer, scheduler
