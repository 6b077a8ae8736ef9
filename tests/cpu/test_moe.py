"""Mixture-of-experts models in FP8 (docs/moe.md): a transformers MoE block's experts run their
grouped GEMMs through the engine's grouped FP8 GEMM (fp8plug.hf.experts, native's
backends/native/grouped.py), checked against a float reference, on every architecture docs/moe.md
lists, built from a tiny config (tests/support/moe_models.py)."""

import copy

import pytest
import torch

import fp8plug
from fp8plug import FP8RecipeKwargs
from fp8plug.backends import get_backend
from fp8plug.backends.native import dense_experts, grouped
from fp8plug.hf.experts import FP8PLUG_EXPERTS, experts_modules
from fp8plug.layers.gemm_counts import EXPERT_COUNTS, settle_all
from tests.support.hf import fresh
from tests.support.moe_models import ARCHITECTURES, EXPERTS, VOCAB, builder
from tests.support.numerics import sqnr_db

GROUP_SIZES = [5, 0, 17, 10, 32]  # unaligned, an empty expert, an aligned one


def _offsets(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def _per_expert(x, w, sizes, fn):
    """fn(x rows of expert e, w[e]) for each expert, concatenated: the loop the grouped GEMM replaces."""
    out, start = [], 0
    for e, size in enumerate(sizes):
        out.append(fn(x[start:start + size], w[e]))
        start += size
    return torch.cat(out)


def _quantized(t):
    """`t` through e4m3 with one scale per row, back in float32: what the GEMM multiplies."""
    data, inverse = grouped.rowwise(t)
    return data.float() * inverse[..., None]


def _build(name, **overrides):
    build = builder(name)
    if build is None:
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {ARCHITECTURES[name][1]}")
    model = build(**overrides)
    if not list(experts_modules(model)):
        pytest.skip(f"transformers {__import__('transformers').__version__} runs {ARCHITECTURES[name][1]}'s experts "
                    "outside its experts registry (@use_experts_implementation)")
    return model


def _batch(seed=1, tokens=24):
    return torch.randint(0, VOCAB, (2, tokens), generator=torch.Generator().manual_seed(seed))


# --- the grouped GEMM ------------------------------------------------------------------------------------


def test_layout_pads_each_group_to_16_rows_without_moving_their_order():
    layout = grouped.group_layout(_offsets(GROUP_SIZES), sum(GROUP_SIZES))
    assert layout.offs.dtype == torch.int32 and layout.offs.tolist() == [16, 32, 64, 80, 112]
    assert layout.padded_rows % 16 == 0 and layout.padded_rows >= int(layout.offs[-1])
    assert layout.rows.tolist() == list(range(5)) + list(range(32, 49)) + list(range(64, 74)) + list(range(80, 112))


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_gemm_emulation_is_exact_against_dequantized_float_reference(transposed):
    torch.manual_seed(0)
    k, n = 32, 48
    x = torch.randn(sum(GROUP_SIZES), k)
    w = torch.randn(len(GROUP_SIZES), n, k)
    stored = w.transpose(-2, -1).contiguous() if transposed else w
    out = grouped.grouped_fp8_linear(x, stored, _offsets(GROUP_SIZES), transposed=transposed)
    # the same quantization, then float32 GEMMs one expert at a time
    reference = _per_expert(_quantized(x), _quantized(w), GROUP_SIZES, lambda a, b: a @ b.t())
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-5)
    assert sqnr_db(out, _per_expert(x, w, GROUP_SIZES, lambda a, b: a @ b.t())) > 25


def test_grouped_gemm_gradients_in_fp8_against_float():
    torch.manual_seed(0)
    k, n = 32, 48
    x = torch.randn(sum(GROUP_SIZES), k, requires_grad=True)
    w = torch.randn(len(GROUP_SIZES), n, k, requires_grad=True)
    grad = torch.randn(sum(GROUP_SIZES), n)
    out = grouped.grouped_fp8_linear(x, w, _offsets(GROUP_SIZES))
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    ref = _per_expert(x, w, GROUP_SIZES, lambda a, b: a @ b.t())
    rx, rw = torch.autograd.grad(ref, (x, w), grad)
    assert sqnr_db(gx, rx) > 25 and sqnr_db(gw, rw) > 25
    assert gw[1].abs().sum() == 0  # the expert no token reached gets no gradient
    # the input gradient is exactly the FP8 GEMM of the quantized operands (the gradient rowwise over
    # N, the weight one scale an expert, the largest of its forward row scales)
    expert_inv = grouped.expert_inverse_scales(grouped.rowwise(w.detach())[1])
    w_kn, w_kn_inv = grouped.per_expert_transposed(w.detach(), expert_inv)
    exact = _per_expert(_quantized(grad), w_kn.float() * w_kn_inv[..., None], GROUP_SIZES, lambda a, b: a @ b.t())
    torch.testing.assert_close(gx, exact, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_a_converted_weight_gradient_made_in_pieces_equals_the_whole_one(monkeypatch, transposed):
    """bf16 activations and float32 master weights (the Accelerate user's setting): the weight
    gradient is computed in pieces of output rows, each converted to float32 as it comes (the
    step's peak memory); bit for bit the gradient of one piece, and in the weight's layout."""
    torch.manual_seed(0)
    k, n = 32, 80
    x = torch.randn(sum(GROUP_SIZES), k).to(torch.bfloat16)
    w = torch.randn(len(GROUP_SIZES), n, k)
    stored = (w.transpose(-2, -1).contiguous() if transposed else w).requires_grad_()
    grad = torch.randn(sum(GROUP_SIZES), n).to(torch.bfloat16)

    def weight_gradient(piece_bytes):
        monkeypatch.setattr(grouped, "WEIGHT_GRADIENT_PIECE_BYTES", piece_bytes)
        out = grouped.grouped_fp8_linear(x, stored, _offsets(GROUP_SIZES), transposed=transposed)
        return torch.autograd.grad(out, stored, grad)[0]

    whole = weight_gradient(2**40)
    pieces = weight_gradient(len(GROUP_SIZES) * k * 2 * 32)  # 32 rows a piece: 80 rows in three pieces
    assert whole.dtype == pieces.dtype == torch.float32 and pieces.shape == stored.shape
    assert torch.equal(pieces, whole)
    reference = torch.autograd.grad(_per_expert(x.float(), w.requires_grad_(), GROUP_SIZES, lambda a, b: a @ b.t()),
                                    w, grad.float())[0]
    assert sqnr_db(pieces, reference.transpose(-2, -1) if transposed else reference) > 25


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_the_gemms_as_dense_gemms_per_expert_equal_the_grouped_ones(monkeypatch, weight_dtype):
    """With DENSE_GEMMS_MAX_EXPERTS at or above the experts, each GEMM is one dense FP8 GEMM per
    expert (groups' bounds read from the layout), the weight gradient whole or in pieces (float32
    weights): the same output and gradients as the grouped kernel's, emulated here."""
    torch.manual_seed(1)
    k, n = 32, 48
    x = torch.randn(sum(GROUP_SIZES), k).to(torch.bfloat16)
    w = torch.randn(len(GROUP_SIZES), n, k).to(weight_dtype).requires_grad_()
    grad = torch.randn(sum(GROUP_SIZES), n).to(torch.bfloat16)
    monkeypatch.setattr(grouped, "WEIGHT_GRADIENT_PIECE_BYTES", len(GROUP_SIZES) * k * 2 * 16)  # 16 rows a piece

    def output_and_gradients(max_experts):
        monkeypatch.setattr(dense_experts, "DENSE_GEMMS_MAX_EXPERTS", max_experts)
        xs = x.clone().requires_grad_()
        out = grouped.grouped_fp8_linear(xs, w, _offsets(GROUP_SIZES))
        return (out, *torch.autograd.grad(out, (xs, w), grad))

    dense, grouped_result = output_and_gradients(len(GROUP_SIZES)), output_and_gradients(0)
    assert dense[2].dtype == weight_dtype
    for a, b in zip(dense, grouped_result):
        assert torch.equal(a, b) and a.abs().sum() > 0


@pytest.mark.parametrize("max_experts", [0, len(GROUP_SIZES)])  # grouped; dense, written in place
@pytest.mark.parametrize("transposed", [False, True])
def test_the_output_gradients_fp8_operand_is_made_in_pieces_with_bf16_weights_too(monkeypatch, max_experts,
                                                                                 transposed):
    """Past WEIGHT_GRADIENT_OPERAND_PIECE_BYTES the weight gradient of unconverted (bf16) weights is
    made in pieces too, each piece's FP8 operand cast from its own columns: bit for bit one piece."""
    torch.manual_seed(2)
    k, n = 32, 80
    x = torch.randn(sum(GROUP_SIZES), k).to(torch.bfloat16)
    w = torch.randn(len(GROUP_SIZES), n, k).to(torch.bfloat16)
    stored = (w.transpose(-2, -1).contiguous() if transposed else w).requires_grad_()
    grad = torch.randn(sum(GROUP_SIZES), n).to(torch.bfloat16)
    monkeypatch.setattr(dense_experts, "DENSE_GEMMS_MAX_EXPERTS", max_experts)
    casts = []
    cast = grouped.cast_weight_grad_operand
    monkeypatch.setattr(grouped, "cast_weight_grad_operand", lambda t, layout: casts.append(t.shape) or cast(t, layout))

    def weight_gradient(operand_bytes):
        monkeypatch.setattr(grouped, "WEIGHT_GRADIENT_OPERAND_PIECE_BYTES", operand_bytes)
        casts.clear()
        out = grouped.grouped_fp8_linear(x, stored, _offsets(GROUP_SIZES), transposed=transposed)
        return torch.autograd.grad(out, stored, grad)[0]

    whole = weight_gradient(2**40)
    assert casts == [(sum(GROUP_SIZES), k), (sum(GROUP_SIZES), n)]
    padded_rows = grouped.group_layout(_offsets(GROUP_SIZES), sum(GROUP_SIZES)).padded_rows
    pieces = weight_gradient(padded_rows * 32)  # 32 rows of the operand a piece: 80 rows in three pieces
    assert casts[1:] == [(sum(GROUP_SIZES), 32), (sum(GROUP_SIZES), 32), (sum(GROUP_SIZES), 16)]
    assert pieces.dtype == torch.bfloat16 and pieces.shape == stored.shape and pieces.abs().sum() > 0
    assert torch.equal(pieces, whole)


@pytest.mark.parametrize("experts, dense_calls", [(8, 3), (9, 0)])
def test_few_experts_run_dense_gemms_and_many_the_grouped_kernel(monkeypatch, experts, dense_calls):
    """Up to DENSE_GEMMS_MAX_EXPERTS (8) experts, each of the three GEMMs runs dense per expert;
    with more (Qwen3-MoE's 128, GPT-OSS's 32), each runs as one grouped GEMM."""
    calls = {"dense": 0, "grouped": 0}

    def counted(kind, function):
        def run(*args, **kwargs):
            calls[kind] += 1
            return function(*args, **kwargs)
        return run

    monkeypatch.setattr(grouped, "dense_grouped_mm", counted("dense", grouped.dense_grouped_mm))
    monkeypatch.setattr(grouped, "scaled_grouped_mm", counted("grouped", grouped.scaled_grouped_mm))
    sizes = [3] * experts
    x = torch.randn(sum(sizes), 32, requires_grad=True)
    w = torch.randn(experts, 16, 32, requires_grad=True)
    torch.autograd.grad(grouped.grouped_fp8_linear(x, w, _offsets(sizes)).sum(), (x, w))
    assert calls == {"dense": dense_calls, "grouped": 3 - dense_calls}


def test_a_non_finite_input_row_stays_visible():
    x = torch.randn(sum(GROUP_SIZES), 32)
    x[3, 0] = float("inf")
    out = grouped.grouped_fp8_linear(x, torch.randn(len(GROUP_SIZES), 16, 32), _offsets(GROUP_SIZES))
    assert not torch.isfinite(out[3]).any() and torch.isfinite(out[4:]).all()


# --- every architecture ------------------------------------------------------------------------------------


def _loss(model, ids):
    logits = model(ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_experts_run_fp8_close_to_float(name):
    model = _build(name)
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    before = model.config._experts_implementation
    report = fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    fqns = [fqn for fqn, _ in experts_modules(model)]
    assert fqns and report.experts == fqns and set(fqns) <= set(report.converted)
    assert model.config._experts_implementation == FP8PLUG_EXPERTS
    assert list(model.state_dict()) == keys
    ids = _batch()
    model.train(), reference.train()
    loss, ref_loss = _loss(model, ids), _loss(reference, ids)
    coverage = fp8plug.fp8_coverage(model)["layers"]
    assert all(coverage[fqn] == (2, 0) for fqn in fqns)  # both projections, in FP8
    assert sqnr_db(model(ids).logits, reference(ids).logits) > 18
    loss.backward(), ref_loss.backward()
    for fqn in fqns:
        got, want = model.get_submodule(fqn), reference.get_submodule(fqn)
        for param in ("down_proj", "gate_up_proj" if hasattr(want, "gate_up_proj") else "up_proj"):
            # FP8 Linears around the experts, and a top-k choice flipped by them, count here too
            assert sqnr_db(getattr(got, param).grad, getattr(want, param).grad) > 10, (fqn, param)
    fp8plug.unconvert_model(model)
    assert model.config._experts_implementation == before
    assert not any(name.endswith("expert_gemm_counts") for name, _ in model.named_buffers())


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_a_few_fp8_steps_lower_the_loss(name):
    model = _build(name)
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, losses = _batch(), []
    model.train()
    for _ in range(6):
        loss = _loss(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert fp8plug.fp8_coverage(model)["layers"]["model.layers.0.mlp.experts"] == (12, 0)


def test_accelerator_with_recipe_kwargs_converts_the_experts():
    fresh()
    model = _build("qwen3_moe")
    accelerator = fp8plug.Accelerator(cpu=True, mixed_precision="fp8",
                                      kwargs_handlers=[FP8RecipeKwargs(backend="native")])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    assert inner.config._experts_implementation == FP8PLUG_EXPERTS
    loss = _loss(model, _batch())
    accelerator.backward(loss)
    optimizer.step()
    assert fp8plug.fp8_coverage(inner)["layers"]["model.layers.0.mlp.experts"] == (2, 0)
    fresh()


def test_the_report_names_the_experts_scaling_whatever_the_recipe_asks_of_linears():
    model = _build("mixtral")
    report = fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", scaling="delayed"))
    assert report.notes["model.layers.0.mlp.experts"] == "dynamic rowwise scaling"
    assert ("1 of 1 MoE experts modules run their grouped GEMMs in FP8 (dynamic rowwise scaling; router and "
            "routing weights in high precision)") in report.summary()
    assert "converted model.layers.0.mlp.experts: dynamic rowwise scaling" in str(report)


def test_eval_runs_the_implementation_the_model_had():
    model = _build("mixtral")
    reference = copy.deepcopy(model).eval()
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    model.eval()
    torch.manual_seed(0)
    x, idx, w = torch.randn(8, 64), torch.randint(0, EXPERTS, (8, 2)), torch.rand(8, 2)
    with torch.no_grad():
        got = model.get_submodule("model.layers.0.mlp.experts")(x, idx, w)
        assert torch.equal(got, reference.get_submodule("model.layers.0.mlp.experts")(x, idx, w))
        model(_batch())
    assert fp8plug.fp8_coverage(model)["layers"]["model.layers.0.mlp.experts"] == (0, 0)  # eval is not counted


def test_modules_to_ignore_names_an_experts_module():
    model = _build("olmoe")
    report = fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native",
                                                                 modules_to_ignore=["model.layers.0.mlp.experts"]))
    assert report.skipped["model.layers.0.mlp.experts"] == "listed in modules_to_ignore"
    assert "0 of 1 MoE experts modules" in report.summary()
    model.train()
    _loss(model, _batch()).backward()
    assert fp8plug.fp8_coverage(model)["layers"].get("model.layers.0.mlp.experts") is None


def test_unaligned_expert_shapes_stay_high_precision_with_the_reason():
    model = _build("mixtral", intermediate_size=24)
    report = fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    reason = report.skipped["model.layers.0.mlp.experts"]
    assert "not divisible by 16" in reason and "down 64x24" in reason
    assert model.config._experts_implementation == "grouped_mm"


def test_engines_without_a_grouped_gemm_say_why():
    model = _build("mixtral")
    report = fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="ao"))
    assert "torchao" in report.skipped["model.layers.0.mlp.experts"]
    assert model.config._experts_implementation == "grouped_mm"
    from fp8plug.backends.te.engine import TEEngine

    assert "GroupedLinear" in TEEngine().grouped_gemm()
    assert get_backend("msamp").grouped_gemm() == "the msamp engine has no grouped FP8 GEMM"  # the default
    assert callable(get_backend("native").grouped_gemm(None, None))


# --- what holds for Linears holds for experts ---------------------------------------------------------------


def test_frozen_experts_under_peft_lora_skip_the_weight_gradient_gemms(monkeypatch):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_build("mixtral"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    calls = []
    original = grouped.groupwise_columns
    monkeypatch.setattr(grouped, "groupwise_columns", lambda *a: calls.append(1) or original(*a))
    model.train()
    _loss(model, _batch()).backward()
    experts = model.get_submodule("base_model.model.model.layers.0.mlp.experts")
    assert experts.gate_up_proj.grad is None and calls == []  # no weight-gradient GEMM, no cast for it
    assert fp8plug.fp8_coverage(model)["layers"]["base_model.model.model.layers.0.mlp.experts"] == (2, 0)
    lora = [p for n, p in model.named_parameters() if "lora_B" in n]  # lora_A's gradient is zero at the start
    assert lora and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


def test_activation_checkpointing_recomputes_the_same_fp8_experts():
    model = _build("qwen2_moe")
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", scaling="dynamic"))
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable()
    model.train(), checkpointed.train()
    ids = _batch()
    _loss(model, ids).backward()
    _loss(checkpointed, ids).backward()
    for (name, param), other in zip(model.named_parameters(), checkpointed.parameters()):
        if "experts" in name:  # dynamic rowwise scales: the recomputed forward is the same, bit for bit
            assert torch.equal(param.grad, other.grad), name
    assert fp8plug.fp8_coverage(checkpointed)["layers"]["model.layers.0.mlp.experts"] == (2, 0)


def test_experts_keep_no_fp8_state_so_a_reloaded_model_runs_identically():
    model = _build("deepseek_v3")
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    state = get_backend("native").fp8_state(model)
    assert state and not any(fqn.endswith("mlp.experts") for fqn in state)  # the shared experts' Linears have some
    again = _build("deepseek_v3", seed=3)
    fp8plug.convert_model(again, recipe=FP8RecipeKwargs(backend="native"))
    again.load_state_dict(model.state_dict())
    model.train(), again.train()
    ids = _batch()
    x, idx, w = torch.randn(8, 64), torch.randint(0, EXPERTS, (8, 2)), torch.rand(8, 2)
    fqn = "model.layers.0.mlp.experts"
    assert torch.equal(model.get_submodule(fqn)(x, idx, w), again.get_submodule(fqn)(x, idx, w))
    assert list(again.state_dict()) == list(model.state_dict()) and again(ids).logits.shape == (2, 24, VOCAB)


def test_export_model_puts_the_implementation_back_and_leaves_nothing_of_fp8plug():
    model = _build("glm4_moe")
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    fp8plug.export_model(model)
    experts = model.get_submodule("model.layers.0.mlp.experts")
    assert model.config._experts_implementation == "grouped_mm"
    assert not [name for name in vars(experts) if "fp8plug" in name]
    assert not [name for name, _ in model.named_buffers() if "fp8plug" in name]


def test_a_nan_input_row_stays_nan():
    x = torch.randn(sum(GROUP_SIZES), 32)
    x[40, 5] = float("nan")
    out = grouped.grouped_fp8_linear(x, torch.randn(len(GROUP_SIZES), 16, 32), _offsets(GROUP_SIZES))
    assert torch.isnan(out[40]).all() and torch.isfinite(out[:40]).all()


def test_a_converted_moe_model_pickles_and_still_runs_its_experts(tmp_path):
    model = _build("mixtral")
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    torch.save(model, tmp_path / "model.pt")
    again = torch.load(tmp_path / "model.pt", weights_only=False)
    again.train()
    _loss(again, _batch()).backward()
    assert fp8plug.fp8_coverage(again)["layers"]["model.layers.0.mlp.experts"] == (2, 0)


def test_the_speed_filter_keeps_experts_too_small_to_gain_in_bf16():
    from fp8plug.tuning.roofline import make_module_filter

    small = _build("mixtral")  # 4 experts of 64 x 32: no FP8 GEMM can gain there
    report = fp8plug.convert_model(small, recipe=FP8RecipeKwargs(
        backend="native", module_filter_fn=make_module_filter("native", tokens=8192, min_speedup=0.85)))
    reason = report.skipped["model.layers.0.mlp.experts"]
    assert "FP8 predicted" in reason and "4096 tokens per expert" in reason and "top-2 of 4 experts" in reason
    assert small.config._experts_implementation == "grouped_mm"
    # Mixtral's shapes (hidden 4096, expert ffn 14336, 8 experts top-2) are predicted to gain
    from fp8plug.hf.experts import speed_problem

    with torch.device("meta"):
        large = _build("mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128)
    experts = large.get_submodule("model.layers.0.mlp.experts")
    assert speed_problem(experts, make_module_filter("native", tokens=8192, min_speedup=0.85)) is None


def test_save_fp8_checkpoint_writes_the_experts_in_fp8_one_weight_per_expert(tmp_path):
    import json

    from fp8plug.checkpoints.export import load_fp8_checkpoint, save_fp8_checkpoint

    model = _build("qwen3_moe")
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    report = save_fp8_checkpoint(model, str(tmp_path / "ckpt"))
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.experts" not in config["modules_to_not_convert"]
    assert report.experts == ["model.layers.0.mlp.experts"] and "model.layers.0.self_attn.q_proj" in report.quantized
    state = load_fp8_checkpoint(str(tmp_path / "ckpt"), model=model)  # tests/cpu/test_export_experts.py: the layout
    down = model.model.layers[0].mlp.experts.down_proj
    assert sqnr_db(state["model.layers.0.mlp.experts.down_proj"], down) > 25


def _converted_on_meta_then_materialised():
    """A Mixtral built on meta and converted there (FSDP2's meta initialisation), then given memory
    (to_empty) and the weights of one built on the CPU."""
    reference = _build("mixtral")
    with torch.device("meta"):
        model = _build("mixtral")
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    return model


def test_expert_counts_made_on_meta_start_from_zero_once_given_memory():
    """Such a model counts its experts' GEMMs from zero, whatever memory to_empty handed the counts."""
    model = _converted_on_meta_then_materialised()
    for _, module in experts_modules(model):
        module._buffers[EXPERT_COUNTS].fill_(123456789)  # what to_empty's memory may hold
    model.train()
    model(_batch())
    coverage = fp8plug.fp8_coverage(model)
    experts = [fqn for fqn, _ in experts_modules(model)]
    assert experts and all(coverage["layers"][fqn] == (2, 0) for fqn in experts), coverage["layers"]


@pytest.mark.parametrize("settled", [True, False])
def test_counts_settled_before_compiling_cost_no_recompile(settled):
    """Counts made on meta are settled outside the compiled forward (prepare() and fp8_coverage
    do it): settling inside flips a flag dynamo guards on, and the model recompiled at its second
    step."""
    model = _converted_on_meta_then_materialised()
    if settled:
        settle_all(model)
    model.train()
    compiled = torch.compile(model, backend="eager")
    compiled(_batch())
    with torch._dynamo.config.patch(error_on_recompile=True):
        if settled:
            compiled(_batch(seed=2))
        else:  # the check has teeth: settled inside, the flag's guard fails at the next call
            with pytest.raises(torch._dynamo.exc.RecompileError):
                compiled(_batch(seed=2))
