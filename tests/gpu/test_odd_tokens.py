"""FP8 for any token count on the GPU, ao and te: a token count the FP8 GEMM cannot take (7, 31,
33, 2047; 8 x 31 as dynamic padding makes it) runs in FP8, zero-padded inside the layer, and the
real rows' outputs and gradients equal those of the same layer fed the zero-padded input by hand
(the aligned FP8 computation) and float64 within FP8's error. A tiny transformers Llama trained
on odd lengths runs every GEMM in FP8 (fp8plug.fp8_coverage).

Run: source .gpu/install.sh && python3 -m pytest tests/gpu/test_odd_tokens.py -q
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs
from tests.support.hf import train_on_lengths
from tests.support.numerics import rel_error, sqnr_db

DEVICE, BF16 = "cuda", torch.bfloat16
SHAPES = [(7,), (31,), (33,), (2047,), (8, 31)]
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _te_available():
    try:
        return fp8plug.get_backend("te").probe().available
    except Exception:  # noqa: BLE001
        return False


def _block_ok():
    from fp8plug.backends.te.engine import scaling_hardware_problem

    return torch.cuda.is_available() and scaling_hardware_problem(
        "block", torch.cuda.get_device_capability(), torch.version.cuda) is None


needs_te = pytest.mark.skipif(not _te_available(), reason="TransformerEngine is not installed")
needs_sm90 = pytest.mark.skipif(not SM90, reason="rowwise GEMMs need sm_90")
RECIPES = [
    pytest.param(("ao", "tensorwise"), id="ao-tensorwise"),
    pytest.param(("ao", "rowwise"), id="ao-rowwise", marks=needs_sm90),
    pytest.param(("ao", "rowwise_with_gw_hp"), id="ao-rowwise_with_gw_hp", marks=needs_sm90),
    pytest.param(("te", "delayed"), id="te-delayed", marks=needs_te),
    pytest.param(("te", "current"), id="te-current", marks=needs_te),
    pytest.param(("te", "block"), id="te-block",
                 marks=[needs_te,
                        pytest.mark.skipif(not _block_ok(), reason="block scaling needs sm_90 and CUDA 12.9")]),
]


def pair(backend, scaling, k=512, n=256):
    """Two identical converted single-Linear models (fresh FP8 state each) and the plain layer."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(k, n)).to(DEVICE, BF16)
    recipe = FP8RecipeKwargs(backend=backend, scaling=scaling)
    models = []
    warm = torch.randn(64, k, device=DEVICE, dtype=BF16)
    for _ in range(2):
        model = copy.deepcopy(plain)
        report = fp8plug.convert_model(model, recipe=recipe)
        assert report.converted == ["0"]
        fp8plug.apply_fp8_autowrap(model, recipe)
        # one aligned step first, with gradients as large as the test's: delayed scales fit the data
        model(warm).backward(torch.randn(64, n, device=DEVICE, dtype=BF16) * 2)
        model.zero_grad(set_to_none=True)
        fp8plug.fp8_coverage(model, reset=True)
        models.append(model)
    return models[0], models[1], plain


def step(model, x, grad):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    return out, x.grad, model[0].weight.grad, model[0].bias.grad


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_odd_token_counts_run_fp8_and_equal_hand_padding(recipe, shape):
    backend, scaling = recipe
    padded_inside, by_hand, plain = pair(backend, scaling)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(*shape, 512, device=DEVICE, dtype=BF16, generator=gen)
    grad = torch.randn(*shape, 256, device=DEVICE, dtype=BF16, generator=gen)
    got = step(padded_inside, x, grad)
    assert fp8plug.fp8_coverage(padded_inside)["layers"]["0"] == (1, 0)  # FP8, not a fallback

    rows = x.numel() // 512
    extra = -rows % 16
    xp = F.pad(x.reshape(rows, 512), (0, 0, 0, extra))
    gp = F.pad(grad.reshape(rows, 256), (0, 0, 0, extra))
    out_h, dx_h, dw_h, db_h = step(by_hand, xp, gp)
    out, dx, dw, db = got
    assert out.shape == (*shape, 256) and dx.shape == x.shape
    assert rel_error(out.reshape(rows, 256), out_h[:rows]) < 1e-5
    # TE's delayed scaling updates every TE module's scales at each autocast exit, process-wide, so
    # the second model's grad_output scale has moved on by the time it runs: its gradients match
    # to FP8's precision, not bit for bit (float64 below holds them to 18 dB either way).
    grad_tolerance = 0.1 if (backend, scaling) == ("te", "delayed") else 1e-5
    assert rel_error(dx.reshape(rows, 512), dx_h[:rows]) < grad_tolerance
    assert rel_error(dw, dw_h) < grad_tolerance and rel_error(db, db_h) < 1e-5

    xd = x.double().requires_grad_()
    wd = plain[0].weight.detach().double().requires_grad_()
    ref = F.linear(xd, wd, plain[0].bias.detach().double())
    ref.backward(grad.double())
    assert 20 <= sqnr_db(out, ref) <= 40  # FP8 ran (bf16 alone gives more), and ran right
    assert sqnr_db(dx, xd.grad) >= 18 and sqnr_db(dw, wd.grad) >= 18


@pytest.mark.parametrize("backend", ["ao", pytest.param("te", marks=needs_te)])
def test_llama_on_odd_lengths_runs_every_gemm_in_fp8(backend):
    transformers = pytest.importorskip("transformers")

    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    accelerator = fp8plug.Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend=backend)])
    assert accelerator.fp8_backend == backend
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    # 2 layers x 7 projections; lm_head stays in bf16 (the Accelerator's default, fp8_output_head)
    assert accelerator.fp8_reports[0].fp8_linears and len(accelerator.fp8_reports[0].fp8_linears) == 14
    # 93, 99, 21, 381 tokens
    losses = train_on_lengths(accelerator, model, optimizer, (31, 33, 7, 127, 31), batch=3, vocab=512)
    coverage = accelerator.fp8_coverage()
    assert coverage["high_precision_gemms"] == 0 and coverage["fp8_gemms"] == 14 * 5
    assert all(torch.isfinite(torch.tensor(losses)))
