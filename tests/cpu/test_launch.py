"""`accelerate launch` with fp8plug: the example configs, the CLI flags, and DDP over gloo on the CPU.

Each test runs the real launcher in a subprocess on examples/train_accelerate.py and reads the
result file every rank writes (--out). Launch exports what it understands as ACCELERATE_*
variables (every FP8 one with its argparse default, a lower-case `ao`, the config wizard's key
names); these tests check that fp8plug.Accelerator reads them as the user meant.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_accelerate.py"
CONFIGS = ROOT / "examples" / "configs"

pytestmark = pytest.mark.slow


def launch(tmp_path, launch_args, script_args=(), timeout=240):
    """Run `accelerate launch` and return (returncode, {rank: result}, combined output)."""
    env = child_env(tmp_path, OMP_NUM_THREADS="1")
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, str(SCRIPT), *script_args,
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    # each rank writes its own file (two ranks' long stdout lines can interleave)
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    return proc.returncode, results, output


def test_one_cpu_process_from_config_file(tmp_path):
    code, results, output = launch(tmp_path, ["--config_file", str(CONFIGS / "cpu_fp8.yaml")], ["--steps", "4"])
    assert code == 0, output[-3000:]
    result = results[0]
    assert result["world_size"] == 1 and result["mixed_precision"] == "fp8" and result["engine"] == "native"
    recipe = result["recipe"]
    # `accelerate config` key names win over the defaults launch exports under Accelerate's names
    assert recipe["backend"] == "native" and recipe["amax_history_len"] == 16
    assert recipe["amax_compute_algo"] == "max" and recipe["fp8_format"] == "HYBRID"
    assert result["converted"] == 14  # 2 blocks x 7 Linears; lm_head stays bf16 (the default)
    assert len(result["losses"]) == 4 and all(math.isfinite(x) for x in result["losses"])
    assert result["weights"]["keys"] == 22 and "embed.weight" in result["state_dict_keys"]
    assert result["weights"]["sha256"] != result["initial_weights"]["sha256"]


def test_bad_setting_exported_before_a_config_launch_fails_naming_it(tmp_path, monkeypatch):
    """The launch replaces ACCELERATE_FP8_FORMAT with its config file's value in the process it
    starts; the value exported before it is still checked there, not silently dropped."""
    monkeypatch.setenv("ACCELERATE_FP8_FORMAT", "bogus")  # child_env copies this process's environment
    code, results, output = launch(tmp_path, ["--config_file", str(CONFIGS / "cpu_fp8.yaml")], ["--steps", "2"])
    assert code != 0 and results == {}, output[-3000:]  # 0 and a trained model before
    assert ("ValueError: FP8RecipeKwargs.fp8_format (from ACCELERATE_FP8_FORMAT, in the environment `accelerate "
            "launch` ran in): 'bogus' is not allowed; use one of HYBRID, E4M3. The launch replaced it with 'HYBRID'"
            in output), output[-3000:]


def test_two_cpu_processes_ddp_over_gloo_end_identical(tmp_path):
    code, results, output = launch(tmp_path, ["--config_file", str(CONFIGS / "cpu_ddp_fp8.yaml")], ["--steps", "4"])
    assert code == 0, output[-3000:]
    assert sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        assert result["world_size"] == 2 and result["distributed_type"] == "DistributedType.MULTI_CPU"
        assert result["engine"] == "native" and result["recipe"]["backend"] == "native"  # `NATIVE` in the file
        assert result["recipe"]["amax_history_len"] == 16
        assert result["weights"]["sha256"] != result["initial_weights"]["sha256"]  # it trained
    assert results[0]["weights"] == results[1]["weights"]  # identical weights on both ranks
    assert results[0]["losses"] == results[1]["losses"]
    # each rank sees its own batch, but the amaxes are reduced across ranks: one scaling state
    assert results[0]["fp8_state"] is not None and results[0]["fp8_state"] == results[1]["fp8_state"]


def test_cli_flags_lower_case_ao_trains_on_cpu(tmp_path):
    flags = ["--cpu", "--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no",
             "--mixed_precision", "fp8", "--fp8_backend", "ao", "--fp8_amax_history_len", "16",
             "--fp8_format", "E4M3"]
    code, results, output = launch(tmp_path, flags, ["--steps", "2"])
    assert code == 0, output[-3000:]
    result = results[0]
    assert result["mixed_precision"] == "fp8" and result["engine"] == "ao"
    recipe = result["recipe"]
    assert recipe["backend"] == "ao" and recipe["amax_history_len"] == 16 and recipe["fp8_format"] == "E4M3"
    assert recipe["amax_compute_algo"] == "most_recent"  # launch's default, exported unasked
    assert result["converted"] == 14 and all(math.isfinite(x) for x in result["losses"])


def test_config_file_with_wizard_keys(tmp_path):
    config = tmp_path / "wizard.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\n"
        "distributed_type: 'NO'\n"
        "mixed_precision: fp8\n"
        "num_machines: 1\n"
        "num_processes: 1\n"
        "use_cpu: true\n"
        "fp8_config:\n"
        "  backend: Native\n"
        "  fp8_format: E4M3\n"
        "  amax_history_length: 32\n"
        "  amax_compute_algorithm: max\n"
        "  optimization_level: O1\n"
        "  margin: 2\n"
        "  interval: 3\n"
        "  override_linear_precision: [false, false, true]\n"
        "  fp8_output_head: true\n"  # launch exports it as ACCELERATE_FP8_OUTPUT_HEAD
    )
    code, results, output = launch(tmp_path, ["--config_file", str(config)], ["--check-config"])
    assert code == 0, output[-3000:]
    recipe = results[0]["recipe"]
    assert results[0]["engine"] == "native"
    assert (recipe["backend"], recipe["fp8_format"], recipe["amax_history_len"], recipe["amax_compute_algo"]) == (
        "native", "E4M3", 32, "max")
    assert (recipe["opt_level"], recipe["margin"], recipe["interval"]) == ("O1", 2, 3)
    assert recipe["override_linear_precision"] == [False, False, True]
    assert recipe["fp8_output_head"] is True


HIDE_ENGINES = '''
"""Hide TransformerEngine, MS-AMP and torchao from this process: a machine with torch,
accelerate and fp8plug only."""
import sys

HIDDEN = {"torchao", "transformer_engine", "msamp"}


class _Hide:
    def __init__(self, inner):
        self._inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


sys.meta_path[:] = [_Hide(finder) for finder in sys.meta_path]
'''


@pytest.mark.parametrize("config", ["cpu_fp8", "cpu_ddp_fp8"])
def test_cpu_configs_run_with_only_torch_accelerate_and_fp8plug(tmp_path, config):
    """accelerate's launcher refuses mixed precision fp8 unless TE, MS-AMP or torchao is
    installed; `fp8plug launch` runs the shipped CPU configs without them (native engine)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_ENGINES)
    env = child_env(tmp_path, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(hide), env["PYTHONPATH"]])
    probe = subprocess.run([sys.executable, "-c", "import accelerate.utils as u; import torchao"], env=env,
                           capture_output=True, text=True)
    assert "No module named 'torchao'" in probe.stderr  # the engines are really hidden
    out = tmp_path / "results"
    args = ["--config_file", str(CONFIGS / f"{config}.yaml"), str(SCRIPT), "--steps", "2", "--out", str(out)]
    plain = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=240)
    assert plain.returncode != 0 and "FP8 is not available on this machine" in plain.stderr  # accelerate's own
    proc = subprocess.run([sys.executable, "-m", "fp8plug", "launch", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert len(results) == (2 if config == "cpu_ddp_fp8" else 1)
    for result in results:
        assert result["engine"] == "native" and result["mixed_precision"] == "fp8"
        assert result["world_size"] == len(results) and result["converted"] == 14


def test_fp8plug_launch_says_why_when_no_fp8_can_run(monkeypatch):
    import accelerate.utils.launch as launch_utils

    from fp8plug.integrations import launch

    monkeypatch.setattr(launch_utils, "is_fp8_available", lambda: False)
    monkeypatch.setattr(launch, "native_fp8_problem", lambda: "torch 2.0 has no float8 dtypes")
    with launch.fp8_check_widened():
        with pytest.raises(RuntimeError, match=r"^fp8plug launch: mixed precision fp8 cannot run here: .*"
                                               r"native engine cannot run \(torch 2.0 has no float8 dtypes\)"):
            launch_utils.is_fp8_available()
    monkeypatch.setattr(launch, "native_fp8_problem", lambda: None)
    with launch.fp8_check_widened():
        assert launch_utils.is_fp8_available()
    assert launch_utils.is_fp8_available() is False  # put back after the block
