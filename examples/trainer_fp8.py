"""Train a Hugging Face Llama with transformers.Trainer in FP8: fp8plug.integrations.trainer.FP8Trainer.

The model is a LlamaForCausalLM with tied embeddings built from a small LlamaConfig (nothing is
downloaded); the data are learnable synthetic sequences. On a CPU the defaults train it in a
few seconds with fp8plug's torch-only `native` engine; on a GPU the same script runs unchanged.

    python3 examples/trainer_fp8.py                       # native engine, CPU or GPU
    python3 examples/trainer_fp8.py --backend ao          # torchao float8
    python3 examples/trainer_fp8.py --compare-bf16        # also train plain Trainer(bf16=True)
    fp8plug launch --config_file examples/configs/cpu_ddp_fp8.yaml examples/trainer_fp8.py

Under `accelerate launch` the engine and recipe come from the launch config unless --backend is
given. The last line printed is `result: {json}`: the engine, converted layers, losses, the eval
loss, and whether the saved checkpoint reloads into plain transformers with the same logits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from fp8plug import FP8RecipeKwargs
from fp8plug.integrations.trainer import FP8Trainer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default=None,
                   help="native, ao, te, msamp, or auto (default: the launch config's, else native)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: a GPU when there is one, else the CPU")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sequences per device per step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (batch*seq: a multiple of 16)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="trainer_fp8_output", help="Trainer's output_dir (checkpoints)")
    p.add_argument("--compare-bf16", action="store_true",
                   help="also train plain transformers.Trainer(bf16=True) from the same start")
    p.add_argument("--out", default=None, help="also write each process's result to OUT/rank<r>.json")
    return p.parse_args(argv)


VOCAB = 128


def tiny_llama(args) -> LlamaForCausalLM:
    """A LlamaForCausalLM from a config alone: random weights, tied embeddings, every Linear width
    a multiple of 16 (what FP8 GEMMs need)."""
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(64, args.seq), tie_word_embeddings=True)
    return LlamaForCausalLM(config)


class CountingSequences(torch.utils.data.Dataset):
    """Each sequence counts up from a random start with a random stride (mod the vocabulary)."""

    def __init__(self, n: int, seq: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(seq)) % VOCAB

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def weights_sha256(model) -> str:
    sha = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        sha.update(key.encode())
        sha.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return sha.hexdigest()


def main(argv=None) -> int:
    args = parse_args(argv)
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ  # running under `accelerate launch`
    backend = args.backend or (None if launched else "native")
    # backend None: the launch config's engine, else the automatic choice ("auto" forces that).
    # lm_head stays in high precision (the Accelerator's default, fp8_output_head; on real text an FP8
    # head cost 1.4% final loss, docs/numerics.md); auto_filter=False: a model this small
    # would otherwise stay in bf16 on an H100/H200, where FP8 would be slower for it.
    recipe = FP8RecipeKwargs(backend=backend, auto_filter=False)
    use_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    output_dir = args.output_dir

    world = int(os.environ.get("WORLD_SIZE", "1"))
    train_data = CountingSequences(args.steps * args.batch * world, args.seq, seed=args.seed)
    eval_data = CountingSequences(4 * args.batch, args.seq, seed=args.seed + 1)

    def training_arguments(subdir: str, **extra) -> TrainingArguments:
        values = dict(output_dir=os.path.join(output_dir, subdir), use_cpu=use_cpu, seed=args.seed,
                      per_device_train_batch_size=args.batch, per_device_eval_batch_size=args.batch,
                      learning_rate=args.lr, lr_scheduler_type="constant", max_steps=args.steps,
                      logging_steps=1, save_strategy="steps", save_steps=args.steps, report_to=[],
                      disable_tqdm=True)
        return TrainingArguments(**{**values, **extra})

    trainer = FP8Trainer(model=tiny_llama(args), args=training_arguments("fp8"), train_dataset=train_data,
                         eval_dataset=eval_data, fp8_recipe=recipe)
    accelerator = trainer.accelerator
    accelerator.print(f"engine: {accelerator.fp8_engine.name} ({accelerator.fp8_engine.title}) on {accelerator.device}")
    trainer.train()
    report = accelerator.fp8_reports[0]
    accelerator.print(report)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    eval_loss = trainer.evaluate()["eval_loss"]  # eval mode: high precision
    accelerator.print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}; eval {eval_loss:.4f}")

    # The checkpoint is a plain transformers one: from_pretrained loads it without fp8plug, tie
    # kept, and its logits equal the FP8-trained model's in eval mode (same bf16 autocast).
    checkpoint = os.path.join(output_dir, "fp8", f"checkpoint-{args.steps}")
    accelerator.wait_for_everyone()  # the main process wrote it
    reloaded = LlamaForCausalLM.from_pretrained(checkpoint).to(accelerator.device).eval()
    model = trainer.model.eval()
    tokens = eval_data.tokens[:2].to(accelerator.device)
    with torch.no_grad(), torch.autocast(accelerator.device.type, dtype=torch.bfloat16):
        ours, plain = model(input_ids=tokens).logits.float(), reloaded(input_ids=tokens).logits.float()
    same_logits = torch.equal(ours, plain)
    # (an engine whose modules run their own high-precision GEMM in eval, as TransformerEngine's
    # do, matches to rounding rather than bit for bit)
    logits_rel_diff = ((ours - plain).norm() / plain.norm()).item()
    result = {
        "engine": accelerator.fp8_engine.name, "device": accelerator.device.type,
        "processes": accelerator.num_processes, "distributed_type": accelerator.distributed_type.value,
        "wrapper": type(trainer.model_wrapped).__name__, "converted": len(report.fp8_linears),
        "skipped": sorted(report.skipped),
        "first_loss": losses[0], "last_loss": losses[-1], "losses": losses, "eval_loss": eval_loss,
        "reloaded_same_logits": same_logits, "reloaded_logits_rel_diff": logits_rel_diff,
        "reloaded_tied": reloaded.lm_head.weight is reloaded.model.embed_tokens.weight,
        "fp8_state_saved": os.path.isfile(os.path.join(checkpoint, "fp8_state.pt")),
        "weights_sha256": weights_sha256(trainer.model),
    }

    if args.compare_bf16:  # the same run through plain transformers.Trainer in bf16
        reference = Trainer(model=tiny_llama(args), args=training_arguments("bf16", bf16=True, save_strategy="no"),
                            train_dataset=train_data)
        reference.train()
        result["bf16_losses"] = [entry["loss"] for entry in reference.state.log_history if "loss" in entry]
        accelerator.print(f"bf16 Trainer: last loss {result['bf16_losses'][-1]:.4f}")

    line = json.dumps(result)
    accelerator.print("result: " + line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{accelerator.process_index}.json"), "w") as f:
            f.write(line)
    # Destroys the process group while the interpreter is whole: left to exit, gloo's worker threads
    # can abort the process ("terminate called without an active exception", pytorch#190489).
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
