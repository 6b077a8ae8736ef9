"""`fp8plug bench` into a folder: bench.json, bench.csv, bench.md (speed-up by shape and engine,
one table per mode) and, if matplotlib is installed, speedup.png.

Every option of `fp8plug bench` works here too; --out replaces --json/--csv.

    python3 benchmarks/linear/bench_report.py --out out/linear                 # GPU: 70B shapes, eager+compiled
    # for fp8plug.tuning.roofline_fit.calibrate:
    python3 benchmarks/linear/bench_report.py --out out/sweep --shapes sweep
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for extra in (ROOT, ROOT / "benchmarks"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from fp8plug import bench  # noqa: E402


def speedup_markdown(data: dict) -> str:
    """One markdown table per mode: a row per shape, a column per engine, speed-up over bf16 (and
    the bf16 time), with failures shown as 'failed'."""
    rows, meta = data["rows"], data.get("meta", {})
    versions = [f"torch {meta.get('torch', '?')}"] + [
        f"{k} {meta[k]}" for k in ("torchao", "transformer_engine", "msamp") if k in meta]
    lines = ["# Linear forward+backward: FP8 speed-up over bf16", "",
             f"Device: {meta.get('device', '?')}; {', '.join(versions)}; median of {meta.get('repeats', '?')} "
             f"after {meta.get('warmup', '?')} warm-up ({meta.get('timing', '?')}); {meta.get('date_utc', '')}."]
    for mode in [m for m in bench.MODES if any(r["mode"] == m for r in rows)]:
        mode_rows = [r for r in rows if r["mode"] == mode]
        engines = list(dict.fromkeys(r["engine"] for r in mode_rows if r["engine"] != bench.BF16))
        shapes = list(dict.fromkeys(r["shape"] for r in mode_rows))
        cell = {(r["shape"], r["engine"]): r for r in mode_rows}
        lines += ["", f"## {mode}", "", "| shape (MxKxN) | bf16 ms | " + " | ".join(engines) + " |",
                  "|---|---:|" + "---:|" * len(engines)]
        for shape in shapes:
            base = cell.get((shape, bench.BF16), {})
            out = [shape, "failed" if base.get("ms") is None else f"{base['ms']:.3f}"]
            for engine in engines:
                r = cell.get((shape, engine))
                out.append("-" if r is None else ("failed" if r.get("speedup") is None else f"{r['speedup']:.2f}x"))
            lines.append("| " + " | ".join(out) + " |")
        failures = [r for r in mode_rows if r.get("error")]
        if failures:
            lines += [""] + [f"- {r['shape']} {r['engine']}: {r['error']}" for r in failures]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_arguments(parser)
    parser.add_argument("--out", default="out/linear", help="folder for bench.json, bench.csv, bench.md, speedup.png")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.json_path, args.csv_path = str(out / "bench.json"), str(out / "bench.csv")
    status = bench.run(args)
    if status == 2 or not (out / "bench.json").exists():
        return status
    data = json.loads((out / "bench.json").read_text())
    (out / "bench.md").write_text(speedup_markdown(data))
    print(f"wrote {out / 'bench.md'}")
    try:
        import plot_speedup

        plot_speedup.plot(data, str(out / "speedup.png"))
        print(f"wrote {out / 'speedup.png'}")
    except ImportError:
        print("matplotlib not installed: no speedup.png (python3 benchmarks/linear/plot_speedup.py can make it later)")
    return status


if __name__ == "__main__":
    sys.exit(main())
