"""The model of benchmarks/distributed/fsdp2_llama.py's rows: its size (parameters, FLOPs a token),
built with its parameters on meta and then given memory and values per rank (or built inside
DeepSpeed's zero.Init), each parameter from a seed of its own name, so every row at every world
size starts from the same weights (`weight_sums` checks it).

Why apart: the rows' launcher needs the FLOP count, the ranks the model, the CPU tests both, and
none of them the rest of the benchmark. `build_meta_model` imports benchmarks/moe/moe_llm.py's
config builder, which the caller puts on sys.path.
"""

from __future__ import annotations

import zlib

LLAMA3_8B = dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, seq=8192, batch=1,
                 rope_theta=500000.0)
INIT_STD = 0.02  # transformers' initializer_range for Llama


def parameter_counts(spec: dict) -> tuple:
    """(all parameters, those outside the input embedding, those of them a token runs through) of
    the model `spec` describes: an MoE token runs through top_k of the experts."""
    d, head_dim = spec["hidden"], spec.get("head_dim") or spec["hidden"] // spec["heads"]
    q, kv = spec["heads"] * head_dim, spec["kv_heads"] * head_dim
    attention = 2 * d * q + 2 * d * kv + 2 * d  # q, o; k, v; two norms
    if spec.get("arch") == "qwen3moe":
        attention += 2 * head_dim  # q_norm, k_norm
    if "experts" in spec:
        router, expert = d * spec["experts"], 3 * d * spec["expert_ffn"]
        layer, active = attention + router + spec["experts"] * expert, attention + router + spec["top_k"] * expert
    else:
        layer = active = attention + 3 * d * spec["intermediate"]
    rest = d + spec["vocab"] * d  # final norm + lm_head
    non_embedding = spec["layers"] * layer + rest
    return non_embedding + spec["vocab"] * d, non_embedding, spec["layers"] * active + rest


def flops_per_token(spec: dict) -> float:
    """Model FLOPs per trained token: 6 x (parameters outside the input embedding that the token
    runs through) + 12 x layers x attention width x seq (attention scores and values, forward and
    backward)."""
    head_dim = spec.get("head_dim") or spec["hidden"] // spec["heads"]
    return 6 * parameter_counts(spec)[2] + 12 * spec["layers"] * spec["heads"] * head_dim * spec["seq"]


def build_zero3_model(spec: dict, accelerator, device):
    """The model built inside deepspeed.zero.Init (each layer partitioned as it is made: no
    rank holds the whole model), every parameter then set from its per-name seed as `materialise`
    does, one at a time (gathered, filled on rank 0, scattered back), and transformers' own
    activation checkpointing per decoder layer."""
    import deepspeed
    import torch

    meta = build_meta_model(spec)
    with deepspeed.zero.Init(config_dict_or_path=accelerator.state.deepspeed_plugin.deepspeed_config):
        model = type(meta)(meta.config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if accelerator.process_index == 0:
                    gen = torch.Generator(device=device).manual_seed(zlib.crc32(canonical(name).encode()))
                    full = torch.empty(param.shape, dtype=torch.float32, device=device)
                    if full.dim() >= 2:
                        full.normal_(0.0, INIT_STD, generator=gen)
                    else:
                        full.fill_(1.0)
                    param.copy_(full)
                    del full
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def build_meta_model(spec: dict):
    """The model from its config (LlamaForCausalLM, or moe_llm.py's MoE model where `spec` has an
    "arch"): parameters on meta, buffers (RoPE's) real, train mode."""
    import accelerate
    from moe_llm import model_config
    from transformers import LlamaConfig, LlamaForCausalLM

    if "arch" in spec:
        cls, config = model_config(spec)
        config.initializer_range = INIT_STD
        with accelerate.init_empty_weights(include_buffers=False):
            model = cls(config)
        return model.train()
    config = LlamaConfig(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=spec["seq"], rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
        initializer_range=INIT_STD, tie_word_embeddings=False, use_cache=False)
    with accelerate.init_empty_weights(include_buffers=False):
        model = LlamaForCausalLM(config)
    return model.train()


def canonical(name: str) -> str:
    """A parameter's name without the wrappers' parts (activation checkpointing, torch.compile)."""
    return name.replace("._checkpoint_wrapped_module", "").replace("_orig_mod.", "").replace("._orig_mod", "")


def materialise(model, device, seed: int = 0) -> None:
    """Give the sharded meta model memory on `device` (each rank its shards) and initialise every
    parameter from its own seed: matrices normal(0, INIT_STD), vectors 1. Each is generated whole,
    one at a time, and cut to this rank's shard, so values do not depend on the world size."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
        for name, param in model.named_parameters():
            gen = torch.Generator(device=device).manual_seed(seed + zlib.crc32(canonical(name).encode()))
            full = torch.empty(param.shape, dtype=torch.float32, device=device)
            if full.dim() >= 2:
                full.normal_(0.0, INIT_STD, generator=gen)
            else:
                full.fill_(1.0)
            target = param
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                target = param.to_local()
            inner = getattr(target, "_tensor", None)  # torchao's float8 all-gather weight wraps the storage
            (inner if isinstance(inner, torch.Tensor) else target).copy_(full)
            del full


def weight_sums(model, device) -> list:
    """The sum and the sum of squares of all weights, over all ranks: equal in every row and for
    every world size if the initialisation is (up to float64 rounding)."""
    import torch

    sums = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for p in model.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            t = getattr(t, "_tensor", t)
            t = getattr(p, "ds_tensor", t)  # ZeRO-3: this rank's partition (zero padding adds nothing)
            sums += torch.stack([t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, dtype=torch.float64) ** 2])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    return [round(x, 6) for x in sums.tolist()]
