"""The training loop the tests share: forward, loss, backward, optimizer step, one loss per step.

Tests compare runs (FP8 against bf16, a resumed run against an unbroken one, low-bit optimizer
states against fp32), so every run must step the same way; only the parts that differ between
tests are options.
"""

import contextlib

import torch

from fp8plug.bench.toy_model import lm_loss


def next_token_loss(model, tokens):
    """fp8plug.bench.toy_model' decoders: next-token cross entropy on a batch of token ids."""
    return lm_loss(model(tokens), tokens)


def hf_loss(model, tokens):
    """A transformers causal LM computes its own next-token loss from labels."""
    return model(input_ids=tokens, labels=tokens).loss


def train(model, optimizer, batches, steps=None, *, loss=next_token_loss, accelerator=None, autocast=None):
    """Step `optimizer` on `batches` (cycled when `steps` exceeds them; default one step per batch)
    and return each step's loss as a float.

    With `accelerator`, the backward is `accelerator.backward` inside `accelerator.accumulate`, as
    in a user's loop; with `autocast` (a device type such as "cuda"), the forward and the loss run
    under bf16 autocast.
    """
    batches = list(batches)
    steps = len(batches) if steps is None else steps
    backward = accelerator.backward if accelerator is not None else torch.Tensor.backward
    losses = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        with accelerator.accumulate(model) if accelerator is not None else contextlib.nullcontext():
            with torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                value = loss(model, batch)
            backward(value)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(value.item())
    return losses


def tail_mean(losses, n=10):
    """The mean of the last `n` losses: one step's loss is too noisy to compare runs by."""
    return sum(losses[-n:]) / n


def adamw_tail_loss(model, batches, steps=None, *, lr=2e-3, autocast=None, tail=10):
    """Train with a fresh AdamW and return the mean of the last `tail` losses: the number the
    FP8-against-bf16 convergence tests compare."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return tail_mean(train(model, optimizer, batches, steps, autocast=autocast), tail)
