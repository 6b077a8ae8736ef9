"""LoRA on an FP8 checkpoint with the base kept in FP8 (fp8plug.load_fp8_base, merge_and_export).

A small Llama (Linears over several 128x128 tiles) is trained a few steps, written as per-tensor and
block FP8 checkpoints by save_fp8_checkpoint, and loaded as a frozen FP8 base. Checked against the
same checkpoint dequantized into the plain model in float32 (the reference): every base Linear is
float8 in memory (half bf16's bytes); logits in FP8 >= 25 dB SQNR; PEFT LoRA adapter gradients
against the same adapters on the reference: >= 24 dB SQNR over all adapters, >= 17 dB for each
(E5M2 grad_output, E4M3 activations: 26 and 19.4 dB measured), and within 1 dB of fp8plug's usual
FP8 LoRA on the dequantized model; no weight-gradient GEMM; training lowers the loss, with and
without gradient checkpointing; merge_and_export reloads (fp8plug and transformers) to the merged
reference within FP8 weight error (>= 25 dB); clear errors for bad inputs.
"""

import json

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

import fp8plug  # noqa: E402
from fp8plug.backends.native import frozen_base  # noqa: E402
from fp8plug.backends.native.frozen_base import FrozenFP8Linear  # noqa: E402
from fp8plug.checkpoints import export_formats as formats  # noqa: E402
from fp8plug.checkpoints.export import load_fp8_checkpoint, save_fp8_checkpoint  # noqa: E402
from tests.cpu.test_export_formats import VOCAB, llama, transformers_skeleton, vllm_problems  # noqa: E402
from tests.support.hf import VOCAB as TINY_VOCAB  # noqa: E402
from tests.support.hf import tiny_llama  # noqa: E402
from tests.support.numerics import sqnr_db  # noqa: E402
from tests.support.training import hf_loss, train  # noqa: E402

BASE_LINEARS = 14  # 2 layers x (q, k, v, o, gate, up, down)


def tokens(seed, batch=4, seq=32):
    """A learnable task: arithmetic sequences mod VOCAB."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    stride = torch.randint(1, 6, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq)) % VOCAB


def trained_llama(tied):
    model = llama(tied).train()
    train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), [tokens(step) for step in range(3)], loss=hf_loss)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(layout, tied) -> checkpoint directory."""
    out = {}
    for tied in (True, False):
        model = trained_llama(tied)
        for layout in formats.LAYOUTS:
            directory = tmp_path_factory.mktemp(f"{layout}_{'tied' if tied else 'untied'}")
            save_fp8_checkpoint(model, directory, layout=layout, max_shard_size="300KB")  # sharded, with an index
            out[layout, tied] = directory
    return out


def reference(directory, tied):
    """The checkpoint dequantized into the plain model, float32 (what users load in high precision)."""
    model = llama(tied, seed=1)
    missing, unexpected = model.load_state_dict(load_fp8_checkpoint(directory), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


def lora(model, seed=0):
    """PEFT LoRA r=8 on every projection, lora_B nonzero (seeded) so both adapters get gradients."""
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def adapter_grads(model, ids):
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", formats.LAYOUTS)
def test_base_stays_fp8_in_memory_and_logits_match_the_dequantized_reference(checkpoints, layout, caplog):
    caplog.set_level("INFO", logger="fp8plug")
    base = fp8plug.load_fp8_base(checkpoints[layout, True], device="cpu", dtype=torch.float32)
    frozen = [m for m in base.modules() if isinstance(m, FrozenFP8Linear)]
    assert len(frozen) == BASE_LINEARS and not base.training
    assert all(m.weight.dtype == torch.float8_e4m3fn and not m.weight.requires_grad for m in frozen)
    assert all(m.weight_scale.dtype == torch.float32 and m.weight_scale.dim() == 0 for m in frozen)
    assert base.lm_head.weight is base.model.embed_tokens.weight  # tied again
    fp8_bytes = sum(m.weight.nbytes for m in frozen)
    assert fp8_bytes * 2 == sum(m.weight.numel() for m in frozen) * torch.bfloat16.itemsize  # half bf16's
    if layout == "block":  # requantized to one scale per tensor: logged once, with the worst SQNR
        line = next(r.getMessage() for r in caplog.records if "requantized" in r.getMessage())
        assert float(line.split("worst SQNR ")[1].split(" dB")[0]) >= 28
    ref = reference(checkpoints[layout, True], tied=True)
    ids = tokens(7)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        eval_logits = base(input_ids=ids).logits  # eval: weights dequantized per call, no FP8 GEMM
        base.train()
        fp8_logits = base(input_ids=ids).logits  # training mode: the FP8 GEMMs on the stored codes
    assert sqnr_db(eval_logits, expected) >= (60 if layout == "per_tensor" else 28)
    assert sqnr_db(fp8_logits, expected) >= 25, sqnr_db(fp8_logits, expected)


@pytest.mark.parametrize("layout", formats.LAYOUTS)
def test_lora_adapter_gradients_match_lora_on_the_dequantized_reference(checkpoints, layout, monkeypatch):
    base = lora(fp8plug.load_fp8_base(checkpoints[layout, True], device="cpu", dtype=torch.float32))
    ref = lora(reference(checkpoints[layout, True], tied=True))
    assert {p.dtype for n, p in base.named_parameters() if "lora_" in n} == {torch.float32}  # not float8
    calls = []
    real = frozen_base.scaled_mm
    monkeypatch.setattr(frozen_base, "scaled_mm", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    ids = tokens(3)
    got, expected = adapter_grads(base, ids), adapter_grads(ref, ids)
    assert set(got) == set(expected) and len(got) == 2 * BASE_LINEARS  # only the adapters have gradients
    names = sorted(got)
    whole = sqnr_db(torch.cat([got[n].flatten() for n in names]), torch.cat([expected[n].flatten() for n in names]))
    worst = min(sqnr_db(got[n], expected[n]) for n in names)
    assert whole >= 24 and worst >= 17, (whole, worst)  # measured: 26 dB whole, 19.4 dB worst (block)
    # as close as fp8plug's usual FP8 LoRA on the dequantized model (NativeFP8Linear, dynamic scaling)
    usual = lora(reference(checkpoints[layout, True], tied=True))
    fp8plug.convert_model(usual, recipe=fp8plug.FP8RecipeKwargs(backend="native", scaling="dynamic", auto_filter=False))
    theirs = adapter_grads(usual, ids)
    usual_whole = sqnr_db(torch.cat([theirs[n].flatten() for n in names]),
                          torch.cat([expected[n].flatten() for n in names]))
    assert whole >= usual_whole - 1, (whole, usual_whole)
    # 14 forward GEMMs (E4M3 input) and 11 input-gradient GEMMs (E5M2 grad_output): layer 0's q/k/v
    # inputs need no gradient (embedding and norm frozen). No weight-gradient GEMM: it would be a
    # third kind, and would come on top.
    assert calls.count(torch.float8_e4m3fn) == BASE_LINEARS and calls.count(torch.float8_e5m2) == BASE_LINEARS - 3
    assert all(m.weight.grad is None for m in base.modules() if isinstance(m, FrozenFP8Linear))


def test_lora_training_lowers_the_loss_with_and_without_gradient_checkpointing(tmp_path):
    save_fp8_checkpoint(tiny_llama(0), tmp_path, layout="per_tensor")  # hidden 64: a quick run

    def run(checkpointing):
        model = fp8plug.load_fp8_base(tmp_path, device="cpu", dtype=torch.float32)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(0)  # the same adapters both times
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        ids = tokens(100, batch=2, seq=16) % TINY_VOCAB  # one batch, learned by heart
        return train(model, opt, [ids], 8, loss=hf_loss)

    plain, checkpointed = run(False), run(True)
    assert plain[-1] < 0.88 * plain[0], plain  # measured: 4.84 -> 4.04
    assert plain == checkpointed  # the recompute casts the same values


def merged_reference(directory, tied, trained):
    """The reference with the trained adapters copied in, merged in float32."""
    ref = lora(reference(directory, tied))
    ref.load_state_dict({n: p for n, p in trained.state_dict().items() if "lora_" in n}, strict=False)
    return ref.merge_and_unload().eval()


@pytest.mark.parametrize("layout", formats.LAYOUTS)
def test_merge_and_export_writes_a_checkpoint_that_reloads_to_the_merged_model(checkpoints, tmp_path, layout):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    source = checkpoints["per_tensor", False]
    model = lora(fp8plug.load_fp8_base(source, device="cpu", dtype=torch.float32), seed=5)
    ids = tokens(11)
    with torch.no_grad():
        before = model.eval()(input_ids=ids).logits
    report = fp8plug.merge_and_export(model, tmp_path / "merged", layout=layout)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)  # the in-memory model is left as it was
    assert len(report.quantized) == BASE_LINEARS and list(report.kept) == ["lm_head"]
    expected_model = merged_reference(source, False, model)
    with torch.no_grad():
        expected = expected_model(input_ids=ids).logits
        reloaded = fp8plug.load_fp8_base(tmp_path / "merged", device="cpu", dtype=torch.float32)
        assert sqnr_db(reloaded(input_ids=ids).logits, expected) >= 25
        if layout == "block":  # the per-tensor layout's config makes transformers refuse it
            served = AutoModelForCausalLM.from_pretrained(
                tmp_path / "merged", quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
            assert sqnr_db(served(input_ids=ids).logits, expected) >= 25
    # the layout checks of save_fp8_checkpoint's own tests: transformers' FP8 skeleton and vLLM's loader
    tensors = formats.read_weights(str(tmp_path / "merged"))
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    skeleton = transformers_skeleton(tmp_path / "merged", config)
    renamed = {k.replace(".weight_scale", ".weight_scale_inv") if k.endswith(".weight_scale") else k: v
               for k, v in tensors.items()}
    assert set(renamed) == set(skeleton.state_dict())
    linears = {n: (m.out_features, m.in_features) for n, m in expected_model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    assert vllm_problems(tensors, config["quantization_config"], linears) == []


def test_fp8_head_tied_head_and_a_round_trip_without_adapters(checkpoints, tmp_path):
    untied = fp8plug.load_fp8_base(checkpoints["block", False], device="cpu", fp8_head=True)
    assert isinstance(untied.lm_head, FrozenFP8Linear) and untied.lm_head.weight.dtype == torch.float8_e4m3fn
    report = fp8plug.merge_and_export(untied, tmp_path / "again", layout="per_tensor")
    assert "lm_head" in report.kept and len(report.quantized) == BASE_LINEARS
    assert formats.read_weights(str(tmp_path / "again"))["lm_head.weight"].dtype == torch.bfloat16
    tied = fp8plug.load_fp8_base(checkpoints["per_tensor", True], device="cpu", fp8_head=True)
    assert type(tied.lm_head) is torch.nn.Linear  # the head is the embedding table: it stays
    # no adapters: the per-tensor base re-saves as the very same codes and scales
    fp8plug.merge_and_export(tied, tmp_path / "same", layout="per_tensor")
    source = formats.read_weights(str(checkpoints["per_tensor", True]))
    written = formats.read_weights(str(tmp_path / "same"))
    assert set(written) == set(source)
    assert all(torch.equal(written[k].view(torch.uint8) if written[k].dtype == torch.float8_e4m3fn else written[k],
                           source[k].view(torch.uint8) if source[k].dtype == torch.float8_e4m3fn
                           else source[k].to(written[k].dtype)) for k in source)


def test_conversion_casts_and_state_dict_keep_the_fp8_layout(checkpoints):
    model = lora(fp8plug.load_fp8_base(checkpoints["per_tensor", False], device="cpu"))
    report = fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", auto_filter=False))
    assert report.kinds.get("base_model.model.lm_head") == "output head"  # kept in high precision by default
    layer = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(layer, FrozenFP8Linear)  # left as it is ("already converted")
    model.to(torch.float16)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    state = layer.state_dict()
    assert set(state) == {"weight", "weight_scale"} and state["weight"].dtype == torch.float8_e4m3fn
    plain = fp8plug.export_model(model).merge_and_unload()  # high precision, for users who want that
    assert type(plain.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_full_fine_tuning_loads_trainable_high_precision_linears(checkpoints):
    model = fp8plug.load_fp8_base(checkpoints["block", True], device="cpu", dtype=torch.float32, trainable=True)
    assert not any(isinstance(m, FrozenFP8Linear) for m in model.modules())
    q = model.model.layers[0].self_attn.q_proj
    ref = reference(checkpoints["block", True], tied=True)
    assert q.weight.requires_grad and torch.equal(q.weight, ref.model.layers[0].self_attn.q_proj.weight)


def test_bad_inputs_give_clear_errors(checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        fp8plug.load_fp8_base(tmp_path, device="cpu")
    plain = llama(True)
    plain.save_pretrained(tmp_path / "bf16")
    with pytest.raises(ValueError, match="not an FP8 checkpoint"):
        fp8plug.load_fp8_base(tmp_path / "bf16", device="cpu")
    # a checkpoint for another shape
    source = checkpoints["per_tensor", True]
    bad = tmp_path / "other"
    bad.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["intermediate_size"] = 512
    formats.write_json(str(bad / "config.json"), config)
    formats.write_weights(formats.read_weights(str(source)), str(bad), "5GB")
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight is torch.float8_e4m3fn .* expects float8_e4m3fn"):
        fp8plug.load_fp8_base(bad, device="cpu")
    # block scales of the wrong grid
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    formats.write_json(str(bad / "config.json"), config)
    with pytest.raises(ValueError, match="block scales"):
        fp8plug.load_fp8_base(bad, device="cpu")
    base = fp8plug.load_fp8_base(source, device="cpu")
    layer = base.model.layers[0].mlp.down_proj
    with pytest.raises(RuntimeError, match="trainable=True"):
        layer.weight.requires_grad_(True)
        layer(torch.randn(2, layer.in_features))
    layer.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="float8_e4m3fn codes"):
        layer.load_state_dict({"weight": torch.zeros(layer.weight.shape), "weight_scale": torch.ones(())})
    with pytest.raises(ValueError, match="no FP8 base layers"):
        fp8plug.merge_and_export(plain, tmp_path / "x")
