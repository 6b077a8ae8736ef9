"""What `fp8plug bench` shows and writes: the progress line, the text table, the environment it ran
in, and the JSON and CSV files."""

from __future__ import annotations

import csv
import datetime
import json
import sys
from typing import List

import torch

from fp8plug.backends.gemm import EMULATION_NOTE, format_speedup
from fp8plug.bench.cases import MODES

CSV_COLUMNS = (
    "shape", "M", "K", "N", "mode", "engine", "backend", "scaling", "default_scaling",
    "ms", "tflops", "speedup", "vs_bf16_compiled", "error",
)


class Progress:
    """tqdm on stderr if it is installed, else one plain line per case."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="case", dynamic_ncols=True, leave=False)
            except ImportError:
                self.bar = None

    def start(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(text)
        else:
            print(f"[{self.done + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec if abs(value) >= 10 else ".3g")


def format_table(rows: List[dict], emulated: bool = False) -> str:
    """A plain text table: shape, mode, engine, ms, TFLOP/s, speed-up over bf16 of the same mode
    (and over compiled bf16 when eager rows sit beside compiled ones), note. `emulated`: the FP8
    GEMMs were emulated (a CPU), which the ratio columns' headings say, and a line under the table."""
    both = {r["mode"] for r in rows} == set(MODES)
    suffix = " (FP8 emulated)" if emulated else ""
    header = ("shape (MxKxN)", "mode", "engine", "ms", "TFLOP/s", f"vs bf16{suffix}") + (
        (f"vs bf16 compiled{suffix}",) if both else ()) + ("note",)
    ratio = format_speedup

    body = [
        (r["shape"], r["mode"], r["engine"], _fmt(r["ms"], ".3f"), _fmt(r["tflops"], ".1f"), ratio(r["speedup"]))
        + ((ratio(r["vs_bf16_compiled"]),) if both else ()) + (r["error"] or "",)
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [header] + body) for i in range(len(header) - 1)]
    lines = []
    for line in [header] + body:
        cells = [str(c).ljust(w) if i < 3 else str(c).rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        lines.append("  ".join(cells + [line[-1]]).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    lines.append("vs bf16: bf16's time / this row's (bigger is faster)." + (f" {EMULATION_NOTE}." if emulated else ""))
    return "\n".join(lines)


def environment(device: torch.device, device_text: str) -> dict:
    """Who measured what, where: versions, device, date."""
    from fp8plug import __version__

    meta = {
        "fp8plug": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device": device_text,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    for module in ("torchao", "transformer_engine", "msamp"):
        if module in sys.modules:
            meta[module] = getattr(sys.modules[module], "__version__", "?")
    return meta


def write_json(path: str, meta: dict, rows: List[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
        f.write("\n")


def write_csv(path: str, rows: List[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
