"""What the Hugging Face tests share: a tiny tied-embedding Llama built from a config (no
downloads), and a clean accelerate process state between tests."""

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
