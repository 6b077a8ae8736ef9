"""Copies of converted models, models converted before prepare, free_memory.

- A copy of a converted model (copy.deepcopy, torch.save/torch.load of the whole model) trained
  with its own optimizer gets the end-of-step update of delayed scaling as the original does.
- A model converted by hand under one recipe and prepared under another is refused by name.
- `free_memory` lets the prepared models go, FP8 state and all.
- `fp8plug launch` returns the script's exit status, and names a missing script in one line.
- `fp8plug env` fails on a bad FP8 setting in the environment, naming the variable.
"""

import copy
import gc
import io
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8plug
from fp8plug import FP8RecipeKwargs
from fp8plug.backends.native.steps import _SkippedStepGuard
from tests.support.hf import fresh
from tests.support.processes import ROOT, child_env

GROWTH = 1.3  # activations grow by this factor every step
RECIPE = dict(backend="native", scaling="delayed", amax_history_len=1, margin=1)


def converted(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(**RECIPE))
    return model


def batch(step):
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(step)) * GROWTH**step


def train(model, first, steps):
    """`steps` steps from step `first`, with the model's own optimizer."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    for step in range(first, first + steps):
        model(batch(step)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def output_error(model, step):
    """Relative error of the FP8 forward (training mode: delayed scales) against float32."""
    x = batch(step)
    with torch.no_grad():
        out = model(x)
        reference = x
        for layer in model:
            reference = F.linear(reference, layer.weight, layer.bias)
    return ((out - reference).norm() / reference.norm()).item()


def save_and_load(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# --- copies of a converted model --------------------------------------------------------------------


@pytest.mark.parametrize("make_copy", [copy.deepcopy, save_and_load], ids=["deepcopy", "save_load"])
def test_a_copy_keeps_its_delayed_scaling_updated(make_copy):
    original = converted()
    train(original, 0, 3)  # the scales of small activations
    copied = make_copy(original)
    train(original, 3, 12)
    train(copied, 3, 12)  # activations grow 1.3**12 = 23x past the copied scales
    assert copied[0].fp8_step.tolist() == [15, 15, 15] == original[0].fp8_step.tolist()
    original_error, copy_error = output_error(original, 15), output_error(copied, 15)
    assert original_error < 0.1
    assert copy_error < 0.1  # frozen scales saturate: 0.89
    assert abs(copy_error - original_error) < 1e-6  # same data, same weights, same scales


def test_a_model_loaded_in_a_fresh_process_keeps_its_delayed_scaling_updated(tmp_path):
    original = converted()
    train(original, 0, 3)
    torch.save(original, tmp_path / "model.pt")
    train(original, 3, 12)
    child = (
        "import torch, tests.cpu.test_copies_and_launch as t\n"
        f"model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "t.train(model, 3, 12)\n"
        "print(model[0].fp8_step.tolist(), t.output_error(model, 15))\n"
    )
    proc = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=child_env(tmp_path, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps, error = proc.stdout.strip().splitlines()[-1].rsplit("] ", 1)
    assert steps == "[15, 15, 15"
    assert abs(float(error) - output_error(original, 15)) < 1e-6  # frozen: 0.89


def test_a_copy_converted_again_runs_one_skipped_step_guard():
    copied = copy.deepcopy(converted())
    fp8plug.convert_model(copied, recipe=FP8RecipeKwargs(**RECIPE))
    guards = [fqn for fqn, m in copied.named_modules() for hook in m._forward_pre_hooks.values()
              if isinstance(hook, _SkippedStepGuard)]
    assert guards == [""]


def test_tracking_a_copy_keeps_no_model_alive():
    original = converted()
    copied = copy.deepcopy(original)
    train(copied, 0, 1)  # tracked by now
    ref = weakref.ref(copied)
    del copied
    gc.collect()
    assert ref() is None


# --- a model converted by hand, then prepared -------------------------------------------------------


def accelerator(**recipe):
    return fp8plug.Accelerator(cpu=True, mixed_precision="fp8",
                               kwargs_handlers=[FP8RecipeKwargs(backend="native", **recipe)])


def by_hand(**recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native", **recipe))
    return model


def test_a_model_converted_under_another_recipe_is_refused_by_name(caplog):
    model = by_hand(scaling="dynamic")
    acc = accelerator(scaling="delayed", amax_history_len=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    caplog.clear()
    with caplog.at_level("INFO", logger="fp8plug"), pytest.raises(fp8plug.ConversionError) as error:
        acc.prepare(model, optimizer)
    message = str(error.value)
    assert message.startswith("prepare(): argument 0: Sequential was already converted")
    assert "scaling='dynamic'" in message and "scaling='delayed'" in message
    assert "amax_history_len=1024" in message and "amax_history_len=4" in message
    assert "fp8plug.unconvert_model(model)" in message and "\n" not in message
    assert not [r for r in caplog.records if "FP8 with" in r.getMessage()]  # no line claiming a conversion
    assert acc.fp8_models == [] and model[0].scaling == "dynamic"  # nothing changed


def test_the_fix_the_refusal_names_applies_the_accelerators_recipe():
    model = by_hand(scaling="dynamic")
    acc = accelerator(scaling="delayed", amax_history_len=4)
    fp8plug.unconvert_model(model)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert [(m.scaling, m.fp8_amax_history.shape[0]) for m in model] == [("delayed", 4)] * 2


def test_a_model_converted_under_the_same_recipe_is_prepared():
    model = by_hand(scaling="delayed", amax_history_len=4)
    acc = accelerator(scaling="delayed", amax_history_len=4)
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert acc.fp8_reports[0].fp8_linears == ["0", "1"]
    assert [(m.scaling, m.fp8_amax_history.shape[0]) for m in model] == [("delayed", 4)] * 2


# --- free_memory between two models (accelerate's find_executable_batch_size) -----------------------


def prepared(acc, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    return acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))


def trained(acc, model, optimizer, steps):
    for step in range(steps):
        acc.backward(model(batch(step)).sum())
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("release", ["free_memory", "clear"])
def test_free_memory_lets_the_old_model_go(release):
    acc = accelerator(amax_history_len=4)
    model, optimizer = prepared(acc, 0)
    trained(acc, model, optimizer, 1)
    old = weakref.ref(model)
    model, optimizer = getattr(acc, release)(model, optimizer)
    gc.collect()
    assert old() is None  # kept by the Accelerator's FP8 bookkeeping before
    assert acc.fp8_models == [] and acc.fp8_reports == []


def test_a_checkpoint_after_free_memory_holds_the_new_model_only(tmp_path):
    acc = accelerator(amax_history_len=4)
    model, optimizer = prepared(acc, 0)
    trained(acc, model, optimizer, 1)
    acc.free_memory(model, optimizer)
    model, optimizer = prepared(acc, 1)  # the retry
    trained(acc, model, optimizer, 3)
    acc.save_state(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / "fp8_state.pt", weights_only=True)
    assert len(saved["models"]) == 1  # 2 before: the old model's too
    assert saved["models"][0]["0"]["fp8_step"].tolist() == [3, 3, 3]

    fresh()  # a new one-model run resumes from it
    acc2 = accelerator(amax_history_len=4)
    model2, _ = prepared(acc2, 2)
    acc2.load_state(tmp_path / "ckpt")
    assert torch.equal(model2[0].fp8_amax_history, model[0].fp8_amax_history)
    assert torch.equal(model2[1].fp8_scale, model[1].fp8_scale) and model2[1].fp8_step.tolist() == [3, 3, 3]


def test_the_same_model_prepared_again_after_free_memory_is_an_fp8_model_again(tmp_path):
    acc = accelerator(amax_history_len=4)
    model, optimizer = prepared(acc, 0)
    acc.free_memory()  # the caller keeps the model (a Trainer's next train())
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    assert acc.fp8_models == [model] and len(acc.fp8_reports) == 1
    trained(acc, model, optimizer, 2)
    acc.save_state(tmp_path / "ckpt")
    assert len(torch.load(tmp_path / "ckpt" / "fp8_state.pt", weights_only=True)["models"]) == 1

# --- fp8plug launch and fp8plug env ---------------------------------------------------------------


def fp8plug_command(tmp_path, *args, **env):
    return subprocess.run([sys.executable, "-m", "fp8plug", *args], cwd=tmp_path, capture_output=True, text=True,
                          env=child_env(tmp_path, OMP_NUM_THREADS="1", **env), timeout=300)


@pytest.mark.parametrize("processes", [1, 2])
def test_launch_returns_the_scripts_exit_status(tmp_path, processes):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('ran')\nsys.exit(3)\n")
    proc = fp8plug_command(tmp_path, "launch", "--cpu", "--num_processes", str(processes), "--main_process_port", "0",
                           str(script))  # a free port: another test may be launching at the same time
    assert proc.returncode == 3, proc.stderr[-3000:]  # 1 before, whatever the script's status
    assert "ran" in proc.stdout  # (with two, torchrun may stop the other rank before it prints)
    assert "Traceback" not in proc.stderr and "CalledProcessError" not in proc.stderr
    assert f"fp8plug launch: {script} exited with status 3" in proc.stderr


def test_launch_names_a_missing_script_in_one_line(tmp_path):
    missing = tmp_path / "no_such.py"
    proc = fp8plug_command(tmp_path, "launch", "--cpu", "--num_processes", "1", str(missing))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"fp8plug launch: no such script: {missing}"
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("variable, value, allowed", [
    ("ACCELERATE_FP8_MARGIN", "abc", "use an integer from 0 to 8"),
    ("ACCELERATE_FP8_BACKEND", "bogus", "use one of msamp, te, ao, native"),
    ("FP8PLUG_SCALING", "weird", "use one of"),
])
def test_env_fails_on_a_bad_fp8_setting_naming_it(tmp_path, variable, value, allowed):
    extra = {"ACCELERATE_FP8_BACKEND": "native"} if variable == "FP8PLUG_SCALING" else {}
    proc = fp8plug_command(tmp_path, "env", **extra, **{variable: value})
    assert proc.returncode == 1, proc.stdout  # 0 before
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("fp8plug env: bad FP8 setting:")
    assert variable in error and repr(value) in error and allowed in error
    settings = [line for line in proc.stdout.splitlines() if line.startswith("FP8 settings")]
    assert settings and variable in settings[0]  # under its own heading
    assert value not in "".join(line for line in proc.stdout.splitlines() if line.startswith("auto_filter"))
    assert "Traceback" not in proc.stderr


def test_env_with_good_fp8_settings_lists_them(tmp_path):
    proc = fp8plug_command(tmp_path, "env", ACCELERATE_FP8_BACKEND="native", FP8PLUG_SCALING="dynamic")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FP8 settings from the environment: ACCELERATE_FP8_BACKEND=native, FP8PLUG_SCALING=dynamic" in proc.stdout
