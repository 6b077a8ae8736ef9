"""The `te` engine's own logic, on the CPU: availability and its reasons, the recipe mapping,
hardware refusals, checkpoint helpers. TransformerEngine itself cannot run here; where a module
must exist, a stand-in package on sys.path plays it, and only fp8plug's decisions are checked.
The engine working for real is tests/gpu/test_te.py."""

import subprocess
import sys
import textwrap
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fp8plug import FP8RecipeKwargs
from fp8plug.backends import BackendUnavailableError, get_backend, select_backend
from fp8plug.backends.base import Engine, offers
from fp8plug.backends.te import engine as te_engine
from fp8plug.backends.te import imports as te_import
from fp8plug.backends.te import layers as te_layers
from fp8plug.backends.te import recipes as te_recipes
from fp8plug.recipe.plans import make_plan
from fp8plug.tuning.hardware import DeviceInfo

H100 = DeviceInfo("cuda", "NVIDIA H100", (9, 0))
CPU = DeviceInfo("cpu", "cpu")
A100 = DeviceInfo("cuda", "NVIDIA A100", (8, 0))

# The dataclass fields of TransformerEngine 2.20.2's recipe classes (from its source), and of a
# TE 1.x DelayedScaling that still had `interval` and `override_linear_precision`.
TE2_FIELDS = {
    "DelayedScaling": frozenset({"margin", "fp8_format", "amax_history_len", "amax_compute_algo",
                                 "scaling_factor_compute_algo", "reduce_amax", "fp8_dpa", "fp8_mha",
                                 "backward_override"}),
    "Float8CurrentScaling": frozenset({"use_power_2_scales", "fp8_format", "fp8_gemm_fprop", "fp8_gemm_dgrad",
                                       "fp8_gemm_wgrad", "fp8_dpa", "fp8_mha", "backward_override"}),
    "Float8BlockScaling": frozenset({"use_f32_scales", "fp8_format", "x_block_scaling_dim", "w_block_scaling_dim",
                                     "grad_block_scaling_dim", "fp8_gemm_fprop", "fp8_gemm_dgrad",
                                     "fp8_gemm_wgrad", "fp8_dpa", "fp8_mha", "backward_override"}),
    "MXFP8BlockScaling": frozenset({"margin", "fp8_format", "fp8_dpa", "fp8_mha", "backward_override",
                                    "enable_2d_quantization"}),
    "NVFP4BlockScaling": frozenset({"disable_rht", "fp4_format", "fp8_format", "fp8_dpa", "fp8_mha",
                                    "backward_override"}),
}
TE1_FIELDS = {"DelayedScaling": frozenset({"margin", "interval", "fp8_format", "amax_history_len", "amax_compute_algo",
                                           "override_linear_precision", "scaling_factor_compute_algo", "reduce_amax"})}


def _te_module_names():
    return [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]


@pytest.fixture
def no_te(monkeypatch):
    """Hide any real TransformerEngine for one test: its modules leave sys.modules, whatever the
    test imported (a stand-in) is dropped after it, and the real ones come back."""
    for name in _te_module_names():
        monkeypatch.delitem(sys.modules, name)
    yield monkeypatch
    for name in _te_module_names():
        del sys.modules[name]


def _stand_in_te(tmp_path, monkeypatch, init_body: str):
    """A `transformer_engine` package on sys.path whose __init__ runs `init_body`."""
    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(init_body))
    (pkg / "pytorch.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))


# --- availability --------------------------------------------------------------------------------


def test_absent_te_is_not_installed(no_te):
    no_te.setitem(sys.modules, "transformer_engine", None)  # an import of it now fails as "not found"
    probe = te_engine.TEEngine().probe()
    assert not probe.available and probe.reason == "not installed"


@pytest.mark.parametrize("error", ["OSError('libcuda.so.1: cannot open shared object file')",
                                   "RuntimeError('Found no NVIDIA driver on your system')"])
def test_installed_but_broken_te_is_unavailable_with_its_reason(tmp_path, no_te, error):
    _stand_in_te(tmp_path, no_te, f"raise {error}\n")
    probe = te_engine.TEEngine().probe()
    kind = error.split("(")[0]
    assert not probe.available
    assert "installed but not importable" in probe.reason and kind in probe.reason
    with pytest.raises(BackendUnavailableError) as err:
        select_backend("te", device=H100)
    message = str(err.value)
    assert kind in message and "pip install" in message and "transformer_engine[pytorch]" in message
    # automatic choice passes over it and says why
    assert select_backend(None, device="cpu").name != "te"


def test_explicit_te_says_it_needs_a_gpu_on_a_cpu_and_gives_the_pip_command_on_a_gpu(no_te):
    no_te.setitem(sys.modules, "transformer_engine", None)
    with pytest.raises(BackendUnavailableError, match=r"cannot run here: needs a CUDA GPU") as on_cpu:
        select_backend("te", device="cpu")
    assert "pip install" not in str(on_cpu.value)  # installing it would not help on a CPU
    with pytest.raises(BackendUnavailableError,
                       match=r"not installed; install it with `pip install --no-build-isolation "
                             r"\"transformer_engine\[pytorch\]\"`"):
        select_backend("te", device=H100)


def test_te_importable_but_cpu_device_is_refused(tmp_path, no_te):
    _stand_in_te(tmp_path, no_te, "__version__ = '2.20.2'\n")
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU with compute capability 8.9"):
        select_backend("te", device="cpu")
    engine = te_engine.TEEngine()
    assert engine.probe().version == "2.20.2"
    assert engine.supports(H100) == (True, "")
    ok, why = engine.supports(A100)
    assert not ok and "8.0" in why and "8.9" in why


def test_engine_calls_without_te_raise_the_install_hint(no_te):
    no_te.setitem(sys.modules, "transformer_engine", None)
    engine = te_engine.TEEngine()
    with pytest.raises(BackendUnavailableError, match="pip install"):
        engine.convert(nn.Sequential(nn.Linear(16, 16)), FP8RecipeKwargs(backend="te"))
    with pytest.raises(BackendUnavailableError, match="pip install"):
        engine.autocast(FP8RecipeKwargs(backend="te"))


def test_without_te_imported_nothing_is_converted_and_nothing_imported(no_te):
    engine = te_engine.TEEngine()
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    assert not any(engine.is_converted(m) for m in model.modules())
    assert engine.unconvert(model) is model
    assert not any(n.startswith("transformer_engine") for n in sys.modules)


def test_import_fp8plug_never_imports_te():
    code = ("import sys, fp8plug; fp8plug.FP8RecipeKwargs(); from fp8plug.backends import te;"
            "print(sorted(m for m in sys.modules if m.startswith('transformer_engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- recipe mapping --------------------------------------------------------------------------------


def te_plan(scaling="delayed", **kwargs):
    """The te engine's plan for a recipe (made on the CPU: no hardware check, no TE needed)."""
    return make_plan(te_engine.TEEngine(), FP8RecipeKwargs(backend="te", scaling=scaling, **kwargs), CPU)


def plan(scaling="delayed", fields=TE2_FIELDS, **kwargs):
    return te_recipes.te_recipe_spec(te_plan(scaling, **kwargs), fields, "2.20.2")


def test_delayed_recipe_carries_every_field_and_most_recent_by_default():
    p = plan(margin=2, fp8_format="E4M3", amax_history_len=16)
    assert p.class_name == "DelayedScaling"
    assert p.kwargs_dict() == {"margin": 2, "fp8_format": "E4M3", "amax_history_len": 16,
                               "amax_compute_algo": "most_recent"}
    assert p.interval == 1 and p.notes == ()
    assert plan(amax_compute_algo="max").kwargs_dict()["amax_compute_algo"] == "max"


def test_interval_is_honoured_through_scaling_factor_compute_algo_on_te2():
    p = plan(interval=4)
    assert p.interval == 4 and "interval" not in p.kwargs_dict() and p.notes == ()


def test_interval_goes_to_te1_field_or_is_noted_when_there_is_no_way():
    assert plan(interval=4, fields=TE1_FIELDS).kwargs_dict()["interval"] == 4
    bare = {"DelayedScaling": TE2_FIELDS["DelayedScaling"] - {"scaling_factor_compute_algo"}}
    p = plan(interval=4, fields=bare)
    assert p.interval == 1 and [(name, value) for name, value, _ in p.notes] == [("interval", 4)]
    assert "no hook to change that" in p.notes[0][2]


def test_override_linear_precision_backward_becomes_backward_override():
    p = plan("current", override_linear_precision=(False, True, True))
    assert p.kwargs_dict()["backward_override"] == "high_precision" and p.notes == ()
    p = plan("block", override_linear_precision=(False, True, True))
    assert p.kwargs_dict()["backward_override"] == "high_precision"


def test_override_linear_precision_that_te2_cannot_do_is_noted_never_dropped():
    p = plan("delayed", override_linear_precision=(False, True, True))
    assert "backward_override" not in p.kwargs_dict()
    assert len(p.notes) == 1 and p.notes[0][0] == "override_linear_precision" and "scaling='current'" in p.notes[0][2]
    p = plan("current", override_linear_precision=(True, False, False))
    assert len(p.notes) == 1 and "modules_to_ignore" in p.notes[0][2]
    p = plan("current", override_linear_precision=(False, False, True))
    assert "backward_override" not in p.kwargs_dict() and len(p.notes) == 1


def test_delayed_only_fields_warned_under_other_scalings_only_when_chosen():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        te_plan("current")
    with pytest.warns(UserWarning) as caught:
        p = te_plan("current", amax_history_len=16, margin=1)
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2 and all("is ignored by backend 'te' with scaling='current': it only applies to "
                                      "delayed scaling" in m for m in messages)
    assert (p.margin, p.amax_history_len) == (0, 1024)  # not in the plan: TE's current scaling has none


def test_block_and_mxfp8_keep_te_default_format_unless_chosen():
    assert "fp8_format" not in plan("block").kwargs_dict()
    assert plan("block", fp8_format="HYBRID").kwargs_dict()["fp8_format"] == "HYBRID"
    assert plan("current").kwargs_dict() == {"fp8_format": "HYBRID"}
    assert plan("nvfp4").kwargs_dict() == {}
    with pytest.warns(UserWarning, match="fp8_format='HYBRID' is ignored by backend 'te' with scaling='nvfp4'"):
        te_plan("nvfp4", fp8_format="HYBRID")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        te_plan("nvfp4", fp8_format="E4M3")  # what NVFP4's block scales are anyway: nothing to say


def test_recipe_class_missing_from_old_te_is_a_clear_error():
    with pytest.raises(ValueError, match=r"scaling: 'block' needs transformer_engine.common.recipe.Float8BlockScaling"):
        plan("block", fields=TE1_FIELDS)


def test_unknown_scaling_names_the_te_choices():
    with pytest.raises(ValueError, match="delayed, current, block, mxfp8, nvfp4"):
        te_engine.TEEngine().scaling_name("tensorwise")


@pytest.mark.parametrize("scaling, capability, cuda, needle", [
    ("mxfp8", (9, 0), "13.0", "sm_100"),
    ("nvfp4", (9, 0), "13.0", "sm_100"),
    ("mxfp8", (12, 0), "13.0", "compute capability 10.x"),
    ("block", (9, 0), "12.8", "CUDA 12.9"),
    ("block", (8, 9), "13.0", "9.0"),
    ("delayed", (8, 0), "12.4", "8.9"),
])
def test_hardware_refusals_say_what_is_needed(scaling, capability, cuda, needle):
    problem = te_recipes.scaling_hardware_problem(scaling, capability, cuda, "NVIDIA H100")
    assert problem and needle in problem and f"scaling={scaling!r}" in problem


@pytest.mark.parametrize("scaling, capability, cuda", [
    ("delayed", (8, 9), "12.4"), ("current", (9, 0), "13.0"), ("block", (9, 0), "12.10"),
    ("block", (9, 0), "13.0"), ("mxfp8", (10, 0), "12.9"), ("nvfp4", (10, 0), "12.9"),
])
def test_hardware_accepts(scaling, capability, cuda):
    assert te_recipes.scaling_hardware_problem(scaling, capability, cuda) is None


def test_interval_scaling_recomputes_every_interval_updates_with_te_formula():
    algo = te_recipes.IntervalScaling(3)
    recipe = SimpleNamespace(margin=1)
    scale = torch.ones(3)
    amaxes = [torch.tensor([2.0, 0.0, float("inf")]), torch.tensor([4.0, 1.0, 1.0]),
              torch.tensor([8.0, 1.0, 1.0]), torch.tensor([16.0, 1e-45, 1.0])]
    seen = []
    for amax in amaxes:
        scale.copy_(algo(amax, scale, 448.0, recipe))  # TE updates the module's scale in place
        seen.append(scale.clone())
    other = torch.ones(3)  # another module's scale has its own count
    assert algo(amaxes[1], other, 448.0, recipe)[0] == 448.0 / 4 / 2
    # update 0 recomputes (zero and inf amax keep the old scale), updates 1 and 2 keep it, 3 recomputes
    assert torch.equal(seen[0], torch.tensor([448.0 / 2 / 2, 1.0, 1.0]))
    assert torch.equal(seen[1], seen[0]) and torch.equal(seen[2], seen[0])
    assert seen[3][0] == 448.0 / 16 / 2 and seen[3][1] == torch.finfo(torch.float32).max and seen[3][2] == 224.0


def test_gemm_alignment_follows_te_rules():
    def fits(shape, kind="fp8"):  # goes through TE's FP8 GEMM as it is, unpadded
        return te_layers.fp8_token_multiple(torch.zeros(shape), kind) == 1

    assert not fits((1, 7, 256)) and not fits((1, 8, 256))
    assert fits((1, 16, 256)) and fits((2, 8, 256))
    assert not fits((8, 24))
    assert not fits((16, 256), "mxfp8") and fits((32, 256), "mxfp8")
    assert not fits((256,))


def test_odd_token_counts_are_padded_to_te_multiple_features_never():
    def plan(shape, kind="fp8"):
        return te_layers.fp8_token_multiple(torch.zeros(shape), kind)

    assert plan((1, 16, 256)) == 1 and plan((2, 8, 256)) == 1  # fits as it is
    assert plan((1, 7, 256)) == 16 and plan((8, 31, 256)) == 16 and plan((2047, 256)) == 16
    assert plan((33, 256), "mxfp8") == 32 and plan((15, 256), "nvfp4") == 16
    assert plan((8, 24)) is None and plan((256,)) is None and plan((0, 256)) is None  # cannot pad those

    class Quantized(torch.Tensor):  # stands for TE's own quantized tensors: never padded
        pass

    assert te_layers.fp8_token_multiple(torch.zeros(7, 256).as_subclass(Quantized)) is None
    assert te_layers.fp8_token_multiple(torch.zeros(16, 256).as_subclass(Quantized)) == 1


def test_warn_once_per_process():
    message = "fp8plug test: this warning appears once"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        te_recipes.warn_once(message)
        te_recipes.warn_once(message)
    assert [str(w.message) for w in caught] == [message]


# --- TE's API names, old and new ----------------------------------------------------------------------


def _recorder(calls, name):
    return lambda **kwargs: calls.append((name, kwargs)) or name


def test_new_te_names_are_used_when_present():
    calls = []
    module = SimpleNamespace(autocast=_recorder(calls, "autocast"), quantized_model_init=_recorder(calls, "qmi"),
                             fp8_autocast=_recorder(calls, "fp8_autocast"), fp8_model_init=_recorder(calls, "fmi"))
    api = te_import.TEApi(module)
    api.autocast(enabled=True, recipe="R")
    assert calls == [("autocast", {"enabled": True, "recipe": "R", "amax_reduction_group": None})]


def test_old_te_names_are_used_otherwise():
    calls = []
    module = SimpleNamespace(fp8_autocast=_recorder(calls, "fp8_autocast"), fp8_model_init=_recorder(calls, "fmi"))
    api = te_import.TEApi(module)
    api.autocast(enabled=False, recipe="R", group="G")
    assert calls == [("fp8_autocast", {"enabled": False, "fp8_recipe": "R", "fp8_group": "G"})]


# --- checkpoints --------------------------------------------------------------------------------------


def test_plain_state_dict_drops_only_te_extra_state():
    sd = {"a.weight": torch.ones(2), "a._extra_state": torch.empty(0, dtype=torch.uint8),
          "b._extra_state": torch.tensor([1, 2], dtype=torch.uint8), "c._extra_state": {"mine": 1},
          "d._extra_state": torch.ones(2), "e._extra_state": torch.empty(0),
          "my_extra_state": torch.empty(0, dtype=torch.uint8)}
    out = te_engine.TEEngine().plain_state_dict(sd)
    assert list(out) == ["a.weight", "c._extra_state", "d._extra_state", "my_extra_state"]


def test_checkpoint_helpers_see_te_entries_as_the_engines():
    from fp8plug.checkpoints.state import engine_keys

    keys = ["a.weight", "a._extra_state", "b.bias"]
    assert engine_keys(keys, te_engine.TEEngine()) == {"a._extra_state"}


class _WithExtraState(nn.Module):
    """Stands in for a TE module: a Linear that, like TE modules, writes `_extra_state`."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4))
        self.loaded = None

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.loaded = state


def test_plain_checkpoint_loads_strictly_once_extra_state_is_supplied():
    model = nn.Sequential(_WithExtraState())
    plain = {"0.weight": torch.full((4, 4), 3.0)}
    with pytest.raises(RuntimeError, match="_extra_state"):
        model.load_state_dict(plain, strict=True)
    te_layers.accept_plain_state_dict(model[0])
    te_layers.accept_plain_state_dict(model[0])  # idempotent: one hook
    model.load_state_dict(plain, strict=True)
    assert torch.equal(model[0].weight, plain["0.weight"]) and model[0].loaded.numel() == 0
    assert list(plain) == ["0.weight"]  # the caller's dict is not modified
    assert list(te_layers.drop_extra_state(model.state_dict())) == ["0.weight"]


def test_base_engine_has_no_fp8_state_by_default():
    engine = Engine()
    assert engine.fp8_state(nn.Linear(2, 2)) == {}
    assert engine.load_fp8_state(nn.Linear(2, 2), {}) is None
    assert not offers(engine, "microbatch")  # an optional capability: the Accelerator then enters nothing


def test_microbatch_flag_is_scoped():
    engine = te_engine.TEEngine()
    assert te_layers._Microbatch.is_first is None
    with engine.microbatch(True):
        assert te_layers._Microbatch.is_first is True
        with engine.microbatch(False):
            assert te_layers._Microbatch.is_first is False
        assert te_layers._Microbatch.is_first is True
    assert te_layers._Microbatch.is_first is None


def test_native_fp8_state_round_trip_resumes_exactly():
    torch.manual_seed(0)
    native = get_backend("native")
    recipe = FP8RecipeKwargs(backend="native", amax_history_len=4)

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
        native.convert(m, recipe)
        return m

    a, b = model(), model()
    x = torch.randn(16, 32)
    for _ in range(3):
        a(x * 3).sum().backward()
        native.end_step([a])
    state = native.fp8_state(a)
    assert set(state) == {"0", "2"} and int(state["0"]["fp8_step"][0]) == 3
    b.load_state_dict(a.state_dict(), strict=True)
    native.load_fp8_state(b, state)
    assert torch.equal(a(x), b(x))
    with pytest.raises(ValueError, match="not in this model"):
        native.load_fp8_state(nn.Sequential(nn.Linear(32, 32)), {"0": state["0"]})
