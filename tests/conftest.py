"""What every test shares: no fp8plug or accelerate settings in the environment, and no accelerate
process state left by an earlier test.

A recipe reads FP8PLUG_* and ACCELERATE_FP8_* variables, and accelerate reads ACCELERATE_*
(ACCELERATE_MIXED_PRECISION, the launch variables), so one exported in the shell or set by an
earlier test would change what a test checks. The variables are removed once for the whole process
(module-scoped fixtures and the subprocesses tests start see a clean environment too) and again
before each test; a test sets what it needs with monkeypatch.
"""

import os
import sys

import pytest

SETTING_PREFIXES = ("FP8PLUG_", "ACCELERATE_")
# Not a setting: where the GPU tests write their measurements (benchmarks/gpu_suite.sh sets it).
KEPT = frozenset({"FP8PLUG_RECORD_DIR"})


def settings_in(environ):
    return [name for name in environ if name.startswith(SETTING_PREFIXES) and name not in KEPT]


def _fresh_accelerate():
    """Forget accelerate's process-wide singletons, as a new process would (when it is loaded)."""
    if "accelerate.state" in sys.modules:
        from tests._hf import fresh

        fresh()


def pytest_configure(config):
    for name in settings_in(os.environ):
        del os.environ[name]


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch):
    for name in settings_in(os.environ):
        monkeypatch.delenv(name)
    _fresh_accelerate()
    yield
    _fresh_accelerate()
