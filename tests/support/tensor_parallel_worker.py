"""One rank of tests/gpu/test_tensor_parallel.py (launched with torch.distributed.run): a small
transformers Llama saved once, loaded with `tp_plan="auto"` over Accelerate's ParallelismConfig
mesh (tp_size=2, dp_shard_size=WORLD/2 with FSDP2 where WORLD > 2), trained for --steps in each of
--modes: "bf16" (accelerate.Accelerator, the baseline), "fp8-eager" and "fp8-compiled"
(fp8plug.Accelerator with the native engine, torch.compile(model) after prepare for the latter),
every mode on the same batches (a tensor-parallel group shares one). Rank 0 writes a JSON summary
to --out: each mode's losses, median step time, and for the FP8 modes the GEMMs that ran in FP8
and in high precision."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--modes", default="bf16,fp8-eager,fp8-compiled")
    return p.parse_args()


def accelerator_for(cls, world, **kwargs):
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig

    dp_shard = world // 2
    config = ParallelismConfig(tp_size=2, dp_shard_size=dp_shard)
    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2) if dp_shard > 1 else None
    return cls(parallelism_config=config, fsdp_plugin=fsdp, **kwargs)


def load(model_dir, accelerator):
    """The model with its tp_plan, its plain parameters (the norms) replicated on the tp mesh
    (parallel_setup.replicate_unsharded says why)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", device_mesh=accelerator.torch_device_mesh,
                                                 dtype=torch.float32)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "distributed"))
    from parallel_setup import replicate_unsharded

    replicate_unsharded(model, accelerator.torch_device_mesh["tp"])
    return model.train()  # from_pretrained gives it in eval mode, where FP8 is off unless asked


def batches(vocab: int, group: int, steps: int):
    """One batch a step of benchmarks/training/hf_llama_task's synthetic task (a fixed permutation
    walk with 10% fresh tokens: its loss falls smoothly to a known floor, where a memorised set of
    random batches falls off a cliff at a step that a small difference moves), seeded by the
    tensor-parallel group's data-parallel index; the same for every mode."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "training"))
    from hf_llama_task import make_batches

    return make_batches(dict(vocab=vocab, batch=4, seq=512), steps, seed=1 + group).cuda()


def run(mode: str, args, world: int) -> dict:
    import accelerate

    import fp8plug

    if mode == "bf16":
        accelerator = accelerator_for(accelerate.Accelerator, world, mixed_precision="bf16")
    else:
        # the speed filter would keep every Linear of this small model in bf16 (hidden 512)
        recipe = fp8plug.FP8RecipeKwargs(backend="native", auto_filter=False)
        accelerator = accelerator_for(fp8plug.Accelerator, world, mixed_precision="fp8", kwargs_handlers=[recipe])
    model = load(args.model_dir, accelerator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    if mode == "fp8-compiled":
        model = torch.compile(model)
    data = batches(model.config.vocab_size, int(os.environ["RANK"]) // 2, args.steps)
    losses, times = [], []
    for step in range(args.steps):
        ids = data[step]
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    result = dict(losses=losses, step_s=sorted(times[5:])[len(times[5:]) // 2])
    if mode != "bf16":
        counts = accelerator.fp8_coverage()
        result.update(fp8_gemms=counts["fp8_gemms"], high_precision_gemms=counts["high_precision_gemms"],
                      counted_layers=len(counts["layers"]),
                      layer_types=sorted({type(m).__name__ for m in model.modules() if hasattr(m, "weight")}))
    del model, optimizer
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=False)
    return result


def main():
    args = parse_args()
    world = int(os.environ["WORLD_SIZE"])
    result = {"world": world}
    for mode in args.modes.split(","):
        try:
            result[mode] = run(mode, args, world)
        except Exception as exc:  # noqa: BLE001 - the test reports the failure, with its mode
            import traceback

            traceback.print_exc()
            result[mode] = {"error": f"{type(exc).__name__}: {exc}"}
            break
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
