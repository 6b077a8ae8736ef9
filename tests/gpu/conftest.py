"""GPU tests: they run only where a CUDA GPU with FP8 tensor cores (sm_89+) is present, and are
skipped everywhere else (CI has no GPU). Run them on the lent H100/H200 with the .gpu kit:
`source .gpu/install.sh && python3 -m pytest tests/gpu -q`."""

import pytest
import torch

from fp8plug.backends.te.engine import share_torch_cudnn

# Test files import TransformerEngine directly; let it load torch's cuDNN, as fp8plug does.
share_torch_cudnn()


def _fp8_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config, items):
    if _fp8_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with compute capability >= 8.9")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_speed_filter(monkeypatch):
    """These tests check numerics on small models, which the default speed filter (auto_filter, on
    for sm_90) would keep in bf16; test_auto_filter.py checks the filter itself. (It runs after
    tests/conftest.py's clean_settings, which removes every FP8PLUG_* setting.)"""
    monkeypatch.setenv("FP8PLUG_AUTO_FILTER", "false")


@pytest.fixture
def device_name():
    return torch.cuda.get_device_name()
