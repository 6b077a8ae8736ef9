"""What the Liger tests share (tests/cpu/test_liger.py on the CPU, tests/gpu/test_liger.py): a small
transformers Llama patched with liger-kernel's `apply_liger_kernel_to_llama`, with the patch undone
after the test, and one training run of it under an Accelerator, with what the run shows.

liger_kernel is imported only inside these functions (it needs triton, which CI lacks); callers
skip first with pytest.importorskip("liger_kernel.transformers").

Why the undo: `apply_liger_kernel_to_llama` replaces names in transformers' modeling_llama module
(LlamaRMSNorm, LlamaMLP, apply_rotary_pos_emb, and without `model=` LlamaForCausalLM.forward)
for the whole process, even when given one model; a later test building a Llama would get Liger's
triton kernels. Every name it may replace is recorded with monkeypatch first, so it comes back.
"""

import contextlib

import torch

PATCHED_NAMES = ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")


def apply_liger(monkeypatch, model=None, **options):
    """liger_kernel's apply_liger_kernel_to_llama(model=model, **options), undone at the test's end."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    for name in PATCHED_NAMES:
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)
    apply_liger_kernel_to_llama(model=model, **options)
    return model


def small_llama(spec, seed=0):
    """LlamaForCausalLM from a config (untied head, every width a multiple of 16), fp32, seed `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                         num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                         num_key_value_heads=spec["kv_heads"], max_position_embeddings=spec["seq"],
                         tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def batches(spec, steps, seed=1234, noise=0.1):
    """A learnable task with a loss floor well above zero (so a relative loss gap means something):
    each sequence walks a fixed random permutation of the vocabulary (next = perm[previous]),
    except that with probability `noise` a token is drawn afresh."""
    gen = torch.Generator().manual_seed(seed)
    vocab, batch, seq = spec["vocab"], spec["batch"], spec["seq"]
    perm = torch.randperm(vocab, generator=gen)
    out = torch.empty(steps, batch, seq, dtype=torch.long)
    token = torch.randint(vocab, (steps, batch), generator=gen)
    for i in range(seq):
        out[:, :, i] = token
        fresh = torch.rand(steps, batch, generator=gen) < noise
        token = torch.where(fresh, torch.randint(vocab, (steps, batch), generator=gen), perm[token])
    return out


def linear_names(model):
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def train_with_liger(monkeypatch, spec, steps, *, fp8, device, lr=3e-3, recipe=None, liger_options=None,
                     before_prepare=None):
    """Train a Liger-patched small Llama for `steps` steps with labels: bf16 under
    accelerate.Accelerator(mixed_precision="bf16"), or FP8 under fp8plug.Accelerator (its default
    engine unless `recipe`). Returns the losses, the Linear layers' names before conversion, how
    often lm_head's forward ran in training (Liger's fused loss reads its weight instead), and for
    FP8 the conversion report and the GEMM counts."""
    import accelerate

    import fp8plug
    from tests.support.hf import fresh

    fresh()
    model = small_llama(spec)
    apply_liger(monkeypatch, model, **(liger_options or {}))
    linears = linear_names(model)
    if before_prepare is not None:
        before_prepare(model)
    calls = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: calls.append(module.training))
    if fp8:
        accelerator = fp8plug.Accelerator(mixed_precision="fp8", cpu=device == "cpu",
                                          kwargs_handlers=[recipe] if recipe is not None else [])
    else:
        accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=device == "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    warmup = max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup))
    model, optimizer, scheduler = accelerator.prepare(model.to(accelerator.device), optimizer, scheduler)
    data = batches(spec, steps).to(accelerator.device)
    losses = []
    for i in range(steps):
        loss = model(input_ids=data[i], labels=data[i]).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    hook.remove()
    result = dict(losses=torch.stack(losses).float().cpu().tolist(), linears=linears,
                  lm_head_training_calls=sum(calls), model=model)
    if fp8:
        result.update(report=accelerator.fp8_reports[0], coverage=accelerator.fp8_coverage())
    with contextlib.suppress(Exception):
        accelerator.free_memory()
    return result


def tail_mean(losses, n=10):
    return sum(losses[-n:]) / n
