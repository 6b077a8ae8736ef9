"""The `ao` engine on the CPU: torchao float8 through fp8plug's rules, numerics against float64,
the FP8RecipeKwargs mapping, the eval policy, compile, activation checkpointing, unconvert, under
fp8plug.Accelerator. A frozen weight's backward is test_ao_frozen.py's."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao.float8")

from torchao.float8.config import ScalingGranularity, ScalingType  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

import fp8plug  # noqa: E402
from fp8plug import ConversionError, FP8RecipeKwargs  # noqa: E402
from fp8plug.backends import get_backend, select_backend  # noqa: E402
from fp8plug.backends.ao import config as torchao_config  # noqa: E402
from tests.support.numerics import sqnr_db  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture
def engine():
    return get_backend("ao")


def recipe(**kwargs):
    return FP8RecipeKwargs(backend="ao", **kwargs)


def two_layers(k=64, n=96, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(k, n, bias=bias), nn.ReLU(), nn.Linear(n, k, bias=bias))


def converted(model=None, **kwargs):
    model = model if model is not None else two_layers()
    get_backend("ao").convert(model, recipe(**kwargs))
    return model


def single(k=64, n=96, **kwargs):
    """One converted Linear inside a container (the root itself cannot be replaced in place)."""
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(k, n))
    get_backend("ao").convert(holder, recipe(**kwargs))
    return holder[0]


def reference(layer, x, grad):
    xd = x.detach().double().requires_grad_()
    wd = layer.weight.detach().double().requires_grad_()
    bd = layer.bias.detach().double().requires_grad_()
    out = F.linear(xd, wd, bd)
    out.backward(grad.double())
    return out, xd.grad, wd.grad, bd.grad


def run(layer, x, grad):
    x = x.clone().requires_grad_()
    layer.weight.grad = layer.bias.grad = None
    out = layer(x)
    out.backward(grad)
    return out, x.grad, layer.weight.grad, layer.bias.grad


def data(m=64, k=64, n=96, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), torch.randn(m, n, generator=gen)


# --- the engine itself ---------------------------------------------------------------------------------


def test_probe_and_selection_on_this_machine(engine):
    probe = engine.probe()
    assert probe.available and probe.version.startswith("0.")
    assert select_backend("ao", device="cpu").backend is engine


def test_converts_through_torchao_under_the_shared_rules(engine):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.small = nn.Linear(64, 10)
            self.keep = nn.Linear(64, 64)
            self.veto = nn.Linear(64, 64)
            self.attn = nn.MultiheadAttention(64, 4)

    model = Net()
    params = {name: id(p) for name, p in model.named_parameters()}
    report = engine.convert(model, recipe(modules_to_ignore=["keep"], module_filter_fn=lambda m, fqn: fqn != "veto"))
    assert report.converted == ["a"]
    assert "out_features=10" in report.skipped["small"]
    assert report.skipped["keep"] == "listed in modules_to_ignore"
    assert report.skipped["veto"] == "module_filter_fn returned False"
    assert "nn.MultiheadAttention 'attn'" in report.skipped["attn.out_proj"]
    assert "in_proj_weight" in report.skipped["attn"]
    assert isinstance(model.a, Float8Linear) and type(model.a).__name__ == "AOFloat8Linear"
    assert all(type(getattr(model, n)) is nn.Linear for n in ("small", "keep", "veto"))
    assert {name: id(p) for name, p in model.named_parameters()} == params  # same Parameter objects
    assert set(model.state_dict()) == set(Net().state_dict())
    again = engine.convert(model, recipe())
    assert again.converted == ["keep", "veto"] and again.skipped["a"] == "already converted"


def test_bad_input_is_refused_clearly(engine):
    with pytest.raises(ConversionError, match="already compiled"):
        engine.convert(torch.compile(two_layers()), recipe())
    with pytest.raises(ConversionError, match=r"\['nope'\]"):
        engine.convert(two_layers(), recipe(modules_to_ignore=["nope"]))
    with pytest.raises(ConversionError, match="wrap it in a container"):
        engine.convert(nn.Linear(64, 64), recipe())
    with pytest.raises(ValueError, match="backend='native' or 'te'"):
        engine.convert(two_layers(), recipe(scaling="delayed"))
    with pytest.raises(ValueError, match="rowwise_with_gw_hp"):
        engine.convert(two_layers(), recipe(scaling="blockwise"))


# --- numerics against float64 ----------------------------------------------------------------------------


@pytest.mark.parametrize("scaling,fmt", [
    ("tensorwise", "HYBRID"), ("tensorwise", "E4M3"), ("rowwise", None), ("rowwise_with_gw_hp", None),
])
@pytest.mark.parametrize("k", [64, 256])
def test_numerics_against_float64(scaling, fmt, k):
    options = {"scaling": scaling, **({"fp8_format": fmt} if fmt else {})}
    layer = single(k=k, **options)
    x, grad = data(k=k)
    out, dx, dw, db = run(layer, x, grad)
    ref_out, ref_dx, ref_dw, ref_db = reference(layer, x, grad)
    assert sqnr_db(out, ref_out) >= 20
    assert sqnr_db(dx, ref_dx) >= 18
    assert sqnr_db(dw, ref_dw) >= 18
    assert sqnr_db(db, ref_db) >= 40  # the bias gradient is not quantised
    assert sqnr_db(out, ref_out) <= 45  # and FP8 really ran: float32 alone would give ~140 dB


def test_recipes_and_formats_reach_torchao_config():
    hybrid = single(scaling="tensorwise").config
    assert hybrid.cast_config_grad_output.target_dtype == E5M2
    assert hybrid.cast_config_input.target_dtype == hybrid.cast_config_weight.target_dtype == E4M3
    e4m3 = single(scaling="tensorwise", fp8_format="E4M3").config
    assert (e4m3.cast_config_grad_output.target_dtype == e4m3.cast_config_grad_output_for_grad_weight.target_dtype
            == E4M3)
    rowwise = single(scaling="rowwise").config  # E4M3 throughout by design; the default HYBRID leaves it
    assert rowwise.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
    assert rowwise.cast_config_grad_output.target_dtype == E4M3 and rowwise.round_scales_to_power_of_2
    explicit = single(scaling="rowwise", fp8_format="HYBRID").config  # ... unless asked explicitly
    assert explicit.cast_config_grad_output.target_dtype == E5M2
    gw_hp = single(scaling="rowwise_with_gw_hp").config
    assert gw_hp.cast_config_input_for_grad_weight.scaling_type is ScalingType.DISABLED


@pytest.mark.parametrize("override,gemm",
                         [((True, False, False), 0), ((False, True, False), 1), ((False, False, True), 2)])
def test_override_linear_precision_runs_that_gemm_unscaled(override, gemm):
    layer = single(override_linear_precision=override)
    names = torchao_config._gemm_operands()[("fprop", "dgrad", "wgrad")[gemm]]
    assert all(getattr(layer.config, n).scaling_type is ScalingType.DISABLED for n in names)
    x, grad = data()
    results = run(layer, x, grad)[:3]  # out, dx, dw: the products of fprop, dgrad, wgrad
    refs = reference(layer, x, grad)[:3]
    for i, (got, want) in enumerate(zip(results, refs)):
        db = sqnr_db(got, want)
        if i == gemm:
            assert db >= 100, f"GEMM {i} should be exact up to float32, got {db:.1f} dB"
        else:
            assert 18 <= db <= 45, f"GEMM {i} should still run in FP8, got {db:.1f} dB"


def test_delayed_scaling_fields_warn_only_when_the_user_set_them(engine, monkeypatch):
    with pytest.warns(UserWarning) as caught:
        engine.convert(two_layers(), recipe(margin=2, amax_history_len=16))
    assert [str(w.message).split(" is ignored by backend 'ao': torchao removed delayed scaling")[0]
            for w in caught] == ["FP8RecipeKwargs.margin=2", "FP8RecipeKwargs.amax_history_len=16"]
    monkeypatch.setenv("ACCELERATE_FP8_MARGIN", "3")  # launch exports these whatever the backend
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LEN", "1024")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.convert(two_layers(), recipe(interval=1))  # explicit but the default: nothing to say


def test_a_whole_torchao_config(engine):
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name("rowwise")
    r = FP8RecipeKwargs(ao_config=config)
    assert r.backend == "ao"
    model = two_layers()
    engine.convert(model, r)
    assert model[0].config.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE
    assert model[0].config.cast_config_grad_output.target_dtype == E4M3  # env/default HYBRID not applied
    model = two_layers()
    engine.convert(model, FP8RecipeKwargs(ao_config=Float8LinearConfig(),
                                          override_linear_precision=(False, False, True)))
    assert model[0].config.cast_config_input_for_grad_weight.scaling_type is ScalingType.DISABLED
    with pytest.raises(ValueError, match="not both"):
        engine.convert(two_layers(), FP8RecipeKwargs(ao_config=config, scaling="rowwise"))
    gathered = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather.*not cast to float8"):
        engine.convert(two_layers(),
                       FP8RecipeKwargs(ao_config=gathered, override_linear_precision=(True, False, False)))
    with pytest.raises(ValueError, match="only on backend='ao'"):
        FP8RecipeKwargs(backend="te", ao_config=config)
    with pytest.raises(ValueError, match="expected a torchao.float8.Float8LinearConfig"):
        engine.convert(two_layers(), FP8RecipeKwargs(ao_config={"emulate": True}))


def test_fsdp_and_padding_fields_from_arguments_and_launch_environment(engine, monkeypatch):
    assert FP8RecipeKwargs().enable_fsdp_float8_all_gather is False and FP8RecipeKwargs().pad_inner_dim is False
    monkeypatch.setenv("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "true")
    monkeypatch.setenv("ACCELERATE_FP8_PAD_INNER_DIM", "True")
    r = recipe()
    assert r.enable_fsdp_float8_all_gather is True and r.pad_inner_dim is True
    assert recipe(pad_inner_dim=False).pad_inner_dim is False  # explicit beats the environment
    model = two_layers()
    engine.convert(model, r)
    assert model[0].config.enable_fsdp_float8_all_gather and model[0].config.pad_inner_dim
    assert isinstance(model[0].weight, WeightWithDynamicFloat8CastTensor)
    # launch exports true by default: with rowwise (no float8 all-gather there) it only warns ...
    with pytest.warns(UserWarning, match="tensorwise scales only"):
        engine.convert(two_layers(), recipe(scaling="rowwise"))
    # ... but asked for explicitly it is an error
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather"):
        engine.convert(two_layers(), recipe(scaling="rowwise", enable_fsdp_float8_all_gather=True))
    with pytest.raises(ValueError, match="pad_inner_dim"):
        FP8RecipeKwargs(pad_inner_dim="maybe")


def test_float8_all_gather_weight_trains_without_fsdp_and_keeps_frozen(engine):
    model, ref = two_layers(), two_layers()
    model[2].weight.requires_grad_(False)
    engine.convert(model, recipe(enable_fsdp_float8_all_gather=True))
    assert model[2].weight.requires_grad is False and model[0].weight.requires_grad is True
    x = torch.randn(32, 64)
    out = model(x)
    out.sum().backward()
    assert sqnr_db(out, ref(x)) >= 20
    assert model[0].weight.grad is not None and model[2].weight.grad is None
    engine.end_step([model])  # not sharded: nothing to precompute, and no error
    assert model[0].weight._precomputed_scale is None


def test_a_hand_written_loop_ends_each_step_for_the_models_its_optimizer_trains(engine, monkeypatch):
    """fp8plug.backends.steps' one global optimizer hook ends the step for the models an optimizer steps,
    without an Accelerator: once per step, and not for a converted model it does not train."""
    calls = []
    monkeypatch.setattr(engine, "end_step", lambda models, group=None: calls.append(models))
    model, other = two_layers(), two_layers()
    engine.convert(model, recipe())
    engine.convert(other, recipe())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(32, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert calls == [[model], [model]]


def test_emulation_on_a_machine_without_a_gpu(monkeypatch):
    """torch's CPU _scaled_mm can take oneDNN's reference kernel (1 s for a 512x128x512 GEMM on an
    AMX Xeon): torchao is told to emulate wherever no GPU is visible."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    layer = single()
    assert layer.config.emulate is True
    x, grad = data()
    out, dx, dw, _ = run(layer, x, grad)
    ref_out, ref_dx, ref_dw, _ = reference(layer, x, grad)
    assert sqnr_db(out, ref_out) >= 20 and sqnr_db(dx, ref_dx) >= 18 and sqnr_db(dw, ref_dw) >= 18


# --- eval policy, autocast, compile, checkpointing ------------------------------------------------------


def test_eval_runs_high_precision_and_autocast_switches(engine):
    model, ref = converted(), two_layers()
    x = torch.randn(32, 64)
    fp8_out = model(x)
    assert sqnr_db(fp8_out, ref(x)) < 45  # training mode: FP8
    model.eval()
    assert torch.equal(model(x), ref(x))  # eval: exactly the plain Linear
    with engine.autocast(recipe(), enabled=True):
        assert torch.equal(model(x), fp8_out)
    model.train()
    with engine.autocast(recipe(), enabled=False):
        assert torch.equal(model(x), ref(x))


def test_contextual_autocast_wrapper_with_ao(engine):
    model, ref = converted(), two_layers()
    x = torch.randn(32, 64)
    fp8plug.apply_fp8_autowrap(model, recipe(), backend=engine)
    fp8_out = model(x)
    assert sqnr_db(fp8_out, ref(x)) < 45
    model.eval()
    assert torch.equal(model(x), ref(x))
    fp8plug.apply_fp8_autowrap(model, recipe(use_autocast_during_eval=True), backend=engine)
    assert torch.equal(model(x), fp8_out)


def test_token_count_an_fp8_gemm_cannot_take_still_runs_fp8():
    x = torch.randn(3, 7, 64)  # 21 tokens: padded to 32 inside the layer
    for model in (converted(), converted(pad_inner_dim=True)):  # fp8plug's padding, torchao's own
        ref = two_layers()
        out = model(x)
        assert out.shape == (3, 7, 64)
        assert 20 <= sqnr_db(out, ref(x)) < 45  # FP8 ran, and ran right


def test_compile_fullgraph_matches_eager_and_follows_eval(engine):
    model, ref = converted(), two_layers()
    eager = copy.deepcopy(model)  # before wrapping: the wrapper holds its model's bound forward
    for m in (model, eager):
        fp8plug.apply_fp8_autowrap(m, recipe(), backend=engine)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(32, 64, requires_grad=True)
    out = compiled(x)
    out.sum().backward()
    eager_out = eager(x)
    eager_out.sum().backward()
    assert torch.equal(out, eager_out)
    assert torch.equal(model[0].weight.grad, eager[0].weight.grad)
    model.eval()
    assert torch.equal(compiled(x), ref(x))  # eval recompiles to the high-precision path
    model.train()
    assert torch.equal(compiled(x), eager_out)


def test_activation_checkpointing_gives_the_same_gradients():
    from torch.utils.checkpoint import checkpoint

    model = converted()
    twin = copy.deepcopy(model)
    x = torch.randn(32, 64)
    checkpoint(model, x, use_reentrant=False).sum().backward()
    twin(x).sum().backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)


# --- unconvert ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("all_gather", [False, True])
def test_unconvert_gives_back_the_same_parameters(engine, all_gather):
    model = two_layers()
    params = [id(p) for p in model.parameters()]
    plain_state = copy.deepcopy(model.state_dict())
    engine.convert(model, recipe(enable_fsdp_float8_all_gather=all_gather))
    assert engine.is_converted(model[0]) and fp8plug.has_fp8_layers(model)
    fp8plug.unconvert_model(model)
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear
    assert [id(p) for p in model.parameters()] == params
    assert all(type(p) is nn.Parameter for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, plain_state[key])


# --- under fp8plug.Accelerator ------------------------------------------------------------------------------


def test_accelerator_converts_and_runs_the_after_step_work(monkeypatch):
    accelerator = fp8plug.Accelerator(
        mixed_precision="fp8", cpu=True, kwargs_handlers=[recipe(enable_fsdp_float8_all_gather=True)]
    )
    engine = accelerator.fp8_engine
    assert engine.name == "ao"
    calls = []
    monkeypatch.setattr(engine, "end_step", lambda models, group=None: calls.append(models))
    model = two_layers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model[0], Float8Linear) and isinstance(model[2], Float8Linear)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters()}  # the optimizer steps the model's weights
    x = torch.randn(32, 64)
    losses = []
    for _ in range(3):
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert len(calls) == 3 and losses[-1] < losses[0]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_cpu_bf16_autocast_trains_every_recipe(scaling):
    """torchao casts a Float8Linear's input under CUDA autocast only; fp8plug does it on the CPU
    too, or the high-precision weight-gradient GEMM of rowwise_with_gw_hp meets mixed dtypes."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="ao", scaling=scaling))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(32, 64))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad).all()
