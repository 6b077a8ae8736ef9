"""benchmarks/training/real_text.py's own rules, without training: the spike rule, the held-out
split, the table against bf16 (the whole script's CPU smoke: `--device cpu --tiny`); and
real_text_seeds.py's pairing of seeds with bf16 and its mean over seeds."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "training"))

import pytest  # noqa: E402
import real_text  # noqa: E402
import real_text_seeds  # noqa: E402


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


def _run(tmp_path, name, row, seed, loss, steps=3000, spikes=(), done=None, lr=6e-4):
    import json

    train = [2.0] * 120
    for step in spikes:
        train[step] = 2.5
    run = dict(row=row, spec=dict(steps=steps, lr=lr, seed=seed), corpus=dict(file_list_sha256="abc"),
               steps_done=steps if done is None else done, final_eval_loss=loss, train_loss=train,
               spikes=real_text.spikes(train), eval_curve=[[1000, loss + 1], [steps, loss]])
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(run))
    return path


def test_seeds_are_paired_with_bf16_and_averaged(tmp_path):
    _run(tmp_path, "b0a", "bf16", 0, 3.0)
    _run(tmp_path, "b0b", "bf16", 0, 3.2)  # two bf16 runs of seed 0: their mean, 3.1
    _run(tmp_path, "r0", "fp8plug-blockwise", 0, 3.131, spikes=[80])
    _run(tmp_path, "b1", "bf16", 1, 4.0, spikes=[90])
    _run(tmp_path, "r1", "fp8plug-blockwise", 1, 3.96)
    _run(tmp_path, "r2", "fp8plug-blockwise", 2, 1.0)  # no bf16 of seed 2: left out
    _run(tmp_path, "r3", "fp8plug-blockwise", 3, 9.0, done=1315)  # stopped early: left out
    _run(tmp_path, "b3", "bf16", 3, 3.0)
    summary = real_text_seeds.summarise(real_text_seeds.complete_runs([str(tmp_path)]), {"fp8plug-blockwise"})
    by_seed = {s["seed"]: s for s in summary["seeds"]}
    assert sorted(by_seed) == [0, 1]
    assert by_seed[0]["bf16_runs"] == 2 and abs(by_seed[0]["diff_pct"] - 1.0) < 1e-9
    assert abs(by_seed[1]["diff_pct"] + 1.0) < 1e-9
    assert abs(summary["mean_pct"]) < 1e-9 and abs(summary["se_pct"] - 1.0) < 1e-9  # stdev of (+1, -1) is sqrt 2
    assert abs(summary["ci95_pct"] - 12.71) < 1e-9  # Student's t, one degree of freedom
    assert [s for s, _ in by_seed[0]["row_own_spikes"]] == [80] and by_seed[0]["bf16_own_spikes"] == []
    assert [s for s, _ in by_seed[1]["bf16_own_spikes"]] == [90] and by_seed[1]["row_own_spikes"] == []
    text = real_text_seeds.table(summary, "fp8plug-blockwise")
    assert "| 0 | 2 | 3.1000 | 3.1310 | +1.00% | 1 (1.25x) | 0 |" in text
    assert "mean +0.00%, standard error 1.00%" in text


def test_seeds_of_another_configuration_are_refused(tmp_path):
    _run(tmp_path, "r0", "fp8plug-blockwise", 0, 3.1)
    _run(tmp_path, "r1", "fp8plug-blockwise", 1, 3.1, lr=1e-3)
    with pytest.raises(SystemExit, match="2 configurations"):
        real_text_seeds.summarise(real_text_seeds.complete_runs([str(tmp_path)]), {"fp8plug-blockwise"})
