"""FP8 attention (FP8RecipeKwargs.fp8_dpa, fp8plug.hf.fp8_attention) on the CPU: the recipe field and
its environment, the switch to "fp8plug_fp8_dpa" and the way back, the fall-back to transformers'
SDPA (exactly "sdpa"'s logits, eagerly and compiled), which call would take FP8 attention and why
each other does not, and the warning where FP8 attention cannot run at all.

TransformerEngine cannot run here. Where the switch needs "FP8 attention can run", that answer is
patched in, and where TE must be missing, broken or refusing, a stand-in plays it: only fp8plug's
own decisions are checked. That FP8 attention works is tests/gpu/test_fp8_attention.py's."""

import copy
import logging
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

import fp8plug  # noqa: E402
from fp8plug import FP8RecipeKwargs
from fp8plug.backends import get_backend
from fp8plug.backends.te import attention as _te_attention  # noqa: E402
from fp8plug.checkpoints.export import export_model  # noqa: E402
from fp8plug.hf import (
    attention,
    fp8_attention,  # noqa: E402
)
from fp8plug.hf.attention import FP8PLUG_FP8_DPA, FP8PLUG_SDPA  # noqa: E402
from fp8plug.recipe.plans import Plan, make_plan  # noqa: E402
from fp8plug.tuning.hardware import DeviceInfo  # noqa: E402
from tests.cpu.test_attention import compiled_attention_masks, ids, llama  # noqa: E402

H100 = DeviceInfo("cuda", "NVIDIA H100", (9, 0))
A100 = DeviceInfo("cuda", "NVIDIA A100", (8, 0))


def messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "fp8plug" and r.levelno == level]


@pytest.fixture(autouse=True)
def fresh_logs_and_dynamo():
    """Each test sees the once-per-process messages again, and no compiled graph of another."""
    fp8_attention._logged.clear()
    torch._dynamo.reset()
    yield
    fp8_attention._logged.clear()
    torch._dynamo.reset()


@pytest.fixture
def fp8_attention_runs(monkeypatch):
    """Pretend FP8 attention can run on this machine, so that the switch happens (the calls still
    meet CPU tensors, which run SDPA)."""
    monkeypatch.setattr(_te_attention, "fp8_attention_problem", lambda device=None: None)


@pytest.fixture
def no_te(monkeypatch):
    """TransformerEngine hidden for one test, and whatever stand-in the test imports dropped after it."""
    names = lambda: [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]  # noqa: E731
    for name in names():
        monkeypatch.delitem(sys.modules, name)
    yield monkeypatch
    for name in names():
        del sys.modules[name]


# --- the recipe field ------------------------------------------------------------------------------


def test_fp8_dpa_is_off_by_default_and_read_from_arguments_and_the_environment(monkeypatch):
    assert FP8RecipeKwargs().fp8_dpa is False
    assert FP8RecipeKwargs(fp8_dpa="yes").fp8_dpa is True and FP8RecipeKwargs(fp8_dpa="yes").is_explicit("fp8_dpa")
    monkeypatch.setenv("FP8PLUG_FP8_DPA", "true")
    recipe = FP8RecipeKwargs()
    assert recipe.fp8_dpa is True and not recipe.is_explicit("fp8_dpa")
    assert FP8RecipeKwargs(fp8_dpa=False).fp8_dpa is False  # an argument beats the environment
    monkeypatch.delenv("FP8PLUG_FP8_DPA")
    # `fp8_config: fp8_dpa: true`, as accelerate launch exports it (it adds no second "fp8_")
    monkeypatch.setenv("ACCELERATE_FP8_DPA", "1")
    assert FP8RecipeKwargs().fp8_dpa is True


def test_a_bad_fp8_dpa_names_the_field_and_where_it_came_from(monkeypatch):
    with pytest.raises(ValueError, match=r"FP8RecipeKwargs\.fp8_dpa: 'maybe' is not a boolean"):
        FP8RecipeKwargs(fp8_dpa="maybe")
    monkeypatch.setenv("FP8PLUG_FP8_DPA", "sometimes")
    with pytest.raises(ValueError, match=r"fp8_dpa \(from FP8PLUG_FP8_DPA\): 'sometimes'"):
        FP8RecipeKwargs()
    recipe = FP8RecipeKwargs(fp8_dpa=False)
    with pytest.raises(ValueError, match="fp8_dpa"):
        recipe.fp8_dpa = "maybe"
    assert recipe.fp8_dpa is False  # a bad assignment leaves the recipe as it was


@pytest.mark.parametrize("engine", ["native", "ao", "te", "msamp"])
def test_every_engine_carries_fp8_dpa_into_its_plan_without_calling_it_ignored(engine, recwarn):
    plan = make_plan(get_backend(engine), FP8RecipeKwargs(backend=engine, fp8_dpa=True), DeviceInfo("cpu", "cpu"))
    assert plan.fp8_dpa is True
    assert not [w for w in recwarn if "fp8_dpa" in str(w.message)]
    assert make_plan(get_backend(engine), FP8RecipeKwargs(backend=engine), DeviceInfo("cpu", "cpu")).fp8_dpa is False


def test_the_settings_follow_the_plans_delayed_scaling_or_the_defaults():
    plan = make_plan(get_backend("native"), FP8RecipeKwargs(backend="native", scaling="delayed", margin=2,
                                                            amax_history_len=16, amax_compute_algo="max",
                                                            fp8_format="E4M3", reduce_amax=False,
                                                            use_autocast_during_eval=True, fp8_dpa=True),
                     DeviceInfo("cpu", "cpu"))
    settings = fp8_attention.FP8AttentionSettings.from_plan(plan)
    assert settings == fp8_attention.FP8AttentionSettings("E4M3", 2, 16, "max", False, True)
    assert settings.recipe_arguments() == dict(fp8_format="E4M3", margin=2, amax_history_len=16,
                                               amax_compute_algo="max", reduce_amax=False)
    assert fp8_attention.FP8AttentionSettings.from_plan(Plan(fp8_dpa=True)) == fp8_attention.DEFAULT_SETTINGS


# --- the switch and the way back -------------------------------------------------------------------


def test_conversion_switches_to_fp8_attention_and_export_puts_sdpa_back(fp8_attention_runs, caplog):
    model = llama()
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", fp8_dpa=True))
    assert model.config._attn_implementation == FP8PLUG_FP8_DPA
    assert any("attention through 'fp8plug_fp8_dpa'" in m for m in messages(caplog, logging.INFO))
    keys = set(model.state_dict())
    model(input_ids=ids())  # runs (SDPA on the CPU) and adds nothing to the model
    assert set(model.state_dict()) == keys and fp8_attention.fp8_attention_modules(model) == {}
    export_model(model)
    assert model.config._attn_implementation == "sdpa"
    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    assert attention._note_positions not in hooks and attention._end_positions not in hooks

    model = llama()
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", fp8_dpa=True, skip_causal_mask=False))
    assert model.config._attn_implementation == FP8PLUG_FP8_DPA  # from "sdpa" directly
    fp8plug.unconvert_model(model)
    assert model.config._attn_implementation == "sdpa"

    model = llama()
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    assert model.config._attn_implementation == FP8PLUG_SDPA  # not asked for: off


def test_a_model_on_another_attention_is_left_alone_and_the_log_says_so(fp8_attention_runs, caplog):
    model = llama()
    model.set_attn_implementation("eager")
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", fp8_dpa=True))
    assert model.config._attn_implementation == "eager"
    (warning,) = [m for m in messages(caplog, logging.WARNING) if "fp8_dpa" in m]
    assert "'eager', not 'sdpa'" in warning and "attn_implementation='sdpa'" in warning


def test_a_plain_torch_model_is_not_touched(fp8_attention_runs):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    assert fp8_attention.use_fp8_attention(model, Plan(fp8_dpa=True)) is False


# --- where FP8 attention cannot run at all --------------------------------------------------------


def test_on_a_machine_without_a_gpu_conversion_warns_naming_fp8_dpa_and_keeps_sdpa(caplog):
    model = llama()
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", fp8_dpa=True))
        fp8plug.convert_model(llama(1), recipe=FP8RecipeKwargs(backend="native", fp8_dpa=True))
    assert model.config._attn_implementation == FP8PLUG_SDPA
    warnings = [m for m in messages(caplog, logging.WARNING) if "fp8_dpa" in m]
    assert len(warnings) == 1  # once per process
    assert "FP8RecipeKwargs.fp8_dpa=True" in warnings[0] and "no CUDA GPU" in warnings[0]
    assert "FP8PLUG_FP8_DPA=false" in warnings[0]


def test_missing_te_or_an_old_gpu_is_a_warning_not_an_error(no_te, caplog):
    no_te.setitem(sys.modules, "transformer_engine", None)  # an import of it now fails as "not found"
    assert "TransformerEngine is not installed" in _te_attention.fp8_attention_problem(H100)
    assert "pip install" in _te_attention.fp8_attention_problem(H100)
    assert "compute capability 8.0" in _te_attention.fp8_attention_problem(A100)
    model = llama()
    with caplog.at_level(logging.WARNING, logger="fp8plug"):
        assert fp8_attention.use_fp8_attention(model, Plan(fp8_dpa=True), device=H100) is False
    assert model.config._attn_implementation == "sdpa"
    (warning,) = messages(caplog, logging.WARNING)
    assert "fp8_dpa" in warning and "not installed" in warning


def _stand_in_te(tmp_path, monkeypatch, init_body, recipe_body=""):
    """A `transformer_engine` package on sys.path: `init_body` in its __init__, `recipe_body` in
    common/recipe.py, an empty pytorch module."""
    package = tmp_path / "transformer_engine"
    (package / "common").mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(init_body))
    (package / "pytorch.py").write_text("")
    (package / "common" / "__init__.py").write_text("")
    (package / "common" / "recipe.py").write_text(textwrap.dedent(recipe_body))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_broken_te_or_one_without_fp8_attention_is_reported(tmp_path, no_te):
    _stand_in_te(tmp_path, no_te, "raise OSError('libcudnn.so.9: cannot open shared object file')\n")
    problem = _te_attention.fp8_attention_problem(H100)
    assert "installed but not importable" in problem and "OSError" in problem
    for name in [n for n in sys.modules if n.startswith("transformer_engine")]:
        del sys.modules[name]
    old = tmp_path / "old"
    _stand_in_te(old, no_te, "__version__ = '1.0'\n", """
        import dataclasses

        @dataclasses.dataclass
        class DelayedScaling:
            margin: int = 0
        """)
    problem = _te_attention.fp8_attention_problem(H100)
    assert "TransformerEngine 1.0 has no FP8 attention" in problem and "upgrade" in problem


# --- which call takes FP8 attention, and the fall-back ---------------------------------------------


def _fake(shape, dtype=torch.bfloat16, cuda=True):
    """What why_sdpa reads of a tensor: a CUDA bf16 tensor of `shape`, without a GPU. Its device
    type, which says whose autocast applies, is the CPU's, so that a test can turn autocast on."""
    return SimpleNamespace(is_cuda=cuda, shape=torch.Size(shape), dtype=dtype, device=torch.device("cpu"))


def test_only_a_training_causal_call_without_a_mask_on_cuda_takes_fp8_attention():
    module = SimpleNamespace(training=True, is_causal=True)
    q, kv = _fake((2, 8, 256, 64)), _fake((2, 2, 256, 64))
    call = dict(attention_mask=None, dropout=0.0, is_causal=None, kwargs={"position_ids": object()})

    def why(**changes):
        args = dict(call, **changes)
        return fp8_attention.why_sdpa(args.pop("module", module), args.pop("q", q), args.pop("k", kv),
                                      args.pop("v", kv), **args)

    assert why() is None  # grouped-query heads, position ids passed along: FP8 attention
    assert why(is_causal=False) == "the attention is not causal"
    assert "not on a CUDA GPU" in why(q=_fake((2, 8, 256, 64), cuda=False))
    assert "eval mode" in why(module=SimpleNamespace(training=False, is_causal=True))
    in_eval = fp8_attention.FP8AttentionSettings(in_eval=True)
    assert fp8_attention.why_sdpa(SimpleNamespace(training=False), q, kv, kv, None, 0.0, True, {}, in_eval) is None
    assert "attention mask" in why(attention_mask=torch.ones(1, dtype=torch.bool))
    assert "dropout" in why(dropout=0.1)
    assert "not as many" in why(k=_fake((2, 2, 300, 64)), v=_fake((2, 2, 300, 64)))
    assert why(kwargs={"sliding_window": 128}) == "the model passes sliding_window"
    assert why(kwargs={"sliding_window": None}) is None
    assert "float32" in why(q=_fake((2, 8, 256, 64), torch.float32))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 weights under bf16 autocast: RoPE'd q, k in float32
        assert why(q=_fake((2, 8, 256, 64), torch.float32), k=_fake((2, 2, 256, 64), torch.float32)) is None
        assert fp8_attention.compute_dtype(torch.zeros(1)) == torch.bfloat16
    assert fp8_attention.compute_dtype(torch.zeros(1)) == torch.float32
    assert "head dims are 72" in why(q=_fake((2, 8, 256, 72)), k=_fake((2, 2, 256, 72)), v=_fake((2, 2, 256, 72)))
    assert "not a multiple" in why(k=_fake((2, 3, 256, 64)), v=_fake((2, 3, 256, 64)))


def test_on_the_cpu_the_switched_model_computes_exactly_what_sdpa_computes(fp8_attention_runs, caplog):
    plain = llama()
    model = copy.deepcopy(plain)
    assert fp8_attention.use_fp8_attention(model, Plan(fp8_dpa=True))
    plain.train(), model.train()
    batch = ids()
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        for _ in range(2):
            assert torch.equal(model(input_ids=batch).logits, plain(input_ids=batch).logits)
    falls_back = [m for m in messages(caplog, logging.INFO) if "instead of FP8 attention" in m]
    assert falls_back == ["fp8plug: fp8_dpa: transformers' SDPA instead of FP8 attention where the tensors are "
                          "not on a CUDA GPU."]  # once, for four calls
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :5] = 0  # left padding: the mask still reaches SDPA
    assert torch.equal(model(input_ids=batch, attention_mask=mask).logits,
                       plain(input_ids=batch, attention_mask=mask).logits)
    with torch.no_grad():
        prompt = ids(batch=1, seq=8)
        assert torch.equal(model.eval().generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True),
                           plain.eval().generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True))


def test_compiled_it_is_sdpa_with_is_causal_in_one_graph(fp8_attention_runs, caplog):
    plain = llama()
    model = copy.deepcopy(plain)
    fp8_attention.use_fp8_attention(model, Plan(fp8_dpa=True))
    model.train()
    graphs = []
    with caplog.at_level(logging.INFO, logger="fp8plug"):
        calls, logits = compiled_attention_masks(model, input_ids=ids())
    assert calls == [(False, True)] * 2  # no mask built, is_causal, as "fp8plug_sdpa" compiled
    (note,) = [m for m in messages(caplog, logging.INFO) if "instead of FP8 attention" in m]
    assert "under torch.compile" in note  # said once, while tracing

    def count(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=count)(input_ids=ids())
    assert len(graphs) == 1  # the attention function breaks no graph
    with torch.no_grad():
        reference = plain.train()(input_ids=ids()).logits
    assert float((logits - reference).norm() / reference.norm()) < 1e-5


def test_a_call_te_refuses_falls_back_to_sdpa_once_and_for_good(monkeypatch, caplog):
    built = []

    class Refusing:
        def __init__(self, *args):
            built.append(args)

        def __call__(self, *args):
            raise ValueError("No dot product attention backend is available for the provided inputs.")

    monkeypatch.setattr(_te_attention, "TEAttention", Refusing)
    monkeypatch.setattr(_te_attention, "attention_recipe", lambda **kwargs: "recipe")
    module = torch.nn.Module()
    q, kv = torch.zeros(1, 4, 16, 16), torch.zeros(1, 2, 16, 16)
    with caplog.at_level(logging.WARNING, logger="fp8plug"):
        for _ in range(3):
            assert fp8_attention._fp8(module, q, kv, kv, None, fp8_attention.DEFAULT_SETTINGS) is None
    assert len(built) == 1  # tried once, then remembered
    (warning,) = messages(caplog, logging.WARNING)
    assert "fp8_dpa" in warning and "No dot product attention backend" in warning and "SDPA from now on" in warning
    assert fp8_attention.fp8_attention_modules(torch.nn.Sequential(module)) == {}

    class OutOfMemory(Refusing):
        def __call__(self, *args):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(_te_attention, "TEAttention", OutOfMemory)
    with pytest.raises(torch.cuda.OutOfMemoryError):  # not a refusal: the user must see it
        fp8_attention._fp8(torch.nn.Module(), q, kv, kv, None, fp8_attention.DEFAULT_SETTINGS)


def test_the_te_attention_is_made_once_per_module_and_shape_and_gets_the_compute_dtype(monkeypatch):
    """A recording stand-in for TE's attention: fp8plug's plumbing only (what it is built with,
    how often, what it is handed, what comes back), not FP8 attention."""

    class Recording:
        made = []

        def __init__(self, heads, kv_heads, head_dim, value_dim, scale, recipe, device):
            self.made.append((heads, kv_heads, head_dim, value_dim, scale, recipe))
            self.seen, self.calls = [], 0

        def __call__(self, query, key, value, training):
            self.seen.append((query.dtype, key.dtype, value.dtype, training))
            self.calls += 1
            return torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1], dtype=query.dtype)

    monkeypatch.setattr(_te_attention, "TEAttention", Recording)
    monkeypatch.setattr(_te_attention, "attention_recipe", lambda **kwargs: tuple(sorted(kwargs.items())))
    module = torch.nn.Module()
    q, kv = torch.zeros(1, 4, 16, 16), torch.zeros(1, 2, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            out = fp8_attention._fp8(module, q, kv, kv.bfloat16(), 0.25, fp8_attention.DEFAULT_SETTINGS)
    assert out.shape == (1, 16, 4, 16) and out.dtype == torch.bfloat16
    assert Recording.made == [(4, 2, 16, 16, 0.25, tuple(sorted(fp8_attention.DEFAULT_SETTINGS.recipe_arguments()
                                                                .items())))]
    (runner,) = fp8_attention.fp8_attention_modules(torch.nn.ModuleDict({"attn": module})).values()
    assert runner.seen == [(torch.bfloat16,) * 3 + (True,)] * 2 and runner.calls == 2
    fp8_attention._fp8(module, torch.zeros(1, 8, 16, 16), kv, kv, 0.25, fp8_attention.DEFAULT_SETTINGS)
    assert len(Recording.made) == 2  # another shape: another TE module beside the first


def test_te_gets_bshd_without_a_copy_where_transformers_lays_tensors_out_so():
    """transformers' [B, H, T, D] tensors are transposed views of [B, T, H, D]: TE's "bshd" takes
    them as they are. A contiguous [B, H, T, D] tensor (another model's layout) is copied once,
    since TE views heads and head dim as one (it refused it with a view error on the H100)."""
    bthd = torch.randn(2, 16, 4, 8)
    as_transformers = bthd.transpose(1, 2)
    got = _te_attention._bshd(as_transformers)
    assert got.data_ptr() == bthd.data_ptr() and torch.equal(got, bthd)
    contiguous = as_transformers.contiguous()
    got = _te_attention._bshd(contiguous)
    assert got.is_contiguous() and got.data_ptr() != contiguous.data_ptr() and torch.equal(got, bthd)

