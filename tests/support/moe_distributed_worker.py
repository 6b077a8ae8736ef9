"""DDP and FSDP2 training of a tiny Mixtral whose experts run in FP8 (fp8plug's native grouped GEMM),
through fp8plug.Accelerator, for tests/cpu/test_moe_distributed.py (two CPU processes over gloo)
and tests/gpu/test_moe_distributed.py (two GPUs over NCCL).

Launched by `accelerate launch --num_processes 2` (`launch` below): each process runs the phases
named on the command line one after the other in the same process group (one launch: on a busy
CPU most of a launch is imports), each phase with a fresh Accelerator:

- ddp: the model replicated, each rank training on its half of the global batch. Writes the
  first step's gradients (after DDP's all-reduce) and the global mean loss of every step.
- fsdp2: FullyShardedDataParallelPlugin(fsdp_version=2), one FSDP unit per decoder layer; writes
  how the experts' 3-D weights were sharded, each rank's local expert shards, the global losses,
  how many expert FP8 GEMMs ran (calls of grouped.py's scaled_grouped_mm or dense_grouped_mm)
  and, from rank 0, the full state dict Accelerate gathers after training.

The test process runs `train` itself in one process as the reference (same model, same global
batch, same Accelerator path), so that both sides share every line but the parallelism.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# the model and batch every side trains: hidden 64, 4 experts top-2 (tests/support/moe_models.py)
LAYERS, PER_RANK, SEQ, WORLD, LR = 2, 2, 32, 2, 3e-3


def build_model(device="cpu", hidden: int = 64):
    """The tiny Mixtral, seeded: every process and the reference build the same weights."""
    from tests.support.moe_models import builder

    return builder("mixtral")(hidden_size=hidden, num_hidden_layers=LAYERS).to(device)


def global_batch(device="cpu", vocab: int = 128) -> torch.Tensor:
    """WORLD x PER_RANK sequences; rank r trains on rows [r * PER_RANK, (r + 1) * PER_RANK)."""
    ids = torch.randint(0, vocab, (WORLD * PER_RANK, SEQ), generator=torch.Generator().manual_seed(7))
    return ids.to(device)


def accelerator_for(strategy: str, cpu: bool):
    """fp8plug.Accelerator, native engine, every experts module converted (no speed filter: tiny
    experts would be kept in bf16); `strategy` "fsdp2" adds Accelerate's FSDP2 plugin, one unit
    per decoder layer, switched on by hand on a CPU (benchmarks/distributed/parallel_setup.fsdp_on_cpu:
    accelerate 1.15 runs FSDP only on GPU-like distributed types)."""
    import fp8plug

    handlers = [fp8plug.FP8RecipeKwargs(backend="native", auto_filter=False)]
    plugin = None
    if strategy == "fsdp2":
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["MixtralDecoderLayer"], reshard_after_forward=True,
            cpu_ram_efficient_loading=False, state_dict_type="FULL_STATE_DICT")
    accelerator = fp8plug.Accelerator(mixed_precision="fp8", kwargs_handlers=handlers, fsdp_plugin=plugin, cpu=cpu)
    if plugin is not None and cpu:
        sys.path.insert(0, str(ROOT / "benchmarks" / "distributed"))
        from parallel_setup import fsdp_on_cpu

        fsdp_on_cpu(accelerator, plugin)
    if plugin is not None and not accelerator.is_fsdp2:
        raise RuntimeError(f"Accelerate did not turn FSDP2 on (distributed type {accelerator.distributed_type})")
    return accelerator


class GemmCounter:
    """Counts the experts' FP8 GEMMs that run (each expert projection: one forward, two backward),
    grouped or dense per expert (grouped.py calls one of the two for each GEMM)."""

    NAMES = ("scaled_grouped_mm", "dense_grouped_mm")

    def __init__(self):
        from fp8plug.backends.native import grouped

        self.calls, self._module = 0, grouped
        self._originals = {name: getattr(grouped, name) for name in self.NAMES}
        for name, original in self._originals.items():
            setattr(grouped, name, self._counted(original))

    def _counted(self, original):
        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)
        return counted

    def close(self):
        for name, original in self._originals.items():
            setattr(self._module, name, original)


def train(accelerator, model, ids: torch.Tensor, steps: int, keep_grads: bool = False) -> dict:
    """`steps` AdamW steps on this process's `ids`; the global mean loss of each step (the mean over
    processes of their local means: every process has as many tokens), and with `keep_grads` the
    first step's gradients as the optimizer sees them (after any all-reduce), by parameter name."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    losses, grads = [], None
    for step in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        if keep_grads and step == 0:
            grads = {name: p.grad.detach().clone().float().cpu()
                     for name, p in accelerator.unwrap_model(model).named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach().reshape(1)).float().mean().item())
    return dict(model=model, losses=losses, grads=grads)


def _local(t) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().float().cpu()


def run_phase(strategy: str, out: Path, steps: int, cpu: bool) -> None:
    import fp8plug
    from fp8plug.hf.experts import experts_modules

    accelerator = accelerator_for(strategy, cpu)
    rank, device = accelerator.process_index, accelerator.device
    ids = global_batch(device)[rank * PER_RANK:(rank + 1) * PER_RANK]
    counter = GemmCounter()
    try:
        result = train(accelerator, build_model(device), ids, steps, keep_grads=strategy == "ddp")
    finally:
        counter.close()
    model = accelerator.unwrap_model(result["model"])
    experts = dict(experts_modules(model))
    first = experts["model.layers.0.mlp.experts"]
    summary = dict(
        world=accelerator.num_processes, fsdp2=bool(accelerator.is_fsdp2),
        losses=result["losses"], grouped_gemm_calls=counter.calls, experts_modules=len(experts),
        implementation=model.config._experts_implementation,
        coverage={fqn: list(v) for fqn, v in fp8plug.fp8_coverage(model)["layers"].items() if fqn in experts},
        weight_type=type(first.gate_up_proj.data).__name__,
        placements=str(getattr(first.gate_up_proj, "placements", "plain")),
        local_shape=list(_local(first.gate_up_proj).shape))
    tensors = {}
    if strategy == "ddp":
        tensors["grads"] = result["grads"]
    else:
        tensors["local"] = {f"{fqn}.{name}": _local(p) for fqn, m in experts.items()
                            for name, p in m.named_parameters(recurse=False)}
        state = accelerator.get_state_dict(result["model"])  # gathered on every rank's call, kept on rank 0
        if accelerator.is_main_process:
            tensors["full_state"] = {k: v.detach().cpu() for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, out / f"{strategy}_rank{rank}.pt")
    (out / f"{strategy}_rank{rank}.json").write_text(json.dumps(summary))
    accelerator.wait_for_everyone()
    del result, model, experts, first
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)  # the next phase keeps the process group
    GradientState._reset_state()


def launch(out: Path, phases, steps: int, env: dict, cpu: bool, timeout: int = 300) -> subprocess.CompletedProcess:
    """`accelerate launch` of this worker on WORLD processes (accelerate's torchrun launcher,
    distributed_type MULTI_GPU) from a config file, a free port; on the CPU with `use_cpu: true`,
    the processes joined over gloo, as examples/configs/cpu_ddp_fp8.yaml does (the command-line
    flags cannot say that: accelerate refuses `--cpu` beside `--multi_gpu`)."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "accelerate_config.yaml"
    config.write_text("\n".join([
        "compute_environment: LOCAL_MACHINE", "distributed_type: MULTI_GPU", "mixed_precision: fp8",
        "num_machines: 1", f"num_processes: {WORLD}", "main_process_port: 0", f"use_cpu: {str(cpu).lower()}",
        "dynamo_config: {}", ""]))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           str(Path(__file__).resolve()), "--out", str(out), "--steps", str(steps), "--phases", ",".join(phases),
           *(["--cpu"] if cpu else [])]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))


def read(out: Path, strategy: str) -> list:
    """Each rank's (summary, tensors) of a phase."""
    return [(json.loads((out / f"{strategy}_rank{r}.json").read_text()),
             torch.load(out / f"{strategy}_rank{r}.pt", weights_only=True)) for r in range(WORLD)]


# --- the checks tests/cpu and tests/gpu share ------------------------------------------------------------

CALLS_PER_STEP = 2 * 3 * LAYERS  # two projections an experts module, each one forward and two backward GEMMs


def one_process(ids: torch.Tensor, steps: int, cpu: bool) -> dict:
    """The same training (`train`, fp8plug.Accelerator) in the calling process, as the reference."""
    from tests.support.hf import fresh

    fresh()
    try:
        accelerator = accelerator_for("ddp", cpu=cpu)
        result = train(accelerator, build_model(accelerator.device), ids.to(accelerator.device), steps,
                       keep_grads=True)
        return dict(losses=result["losses"], grads=result["grads"])
    finally:
        fresh()


def references(steps: int, cpu: bool) -> dict:
    """One process on the whole global batch (`steps`), and one step on each rank's half."""
    ids, half = global_batch(), PER_RANK
    return dict(whole=one_process(ids, steps, cpu),
                halves=[one_process(ids[r * half:(r + 1) * half], 1, cpu) for r in range(WORLD)])


def check_ddp(ranks: list, reference: dict, steps: int, halves_sqnr: float, whole_sqnr: float,
              loss_rtol: float) -> None:
    """DDP's first-step gradients: the same on both ranks; the mean of the two halves' one-process
    gradients (SQNR > `halves_sqnr`: DDP adds only its all-reduce's rounding); the whole batch's in
    one process (experts' SQNR > `whole_sqnr`: FP8 scales from half the tokens). Losses within
    `loss_rtol` of one process's, the grouped FP8 GEMMs counted."""
    from tests.support.numerics import sqnr_db

    (summary, tensors), (_, other) = ranks
    assert summary["world"] == WORLD and not summary["fsdp2"]
    assert summary["implementation"] == "fp8plug_fp8_experts" and summary["experts_modules"] == LAYERS
    assert summary["grouped_gemm_calls"] == CALLS_PER_STEP * steps  # the experts ran their grouped FP8 GEMMs
    grads, whole = tensors["grads"], reference["whole"]["grads"]
    halves = [r["grads"] for r in reference["halves"]]
    assert set(grads) == set(whole) and any("experts.gate_up_proj" in name for name in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, other["grads"][name]), name  # all-reduced: the same on both ranks
        mean = (halves[0][name] + halves[1][name]) / 2
        assert sqnr_db(grad, mean) > halves_sqnr, (name, sqnr_db(grad, mean))
        if "experts" in name:
            assert sqnr_db(grad, whole[name]) > whole_sqnr, (name, sqnr_db(grad, whole[name]))
    losses, ref = summary["losses"], reference["whole"]["losses"]
    assert all(abs(a - b) < loss_rtol * b for a, b in zip(losses, ref)), (losses, ref)
    assert losses[-1] < losses[0], losses


def check_fsdp2(ranks: list, reference: dict, steps: int, loss_rtol: float) -> None:
    """FSDP2: the experts' 3-D weights are DTensors sharded by expert (Shard(0), half the experts a
    rank), their grouped FP8 GEMMs ran (counted, and fp8_coverage's FP8 count), and the losses are
    within `loss_rtol` of one process's on the whole batch (bf16 compute: FSDP2's param_dtype)."""
    (summary, _), (summary1, _) = ranks
    assert summary["fsdp2"] and summary["weight_type"] == "DTensor"
    assert summary["placements"] == "(Shard(dim=0),)" and summary["local_shape"][0] == 4 // WORLD
    assert summary["grouped_gemm_calls"] == summary1["grouped_gemm_calls"] == CALLS_PER_STEP * steps
    assert len(summary["coverage"]) == LAYERS and all(v == [2 * steps, 0] for v in summary["coverage"].values())
    losses, ref = summary["losses"], reference["whole"]["losses"]
    assert losses == summary1["losses"]
    assert all(abs(a - b) < loss_rtol * b for a, b in zip(losses, ref)), (losses, ref)
    assert losses[-1] < losses[0], losses


def check_full_state_dict(ranks: list, dtype: torch.dtype) -> None:
    """The full state dict Accelerate gathers after FSDP2 training: the fp32 master weights, the
    experts exactly the ranks' shards in order, loading strictly into a plain (unconverted) model
    of `dtype` with every tensor exactly the saved one in that dtype, every expert weight trained."""
    (_, tensors), (_, tensors1) = ranks
    state = tensors["full_state"]
    plain = build_model().to(dtype)
    initial = {k: v.clone() for k, v in plain.state_dict().items()}
    plain.load_state_dict(state, strict=True)
    loaded = plain.state_dict()
    for name, local in tensors["local"].items():
        assert torch.equal(state[name].float(), torch.cat([local, tensors1["local"][name]])), name
    for name, value in state.items():
        assert value.dtype == torch.float32, name
        assert torch.equal(loaded[name], value.to(dtype)), name
    moved = [n for n in state if "experts" in n and not torch.equal(loaded[n], initial[n])]
    assert len(moved) == 2 * LAYERS, moved


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--phases", default="ddp,fsdp2")
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()
    for phase in args.phases.split(","):
        run_phase(phase, Path(args.out), args.steps, args.cpu)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
