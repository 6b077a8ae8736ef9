"""What every row of benchmarks/training/hf_llama.py trains, whichever way it runs the model: the synthetic
task, the LlamaForCausalLM, the learning-rate schedule and the training step (benchmarks/moe's rows use
them too).

A module of its own because two training loops use it, hf_llama.py's own (the Accelerator rows)
and hf_llama_trainer.py's (`transformers.Trainer`, the `trainer` rows); both must train on the same
data from the same initial weights with the same schedule, or their losses say nothing.
Imports torch and transformers only inside the functions, so that hf_llama.py's parent process
(which only starts rows and prints the table) stays light.
"""

from __future__ import annotations

import math

ALPHABET, NOISE = 1024, 0.1  # the synthetic task (make_batches)


def make_batches(spec: dict, steps: int, seed: int = 1234):
    """`steps` batches of a learnable task: each sequence walks a fixed random permutation of the
    first min(vocab, 1024) token ids (next = perm[previous]), except that with probability 0.1 a
    token is drawn afresh. A bigram model can learn it; its loss floor (`loss_floor`) is known, so
    a loss is meaningful in absolute terms. Vectorised: the token at i is perm applied (i - j)
    times to the fresh draw at j, the last fresh position <= i."""
    import torch

    k, batch, seq = min(spec["vocab"], ALPHABET), spec["batch"], spec["seq"]
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(k, generator=gen)
    powers = torch.empty(seq, k, dtype=torch.long)
    powers[0] = torch.arange(k)
    for i in range(1, seq):
        powers[i] = perm[powers[i - 1]]
    n = steps * batch
    fresh = torch.rand(n, seq, generator=gen) < NOISE
    fresh[:, 0] = True
    draws = torch.randint(k, (n, seq), generator=gen)
    pos = torch.arange(seq).expand(n, seq)
    last = torch.where(fresh, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return powers[pos - last, draws.gather(1, last)].view(steps, batch, seq)


def loss_floor(spec: dict) -> float:
    """The cross-entropy (nats) of the best possible predictor of make_batches' tokens."""
    k = min(spec["vocab"], ALPHABET)
    hit, miss = 1 - NOISE + NOISE / k, NOISE / k
    return -(hit * math.log(hit) + (k - 1) * miss * math.log(miss))


def build_model(spec: dict, device):
    """LlamaForCausalLM from a config, fp32 weights built directly on `device`, seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"], max_position_embeddings=spec["seq"],
        tie_word_embeddings=False, use_cache=False,
    )
    if spec.get("liger"):  # patches transformers' Llama classes (this row's process only)
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    if spec.get("lora"):  # PEFT LoRA on every projection: the base frozen, the adapters trained
        import peft

        lora = peft.LoraConfig(r=spec["lora"], lora_alpha=2 * spec["lora"],
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"])
        model = peft.get_peft_model(model, lora)
    return model.train()


def warmup_schedule(optimizer, steps: int):
    """The learning rate of every row: a linear warm-up over a tenth of the steps (step i at
    (i + 1) / warm-up of the peak), then constant. Not Trainer's "linear" (which decays to zero
    by the last step) nor its "constant_with_warmup" (which starts at zero, one step behind)."""
    import torch

    warmup = max(1, steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup))


def training_step(accelerator, model, optimizer, scheduler, data):
    """step(i): one optimizer step on batch i, its loss detached."""
    def step(i):
        loss = model(input_ids=data[i], labels=data[i]).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step
