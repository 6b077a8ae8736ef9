"""LoRA on an FP8 checkpoint with the base kept in FP8, on a real GPU (torch._scaled_mm).

The checks of tests/cpu/test_fp8_base.py where the CPU emulates the GEMM, here with the real one:
the base stays float8 in GPU memory (allocated bytes about half of the same base in bf16), logits
and LoRA adapter gradients against the dequantized float32 reference, every FP8 GEMM a
`torch._scaled_mm` call and none for a weight gradient, eager and torch.compile'd training that
lowers the loss, and merge_and_export reloading to the merged model. Run with the GPU kit:
`python3 -m pytest tests/gpu/test_fp8_base.py -q`.
"""

import pytest
import torch

peft = pytest.importorskip("peft")

import fp8plug  # noqa: E402
from fp8plug.backends.native.frozen_base import FrozenFP8Linear  # noqa: E402
from fp8plug.checkpoints.export import save_fp8_checkpoint  # noqa: E402
from tests.cpu.test_fp8_base import (  # noqa: E402
    BASE_LINEARS,
    lora,
    merged_reference,
    reference,
    tokens,
    trained_llama,
)
from tests.support.numerics import sqnr_db  # noqa: E402
from tests.support.training import hf_loss, train  # noqa: E402

CUDA = "cuda"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    model = trained_llama(tied=False)
    out = {}
    for layout in ("block", "per_tensor"):
        out[layout] = tmp_path_factory.mktemp(layout)
        save_fp8_checkpoint(model.eval(), out[layout], layout=layout)
    return out


@pytest.mark.parametrize("layout", ["block", "per_tensor"])
def test_memory_logits_and_adapter_gradients_on_the_gpu(checkpoints, layout, monkeypatch):
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    base = fp8plug.load_fp8_base(checkpoints[layout], device=CUDA, dtype=torch.bfloat16)
    fp8_bytes = torch.cuda.memory_allocated() - before
    bf16 = fp8plug.load_fp8_base(checkpoints[layout], device=CUDA, dtype=torch.bfloat16, trainable=True)
    bf16_bytes = torch.cuda.memory_allocated() - before - fp8_bytes
    frozen = [m for m in base.modules() if isinstance(m, FrozenFP8Linear)]
    assert len(frozen) == BASE_LINEARS and all(m.weight.device.type == CUDA and m.weight.dtype == torch.float8_e4m3fn
                                               for m in frozen)
    linear_numel = sum(m.weight.numel() for m in frozen)
    assert bf16_bytes - fp8_bytes >= 0.95 * linear_numel  # one byte less per base weight
    del bf16

    ref = reference(checkpoints[layout], tied=False).to(CUDA)
    base, ref = lora(base), lora(ref)
    base.to(CUDA)
    ref.to(CUDA)
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    ids = tokens(3).to(CUDA)
    base.train()
    ref.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = base(input_ids=ids, labels=ids).loss
    loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()  # float32 reference, no FP8
    got = {n: p.grad.float() for n, p in base.named_parameters() if p.grad is not None}
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(got) == set(expected) and len(got) == 2 * BASE_LINEARS
    names = sorted(got)
    whole = sqnr_db(torch.cat([got[n].flatten() for n in names]), torch.cat([expected[n].flatten() for n in names]))
    assert whole >= 20, whole  # bf16 autocast on top of FP8 here (CPU test: float32, >= 24 dB)
    assert calls.count(torch.float8_e4m3fn) == BASE_LINEARS and calls.count(torch.float8_e5m2) == BASE_LINEARS - 3
    assert all(m.weight.grad is None for m in frozen)


@pytest.mark.parametrize("compiled", [False, True])
def test_lora_training_on_the_fp8_base_lowers_the_loss(checkpoints, compiled):
    model = fp8plug.load_fp8_base(checkpoints["block"], device=CUDA, dtype=torch.bfloat16, fp8_head=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", auto_filter=False))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    step = torch.compile(model) if compiled else model
    ids = tokens(100, batch=2).to(CUDA)
    losses = train(step, opt, [ids], 20, loss=hf_loss, autocast="cuda")
    assert sum(losses[-3:]) / 3 < 0.9 * losses[0], losses


@pytest.mark.parametrize("layout", ["block", "per_tensor"])
def test_merge_and_export_on_the_gpu(checkpoints, tmp_path, layout):
    model = lora(fp8plug.load_fp8_base(checkpoints["per_tensor"], device=CUDA, dtype=torch.float32), seed=5)
    fp8plug.merge_and_export(model, tmp_path / "merged", layout=layout)
    expected_model = merged_reference(checkpoints["per_tensor"], False, model.cpu()).to(CUDA)
    reloaded = fp8plug.load_fp8_base(tmp_path / "merged", device=CUDA, dtype=torch.float32)
    ids = tokens(11).to(CUDA)
    with torch.no_grad():
        assert sqnr_db(reloaded(input_ids=ids).logits, expected_model(input_ids=ids).logits) >= 25
