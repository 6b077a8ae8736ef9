"""What the Hugging Face tests share: a tiny tied-embedding Llama built from a config (no
downloads), a clean accelerate process state between tests, and a few training steps at odd
sequence lengths."""

from accelerate.state import AcceleratorState, GradientState

VOCAB = 128


def tiny_llama(seed=0, vocab=VOCAB):
    """A 2-layer LlamaForCausalLM, hidden 64, every Linear a multiple of 16, embeddings tied."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def fresh():
    """Forget accelerate's process-wide singletons, as a new process would."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train_on_lengths(accelerator, model, optimizer, lengths, batch, vocab):
    """One training step per sequence length in `lengths` (random tokens, a fixed seed), so that
    token counts that are not multiples of 16 reach the FP8 GEMMs; returns the losses."""
    import torch

    gen = torch.Generator().manual_seed(0)
    losses = []
    for length in lengths:
        ids = torch.randint(0, vocab, (batch, length), generator=gen).to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
