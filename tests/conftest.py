"""What every test shares: no fp8plug or accelerate settings in the environment, and no accelerate
process state left by an earlier test.

A recipe reads FP8PLUG_* and ACCELERATE_FP8_* variables, and accelerate reads ACCELERATE_*
(ACCELERATE_MIXED_PRECISION, the launch variables), so one exported in the shell or set by an
earlier test would change what a test checks. The variables are removed once for the whole process
and again before and after each test, for good: accelerate and DeepSpeed write some into
os.environ themselves (ACCELERATE_USE_DEEPSPEED, ...), and a module-scoped fixture built between
two tests must not see them. A test sets what it needs with monkeypatch.
"""

import collections
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
        from tests.support.hf import fresh

        fresh()


def _forget_settings():
    for name in settings_in(os.environ):
        del os.environ[name]


def pytest_configure(config):
    _forget_settings()


@pytest.fixture(autouse=True)
def clean_settings():
    _forget_settings()
    _fresh_accelerate()
    yield
    _forget_settings()
    _fresh_accelerate()


def pytest_terminal_summary(terminalreporter):
    """The skipped tests, one line per distinct reason with how many: setup.cfg's `-r` leaves out
    `s`, which lists every skip on its own line (64 on a machine without a GPU)."""
    reasons = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason] += 1
    if reasons:
        terminalreporter.write_sep("=", f"{sum(reasons.values())} skipped, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:4d}  {reason}")
