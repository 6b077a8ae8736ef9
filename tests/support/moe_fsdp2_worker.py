"""One rank of FSDP2 training of a tiny Mixtral with FP8 experts (tests/cpu/test_moe.py on the CPU
over gloo, tests/gpu/test_moe.py on two GPUs over NCCL): the model converted first, then each
decoder layer and the root sharded with `fully_shard` (the experts' 3-D parameters sharded along
the expert dimension), a few AdamW steps on this rank's own batch. Writes rank<r>.json: losses,
the experts' GEMM counts, and how the expert weight was sharded."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(out: str, steps: int) -> None:
    cuda = torch.cuda.is_available() and os.environ.get("FP8PLUG_TEST_CPU") != "1"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from torch.distributed.fsdp import fully_shard

    import fp8plug
    from fp8plug import FP8RecipeKwargs
    from tests.support.moe_models import builder

    model = builder("mixtral")(hidden_size=128 if cuda else 64, num_hidden_layers=2).to(device)
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", auto_filter=False))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    experts = model.model.layers[0].mlp.experts
    placement = str(experts.gate_up_proj.placements) if hasattr(experts.gate_up_proj, "placements") else "plain"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(rank)).to(device)
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    counts = fp8plug.fp8_coverage(model)["layers"]
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(dict(
        losses=losses, placement=placement, experts=counts.get("model.layers.0.mlp.experts"),
        implementation=model.config._experts_implementation)))
    dist.destroy_process_group()


def run_ranks(tmp_path, steps: int, **env) -> list:
    """Two ranks of this worker through torch.distributed.run (a free port); their JSON results."""
    import socket
    import subprocess

    from tests.support.processes import child_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(Path(__file__).resolve()), str(Path(tmp_path) / "out"), str(steps)]
    proc = subprocess.run(cmd, env=child_env(tmp_path, **env), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads((Path(tmp_path) / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
