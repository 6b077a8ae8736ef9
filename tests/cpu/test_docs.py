"""The code in docs/*.md and README.md runs, so the documentation cannot rot.

Every ```python block of a file runs, in order, in one namespace per file (later blocks may use
what earlier ones defined), on the CPU, with a clean Accelerate state and no ACCELERATE_*
variables. A block that cannot run here (it needs a GPU, `accelerate launch`'s environment, or
is a fragment) is preceded by a line `<!-- skip: why -->`; those are counted and kept few.
Relative links and the example paths the docs name must exist too.
"""

import os
import re
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SKIP = re.compile(r"^<!--\s*skip:\s*(?P<why>.+?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
MAX_SKIPPED = 8  # keep skipped blocks few: runnable documentation is the point


def code_blocks(path: Path):
    """(first line number, language, code, skip reason or None) for each fenced block."""
    lines = path.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = SKIP.match(previous)
        start = i + 1
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        blocks.append((start + 1, fence["lang"], textwrap.dedent("\n".join(body)) + "\n",
                       skip["why"] if skip else None))
    return blocks


def python_blocks(path: Path):
    return [b for b in code_blocks(path) if b[1] in ("python", "py")]


@pytest.fixture
def clean_accelerate(monkeypatch, tmp_path):
    """A scratch working directory, and afterwards the environment as it was (tests/conftest.py
    cleans the settings and accelerate's state around every test)."""
    saved = dict(os.environ)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    os.environ.clear()  # whatever a block set, before monkeypatch puts back what it removed
    os.environ.update(saved)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path, clean_accelerate):
    blocks = [b for b in python_blocks(path) if b[3] is None]
    if not blocks:
        pytest.skip(f"{path.name} has no runnable python block")
    namespace = {"__name__": "__docs__"}
    for line, _, code, _ in blocks:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(
                    f"{path.relative_to(ROOT)}, python block at line {line} failed: {type(exc).__name__}: {exc}"
                ) from exc


def test_skipped_blocks_are_few_and_explained():
    skipped = [(p.relative_to(ROOT), line, why) for p in DOCS for line, lang, _, why in python_blocks(p) if why]
    assert len(skipped) <= MAX_SKIPPED, skipped
    for where in skipped:
        assert len(where[2]) >= 8, f"give a reason for skipping {where}"


def test_skip_markers_precede_python_blocks():
    """A skip marker anywhere else would silently do nothing."""
    for path in DOCS:
        lines = path.read_text().splitlines()
        for number, text in enumerate(lines):
            if SKIP.match(text.strip()):
                following = next((t for t in lines[number + 1:] if t.strip()), "")
                assert following.strip() in ("```python", "```py"), f"{path.name}:{number + 1}: {text}"


def test_links_and_example_paths_exist():
    missing = []
    for path in DOCS:
        text = path.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.exists():
                missing.append(f"{path.name}: link {target}")
        for name in set(re.findall(r"\b(examples/[\w/.-]+\.(?:py|yaml))", text)):
            if not (ROOT / name).exists():
                missing.append(f"{path.name}: {name}")
    assert not missing, missing


# A page says what is true now: the record of how it got there is git's, not the page's.
HISTORY = re.compile(r"\bsessions?\b|\bcalls? \d|\bcall\d+_", re.IGNORECASE)
MAX_LINES = {"performance.md": 300}
MAX_LINES_OTHER = 350


def test_pages_are_references_not_lab_notebooks():
    """No page (docs/*.md, README.md, the notes beside the results) speaks of the session or call
    that measured something, and every page stays short enough to read: performance.md under 300
    lines, the others under 350 (results are linked, not retold)."""
    pages = DOCS + sorted((ROOT / "docs" / "results").rglob("*.md"))
    history = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in pages
               for n, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not history, history
    long = [f"{p.name}: {n} lines" for p in DOCS
            if (n := len(p.read_text().splitlines())) >= MAX_LINES.get(p.name, MAX_LINES_OTHER)]
    assert not long, long


def test_results_are_named_by_device_and_date():
    """docs/results/<device>/<date>[-what]/...: no folder or file named after a session or a call."""
    named = [str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "results").rglob("*")
             if re.search(r"session|^call\d*_|^call\d*\.", p.name, re.IGNORECASE)]
    assert not named, named


def test_troubleshooting_names_every_public_error_class():
    """Each exception class fp8plug defines for users has its entry (BenchSkip never leaves bench)."""
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    defined = set()
    for source in (ROOT / "fp8plug").rglob("*.py"):
        defined.update(re.findall(r"^class (\w+)\((?:\w+Error|\w*Exception|RuntimeError|ValueError)\)",
                                  source.read_text(), re.M))
    defined.discard("BenchSkip")
    assert defined >= {"BackendUnavailableError", "ConversionError"}
    assert all(name in text for name in defined), sorted(n for n in defined if n not in text)


def _undocumented(obj, where):
    """`where` if `obj` (or a public method or property of it, for a class) lacks its own docstring."""
    import inspect

    missing = []
    own = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not (own or "").strip():
        missing.append(where)
    if inspect.isclass(obj):
        for attr, value in obj.__dict__.items():
            if attr.startswith("_"):
                continue
            function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if (isinstance(value, property) or inspect.isfunction(function)) and not (function.__doc__ or "").strip():
                missing.append(f"{where}.{attr}")
    return missing


def test_public_names_have_docstrings():
    """Every name in fp8plug.__all__, and every public name fp8plug.integrations.float8 (with the
    config classes of fp8plug.integrations.float8_training) and fp8plug.integrations.accelerator
    define, says what it is for (classes: their public methods and properties too)."""
    import fp8plug
    import fp8plug.integrations.accelerator
    import fp8plug.integrations.float8
    import fp8plug.integrations.float8_training

    missing = []
    for name in fp8plug.__all__:
        missing += _undocumented(getattr(fp8plug, name), f"fp8plug.{name}")
    for module in (fp8plug.integrations.float8, fp8plug.integrations.float8_training, fp8plug.integrations.accelerator):
        for name, obj in vars(module).items():
            if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__:
                missing += _undocumented(obj, f"{module.__name__}.{name}")
    assert not missing, missing
