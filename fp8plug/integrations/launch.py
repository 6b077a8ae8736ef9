"""`fp8plug launch`: accelerate's own launcher, with fp8plug's engines counted as FP8 support.

`accelerate launch` with mixed precision fp8 (a config's `mixed_precision: fp8`, or the flag)
first checks that TransformerEngine, MS-AMP or torchao is installed, and stops before the script
runs where none is, although `fp8plug.Accelerator` trains in FP8 with its `native` engine on torch
alone. This command runs accelerate's launcher unchanged (same arguments, same config files, same
environment for the processes) except for that one check: FP8 counts as available where
accelerate's own check passes or where fp8plug's native engine can run. Where neither holds, it
stops at launch and says why. The check is widened only inside this launcher process; the
launched processes import accelerate untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional, Sequence

from fp8plug._upstream import launcher_fp8_check


def native_fp8_problem() -> Optional[str]:
    """Why fp8plug's native engine cannot run on this machine's CPU or GPU, or None where it can."""
    from fp8plug.backends import get_backend
    from fp8plug.tuning.hardware import device_info

    engine = get_backend("native")
    probe = engine.probe()
    if not probe.available:
        return probe.reason
    ok, reason = engine.supports(device_info())
    return None if ok else reason


def fp8_check_widened():
    """Within the block (a context manager), accelerate's launcher takes FP8 as available where
    fp8plug's native engine runs; where it cannot either, the launcher's refusal names both
    reasons."""

    def is_fp8_available(original) -> bool:
        if original():
            return True
        problem = native_fp8_problem()
        if problem is None:
            return True
        raise RuntimeError(
            "fp8plug launch: mixed precision fp8 cannot run here: none of TransformerEngine, MS-AMP or "
            f"torchao is installed, and fp8plug's native engine cannot run ({problem}); install torchao, "
            "or launch without mixed_precision fp8."
        )

    return launcher_fp8_check(is_fp8_available)


def main(argv: Sequence[str]) -> int:
    """`fp8plug launch ARGS`: `accelerate launch ARGS` with the FP8 check widened (module doc)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    parser = launch_command_parser()
    parser.prog = "fp8plug launch"
    args = parser.parse_args(list(argv))
    problem = script_problem(args)
    if problem:
        print(f"fp8plug launch: {problem}", file=sys.stderr)
        return 2
    with fp8_check_widened():
        try:
            launch_command(args)
        except Exception as exc:
            status = script_exit_status(exc)
            if status is None:
                raise
            print(f"fp8plug launch: {args.training_script} exited with status {status}", file=sys.stderr)
            return status
    return 0


def script_problem(args) -> Optional[str]:
    """'no such script: PATH' where the script to launch is a path that does not exist (not with
    --module or --no_python, which name a module or a program), else None: found before any
    process starts, rather than as each one's failure."""
    if args.module or args.no_python or os.path.exists(args.training_script):
        return None
    return f"no such script: {args.training_script}"


def script_exit_status(error: BaseException) -> Optional[int]:
    """The exit status of the launched script that `error` reports (accelerate's launcher raises
    CalledProcessError for one process, torchrun ChildFailedError for several: the first failed
    rank's), as a shell gives it (128 + N for a signal N); None for any other error. Returned as
    fp8plug launch's own, so a scheduler sees the script's status rather than a generic 1."""
    code = None
    if isinstance(error, subprocess.CalledProcessError):
        code = error.returncode
    else:
        try:
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        except ImportError:  # pragma: no cover - torch built without distributed
            return None
        if isinstance(error, ChildFailedError):
            code = error.get_first_failure()[1].exitcode
    if code is None:
        return None
    return 128 - code if code < 0 else code


__all__ = ["fp8_check_widened", "main", "native_fp8_problem", "script_exit_status", "script_problem"]
