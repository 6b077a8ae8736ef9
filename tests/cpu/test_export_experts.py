"""MoE experts in save_fp8_checkpoint: one FP8 weight per expert and projection, under the names
transformers' save_pretrained writes (fp8plug.checkpoints.export_experts says why).

What the clients' loaders require, read in their sources (the entries below are checked against it):
- transformers 5.17 and 5.24, src/transformers/conversion_mapping.py, "mixtral" and "qwen2_moe"
  (used by qwen3_moe): WeightConverter(".experts.*.w1.weight", ".experts.*.w3.weight" ->
  ".experts.gate_up_proj", [MergeModulelist(dim=0), Concatenate(dim=1)]), ".experts.*.w2.weight"
  -> ".experts.down_proj"; Mixtral's WeightRenaming(".block_sparse_moe.", ".mlp."); qwen2_moe's
  "mlp.experts.*.gate_proj/up_proj/down_proj.weight". Checkpoint names come from
  core_model_loading.revert_weight_conversion (what save_pretrained calls).
- transformers integrations/finegrained_fp8.py FP8Experts.__init__ (_alloc_expert_proj):
  gate_up_proj float8_e4m3fn [E, 2I, H] with gate_up_proj_scale_inv float32
  [E, max(ceil(2I/bn), 2), ceil(H/bk)], down_proj [E, H, I] with [E, ceil(H/bn), ceil(I/bk)];
  `assert has_bias is False`. Per-expert [ceil(I/128), ceil(H/128)] scales merge to
  [E, 2*ceil(I/128), ceil(H/128)]: equal for the I used on the GPU (128).
  Fp8Dequantize._dequantize_one (CPU path, `dequantize=True` set by validate_environment without
  a GPU): derives the block from the scale grid, so a [ceil(I/128), ceil(H/128)] or 0-d scale.
- vLLM model_executor/layers/quantization/fp8.py Fp8MoEMethod.create_weights: block
  w13_weight_scale_inv [E, 2*ceil(I/bn), ceil(H/bk)], w2_weight_scale_inv [E, ceil(H/bn), ceil(I/bk)];
  per tensor w13_weight_scale [E, 2], w2_weight_scale [E]. fused_moe/layer.py
  _load_per_tensor_weight_scale: param[expert][0 for w1, 1 for w3] = the checkpoint's scalar;
  FusedMoE.make_expert_params_mapping("w1"/"gate_proj", "w2"/"down_proj", "w3"/"up_proj"):
  "experts.{e}.{name}." -> "experts.w13_" / "experts.w2_".
"""

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

import fp8plug  # noqa: E402
from fp8plug import FP8RecipeKwargs  # noqa: E402
from fp8plug.checkpoints import export_formats as formats  # noqa: E402
from fp8plug.checkpoints.export import export_model, load_fp8_checkpoint, save_fp8_checkpoint  # noqa: E402
from fp8plug.checkpoints.fp8_base import load_fp8_base  # noqa: E402
from tests.support.moe_models import EXPERTS, HIDDEN, builder  # noqa: E402
from tests.support.numerics import sqnr_db  # noqa: E402
from tests.support.training import hf_loss, train  # noqa: E402

# name -> (the expert-size override, checkpoint prefix of layer 0's experts, per-expert names gate, up, down)
PER_EXPERT = {
    "mixtral": ("intermediate_size", "model.layers.0.block_sparse_moe.experts", ("w1", "w3", "w2")),
    "qwen3_moe": ("moe_intermediate_size", "model.layers.0.mlp.experts", ("gate_proj", "up_proj", "down_proj")),
}
ROUTER = {"mixtral": "model.layers.0.block_sparse_moe.gate.weight", "qwen3_moe": "model.layers.0.mlp.gate.weight"}
EXPERT_FFN = 256  # two 128-row tiles per expert projection: the block grid is checked


def _build(name, **overrides):
    build = builder(name)
    if build is None:
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {name}")
    return build(**overrides)


def _ids(seed=0):
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def _trained(name, **overrides):
    """The model converted by fp8plug, trained 3 FP8 steps, exported: what a user saves."""
    model = _build(name, **overrides)
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    model.train()
    train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), [_ids(s) for s in range(3)], loss=hf_loss)
    return export_model(model).eval()


@pytest.mark.parametrize("layout", formats.LAYOUTS)
@pytest.mark.parametrize("name", list(PER_EXPERT))
def test_every_expert_entry_is_what_vllm_and_transformers_read(tmp_path, name, layout):
    size_key, prefix, (gate, up, down) = PER_EXPERT[name]
    model = _build(name, **{size_key: EXPERT_FFN})
    experts = model.model.layers[0].mlp.experts
    report = save_fp8_checkpoint(model, tmp_path, layout=layout)
    tensors = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]

    scale_name = {"block": "weight_scale_inv", "per_tensor": "weight_scale"}[layout]
    inter, hidden = EXPERT_FFN, HIDDEN
    want = {}
    for e in range(EXPERTS):
        for proj, shape in ((gate, (inter, hidden)), (up, (inter, hidden)), (down, (hidden, inter))):
            want[f"{prefix}.{e}.{proj}.weight"] = (torch.float8_e4m3fn, shape)
            grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)) if layout == "block" else ()
            want[f"{prefix}.{e}.{proj}.{scale_name}"] = (torch.float32, grid)
    got = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items() if re.search(r"\.experts[.]", k)}
    assert got == want  # every key, dtype and shape; no fused gate_up_proj/down_proj left beside them
    if layout == "block":
        assert want[f"{prefix}.0.{gate}.{scale_name}"][1] == (2, 1)  # rows 0-127 and 128-255

    # the same quantizer as the Linears (one rule): expert e's gate rows, up rows, down
    for e, proj, rows in ((1, gate, experts.gate_up_proj[1, :inter]), (2, up, experts.gate_up_proj[2, inter:]),
                          (3, down, experts.down_proj[3])):
        fp8, scale = formats.quantize(rows, layout)
        assert torch.equal(tensors[f"{prefix}.{e}.{proj}.weight"].view(torch.uint8), fp8.view(torch.uint8))
        assert torch.equal(tensors[f"{prefix}.{e}.{proj}.{scale_name}"], scale)

    # the router stays high precision, under save_pretrained's name; neither client quantizes it, so it
    # is not listed; the FP8 experts are not listed either (both clients would then skip them)
    assert tensors[ROUTER[name]].dtype == torch.float32
    assert config["modules_to_not_convert"] == config["ignored_layers"] == ["lm_head"]
    assert report.experts == ["model.layers.0.mlp.experts"] and "model.layers.0.mlp.experts" not in report.kept
    assert config["weight_block_size"] == ([128, 128] if layout == "block" else None)


def test_experts_with_partial_tiles_stay_high_precision_in_the_block_layout(tmp_path):
    # 160 rows per expert: transformers' dequantizer would take the two tiles for 2 x 80 rows
    model = _build("qwen3_moe", moe_intermediate_size=160)
    report = save_fp8_checkpoint(model, tmp_path / "block")
    why = report.kept["model.layers.0.mlp.experts"]
    assert report.experts == [] and "=160 not a multiple of 128: transformers would read" in why
    config = json.loads((tmp_path / "block" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.experts" in config["modules_to_not_convert"]
    assert load_file(tmp_path / "block" / "model.safetensors")["model.layers.0.mlp.experts.0.up_proj.weight"].dtype \
        == torch.float32
    per_tensor = save_fp8_checkpoint(model, tmp_path / "per_tensor", layout="per_tensor")  # any width there
    assert per_tensor.experts == ["model.layers.0.mlp.experts"]


def test_gpt_oss_experts_stay_high_precision_with_biases_and_are_listed(tmp_path):
    model = _build("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    report = save_fp8_checkpoint(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    fqn = "model.layers.0.mlp.experts"
    for param in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert torch.equal(tensors[f"{fqn}.{param}"], getattr(experts, param).detach())
    # listed for both clients: transformers' FP8Experts would otherwise refuse the biases (assert has_bias is False)
    assert fqn in config["modules_to_not_convert"] and fqn in config["ignored_layers"]
    assert "biases" in report.kept[fqn] and report.experts == []


def test_experts_named_in_modules_to_ignore_are_written_per_expert_in_high_precision(tmp_path):
    model = _build("mixtral")
    report = save_fp8_checkpoint(model, tmp_path, modules_to_ignore=["model.layers.0.mlp.experts"])
    tensors = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert tensors["model.layers.0.block_sparse_moe.experts.2.w3.weight"].dtype == torch.float32
    assert not [k for k in tensors if "experts" in k and "scale" in k]
    # the checkpoint's name, which transformers maps back to the module (_normalize_modules_to_not_convert)
    assert "model.layers.0.block_sparse_moe.experts" in config["ignored_layers"]
    assert report.kept["model.layers.0.mlp.experts"].endswith("named in modules_to_ignore")
    state = load_fp8_checkpoint(str(tmp_path), model=model)
    assert torch.equal(state["model.layers.0.mlp.experts.gate_up_proj"], model.model.layers[0].mlp.experts.gate_up_proj)


@pytest.mark.parametrize("layout", formats.LAYOUTS)
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_trained_model_exported_and_reloaded_gives_its_logits(tmp_path, name, layout):
    """fp8plug's loader (trainable: dequantized Linears; frozen: FP8 Linears; experts dequantized
    either way), load_fp8_checkpoint into the plain model, and transformers' own from_pretrained
    (on a CPU it dequantizes: quantizer_finegrained_fp8.validate_environment) all give the trained
    model's logits within FP8 weight error."""
    from transformers import AutoModelForCausalLM

    model = _trained(name)
    ids = _ids(7)
    with torch.no_grad():
        want = model(ids).logits
    save_fp8_checkpoint(model, tmp_path, layout=layout)
    for trainable in (True, False):
        loaded = load_fp8_base(tmp_path, device="cpu", dtype=torch.float32, trainable=trainable)
        experts = loaded.model.layers[0].mlp.experts
        assert experts.down_proj.dtype == torch.float32 and experts.down_proj.dim() == 3  # dequantized, 3-D
        with torch.no_grad():
            assert sqnr_db(loaded(ids).logits, want) >= 25, (trainable,)
    plain = _build(name, seed=1)
    plain.load_state_dict(load_fp8_checkpoint(str(tmp_path), model=plain), strict=True)
    with torch.no_grad():
        assert sqnr_db(plain.eval()(ids).logits, want) >= 25
    if layout == "per_tensor":  # vLLM's and SGLang's: its config makes transformers refuse it
        with pytest.raises(ValueError, match="transformers reads layout='block'"):
            AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        return
    served = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert sqnr_db(served(ids).logits, want) >= 25
    assert torch.equal(served.model.layers[0].mlp.experts.down_proj, plain.model.layers[0].mlp.experts.down_proj)


def test_lora_on_an_fp8_moe_base_merges_back_to_fp8_experts(tmp_path):
    """load_fp8_base (frozen: FP8 Linears, experts dequantized), PEFT LoRA, merge_and_export: the
    experts are written again one FP8 weight per expert, and the result reloads to the merged model."""
    peft = pytest.importorskip("peft")
    model = _trained("mixtral")
    save_fp8_checkpoint(model, tmp_path / "base")
    base = load_fp8_base(tmp_path / "base", device="cpu", dtype=torch.float32)
    tuned = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
        want = tuned.eval()(_ids(5)).logits
    report = fp8plug.merge_and_export(tuned, tmp_path / "merged")
    assert report.experts == ["model.layers.0.mlp.experts"]
    tensors = load_file(tmp_path / "merged" / "model.safetensors")
    assert tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"].dtype == torch.float8_e4m3fn
    assert not [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]
    with torch.no_grad():
        reloaded = load_fp8_base(tmp_path / "merged", device="cpu", dtype=torch.float32)
        assert sqnr_db(reloaded(_ids(5)).logits, want) >= 25
