"""fp8plug.Accelerator on the CPU with the native engine: handlers, precision, prepare, checkpoints."""

import contextlib

import pytest
import torch
from accelerate.utils import DistributedDataParallelKwargs, MSAMPRecipeKwargs
from accelerate.utils.dataclasses import FP8BackendType
from safetensors.torch import load_file
from torch import nn

import fp8plug
from fp8plug import BackendUnavailableError, ConversionError, FP8RecipeKwargs
from fp8plug.backends.native.engine import NativeEngine, NativeFP8Linear
from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, synthetic_batches
from fp8plug.checkpoints.state import install_plain_state_dict
from fp8plug.integrations.accelerator import _rebind_optimizers
from tests.support.hf import fresh
from tests.support.training import train

CFG = DecoderConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=32)


def make(recipe=None, **kwargs):
    recipe = recipe or FP8RecipeKwargs(backend="native", amax_history_len=4)
    return fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[recipe], **kwargs)


def model_and_optimizer(seed=0, lr=1e-2):
    torch.manual_seed(seed)
    model = TinyDecoder(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def batches(n, seed=1):
    return synthetic_batches(n, batch=2, seq=16, vocab=CFG.vocab_size, seed=seed)


# --- construction ----------------------------------------------------------------------------------


def test_kwargs_handler_beside_accelerates_own():
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    recipe = FP8RecipeKwargs(backend="native")
    acc = fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[ddp, recipe])
    assert acc.mixed_precision == "fp8"
    assert acc.state.mixed_precision == "bf16"  # what accelerate runs outside the FP8 Linears
    assert acc.fp8_engine.name == "native" and acc.fp8_recipe is recipe
    assert acc.fp8_backend == "native" and acc.fp8_backend.value == "native"  # names the engine
    assert all(acc.fp8_backend != member for member in FP8BackendType)  # accelerate's own FP8 stays off
    assert acc.ddp_handler is ddp


def test_fp8_from_launch_environment(monkeypatch):
    # what `accelerate launch` exports for a config with `backend: NATIVE` and the wizard's keys
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "NATIVE")
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LEN", "1024")  # launch's default, always exported
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LENGTH", "16")
    acc = fp8plug.Accelerator(cpu=True)
    assert acc.mixed_precision == "fp8" and acc.fp8_engine.name == "native"
    assert acc.fp8_recipe.amax_history_len == 16


def test_no_fp8_means_plain_accelerate():
    acc = fp8plug.Accelerator(cpu=True, mixed_precision="bf16")
    assert acc.mixed_precision == "bf16" and acc.fp8_engine is None
    model, optimizer = model_and_optimizer()
    model, optimizer = acc.prepare(model, optimizer)
    assert not any(isinstance(m, NativeFP8Linear) for m in model.modules())


@pytest.mark.parametrize("precision", [None, "bf16", "no"])
def test_recipe_without_fp8_precision_is_an_error(precision):
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        fp8plug.Accelerator(cpu=True, mixed_precision=precision, kwargs_handlers=[FP8RecipeKwargs(backend="native")])


def test_accelerates_own_fp8_handler_is_refused():
    with pytest.raises(ValueError, match="use fp8plug.FP8RecipeKwargs"):
        fp8plug.Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[MSAMPRecipeKwargs()])


@pytest.mark.parametrize("backend, hint", [("te", "TransformerEngine"), ("msamp", "MS-AMP")])
def test_engine_that_cannot_run_is_an_error_not_a_fallback(backend, hint):
    with pytest.raises(BackendUnavailableError) as info:
        make(FP8RecipeKwargs(backend=backend))
    message = str(info.value)
    assert "cannot run here" in message and hint in message and "\n" not in message  # one line
    assert "needs a CUDA GPU" in message or "runs only on CUDA GPUs" in message  # this is a CPU: no install hint
    assert "install it with" not in message


def test_launch_asking_for_an_engine_that_cannot_run_is_an_error(monkeypatch):
    # `accelerate launch --mixed_precision fp8 --fp8_backend te` on a machine without TransformerEngine
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "te")
    with pytest.raises(BackendUnavailableError, match="cannot run here"):
        fp8plug.Accelerator(cpu=True)


def test_bad_scaling_fails_at_construction():
    with pytest.raises(ValueError, match="scaling"):
        make(FP8RecipeKwargs(backend="native", scaling="columnwise"))


# --- prepare ---------------------------------------------------------------------------------------


def test_prepare_converts_once_and_runs_fp8_under_bf16_autocast(monkeypatch):
    import accelerate

    for name in ("_prepare_te", "_prepare_ao", "_prepare_msamp"):  # accelerate's own FP8 must not run
        monkeypatch.setattr(accelerate.Accelerator, name, lambda *a, **k: pytest.fail("accelerate's FP8 ran"))
    acc = make(FP8RecipeKwargs(backend="native", modules_to_ignore=["lm_head"]))
    model, optimizer = model_and_optimizer()
    model, optimizer = acc.prepare(model, optimizer)
    assert len(acc.fp8_reports) == 1 and len(acc.fp8_reports[0].converted) == 7
    assert acc.fp8_reports[0].skipped["lm_head"] == "listed in modules_to_ignore"
    assert {id(p) for p in model.parameters()} == {id(p) for g in optimizer.param_groups for p in g["params"]}

    seen = {}
    model.lm_head.register_forward_hook(lambda m, i, o: seen.__setitem__("head", o.dtype))
    tokens = batches(1)[0]
    q = model.layers[0].q
    out = model(tokens)
    assert seen["head"] == torch.bfloat16  # the rest runs under bf16 autocast
    assert out.dtype == torch.float32  # accelerate's fp32 output wrapper
    recorded = q.fp8_amax_recorded.tolist()
    assert recorded[0] > 0 and recorded[1] > 0 and recorded[2] < 0  # FP8 ran: input and weight amaxes

    model.eval()
    model(tokens)
    assert q.fp8_amax_recorded.tolist() == recorded  # eval runs in high precision
    model.train()

    again = acc.prepare(model)
    assert again is model and len(acc.fp8_reports) == 1  # not converted twice


def test_several_models_and_optimizers_in_one_call():
    acc = make()
    first, opt1 = model_and_optimizer(0)
    second, opt2 = model_and_optimizer(1)
    first, second, opt1, opt2 = acc.prepare(first, second, opt1, opt2)
    assert len(acc.fp8_reports) == 2
    for model, opt in ((first, opt1), (second, opt2)):
        assert isinstance(model.layers[0].up, NativeFP8Linear)
        assert {id(p) for p in model.parameters()} == {id(p) for g in opt.param_groups for p in g["params"]}


class CloningNative(NativeEngine):
    """Native, but conversion makes new Parameter objects (as TransformerEngine does): tests that
    prepare() moves the optimizer to them. Not a claim about any real engine."""

    def convert_listed(self, model, plan, modules, report):
        super().convert_listed(model, plan, modules, report)
        for module in model.modules():
            if isinstance(module, NativeFP8Linear):
                module.weight = nn.Parameter(module.weight.detach().clone())


def test_prepare_rebinds_optimizer_to_new_parameters():
    acc = make()
    acc.fp8_engine = CloningNative()
    model, optimizer = model_and_optimizer()
    old_q = model.layers[0].q.weight
    model, optimizer = acc.prepare(model, optimizer)
    new_q = model.layers[0].q.weight
    assert new_q is not old_q
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert id(new_q) in held and id(old_q) not in held
    before = new_q.detach().clone()
    train(model, optimizer, batches(1), accelerator=acc)
    assert not torch.equal(before, new_q.detach())  # the model's own weights trained: nothing stale


def test_rebind_moves_optimizer_state_and_refuses_removed_parameters():
    old, kept, new = (nn.Parameter(torch.ones(2)) for _ in range(3))
    optimizer = torch.optim.AdamW([old, kept])
    optimizer.state[old] = {"exp_avg": torch.full((2,), 3.0)}
    _rebind_optimizers([optimizer], {"a": old, "b": kept}, {"a": new, "b": kept}, "Net")
    assert optimizer.param_groups[0]["params"][0] is new
    assert optimizer.state[new]["exp_avg"][0] == 3.0 and old not in optimizer.state
    with pytest.raises(ConversionError, match=r"\['b'\]"):
        _rebind_optimizers([optimizer], {"b": kept}, {}, "Net")


def test_second_accelerator_refuses_a_prepared_model():
    """A model prepared by one fp8plug.Accelerator is refused, clearly, by a second one, which
    would otherwise ignore its own recipe for it, save no FP8 state for it and report no coverage."""
    first = make()
    model, optimizer = model_and_optimizer()
    model, optimizer = first.prepare(model, optimizer)
    first.prepare(model)  # the same Accelerator again: fine
    fresh()
    second = make(FP8RecipeKwargs(backend="native", amax_history_len=8))
    with pytest.raises(ConversionError, match=r"^prepare\(\): argument 0: TinyDecoder was already prepared by another "
                                               r"Accelerator.*one fp8plug.Accelerator only") as error:
        second.prepare(model)
    assert "\n" not in str(error.value)


def test_a_model_compiled_before_prepare_is_converted_inside_its_wrapper():
    """torch.compile(model) before prepare is one of the ways users hold a model. The
    wrapper traces at its first call, so the model inside is converted in place and the wrapper
    kept; training then runs every Linear in FP8 (the 'eager' backend: dynamo's tracing, no
    inductor build on the CPU)."""
    acc = make()
    model, optimizer = model_and_optimizer()
    compiled = torch.compile(model, backend="eager")
    prepared, optimizer = acc.prepare(compiled, optimizer)
    assert prepared is compiled and acc.fp8_models == [model]
    converted = sum(isinstance(m, NativeFP8Linear) for m in model.modules())
    assert converted > 0 and converted == len(acc.fp8_reports[0].converted)
    train(prepared, optimizer, batches(3), accelerator=acc)
    coverage = fp8plug.fp8_coverage(prepared)
    assert coverage["fp8_gemms"] == 3 * converted and coverage["high_precision_gemms"] == 0



def test_sharded_or_ddp_wrapped_model_is_refused(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    acc = make()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ConversionError, match="already sharded with FSDP2"):
            acc.prepare(sharded)
        with pytest.raises(ConversionError, match="already wrapped in DistributedDataParallel"):
            acc.prepare(nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 32))))
    finally:
        dist.destroy_process_group()
    assert not acc.fp8_reports


class CountingNative(NativeEngine):
    """Native plus a record of the after-step and micro-batch calls prepare() and accumulate() make
    (tests fp8plug's own wiring, not an engine)."""

    def __init__(self):
        self.steps = 0
        self.firsts = []

    def end_step(self, models, group=None):
        self.steps += 1

    def microbatch(self, is_first):
        self.firsts.append(is_first)
        return contextlib.nullcontext()


def test_accumulate_hooks_after_step_and_first_microbatch():
    acc = make(gradient_accumulation_steps=3)
    engine = acc.fp8_engine = CountingNative()
    model, optimizer = model_and_optimizer()
    model, optimizer = acc.prepare(model, optimizer)
    train(model, optimizer, batches(6), accelerator=acc)
    assert engine.firsts == [True, False, False, True, False, False]
    assert engine.steps == 2  # once per real optimizer step, not per micro-batch


def test_after_step_hook_for_an_optimizer_prepared_after_its_model():
    acc = make()
    engine = acc.fp8_engine = CountingNative()
    model, optimizer = model_and_optimizer()
    model = acc.prepare(model)
    optimizer = acc.prepare(optimizer)
    train(model, optimizer, batches(2), accelerator=acc)
    assert engine.steps == 2


def test_unwrap_without_fp32_wrapper_still_runs():
    acc = make()
    model, _ = model_and_optimizer()
    model = acc.prepare(model)
    inner = acc.unwrap_model(model, keep_fp32_wrapper=False)
    tokens = batches(1)[0]
    assert inner(tokens).shape == (2, 16, CFG.vocab_size)
    assert inner.layers[0].q.fp8_amax_recorded[0] > 0  # still the FP8 model


@pytest.mark.slow
def test_torch_compile_after_conversion():
    acc = make(dynamo_backend="eager")
    model, optimizer = model_and_optimizer()
    model, optimizer = acc.prepare(model, optimizer)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    train(model, optimizer, batches(2), accelerator=acc)
    assert acc.unwrap_model(model).layers[0].q.fp8_step.tolist() == [2, 2, 2]


# --- checkpoints -----------------------------------------------------------------------------------


def test_state_dicts_have_plain_keys_and_load_strictly_both_ways(tmp_path):
    acc = make()
    model, optimizer = model_and_optimizer()
    plain_keys = set(TinyDecoder(CFG).state_dict())
    model, optimizer = acc.prepare(model, optimizer)
    train(model, optimizer, batches(1), accelerator=acc)

    got = acc.get_state_dict(model)
    assert set(got) == plain_keys
    assert set(acc.unwrap_model(model).state_dict()) == plain_keys
    acc.save_model(model, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == plain_keys

    plain = TinyDecoder(CFG)
    plain.load_state_dict(saved, strict=True)
    assert torch.equal(plain.layers[0].q.weight, model.layers[0].q.weight.detach())

    torch.manual_seed(5)
    source = TinyDecoder(CFG)
    acc.unwrap_model(model).load_state_dict(source.state_dict(), strict=True)
    assert torch.equal(model.layers[0].q.weight.detach(), source.layers[0].q.weight)


class ExtraStateLinear(nn.Linear):
    """A Linear with an engine-style `_extra_state` entry (as TransformerEngine modules have)."""

    def get_extra_state(self):
        return torch.tensor([7.0])

    def set_extra_state(self, state):
        self.loaded_extra = state


class DropsExtraState:
    """The one engine method install_plain_state_dict relies on (tests fp8plug's hooks only)."""

    def plain_entries(self, state_dict):
        return {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}


def test_plain_state_dict_hooks_hide_engine_entries():
    model = nn.Sequential(ExtraStateLinear(16, 16), nn.LayerNorm(16))
    assert "0._extra_state" in model.state_dict()
    install_plain_state_dict(model, DropsExtraState())
    plain = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    assert set(model.state_dict()) == set(plain.state_dict())
    model.load_state_dict(plain.state_dict(), strict=True)  # no _extra_state in a plain checkpoint
    assert torch.equal(model[0].weight, plain[0].weight)
    wrapper = nn.ModuleDict({"inner": model})  # the hooks apply under a prefix too
    assert set(wrapper.state_dict()) == {f"inner.{k}" for k in plain.state_dict()}
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({"0.weight": plain[0].weight}, strict=True)  # real keys still checked


def test_save_state_load_state_resumes_identically(tmp_path):
    data = batches(6)
    acc = make()
    model, optimizer = model_and_optimizer(seed=0)
    model, optimizer = acc.prepare(model, optimizer)
    train(model, optimizer, data[:3], accelerator=acc)
    acc.save_state(tmp_path / "ckpt")
    saved_history = model.layers[0].q.fp8_amax_history.clone()
    reference = train(model, optimizer, data[3:], accelerator=acc)
    reference_weights = {k: v.clone() for k, v in acc.get_state_dict(model).items()}

    def resumed(break_fp8_state=False):
        fresh()
        acc2 = make()
        model2, optimizer2 = model_and_optimizer(seed=123)  # other weights: the load must replace them
        model2, optimizer2 = acc2.prepare(model2, optimizer2)
        acc2.load_state(tmp_path / "ckpt")
        assert torch.equal(model2.layers[0].q.fp8_amax_history, saved_history)
        if break_fp8_state:
            for m in model2.modules():
                if isinstance(m, NativeFP8Linear):
                    m.fp8_amax_history.zero_()
                    m.fp8_scale.fill_(1.0)
                    m.fp8_step.zero_()
        return acc2, model2, train(model2, optimizer2, data[3:], accelerator=acc2)

    acc2, model2, losses = resumed()
    assert losses == reference  # bit-identical
    for key, value in acc2.get_state_dict(model2).items():
        assert torch.equal(value, reference_weights[key]), key
    # control: the FP8 scaling state matters; without it the run does not continue identically
    _, _, losses_without = resumed(break_fp8_state=True)
    assert losses_without != reference


def test_load_state_with_another_backend_or_model_count_is_an_error(tmp_path):
    acc = make()
    model, optimizer = model_and_optimizer()
    model, optimizer = acc.prepare(model, optimizer)
    acc.save_state(tmp_path / "ckpt")
    state = acc.fp8_checkpoint_state
    saved = state.state_dict()
    with pytest.raises(ValueError, match="backend 'te'"):
        state.load_state_dict({**saved, "backend": "te"})
    with pytest.raises(ValueError, match="2 converted model"):
        state.load_state_dict({**saved, "models": saved["models"] * 2})


def test_storage_view_for_fsdp2_parameter_mapping():
    # torchao's float8 all-gather weight has no storage of its own; accelerate's FSDP2 mapping by
    # data pointer needs the wrapped tensor (same storage) instead.
    torchao_float8 = pytest.importorskip("torchao.float8")
    from fp8plug.integrations.accelerator import storage_view

    model = nn.Sequential(nn.Linear(32, 32))
    storage = model[0].weight.data_ptr()
    config = torchao_float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    torchao_float8.convert_to_float8_training(model, config=config)
    weight = model[0].weight
    assert weight.data_ptr() == 0
    assert storage_view(weight).data_ptr() == storage
    plain = nn.Parameter(torch.ones(2))
    assert storage_view(plain) is plain


def test_float8_all_gather_only_under_fsdp2():
    # `accelerate launch` exports ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER=true unasked; without
    # FSDP2 the torchao engine gets plain weights
    pytest.importorskip("torchao.float8")
    acc = make(FP8RecipeKwargs(backend="ao", enable_fsdp_float8_all_gather=True))
    model, optimizer = model_and_optimizer()
    model, optimizer = acc.prepare(model, optimizer)
    assert type(model.layers[0].q.weight) is nn.Parameter
    assert acc.fp8_recipe.enable_fsdp_float8_all_gather  # the user's recipe is left as given
    losses = train(model, optimizer, batches(2), accelerator=acc)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_example_script_resumes_identically(tmp_path, monkeypatch):
    # examples/train_accelerate.py --save-at/--resume, as `accelerate launch` would run it twice
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "train_accelerate.py"
    spec = importlib.util.spec_from_file_location("train_accelerate", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "native")
    common = ["--steps", "6", "--dim", "32", "--ffn", "64", "--layers", "1", "--heads", "2", "--seq", "16",
              "--vocab", "64", "--batch", "2"]
    script.main(common + ["--save-at", "3", "--save-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "a")])
    fresh()
    script.main(common + ["--resume", str(tmp_path / "ckpt"), "--out", str(tmp_path / "b")])
    full = json.loads((tmp_path / "a" / "rank0.json").read_text())
    resumed = json.loads((tmp_path / "b" / "rank0.json").read_text())
    assert resumed["start_step"] == 3 and resumed["losses"] == full["losses"][3:]
    assert resumed["weights"] == full["weights"]


def test_optimizer_states_field_swaps_adamw_for_a_low_bit_one(monkeypatch):
    """The opt-in recipe field reaches prepare(); without it the user's optimizer is kept."""
    AdamW8bit = pytest.importorskip("torchao.optim", reason="needs torchao (its low-bit AdamW)").AdamW8bit

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = fp8plug.Accelerator(mixed_precision="fp8", cpu=True,
                              kwargs_handlers=[fp8plug.FP8RecipeKwargs(backend="native", optimizer_states="8bit")])
    model, opt = acc.prepare(model, opt)
    assert isinstance(opt.optimizer, AdamW8bit)
    fresh()
    model = nn.Sequential(nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = fp8plug.Accelerator(mixed_precision="fp8", cpu=True,
                              kwargs_handlers=[fp8plug.FP8RecipeKwargs(backend="native")])
    model, opt = acc.prepare(model, opt)
    assert type(opt.optimizer) is torch.optim.AdamW
