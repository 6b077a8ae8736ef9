"""CONTRACT TESTS for the msamp engine (fp8plug/backends/msamp/engine.py).

MS-AMP cannot be installed on current stacks (source-only, pins torch 2.1 and TransformerEngine
1.1), so these tests run the adapter against tests/support/fakes/msamp: a stand-in that implements the
part of MS-AMP's documented surface the adapter uses (msamp.initialize, opt levels O1/O2,
LBAdam/LBAdamW, ScalingTensor weights, all_reduce_grads) and does no FP8 arithmetic. They check
that fp8plug calls MS-AMP's API as documented and handles what it returns; they say nothing about
whether MS-AMP itself works.
"""

import copy
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fp8plug.backends import judge
from fp8plug.backends.msamp.engine import MSAMPEngine, is_scaling_tensor
from fp8plug.recipe.kwargs import FP8RecipeKwargs
from fp8plug.recipe.plans import make_plan
from fp8plug.tuning.hardware import DeviceInfo

FAKES = Path(__file__).resolve().parents[1] / "support" / "fakes"


def _drop_msamp_modules():
    for name in [m for m in sys.modules if m == "msamp" or m.startswith("msamp.")]:
        del sys.modules[name]


@pytest.fixture
def msamp(monkeypatch):
    """The stand-in imported as `msamp`, and everything it patched undone afterwards."""
    had_cast = "cast" in vars(torch.Tensor)
    is_tensor_like = torch.overrides.is_tensor_like
    _drop_msamp_modules()
    monkeypatch.syspath_prepend(str(FAKES))
    import msamp as stand_in

    assert stand_in.__version__.endswith("contract-stand-in")
    yield stand_in
    _drop_msamp_modules()
    torch.overrides.is_tensor_like = is_tensor_like
    if not had_cast and "cast" in vars(torch.Tensor):
        del torch.Tensor.cast


@pytest.fixture
def engine():
    return MSAMPEngine()


class Net(nn.Module):
    """Linears of every kind the shared rules meet: aligned (converted), misaligned, one to ignore,
    a subclass, and one MS-AMP's own opt-out covers."""

    class MyLinear(nn.Linear):
        pass

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.odd = nn.Linear(32, 10)
        self.head = nn.Linear(32, 32)
        self.custom = Net.MyLinear(32, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        h = self.down(torch.relu(self.up(self.norm(x))))
        return self.head(h) + self.custom(h) + self.odd(h).sum(-1, keepdim=True)


def _recipe(**kwargs):
    return FP8RecipeKwargs(modules_to_ignore=["head"], **kwargs)


def _pair(**adamw):
    model = Net()
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if n.startswith("up")], "lr": 1e-3},
            {"params": [p for n, p in model.named_parameters() if not n.startswith("up")], "weight_decay": 0.1},
        ],
        lr=5e-4, **adamw,
    )
    return model, optimizer


# --- availability ---------------------------------------------------------------------------------


def test_absent_msamp_is_explained(monkeypatch, engine):
    monkeypatch.setitem(sys.modules, "msamp", None)  # import fails as if not installed
    probe = engine.probe()
    assert not probe.available
    for words in ("does not install on current stacks", "torch 2.1", "TransformerEngine 1.1",
                  "unmaintained", "deprecated by Accelerate", "scripts/build_msamp_kit.sh"):
        assert words in probe.reason
    verdict = judge("msamp", DeviceInfo("cuda", "NVIDIA H100", (9, 0)))
    assert not verdict.usable
    assert "does not install" in verdict.reason and "github.com/Azure/MS-AMP" in verdict.reason


def test_stand_in_is_probed_like_msamp(msamp, engine):
    probe = engine.probe()
    assert probe.available and probe.version == "0.4.0+contract-stand-in"


def test_supports_cuda_only(engine):
    ok, why = engine.supports(DeviceInfo("cpu", "x86_64"))
    assert not ok and "CUDA" in why
    assert engine.supports(DeviceInfo("cuda", "NVIDIA H100", (9, 0))) == (True, "")
    ok, why = engine.supports(DeviceInfo("cuda", "NVIDIA A100", (8, 0)))
    assert not ok and "8.0" in why


# --- convert: a plan, with MS-AMP's opt-out marks --------------------------------------------------


def test_convert_plans_under_the_shared_rules_and_marks_the_rest(engine):
    model = Net()
    model.norm_proj = nn.Linear(32, 32)
    model.norm_proj.use_fp32_linear = True  # the user's own MS-AMP opt-out
    report = engine.convert(model, _recipe(module_filter_fn=lambda m, fqn: fqn != "down"))
    assert report.converted == ["up"]
    assert "divisible by 16" in report.skipped["odd"]
    assert report.skipped["head"] == "listed in modules_to_ignore"
    assert report.skipped["down"] == "module_filter_fn returned False"
    assert "subclasses Linear" in report.skipped["custom"]
    assert "use_fp32_linear" in report.skipped["norm_proj"]
    assert type(model.up) is nn.Linear  # nothing converted yet: msamp.initialize does it
    assert not getattr(model.up, "use_fp32_linear", False)
    for name in ("odd", "head", "down", "custom", "norm_proj"):
        assert getattr(model, name).use_fp32_linear is True, name

    report = engine.convert(model, FP8RecipeKwargs())  # re-planning replaces fp8plug's marks
    assert sorted(report.converted) == ["down", "head", "up"]
    assert not getattr(model.head, "use_fp32_linear", False)
    engine.unconvert(model)
    assert not hasattr(model.odd, "use_fp32_linear")
    assert model.norm_proj.use_fp32_linear is True  # the user's mark stays


# --- prepare: msamp.initialize on the pair --------------------------------------------------------------


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_prepare_initializes_the_pair(msamp, engine, level):
    model, optimizer = _pair()
    plain = copy.deepcopy(model)
    recipe = _recipe(opt_level=level)
    engine.convert(model, recipe)
    new_model, new_optimizer = engine.prepare(model, optimizer, recipe)

    assert isinstance(new_model.up, msamp.nn.FP8Linear) and isinstance(new_model.down, msamp.nn.FP8Linear)
    for name in ("odd", "head", "custom"):
        assert type(getattr(new_model, name)) in (nn.Linear, Net.MyLinear), name
    assert engine.is_converted(new_model.up) and not engine.is_converted(new_model.odd)
    assert type(new_optimizer) is msamp.optim.LBAdamW and new_optimizer.use_adam is False
    want = (torch.uint8, torch.float16) if level == "O2" else (torch.float32, torch.float32)
    assert (new_optimizer.exp_avg_dtype, new_optimizer.exp_avg_sq_dtype) == want
    groups = new_optimizer.param_groups
    assert [g["lr"] for g in groups] == [1e-3, 5e-4]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.1]
    new_params = {id(p) for p in new_model.parameters()}
    assert all(id(p) in new_params for g in groups for p in g["params"])
    assert sum(len(g["params"]) for g in groups) == len(list(plain.parameters()))
    reference = plain.up.weight.detach().double()
    error = (new_model.up.weight.float().double() - reference).norm() / reference.norm()
    assert error < 1e-3  # MS-AMP keeps weights in FP16


def test_weights_frozen_before_prepare_stay_frozen(msamp, engine):
    """MS-AMP builds each FP8Linear with a new, trainable weight; a frozen one (a LoRA base) must
    come back frozen, or it gets a weight gradient every step."""
    model, _ = _pair()
    model.down.weight.requires_grad = False
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    new_model, _ = engine.prepare(model, optimizer, _recipe())
    assert isinstance(new_model.down, msamp.nn.FP8Linear) and new_model.down.weight.requires_grad is False
    assert new_model.up.weight.requires_grad is True


def test_prepare_maps_adam_to_lbadam(msamp, engine):
    model = Net()
    _, new_optimizer = engine.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3), _recipe())
    assert type(new_optimizer) is msamp.optim.LBAdam and new_optimizer.use_adam is True


def test_prepare_needs_the_optimizer(msamp, engine):
    with pytest.raises(ValueError, match=r"model and its optimizer together.*no optimizer steps Net"):
        engine.prepare(Net(), None, _recipe())


def test_o3_is_deepspeed_only(msamp, engine):
    assert FP8RecipeKwargs(opt_level="o3").opt_level == "O3"  # an MS-AMP level; the engine decides
    with pytest.raises(ValueError, match=r"FP8RecipeKwargs\.opt_level: 'O3'.*DeepSpeed"):
        make_plan(engine, FP8RecipeKwargs(backend="msamp", opt_level="O3"))
    recipe = _recipe()
    recipe.opt_level = "O3"
    model, optimizer = _pair()
    with pytest.raises(ValueError, match=r"FP8RecipeKwargs\.opt_level: 'O3'.*DeepSpeed"):
        engine.prepare(model, optimizer, recipe)


def test_prepare_refuses_what_msamp_cannot_take(msamp, engine):
    model = Net()
    with pytest.raises(ValueError, match=r"Adam and AdamW only.*SGD"):
        engine.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _recipe())
    extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not parameters of Net"):
        engine.prepare(model, torch.optim.AdamW([*model.parameters(), extra]), _recipe())
    with pytest.raises(ValueError, match="bare optimizer"):
        engine.prepare(model, SimpleNamespace(optimizer=torch.optim.AdamW(model.parameters())), _recipe())
    with pytest.raises(ValueError, match=r"msamp engine must initialize the model before wrapping.*already compiled"):
        engine.prepare(torch.compile(model), torch.optim.AdamW(model.parameters()), _recipe())
    recipe = _recipe(optimizer_states="fp8")  # backend chosen automatically: prepare must refuse
    with pytest.raises(ValueError, match=r"optimizer_states.*msamp"):
        engine.prepare(model, torch.optim.AdamW(model.parameters()), recipe)
    prepared, optimizer = engine.prepare(model, torch.optim.AdamW(model.parameters()), _recipe())
    with pytest.raises(ValueError, match="once"):
        engine.prepare(prepared, optimizer, _recipe())


def test_adamw_silently_becoming_adam_is_caught(msamp, engine, monkeypatch):
    """On torch >= 2.x AdamW subclasses Adam; MS-AMP checks Adam first, so outside the torch 2.1 it
    pins it would give an AdamW user L2 weight decay. The adapter refuses that result."""
    def initialize_checking_adam_first(model, optimizer=None, opt_level="O1"):
        cast_model = msamp.nn.LinearReplacer.replace(model)
        return cast_model, msamp.optim.LBAdam(optimizer.param_groups, lr=1e-3)

    monkeypatch.setattr(msamp, "initialize", initialize_checking_adam_first)
    model, optimizer = _pair()
    with pytest.raises(RuntimeError, match="turned torch.optim.AdamW into LBAdam"):
        engine.prepare(model, optimizer, _recipe())


# --- DDP gradient sync, clipping ----------------------------------------------------------------------------


def test_each_step_runs_msamp_all_reduce_grads_first(msamp, engine):
    model, optimizer = _pair()
    new_model, new_optimizer = engine.prepare(model, optimizer, _recipe())
    assert new_optimizer.all_reduce_calls == []
    new_optimizer.step()
    new_optimizer.step()
    assert new_optimizer.all_reduce_calls == [new_model, new_model] and new_optimizer.steps == 2
    # what accelerate hands back: the optimizer wrapped, the model in DDP
    engine.sync_gradients(SimpleNamespace(module=new_model), SimpleNamespace(optimizer=new_optimizer))
    assert new_optimizer.all_reduce_calls[-1] is new_model


def test_clip_grad_norm_uses_msamps(msamp, engine):
    model, optimizer = _pair()
    new_model, _ = engine.prepare(model, optimizer, _recipe())
    new_model.up.weight.grad = msamp.common.tensor.ScalingTensor(
        torch.full((64, 32), 2.0, dtype=torch.float16),
        msamp.common.tensor.ScalingMeta(msamp.common.dtype.Dtypes.kfloat16),
    )
    norm = engine.clip_grad_norm_(new_model.parameters(), 1.0)
    assert float(norm) == pytest.approx(2.0 * (64 * 32) ** 0.5)


# --- checkpoints ---------------------------------------------------------------------------------------------


def test_state_dict_comes_out_plain(msamp, engine):
    model, optimizer = _pair()
    plain = copy.deepcopy(model)
    new_model, _ = engine.prepare(model, optimizer, _recipe())
    state = new_model.state_dict()
    assert list(state) == list(plain.state_dict())
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 for v in state.values())
    for key, value in plain.state_dict().items():
        reference = value.double()
        assert (state[key].double() - reference).norm() <= 1e-3 * reference.norm(), key  # FP16 rounding
    fresh = Net()
    fresh.load_state_dict(state, strict=True)
    # the engine's hook for Accelerator.get_state_dict: ScalingTensor values become tensors
    scaling = {"up.weight": new_model.up.weight, "up.bias": new_model.up.bias}
    assert is_scaling_tensor(scaling["up.weight"])
    converted = engine.plain_state_dict(scaling)
    assert list(converted) == ["up.weight", "up.bias"]
    assert isinstance(converted["up.weight"], torch.Tensor) and converted["up.bias"] is new_model.up.bias


def test_plain_checkpoint_loads_into_the_prepared_model(msamp, engine):
    model, optimizer = _pair()
    new_model, _ = engine.prepare(model, optimizer, _recipe())
    torch.manual_seed(1)
    other = Net()
    new_model.load_state_dict(other.state_dict(), strict=True)
    reference = other.up.weight.detach().double()
    error = (new_model.up.weight.float().double() - reference).norm() / reference.norm()
    assert is_scaling_tensor(new_model.up.weight) and error < 1e-3
    assert torch.equal(new_model.odd.weight, other.odd.weight)


def test_unconvert_gives_plain_linears_with_the_weights(msamp, engine):
    model, optimizer = _pair()
    new_model, _ = engine.prepare(model, optimizer, _recipe())
    weight = new_model.up.weight.float()
    engine.unconvert(new_model)
    assert type(new_model.up) is nn.Linear and torch.equal(new_model.up.weight.detach(), weight)
    assert not any(engine.is_converted(m) for m in new_model.modules())


# --- eval and the recipe fields MS-AMP has no use for ------------------------------------------------------


def test_eval_runs_fp8_and_says_so(msamp, engine):
    with engine.autocast(_recipe(), enabled=False):  # nothing to switch off: MS-AMP has no such mode
        pass
    model, optimizer = _pair()
    with pytest.warns(UserWarning, match="eval runs FP8 GEMMs too"):
        engine.prepare(model, optimizer, _recipe(use_autocast_during_eval=False))
    model, optimizer = _pair()
    with pytest.warns(UserWarning) as caught:
        engine.prepare(model, optimizer, _recipe(margin=1, fp8_format="E4M3"))
    assert sorted(str(w.message).split(" is ignored by backend 'msamp': MS-AMP has no such setting")[0]
                  for w in caught) == ["FP8RecipeKwargs.fp8_format='E4M3'", "FP8RecipeKwargs.margin=1"]
    model, optimizer = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.prepare(model, optimizer, _recipe())  # defaults: nothing to warn about


# --- through fp8plug.Accelerator ------------------------------------------------------------------------


def test_accelerator_prepare_drives_msamp(msamp, monkeypatch):
    """fp8plug.Accelerator hands MS-AMP its (model, optimizer) pair, each step all-reduces first,
    and get_state_dict is plain. (The stand-in runs on the CPU, so the CUDA check is lifted.)"""
    import fp8plug

    # (tests/conftest.py clears ACCELERATE_* and accelerate's process state around every test)
    monkeypatch.setattr(MSAMPEngine, "supports", lambda self, device: (True, ""))
    accelerator = fp8plug.Accelerator(
        cpu=True, mixed_precision="fp8", kwargs_handlers=[_recipe(backend="msamp")]
    )
    model = Net()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert accelerator.fp8_engine.name == "msamp"
    assert accelerator.fp8_reports[0].converted == ["up", "down"]
    assert isinstance(model.up, msamp.nn.FP8Linear)
    inner = optimizer.optimizer
    assert type(inner) is msamp.optim.LBAdamW and inner.exp_avg_dtype == torch.uint8  # O2 default
    accelerator.backward(model(torch.randn(16, 32)).sum())
    optimizer.step()
    assert inner.all_reduce_calls == [model] and inner.steps == 1
    state = accelerator.get_state_dict(model)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert list(state) == list(Net().state_dict())


@pytest.mark.parametrize("fields, match", [
    ({"optimizer_states": "fp8"}, r"FP8RecipeKwargs\.optimizer_states.*msamp"),
    ({"opt_level": "O3"}, r"FP8RecipeKwargs\.opt_level: 'O3'.*DeepSpeed"),
])
def test_accelerator_refuses_what_msamp_cannot_do_before_prepare(msamp, monkeypatch, fields, match):
    """MS-AMP's refusals live in the engine (its make_plan); fp8plug.Accelerator asks at construction,
    before any model or optimizer is touched."""
    import fp8plug

    # (tests/conftest.py clears ACCELERATE_* and accelerate's process state around every test)
    monkeypatch.setattr(MSAMPEngine, "supports", lambda self, device: (True, ""))
    with pytest.raises(ValueError, match=match):
        fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[_recipe(backend="msamp", **fields)])
