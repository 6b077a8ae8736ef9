"""PNG of FP8 speed-up over bf16 by Linear shape, from `fp8plug bench --json` output.

One panel per mode (eager, compiled); in each, one group of bars per shape and one bar per
engine; the dashed line at 1.0 is bf16. Failed cases are left out of the bars (the JSON and the
bench table say why). matplotlib is needed here only, not by fp8plug.

    python3 benchmarks/linear/plot_speedup.py bench.json --out speedup.png
"""

from __future__ import annotations

import argparse
import json
import sys


def speedups(rows, mode):
    """({engine: {shape: speed-up}}, [shapes in bench order]) for one mode, bf16 left out."""
    shapes, table = [], {}
    for r in rows:
        if r.get("mode") != mode:
            continue
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
        if r["engine"] == "bf16" or not r.get("speedup"):
            continue
        table.setdefault(r["engine"], {})[r["shape"]] = r["speedup"]
    return table, shapes


def plot(data: dict, out: str, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    modes = [m for m in ("eager", "compiled") if any(r.get("mode") == m for r in rows)]
    if not modes:
        raise ValueError("plot_speedup: the JSON has no rows; run `fp8plug bench --json PATH` first.")
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        table, shapes = speedups(rows, mode)
        engines = sorted(table)
        width = 0.8 / max(len(engines), 1)
        for i, engine in enumerate(engines):
            xs = [j + (i - (len(engines) - 1) / 2) * width for j, s in enumerate(shapes) if s in table[engine]]
            ys = [table[engine][s] for s in shapes if s in table[engine]]
            bars = ax.bar(xs, ys, width, label=engine)
            for bar, y in zip(bars, ys):
                ax.annotate(f"{y:.2f}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=20, ha="right", fontsize=8)
        ax.set_xlabel("shape M x K x N")
        ax.set_ylabel(f"speed-up over bf16 ({mode})")
        ax.set_title(mode)
        if engines:
            ax.legend(fontsize=8)
    meta = data.get("meta", {})
    fig.suptitle(title or (f"FP8 Linear forward+backward vs bf16\n"
                           f"{meta.get('device', '?')}, torch {meta.get('torch', '?')}"),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="fp8plug bench --json output")
    parser.add_argument("--out", default="speedup.png", help="PNG to write")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    try:
        plot(data, args.out, args.title)
    except ImportError:
        print("plot_speedup: matplotlib is not installed (pip install matplotlib); fp8plug itself does not need it.",
              file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
