"""Finer scaling on a GPU: torch's rowwise and blockwise FP8 GEMMs against the CPU emulation and
fp32, TransformerEngine's Float8BlockScaling and torchao's rowwise through the same recipe words,
and a tiny Llama's training step per word (skipped without an sm_90 GPU)."""

import pytest
import torch

from fp8plug import FP8RecipeKwargs, convert_model, fp8_coverage
from fp8plug.backends.native import granular
from fp8plug.tuning.hardware import device_info
from tests.support.numerics import sqnr_db
from tests.support.training import hf_loss, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs an sm_90 (Hopper) GPU")


def blockwise_problem():
    info = device_info("cuda")
    return granular.blockwise_gemm_problem(info.capability, info.cuda_version)


def needs(word):
    if word == "blockwise" and blockwise_problem():
        pytest.skip(blockwise_problem())


@pytest.mark.parametrize("word", granular.GRANULAR)
@pytest.mark.parametrize("shape", [(256, 512, 384), (4096, 1024, 2048)])
def test_the_gpu_gemms_match_the_emulation_and_fp32(word, shape):
    """All three GEMMs on the GPU against the same layer emulated on the CPU (same FP8 bytes, the
    GPU accumulating differently, writing bf16: > 40 dB) and against fp32 (> 25 dB)."""
    needs(word)
    m, k, n = shape
    torch.manual_seed(0)
    x, w, g = torch.randn(m, k), torch.randn(n, k) * 0.05, torch.randn(m, n)
    results = {}
    for device in ("cuda", "cpu"):
        # copies, also on the CPU (x.to("cpu") would be x itself, and the fp32 reference's
        # backward below would then add its gradient into the one kept here)
        xd, wd = x.clone().to(device).requires_grad_(), w.clone().to(device).requires_grad_()
        out = granular.granular_linear(xd, wd, word, torch.float32)
        out.backward(g.to(device))
        results[device] = [t.detach().cpu() for t in (out, xd.grad, wd.grad)]
    x32, w32 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = x32 @ w32.t()
    ref.backward(g)
    for gpu, cpu, exact in zip(results["cuda"], results["cpu"], (ref, x32.grad, w32.grad)):
        assert sqnr_db(gpu, cpu) > 40, sqnr_db(gpu, cpu)  # the GPU writes bf16 and accumulates its own way
        assert sqnr_db(gpu, exact) > 25, sqnr_db(gpu, exact)


@pytest.mark.parametrize("k", [640, 512])
@pytest.mark.parametrize("cast", ["eager kernels", "torch ops"])
def test_blockwise_scale_layouts_reach_torch_unchanged(k, cast):
    """1x128 x 128x128 (forward, dgrad) and 1x128 x 1x128 (wgrad), K a multiple of 512 or not (the
    128x128 scales' K blocks padded to a multiple of 4 where not): bf16 output against the
    emulation. Both casts store 1x128 inverse scales column-major, the layout the GEMM takes."""
    needs("blockwise")
    torch.manual_seed(1)
    a, b = torch.randn(256, k, device="cuda"), torch.randn(384, k, device="cuda")
    cast_tiles = granular.cast_tiles if cast == "eager kernels" else granular._cast_tiles
    for kb in (granular.SQUARE, granular.TILE):
        qa, sa = cast_tiles(a, granular.TILE, False)
        qb, sb = cast_tiles(b, kb, False)
        assert sa.stride() == (1, sa.shape[0]), sa.stride()
        gpu = granular.granular_mm(qa, sa, granular.TILE, qb, sb, kb, torch.bfloat16).float().cpu()
        cpu = granular.granular_mm(qa.cpu(), sa.cpu(), granular.TILE, qb.cpu(), sb.cpu(), kb, torch.float32)
        assert sqnr_db(gpu, cpu) > 40, (kb, sqnr_db(gpu, cpu))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256, max_position_embeddings=128)
    return LlamaForCausalLM(config).cuda().to(torch.bfloat16)


def train_losses(model, steps=8):
    ids = torch.randint(0, 256, (4, 96), generator=torch.Generator().manual_seed(0)).cuda()
    return train(model, torch.optim.AdamW(model.parameters(), lr=2e-3), [ids], steps, loss=hf_loss)


@pytest.mark.parametrize("engine,word", [("native", "rowwise"), ("native", "rowwise_with_gw_hp"),
                                         ("native", "blockwise"), ("ao", "rowwise"), ("ao", "rowwise_with_gw_hp"),
                                         ("te", "blockwise")])
def test_a_tiny_llama_trains_with_each_word_on_each_engine(engine, word):
    if engine == "native":
        needs(word)
    if engine == "te":
        pytest.importorskip("transformer_engine.pytorch")
    reference = train_losses(tiny_llama())
    model = tiny_llama()
    report = convert_model(model, recipe=FP8RecipeKwargs(backend=engine, scaling=word))
    assert len(report.fp8_linears) >= 14, report
    if engine == "te":
        from fp8plug import get_backend

        assert type(get_backend("te").te_recipe(FP8RecipeKwargs(backend="te", scaling=word))).__name__ == \
            "Float8BlockScaling"
    losses = train_losses(model)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5
    assert abs(losses[-1] - reference[-1]) < 0.05 * reference[0], (losses, reference)
    if engine != "te":
        assert fp8_coverage(model)["fp8_gemms"] > 0


@pytest.mark.parametrize("word", granular.GRANULAR)
def test_a_compiled_native_layer_matches_eager(word):
    needs(word)
    from fp8plug.backends.native.engine import NativeFP8Linear

    torch.manual_seed(2)
    layer = NativeFP8Linear(1024, 2048, bias=True, scaling=word, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 200, 1024, device="cuda", dtype=torch.bfloat16)
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True)(x)
    assert sqnr_db(compiled.float(), eager.float()) > 40


@pytest.mark.parametrize("word", granular.GRANULAR)
def test_a_compiled_native_layer_has_eager_gradients(word):
    """Forward and backward, compiled against eager: the output and both gradients agree. As an
    autograd.Function traced by torch 2.11's dynamo the gradients came out exactly zero (models that
    did not learn); compiled, the layer is an operator now (backends/native/compiled_ops.py)."""
    needs(word)
    from fp8plug.backends.native.engine import NativeFP8Linear

    torch.manual_seed(3)
    layer = NativeFP8Linear(1024, 2048, bias=False, scaling=word, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(4, 256, 2048, device="cuda", dtype=torch.bfloat16)
    results = []
    for runner in (layer, torch.compile(layer)):
        layer.weight.grad = None
        xi = x.clone().requires_grad_()
        out = runner(xi)
        out.backward(grad)
        results.append((out.float(), xi.grad.float(), layer.weight.grad.float()))
    for name, eager, compiled in zip(("output", "input grad", "weight grad"), *results):
        assert sqnr_db(compiled, eager) > 30, name


@pytest.mark.parametrize("word", ("dynamic", "delayed") + granular.GRANULAR)
def test_a_compiled_llama_has_eager_gradients_for_each_scaling(word):
    """A small transformers Llama through fp8plug.Accelerator with each scaling (per-tensor's two
    too, whose casts are one operator each for dynamo: backends.native.cast): one step's gradients
    of every weight, eager and under torch.compile, each held against the same model's bf16
    gradients. The compiled ones must be as close to bf16 as the eager ones (within 3 dB): compiled
    and eager FP8 are not compared with each other, since one ulp upstream moves every dynamic
    scale after it (tests/gpu/test_moe.py says more)."""
    needs(word)
    import copy

    import transformers

    from fp8plug import Accelerator
    from tests.support.hf import fresh

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(4)
    start = transformers.LlamaForCausalLM(config).cuda().train()
    ids = torch.randint(0, 512, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    reference = copy.deepcopy(start)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hf_loss(reference, ids).backward()
    bf16 = {n: p.grad.float() for n, p in reference.named_parameters() if p.grad is not None}
    grads = {}
    for compiled in (False, True):
        fresh()
        accelerator = Accelerator(mixed_precision="fp8",
                                  kwargs_handlers=[FP8RecipeKwargs(backend="native", scaling=word, auto_filter=False)])
        model = accelerator.prepare(copy.deepcopy(start))
        runner = torch.compile(model) if compiled else model
        accelerator.backward(hf_loss(runner, ids))
        grads[compiled] = {n: p.grad.float() for n, p in accelerator.unwrap_model(model).named_parameters()
                           if p.grad is not None}
        assert fp8_coverage(accelerator.unwrap_model(model))["fp8_gemms"] > 0
    converted = [n for n in bf16 if n.endswith("proj.weight")]
    assert converted and grads[False].keys() == grads[True].keys() == bf16.keys()
    for n in converted:
        eager_db, compiled_db = sqnr_db(grads[False][n], bf16[n]), sqnr_db(grads[True][n], bf16[n])
        assert eager_db > 15, (n, eager_db)
        assert compiled_db > eager_db - 3, (n, eager_db, compiled_db)
