"""The FP8 settings `accelerate launch` replaced, seen from a process it started.

Why: `accelerate launch` in mixed precision fp8 sets every ACCELERATE_FP8_* variable it knows in
the processes it starts (from its flags, its config file's `fp8_config:`, or its own defaults), over
whatever the shell had exported. A bad value exported there (ACCELERATE_FP8_FORMAT=bogus) would be
replaced unseen, and the run would go on with another setting. The launcher's own environment, as
it was when the launcher started, is still readable from a process it started (Linux:
/proc/<parent>/environ), so fp8plug.recipe.kwargs checks each value the launch replaced as it
would have checked it. Elsewhere (another OS, a parent that is not accelerate's launcher, as under
torchrun or mpirun across machines) nothing is found and nothing is checked.
"""

from __future__ import annotations

import functools
import os
from typing import Dict, Iterable, Mapping, Optional, Tuple


def replaced_by_launch(variables: Iterable[str], environ: Mapping[str, str] = os.environ,
                       parent: Optional[int] = None) -> Dict[str, Tuple[str, str]]:
    """Each of `variables` that the launcher this process was started by had in its environment
    with another value than `environ` gives it: variable -> (the launcher's value, this process's).
    Empty where the parent (`parent`, a process id; default: this process's parent) is not
    `accelerate launch` or `fp8plug launch`, or its environment cannot be read."""
    launcher = launcher_environment(os.getppid() if parent is None else parent)
    if not launcher:
        return {}
    return {name: (launcher[name], environ[name]) for name in variables
            if name in launcher and name in environ and launcher[name] != environ[name]}


@functools.lru_cache(maxsize=None)
def launcher_environment(pid: int) -> Optional[Dict[str, str]]:
    """The environment process `pid` started with, where it is accelerate's launcher (`accelerate
    launch`, `python -m accelerate.commands.launch`, `fp8plug launch`); None otherwise or where
    /proc cannot tell. Read once per process: a process's starting environment never changes."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [arg.decode(errors="replace") for arg in f.read().split(b"\0") if arg]
        if not is_launcher(argv):
            return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = [entry.decode(errors="replace") for entry in f.read().split(b"\0") if b"=" in entry]
    except OSError:  # no /proc (not Linux), or the parent is gone or not ours to read
        return None
    return dict(entry.split("=", 1) for entry in entries)


def is_launcher(argv) -> bool:
    """Whether command line `argv` runs accelerate's launcher: `accelerate launch`, `accelerate-launch`,
    `python -m accelerate.commands.launch`, or `fp8plug launch` (the same launcher, fp8plug.integrations.launch)."""
    names = [os.path.basename(arg) for arg in argv]
    if "accelerate.commands.launch" in names or any(name.startswith("accelerate-launch") for name in names):
        return True
    return any(name in ("accelerate", "fp8plug") and following == "launch"
               for name, following in zip(names, names[1:]))


__all__ = ["is_launcher", "launcher_environment", "replaced_by_launch"]
