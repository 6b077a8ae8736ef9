"""Finer scaling in the native engine (fp8plug.backends.native.granular): rowwise,
rowwise_with_gw_hp and blockwise, their CPU emulation held exactly to a float reference written
here tile by tile, their accuracy against fp32, the recipe words across engines, the per-layer
field, the checkpoint record and rescale_layer."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs, convert_model, fp8_coverage, get_backend
from fp8plug.backends import select_backend
from fp8plug.backends.base import offers
from fp8plug.backends.native import granular
from fp8plug.backends.native.engine import NativeFP8Linear
from fp8plug.checkpoints.state import FP8CheckpointState, recipe_record
from fp8plug.recipe.layer_scaling import first_last_bf16
from fp8plug.recipe.plans import make_plan
from tests.support.numerics import sqnr_db
from tests.support.training import hf_loss, train

E4M3 = torch.float8_e4m3fn
WORDS = granular.GRANULAR


# --- a reference written tile by tile -------------------------------------------------------------------


def reference_dequant(t, tile_rows, tile_cols, power_of_two):
    """t [R, C] quantised to E4M3 tile by tile (tiles tile_rows x tile_cols, partial at the edges)
    with scale 448 / amax, and read back in float32: the loop a reader can check by eye."""
    t = t.float()
    out = torch.empty_like(t)
    for r0 in range(0, t.shape[0], tile_rows):
        for c0 in range(0, t.shape[1], tile_cols):
            tile = t[r0:r0 + tile_rows, c0:c0 + tile_cols]
            amax = tile.abs().max()
            scale = 448.0 / amax if amax > 0 else torch.tensor(1.0)  # as per-tensor scaling computes it
            if power_of_two:
                scale = 2.0 ** torch.floor(torch.log2(scale))
            q = (tile * scale).clamp(-448, 448).to(E4M3).float()
            out[r0:r0 + tile_rows, c0:c0 + tile_cols] = q * scale.reciprocal()  # the GEMM takes 1 / scale
    return out


TILES = {granular.ROW: lambda r, c: (1, c), granular.TENSOR: lambda r, c: (r, c),
         granular.TILE: lambda r, c: (1, 128), granular.SQUARE: lambda r, c: (128, 128)}


def ref(t, kind, word):
    return reference_dequant(t, *TILES[kind](*t.shape), granular.POWER_OF_TWO[word])


@pytest.mark.parametrize("kind", [granular.ROW, granular.TILE, granular.SQUARE, granular.TENSOR])
@pytest.mark.parametrize("shape", [(50, 200), (130, 257), (16, 128)])
def test_cast_matches_the_tile_by_tile_reference_exactly(kind, shape):
    torch.manual_seed(0)
    t = torch.randn(*shape) * torch.logspace(-3, 3, shape[1])  # values over six decades
    for pow2 in (True, False):
        q, inv = granular.cast_tiles(t, kind, pow2)
        assert q.dtype == E4M3 and q.shape == t.shape
        expected = reference_dequant(t, *TILES[kind](*shape), pow2)
        assert torch.equal(granular.dequantize(q, inv, kind), expected)


@pytest.mark.parametrize("word", WORDS)
def test_all_three_gemms_equal_the_float_reference_exactly(word):
    """forward, input gradient and weight gradient of the emulated layer are the float32 GEMMs of
    the reference's dequantised operands (odd token count and partial 128-blocks included)."""
    torch.manual_seed(1)
    m, k, n = 50, 200, 136
    x = torch.randn(m, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    g = torch.randn(m, n)
    out = granular.granular_linear(x, w, word, torch.float32)
    out.backward(g)
    (fa, fb), (da, db), wgrad = granular.GEMMS[word]
    assert torch.allclose(out, ref(x.detach(), fa, word) @ ref(w.detach(), fb, word).t(), rtol=1e-6, atol=1e-5)
    expect_dx = ref(g, da, word) @ ref(w.detach().t(), db, word).t()
    assert torch.allclose(x.grad, expect_dx, rtol=1e-6, atol=1e-5)
    if wgrad is None:  # rowwise_with_gw_hp: the weight gradient in high precision
        expect_dw = g.t() @ x.detach()
    else:
        expect_dw = ref(g.t(), wgrad[0], word) @ ref(x.detach().t(), wgrad[1], word).t()
    assert torch.allclose(w.grad, expect_dw, rtol=1e-6, atol=1e-4)


def _fp8_vs_fp32(scaling, x, w, g):
    layer = NativeFP8Linear(w.shape[1], w.shape[0], bias=False, scaling=scaling)
    with torch.no_grad():
        layer.weight.copy_(w)
    xr = x.clone().requires_grad_()
    out = layer(xr)
    out.backward(g)
    x32, w32 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_out = x32 @ w32.t()
    ref_out.backward(g)
    return sqnr_db(out, ref_out), sqnr_db(xr.grad, x32.grad), sqnr_db(layer.weight.grad, w32.grad)


@pytest.mark.parametrize("word", WORDS)
def test_fp8_linear_against_fp32(word):
    torch.manual_seed(2)
    x, w, g = torch.randn(96, 256), torch.randn(128, 256) * 0.05, torch.randn(96, 128)
    fwd, dgrad, wgrad = _fp8_vs_fp32(word, x, w, g)
    assert fwd > 25 and dgrad > 25 and wgrad > 25, (fwd, dgrad, wgrad)
    if word == "rowwise_with_gw_hp":
        assert wgrad > 60  # the weight gradient is not quantised at all


def test_rowwise_beats_per_tensor_on_outlier_rows_and_blockwise_beats_both_on_outlier_tiles():
    torch.manual_seed(3)
    x = torch.randn(64, 512)
    x[::16] *= 1e4  # a few rows 10^4 x the rest: the others fall towards E4M3's subnormals under one scale
    normal = torch.ones(64, dtype=torch.bool)
    normal[::16] = False
    per_tensor = sqnr_db(granular.dequantize(*granular.cast_tiles(x, granular.TENSOR, False), granular.TENSOR)[normal],
                         x[normal])
    rowwise = sqnr_db(granular.dequantize(*granular.cast_tiles(x, granular.ROW, True), granular.ROW)[normal], x[normal])
    assert rowwise > per_tensor + 4, (rowwise, per_tensor)
    # an outlier channel, as LLM activations grow them
    x = torch.randn(64, 512) * 0.01
    x[:, 5] *= 1e5  # every row has it, in the first 128-wide tile
    # the outlier tile's own error dominates any SQNR; the other tiles' error is what blockwise saves
    rest = slice(128, 512)
    tail = {kind: sqnr_db(granular.dequantize(*granular.cast_tiles(x, kind, False), kind)[:, rest], x[:, rest])
            for kind in (granular.TENSOR, granular.ROW, granular.TILE)}
    assert tail[granular.TILE] > 28 and tail[granular.TILE] > tail[granular.ROW] + 10 > tail[granular.TENSOR] + 10, tail
    # and in the layer: the output of the rows' other channels
    w = torch.randn(128, 512) * 0.05
    w[:, :128] = 0  # the GEMM reads only the channels outside the outlier tile
    outs = {s: _fp8_vs_fp32(s, x, w, torch.randn(64, 128))[0] for s in ("dynamic", "rowwise", "blockwise")}
    assert outs["blockwise"] > 25 and outs["blockwise"] > outs["rowwise"] + 10 > outs["dynamic"] + 10, outs


def test_a_non_finite_value_stays_non_finite():
    x = torch.randn(16, 256)
    x[3, 7] = float("inf")
    for kind in (granular.ROW, granular.TILE):
        q, inv = granular.cast_tiles(x, kind, False)
        deq = granular.dequantize(q, inv, kind)
        assert torch.isnan(deq[3, 7]) and torch.isfinite(deq[4]).all()


# --- the recipe words --------------------------------------------------------------------------------


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def _losses(model, steps=6):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    return train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), [ids], steps, loss=hf_loss)


@pytest.mark.parametrize("word", WORDS)
def test_a_tiny_llama_trains_with_each_word(word):
    reference = _losses(tiny_llama())
    model = tiny_llama()
    report = convert_model(model, recipe=FP8RecipeKwargs(backend="native", scaling=word, fp8_output_head=True))
    assert len(report.fp8_linears) == 15, report  # 7 per layer and the head, every one a multiple of 128
    assert {m.scaling for m in model.modules() if isinstance(m, NativeFP8Linear)} == {word}
    losses = _losses(model)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5  # it learns
    assert abs(losses[-1] - reference[-1]) < 0.05 * reference[0], (losses, reference)
    assert fp8_coverage(model)["fp8_gemms"] == 15 * 6


def test_blockwise_leaves_layers_not_divisible_by_128_in_high_precision_saying_why():
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 48))
    report = convert_model(model, recipe=FP8RecipeKwargs(backend="native", scaling="blockwise"))
    assert report.converted == ["0"] and "128x128 weight blocks" in report.skipped["1"]


def test_delayed_settings_with_a_finer_scaling_are_named_as_not_applying():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = make_plan(get_backend("native"), FP8RecipeKwargs(backend="native", scaling="rowwise", margin=2,
                                                               fp8_format="HYBRID"), device="cpu")
    text = " ".join(str(w.message) for w in caught)
    assert plan.scaling == "rowwise" and plan.fp8_format == "E4M3"
    assert "margin=2 is ignored" in text and "dynamic" in text and "fp8_format='HYBRID' is ignored" in text


def test_te_maps_blockwise_to_its_block_scaling_and_refuses_rowwise_clearly():
    te = get_backend("te")
    assert te.scaling_name("blockwise") == "block"
    with pytest.raises(ValueError, match="backend='native' or 'ao' for rowwise"):
        te.scaling_name("rowwise")
    with pytest.raises(ValueError, match="'blockwise' is not a torchao float8 recipe"):
        get_backend("ao").scaling_name("blockwise")
    assert get_backend("ao").scaling_name("rowwise_with_gw_hp") == "rowwise_with_gw_hp"


def test_the_automatic_choice_passes_over_engines_without_the_scaling():
    selection = select_backend(None, "cpu", scaling="blockwise")
    assert selection.name == "native"
    assert "has no 'blockwise' scaling" in selection.verdicts["ao"].reason
    assert select_backend(None, "cpu", scaling="rowwise").name in ("ao", "native")


def test_unknown_words_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="FP8RecipeKwargs.layer_scaling: pattern 'x' names 'fast'"):
        FP8RecipeKwargs(layer_scaling={"x": "fast"})
    with pytest.raises(ValueError, match="layer_scaling: give a dict"):
        FP8RecipeKwargs(layer_scaling="bf16")
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather: gathers per-tensor FP8 weights"):
        make_plan(get_backend("native"), FP8RecipeKwargs(backend="native", scaling="rowwise",
                                                         enable_fsdp_float8_all_gather=True), device="cpu")
    with pytest.raises(ValueError, match="'tensorwise' is not a fp8plug native"):
        make_plan(get_backend("native"), FP8RecipeKwargs(backend="native", layer_scaling={"*": "tensorwise"}),
                  device="cpu")


# --- per layer -----------------------------------------------------------------------------------------


def test_layer_scaling_chooses_per_layer_and_the_report_and_coverage_say_so():
    model = tiny_llama()
    rules = {**dict(first_last_bf16([n for n, _ in model.named_modules()])), "*.down_proj": "blockwise",
             "lm_head": "bf16"}
    assert list(rules)[:2] == ["model.layers.0.*", "model.layers.1.*"]
    rules = {"model.layers.0.*": "bf16", "*.down_proj": "blockwise", "lm_head": "bf16"}
    report = convert_model(model, recipe=FP8RecipeKwargs(backend="native", scaling="rowwise", layer_scaling=rules))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NativeFP8Linear)}
    assert layers["model.layers.1.mlp.down_proj"].scaling == "blockwise"
    assert layers["model.layers.1.self_attn.q_proj"].scaling == "rowwise"
    assert not any(n.startswith("model.layers.0.") for n in layers) and "lm_head" not in layers
    assert "converted model.layers.1.mlp.down_proj: blockwise (layer_scaling)" in str(report)
    assert report.skipped["model.layers.0.mlp.up_proj"] == "layer_scaling: 'model.layers.0.*' -> bf16"
    assert "kept in high precision by layer_scaling" in report.summary()
    _losses(model, steps=1)
    scalings = fp8_coverage(model)["scalings"]
    assert scalings["model.layers.1.mlp.down_proj"] == "blockwise"
    assert scalings["model.layers.1.mlp.up_proj"] == "rowwise"


def test_the_checkpoint_record_holds_the_per_layer_scaling_and_refuses_another():
    engine = get_backend("native")
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    saved_recipe = FP8RecipeKwargs(backend="native", scaling="rowwise", layer_scaling={"1": "blockwise"})
    convert_model(model, recipe=saved_recipe)
    assert model[1].scaling == "blockwise"
    state = FP8CheckpointState(engine, [model], saved_recipe).state_dict()
    assert state["recipe"]["layer_scaling"] == [["1", "blockwise"]]
    assert recipe_record(engine, saved_recipe)["scaling"] == "rowwise"
    FP8CheckpointState(engine, [model], saved_recipe).check(state)  # the same recipe resumes
    other = FP8RecipeKwargs(backend="native", scaling="rowwise", layer_scaling={"1": "rowwise"})
    with pytest.raises(ValueError, match="layer_scaling"):
        FP8CheckpointState(engine, [model], other).check(state)
    with pytest.raises(ValueError, match="scaling='rowwise'"):
        FP8CheckpointState(engine, [model], FP8RecipeKwargs(backend="native", scaling="blockwise")).check(state)


# --- rescale_layer ------------------------------------------------------------------------------------


def test_rescale_layer_moves_one_layer_to_a_finer_scaling_or_to_bf16_keeping_parameters():
    engine = get_backend("native")
    assert offers(engine, "rescale_layer")
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.Linear(128, 48))
    convert_model(model, recipe=FP8RecipeKwargs(backend="native", scaling="delayed"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [id(p) for p in model.parameters()]
    x = torch.randn(40, 128)
    model(x).sum().backward()
    opt.step()
    assert engine.rescale_layer(model, "0", "blockwise") is model[0] and model[0].scaling == "blockwise"
    plain = engine.rescale_layer(model, "2", "bf16")
    assert type(plain) is nn.Linear and model[2] is plain
    assert [id(p) for p in model.parameters()] == params  # the optimizer still holds them
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="cannot run blockwise"):
        engine.rescale_layer(model, "3", "blockwise")  # 48 outputs: no 128x128 blocks
    with pytest.raises(ValueError, match="not a native FP8 Linear"):
        engine.rescale_layer(model, "1", "rowwise")
    with pytest.raises(ValueError, match="not a native scaling"):
        engine.rescale_layer(model, "3", "mxfp8")
    fp8plug.sync_fp8_scaling(model)  # the end of a step still runs for the delayed layer left


@pytest.mark.parametrize("kind", [granular.ROW, granular.TILE, granular.SQUARE, granular.TENSOR])
def test_the_cpu_cast_operator_gives_what_its_fake_says(kind):
    """torch.library.opcheck: the operator's outputs have the shapes, dtypes and strides its fake
    gives a compiled graph (which asserts them when it runs, from inductor's cache too), and it
    traces under AOT autograd."""
    torch.library.opcheck(granular._cpu_cast_tiles, (torch.randn(130, 260), kind, True))


def test_a_compiled_blockwise_layer_matches_eager_on_the_cpu():
    """torch.compile(fullgraph=True) of a granular layer: the same outputs and gradients, bit for
    bit (the CPU casts and GEMMs are operators the compiler calls as they are)."""
    torch.manual_seed(0)
    layer = NativeFP8Linear(256, 256, scaling="blockwise")
    x = torch.randn(40, 256, requires_grad=True)
    layer(x).sum().backward()
    eager = [t.clone() for t in (x.grad, layer.weight.grad)]
    x.grad = layer.weight.grad = None
    out = torch.compile(layer, fullgraph=True)(x)
    out.sum().backward()
    assert torch.equal(out, layer(x)) and torch.equal(x.grad, eager[0]) and torch.equal(layer.weight.grad, eager[1])


def test_the_compiled_gradient_diagnosis_runs_on_the_cpu(tmp_path):
    """benchmarks/diagnose/compiled_fp8_grads.py, the GPU check of compiled granular gradients,
    in its CPU smoke: the CPU's compiled rowwise gradients are the eager ones."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "grads.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks/diagnose/compiled_fp8_grads.py"), "--device", "cpu",
                           "--cases", "dense-rowwise", "--variants", "aot_eager", "--json", str(out)],
                          capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert all(db > 100 for db in row["result"]["aot_eager"]["vs eager"].values()), row
