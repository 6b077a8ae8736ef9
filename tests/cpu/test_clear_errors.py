"""Errors that used to be tracebacks or other libraries' messages are one line naming the module,
field or path and what to do; the model is left as it was; bench checks its output paths before
measuring anything; the GPU kit scripts use private temporary folders, not fixed /tmp paths."""

import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from fp8plug import ConversionError, FP8RecipeKwargs, convert_model
from fp8plug.bench import run as bench_run
from fp8plug.bench.options import add_arguments
from fp8plug.cli import main

ROOT = Path(__file__).resolve().parents[2]


def one_line(text):
    return text.strip() and "\n" not in text.strip() and "Traceback" not in text


def weightless(model):
    model[1].weight = None


def deleted_weight(model):
    del model[1].weight


def plain_tensor_weight(model):
    weight = model[1].weight.detach()
    del model[1].weight
    model[1].weight = weight


@pytest.mark.parametrize("backend", ["native", "ao"])
@pytest.mark.parametrize("spoil, words", [
    (weightless, "has no weight"), (deleted_weight, "has no weight"), (plain_tensor_weight, "has a Tensor as weight"),
    (lambda model: model[1].double(), "its weight is torch.float64"),
])
def test_unusable_linear_is_refused_before_anything_is_converted(backend, spoil, words):
    if backend == "ao":
        # loaded, it makes the ao engine look at each Linear's weight for torchao's MX wrapper: load it
        # here so that the check meets the spoiled Linear whichever tests this process ran before
        pytest.importorskip("torchao.prototype.moe_training.tensor")
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    spoil(model)
    with pytest.raises(ConversionError,
                       match=rf"^cannot convert '1' to FP8: .*{words}.*modules_to_ignore=\['1'\]") as error:
        convert_model(model, recipe=FP8RecipeKwargs(backend=backend))
    assert one_line(str(error.value))
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]  # not half converted


def test_unusable_linear_can_be_left_alone():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    model[1].double()
    report = convert_model(model, recipe=FP8RecipeKwargs(backend="native", modules_to_ignore=["1"]))
    assert report.converted == ["0"]


@pytest.mark.parametrize("argv, words", [
    (["env", "--device", "bogus"], "fp8plug env: --device: 'bogus' is not a device"),
    (["env", "--device", "mps"], "fp8plug env: --device: 'mps' is not supported"),
    (["bench", "--device", "bogus"], "fp8plug bench: --device: 'bogus' is not a device"),
    (["bench", "--json", "/no/such/dir/x.json"], "fp8plug bench: --json: the folder '/no/such/dir'"),
    (["bench", "--csv", "/no/such/dir/x.csv"], "fp8plug bench: --csv: the folder '/no/such/dir'"),
])
def test_cli_bad_option_is_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(words) and one_line(err), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only torch")
@pytest.mark.parametrize("command", ["env", "bench"])
def test_cuda_on_cpu_only_torch_is_one_line(command, capsys):
    assert main([command, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fp8plug {command}: --device: cuda asked for") and "--device cpu" in err and one_line(err)


def test_bench_checks_output_paths_before_measuring(tmp_path, monkeypatch, capsys):
    import argparse

    import fp8plug.bench as bench

    measured = []
    monkeypatch.setattr(bench, "measure", lambda *a, **k: measured.append(a) or {})
    args = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--json", str(tmp_path / "missing" / "x.json"), "--shapes", "16x16x16", "--engines", "native"])
    assert bench_run(args) == 2
    assert measured == []  # nothing was measured before the path was refused
    assert "--json" in capsys.readouterr().err


KIT_SCRIPTS = ["scripts/build_deepspeed_kit.sh", "scripts/msamp_kit/build.sh", "benchmarks/gpu_suite.sh"]


@pytest.mark.parametrize("script", KIT_SCRIPTS)
def test_kit_scripts_use_private_temporary_folders(script):
    text = (ROOT / script).read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    fixed = re.findall(r"/tmp/[A-Za-z_][\w.-]*", code)
    assert not fixed, f"{script} uses fixed /tmp paths {fixed}: use a folder from mktemp -d"
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
