"""What FP8 for any token count costs: one Linear's forward+backward at token counts an FP8 GEMM
cannot take as they are (2047, 2049, 4095, 8191, 8 x 31 = 248), which the engines now zero-pad,
next to the aligned counts around them and to bf16 at the same count.

Columns: ms (median, fp8plug bench's queued GPU timing), the speed-up over bf16 nn.Linear at the
same token count, and, for an odd count, its time over the time of the aligned count it is padded
to ("vs padded"; 1.00 means the padding copies cost nothing beyond the padded GEMMs). "fp8" says
whether the call really ran in FP8 (fp8plug.fp8_coverage), so a silent fallback shows.

    python3 benchmarks/linear/odd_tokens.py                       # GPU: ao and te, K=N=4096, eager+compiled
    python3 benchmarks/linear/odd_tokens.py --engines ao,te:current,native --tokens 2047,2048 --json out/odd.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fp8plug import (  # noqa: E402
    FP8RecipeKwargs,
    bench,  # noqa: E402
    fp8_coverage,
    get_backend,
)
from fp8plug.tuning.hardware import device_info  # noqa: E402

DEFAULT_TOKENS = "248,256,2047,2048,2049,2064,4095,4096,8191,8192"


def aligned_up(m: int, multiple: int = 16) -> int:
    return -(-m // multiple) * multiple


def ran_in_fp8(spec: bench.EngineSpec, m: int, k: int, n: int, device) -> str:
    """'yes', 'no' or 'unknown' (an engine without GEMM counts): one forward+backward, counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16))
    engine = get_backend(spec.backend)
    recipe = FP8RecipeKwargs(backend=spec.backend, scaling=spec.scaling, auto_filter=False)
    engine.convert(model, recipe)
    with engine.autocast(recipe, enabled=True):
        model(torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    layers = fp8_coverage(model)["layers"]
    if not layers:
        return "unknown"
    return "yes" if layers["0"] == (1, 0) else "no"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="ao,te", help="comma list of engine[:scaling] (default ao,te)")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help=f"token counts M (default {DEFAULT_TOKENS})")
    parser.add_argument("--dims", default="4096x4096", help="KxN, in and out features (default 4096x4096)")
    parser.add_argument("--modes", default=None, help="eager,compiled (default both on a GPU, eager on the CPU)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", dest="json_path", default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    k, n = (int(v) for v in args.dims.lower().split("x"))
    tokens = sorted({int(t) for t in args.tokens.split(",") if t.strip()})
    modes = bench.parse_modes(args.modes) if args.modes else (list(bench.MODES) if device.type == "cuda" else ["eager"])
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)
    repeats = args.repeats if args.repeats is not None else (20 if device.type == "cuda" else 3)
    timer = bench.Timer(device, warmup, repeats)
    specs, unavailable = bench.resolve_engines(args.engines, device_info(device))
    specs = [s for s in specs if s.backend is not None]
    rows = []
    for mode in modes:
        for m in tokens:
            base = bench.measure(bench.EngineSpec(bench.BF16), (m, k, n), mode, device, timer)
            rows.append({**base, "fp8": None})
            for spec in specs:
                row = bench.measure(spec, (m, k, n), mode, device, timer, unavailable.get(spec.backend))
                if row["ms"] and base["ms"]:
                    row["speedup"] = base["ms"] / row["ms"]
                row["fp8"] = None if row["error"] else ran_in_fp8(spec, m, k, n, device)
                rows.append(row)
            print(f"{mode} M={m} done", file=sys.stderr, flush=True)
    for row in rows:  # an odd count against the aligned count it is padded to, where measured
        padded = aligned_up(row["M"])
        twin = next((r for r in rows
                     if r["M"] == padded and r["engine"] == row["engine"] and r["mode"] == row["mode"]), None)
        row["vs_padded"] = ((row["ms"] / twin["ms"])
                            if padded != row["M"] and twin and row["ms"] and twin["ms"] else None)
    print(table(rows, device, k, n))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps({"meta": bench.environment(device, device_info(device).describe()),
                                                    "rows": rows}, indent=1))
    return 0


def table(rows, device, k, n) -> str:
    lines = [f"# Odd token counts: one Linear {k}->{n} forward+backward on {device_info(device).describe()}", "",
             "| mode | M | engine | ms | vs bf16 | vs padded | fp8 |", "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        ms = r["error"] if r["error"] else fmt(r["ms"], ".3f")
        speed = "" if r["engine"] == bench.BF16 else fmt(r["speedup"], ".2f")
        lines.append(f"| {r['mode']} | {r['M']} | {r['engine']} | {ms} | {speed} | "
                     f"{fmt(r['vs_padded'], '.2f')} | {r['fp8'] or ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
