"""Fine-tune with TRL's SFTTrainer and a PEFT LoRA adapter in FP8, then ship the model.

The everyday Hugging Face recipe, unchanged but for one mixin: `FP8TrainerMixin` in front of
`trl.SFTTrainer`. The frozen base projections run in FP8 (forward and input-gradient GEMMs; a
frozen weight gets no weight-gradient GEMM), the LoRA adapters train. At the end the model is
exported to plain modules (`fp8plug.export_model`), the adapters merged (`merge_and_unload`),
and two checkpoints written: the plain one (`save_pretrained`) and an FP8 one for inference
servers (`fp8plug.checkpoints.export.save_fp8_checkpoint`).

The model is a LlamaForCausalLM from a small config and the tokenizer a word-level one built here
(nothing is downloaded); the data are synthetic counting sequences as text. On a CPU it trains in
seconds with the `native` engine; on a GPU the same script runs unchanged.

    python3 examples/sft_lora_fp8.py                  # native engine, CPU or GPU
    python3 examples/sft_lora_fp8.py --compare-bf16   # also the same LoRA run in bf16

The last line printed is `result: {json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import fp8plug
from fp8plug import FP8RecipeKwargs
from fp8plug.checkpoints.export import export_model, load_fp8_checkpoint, save_fp8_checkpoint
from fp8plug.integrations.trainer import FP8TrainerMixin

VOCAB = 128


class FP8SFTTrainer(FP8TrainerMixin, SFTTrainer):
    """TRL's SFTTrainer in FP8: the whole integration."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="native", help="native, ao, te, msamp, or auto")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--compare-bf16", action="store_true", help="also train the same LoRA in bf16")
    return p.parse_args(argv)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words t0..t127 (t0 pads, t1 ends), built in memory."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0")


def counting_text(n: int, seq: int, seed: int) -> Dataset:
    """Sequences counting up from a random start with a random stride (mod VOCAB), as text."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(2, VOCAB, (n, 1), generator=gen)
    stride = torch.randint(1, 8, (n, 1), generator=gen)
    rows = ((start + stride * torch.arange(seq)) % VOCAB).tolist()
    return Dataset.from_dict({"text": [" ".join(f"t{i}" for i in row) for row in rows]})


def base_model(args) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(64, args.seq), tie_word_embeddings=True, pad_token_id=0)
    return LlamaForCausalLM(config)


def train(args, trainer_class, out_dir, **extra):
    config = SFTConfig(output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
                       learning_rate=args.lr, logging_steps=1, report_to=[], save_strategy="no",
                       disable_tqdm=True, bf16=True, use_cpu=not torch.cuda.is_available(), seed=args.seed,
                       max_length=args.seq)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear")
    trainer = trainer_class(model=base_model(args), args=config, train_dataset=counting_text(256, args.seq, args.seed),
                            processing_class=word_tokenizer(), peft_config=lora, **extra)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return trainer, losses


def tail(losses, n=5):
    return sum(losses[-n:]) / min(n, len(losses))


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = args.output_dir or tempfile.mkdtemp(prefix="sft_lora_fp8_")
    backend = None if args.backend == "auto" else args.backend
    trainer, losses = train(args, FP8SFTTrainer, os.path.join(out_dir, "fp8"),
                            fp8_recipe=FP8RecipeKwargs(backend=backend))
    engine = trainer.accelerator.fp8_engine
    model = trainer.model
    # converted layers with a frozen weight matrix (the norms the native engine takes over have vectors)
    frozen = sorted(n for n, m in model.named_modules()
                    if engine.is_converted(m) and len(m.weight.shape) == 2 and not m.weight.requires_grad)
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    print(f"engine: {engine.name}; {len(frozen)} frozen base layers in FP8, {len(trained)} LoRA tensors trained")
    print(f"loss: first {losses[0]:.4f}, last 5 steps {tail(losses):.4f}")
    result = {"engine": engine.name, "frozen_fp8_layers": len(frozen), "trained_tensors": len(trained),
              "losses": losses}

    # ship: plain modules, adapters merged, a plain and an FP8 checkpoint
    model.eval()
    probe = torch.tensor([[(5 + 3 * i) % VOCAB for i in range(args.seq)]], device=trainer.accelerator.device)
    with torch.no_grad():
        trained_logits = model(input_ids=probe).logits.float()
    merged = export_model(trainer.accelerator.unwrap_model(model)).merge_and_unload()
    with torch.no_grad():
        merged_logits = merged(input_ids=probe).logits.float()
    merged.save_pretrained(os.path.join(out_dir, "merged"))
    report = save_fp8_checkpoint(merged, os.path.join(out_dir, "merged-fp8"))
    print(report)
    served = LlamaForCausalLM(merged.config).to(probe.device).eval()
    served.load_state_dict(load_fp8_checkpoint(os.path.join(out_dir, "merged-fp8")), strict=False)
    served.tie_weights()
    with torch.no_grad():
        served_logits = served(input_ids=probe).logits.float()
    result.update(
        plain_modules=not fp8plug.has_fp8_layers(merged),
        merged_max_abs_diff=(merged_logits - trained_logits).abs().max().item(),
        fp8_checkpoint_sqnr_db=sqnr_db(served_logits, merged_logits),
        fp8_weights=len(report.quantized),
    )
    print(f"exported: plain modules {result['plain_modules']}, merged logits within "
          f"{result['merged_max_abs_diff']:.2e} of the trained model's, FP8 checkpoint "
          f"{result['fp8_checkpoint_sqnr_db']:.1f} dB SQNR against them")
    if args.compare_bf16:
        _, bf16_losses = train(args, SFTTrainer, os.path.join(out_dir, "bf16"))
        result["bf16_losses"] = bf16_losses
        gap = (tail(losses) - tail(bf16_losses)) / tail(bf16_losses)
        print(f"bf16 LoRA: last 5 steps {tail(bf16_losses):.4f}; FP8 {gap:+.2%} from it")
    print("result: " + json.dumps(result))
    return 0


def sqnr_db(signal: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `signal` against `reference`, in dB."""
    noise = (signal - reference).pow(2).mean()
    return (10 * torch.log10(reference.pow(2).mean() / noise)).item() if noise > 0 else float("inf")


if __name__ == "__main__":
    raise SystemExit(main())
