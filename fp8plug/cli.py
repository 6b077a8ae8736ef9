"""The `fp8plug` command: `fp8plug env` (what can run here and what would be chosen),
`fp8plug bench` (Linear speed per engine, see fp8plug.bench) and `fp8plug launch` (accelerate's
launcher, taking FP8 as available where only fp8plug's native engine runs; fp8plug.integrations.launch)."""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
from typing import Optional, Sequence


def env_report(device=None) -> str:
    """Versions, the device, every engine's availability with its reason, and the automatic choice."""
    import accelerate
    import torch

    from fp8plug.backends import BackendUnavailableError, select_backend
    from fp8plug.recipe.kwargs import FP8RecipeKwargs
    from fp8plug.tuning.hardware import device_info, parse_device

    info = device_info(parse_device(device))
    lines = [
        f"Python       {platform.python_version()} ({sys.executable})",
        f"torch        {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        f"accelerate   {accelerate.__version__}",
        f"device       {info.describe()}",
        f"FP8 GEMMs    {fp8_gemm_status(info)}",
    ]
    settings_problem = fp8_settings_problem(info)
    lines.append(f"FP8 settings {fp8_settings_status(settings_problem)}")
    try:
        selection = select_backend(None, info)
        lines.extend(selection.explain().splitlines()[1:])  # its first line repeats the device
        lines.append(f"automatic choice: {selection.name} ({selection.backend.title})")
        for compiled in (True, False):  # what fp8plug.Accelerator picks once it knows how the model runs
            ranked = select_backend(None, info, compiled=compiled)
            if ranked.mode:
                lines.append(f"  for a {ranked.mode} model: {ranked.summary()}")
        # at the scaling the choice tunes the engine to, as fp8plug.Accelerator runs it
        status = (auto_filter_status(selection.name, info, selection.tune(FP8RecipeKwargs()).scaling)
                  if settings_problem is None
                  else "not judged: the FP8 settings above are bad")
        lines.append(f"auto_filter  {status}")
    except BackendUnavailableError as exc:
        lines.append(str(exc))
        lines.append("automatic choice: none")
    return "\n".join(lines)


def fp8_setting_variables() -> list:
    """Every environment variable an FP8RecipeKwargs reads (fp8plug.recipe.environment)."""
    from fp8plug.recipe.environment import VARIABLES

    return list(VARIABLES)


def fp8_settings_problem(info=None, environ=None) -> Optional[str]:
    """Why the FP8 settings in the environment (ACCELERATE_FP8_*, FP8PLUG_*) cannot be used, naming
    the variable, its value and what is allowed; None where a recipe built from them is valid,
    its scaling included: checked against the backend they name, else against the engine chosen
    automatically on device `info` (a DeviceInfo; None: this machine's), as fp8plug.Accelerator
    would check it when built."""
    from fp8plug.backends import BackendUnavailableError, get_backend, select_backend
    from fp8plug.recipe import BACKENDS, FP8RecipeKwargs
    from fp8plug.recipe.environment import ENV_NAMES

    environ = os.environ if environ is None else environ
    try:
        recipe = FP8RecipeKwargs()
    except ValueError as exc:
        return _naming_variable(str(exc), environ)
    if recipe.scaling is None:
        return None
    try:
        engines = [get_backend(recipe.backend) if recipe.backend else select_backend(None, info).backend]
    except BackendUnavailableError:  # no engine runs here: any engine's scaling is one
        engines = [get_backend(name) for name in BACKENDS]
    refusals = []
    for engine in engines:
        try:
            engine.scaling_name(recipe.scaling)
            return None
        except ValueError as exc:
            refusals.append(str(exc))
    if len(engines) > 1:
        allowed = "; ".join(f"{', '.join(e.scalings)} ({e.name})" for e in engines)
        refusal = f"FP8RecipeKwargs.scaling: {recipe.scaling!r} is no engine's scaling; use one of {allowed}."
    else:
        refusal = refusals[0]
        if not recipe.backend:
            refusal += (f" ({engines[0].name} is the engine chosen automatically here; set ACCELERATE_FP8_BACKEND "
                        "to one that has this scaling.)")
    variables = [name for name in ENV_NAMES["scaling"] if name in environ]
    return f"{', '.join(f'{name}={environ[name]!r}' for name in variables)}: {refusal}"


def _naming_variable(message: str, environ) -> str:
    """A recipe's error `message`, led by the variable(s) that gave the field it names and their
    values, where it does not name them already."""
    from fp8plug.recipe.environment import VARIABLES

    match = re.match(r"FP8RecipeKwargs\.(\w+)", message)
    field = match.group(1) if match else None
    variables = [name for name, given in VARIABLES.items() if given == field and name in environ]
    if not variables or any(name in message for name in variables):
        return message
    given = [name for name in variables if repr(environ[name]) in message] or variables
    return f"{', '.join(f'{name}={environ[name]!r}' for name in given)}: {message}"


def fp8_settings_status(problem: Optional[str]) -> str:
    """The env report's line on the FP8 settings in the environment."""
    if problem is not None:
        return f"bad: {problem}"
    given = [f"{name}={os.environ[name]}" for name in fp8_setting_variables() if name in os.environ]
    return f"from the environment: {', '.join(given)}" if given else "none in the environment (the defaults)"


def fp8_gemm_status(info) -> str:
    """How FP8 GEMMs run on the device and one FP8 GEMM's time against bf16's, measured now (a few
    milliseconds), or why they cannot run."""
    from fp8plug.backends.gemm import fp8_gemm_speed

    if not info.fp8_gemm:
        return "none on this device (FP8 GEMMs need CUDA compute capability 8.9+ or a CPU)"
    return fp8_gemm_speed(info.type).describe()


def auto_filter_status(backend: str, info, scaling: Optional[str] = None) -> str:
    """Whether FP8RecipeKwargs' default speed filter would act for `backend` (at `scaling`, the one
    the automatic choice tunes it to) on this device."""
    from fp8plug.recipe.kwargs import FP8RecipeKwargs
    from fp8plug.tuning.roofline import AUTO_MIN_SPEEDUP, auto_filter

    try:
        speed_filter = auto_filter(FP8RecipeKwargs(backend=backend, scaling=scaling), backend, info)
    except ValueError as exc:  # FP8PLUG_AUTO_FILTER=true where no calibration exists
        return f"asked for, but: {exc}"
    if speed_filter is None:
        return "off (no calibrated cost model for this engine and device, or turned off)"
    return (f"on: Linears predicted below {AUTO_MIN_SPEEDUP:g}x bf16's speed at {speed_filter.tokens} tokens "
            "stay in bf16 (FP8RecipeKwargs.auto_filter)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # every argument after it is accelerate launch's
        from fp8plug.integrations.launch import main as launch_main

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
        from fp8plug import bench as bench_module

        bench_module.add_arguments(bench)
    args = _parse(parser, commands, argv)
    if args.command == "env":
        try:
            report = env_report(args.device)
        except ValueError as exc:  # a bad --device: one line, not a traceback
            print(f"fp8plug env: {exc}", file=sys.stderr)
            return 2
        print(report)
        from fp8plug.tuning.hardware import device_info, parse_device

        problem = fp8_settings_problem(device_info(parse_device(args.device)))
        if problem is not None:  # what would fail at prepare(): a non-zero status, as a check should give
            print(f"fp8plug env: bad FP8 setting: {problem}", file=sys.stderr)
            return 1
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
