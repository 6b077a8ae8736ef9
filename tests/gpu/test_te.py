"""The `te` engine on a real GPU with TransformerEngine 2.x (written against 2.20.2 on H100/H200):
conversion both ways, recipes reaching TE, numerics against float64, odd token counts padded,
checkpoints and exact resume, gradient-accumulation caching, and a small decoder trained within
5% of bf16 (through the API and through fp8plug.Accelerator)."""

import copy
import os
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

te = pytest.importorskip("transformer_engine.pytorch")
from transformer_engine.common import recipe as te_recipes  # noqa: E402

import fp8plug  # noqa: E402
from fp8plug import FP8RecipeKwargs  # noqa: E402
from fp8plug.backends import get_backend  # noqa: E402
from fp8plug.backends.te import engine as te_engine  # noqa: E402
from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, synthetic_batches  # noqa: E402
from tests.support.numerics import rel_error  # noqa: E402
from tests.support.training import adamw_tail_loss, tail_mean, train  # noqa: E402

DEVICE = "cuda"
BF16 = torch.bfloat16


@pytest.fixture
def engine():
    return get_backend("te")


class Mixed(nn.Module):
    """Every kind of module the engine meets: Linears with and without bias, norms it converts and
    norms it must skip."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64, bias=False)
        self.ln = nn.LayerNorm(64)
        self.rms = nn.RMSNorm(64)
        self.ln_no_affine = nn.LayerNorm(64, elementwise_affine=False)
        self.ln_no_bias = nn.LayerNorm(64, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.rms(self.ln(x)))))


def mixed(seed=0):
    torch.manual_seed(seed)
    return Mixed().to(DEVICE, BF16)


def linear_stack(seed=0, widths=(256, 256, 128)):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers).to(DEVICE, BF16)


def converted(model, recipe=None):
    recipe = recipe or FP8RecipeKwargs(backend="te")
    fp8plug.convert_model(model, recipe=recipe)
    fp8plug.apply_fp8_autowrap(model, recipe)
    return model


# --- conversion ----------------------------------------------------------------------------------------


def test_round_trip_is_bit_exact_and_keeps_device_dtype_and_parameters():
    model = mixed()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {name: p for name, p in model.named_parameters()}
    report = fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="te"))

    assert isinstance(model.fc1, te.Linear) and isinstance(model.fc2, te.Linear)
    assert isinstance(model.ln, te.LayerNorm) and isinstance(model.rms, te.RMSNorm)
    assert sorted(report.converted) == ["fc1", "fc2", "ln", "rms"]
    assert "elementwise_affine=False" in report.skipped["ln_no_affine"]
    assert "bias=False" in report.skipped["ln_no_bias"]
    assert isinstance(model.fc2.bias, torch.Tensor) and model.fc2.bias.numel() == 0  # TE's quirk
    for name, p in model.named_parameters():  # the very same Parameters: same values, device, dtype
        assert p is params[name] and p.device.type == "cuda" and p.dtype == BF16
    assert fp8plug.has_transformer_engine_layers(model)
    model(torch.randn(2, 8, 64, device=DEVICE, dtype=BF16))  # runs

    fp8plug.convert_model(model, to_transformer_engine=False)
    assert type(model.fc1) is nn.Linear and type(model.fc2) is nn.Linear and model.fc2.bias is None
    assert type(model.ln) is nn.LayerNorm and type(model.rms) is nn.RMSNorm and model.rms.eps is None
    assert not fp8plug.has_transformer_engine_layers(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value) and after[key].dtype == value.dtype, key


def test_linear_after_an_unaligned_sibling_is_still_converted(engine):
    torch.manual_seed(0)
    model = nn.ModuleDict({"odd": nn.Linear(64, 24), "even": nn.Linear(64, 64)}).to(DEVICE, BF16)
    report = engine.convert(model, FP8RecipeKwargs(backend="te"))
    assert report.converted == ["even"] and "out_features=24 not divisible by 16" in report.skipped["odd"]
    assert type(model["odd"]) is nn.Linear and isinstance(model["even"], te.Linear)
    with engine.autocast(FP8RecipeKwargs(backend="te", scaling="current")):
        out = model["even"](torch.randn(16, 64, device=DEVICE, dtype=BF16))
    assert out.shape == (16, 64) and torch.isfinite(out).all()


# --- recipes and numerics ------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", ["delayed", "current", "block"])
def test_recipes_run_within_6_percent_of_float64(scaling):
    model = converted(linear_stack(widths=(256, 512)), FP8RecipeKwargs(backend="te", scaling=scaling))
    layer = model[0]
    for _ in range(3):  # delayed scaling needs a step or two before its scales fit the data
        x = torch.randn(4, 64, 256, device=DEVICE, dtype=BF16, requires_grad=True)
        grad = torch.randn(4, 64, 512, device=DEVICE, dtype=BF16)
        layer.weight.grad = layer.bias.grad = None
        out = model(x)
        out.backward(grad)
    assert layer.fp8 and isinstance(layer.fp8_meta["recipe"], getattr(te_recipes, te_engine.RECIPE_CLASSES[scaling]))
    xd = x.detach().double().requires_grad_()
    wd = layer.weight.detach().double().requires_grad_()
    ref = F.linear(xd, wd, layer.bias.detach().double())
    ref.backward(grad.double())
    error = rel_error(out, ref)
    assert 0.005 < error < 0.06, error  # FP8 ran (bf16 would be ~0.003) and within the bound
    assert rel_error(x.grad, xd.grad) < 0.12
    assert rel_error(layer.weight.grad, wd.grad) < 0.12


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_amax_compute_algo_reaches_te(algo):
    model = converted(linear_stack(widths=(64, 64)),
                      FP8RecipeKwargs(backend="te", amax_compute_algo=algo, amax_history_len=16))
    big = torch.randn(16, 64, device=DEVICE, dtype=BF16) * 100
    small = torch.randn(16, 64, device=DEVICE, dtype=BF16)
    model(big)
    model(small)  # scales update when each top-level forward's autocast region closes
    meta = model[0].fp8_meta
    assert meta["recipe"].amax_compute_algo == algo
    chosen = small if algo == "most_recent" else big
    expected = 448.0 / chosen.float().abs().max()
    torch.testing.assert_close(meta["scaling_fwd"].scale[0], expected, rtol=1e-5, atol=0)


def test_interval_is_honoured_through_te(engine):
    recipe = FP8RecipeKwargs(backend="te", interval=2, amax_history_len=5)
    assert isinstance(engine.te_recipe(recipe).scaling_factor_compute_algo, te_engine.IntervalScaling)
    model = converted(linear_stack(widths=(64, 64)), recipe)
    inputs = [torch.randn(16, 64, device=DEVICE, dtype=BF16) * s for s in (100, 1, 10)]
    scales = []
    for x in inputs:
        model(x)
        scales.append(model[0].fp8_meta["scaling_fwd"].scale[0].item())
    amax = [x.float().abs().max().item() for x in inputs]
    assert scales[0] == pytest.approx(448.0 / amax[0], rel=1e-5)
    assert scales[1] == scales[0]  # update 2 of every 2 keeps the scale
    assert scales[2] == pytest.approx(448.0 / amax[2], rel=1e-5)  # most_recent, recomputed


def test_override_linear_precision(engine):
    recipe = FP8RecipeKwargs(backend="te", scaling="current", override_linear_precision=(False, True, True))
    assert engine.te_recipe(recipe).backward_override == "high_precision"
    model = converted(linear_stack(widths=(256, 256)), recipe)
    x = torch.randn(128, 256, device=DEVICE, dtype=BF16, requires_grad=True)
    grad = torch.randn(128, 256, device=DEVICE, dtype=BF16)
    model(x).backward(grad)
    ref_grad = grad.double() @ model[0].weight.detach().double()
    assert rel_error(x.grad, ref_grad) < 0.01  # dgrad in bf16, not FP8 (~0.05)
    with pytest.warns(UserWarning, match="override_linear_precision"):
        engine.te_recipe(FP8RecipeKwargs(backend="te", margin=1, override_linear_precision=(False, True, True)))


@pytest.mark.parametrize("scaling", ["mxfp8", "nvfp4"])
def test_blackwell_recipes_are_refused_on_hopper(engine, scaling):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("checks the refusal on an sm_90 GPU")
    recipe = FP8RecipeKwargs(backend="te", scaling=scaling)
    with pytest.raises(ValueError, match=rf"scaling='{scaling}' needs a Blackwell.*sm_100.*sm_90"):
        engine.autocast(recipe)
    model = linear_stack(widths=(64, 64))
    with pytest.raises(ValueError, match="sm_100"):
        fp8plug.convert_model(model, recipe=recipe)
    assert type(model[0]) is nn.Linear  # refused before touching the model


def test_native_te_recipe_object_is_accepted():
    model = linear_stack(widths=(64, 64))
    get_backend("te").convert(model)
    native = te_recipes.DelayedScaling(fp8_format=te_recipes.Format.E4M3, amax_history_len=8)
    model.forward = types.MethodType(fp8plug.contextual_fp8_autocast(model.forward, native), model)
    model(torch.randn(16, 64, device=DEVICE, dtype=BF16))
    assert model[0].fp8_meta["recipe"] is native


# --- train / eval ------------------------------------------------------------------------------------------


def test_eval_equals_the_bf16_forward(engine):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 128)).to(DEVICE, BF16)
    recipe = FP8RecipeKwargs(backend="te")
    model = converted(copy.deepcopy(base), recipe)
    x = torch.randn(4, 64, 256, device=DEVICE, dtype=BF16)
    for _ in range(2):
        model(x).float().sum().backward()  # FP8 training steps first
    with torch.no_grad():
        reference = base.eval()(x)
        in_train = model(x)  # train mode: FP8
        model.eval()
        in_eval = model(x)
        with engine.autocast(recipe, enabled=False):
            high_precision = model(x)
    assert torch.equal(in_eval, high_precision)
    assert rel_error(in_eval, reference) < 5e-3  # the bf16 forward, up to GEMM/norm kernel rounding
    assert rel_error(in_train, reference) > 2 * rel_error(in_eval, reference)


def test_odd_token_counts_run_in_fp8_padded_in_train_and_eval(engine):
    base = linear_stack()
    recipe = FP8RecipeKwargs(backend="te", use_autocast_during_eval=True)
    model = converted(copy.deepcopy(base), recipe)
    for _ in range(2):
        model(torch.randn(2, 8, 256, device=DEVICE, dtype=BF16)).float().sum().backward()
    fp8plug.fp8_coverage(model, reset=True)

    seven = torch.randn(1, 7, 256, device=DEVICE, dtype=BF16, requires_grad=True)
    out = model(seven)  # TE alone raises ValueError here (checked below); fp8plug pads to 16 tokens
    out.float().sum().backward()
    assert out.shape == (1, 7, 128) and seven.grad.shape == seven.shape and torch.isfinite(seven.grad).all()
    with torch.no_grad():
        assert 5e-3 < rel_error(out, base(seven)) < 0.1  # that forward ran in FP8
        model.eval()
        assert 5e-3 < rel_error(model(seven), base(seven)) < 0.1  # eval with FP8 on: padded too
    assert fp8plug.fp8_coverage(model)["layers"] == {"0": (2, 0), "2": (2, 0)}
    with engine.autocast(recipe):  # without the wrapper too
        model[0](seven.detach())

    raw = te.Linear(256, 256, params_dtype=BF16)
    with te.autocast(enabled=True, recipe=te_recipes.Float8CurrentScaling()):
        with pytest.raises(ValueError, match="divisible by 8"):
            raw(seven.detach())


def test_microbatch_flag_makes_te_reuse_the_fp8_weight(engine):
    recipe = FP8RecipeKwargs(backend="te", scaling="current")
    model = converted(linear_stack(widths=(256, 256)), recipe)
    x = torch.randn(64, 256, device=DEVICE, dtype=BF16)
    with engine.microbatch(True):
        first = model(x)
    assert "weight" in model[0]._fp8_workspaces
    with torch.no_grad():
        model[0].weight.add_(0.5)
    with engine.microbatch(False):
        cached = model(x)  # a later micro-batch: TE reuses the FP8 weight cast on the first
    fresh = model(x)  # no flag: TE casts the (changed) weight again
    assert torch.equal(cached, first) and not torch.equal(fresh, first)


# --- checkpoints -------------------------------------------------------------------------------------------


def test_plain_state_dict_round_trip_is_strict(engine):
    model = converted(mixed(0))
    model(torch.randn(2, 8, 64, device=DEVICE, dtype=BF16))  # TE now has extra state to write
    plain_other = mixed(1).state_dict()
    model.load_state_dict(plain_other, strict=True)  # a plain checkpoint into a converted model
    for key, value in plain_other.items():
        assert torch.equal(model.state_dict()[key], value)

    full = model.state_dict()
    assert any(key.endswith("_extra_state") for key in full)
    plain = engine.plain_state_dict(full)
    fresh = mixed(2)
    assert set(plain) == set(fresh.state_dict())
    fresh.load_state_dict(plain, strict=True)  # and back into the plain model
    for key, value in plain_other.items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_fp8_state_resumes_exactly(engine):
    recipe = FP8RecipeKwargs(backend="te", amax_history_len=8)
    a = converted(linear_stack(0), recipe)
    for _ in range(3):
        a(torch.randn(32, 256, device=DEVICE, dtype=BF16) * 4).float().square().sum().backward()
    state = engine.fp8_state(a)
    assert set(state) == {"0", "2"} and state["0"]["amax_history_fwd"].shape == (8, 3)

    b = converted(linear_stack(1), recipe)
    engine.load_plain_state_dict(b, engine.plain_state_dict(a.state_dict()))
    engine.load_fp8_state(b, state)
    control = converted(linear_stack(1), recipe)  # same weights, no FP8 state
    engine.load_plain_state_dict(control, engine.plain_state_dict(a.state_dict()))

    for model in (a, b):
        model.zero_grad(set_to_none=True)
    x = torch.randn(32, 256, device=DEVICE, dtype=BF16)
    out_a, out_b, out_control = a(x), b(x), control(x)
    assert torch.equal(out_a, out_b)  # the saved scales, not fresh ones (the control's)
    assert not torch.equal(out_a, out_control)
    out_a.float().sum().backward()
    out_b.float().sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad)


# --- a small decoder -------------------------------------------------------------------------------------

CFG = DecoderConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, ffn_dim=1024, max_seq_len=128)
STEPS = 200


def _batches():
    return synthetic_batches(STEPS, 16, 128, CFG.vocab_size, seed=0, device=DEVICE)


def _base():
    torch.manual_seed(0)
    return TinyDecoder(CFG).to(DEVICE)


def _train_plain(model, batches):
    return adamw_tail_loss(model, batches, autocast="cuda", tail=20)


@pytest.fixture(scope="module")
def bf16_loss():
    return _train_plain(_base(), _batches())


def test_decoder_trains_within_5_percent_of_bf16(bf16_loss):
    recipe = FP8RecipeKwargs(backend="te", modules_to_ignore=["lm_head"])
    model = converted(_base(), recipe)
    assert isinstance(model.layers[0].up, te.Linear) and isinstance(model.layers[0].attn_norm, te.RMSNorm)
    fp8 = _train_plain(model, _batches())
    assert abs(fp8 - bf16_loss) / bf16_loss <= 0.05, (fp8, bf16_loss)


def test_decoder_through_accelerator_within_5_percent_of_bf16(bf16_loss):
    recipe = FP8RecipeKwargs(backend="te", modules_to_ignore=["lm_head"])
    accelerator = fp8plug.Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe])
    assert accelerator.fp8_engine.name == "te"
    model = _base()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model.layers[0].q, te.Linear)
    fp8 = tail_mean(train(model, optimizer, _batches(), accelerator=accelerator), 20)
    assert abs(fp8 - bf16_loss) / bf16_loss <= 0.05, (fp8, bf16_loss)


CUDNN_SCRIPT = r"""
import sys, torch
import torch.nn.functional as F
q = torch.randn(2, 8, 256, 128, device="cuda", dtype=torch.bfloat16)
if sys.argv[1] == "torch-first":
    F.scaled_dot_product_attention(q, q, q, is_causal=True)  # torch loads and uses its cuDNN first
from fp8plug.backends import get_backend
probe = get_backend("te").probe()
assert probe.available, probe.reason
choice = torch._fused_sdp_choice(q, q, q, is_causal=True)
major, minor, _ = torch._C._cudnn.getCompileVersion()
print(torch.backends.cudnn.version(), f"{major}.{minor}", int(choice), int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION))
"""  # noqa: E501 (a script's text, kept as it runs)


@pytest.mark.parametrize("order", ["torch-first", "te-first"])
def test_te_and_torch_share_one_cudnn(order):
    """Importing TE through fp8plug, before or after torch used cuDNN, leaves one cuDNN in the
    process (torch's), TE importable, and torch's cuDNN attention first in line (a system cuDNN
    older than torch's once made TE unimportable, or torch fall back to FlashAttention-2)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("CUDNN_PATH", "CUDNN_HOME")}
    out = subprocess.run([sys.executable, "-c", CUDNN_SCRIPT, order], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    runtime, compiled, choice, cudnn = out.stdout.split()[-4:]
    major, minor = int(runtime) // 10000, int(runtime) // 100 % 100
    assert f"{major}.{minor}" == compiled, f"torch built with cuDNN {compiled}, runs {runtime}"
    if int(runtime) > 91500 and torch.cuda.get_device_capability() in ((9, 0), (10, 0)):
        assert choice == cudnn, "torch prefers cuDNN attention here from cuDNN 9.15.1 on"
