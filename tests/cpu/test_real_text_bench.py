"""benchmarks/training/real_text.py's own rules, without training: the spike rule, the held-out
split, the table against bf16 (the whole script's CPU smoke: `--device cpu --tiny`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "training"))

import real_text  # noqa: E402


def test_a_spike_is_ten_percent_over_the_running_median():
    losses = [2.0] * 60
    losses[55] = 2.21  # 10.5% over the median of the 50 before it
    losses[57] = 2.19  # 9.5%: not a spike
    assert real_text.spikes(losses) == [55]


def test_held_out_split_is_by_file_and_stable():
    names = [f"pkg/module_{i}.py" for i in range(2000)]
    held = [n for n in names if real_text.held_out(n)]
    assert 60 < len(held) < 140 and held == [n for n in names if real_text.held_out(n)]


def test_table_compares_with_bf16_and_names_failed_rows():
    results = {
        "bf16": dict(final_eval_loss=3.0, tokens_per_s=1000.0, spikes=[100], steps_done=3000),
        "fp8plug-default": dict(final_eval_loss=3.012, tokens_per_s=1400.0, spikes=[102, 900], steps_done=3000),
        "fp8plug-rowwise": dict(error="ValueError: FP8RecipeKwargs.scaling: 'rowwise' is not ..."),
    }
    lines = real_text.table(results).splitlines()
    assert lines[2] == "| bf16 | 3000 | 3.0000 | +0.00% | 0 | 1,000 | 1.00x |"
    assert lines[3] == "| fp8plug-default | 3000 | 3.0120 | +0.40% | 1 | 1,400 | 1.40x |"
    assert lines[4].startswith("| fp8plug-rowwise | - |") and "'rowwise' is not" in lines[4]
