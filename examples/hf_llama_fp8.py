"""Train a Hugging Face transformers Llama in FP8 with fp8plug.Accelerator (no hub downloads).

The model is a LlamaForCausalLM built from a small LlamaConfig, so nothing is downloaded. On a
CPU the defaults train it in a few seconds with fp8plug's torch-only `native` engine; on a GPU
the same script runs unchanged (pick the engine with --backend).

    python3 examples/hf_llama_fp8.py                      # native engine, CPU or GPU
    python3 examples/hf_llama_fp8.py --backend auto       # whichever engine suits the machine
    python3 examples/hf_llama_fp8.py --device cuda --backend te --hidden 1024 --layers 4 --steps 200
    fp8plug launch --config_file examples/configs/cpu_fp8.yaml examples/hf_llama_fp8.py

Under `accelerate launch` the FP8 settings (engine, recipe) come from the launch config unless
--backend is given. The last line printed is `result: {json}` (engine, converted layers, losses).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fp8plug
from fp8plug import FP8RecipeKwargs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default=None,
                   help="native, ao, te, msamp, or auto (default: the launch config's, else native)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: a GPU when there is one, else the CPU")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (batch*seq: a multiple of 16)")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", default=None, help="also save the trained model with save_pretrained here")
    return p.parse_args(argv)


def tiny_llama(args) -> LlamaForCausalLM:
    """A LlamaForCausalLM from a config alone: random weights, every Linear width a multiple of 16."""
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(64, args.seq),
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def batches(args, generator):
    """Learnable synthetic token streams: each sequence counts up from a random start with a random
    stride (modulo the vocabulary)."""
    for _ in range(args.steps):
        start = torch.randint(0, args.vocab, (args.batch, 1), generator=generator)
        stride = torch.randint(1, 8, (args.batch, 1), generator=generator)
        yield (start + stride * torch.arange(args.seq)) % args.vocab


def main(argv=None) -> int:
    args = parse_args(argv)
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ  # running under `accelerate launch`
    backend = args.backend or (None if launched else "native")
    # backend None: the launch config's fp8 backend, else the automatic choice ("auto" forces that).
    # auto_filter=False: a model this small would stay in bf16 on an H100/H200 (FP8 is slower there).
    # lm_head stays in high precision: the Accelerator's default (FP8RecipeKwargs.fp8_output_head)
    recipe = FP8RecipeKwargs(backend=backend, auto_filter=False)
    accelerator = fp8plug.Accelerator(
        mixed_precision="fp8",
        cpu=args.device == "cpu",
        kwargs_handlers=[recipe],
    )
    if args.device == "cuda" and accelerator.device.type != "cuda":
        raise SystemExit("--device cuda: no CUDA GPU is visible")
    accelerator.print(f"engine: {accelerator.fp8_engine.name} ({accelerator.fp8_engine.title}) "
                      f"on {accelerator.device}")

    torch.manual_seed(args.seed)
    model = tiny_llama(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    report = accelerator.fp8_reports[0]
    accelerator.print(report)

    losses = []
    model.train()
    for input_ids in batches(args, torch.Generator().manual_seed(args.seed)):
        input_ids = input_ids.to(accelerator.device)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f} after {len(losses)} steps")

    # Eval runs in high precision (use_autocast_during_eval=False), whatever the token count.
    model.eval()
    with torch.no_grad():
        prompt = torch.arange(7, device=accelerator.device).unsqueeze(0) % args.vocab
        generated = accelerator.unwrap_model(model).generate(
            prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    accelerator.print(f"greedy continuation of 0..6: {generated[0, 7:].tolist()}")

    if args.save_dir:
        accelerator.wait_for_everyone()
        # The converted model's state dict has the plain architecture's keys, so this checkpoint
        # loads into a plain LlamaForCausalLM (LlamaForCausalLM.from_pretrained(save_dir)).
        accelerator.unwrap_model(model).save_pretrained(
            args.save_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
        accelerator.print(f"saved to {args.save_dir}")

    result = {"engine": accelerator.fp8_engine.name, "converted": len(report.fp8_linears),
              "skipped": sorted(report.skipped), "first_loss": losses[0], "last_loss": losses[-1],
              "device": accelerator.device.type, "generated": generated[0, 7:].tolist()}
    accelerator.print("result: " + json.dumps(result))
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
