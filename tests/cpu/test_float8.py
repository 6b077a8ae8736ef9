"""fp8plug.integrations.float8: OLMo-core's Float8Config / apply_float8_linear and the torchao seed's
convert_to_float8_training (dynamic on torchao, delayed on the native engine), including the
seed's two code examples run as written."""

import functools

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

import fp8plug  # noqa: E402
from fp8plug import ConversionError  # noqa: E402
from fp8plug.backends import get_backend  # noqa: E402
from fp8plug.backends.base import Probe  # noqa: E402
from fp8plug.backends.native.engine import NativeFP8Linear  # noqa: E402
from fp8plug.integrations.float8 import (
    AOFloat8LinearConfig,
    AOFloat8LinearRecipe,
    AOMXLinearConfig,
    DelayedScalingConfig,
    Float8CastConfig,
    Float8Config,
    Float8ScalingType,
    Float8TrainingConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
    sync_float8_amax_and_scale_history,
)
from tests.support.numerics import sqnr_db  # noqa: E402


class Model(nn.Module):
    """Two aligned layers, one unaligned (24 outputs), and an `output` head the seed filters out."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.w1 = nn.Linear(64, 128)
        self.w2 = nn.Linear(128, 64)
        self.odd = nn.Linear(64, 24)
        self.output = nn.Linear(24, 16)

    def forward(self, x):
        return self.output(self.odd(torch.relu(self.w2(torch.relu(self.w1(x))))))


def kinds(model):
    return {name: type(m).__name__ for name, m in model.named_children()}


# --- Float8Config validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("given", [
    dict(ao=AOFloat8LinearConfig(), ao_recipe="rowwise"),
    dict(ao=AOFloat8LinearConfig(), ao_mx=AOMXLinearConfig()),
    dict(ao_recipe=AOFloat8LinearRecipe.rowwise, ao_mx=AOMXLinearConfig()),
])
def test_ao_ao_recipe_ao_mx_are_mutually_exclusive(given):
    with pytest.raises(ValueError, match="mutually exclusive"):
        Float8Config(**given)


def test_config_values_are_checked():
    assert Float8Config(ao_recipe="ROWWISE").ao_recipe is AOFloat8LinearRecipe.rowwise
    assert str(AOFloat8LinearRecipe("rowwise_with_gw_hp")) == "rowwise_with_gw_hp"
    with pytest.raises(ValueError, match="ao_recipe.*tensorwise, rowwise, rowwise_with_gw_hp"):
        Float8Config(ao_recipe="blockwise")
    with pytest.raises(ValueError, match="modules_to_ignore"):
        Float8Config(modules_to_ignore="output")
    with pytest.raises(ValueError, match="Float8Config.ao: expected an AOFloat8LinearConfig"):
        Float8Config(ao={"emulate": True})
    with pytest.raises(ValueError, match="Float8Config.enabled"):
        Float8Config(enabled="yes")
    with pytest.raises(ValueError, match="cast_config_input.*unknown field"):
        Float8Config(ao=AOFloat8LinearConfig(cast_config_input={"scaling": "dynamic"})).apply_float8_linear(Model())


# --- apply_float8_linear ------------------------------------------------------------------------------------


def test_apply_converts_in_place_and_ignores_exact_names():
    model = Model()
    report = Float8Config(modules_to_ignore=["w2"]).apply_float8_linear(model, modules_to_ignore=["output"])
    assert report.converted == ["w1"]
    assert kinds(model) == {"w1": "AOFloat8Linear", "w2": "Linear", "odd": "Linear", "output": "Linear"}
    x = torch.randn(32, 64)
    assert sqnr_db(model(x), Model()(x)) >= 20


def test_names_that_match_no_linear_layer_are_errors():
    with pytest.raises(ConversionError, match=r"\['w3'\]"):
        Float8Config().apply_float8_linear(Model(), modules_to_ignore=["w3"])
    with pytest.raises(ConversionError, match="not Linear layers"):
        Float8Config(modules_to_ignore=[""]).apply_float8_linear(Model())


def test_disabled_is_a_no_op():
    model = Model()
    assert Float8Config(enabled=False, ao_recipe="rowwise").apply_float8_linear(model) is None
    assert all(type(m) is nn.Linear for m in model.children())


def test_frozen_parameters_stay_frozen():
    model = Model()
    model.w1.weight.requires_grad_(False)
    model.w2.bias.requires_grad_(False)
    config = Float8Config(ao=AOFloat8LinearConfig(enable_fsdp_float8_all_gather=True))
    config.apply_float8_linear(model)
    assert isinstance(model.w1, Float8Linear)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"w1.weight", "w2.bias"}
    assert config.should_precompute_float8_dynamic_scale_for_fsdp
    assert not Float8Config().should_precompute_float8_dynamic_scale_for_fsdp


def test_recipe_and_field_configs_reach_torchao():
    model = Model()
    Float8Config(ao_recipe="rowwise").apply_float8_linear(model)
    assert model.w1.config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
    model = Model()
    ao = AOFloat8LinearConfig(cast_config_grad_output={"target_dtype": "float8_e4m3fn"},
                              round_scales_to_power_of_2=True)
    Float8Config(ao=ao).apply_float8_linear(model)
    assert model.w1.config.cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    assert model.w1.config.round_scales_to_power_of_2
    assert model.w1.config.emulate is (not torch.cuda.is_available())  # no GPU: emulated GEMMs
    x = torch.randn(32, 64)
    assert sqnr_db(model(x), Model()(x)) >= 20


# --- MXFP8 ----------------------------------------------------------------------------------------------------


def test_mx_refuses_what_torchao_cannot_train():
    with pytest.raises(ValueError, match="MXFP8 .*float8_e4m3fn.* only"):
        AOMXLinearConfig(elem_dtype=torch.float4_e2m1fn_x2).to_ao_type()
    with pytest.raises(ValueError, match="blocks of 32"):
        AOMXLinearConfig(block_size=16).to_ao_type()
    with pytest.raises(ValueError, match="scale_calculation_mode"):
        AOMXLinearConfig(scale_calculation_mode="round").to_ao_type()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="compute capability 10.0"):
            AOMXLinearConfig(kernel_preference="auto").to_ao_type()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulated default applies where no GPU is visible")
def test_mx_emulated_on_cpu_numerics_eval_and_unconvert():
    from fp8plug.backends.ao.config import mx_support_problem

    if mx_support_problem(emulated=True):
        pytest.skip(mx_support_problem(emulated=True))
    model, ref = Model().to(torch.bfloat16), Model()
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    report = Float8Config(ao_mx=AOMXLinearConfig(scale_calculation_mode="rceil")).apply_float8_linear(model)
    assert report.converted == ["w1", "w2"] and "not divisible by 32" in report.skipped["odd"]
    assert kinds(model)["w1"] == "AOMXLinear"
    x = torch.randn(64, 64)
    out = model.w1(x.bfloat16())
    out.float().sum().backward()
    ref_out = ref.w1(x)
    ref_out.sum().backward()
    assert 20 <= sqnr_db(out, ref_out) <= 40  # MXFP8 ran (bf16 alone gives ~50 dB), and ran well
    assert sqnr_db(model.w1.weight.grad, ref.w1.weight.grad) >= 18
    assert sqnr_db(model.w1.bias.grad, ref.w1.bias.grad) >= 35  # the bias torchao's override drops is kept
    model.eval()
    assert sqnr_db(model.w1(x.bfloat16()), ref_out) >= 40  # eval: high precision (bf16)
    fp8plug.unconvert_model(model)
    assert all(type(m) is nn.Linear and type(m.weight) is nn.Parameter for m in model.children())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params


# --- the torchao seed's shape ----------------------------------------------------------------------------------


def test_dynamic_config_runs_on_torchao_and_a_torchao_config_is_accepted():
    model = convert_to_float8_training(Model())
    assert kinds(model) == {"w1": "AOFloat8Linear", "w2": "AOFloat8Linear", "odd": "Linear", "output": "Linear"}
    from torchao.float8 import Float8LinearConfig as TorchaoConfig

    model = convert_to_float8_training(Model(), config=TorchaoConfig.from_recipe_name("rowwise"),
                                       module_filter_fn=lambda m, fqn: fqn != "w2")
    assert kinds(model)["w1"] == "AOFloat8Linear" and kinds(model)["w2"] == "Linear"


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_from_recipe_name_as_torchao_spells_it(name):
    """fp8plug's Float8TrainingConfig.from_recipe_name gives torchao's recipe (its own config, the
    same casts), which converts and trains on the ao engine."""
    from torchao.float8 import Float8LinearConfig as TorchaoConfig
    from torchao.float8.config import Float8LinearRecipeName

    config = Float8TrainingConfig.from_recipe_name(name)
    assert Float8TrainingConfig.from_recipe_name(Float8LinearRecipeName(name)) == config
    assert isinstance(config, Float8TrainingConfig) and config.recipe_name == name and not config.delayed
    theirs = TorchaoConfig.from_recipe_name(name)
    ours = config.to_torchao()
    for field in ("cast_config_input", "cast_config_weight", "cast_config_grad_output",
                  "cast_config_input_for_grad_weight", "cast_config_weight_for_grad_input",
                  "cast_config_grad_output_for_grad_weight", "round_scales_to_power_of_2"):
        assert getattr(ours, field) == getattr(theirs, field), field
    model, ref = convert_to_float8_training(Model(), config=config), Model()
    assert kinds(model)["w1"] == "AOFloat8Linear" and model.w1.config.cast_config_input == theirs.cast_config_input
    x = torch.randn(32, 64)
    assert 20 <= sqnr_db(model(x), ref(x)) <= 45


def test_from_recipe_name_errors_name_the_choices(monkeypatch):
    with pytest.raises(ValueError, match="recipe_name: 'columnwise' is not a torchao float8 recipe; use one of "
                                         "tensorwise, rowwise, rowwise_with_gw_hp"):
        Float8TrainingConfig.from_recipe_name("columnwise")
    with pytest.raises(ValueError, match="sets every cast itself"):
        Float8TrainingConfig(recipe_name="rowwise", cast_config_input=Float8CastConfig(Float8ScalingType.DISABLED))
    monkeypatch.setattr(get_backend("ao"), "probe", lambda: Probe(False, reason="not installed"))
    with pytest.raises(fp8plug.BackendUnavailableError, match="pip install torchao"):
        convert_to_float8_training(Model(), config=Float8TrainingConfig.from_recipe_name("rowwise"))


def test_delayed_runs_on_native_with_per_tensor_modes():
    config = Float8TrainingConfig(
        cast_config_input=Float8CastConfig(Float8ScalingType.DYNAMIC),
        cast_config_weight=Float8CastConfig(Float8ScalingType.DELAYED),
        cast_config_grad_output=Float8CastConfig(Float8ScalingType.DELAYED),
        delayed_scaling_config=DelayedScalingConfig(history_len=4),
    )
    model, ref = convert_to_float8_training(Model(), config=config), Model()
    layer = model.w1
    assert isinstance(layer, NativeFP8Linear) and layer.scaling_modes == ("dynamic", "delayed", "delayed")
    assert layer.fp8_amax_history.shape == (4, 3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # several steps, so the delayed scales come from their history
        x, grad = torch.randn(32, 64, generator=gen), torch.randn(32, 128, generator=gen)
        layer.weight.grad = None
        out = layer(x)
        out.backward(grad)
        fp8plug.sync_fp8_scaling(model)
    ref.w1(x).backward(grad)
    history = layer.fp8_amax_history
    assert (history[:3, 1:] > 0).all() and (history[:, 0] == 0).all()  # only delayed tensors keep history
    assert sqnr_db(out, ref.w1(x)) >= 20
    assert sqnr_db(layer.weight.grad, ref.w1.weight.grad) >= 18
    assert 20 <= sqnr_db(model(x), ref(x)) <= 45  # the whole model: FP8 layers and plain ones


def test_seed_config_errors():
    with pytest.raises(ValueError, match="DELAYED and DISABLED"):
        Float8TrainingConfig(cast_config_input=Float8CastConfig(Float8ScalingType.DELAYED),
                             cast_config_weight=Float8CastConfig(Float8ScalingType.DISABLED))
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather"):
        Float8TrainingConfig(cast_config_weight=Float8CastConfig(Float8ScalingType.DELAYED),
                             enable_fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="both be DISABLED"):
        disabled = Float8TrainingConfig(cast_config_input=Float8CastConfig(Float8ScalingType.DISABLED))
        convert_to_float8_training(Model(), config=disabled)
    with pytest.raises(ValueError, match="scaling_type"):
        Float8CastConfig(scaling_type="delayed")
    with pytest.raises(ValueError, match="config must be"):
        convert_to_float8_training(Model(), config={"emulate": True})
    with pytest.raises(ConversionError, match="already compiled"):
        convert_to_float8_training(torch.compile(Model()))
    assert sync_float8_amax_and_scale_history(Model()) is None  # native layers sync inside forward/backward
    with pytest.raises(ValueError, match="nn.Module"):
        sync_float8_amax_and_scale_history([Model()])


def test_without_torchao_dynamic_falls_back_to_native(monkeypatch):
    monkeypatch.setattr(get_backend("ao"), "probe", lambda: Probe(False, reason="not installed"))
    with pytest.warns(UserWarning, match="native engine instead"):
        model = convert_to_float8_training(Model())
    assert isinstance(model.w1, NativeFP8Linear) and model.w1.scaling == "dynamic"
    precompute_float8_dynamic_scale_for_fsdp(model)  # nothing to do, and no error


# --- the seed's two examples, as written --------------------------------------------------------------------
# Changes to the seed text: the import path (fp8plug.integrations.float8 for torchao.float8), indentation
# restored, the FSDP line replaced by `model = m` (no process group here), an optimizer defined
# before the loop, and the comma the seed's second example misses after
# `enable_pre_and_post_forward=False`. The delayed example imports torchao's class names
# (ScalingType, CastConfig, Float8LinearConfig), which fp8plug.integrations.float8 still answers, deprecated,
# with its renamed classes.

SEED_DYNAMIC = '''
from fp8plug.integrations.float8 import (
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)

# create model
m = Model(...)

# optional: filter modules from being eligible for float8 conversion
def module_filter_fn(mod: torch.nn.Module, fqn: str):
    # don't convert the output module
    if fqn == "output":
        return False
    # don't convert linear modules with weight dimensions not divisible by 16
    if isinstance(mod, torch.nn.Linear):
        if mod.in_features % 16 != 0 or mod.out_features % 16 != 0:
            return False
    return True

# convert all `torch.nn.Linear` modules to `Float8Linear`
convert_to_float8_training(m, module_filter_fn=module_filter_fn)

# optional: use FSDP
model = m

# optional: enable torch.compile for improved performance
m = torch.compile(m)

optimizer = torch.optim.SGD(m.parameters(), lr=1e-4)
# toy training loop
for _ in range(N_ITER):
    optimizer.zero_grad()
    y = m(x)
    y.sum().backward()
    optimizer.step()

    # specific to fsdp2 + dynamic scaling, when fp8 all-gather is turned on
    # this method is optional but is highly recommended for performance
    # it calcuclates scales for all parameters in a single all-reduce
    precompute_float8_dynamic_scale_for_fsdp(model)
'''

SEED_DELAYED = '''
from fp8plug.integrations.float8 import (
    convert_to_float8_training,
    sync_float8_amax_and_scale_history,
    ScalingType,
)

# create model
m = Model(...)

# optional: configure for compatibility with FSDP. Note that workarounds
# gated with config.enable_amax_init and
# config.enable_pre_and_post_forward are needed for
# autocast + compile + FSDP + float8 to work
from fp8plug.integrations.float8 import Float8LinearConfig, ScalingType, CastConfig
config = Float8LinearConfig(
    enable_amax_init=False,  # only needed for autocast + compile + FSDP + float8 delayed
    enable_pre_and_post_forward=False,  # only needed for autocast + compile + FSDP + float8 delayed
    cast_config_input=CastConfig(scaling_type=ScalingType.DELAYED),
    cast_config_weight=CastConfig(scaling_type=ScalingType.DELAYED),
    cast_config_grad_output=CastConfig(scaling_type=ScalingType.DELAYED),
)

# convert all `torch.nn.Linear` modules to `Float8Linear`, specifying scaling
# type
convert_to_float8_training(
    m,
    config=config,
)

# optional: use FSDP
model = m

# optional: enable torch.compile for improved performance
m = torch.compile(m)

optimizer = torch.optim.SGD(m.parameters(), lr=1e-4)
# toy training loop
for _ in range(N_ITER):
    optimizer.zero_grad()
    y = m(x)
    y.sum().backward()

    # specific to float8 with delayed scaling: separate step to sync scales/amaxes
    # in the future, this may move to a context manager
    sync_float8_amax_and_scale_history(model)

    optimizer.step()
'''


def run_seed(code, monkeypatch):
    # torch.compile as written, on the aot_eager backend: it traces the same graph as inductor
    # but compiles in a second on a 2-core CI machine (tests/gpu compile with inductor).
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    x = torch.randn(32, 64)
    namespace = {"torch": torch, "Model": lambda *_: Model(), "N_ITER": 3, "x": x}
    exec(compile(code, "<seed example>", "exec"), namespace)
    return namespace


def test_seed_example_dynamic(monkeypatch):
    before = Model()
    ns = run_seed(SEED_DYNAMIC, monkeypatch)
    model = ns["model"]
    assert kinds(model) == {"w1": "AOFloat8Linear", "w2": "AOFloat8Linear", "odd": "Linear", "output": "Linear"}
    moved = (model.w1.weight - before.w1.weight).abs().max()
    assert torch.isfinite(model.w1.weight).all() and moved > 0  # three optimizer steps went through
    assert_fp8_close_to_high_precision(model, ns["x"])


def test_seed_example_delayed(monkeypatch):
    ns = run_seed(SEED_DELAYED, monkeypatch)
    model = ns["model"]
    assert kinds(model) == {"w1": "NativeFP8Linear", "w2": "NativeFP8Linear", "odd": "Linear", "output": "Linear"}
    assert model.w1.scaling == "delayed" and model.w1.amax_compute_algo == "max"
    assert model.w1.fp8_amax_history.shape == (16, 3)
    assert (model.w1.fp8_step == 3).all()  # three steps of amax history, forward and backward
    assert_fp8_close_to_high_precision(model, ns["x"])


def assert_fp8_close_to_high_precision(model, x):
    """The trained model in FP8 against the same weights in high precision."""
    with torch.no_grad():
        fp8 = model(x)
        with get_backend("ao").autocast(None, enabled=False):
            high = model(x)
    assert 20 <= sqnr_db(fp8, high) <= 45
