"""One benchmark row in a process of its own, with empty compile caches: what every row-per-process
benchmark here (hf_llama.py, lora_fp8_base.py, benchmarks/moe/moe_llm.py) launches its rows with.

Why: a row's time to its first step, and its memory, are a first run's only in a fresh process whose
inductor and Triton caches start empty; and a row that runs past its time must take its compile
workers down with it, so it runs in a process group of its own (start_new_session) and the whole
group is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]


def run_fresh(cmd: list, timeout: float, caches_in: Optional[str] = None) -> Tuple[Optional[int], str]:
    """Run `cmd` from the repository root; with `caches_in` (a directory), its inductor and Triton
    caches start empty there. (Its return code, None where it ran past `timeout` and was killed
    with its process group; its stderr.)"""
    env = dict(os.environ)
    if caches_in is not None:
        env.update(TORCHINDUCTOR_CACHE_DIR=f"{caches_in}/inductor", TRITON_CACHE_DIR=f"{caches_in}/triton")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT), env=env,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err
    return proc.returncode, err
