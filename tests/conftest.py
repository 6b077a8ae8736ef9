"""What every test shares: no fp8plug or accelerate settings in the environment, and no accelerate
process state left by an earlier test.

A recipe reads FP8PLUG_* and ACCELERATE_FP8_* variables, and accelerate reads ACCELERATE_*
(ACCELERATE_MIXED_PRECISION, the launch variables), so one exported in the shell or set by an
earlier test would change what a test checks. The variables are removed once for the whole process
and again before and after each test, for good: accelerate and DeepSpeed write some into
os.environ themselves (ACCELERATE_USE_DEEPSPEED, ...), and a module-scoped fixture built between
two tests must not see them. A test sets what it needs with monkeypatch.

And how the tests share the machine: setup.cfg's addopts run them on pytest-xdist's workers; here
is how many, and each worker's share of the CPUs.
"""

import collections
import importlib.util
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


def pytest_addoption(parser, pluginmanager):
    """setup.cfg's addopts ask pytest-xdist for workers (--numprocesses=auto --dist=loadscope).
    Where it is not installed (an environment scripts/bootstrap.sh did not set up, or
    `-p no:xdist`), take those two options and run the tests in this process, rather than have
    pytest refuse its own command line."""
    if importlib.util.find_spec("xdist") is not None and not pluginmanager.is_blocked("xdist"):
        return  # (not has_plugin: under `-p tests.conftest` this runs before pytest loads xdist)
    ignored = "pytest-xdist is not installed: ignored, the tests run in this process"
    parser.addoption("--numprocesses", default=None, help=ignored)
    parser.addoption("--dist", default=None, help=ignored)


def pytest_report_header(config):
    if not config.pluginmanager.has_plugin("xdist"):
        return "pytest-xdist is not installed: the tests run in this process (bash scripts/bootstrap.sh installs it)"


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where it is not installed
def pytest_xdist_auto_num_workers(config):
    """--numprocesses=auto (setup.cfg): one worker per CPU this process may use, at most 8, and
    none (the tests run in this process) with one CPU or a CUDA GPU. Why at most 8: each worker
    imports torch, transformers and DeepSpeed (1-2 GB), and many tests start processes of their
    own. Why none with a GPU: the GPU tests share one device and time their kernels.
    PYTEST_XDIST_AUTO_NUM_WORKERS still decides where it is set (pytest-xdist's own rule)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    import torch

    workers = min(_cpus(), 8)
    return 0 if workers < 2 or torch.cuda.is_available() else workers


def _share_the_cpus():
    """Under pytest-xdist, give each worker its share of the CPUs for torch's threads, and the
    processes its tests start the same through OMP_NUM_THREADS (unless set already). Without it
    every worker runs one thread per CPU, and OpenMP's threads wait on one another for a core: on
    2 busy CPUs an elementwise operation on 65k elements took 8-12 ms instead of 0.01 ms."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = max(1, _cpus() // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config):
    _forget_settings()
    _share_the_cpus()


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
