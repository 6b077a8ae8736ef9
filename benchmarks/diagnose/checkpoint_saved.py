"""What a compiled model keeps for backward under activation checkpointing, FP8 layers against bf16.

Why: inside a checkpointed region, torch.compile's partitioner should keep only the region's
inputs and recompute the rest in backward. It recomputes the ops that checkpointing tagged while
tracing; torch 2.11 does not tag the ops inside an autograd.Function (2.13 does), so a layer
whose GEMM runs inside one keeps that GEMM's output alive until backward, and checkpointing stops
saving memory for it. The native engine's granular, grouped and frozen layers call operators
when compiled for that reason (backends/native/compiled_ops.py); the per-tensor layer still runs
its GEMMs in an autograd.Function (backends/native/fp8_matmul.py). Measured on the CPU with torch
2.11 (docs/engines.md, the native engine's "Known limit"): per block, the
per-tensor layer keeps its up-projection's output, which bf16 recomputes.

This lists, for a stack of checkpointed MLP blocks compiled with inductor, every activation the
compiled forward hands to backward (parameters and the model's input left out), by shape, dtype
and the op that made it, for bf16 Linears and for each native FP8 variant, and says where an FP8
model keeps more than bf16 does. Runs on the CPU (emulated FP8) or on a GPU.

  python3 benchmarks/diagnose/checkpoint_saved.py [--device cuda] [--variants bf16,tensor,delayed,rowwise]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fp8plug  # noqa: E402
from fp8plug import FP8RecipeKwargs  # noqa: E402

VARIANTS = {  # name -> the recipe's scaling (None: plain bf16 Linears)
    "bf16": None, "tensor": "dynamic", "delayed": "delayed", "rowwise": "rowwise", "blockwise": "blockwise",
}
WIDTH, TOKENS, BLOCKS = 256, 512, 3


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class CheckpointedStack(nn.Module):
    """Residual MLP blocks, each under non-reentrant torch.utils.checkpoint (as transformers'
    gradient checkpointing runs each decoder layer)."""

    def __init__(self, width: int = WIDTH, blocks: int = BLOCKS):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


@contextlib.contextmanager
def saved_activations(into: List[dict]):
    """Within: every forward graph inductor partitions appends one dict per tensor it hands to
    backward that is not a graph input (shape, dtype, the op that made it, its checkpoint tag)."""
    import torch._inductor.compile_fx as compile_fx

    original = compile_fx.min_cut_rematerialization_partition

    def partition(joint, *args, **kwargs):
        forward, backward = original(joint, *args, **kwargs)
        output = next(n for n in forward.graph.nodes if n.op == "output")
        for node in output.args[0]:
            value = node.meta.get("val") if hasattr(node, "meta") else None
            if node.op == "placeholder" or not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            into.append({"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
                         "op": str(node.target), "tag": str(node.meta.get("recompute"))})
        return forward, backward

    compile_fx.min_cut_rematerialization_partition = partition
    try:  # no cached graph: a cache hit would skip the partitioner
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield into
    finally:
        compile_fx.min_cut_rematerialization_partition = original


def run(variant: str, device: str) -> List[dict]:
    """One forward and backward of the compiled CheckpointedStack with `variant`'s layers; what
    the compiled forward kept for backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = CheckpointedStack().to(device)
    scaling = VARIANTS[variant]
    if scaling is not None:
        fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", scaling=scaling, auto_filter=False))
    x = torch.randn(TOKENS, WIDTH, device=device, requires_grad=True)
    saved: List[dict] = []
    with saved_activations(saved):
        with torch.autocast(device, dtype=torch.bfloat16):
            out = torch.compile(model)(x)
        out.float().square().mean().backward()
    return saved


def extra(saved: List[dict], baseline: List[dict]) -> List[dict]:
    """The activations `saved` keeps beyond `baseline`'s (matched by shape and dtype, each once),
    counting only those with a value per token (a delayed layer's few-element amax records are
    state, not activations): what checkpointing failed to recompute."""
    unmatched = [(s["shape"], s["dtype"]) for s in baseline]
    beyond = []
    for s in saved:
        if torch.Size(s["shape"]).numel() < TOKENS:
            continue
        if (s["shape"], s["dtype"]) in unmatched:
            unmatched.remove((s["shape"], s["dtype"]))
        else:
            beyond.append(s)
    return beyond


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    results: Dict[str, List[dict]] = {}
    for variant in ["bf16"] + [v for v in args.variants.split(",") if v and v != "bf16"]:
        results[variant] = run(variant, args.device)
    print(f"torch {torch.__version__} on {args.device}: {BLOCKS} checkpointed blocks, width {WIDTH}, {TOKENS} tokens")
    for variant, saved in results.items():
        beyond = extra(saved, results["bf16"])
        said = "; ".join(f"{s['dtype']}{s['shape']} from {s['op']}" for s in beyond) or "nothing beyond bf16"
        print(f"  {variant:10s} {len(saved):3d} activations kept; beyond bf16's: {said}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "device": args.device,
                                               "saved": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
