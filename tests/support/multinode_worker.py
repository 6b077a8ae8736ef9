"""The training script tests/cpu/test_multinode.py launches on two "nodes" of two processes each.

    accelerate launch --config_file examples/configs/cpu_2nodes_fp8.yaml --machine_rank R \\
        --main_process_port PORT tests/support/multinode_worker.py --out OUT [--save-at K --save-dir DIR] [--resume DIR]

A user's script: fp8plug.Accelerator with the engine and recipe from the launch config (native,
delayed scaling), a small MLP of three FP8 Linears with dropout, AdamW and an LR scheduler
prepared by the Accelerator, a step counter registered for checkpointing. Each rank trains on its
own data, scaled by (rank + 1), so every rank measures other amaxes and the amax reduction across
ranks decides the scales. Per step, each rank records what it measured itself (the layers'
`fp8_amax_recorded`, read after backward and before the optimizer step reduces it) and the
newest entry of each amax history after the step. At the end it gathers every rank's whole FP8
state (histories, scales, update counts) with `accelerator.gather` and checks that all ranks hold
the same. Each rank writes OUT/rank<r>.json; the test compares them.

`--save-at K` calls `accelerator.save_state(DIR)` after step K and trains on; `--resume DIR`
builds the model from another seed (so nothing but the checkpoint can make it match), calls
`accelerator.load_state(DIR)` and continues from the saved step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedDataParallelKwargs
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs

DIM, HIDDEN, OUT_DIM, BATCH = 32, 64, 16, 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.drop = nn.Dropout(0.1)  # draws from each rank's RNG: a resume must restore all four
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, OUT_DIM)

    def forward(self, x):
        return self.head(F.gelu(self.down(self.drop(F.gelu(self.up(x))))))


class Progress:
    """The step counter, saved and restored with the checkpoint (register_for_checkpointing)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def batch(step: int, rank: int):
    """Rank `rank`'s batch at `step`: its own inputs, (rank + 1) times larger than rank 0's, and a
    fixed linear target."""
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(BATCH, DIM, generator=gen) * (rank + 1)
    teacher = torch.randn(DIM, OUT_DIM, generator=torch.Generator().manual_seed(123)) / DIM**0.5
    return x, x @ teacher


def fp8_state(accelerator, model) -> dict:
    """{layer: {buffer: nested lists}} of the engine's scaling state (fp8_amax_history, fp8_scale,
    fp8_step, fp8_amax_recorded), on this rank."""
    state = accelerator.fp8_engine.fp8_state(accelerator.unwrap_model(model))
    return {layer: {name: value.tolist() for name, value in buffers.items()} for layer, buffers in state.items()}


def weights(model) -> dict:
    """The exact bytes of the weights (sha256) and their values (to say how far apart two runs are)."""
    sha = hashlib.sha256()
    values = {}
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().float().contiguous()
        sha.update(name.encode())
        sha.update(tensor.numpy().tobytes())
        values[name] = tensor.flatten().tolist()
    return {"sha256": sha.hexdigest(), "values": values}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--save-dir", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="DDP's find_unused_parameters: keeps its gradient buckets in one layout (the test says why)")
    args = p.parse_args()

    # engine, format and history length come from the launch config; the layers here are small
    handlers = [FP8RecipeKwargs(auto_filter=False)]
    if args.find_unused_parameters:
        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    accelerator = fp8plug.Accelerator(kwargs_handlers=handlers)
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(1 if args.resume else 0)  # a resumed run starts from other weights
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    torch.manual_seed(1000 + rank)  # each rank its own dropout masks
    if args.resume:
        accelerator.load_state(args.resume)
    loaded_sha = weights(accelerator.unwrap_model(model))["sha256"]

    info = {
        "rank": rank, "world_size": world, "local_rank": accelerator.local_process_index,
        "node": int(os.environ["GROUP_RANK"]), "nodes": int(os.environ["GROUP_WORLD_SIZE"]),
        "distributed_type": str(accelerator.distributed_type), "backend": accelerator.state.backend,
        "engine": accelerator.fp8_engine.name, "recipe": accelerator.fp8_recipe.to_dict(),
        "start_step": progress.step, "start_weights_sha256": loaded_sha, "steps": [],
    }
    model.train()
    while progress.step < args.steps:
        x, y = batch(progress.step, rank)
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        local = {layer: buffers["fp8_amax_recorded"] for layer, buffers in fp8_state(accelerator, model).items()}
        optimizer.step()  # the native engine's end of step: amaxes reduced (max) over all ranks
        scheduler.step()
        optimizer.zero_grad()
        newest = {layer: buffers["fp8_amax_history"][0] for layer, buffers in fp8_state(accelerator, model).items()}
        mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
        info["steps"].append({"step": progress.step, "loss": loss.item(), "mean_loss": mean_loss,
                              "local_amax": local, "newest_amax": newest,
                              "weights_sha256": weights(accelerator.unwrap_model(model))["sha256"]})
        progress.step += 1
        if args.save_at is not None and progress.step == args.save_at:
            accelerator.save_state(args.save_dir)

    info["fp8_state"] = fp8_state(accelerator, model)
    tensors = accelerator.fp8_engine.fp8_state(accelerator.unwrap_model(model))
    flat = torch.cat([tensors[layer][name].double().flatten() for layer in sorted(tensors)
                      for name in ("fp8_amax_history", "fp8_scale", "fp8_step")])
    gathered = accelerator.gather(flat.unsqueeze(0))  # (world, n): every rank's state, on every rank
    info["gathered_ranks"] = gathered.shape[0]
    info["gathered_identical"] = bool((gathered == gathered[0]).all())
    info["weights"] = weights(accelerator.unwrap_model(model))
    info["lr"] = scheduler.get_last_lr()
    accelerator.wait_for_everyone()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
