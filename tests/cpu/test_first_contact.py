"""A first contact with fp8plug is quiet and quick: the README's demo prints no
third-party noise, the CLI names an argument it does not know and shows the right usage, and
`fp8plug --help` answers without importing torch."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=child_env(tmp_path))


def _foreign_lines(stderr: str):
    """stderr lines that are not fp8plug's own log lines."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("fp8plug")]


@pytest.mark.slow
def test_demo_prints_no_third_party_noise(tmp_path):
    """torchao's `Failed to load ..._C_...so` and torch's pytree `Enum subclass` warnings came from
    importing transformers for a model that is not a transformers model."""
    result = _run(["examples/fp8_demo.py", "--steps", "2"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "final loss" in result.stdout
    assert _foreign_lines(result.stderr) == []


def test_converting_a_plain_model_imports_no_transformers(tmp_path):
    code = ("import sys, torch, fp8plug\n"
            "model = torch.nn.Sequential(torch.nn.Linear(32, 32))\n"
            "fp8plug.convert_model(model, backend='native')\n"
            "fp8plug.unconvert_model(model)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torchao')))\n")
    result = _run(["-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- the CLI -------------------------------------------------------------------------------------


def test_unknown_top_level_argument_is_named(tmp_path):
    result = _run(["-m", "fp8plug", "--bogus"], tmp_path)
    assert result.returncode == 2
    assert "--bogus" in result.stderr
    assert "required: command" not in result.stderr


def test_unknown_bench_argument_shows_the_bench_usage(tmp_path):
    result = _run(["-m", "fp8plug", "bench", "--bogus"], tmp_path)
    assert result.returncode == 2
    assert "--bogus" in result.stderr
    assert result.stderr.startswith("usage: fp8plug bench")
    assert "--shapes" in result.stderr  # bench's own options, not the top-level usage


def test_unknown_env_argument_shows_the_env_usage(tmp_path):
    result = _run(["-m", "fp8plug", "env", "--bogus"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: fp8plug env") and "--bogus" in result.stderr


def _modules_after(args, tmp_path):
    """The top-level packages imported by `python -m fp8plug ARGS`, and its result."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['fp8plug', *{list(args)!r}]\n"
            "try:\n"
            "    runpy.run_module('fp8plug', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as exc:\n"
            "    print('exit', exc.code)\n"
            "print('modules', sorted({m.split('.')[0] for m in sys.modules}))\n")
    result = _run(["-c", code], tmp_path)
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("modules "), result.stdout + result.stderr
    return eval(last[len("modules "):]), result  # noqa: S307 - our own child's printed list


@pytest.mark.parametrize("args", [["--help"], [], ["--bogus"]])
def test_cli_help_and_errors_import_no_torch(tmp_path, args):
    modules, result = _modules_after(args, tmp_path)
    assert "usage: fp8plug" in result.stdout + result.stderr
    assert not {"torch", "accelerate", "transformers"} & set(modules), modules


def test_env_imports_no_transformers(tmp_path):
    modules, result = _modules_after(["env", "--device", "cpu"], tmp_path)
    assert "automatic choice" in result.stdout, result.stderr
    assert "torch" in modules and "transformers" not in modules, modules


# --- the test run's summary ----------------------------------------------------------------------


def test_skips_are_summed_by_reason_not_listed_one_by_one(tmp_path):
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.parametrize('n', range(3))\n"
        "def test_needs_a_gpu(n):\n"
        "    pytest.skip('needs a GPU')\n\n"
        "def test_needs_something_else():\n"
        "    pytest.skip('needs something else')\n\n"
        "def test_runs():\n"
        "    assert True\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "setup.cfg"), "--rootdir", str(tmp_path),
         "-p", "tests.conftest", "-p", "no:cacheprovider", str(tmp_path / "test_skips.py")],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=child_env(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SKIPPED [" not in result.stdout, result.stdout
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert "3  needs a GPU" in lines and "1  needs something else" in lines, result.stdout
    assert any("4 skipped, by reason" in line for line in lines), result.stdout
