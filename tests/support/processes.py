"""The environment of the child processes tests start (`accelerate launch`, examples, benchmarks)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(tmp_path=None, **extra) -> dict:
    """This process's environment for a child: this checkout first on PYTHONPATH, Hugging Face
    offline (a download attempt fails instead of reaching the network) and, with `tmp_path`, an
    empty HF_HOME there (no user accelerate config, no cached models); then `extra`. No
    FP8PLUG_*/ACCELERATE_* settings need removing: tests/conftest.py already did."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    if tmp_path is not None:
        env["HF_HOME"] = str(Path(tmp_path) / "hf_home")
    env.update(extra)
    return env
