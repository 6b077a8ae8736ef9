"""The FP8 checkpoint layouts, checked against what their clients' loaders require.

- transformers: its own FP8 integration builds the model the checkpoint must fill
  (`replace_with_fp8_linear` with the checkpoint's `quantization_config`), and every key, dtype
  and shape is compared with it; then a real `from_pretrained` on the CPU (FineGrainedFP8Config
  with dequantize=True, what transformers does by itself without a GPU) holds the logits to
  25 dB SQNR against the exported model's, with the weights dequantized exactly as we wrote them.
- vLLM (not installed here): its fp8 loader's requirements, as read in
  vllm/model_executor/layers/quantization/fp8.py (Fp8Config.from_config, Fp8LinearMethod.
  create_weights), utils/fp8_utils.py (validate_fp8_block_shape), utils/quant_utils.py
  (is_layer_skipped) and model_executor/parameter.py (PerTensorScaleParameter's loads), are
  written out in `vllm_problems` and checked.
Both layouts, tied and untied heads, sharded with an index.
"""

import json
import math
import os

import pytest
import torch

from fp8plug.checkpoints import export_formats as formats
from fp8plug.checkpoints.export import export_model, load_fp8_checkpoint, save_fp8_checkpoint
from tests.support.numerics import sqnr_db

pytest.importorskip("transformers")

VOCAB = 256


def llama(tied=True, seed=0):
    """A 2-layer Llama whose Linears span several 128x128 tiles (q 256x256, k/v 128x256, MLP
    384x256 and 256x384), every dimension a multiple of 128 so vLLM's fused q/k/v and gate/up fit
    the block layout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


def ids(seed=0, batch=2, seq=24):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def tensors_and_config(directory):
    config = json.loads((directory / "config.json").read_text())
    return formats.read_weights(os.fspath(directory)), config


# --- block quantization itself -------------------------------------------------------------------------------
def _whole(weight):
    """quantize_per_tensor's arithmetic on the whole tensor at once (the reference for the chunked one)."""
    w = weight.float()
    scale = w.abs().max() / 448
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("chunk", [1, 64, 100_000])
def test_per_tensor_quantization_in_row_chunks_is_the_whole_tensor_s(monkeypatch, chunk):
    monkeypatch.setattr(formats, "CHUNK_ROWS", chunk)
    torch.manual_seed(0)
    weight = torch.randn(300, 200, dtype=torch.bfloat16) * torch.linspace(0.01, 3, 300, dtype=torch.bfloat16)[:, None]
    fp8, scale = formats.quantize_per_tensor(weight)
    want_fp8, want_scale = _whole(weight)
    assert torch.equal(fp8.view(torch.uint8), want_fp8.view(torch.uint8)) and torch.equal(scale, want_scale)
    blocks = formats.quantize_blocks(weight)
    real = formats.dequantize(*blocks)
    again, again_scale, sqnr = formats.requantize_per_tensor(*blocks)  # block -> per tensor, chunk by chunk
    want_fp8, want_scale = _whole(real)
    assert torch.equal(again.view(torch.uint8), want_fp8.view(torch.uint8)) and torch.equal(again_scale, want_scale)
    assert abs(sqnr - sqnr_db(formats.dequantize(again, again_scale), real)) < 0.01


def test_block_scales_are_each_tiles_amax_over_448_with_partial_tiles():
    torch.manual_seed(0)
    weight = torch.randn(200, 300) * torch.linspace(0.01, 3, 300)  # tiles of very different ranges
    fp8, scale = formats.quantize_blocks(weight)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)  # ceil(200/128), ceil(300/128)
    for r in range(2):
        for c in range(3):
            tile = weight[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
            assert torch.isclose(scale[r, c], tile.abs().max() / 448, rtol=1e-6)
            assert fp8[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128].float().abs().max() == 448
    restored = formats.dequantize(fp8, scale)
    assert sqnr_db(restored, weight) >= 28  # E4M3's 3 mantissa bits, per tile: ~31 dB
    per_tensor = formats.dequantize(*formats.quantize_per_tensor(weight))
    assert sqnr_db(restored, weight) > sqnr_db(per_tensor, weight)  # tiles follow the ranges


# --- what transformers' FP8 loader requires -------------------------------------------------------------------
def transformers_skeleton(directory, config):
    """The module tree transformers' FP8 integration builds for this checkpoint, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    entry = dict(config["quantization_config"])
    if entry.get("scale_fmt") == formats.PER_TENSOR_SCALE_FMT:  # what it would build, were it not refused
        del entry["scale_fmt"]
    quant = FineGrainedFP8Config.from_dict(entry)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    return replace_with_fp8_linear(model, modules_to_not_convert=quant.modules_to_not_convert,
                                   quantization_config=quant, pre_quantized=True)


@pytest.mark.parametrize("layout", formats.LAYOUTS)
@pytest.mark.parametrize("tied", [True, False])
def test_every_key_dtype_and_shape_is_what_transformers_builds(tmp_path, layout, tied):
    import re

    model = llama(tied)
    save_fp8_checkpoint(model, tmp_path, layout=layout, max_shard_size="200KB")
    tensors, config = tensors_and_config(tmp_path)
    quant = config["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["activation_scheme"] == "dynamic"
    assert quant["weight_block_size"] == ([128, 128] if layout == "block" else None)  # null: per-tensor there
    assert quant["modules_to_not_convert"] == quant["ignored_layers"] == ["lm_head"]
    if layout == "per_tensor":  # transformers names the per-tensor scale weight_scale_inv, so it is refused
        from transformers import FineGrainedFP8Config

        with pytest.raises(ValueError, match="transformers reads layout='block'"):
            FineGrainedFP8Config.from_dict(dict(quant))
        tensors = {re.sub(r"\.weight_scale$", ".weight_scale_inv", k): v for k, v in tensors.items()}
    skeleton = transformers_skeleton(tmp_path, config)
    expected = dict(skeleton.state_dict())
    if tied:
        del expected["lm_head.weight"]  # tied to the embeddings: stored once, as save_pretrained does
    assert set(tensors) == set(expected)
    fp8_linears = [n for n, m in skeleton.named_modules() if type(m).__name__ == "FP8Linear"]
    assert len(fp8_linears) == 14 and "lm_head" not in fp8_linears
    for key, tensor in tensors.items():
        assert tuple(tensor.shape) == tuple(expected[key].shape), key
        if key.endswith(".weight") and key[: -len(".weight")] in fp8_linears:
            assert tensor.dtype == expected[key].dtype == torch.float8_e4m3fn, key
        elif key.endswith(".weight_scale_inv"):
            assert tensor.dtype == expected[key].dtype == torch.float32, key
        else:
            assert tensor.dtype == model.state_dict()[key].dtype, key  # trained dtype kept
    for name in fp8_linears:
        module = skeleton.get_submodule(name)
        assert module.block_size == quant["weight_block_size"] and module.activation_scale is None


@pytest.mark.parametrize("layout", formats.LAYOUTS)
@pytest.mark.parametrize("tied", [True, False])
def test_transformers_from_pretrained_round_trip_on_the_cpu(tmp_path, layout, tied):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    plain = llama(tied)
    save_fp8_checkpoint(plain, tmp_path, layout=layout, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    if layout == "per_tensor":  # vLLM's and SGLang's: its config makes transformers refuse it
        with pytest.raises(ValueError, match="transformers reads layout='block'"):
            AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=FineGrainedFP8Config(dequantize=True))
        return
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    ours = load_fp8_checkpoint(tmp_path)
    for name, value in loaded.state_dict().items():
        if name in ours:  # transformers dequantized each weight exactly as fp8plug wrote it
            assert torch.equal(value, ours[name].to(value.dtype)), name
    with torch.no_grad():
        expected = plain(input_ids=ids()).logits
        got = loaded(input_ids=ids()).logits
    assert sqnr_db(got, expected) >= 25, sqnr_db(got, expected)  # E4M3 weights alone: ~30 dB


# --- what vLLM's FP8 loader requires ------------------------------------------------------------------------
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def vllm_problems(tensors, quant, linears):
    """Why vLLM's fp8 loader would refuse or misread this checkpoint, as its source says; `linears`
    maps each Linear of the model to (out_features, in_features)."""
    problems = []
    if quant.get("quant_method") != "fp8":  # Fp8Config.get_name(): selects the config class
        problems.append("quant_method is not 'fp8'")
    if quant.get("activation_scheme") not in ("static", "dynamic"):  # from_config: required, checked
        problems.append("activation_scheme missing or not static/dynamic")
    block = quant.get("weight_block_size")
    if block is not None and (len(block) != 2 or quant["activation_scheme"] != "dynamic"):
        problems.append("block quantization needs two sizes and dynamic activations")
    ignored = quant.get("ignored_layers") or []
    for fused, parts in FUSED.items():  # is_layer_skipped: all shards of a fused layer alike
        for name in linears:
            parent, _, leaf = name.rpartition(".")
            if leaf == parts[0]:
                skipped = {f"{parent}.{p}" in ignored for p in parts}
                if len(skipped) > 1:
                    problems.append(f"{parent}.{fused}: some but not all shards in ignored_layers")
                if block and not skipped.pop():  # validate_fp8_block_shape, merged weights
                    for p in parts[:-1]:
                        if linears[f"{parent}.{p}"][0] % block[0]:
                            problems.append(f"{parent}.{p}: out_features not divisible by block_n")
    for name, (out_features, in_features) in linears.items():
        weight = tensors.get(f"{name}.weight")
        if name == "lm_head" or name in ignored:  # ParallelLMHead, or UnquantizedLinearMethod
            if weight is not None and weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                problems.append(f"{name}: vLLM keeps it unquantized, the checkpoint has {weight.dtype}")
            if f"{name}.weight_scale" in tensors or f"{name}.weight_scale_inv" in tensors:
                problems.append(f"{name}: a scale for a layer vLLM does not quantize (no such parameter)")
            continue
        if weight is None or weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (out_features, in_features):
            problems.append(f"{name}.weight: not float8_e4m3fn [{out_features}, {in_features}]")
        own, other = ("weight_scale_inv", "weight_scale") if block else ("weight_scale", "weight_scale_inv")
        scale = tensors.get(f"{name}.{own}")
        if f"{name}.{other}" in tensors:
            problems.append(f"{name}.{other}: no such parameter in this layout (vLLM's loader fails on it)")
        if scale is None or scale.dtype != torch.float32:
            problems.append(f"{name}.{own}: missing or not float32")
        elif block and tuple(scale.shape) != (math.ceil(out_features / block[0]), math.ceil(in_features / block[1])):
            problems.append(f"{name}.{own}: shape {tuple(scale.shape)} is not the block grid")
        elif not block and tuple(scale.shape) not in ((), (1,)):  # PerTensorScaleParameter loads
            problems.append(f"{name}.{own}: shape {tuple(scale.shape)}, vLLM takes a scalar per tensor")
        if f"{name}.input_scale" in tensors and quant["activation_scheme"] == "dynamic":
            problems.append(f"{name}.input_scale with dynamic activations")
    return problems


@pytest.mark.parametrize("layout", formats.LAYOUTS)
@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_meets_vllms_fp8_loader(tmp_path, layout, tied):
    model = llama(tied)
    save_fp8_checkpoint(model, tmp_path, layout=layout)
    tensors, config = tensors_and_config(tmp_path)
    linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert vllm_problems(tensors, config["quantization_config"], linears) == []


def test_fused_siblings_stay_together_and_small_kv_needs_per_tensor_for_vllm(tmp_path, caplog):
    from tests.support.hf import tiny_llama  # k/v out_features 32: not a multiple of 128

    model = tiny_llama()
    report = save_fp8_checkpoint(model, tmp_path / "a", modules_to_ignore=["model.layers.0.self_attn.k_proj"],
                                 layout="per_tensor")
    for sibling in ("q_proj", "v_proj"):
        assert report.kept[f"model.layers.0.self_attn.{sibling}"].startswith("fused with")
    tensors, config = tensors_and_config(tmp_path / "a")
    linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert vllm_problems(tensors, config["quantization_config"], linears) == []
    with caplog.at_level("WARNING", logger="fp8plug"):
        save_fp8_checkpoint(model, tmp_path / "b", layout="block")
    assert "use layout='per_tensor' for vLLM" in caplog.text
    tensors, config = tensors_and_config(tmp_path / "b")
    assert any("not divisible by block_n" in p for p in vllm_problems(tensors, config["quantization_config"], linears))


# --- files ---------------------------------------------------------------------------------------------------
def test_shards_and_index_cover_every_tensor_once(tmp_path):
    model = llama(tied=False)
    report = save_fp8_checkpoint(model, tmp_path, max_shard_size="150KB")
    index = json.loads((tmp_path / formats.INDEX_NAME).read_text())
    shards = sorted(f for f in report.files if f.startswith("model-"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    from safetensors import safe_open

    seen, size = [], 0
    for shard in shards:
        with safe_open(os.fspath(tmp_path / shard), "pt") as f:
            for key in f.keys():
                seen.append(key)
                assert index["weight_map"][key] == shard
                tensor = f.get_tensor(key)
                size += tensor.numel() * tensor.element_size()
    assert sorted(seen) == sorted(index["weight_map"]) and index["metadata"]["total_size"] == size


def test_layout_is_checked(tmp_path):
    with pytest.raises(ValueError, match="layout='blocks'.*'block', 'per_tensor'"):
        save_fp8_checkpoint(llama(), tmp_path / "x", layout="blocks")
    assert not (tmp_path / "x").exists()


def test_a_converted_model_writes_what_its_export_writes(tmp_path):
    """Any engine's converted model may be written as it is: the same tensors as after export_model."""
    import fp8plug

    model = llama()
    fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native", auto_filter=False))
    save_fp8_checkpoint(model, tmp_path / "converted")
    save_fp8_checkpoint(export_model(model), tmp_path / "exported")
    converted, config_c = tensors_and_config(tmp_path / "converted")
    exported, config_e = tensors_and_config(tmp_path / "exported")
    assert config_c == config_e and set(converted) == set(exported)
    assert all(torch.equal(converted[k].view(torch.uint8) if converted[k].dtype == torch.float8_e4m3fn
                           else converted[k],
                           exported[k].view(torch.uint8) if exported[k].dtype == torch.float8_e4m3fn else exported[k])
               for k in converted)
