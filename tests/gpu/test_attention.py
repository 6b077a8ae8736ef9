"""fp8plug.hf.attention on the GPU's stack (torch and transformers as installed there): a compiled
transformers Llama converted by fp8plug runs SDPA with is_causal and no mask, and its logits are
those of "sdpa" run eagerly. What "sdpa" itself does when compiled is printed (on torch < 2.14
transformers builds the mask: the reason for fp8plug.hf.attention). The speed is
benchmarks/training/hf_llama.py's (bf16-skipmask and fp8plug-keepmask rows)."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

import fp8plug  # noqa: E402
from fp8plug.hf.attention import FP8PLUG_SDPA  # noqa: E402
from tests.cpu.test_attention import compiled_attention_masks  # noqa: E402


def small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512, use_cache=False)
    return LlamaForCausalLM(config).cuda().to(torch.bfloat16)


def test_compiled_llama_attention_takes_is_causal_and_matches_sdpa(capsys):
    torch._dynamo.reset()
    ids = torch.randint(0, 1024, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    plain = small_llama().eval()
    with torch.no_grad():
        reference = plain(input_ids=ids).logits.float()
    sdpa_compiled, _ = compiled_attention_masks(copy.deepcopy(plain), input_ids=ids)

    model = copy.deepcopy(plain)
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native"))
    assert model.config._attn_implementation == FP8PLUG_SDPA
    model.eval()  # FP8 is off in eval by default: the logits differ from sdpa's by the kernel only
    calls, _ = compiled_attention_masks(model, input_ids=ids)
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model)(input_ids=ids).logits.float()  # inductor
    with capsys.disabled():
        print(f"\n  compiled 'sdpa' attention calls (mask given, is_causal): {sdpa_compiled}; "
              f"fp8plug's: {calls}")
    assert calls == [(False, True)] * 2
    error = float((logits - reference).norm() / reference.norm())
    assert error < 1e-2, error  # bf16: the same attention by another kernel
