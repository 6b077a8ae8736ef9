"""Many seeds of benchmarks/training/real_text.py summed up: is a row's final held-out loss within a target of bf16's?

One pair of runs cannot say. Two bf16 runs of one seed on the same GPU kind ended 0.8% apart (the
trajectories part under run-to-run nondeterminism and the gap grows over training), and seeds
(other initial weights and batch order) differ by up to 3%, so a row is compared with bf16 seed by
seed, and the differences are averaged over seeds.

This reads every row JSON under the given directories and keeps the complete runs (every step
done) of one configuration (the spec with its seed left out, and the corpus's file list): the
configuration of the `--row` runs. For each seed that has both a `--row` run and a bf16 run it
reports the difference of the final held-out losses in % (the mean of the runs where a seed has
several, as along the curves), and the loss spikes (real_text.py's rule) each of the seed's first two runs has that the
other has not, with the largest one's size. Then the mean difference over seeds, its standard
error and a 95% interval (Student's t). `--png` draws each seed's difference along the held-out
curve.

    python3 benchmarks/training/real_text_seeds.py --row fp8plug-blockwise docs/results/h200/ \\
        --png docs/real_text_seeds.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_text import SPIKE_WINDOW, spikes_not_in  # noqa: E402

T_95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}  # two-sided


def configuration(run: dict) -> str:
    """What must be equal for two runs to be compared: the spec (seed aside) and the corpus."""
    spec = {k: v for k, v in run.get("spec", {}).items() if k != "seed"}
    return json.dumps([spec, (run.get("corpus") or {}).get("file_list_sha256")], sort_keys=True)


def complete_runs(paths: list) -> list:
    """Every row JSON under `paths` whose run did all its steps, with the seed made explicit (0 before --seed)."""
    runs = []
    for path in paths:
        files = [Path(path)] if Path(path).is_file() else sorted(Path(path).rglob("*.json"))
        for file in files:
            try:
                run = json.loads(file.read_text())
            except (OSError, ValueError):
                continue
            spec = run.get("spec") if isinstance(run, dict) else None
            if not spec or run.get("error") or run.get("steps_done") != spec.get("steps"):
                continue
            run["seed"] = spec.get("seed") or 0
            run["file"] = str(file)
            runs.append(run)
    return runs


def mean_curve(runs: list) -> dict:
    """step -> the mean held-out loss of `runs` at the steps all of them evaluated."""
    curves = [dict(run["eval_curve"]) for run in runs]
    steps = set.intersection(*(set(curve) for curve in curves))
    return {step: statistics.mean(curve[step] for curve in curves) for step in sorted(steps)}


def own_spikes(run: dict, other: dict) -> list:
    """(step, loss over its running median) of `run`'s spikes that `other` has not (real_text.spikes_not_in)."""
    losses = run["train_loss"]
    return [(s, losses[s] / statistics.median(losses[s - SPIKE_WINDOW:s]))
            for s in spikes_not_in(run["spikes"], other["spikes"])]


def summarise(runs: list, rows: set) -> dict:
    """Per seed and over seeds: the rows' final held-out loss against bf16's."""
    mine = [r for r in runs if r.get("row") in rows]
    configs = {configuration(r) for r in mine}
    if len(configs) != 1:
        raise SystemExit(f"real_text_seeds: the {sorted(rows)} runs found have {len(configs)} configurations; "
                         "pass the directories of one configuration")
    config = configs.pop()
    by_seed = defaultdict(lambda: dict(row=[], bf16=[]))
    for run in runs:
        if configuration(run) == config and (run.get("row") in rows or run.get("row") == "bf16"):
            by_seed[run["seed"]]["row" if run.get("row") in rows else "bf16"].append(run)
    seeds = []
    for seed, pair in sorted(by_seed.items()):
        if not pair["row"] or not pair["bf16"]:
            continue
        row = statistics.mean(r["final_eval_loss"] for r in pair["row"])
        bf16 = statistics.mean(r["final_eval_loss"] for r in pair["bf16"])
        first, base = pair["row"][0], pair["bf16"][0]
        seeds.append(dict(seed=seed, row_loss=row, bf16_loss=bf16, row_runs=len(pair["row"]),
                          bf16_runs=len(pair["bf16"]), diff_pct=100 * (row / bf16 - 1),
                          row_own_spikes=own_spikes(first, base), bf16_own_spikes=own_spikes(base, first),
                          curves=(mean_curve(pair["row"]), mean_curve(pair["bf16"]))))
    diffs = [s["diff_pct"] for s in seeds]
    out = dict(seeds=seeds, n=len(diffs), mean_pct=statistics.mean(diffs) if diffs else None)
    if len(diffs) > 1:
        out["se_pct"] = statistics.stdev(diffs) / len(diffs) ** 0.5
        out["ci95_pct"] = T_95.get(len(diffs) - 1, 2.0) * out["se_pct"]
    return out


def table(summary: dict, row: str) -> str:
    lines = [f"| seed | bf16 runs | bf16 loss | {row} | vs bf16 | its spikes bf16 has not (largest) | "
             "bf16's spikes it has not (largest) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    def spikes_cell(found):
        return f"{len(found)} ({max(r for _, r in found):.2f}x)" if found else "0"

    for s in summary["seeds"]:
        lines.append(f"| {s['seed']} | {s['bf16_runs']} | {s['bf16_loss']:.4f} | {s['row_loss']:.4f} | "
                     f"{s['diff_pct']:+.2f}% | {spikes_cell(s['row_own_spikes'])} | "
                     f"{spikes_cell(s['bf16_own_spikes'])} |")
    if summary.get("se_pct") is not None:
        lines.append(f"\nOver {summary['n']} seeds: mean {summary['mean_pct']:+.2f}%, standard error "
                     f"{summary['se_pct']:.2f}%, 95% interval {summary['mean_pct'] - summary['ci95_pct']:+.2f}% to "
                     f"{summary['mean_pct'] + summary['ci95_pct']:+.2f}%.")
    return "\n".join(lines)


def plot(summary: dict, row: str, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    by_step = defaultdict(list)
    for s in summary["seeds"]:
        mine, base = s["curves"]
        steps = sorted(set(mine) & set(base))
        diffs = [100 * (mine[k] / base[k] - 1) for k in steps]
        ax.plot(steps, diffs, marker="o", markersize=3, linewidth=1, alpha=0.7, label=f"seed {s['seed']}")
        for step, diff in zip(steps, diffs):
            by_step[step].append(diff)
    shared = [k for k in sorted(by_step) if len(by_step[k]) == len(summary["seeds"])]
    ax.plot(shared, [statistics.mean(by_step[k]) for k in shared], color="black", linewidth=2.5,
            label="mean over seeds")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(title=f"{row}: held-out loss against bf16's, seed by seed", xlabel="step", ylabel="% over bf16")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dirs", nargs="+", help="directories (searched recursively) or files of real_text.py row JSONs")
    p.add_argument("--row", required=True, help="the row compared with bf16; several names (comma-separated) "
                   "count as one, e.g. fp8plug-default,fp8plug-bf16head (older records' name for the "
                   "head-in-bf16 default)")
    p.add_argument("--png", help="write the per-seed curves of the difference here")
    args = p.parse_args(argv)
    summary = summarise(complete_runs(args.dirs), set(args.row.split(",")))
    print(table(summary, args.row.split(",")[0]))
    if args.png:
        plot(summary, args.row.split(",")[0], args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
