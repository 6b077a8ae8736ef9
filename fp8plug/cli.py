"""The `fp8plug` command: `fp8plug env` (what can run here and what would be chosen),
`fp8plug bench` (Linear speed per engine, see fp8plug.bench) and `fp8plug launch` (accelerate's
launcher, taking FP8 as available where only fp8plug's native engine runs; fp8plug.launch)."""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Optional, Sequence


def env_report(device=None) -> str:
    """Versions, the device, every engine's availability with its reason, and the automatic choice."""
    import torch

    import accelerate

    from .backends import BackendUnavailableError, select_backend
    from .hardware import device_info, parse_device

    info = device_info(parse_device(device))
    lines = [
        f"Python       {platform.python_version()} ({sys.executable})",
        f"torch        {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        f"accelerate   {accelerate.__version__}",
        f"device       {info.describe()}",
        f"FP8 GEMMs    {fp8_gemm_status(info)}",
    ]
    try:
        selection = select_backend(None, info)
        lines.extend(selection.explain().splitlines()[1:])  # its first line repeats the device
        lines.append(f"automatic choice: {selection.name} ({selection.backend.title})")
        for compiled in (True, False):  # what fp8plug.Accelerator picks once it knows how the model runs
            ranked = select_backend(None, info, compiled=compiled)
            if ranked.mode:
                lines.append(f"  for a {ranked.mode} model: {ranked.summary()}")
        lines.append(f"auto_filter  {auto_filter_status(selection.name, info)}")
    except BackendUnavailableError as exc:
        lines.append(str(exc))
        lines.append("automatic choice: none")
    return "\n".join(lines)


def fp8_gemm_status(info) -> str:
    """How FP8 GEMMs run on the device and one FP8 GEMM's time against bf16's, measured now (a few
    milliseconds), or why they cannot run."""
    from .fp8_gemm import fp8_gemm_speed

    if not info.fp8_gemm:
        return "none on this device (FP8 GEMMs need CUDA compute capability 8.9+ or a CPU)"
    speed = fp8_gemm_speed(info.type)
    if speed.how == "emulated":
        return (f"{speed.describe()}; a CPU has no FP8 matrix units, so FP8 here checks numerics "
                "and code paths, not speed")
    return speed.describe()


def auto_filter_status(backend: str, info) -> str:
    """Whether FP8RecipeKwargs' default speed filter would act for `backend` on this device."""
    from .recipe import FP8RecipeKwargs
    from .roofline import AUTO_MIN_SPEEDUP, auto_filter

    try:
        speed_filter = auto_filter(FP8RecipeKwargs(backend=backend), backend, info)
    except ValueError as exc:  # FP8PLUG_AUTO_FILTER=true where no calibration exists
        return f"asked for, but: {exc}"
    if speed_filter is None:
        return "off (no calibrated cost model for this engine and device, or turned off)"
    return (f"on: Linears predicted below {AUTO_MIN_SPEEDUP:g}x bf16's speed at {speed_filter.tokens} tokens "
            "stay in bf16 (FP8RecipeKwargs.auto_filter)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # every argument after it is accelerate launch's
        from .launch import main as launch_main

        return launch_main(argv[1:])
    parser = argparse.ArgumentParser(prog="fp8plug", description="fp8plug: FP8 training for PyTorch and Accelerate")
    commands = parser.add_subparsers(dest="command")
    env = commands.add_parser("env", help="report versions, the device, each FP8 engine and the automatic choice")
    env.add_argument("--device", default=None, help="device to judge (default: cuda if present, else cpu)")
    commands.add_parser("launch", add_help=False,
                        help="accelerate launch, with FP8 available where only fp8plug's native engine runs "
                             "(`fp8plug launch --help`: accelerate launch's arguments)")
    bench = commands.add_parser("bench", help="time Linear forward+backward per engine against bf16")
    if _command(argv) == "bench":  # its options need torch: built only for `fp8plug bench ...`
        from . import bench as bench_module

        bench_module.add_arguments(bench)
    args = _parse(parser, commands, argv)
    if args.command == "env":
        try:
            report = env_report(args.device)
        except ValueError as exc:  # a bad --device: one line, not a traceback
            print(f"fp8plug env: {exc}", file=sys.stderr)
            return 2
        print(report)
        return 0
    return bench_module.run(args)


def _command(argv: Sequence[str]) -> Optional[str]:
    """The subcommand `argv` names: its first argument that is not an option (the top-level
    parser's only option is --help)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _parse(parser: argparse.ArgumentParser, commands, argv: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, except that an argument nobody knows is named, with the usage of
    the subcommand it was given to (argparse alone says "required: command" for `fp8plug --bogus`
    and shows the top-level usage for `fp8plug bench --bogus`). Exits with status 2 on an error,
    as argparse does."""
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}; name a command: {', '.join(commands.choices)}"
                     if unknown else f"name a command: {', '.join(commands.choices)}")
    if unknown:
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


if __name__ == "__main__":
    raise SystemExit(main())
