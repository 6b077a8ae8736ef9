"""Train a small decoder-only LM with fp8plug.Accelerator, under `accelerate launch` or plain python.

    fp8plug launch --config_file examples/configs/cpu_fp8.yaml examples/train_accelerate.py
    fp8plug launch --config_file examples/configs/cpu_ddp_fp8.yaml examples/train_accelerate.py
    accelerate launch --config_file examples/configs/gpu_fp8.yaml examples/train_accelerate.py --steps 200
    accelerate launch --config_file examples/configs/2gpu_fsdp2_fp8.yaml examples/train_accelerate.py --steps 200
    fp8plug launch --config_file examples/configs/cpu_deepspeed_fp8.yaml examples/train_accelerate.py

FP8 settings come from the launch configuration (`mixed_precision: fp8` and its `fp8_config:`
section, or `--mixed_precision fp8 --fp8_backend ...` on the command line); the script only sets
`auto_filter=False`. lm_head stays in high precision, as the Accelerator keeps a model's output head
by default (`fp8_output_head`, docs/recipe.md). Every process sees its own slice of the same global batch, so a
run on N processes follows the same data as a run on one. Each rank prints one line
`FP8PLUG_RESULT {json}` (engine, recipe, losses, a checksum of the plain weights) and, with
--out, writes it to OUT/rank<r>.json. --save-at/--save-dir and --resume exercise
save_state/load_state; --check-config stops after building the Accelerator.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch

import fp8plug
from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, lm_loss, synthetic_batches
from fp8plug.integrations.accelerator import requested_precision


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer micro-steps in all (including resumed ones)")
    p.add_argument("--batch", type=int, default=4, help="sequences per process per step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--cpu", action="store_true",
                   help="force the CPU where there is a GPU (cpu=True; refused beside a DeepSpeed config, "
                        "which it would turn off); on a machine without a GPU the CPU is used anyway")
    p.add_argument("--check-config", action="store_true", help="print the FP8 recipe and engine, do not train")
    p.add_argument("--save-at", type=int, default=None, help="save_state after this many steps")
    p.add_argument("--save-dir", default=None)
    p.add_argument("--resume", default=None, help="load_state from this directory and continue")
    p.add_argument("--out", default=None, help="directory for rank<r>.json")
    return p.parse_args(argv)


def weights_digest(state_dict) -> dict:
    """A checksum of the plain weights: sum of |w| in float64 and a sha256 of the exact bytes."""
    if not state_dict:
        return {"abs_sum": None, "sha256": None, "keys": 0}
    sha = hashlib.sha256()
    total = 0.0
    for key in sorted(state_dict):
        tensor = state_dict[key].detach().to("cpu", torch.float32).contiguous()
        sha.update(key.encode())
        sha.update(tensor.numpy().tobytes())
        total += tensor.double().abs().sum().item()
    return {"abs_sum": total, "sha256": sha.hexdigest(), "keys": len(state_dict)}


def main(argv=None) -> int:
    args = parse_args(argv)
    fp8 = requested_precision(None) == "fp8"
    # auto_filter=False: at these sizes the default filter would keep every layer in bf16 on a GPU
    # (lm_head stays in high precision: the Accelerator's default, FP8RecipeKwargs.fp8_output_head)
    handlers = [fp8plug.FP8RecipeKwargs(auto_filter=False)] if fp8 else []
    accelerator = fp8plug.Accelerator(cpu=args.cpu, kwargs_handlers=handlers,
                                      gradient_accumulation_steps=args.grad_accum)
    info = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        "engine": accelerator.fp8_engine.name if accelerator.fp8_engine else None,
        "recipe": {k: (list(v) if isinstance(v, tuple) else v) for k, v in accelerator.fp8_recipe.to_dict().items()}
        if accelerator.fp8_recipe else None,
    }
    if args.check_config:
        return report(info, args.out)

    torch.manual_seed(args.seed)
    cfg = DecoderConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                        ffn_dim=args.ffn, max_seq_len=args.seq)
    model = TinyDecoder(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    deepspeed = accelerator.state.deepspeed_plugin
    if deepspeed is not None:  # DeepSpeed reads the batch size from a DataLoader; this loop has none
        deepspeed.deepspeed_config.update(train_micro_batch_size_per_gpu=args.batch,
                                          train_batch_size=args.batch * accelerator.num_processes * args.grad_accum)
    model, optimizer = accelerator.prepare(model, optimizer)
    info["converted"] = sum(len(r.fp8_linears) for r in accelerator.fp8_reports)
    info["initial_weights"] = weights_digest(accelerator.get_state_dict(model))

    world, rank = accelerator.num_processes, accelerator.process_index
    batches = synthetic_batches(args.steps, args.batch * world, args.seq, args.vocab, seed=args.seed)
    start = 0
    if args.resume:
        accelerator.load_state(args.resume)
        with open(os.path.join(args.resume, "fp8plug_step.json")) as f:
            start = json.load(f)["step"]
    losses = []
    model.train()
    for step in range(start, args.steps):
        tokens = batches[step][rank * args.batch:(rank + 1) * args.batch].to(accelerator.device)
        with accelerator.accumulate(model):
            loss = lm_loss(model(tokens), tokens)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        if args.save_at is not None and step + 1 == args.save_at:
            accelerator.save_state(args.save_dir)
            if accelerator.is_main_process:
                with open(os.path.join(args.save_dir, "fp8plug_step.json"), "w") as f:
                    json.dump({"step": step + 1}, f)
            accelerator.wait_for_everyone()
    info["start_step"] = start
    info["losses"] = losses
    state_dict = accelerator.get_state_dict(model)
    info["weights"] = weights_digest(state_dict)
    info["state_dict_keys"] = sorted(state_dict)[:4] if state_dict else []
    info["fp8_state"] = fp8_state_digest(accelerator, model)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return report(info, args.out)


def fp8_state_digest(accelerator, model):
    """A sha256 of the engine's FP8 scaling state (amax histories, scales), or None without one:
    with delayed scaling every rank must hold the same state (amaxes are reduced across ranks)."""
    engine = accelerator.fp8_engine
    state = engine.fp8_state(accelerator.unwrap_model(model)) if engine is not None else {}
    if not state:
        return None
    sha = hashlib.sha256()
    for fqn in sorted(state):
        for name in sorted(state[fqn]):
            value = state[fqn][name]
            if isinstance(value, torch.Tensor):
                sha.update(value.detach().float().cpu().numpy().tobytes())
            else:  # an engine's non-tensor entries (TransformerEngine's recipe name, say)
                sha.update(repr(value).encode())
    return sha.hexdigest()


def report(info: dict, out) -> int:
    line = json.dumps(info, sort_keys=True)
    print(f"FP8PLUG_RESULT {line}", flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{info['rank']}.json"), "w") as f:
            f.write(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
