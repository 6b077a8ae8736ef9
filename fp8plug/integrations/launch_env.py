"""How accelerate's launcher flags read from the environment, in one place.

`accelerate launch` passes its choices to the processes it starts as environment variables
(ACCELERATE_USE_CPU, ACCELERATE_USE_DEEPSPEED, ...). fp8plug must read them as accelerate does
before accelerate.Accelerator.__init__ runs (to join CPU processes, to see DeepSpeed coming), and
both fp8plug.integrations.cpu_processes and fp8plug.integrations.deepspeed_zero ask, so the reading
lives here, below both.
"""

from __future__ import annotations

import os


def env_flag(name: str) -> bool:
    """Whether environment variable `name` holds a true value, as accelerate reads its flags."""
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes", "on", "y", "t")


def deepspeed_requested(arguments: dict) -> bool:
    """Whether accelerate.Accelerator(**arguments) would run under DeepSpeed if it could: a
    `deepspeed_plugin` argument, or a DeepSpeed launch config (ACCELERATE_USE_DEEPSPEED)."""
    return arguments.get("deepspeed_plugin") is not None or env_flag("ACCELERATE_USE_DEEPSPEED")


__all__ = ["deepspeed_requested", "env_flag"]
