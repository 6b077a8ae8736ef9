"""`fp8plug bench`'s options: parsing the shape and mode lists, the argparse options (shared by the
`fp8plug bench` subcommand and `python -m fp8plug.bench`), and the settings they resolve to on this
machine. Bad input is a ValueError naming the option and the expected form."""

from __future__ import annotations

import argparse
import os
from typing import List, Tuple

import torch

from fp8plug.bench.cases import CPU_SHAPES, LLAMA70B_SHAPES, MODES, SHAPE_PRESETS, Shape
from fp8plug.bench.timing import TIMINGS
from fp8plug.tuning.hardware import parse_device


def parse_shapes(text: str) -> List[Shape]:
    """`MxKxN[,MxKxN...]` or a preset name (llama70b, tiny, sweep) -> [(M, K, N), ...].

    M is the token count, K the input features, N the output features. Raises ValueError naming
    the bad part and the expected form."""
    if text is None or not str(text).strip():
        raise ValueError("--shapes: empty; give MxKxN[,MxKxN...] (e.g. 16384x8192x8192) or a preset: "
                         + ", ".join(SHAPE_PRESETS))
    key = str(text).strip().lower()
    if key in SHAPE_PRESETS:
        return list(SHAPE_PRESETS[key])
    shapes = []
    for part in key.split(","):
        part = part.strip()
        if not part:
            continue
        dims = part.split("x")
        try:
            values = tuple(int(d) for d in dims)
        except ValueError:
            values = ()
        if len(dims) != 3 or len(values) != 3:
            raise ValueError(
                f"--shapes: {part!r} is not MxKxN (three integers joined by 'x', e.g. 16384x8192x8192; "
                f"presets: {', '.join(SHAPE_PRESETS)})."
            )
        if min(values) <= 0:
            raise ValueError(f"--shapes: {part!r} has a dimension <= 0; every one of M, K, N must be positive.")
        shapes.append(values)
    if not shapes:
        raise ValueError("--shapes: no shape given; use MxKxN[,MxKxN...].")
    return shapes


def parse_modes(text: str) -> List[str]:
    """`eager,compiled` -> ["eager", "compiled"]; anything else is a ValueError."""
    modes = [m.strip().lower() for m in str(text).split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes: {', '.join(bad) or 'nothing'} not allowed; use one or both of {', '.join(MODES)}.")
    return list(dict.fromkeys(modes))


def _argtype(parse):
    def convert(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `fp8plug bench`'s options to `parser` (the CLI's subcommand parser or our own)."""
    parser.add_argument(
        "--shapes", type=_argtype(parse_shapes), default=None, metavar="MxKxN,...",
        help="Linear shapes: M tokens, K in features, N out features, comma separated, or a preset "
             "(llama70b, tiny, sweep). Default: llama70b on a GPU, tiny (256x256x256) on the CPU.",
    )
    parser.add_argument(
        "--engines", default=None, metavar="LIST",
        help="auto (every usable engine, default scaling, plus the bare fp8-gemm bound), all (every "
             "scaling), or a comma list like native:dynamic,ao:tensorwise,te:current,fp8-gemm. "
             "bf16 nn.Linear is always measured as the baseline.",
    )
    parser.add_argument(
        "--modes", type=_argtype(parse_modes), default=None, metavar="eager,compiled",
        help="eager, compiled (torch.compile), or both. Default: both on a GPU, eager on the CPU.",
    )
    parser.add_argument("--compile", action="store_true",
                        help="also run compiled (same as adding 'compiled' to --modes)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default: 5 GPU, 2 CPU)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed iterations; the median is reported (default: 20 GPU, 5 CPU)")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="measure every case this many times, the cases taking turns, and report the median "
             "(a case's speed on a GPU varies by a few percent from one build of it to the next)",
    )
    parser.add_argument(
        "--timing", choices=TIMINGS, default="queued",
        help="GPU timing: queued (the GPU's own time per step, as inside a model whose host runs "
             "ahead; default) or synced (each step alone, host time included)",
    )
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--csv", dest="csv_path", default=None, metavar="PATH", help="write the results as CSV")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def check_output_path(path, option: str) -> None:
    """A ValueError naming `option` and `path` if the results could not be written there: its
    folder missing or not writable, or the path itself a folder."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{option}: {path!r} is a folder; give a file path, "
                         f"e.g. {os.path.join(path, 'bench.' + option.lstrip('-'))!r}.")
    if not os.path.isdir(folder):
        raise ValueError(
            f"{option}: the folder {folder!r} of {path!r} does not exist; create it first or write elsewhere.")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{option}: the folder {folder!r} of {path!r} is not writable; write elsewhere.")


def settings(args) -> Tuple[torch.device, List[Shape], List[str], int, int]:
    for option, path in (("--json", getattr(args, "json_path", None)), ("--csv", getattr(args, "csv_path", None))):
        check_output_path(path, option)  # before any measuring, not after it
    device = parse_device(args.device)
    gpu = device.type == "cuda"
    shapes = args.shapes or (LLAMA70B_SHAPES if gpu else CPU_SHAPES)
    modes = list(args.modes or (["eager", "compiled"] if gpu else ["eager"]))
    if getattr(args, "compile", False) and "compiled" not in modes:
        modes.append("compiled")
    warmup = args.warmup if args.warmup is not None else (5 if gpu else 2)
    repeats = args.repeats if args.repeats is not None else (20 if gpu else 5)
    if warmup < 0:
        raise ValueError("--warmup: must be >= 0.")
    if repeats < 1:
        raise ValueError("--repeats: must be >= 1.")
    if getattr(args, "rounds", 1) < 1:
        raise ValueError("--rounds: must be >= 1.")
    return device, shapes, modes, warmup, repeats
