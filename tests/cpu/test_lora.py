"""FP8 LoRA with the real peft and TRL on the CPU, and handing the result on.

Checked: a frozen base projection does only the forward and input-gradient GEMMs in FP8 (no
weight-gradient GEMM, no transposed casts for it); the adapters train in high precision; FP8 LoRA
tracks bf16 LoRA's loss within 1% (60 steps here; the example's --steps 200 --compare-bf16 for
200); TRL's SFTTrainer with FP8TrainerMixin runs the shipped example; `export_model` gives plain
modules whose outputs equal the trained model's; the
FP8 inference checkpoint holds E4M3 weights with per-tensor scales and reloads to within FP8
weight error of the trained model.
"""

import copy
import json
import os

import pytest
import torch

peft = pytest.importorskip("peft")

import fp8plug  # noqa: E402
from fp8plug.backends.native import engine as native  # noqa: E402
from fp8plug.backends.native import fp8_matmul, linear  # noqa: E402
from fp8plug.checkpoints import export_formats as formats  # noqa: E402
from fp8plug.checkpoints.export import export_model, load_fp8_checkpoint, save_fp8_checkpoint  # noqa: E402
from fp8plug.layers.rules import ADAPTER  # noqa: E402
from tests.support.hf import VOCAB, fresh, tiny_llama  # noqa: E402
from tests.support.numerics import sqnr_db  # noqa: E402
from tests.support.threads import one_thread  # noqa: E402,F401 - autouse: tiny models on one torch thread

# the head asked for in FP8 too, so that every frozen Linear of the LoRA model is an FP8 base layer
RECIPE = fp8plug.FP8RecipeKwargs(backend="native", auto_filter=False, fp8_output_head=True)


def lora_llama(seed=0):
    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    return peft.get_peft_model(tiny_llama(seed), config)


def tokens(step, batch=8, seq=32):
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq)) % VOCAB


def step(model, opt, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_adapters_stay_high_precision_and_base_layers_convert():
    model = lora_llama()
    report = fp8plug.convert_model(model, recipe=RECIPE)
    adapters = [n for n, kind in report.kinds.items() if kind == ADAPTER]
    assert len(adapters) == 28 and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    bases = [n for n, m in model.named_modules() if isinstance(m, native.NativeFP8Linear)]
    assert len(bases) == 15 and all(n.endswith("base_layer") or n.endswith("lm_head") for n in bases)
    assert all(not m.weight.requires_grad for n, m in model.named_modules() if isinstance(m, native.NativeFP8Linear))


def test_frozen_base_layers_do_no_weight_gradient_work(monkeypatch):
    """Per step: no weight-gradient GEMM for a frozen base layer (a trainable one has it), and one
    transposed FP8 copy (its weight's, for the input gradient) instead of three. The first layer's
    q/k/v inputs need no gradient under LoRA (embeddings and norm are frozen): no input-gradient
    GEMM either."""
    gemms, transposed = [], []
    real_gemm, real_cast = fp8_matmul.scaled_mm, linear._cast

    def counting_gemm(*args, **kwargs):
        gemms.append(1)
        return real_gemm(*args, **kwargs)

    def counting_cast(*args, **kwargs):
        out = real_cast(*args, **kwargs)
        transposed.append(out[1] is not None)
        return out

    monkeypatch.setattr(fp8_matmul, "scaled_mm", counting_gemm)
    monkeypatch.setattr(linear, "_cast", counting_cast)  # the layer's forward casts
    monkeypatch.setattr(fp8_matmul, "_cast", counting_cast)  # backward's grad_output casts
    model = lora_llama()
    fp8plug.convert_model(model, recipe=RECIPE)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with fp8plug.get_backend("native").autocast(RECIPE):
        step(model, opt, tokens(0))
    frozen = 15  # 14 projections and the tied lm_head, all frozen under LoRA
    assert len(gemms) == frozen + (frozen - 3)  # forward for all, input gradient but for layer 0's q/k/v
    assert sum(transposed) == frozen and len(transposed) == 3 * frozen - 3  # layer 0 q/k/v: no backward

    gemms.clear()
    plain = tiny_llama()
    fp8plug.convert_model(plain, recipe=RECIPE)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    with fp8plug.get_backend("native").autocast(RECIPE):
        step(plain, opt, tokens(0))
    assert len(gemms) == 3 * frozen  # trainable: the weight-gradient GEMM is there


@pytest.mark.slow
def test_fp8_lora_tracks_bf16_lora_within_one_percent():
    base = lora_llama()
    bf16 = copy.deepcopy(base)
    fp8plug.convert_model(base, recipe=RECIPE)
    fp8plug.apply_fp8_autowrap(base, RECIPE)
    results = []
    for model in (bf16, base):
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        losses = [step(model, opt, tokens(i % 16)) for i in range(60)]
        results.append((losses[0], sum(losses[-10:]) / 10))
    (_, bf16_loss), (first, fp8_loss) = results
    assert abs(fp8_loss - bf16_loss) / bf16_loss <= 0.01, (fp8_loss, bf16_loss)
    assert fp8_loss < 0.95 * first  # it learned


def trained_model():
    fresh()
    model = tiny_llama()
    accelerator = fp8plug.Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[RECIPE])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = accelerator.prepare(model, opt)
    for i in range(3):
        ids = tokens(i)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    return accelerator, model


def test_export_model_gives_plain_modules_with_the_trained_weights():
    accelerator, model = trained_model()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    plain = export_model(accelerator.unwrap_model(model))
    assert not fp8plug.has_fp8_layers(plain)
    assert all(type(m) is torch.nn.Linear for n, m in plain.named_modules() if "proj" in n or n == "lm_head")
    assert "forward" not in plain.__dict__  # no wrapper of accelerate's or fp8plug's is left
    assert all(torch.equal(p, weights[n]) for n, p in plain.named_parameters())
    reference = tiny_llama()
    reference.load_state_dict(plain.state_dict())
    ids = tokens(9)
    assert torch.equal(plain(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_fp8_checkpoint_holds_e4m3_weights_and_reloads_within_fp8_error(tmp_path):
    from safetensors import safe_open

    accelerator, model = trained_model()
    plain = export_model(accelerator.unwrap_model(model)).eval()
    report = save_fp8_checkpoint(plain, tmp_path, layout="per_tensor")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": None, "ignored_layers": ["lm_head"],
                                             "modules_to_not_convert": ["lm_head"],
                                             "scale_fmt": formats.PER_TENSOR_SCALE_FMT}
    assert report.kept == {"lm_head": "tied to model.embed_tokens.weight"} and len(report.quantized) == 14
    with safe_open(os.fspath(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        w = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        scale = f.get_tensor("model.layers.0.mlp.up_proj.weight_scale")
    assert w.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == ()
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    original = plain.model.layers[0].mlp.up_proj.weight.detach()
    assert sqnr_db(w.float() * scale, original) >= 25  # E4M3's 3 mantissa bits: ~30 dB
    served = tiny_llama()
    served.load_state_dict(load_fp8_checkpoint(tmp_path), strict=False)
    served.tie_weights()
    ids = tokens(11)
    with torch.no_grad():
        assert sqnr_db(served(input_ids=ids).logits, plain(input_ids=ids).logits) >= 25


@pytest.mark.slow
def test_trl_sft_lora_example(tmp_path, capsys):
    pytest.importorskip("trl")
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    try:
        import sft_lora_fp8
    finally:
        sys.path.pop(0)
    fresh()
    assert sft_lora_fp8.main(["--steps", "4", "--output-dir", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.rsplit("result: ", 1)[1])
    assert result["engine"] == "native" and result["frozen_fp8_layers"] == 14 and result["trained_tensors"] == 28
    assert result["plain_modules"] and result["fp8_weights"] == 14 and result["fp8_checkpoint_sqnr_db"] >= 25
    assert (tmp_path / "merged" / "config.json").exists() and (tmp_path / "merged-fp8" / "model.safetensors").exists()
