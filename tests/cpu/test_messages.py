"""Each message names what actually happened and the fix, in one line; the dependency noise that
fp8plug's own imports trigger is dropped, and nothing else."""

import logging
import subprocess
import sys
from pathlib import Path

import accelerate
import pytest
from torch import nn

import fp8plug
from fp8plug import BackendUnavailableError, ConversionError, FP8RecipeKwargs
from fp8plug.backends import get_backend, select_backend
from fp8plug.backends.base import Probe, quiet_import_noise
from fp8plug.tuning.hardware import DeviceInfo
from tests.support.processes import child_env

TROUBLESHOOTING = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
H100 = DeviceInfo("cuda", "NVIDIA H100", (9, 0))
CPU = DeviceInfo("cpu", "x86_64")


def test_recipe_without_fp8_names_where_the_precision_came_from(monkeypatch):
    with pytest.raises(ValueError) as unset:
        fp8plug.Accelerator(cpu=True, kwargs_handlers=[FP8RecipeKwargs()])
    assert "ACCELERATE_MIXED_PRECISION" not in str(unset.value)  # it is not set
    assert "no mixed_precision was given, and accelerate's default is 'no'" in str(unset.value)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(ValueError, match=r"mixed_precision is 'bf16' \(from ACCELERATE_MIXED_PRECISION\)"):
        fp8plug.Accelerator(cpu=True, kwargs_handlers=[FP8RecipeKwargs()])


@pytest.mark.parametrize("backend, why", [("te", "needs a CUDA GPU"), ("msamp", "runs only on CUDA GPUs")])
def test_a_gpu_engine_on_a_cpu_says_so_in_one_line_without_install_text(backend, why):
    with pytest.raises(BackendUnavailableError) as info:
        select_backend(backend, CPU)
    message = str(info.value)
    assert why in message and "\n" not in message and "install" not in message.lower(), message


@pytest.mark.parametrize("backend", ["te", "msamp"])
def test_a_missing_engine_gives_its_install_command_once(monkeypatch, backend):
    engine = get_backend(backend)
    monkeypatch.setattr(engine, "probe", lambda: Probe(False, reason="not installed"))
    with pytest.raises(BackendUnavailableError) as info:
        select_backend(backend, H100)
    message = str(info.value)
    assert message.count(engine.install_hint) == 1 and "\n" not in message, message
    assert len(message) < 600


def test_plain_accelerate_given_fp8plugs_recipe_names_it_and_troubleshooting_gives_the_fix():
    """Plain accelerate.Accelerator raises its bare KeyError with the handler's class; the
    troubleshooting page has that message and says to use fp8plug.Accelerator."""
    with pytest.raises(KeyError) as error:
        accelerate.Accelerator(cpu=True, kwargs_handlers=[FP8RecipeKwargs()])
    message = str(error.value)
    assert message == "<class 'fp8plug.recipe.kwargs.FP8RecipeKwargs'>", message
    row = next(line for line in TROUBLESHOOTING.read_text().splitlines() if f"`KeyError: {message}`" in line)
    assert "Use `fp8plug.Accelerator`" in row, row


def test_converting_another_engines_fp8_model_is_refused_not_reported_as_high_precision():
    pytest.importorskip("torchao")
    model = nn.Sequential(nn.Linear(16, 16))
    fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="native"))
    with pytest.raises(ConversionError, match=r"with the ao engine: '0' is already an FP8 layer of another "
                                              r"engine \(NativeFP8Linear\)"):
        fp8plug.convert_model(model, recipe=FP8RecipeKwargs(backend="ao"))


def test_norm_conversion_asked_for_by_name_warns_where_the_engine_leaves_norms(caplog):
    def model():
        return nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))

    with caplog.at_level(logging.WARNING, logger="fp8plug"):
        fp8plug.convert_model(model(), recipe=FP8RecipeKwargs(backend="native"))
        assert "_convert_ln" not in caplog.text  # the default asks for nothing by name
        fp8plug.convert_model(model(), to_transformer_engine=True, _convert_ln=True, backend="native")
    assert "convert_model(_convert_ln=True): the native engine converted none of this model's norms, so 1 norm " \
           "layer(s) stay torch's (1)" in caplog.text


def test_engine_imports_drop_exactly_the_known_noise():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    loggers = [logging.getLogger(name) for name in ("torch.utils._pytree", "torchao")]
    for logger in loggers:
        logger.addHandler(Keep())
    try:
        with quiet_import_noise():
            loggers[0].warning("<enum 'X'> is an Enum subclass and is now natively supported ...")
            loggers[0].warning("a real problem")
            loggers[1].error("torchao broke")
        loggers[0].warning("<enum 'Y'> after the import")
    finally:
        for logger in loggers:
            logger.handlers = [h for h in logger.handlers if not isinstance(h, Keep)]
    assert seen == ["a real problem", "torchao broke", "<enum 'Y'> after the import"]


def test_probing_torchao_prints_nothing_on_a_cpu(tmp_path):
    pytest.importorskip("torchao")
    code = "import fp8plug; from fp8plug.backends import get_backend; assert get_backend('ao').probe().available"
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "_pytree" not in proc.stderr and "triton" not in proc.stderr, \
        proc.stderr
