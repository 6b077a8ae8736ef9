"""The native engine's FP8 all-gather under FSDP2 on two GPUs, through Accelerate and compiled
(benchmarks/distributed/fsdp2_llama.py at a small size): FSDP2 shards the FP8AllGatherWeight
wrappers, all-gathers FP8 bytes with one precomputed scale per weight, and the model trains as the
bf16 all-gather does (the mean of the last 10 losses within 1%, 30 steps); the bf16 row is the
same launch without the wrapper. Under FSDP2's bf16 mixed precision the two differ slightly by
design: the FP8 all-gather casts the fp32 master shard to FP8 directly, the bf16 one casts the
gathered bf16 copy (tests/cpu/test_native_fp8_all_gather.py holds fp32 runs to exact equality).

Run: source .gpu/install.sh && python3 -m pytest tests/gpu/test_native_fp8_all_gather.py -q -s
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.processes import child_env

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--layers", "2", "--hidden", "1024", "--intermediate", "2816", "--heads", "8", "--kv-heads", "4",
         "--vocab", "8192", "--seq", "1024", "--batch", "2"]
ROWS = "fp8plug-native-usercompiled,fp8plug-fp8ag-usercompiled"


def test_fp8_all_gather_trains_like_the_bf16_all_gather(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/distributed/fsdp2_llama.py"), "--nproc", "2", *SMALL,
           "--steps", "30", "--warmup", "5", "--rows", ROWS, "--json", str(out), "--timeout", "300",
           "--min-row-s", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(tmp_path, FP8PLUG_AUTO_FILTER="false"), capture_output=True,
                          text=True, timeout=700)
    print(proc.stdout[-3000:])
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    bf16_ag, fp8_ag = rows["fp8plug-native-usercompiled"], rows["fp8plug-fp8ag-usercompiled"]
    assert not bf16_ag.get("error") and not fp8_ag.get("error"), (bf16_ag.get("error"), fp8_ag.get("error"),
                                                                   proc.stderr[-3000:])
    assert "FP8AllGatherWeight" in fp8_ag["param_local_types"]
    assert "FP8AllGatherWeight" not in bf16_ag["param_local_types"]
    assert fp8_ag["fp8_gemms"] > 0 and fp8_ag["init_sums"] == bf16_ag["init_sums"]
    assert abs(fp8_ag["loss"] / bf16_ag["loss"] - 1) < 0.01, (fp8_ag["loss"], bf16_ag["loss"])
    print(f"tok/s/GPU: bf16 all-gather {bf16_ag['tokens_per_s']:.0f}, FP8 all-gather {fp8_ag['tokens_per_s']:.0f}")
