"""fp8plug.hf.attention on the CPU with the real transformers: a converted Llama's SDPA gets
is_causal and no mask, compiled too, computes what "sdpa" computes, and still builds the mask
wherever one is needed (a padding mask, position ids the caller passes, a KV cache, a sliding
window); a failed forward leaves no state behind; the switch is undone for shipping.

Which kernel SDPA picks on a GPU, and what that is worth, is benchmarks/training/hf_llama.py's
(docs/attention.md)."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import fp8plug  # noqa: E402
from fp8plug.checkpoints.export import export_model  # noqa: E402
from fp8plug.hf.attention import FP8PLUG_SDPA, causal_or_sdpa_mask, skip_causal_mask  # noqa: E402
from tests.support.hf import VOCAB, tiny_llama  # noqa: E402

SDPA_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention")


class SdpaCalls(TorchDispatchMode):
    """Records, for each attention op that runs, whether it was given a mask and is_causal."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SDPA_OPS:
            schema = [a.name for a in func._schema.arguments]
            values = dict(zip(schema, args), **kwargs)
            self.calls.append((values.get("attn_mask") is not None, bool(values.get("is_causal", False))))
        return func(*args, **kwargs)


def compiled_attention_masks(model, **inputs):
    """Compile `model` with a backend that reads the traced graph: for each SDPA call, (mask
    given, is_causal); and the compiled model's logits."""
    found = []

    def backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
                found.append((mask is not None, bool(causal)))
        return graph_module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend)(**inputs).logits
    return found, logits


def llama(seed=0):
    """The tiny Llama as trained: no KV cache (with one, transformers never checks for packing)."""
    model = tiny_llama(seed)
    model.config.use_cache = False
    return model


def ids(batch=2, seq=32, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def attention_calls(model, **inputs):
    with SdpaCalls() as spy, torch.no_grad():
        logits = model(**inputs).logits
    return spy.calls, logits


def rel_error(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_no_mask_is_built_compiled_or_not_and_the_logits_are_sdpas():
    plain = llama(0)
    fast = copy.deepcopy(plain)
    assert skip_causal_mask(fast) and fast.config._attn_implementation == FP8PLUG_SDPA
    batch = dict(input_ids=ids())
    _, reference = attention_calls(plain, **batch)
    calls, logits = attention_calls(fast, **batch)
    assert calls == [(False, True)] * 2  # both layers: no mask, is_causal
    assert rel_error(logits, reference) < 1e-5
    calls, logits = compiled_attention_masks(fast, **batch)
    assert calls == [(False, True)] * 2  # compiled too
    assert rel_error(logits, reference) < 1e-5
    built, _ = compiled_attention_masks(plain, **batch)  # transformers compiled: it cannot rule out packing
    print(f"'sdpa' compiled: {built}")


def test_a_padding_mask_or_a_cache_still_builds_the_mask():
    plain = llama(0)
    fast = copy.deepcopy(plain)
    skip_causal_mask(fast)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :5] = 0  # left padding in the second row
    batch = dict(input_ids=ids(), attention_mask=mask)
    _, reference = attention_calls(plain, **batch)
    for calls, logits in (attention_calls(fast, **batch), compiled_attention_masks(fast, **batch)):
        assert calls and all(has_mask for has_mask, _ in calls)
        assert rel_error(logits[1, 5:], reference[1, 5:]) < 1e-5 and rel_error(logits[0], reference[0]) < 1e-5
    # position ids the caller passes (packed sequences: two of 16 in a row) are honoured, compiled too
    positions = torch.arange(32).remainder(16).expand(2, -1)
    _, reference = attention_calls(plain, input_ids=ids(), position_ids=positions)
    calls, logits = compiled_attention_masks(fast, input_ids=ids(), position_ids=positions)
    assert calls and all(has_mask for has_mask, _ in calls)
    assert rel_error(logits, reference) < 1e-5
    # decoding with a KV cache (more keys than queries) matches "sdpa" token for token
    prompt = ids(batch=1, seq=8)
    want = plain.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    got = fast.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    assert torch.equal(got, want)


def test_only_a_plain_causal_mask_without_padding_is_skipped():
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    plain = dict(batch_size=1, q_length=8, kv_length=8, mask_function=causal_mask_function)
    assert causal_or_sdpa_mask(**plain) is None
    built = [
        dict(plain, attention_mask=torch.tensor([[False] + [True] * 7])),  # padding
        dict(plain, kv_length=12, q_offset=4),  # a cache
        dict(plain, mask_function=sliding_window_causal_mask_function(4), local_size=4),
        dict(plain, allow_is_causal_skip=False),  # transformers' own "not plain" (packed sequences, ...)
    ]
    for kwargs in built:
        assert isinstance(causal_or_sdpa_mask(**kwargs), torch.Tensor), kwargs


def test_conversion_switches_and_export_or_the_recipe_keeps_sdpa():
    model = tiny_llama(0)
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native"))
    assert model.config._attn_implementation == FP8PLUG_SDPA
    export_model(model)
    assert model.config._attn_implementation == "sdpa"  # a shipped model names transformers' own

    model = tiny_llama(0)
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", skip_causal_mask=False))
    assert model.config._attn_implementation == "sdpa"

    eager = tiny_llama(0)
    eager.set_attn_implementation("eager")
    fp8plug.convert_model(eager, recipe=fp8plug.FP8RecipeKwargs(backend="native"))
    assert eager.config._attn_implementation == "eager"  # only "sdpa" is switched


def test_a_failed_forward_leaves_no_model_thinking_its_positions_are_its_own():
    from fp8plug.hf import attention

    fast = llama(0)
    skip_causal_mask(fast)
    with pytest.raises(Exception):
        fast(input_ids=torch.full((1, 8), VOCAB + 5))  # out of the vocabulary: the embedding raises
    assert attention._POSITIONS.own is False
    export_model(fast)
    assert not fast._forward_pre_hooks and not fast.model._forward_hooks


def test_a_peft_model_is_switched_inside():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(llama(0), peft.LoraConfig(r=4, target_modules="all-linear"))
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native"))
    assert model.get_base_model().config._attn_implementation == FP8PLUG_SDPA
    calls, _ = compiled_attention_masks(model, input_ids=ids())
    assert calls == [(False, True)] * 2
