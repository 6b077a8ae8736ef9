"""The native engine's eager fused RMSNorm (backends.native.fused_norm) on CUDA: its numerics against
transformers' LlamaRMSNorm, the FP8 cast that takes its amax, and a Llama whose shared inputs are
cast once (backends.native.shared_input)."""

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fp8plug
from fp8plug.backends.native import fused_cast, fused_norm
from fp8plug.backends.native.fused_norm import FusedRMSNorm
from tests.support.numerics import rel_error, sqnr_db

F32, BF16 = torch.float32, torch.bfloat16


def llama_norm(width, dtype, seed=0):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(seed)
    norm = LlamaRMSNorm(width, eps=1e-5).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(width))
    return norm


def forward_backward(norm, x, grad):
    x = x.detach().clone().requires_grad_()
    norm.weight.grad = None
    y = norm(x)
    y.backward(grad)
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("x_dtype,w_dtype", [(F32, F32), (BF16, F32), (BF16, BF16)])
@pytest.mark.parametrize("width", [4096, 1000])
def test_fused_norm_matches_llama_rms_norm(x_dtype, w_dtype, width):
    original = llama_norm(width, w_dtype)
    fused = FusedRMSNorm(original)
    assert fused_norm.usable(torch.empty(1, width, device="cuda", dtype=x_dtype), fused.weight)
    x = (3 * torch.randn(4, 333, width, device="cuda")).to(x_dtype)
    grad = torch.randn(4, 333, width, device="cuda").to(torch.promote_types(x_dtype, w_dtype))
    want = forward_backward(original, x, grad)
    got = forward_backward(fused, x, grad)
    for name, a, b in zip(("output", "input grad", "weight grad"), got, want):
        assert a.dtype == b.dtype, name
        # float32 results differ only by the order of the row sums; 16-bit ones by where that
        # flips a rounding
        limit = 2e-6 if a.dtype == F32 else 4e-3
        assert rel_error(a, b) < limit, (name, rel_error(a, b))
    y, amax = fused_norm._RMSNorm.apply(x, fused.weight, fused.variance_epsilon)
    assert amax.item() == y.float().abs().max().item()


def test_the_cast_of_a_norm_output_takes_its_amax_and_writes_the_same_bytes():
    assert fused_cast.load()
    norm = llama_norm(4096, F32)
    x = torch.randn(2048, 4096, device="cuda")
    x[7, 9] = float("nan")  # NaN counts as inf in the amax, as the cast's own amax pass has it
    for poisoned in (False, True):
        inp = x if poisoned else torch.nan_to_num(x)
        y, amax = fused_norm._RMSNorm.apply(inp, norm.weight, 1e-5)
        given = fused_cast.cast_transpose_dynamic(y, torch.float8_e4m3fn, amax)
        own = fused_cast.cast_transpose_dynamic(y, torch.float8_e4m3fn)
        for a, b in zip(given, own):
            assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                               b.view(torch.uint8) if b.dtype.itemsize == 1 else b)


def tiny_llama_cuda():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
    return LlamaForCausalLM(config).cuda()


def kernel_counts(step) -> dict:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return {e.key: e.count for e in prof.key_averages()}


def test_a_llama_casts_each_shared_input_once_and_reads_the_norms_amax():
    model = tiny_llama_cuda()  # the head asked for in FP8 too: its input is the final norm's output
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", scaling="dynamic",
                                                                fp8_output_head=True))
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    model.train()

    def forward():
        with torch.autocast("cuda", torch.bfloat16):
            model(input_ids=ids)

    forward()
    counts = kernel_counts(forward)
    # a layer: inputs cast for q/k/v (once), o, gate/up (once), down; seven weights; then lm_head
    assert counts.get("rms_norm_forward") == 5
    assert counts.get("cast_both_layouts") == 2 * (4 + 7) + 2
    # no amax pass for the inputs a norm wrote: q/k/v's, gate/up's, lm_head's
    assert counts.get("amax_unless_scaled") == 2 * (2 + 7) + 1


def test_training_with_fused_norms_follows_the_unfused_model():
    base = tiny_llama_cuda()
    fused, plain = copy.deepcopy(base), copy.deepcopy(base)
    recipe = fp8plug.FP8RecipeKwargs(backend="native", scaling="dynamic")
    fp8plug.convert_model(fused, recipe=recipe)
    norms = [fqn for fqn, m in plain.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    fp8plug.convert_model(plain, recipe=fp8plug.FP8RecipeKwargs(backend="native", scaling="dynamic",
                                                                modules_to_ignore=norms))
    assert any(isinstance(m, FusedRMSNorm) for m in fused.modules())
    assert not any(isinstance(m, FusedRMSNorm) for m in plain.modules())
    ids = torch.randint(0, 512, (4, 128), device="cuda")
    losses = []
    for model in (fused, plain):
        model.train()
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) / losses[1] < 1e-3
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters()):
        assert sqnr_db(a.grad, b.grad) > 30, name
