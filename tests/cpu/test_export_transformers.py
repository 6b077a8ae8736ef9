"""Every FP8 checkpoint fp8plug writes is read right by transformers' own `from_pretrained`, or
refused with a message: both layouts at hidden widths 192 and 320 (not multiples of 128, as in
small models), 960 (SmolLM2-360M's) and 4096, loaded dequantized on the CPU (what transformers
does without FP8 GEMMs), logits compared with the high-precision model's and with fp8plug's own
reading of the same file. Runs on whichever transformers is installed: CI runs it on the newest
and on setup.cfg's floor."""

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, LlamaConfig, LlamaForCausalLM

import fp8plug
from fp8plug.checkpoints import export_formats as formats
from fp8plug.checkpoints.export import load_fp8_checkpoint, save_fp8_checkpoint
from tests.support.numerics import sqnr_db
from tests.support.threads import one_thread  # noqa: F401 - autouse: one torch thread

# hidden width -> intermediate width (multiples of 128 but for 960's, SmolLM2-360M's 2560)
WIDTHS = {192: 384, 320: 640, 960: 2560, 4096: 256}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def llama(hidden, seed=0):
    """One decoder layer of width `hidden`; two heads of 64 so that only the hidden and the MLP
    widths are under test (q/o are 128 wide, k/v 64)."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=WIDTHS[hidden], num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=128,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # tiles of different ranges, as trained weights have: a tile misread shows
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight[128:] *= 8.0
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def read_by_fp8plug(model, directory):
    """The model with the checkpoint's weights dequantized by fp8plug (fp8 x scale): what vLLM and
    SGLang compute with, up to their GEMMs' rounding."""
    again = llama(model.config.hidden_size, seed=1)
    again.load_state_dict(load_fp8_checkpoint(directory), strict=True)
    return again


@pytest.mark.parametrize("hidden", list(WIDTHS))
def test_block_layout_is_read_right_by_transformers(hidden, tmp_path):
    model = llama(hidden)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = logits(model, ids)
    report = save_fp8_checkpoint(model, tmp_path / "ckpt")
    layer = "model.layers.0."
    wide = [p for p in PROJECTIONS if formats.block_width_problem(*model.get_submodule(layer + p).weight.shape)]
    # a Linear whose width above 128 is not a multiple of 128 stays in high precision, with the reason
    assert (hidden % 128 != 0) == bool(wide)
    for projection in wide:
        assert "not a multiple of 128: transformers would read" in report.kept[layer + projection]
    assert sorted(report.quantized) == sorted(layer + p for p in PROJECTIONS if p not in wide)
    with open(tmp_path / "ckpt" / "config.json") as f:
        assert set(json.load(f)["quantization_config"]["modules_to_not_convert"]) >= {layer + p for p in wide}

    loaded, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", quantization_config=FineGrainedFP8Config(dequantize=True), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    served = logits(loaded, ids)
    # transformers reads exactly what fp8plug wrote (fp8 x the right tile's scale) ...
    assert sqnr_db(served, logits(read_by_fp8plug(model, tmp_path / "ckpt"), ids)) > 60
    # ... which is the model up to FP8's rounding of the stored weights (about 31 dB each; the
    # logits of seven such GEMMs in a row measure 21-27 dB here)
    assert sqnr_db(served, reference) > 20
    if not report.quantized:
        return
    for projection in report.quantized:  # each stored weight at E4M3's SQNR, not a misplaced scale's
        name = projection[len("model."):]
        weight = dict(model.model.named_parameters())[name + ".weight"]
        assert sqnr_db(dict(loaded.model.named_parameters())[name + ".weight"].detach(), weight.detach()) > 28


@pytest.mark.parametrize("hidden", list(WIDTHS))
def test_per_tensor_layout_is_refused_by_transformers_and_read_by_fp8plug(hidden, tmp_path):
    model = llama(hidden)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    report = save_fp8_checkpoint(model, tmp_path / "ckpt", layout="per_tensor")
    assert len(report.quantized) == len(PROJECTIONS)  # any width, for vLLM and SGLang
    # transformers names the per-tensor scale weight_scale_inv: it would run with new scales, so
    # the config makes it refuse, with the reason
    dequantize = FineGrainedFP8Config(dequantize=True)
    with pytest.raises(ValueError, match="transformers reads layout='block'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", quantization_config=dequantize)
    with pytest.raises(ValueError, match="transformers reads layout='block'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    # the stored weights and scales are right: the logits vLLM and SGLang compute from them
    assert sqnr_db(logits(read_by_fp8plug(model, tmp_path / "ckpt"), ids), logits(model, ids)) > 20


def test_a_merged_fp8_base_is_read_right_by_transformers(tmp_path, caplog):
    # merge_and_export writes the block layout by the same rule: a 192-wide base loaded from a
    # per-tensor checkpoint (every Linear in FP8), merged, keeps its wide Linears in high precision
    model = llama(192)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    save_fp8_checkpoint(model, tmp_path / "base", layout="per_tensor")
    base = fp8plug.load_fp8_base(tmp_path / "base", device="cpu", dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        report = fp8plug.merge_and_export(base, tmp_path / "merged")
    wide = {f"model.layers.0.{p}" for p in PROJECTIONS if p != "self_attn.k_proj" and p != "self_attn.v_proj"}
    assert wide <= set(report.kept) and "not a multiple of 128" in report.kept["model.layers.0.mlp.gate_proj"]
    loaded, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", quantization_config=FineGrainedFP8Config(dequantize=True), output_loading_info=True)
    assert not any(info.values()), info
    plain = llama(192, seed=1)
    plain.load_state_dict(load_fp8_checkpoint(tmp_path / "merged"), strict=True)
    assert sqnr_db(logits(loaded, ids), logits(plain, ids)) > 60
    assert sqnr_db(logits(loaded, ids), logits(model, ids)) > 20
