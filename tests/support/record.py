"""How GPU tests keep their measurements: printed, and written as JSON under $FP8PLUG_RECORD_DIR
when it is set (benchmarks/gpu_suite.sh sets it so the figures land in docs/results/)."""

import json
import os
from pathlib import Path


def record(name: str, summary: dict) -> None:
    print(f"{name}: {json.dumps(summary)}")
    folder = os.environ.get("FP8PLUG_RECORD_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        Path(folder, f"{name}.json").write_text(json.dumps(summary, indent=1))
