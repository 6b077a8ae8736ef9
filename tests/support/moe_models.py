"""Tiny transformers mixture-of-experts models built from a config (no download), one per
architecture fp8plug's FP8 experts are tried on (docs/moe.md). Every GEMM dimension is a multiple
of 16 so the experts can run in FP8; an architecture the installed transformers lacks is None."""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Optional

import torch

HIDDEN, EXPERT_FFN, EXPERTS, TOP_K, VOCAB = 64, 32, 4, 2, 128
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)

# name -> (config class, model class, the architecture's own settings)
ARCHITECTURES: Dict[str, tuple] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=EXPERT_FFN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=EXPERT_FFN, shared_expert_intermediate_size=32,
                       num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=64, moe_intermediate_size=EXPERT_FFN, num_experts=EXPERTS,
                       num_experts_per_tok=TOP_K, decoder_sparse_step=1, head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=EXPERT_FFN, num_experts=EXPERTS, num_experts_per_tok=TOP_K)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=64, moe_intermediate_size=EXPERT_FFN, n_routed_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=0, n_group=1,
                         topk_group=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                         v_head_dim=16, num_key_value_heads=4)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=EXPERT_FFN, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                     head_dim=16, sliding_window=16, layer_types=["full_attention"])),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(intermediate_size=64, moe_intermediate_size=EXPERT_FFN, n_routed_experts=EXPERTS,
                      num_experts_per_tok=TOP_K, n_shared_experts=1, first_k_dense_replace=0, n_group=1,
                      topk_group=1, head_dim=16)),
}


def builder(name: str) -> Optional[Callable[..., torch.nn.Module]]:
    """A function building the tiny `name` model (seeded), or None where transformers lacks it."""
    config_name, model_name, own = ARCHITECTURES[name]
    transformers = importlib.import_module("transformers")
    config_class, model_class = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if config_class is None or model_class is None:
        return None

    def build(seed: int = 0, **overrides) -> torch.nn.Module:
        torch.manual_seed(seed)
        config = config_class(**{**COMMON, **own, **overrides})
        return model_class(config)

    return build
