"""One `accelerate launch` process of the DeepSpeed tests: trains a small transformers Llama under
DeepSpeed ZeRO once per (stage, precision) asked for, in turn, in this one process (accelerate's
process-wide state is reset between runs), and writes what each run saw to OUT/rank<r>.json.

    accelerate launch --config_file <deepspeed config> tests/support/deepspeed_worker.py \
        --stages 1,2,3 --runs bf16,native --steps 30 --resume-steps 5 --out OUT

A run named "bf16" is plain accelerate in bf16 (the reference); any other name is an fp8plug
engine under fp8plug.Accelerator. With --resume-steps K every FP8 run saves its state K steps
before the end, and afterwards a fresh Accelerator, model (other initial weights) and optimizer
load it and train those last K steps again: the losses must be the same, loss for loss.
--zero-init-runs repeats runs at stage 3 (--zero-init-steps long, no resume) with the model built
inside deepspeed.zero.Init (partitioned at construction, as accelerate's zero3_init_flag does).
--from-launch takes everything (mixed precision, engine, ZeRO stage) from the launch config
instead, as a user's script would. The learning rate is held constant, through an LR scheduler
that the checkpoint carries (--schedule linear: Trainer's warm-up and decay to zero). For
studies (docs/distributed.md): --seeds repeats every run per initial weights, --recipe gives the
FP8 runs more FP8RecipeKwargs fields (another TE scaling), and stage 0 runs them without DeepSpeed.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages; 0: the same runs without DeepSpeed")
    p.add_argument("--runs", default="bf16,native")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--resume-steps", type=int, default=0)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--zero-init-runs", default="", help="runs repeated at stage 3 with the model built under zero.Init")
    p.add_argument("--zero-init-steps", type=int, default=30)
    p.add_argument("--seeds", default="0", help="the model's initial weights: every run is repeated per seed")
    p.add_argument("--recipe", default="{}", help="more FP8RecipeKwargs fields for the FP8 runs, as JSON")
    p.add_argument("--schedule", choices=["constant", "linear"], default="constant",
                   help="constant: lr throughout; linear: warm up over the first tenth, then decay "
                        "to zero (transformers' get_linear_schedule_with_warmup, Trainer's default)")
    p.add_argument("--from-launch", action="store_true")
    p.add_argument("--refuse", default="", help="engines whose refusal to run is recorded instead")
    p.add_argument("--out", required=True)
    return p.parse_args()


def fresh():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if not torch.cuda.is_available() and "WORLD_SIZE" in os.environ:  # launched, on CPU
        # accelerate 1.15 picks no process-group backend on a machine without GPUs unless told
        # (cpu=True would turn DeepSpeed off); without one it counts a single process while
        # DeepSpeed runs two over gloo. fp8plug.Accelerator asks for gloo itself
        # (fp8plug.integrations.deepspeed_zero.join_cpu_processes); the plain bf16 reference needs it set here.
        from accelerate import PartialState

        PartialState(backend="gloo")


def build_model(args, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         vocab_size=args.vocab, max_position_embeddings=args.seq, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def ds_plugin(args, stage):
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1, gradient_clipping=1.0,
                             zero3_init_flag=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=args.batch, train_batch_size=args.batch * world,
                                   steps_per_print=10**9)
    return plugin


def make_accelerator(args, stage, run):
    import accelerate

    import fp8plug

    if args.from_launch:  # everything from the launch config; a DataLoader would give the batch size
        accelerator = fp8plug.Accelerator()
        world = accelerator.num_processes
        accelerator.state.deepspeed_plugin.deepspeed_config.update(
            train_micro_batch_size_per_gpu=args.batch, train_batch_size=args.batch * world)
        return accelerator
    plugin = ds_plugin(args, stage) if stage else None  # stage 0: no DeepSpeed (the control)
    if run == "bf16":
        return accelerate.Accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
    return fp8plug.Accelerator(mixed_precision="fp8", deepspeed_plugin=plugin,
                               kwargs_handlers=[fp8plug.FP8RecipeKwargs(backend=run, **json.loads(args.recipe))])


def init_partitioned(model, seed):
    """Give a model built under zero.Init the initial weights transformers gives an unpartitioned
    one. zero.Init partitions each submodule's parameters as it is built, so the model's own
    weight init runs on empty shards and the weights keep torch's defaults (embeddings N(0, 1),
    tied to lm_head: a first loss near 500 on the GPU); transformers re-initialises only in
    from_pretrained. Gathered here, set on rank 0 and scattered back."""
    import deepspeed

    std = model.config.initializer_range
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        torch.manual_seed(seed)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                    module.weight.normal_(0.0, std)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
                elif type(module).__name__.endswith("RMSNorm"):
                    module.weight.fill_(1.0)


def schedule(args, optimizer, steps):
    from transformers import get_constant_schedule, get_linear_schedule_with_warmup

    if args.schedule == "constant":
        return get_constant_schedule(optimizer)
    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=max(1, steps // 10), num_training_steps=steps)


def prepare(args, accelerator, stage, seed, steps, zero_init=False):
    if zero_init:
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=accelerator.state.deepspeed_plugin.deepspeed_config):
            model = build_model(args, seed)
        init_partitioned(model, seed)
    else:
        model = build_model(args, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    return accelerator.prepare(model, optimizer, schedule(args, optimizer, steps))


def batches(args, accelerator):
    from fp8plug.bench.toy_model import synthetic_batches

    world, rank = accelerator.num_processes, accelerator.process_index
    full = synthetic_batches(args.steps, args.batch * world, args.seq, args.vocab, seed=1)
    return [b[rank * args.batch:(rank + 1) * args.batch].to(accelerator.device) for b in full]


def train(accelerator, model, optimizer, scheduler, data, start, stop, save_at=None, save_dir=None):
    """Steps start..stop-1; the per-step loss averaged over ranks (one collective at the end)."""
    model.train()
    losses = []
    for step in range(start, stop):
        if save_at is not None and step == save_at:
            accelerator.save_state(save_dir)
        out = model(input_ids=data[step], labels=data[step])
        accelerator.backward(out.loss)
        if accelerator.state.deepspeed_plugin is None:  # DeepSpeed clips by its config
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(out.loss.detach().float())
    return accelerator.reduce(torch.stack(losses), "mean").tolist()


def fp8_entries(accelerator):
    """Every converted layer's FP8 state as (name, entry), by name, read once at the end of a run
    for the digest, the scale ranges and the update counts below."""
    return [item for model in accelerator.fp8_models
            for item in sorted(accelerator.fp8_engine.fp8_state(model).items())]


def fp8_state_digest(entries):
    sha = hashlib.sha256()
    for fqn, entry in entries:
        for name, value in sorted(entry.items()):
            if isinstance(value, torch.Tensor):
                sha.update(f"{fqn}.{name}".encode())
                sha.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def scale_ranges(entries):
    """Per scaling-state tensor name (TE's scale_fwd / scale_bwd, native's fp8_scale) and slot,
    the [smallest, largest] scale over the converted layers at the end of the run: a slot stuck
    at its initial 1.0 shows here."""
    ranges = {}
    for _, entry in entries:
        for name, value in entry.items():
            if "scale" in name and isinstance(value, torch.Tensor) and value.is_floating_point():
                for slot, v in enumerate(value.flatten().tolist()):
                    low, high = ranges.get(f"{name}[{slot}]", (v, v))
                    ranges[f"{name}[{slot}]"] = (min(low, v), max(high, v))
    return {k: [float(f"{low:.4g}"), float(f"{high:.4g}")] for k, (low, high) in sorted(ranges.items())}


def scale_updates(entries):
    """(fewest, most) end-of-step scale updates over the converted layers' slots, where the
    engine's FP8 state counts them (native's fp8_step); None elsewhere."""
    counts = [int(v) for _, entry in entries for v in entry.get("fp8_step", torch.empty(0)).flatten().tolist()]
    return [min(counts), max(counts)] if counts else None


def tied(model) -> bool:
    """Whether lm_head still shares the input embedding's weight (the model ties them)."""
    inner = getattr(model, "module", model)
    return inner.get_output_embeddings().weight is inner.get_input_embeddings().weight


def one_run(args, stage, run, seed, shared_dir, zero_init=False):
    fresh()
    accelerator = make_accelerator(args, stage, run)
    steps = args.zero_init_steps if zero_init else args.steps
    model, optimizer, scheduler = prepare(args, accelerator, stage, seed, steps, zero_init=zero_init)
    data = batches(args, accelerator)
    fp8 = getattr(accelerator, "fp8_engine", None) is not None
    save_at = args.steps - args.resume_steps if (args.resume_steps and fp8 and not zero_init) else None
    save_dir = os.path.join(shared_dir, f"ckpt_{stage}_{run}")
    if fp8:
        accelerator.fp8_coverage(reset=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    losses = train(accelerator, model, optimizer, scheduler, data, 0, steps, save_at, save_dir)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {
        "stage": stage, "run": run, "seed": seed, "losses": losses, "seconds": seconds,
        "tokens_per_s": steps * args.batch * args.seq * accelerator.num_processes / seconds,
        "engine_class": type(model).__name__,
        "optimizer_class": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "zero_stage": getattr(accelerator.state.deepspeed_plugin, "zero_stage", 0),
        "world_size": accelerator.num_processes,
        "mixed_precision": str(accelerator.mixed_precision), "zero_init": zero_init,
        "tied": tied(model),
    }
    if fp8:
        coverage, entries = accelerator.fp8_coverage(), fp8_entries(accelerator)
        result.update(engine=accelerator.fp8_engine.name, converted=len(accelerator.fp8_reports[0].fp8_linears),
                      fp8_gemms=coverage["fp8_gemms"], fp8_state=fp8_state_digest(entries),
                      scale_updates=scale_updates(entries), scales=scale_ranges(entries))
    del model, optimizer, scheduler
    accelerator.free_memory()
    if save_at is not None:
        result["resumed_losses"] = resume(args, stage, run, data, save_at, save_dir)
        if accelerator.is_main_process:
            shutil.rmtree(save_dir, ignore_errors=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def resume(args, stage, run, data, save_at, save_dir):
    fresh()
    accelerator = make_accelerator(args, stage, run)
    # other weights (and a fresh schedule): weights, optimizer and lr schedule must come from the checkpoint
    model, optimizer, scheduler = prepare(args, accelerator, stage, 123, args.steps)
    accelerator.load_state(save_dir)
    losses = train(accelerator, model, optimizer, scheduler, data, save_at, args.steps)
    del model, optimizer, scheduler
    accelerator.free_memory()
    return losses


def refusal(args, stage, run):
    fresh()
    try:
        accelerator = make_accelerator(args, stage, run)
        prepare(args, accelerator, stage, 0, args.steps)
    except (ValueError, ImportError) as exc:
        return {"stage": stage, "run": run, "refused": f"{type(exc).__name__}: {exc}"}
    return {"stage": stage, "run": run, "refused": None}


def main():
    args = parse_args()
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        # DeepSpeed's CPU all-reduce through shared memory is a C++ op it compiles on first use
        # (minutes on two cores); gloo, which it falls back to, does the job for these sizes.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    os.makedirs(args.out, exist_ok=True)
    shared_dir = os.environ.get("FP8PLUG_DS_CKPT") or tempfile.gettempdir()
    results, error = [], None
    refuse = [r for r in args.refuse.split(",") if r]
    try:
        stages = [0] if args.from_launch else [int(s) for s in args.stages.split(",")]
        runs = ["launch"] if args.from_launch else [r for r in args.runs.split(",") if r]
        if "te" in runs + args.zero_init_runs.split(","):
            # TransformerEngine imports only before torch first uses cuDNN (the bf16 run's
            # attention does): probing it now loads it the way a te-only script would (seen on
            # 2x H200: imported after the bf16 run, `libcudnn_cnn.so.9: undefined symbol`)
            from fp8plug.backends import get_backend

            get_backend("te").probe()
        seeds = [int(s) for s in args.seeds.split(",")]
        for seed in seeds:
            for stage in stages:
                for run in runs:
                    results.append(one_run(args, stage, run, seed, shared_dir))
        for stage in stages:
            for run in refuse:
                results.append(refusal(args, stage, run))
        for seed in seeds:
            for run in [r for r in args.zero_init_runs.split(",") if r]:
                results.append(one_run(args, 3, run, seed, shared_dir, zero_init=True))
    except Exception:  # noqa: BLE001 - reported to the test, which shows it
        error = traceback.format_exc()
    rank = dist.get_rank() if dist.is_initialized() else 0
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"results": results, "error": error}))
    if dist.is_initialized() and error is None:
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if error is None else 1)  # skip gloo's/NCCL's teardown, which can hang


if __name__ == "__main__":
    main()
