"""Accelerate's meaning kept: `convert_model(model)` called as Accelerate's API
converts to TransformerEngine where TE runs, while the speed-ranked automatic choice stays the
Accelerator's default and is `backend="auto"` away; where TE does not run, the automatic choice
converts and the reason is logged. An Accelerate script with its import line swapped for
fp8plug's runs unchanged (tests/support/accelerate_script.py).

TransformerEngine cannot run on a CPU: where these tests need it to be "usable", engines are
reported importable and the device reported as an H100, and conversion is replaced by a recorder
of the engine chosen. They check fp8plug's choice only, never that an engine works; the script
running for real with TE is tests/gpu/test_accelerate_script.py.
"""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs, TERecipeKwargs, api, autocast, backends, coverage
from fp8plug.backends import get_backend
from fp8plug.backends.base import Probe
from fp8plug.layers.rules import ConversionReport
from fp8plug.tuning.hardware import DeviceInfo
from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "accelerate_script.py"
ACCELERATE_IMPORT = "from accelerate.utils import "
H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", (9, 0))


def swapped_script(tmp_path) -> Path:
    """tests/support/accelerate_script.py with its one `from accelerate.utils import ...` line importing
    the same names from fp8plug instead, and nothing else changed."""
    text = SCRIPT.read_text()
    assert text.count(ACCELERATE_IMPORT) == 1
    path = Path(tmp_path) / "accelerate_script_fp8plug.py"
    path.write_text(text.replace(ACCELERATE_IMPORT, "from fp8plug import "))
    return path


def run_script(path, tmp_path, prelude: str = "", timeout: int = 600):
    """Run the script at `path` in a child Python after `prelude` (code run first, in the child)."""
    code = prelude + f"\nimport runpy\nrunpy.run_path({str(path)!r}, run_name='__main__')\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, env=child_env(tmp_path))


# --- the choice, in this process (selection logic only) -----------------------------------------------


def _available(monkeypatch, *names):
    for name in ("msamp", "te", "ao", "native"):
        probe = Probe(True, "test") if name in names else Probe(False, reason="not installed")
        monkeypatch.setattr(get_backend(name), "probe", lambda probe=probe: probe)


@pytest.fixture
def chosen(monkeypatch):
    """On a reported H100 where TE, torchao and native import: the engines convert_model converts
    with, call by call (nothing is converted). TE is measured slower than native here, as on the
    real H100, so the speed-ranked choice is not TE."""
    _available(monkeypatch, "te", "ao", "native")
    monkeypatch.setattr(backends, "device_info", lambda device=None: H100)
    names = []
    monkeypatch.setattr(api, "make_plan", lambda engine, recipe, device, auto_filter=False: None)
    monkeypatch.setattr(api, "plan_model", lambda model, engine, plan, linear=True, norm=None:
                        names.append(engine.name) or engine)
    monkeypatch.setattr(api, "apply_plan", lambda model, engine: ConversionReport(engine.name))
    coverage._NOTED.clear()
    yield names
    coverage._NOTED.clear()


def _model():
    return nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32))


def test_accelerates_call_converts_to_te_where_te_runs(chosen):
    ranked = backends.select_backend(None, H100).name
    assert ranked != "te"  # the Accelerator's default differs, so the test below means something
    fp8plug.convert_model(_model())
    fp8plug.convert_model(_model(), True, True, True)  # Accelerate's positional signature
    assert chosen == ["te", "te"]


@pytest.mark.parametrize("how", [{"backend": "auto"}, {"recipe": FP8RecipeKwargs()},
                                 {"compiled": None, "backend": "AUTO"}])
def test_the_speed_ranked_choice_is_one_argument_away(chosen, how):
    fp8plug.convert_model(_model(), **how)
    assert chosen == [backends.select_backend(None, H100).name] and chosen != ["te"]


def test_a_known_mode_ranks_by_speed(chosen):
    fp8plug.convert_model(_model(), compiled=True)
    assert chosen == [backends.select_backend(None, H100, compiled=True).name]


def test_an_engine_named_by_accelerate_launch_is_taken(chosen, monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "ao")
    fp8plug.convert_model(_model())
    assert chosen == ["ao"]


def test_without_te_the_automatic_choice_converts_and_says_why_once(chosen, monkeypatch, caplog):
    _available(monkeypatch, "ao", "native")
    with caplog.at_level(logging.WARNING, logger="fp8plug"):
        fp8plug.convert_model(_model())
        fp8plug.convert_model(_model())
    assert chosen == [backends.select_backend(None, H100).name] * 2
    notes = [r.getMessage() for r in caplog.records if "converts to TransformerEngine where it runs" in r.getMessage()]
    assert len(notes) == 1
    assert "TransformerEngine cannot run here (not installed" in notes[0] and f"converts with {chosen[0]}" in notes[0]


def test_on_this_cpu_accelerates_call_converts_with_the_automatic_choice(caplog):
    coverage._NOTED.clear()
    model = _model()
    with caplog.at_level(logging.WARNING, logger="fp8plug"):
        report = fp8plug.convert_model(model)
    assert report.backend == backends.select_backend(None, "cpu").name
    assert fp8plug.has_fp8_layers(model) and not fp8plug.has_transformer_engine_layers(model)
    assert any("TransformerEngine cannot run here (needs a CUDA GPU" in r.getMessage() for r in caplog.records)


# --- the autocast follows the conversion ---------------------------------------------------------------


def test_an_autocast_with_no_engine_named_is_the_converting_engines(monkeypatch):
    """After a conversion, `apply_fp8_autowrap(model, FP8RecipeKwargs())` runs the forward in that
    engine's autocast, not the automatic choice's (an H100's ranked choice under TE layers left
    them in high precision). Here native converts while torchao, first on a CPU, is usable."""
    if backends.select_backend(None, "cpu").name == "native":
        pytest.skip("torchao is not usable here: the automatic choice is native already")
    entered = []
    for name in ("ao", "native"):
        engine = get_backend(name)
        monkeypatch.setattr(engine, "autocast", lambda plan=None, enabled=True, name=name, original=engine.autocast:
                            entered.append(name) or original(plan, enabled))
    model = nn.Sequential(nn.Linear(32, 32))
    fp8plug.convert_model(model, backend="native")
    fp8plug.apply_fp8_autowrap(model, FP8RecipeKwargs())
    model(torch.randn(16, 32))
    assert entered == ["native"]


def test_an_unconverted_model_keeps_the_automatic_choice():
    assert autocast._engine_holding(nn.Sequential(nn.Linear(32, 32))) is None
    assert autocast._engine_holding(lambda x: x) is None


# --- TERecipeKwargs ------------------------------------------------------------------------------------


def test_te_recipe_kwargs_is_the_te_recipe_with_accelerates_fields():
    assert TERecipeKwargs(amax_history_len=16) == FP8RecipeKwargs(backend="te", amax_history_len=16)
    assert TERecipeKwargs(use_mxfp8_block_scaling=True).scaling == "mxfp8"
    with pytest.raises(TypeError, match="names TransformerEngine itself"):
        TERecipeKwargs(backend="ao")


def test_fp8plug_has_every_name_the_script_imports():
    import accelerate.utils

    line = next(line for line in SCRIPT.read_text().splitlines() if line.startswith(ACCELERATE_IMPORT))
    names = [n.strip() for n in line[len(ACCELERATE_IMPORT):].split("#")[0].split(",")]
    assert {"convert_model", "has_transformer_engine_layers", "contextual_fp8_autocast", "apply_fp8_autowrap",
            "TERecipeKwargs"} <= set(names)
    for name in names + ["FP8RecipeKwargs"]:
        assert hasattr(accelerate.utils, name) and hasattr(fp8plug, name), name


# --- the Accelerate script, swapped to fp8plug, in a child process -------------------------------------

# Selection only: the device reported as an H100 where every engine imports, and conversion
# stopped where it would begin, saying which engine it would be and from which line of the script.
_FAKE_H100_PRELUDE = '''
import sys, traceback
from fp8plug import api, backends
from fp8plug.backends import get_backend
from fp8plug.backends.base import Probe
from fp8plug.tuning.hardware import DeviceInfo

H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
backends.device_info = lambda device=None: H100
for _name in ("msamp", "te", "ao", "native"):
    get_backend(_name).probe = (lambda: Probe(True, "fake")) if _name != "msamp" else (lambda: Probe(False, reason="not installed"))

class Reached(Exception):
    pass

def _stop(model, engine, plan, linear=True, norm=None):
    raise Reached(f"{engine.name} linear={linear} norm={norm is not False}")

api.make_plan = lambda engine, recipe, device, auto_filter=False: None
api.plan_model = _stop
'''  # noqa: E501 (a script's text, kept as it runs)


def test_the_swapped_script_converts_to_te_on_an_fp8_gpu(tmp_path):
    path = swapped_script(tmp_path)
    prelude = _FAKE_H100_PRELUDE + (
        "def _catch(run):\n"
        "    try:\n"
        "        run()\n"
        "    except Reached as exc:\n"
        f"        line = [f.line for f in traceback.extract_tb(exc.__traceback__) if f.filename == {str(path)!r}][-1]\n"
        "        print('CONVERTS WITH', exc, 'AT', line)\n"
    )
    code = prelude + f"import runpy\n_catch(lambda: runpy.run_path({str(path)!r}, run_name='__main__'))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                            cwd=tmp_path, env=child_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CONVERTS WITH te linear=True norm=True AT convert_model(model)" in result.stdout, result.stdout


@pytest.mark.slow
def test_the_swapped_script_on_a_cpu_says_te_cannot_run(tmp_path):
    """For real on this CPU: the script's conversion falls back with the reason logged, and its
    TERecipeKwargs, which names TE, then fails saying why TE cannot run here."""
    result = run_script(swapped_script(tmp_path), tmp_path)
    assert result.returncode != 0
    assert "converts to TransformerEngine where it runs" in result.stderr
    assert "TransformerEngine cannot run here (needs a CUDA GPU" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("fp8plug.backends.base.BackendUnavailableError: FP8 backend 'te'"), last
