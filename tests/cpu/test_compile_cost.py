"""benchmarks/training/compile_cost.py on the CPU: each row in its own process comes back with the
graph's counts, the FP8 graph is the larger one (the first compiled step's cost), and an unknown
row is refused by name."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "training" / "compile_cost.py"

pytestmark = pytest.mark.slow  # two rows, each a process of its own: about 20 s


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT), env=child_env())


def test_fp8_graph_counted_against_bf16(tmp_path):
    out = tmp_path / "cost.json"
    proc = _run("--rows", "bf16,dynamic", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    bf16, fp8 = rows["bf16"], rows["dynamic"]
    for row in (bf16, fp8):
        assert row["graphs"] >= 1 and len(row["graph_ops"]) >= 2 and row["ops"] == sum(row["graph_ops"]), row
        assert min(row["graph_ops"][-2:]) > 100, row  # the model's forward and backward
        assert 0 < row["tracing_s"] <= row["front_end_s"], row
    # every Linear's casts are traced into the graph: more than twice bf16's ops (measured 2.4x)
    assert fp8["ops"] > 2 * bf16["ops"], rows
    # each op put down to the fp8plug line that made it (the casts' among them); the model's own
    # ops are at most bf16's (its Linears and norms are fp8plug's in the FP8 graph)
    sources = fp8["ops_by_source"]
    assert sum(sources.values()) == fp8["ops"]
    assert any(key.startswith("fp8plug/backends/native/cast.py:") for key in sources), sources  # the casts
    assert sources.get("outside fp8plug", 0) <= bf16["ops"], sources
    assert set(bf16["ops_by_source"]) == {"outside fp8plug"}, bf16["ops_by_source"]
    assert "compile_cost: " in proc.stdout


def test_unknown_row_is_named():
    proc = _run("--rows", "bf16,tensorwise", timeout=60)
    assert proc.returncode != 0
    assert "--rows" in proc.stderr and "tensorwise" in proc.stderr
