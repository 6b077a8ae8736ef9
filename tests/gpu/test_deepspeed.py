"""Two GPUs under DeepSpeed ZeRO 1, 2 and 3: fp8plug's te, ao and native engines each train a small
transformers Llama for 200 steps to within 1% of bf16 under the same stage (te: at most 1% above,
see BELOW_BF16_OK); save_state/load_state resume loss for loss; models built under
deepspeed.zero.Init train too; and the shipped launch config (examples/configs/2gpu_deepspeed_fp8.yaml)
runs. Skipped unless two sm_89+ GPUs and DeepSpeed are there (device kind nvidia-h200-x2, kits .gpu
and .dskit).

One `accelerate launch` per ZeRO stage trains bf16 and every engine in turn (tests/support/deepspeed_worker.py).
Run: source .gpu/install.sh && source .dskit/install.sh && python3 -m pytest tests/gpu/test_deepspeed.py -q -x -rs
With FP8PLUG_RECORD_DIR=<dir> each stage's summary is also written there as JSON (for docs/results/).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.processes import child_env
from tests.support.record import record

pytest.importorskip("deepspeed", reason="needs DeepSpeed (source .dskit/install.sh)")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "deepspeed_worker.py"
CONFIG = ROOT / "examples" / "configs" / "2gpu_deepspeed_fp8.yaml"
ENGINES = ["native", "ao", "te"]
STEPS = 200
RESUME = 10
MAX_GAP = 0.01
# TransformerEngine's delayed scaling trains this model faster than bf16 in mid-run and ends 1-2%
# *below* it (2x H200: -1.5/-1.5/-1.8% at ZeRO 1/2/3, -0.9% from zero.Init). That is TE's numerics,
# not DeepSpeed's: the same te recipe without DeepSpeed ends 2.3-3.5% below bf16, while TE's
# current scaling (+0.6% under ZeRO 1 and 3) and fp8plug's native delayed scaling track bf16
# (docs/distributed.md, results/h200x2/deepspeed/te_delayed_study.json). For te the bound
# is one-sided: no more than 1% above bf16, which is what losing training would look like.
BELOW_BF16_OK = {"te"}
MODEL = ["--hidden", "512", "--ffn", "1536", "--layers", "4", "--heads", "8", "--kv-heads", "4",
         "--vocab", "1024", "--seq", "256", "--batch", "8", "--lr", "1e-3"]

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def launch(tmp_path, config: Path, worker_args, timeout=420):
    env = child_env(tmp_path, FP8PLUG_DS_CKPT=str(tmp_path))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(WORKER),
           *worker_args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    ranks = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    errors = [r["error"] for r in ranks.values() if r.get("error")]
    assert not errors, errors[0]
    assert proc.returncode == 0 and sorted(ranks) == [0, 1], output[-5000:]
    return ranks[0]["results"], ranks[1]["results"]


def launch_config(tmp_path, fp8=True) -> Path:
    """The shipped DeepSpeed config; without its FP8 part for the per-stage tests, whose worker
    passes its own precision, engine and DeepSpeed plugin per run."""
    config = yaml.safe_load(CONFIG.read_text())
    if not fp8:
        config.pop("fp8_config")
        config["mixed_precision"] = "bf16"
    path = tmp_path / "launch.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def tail(losses):
    return sum(losses[-10:]) / 10


def check_against_bf16(results, other_rank):
    """Every FP8 run within MAX_GAP of the bf16 run it was launched with (BELOW_BF16_OK engines:
    at most MAX_GAP above it); returns the summary and the runs that missed."""
    by_run = {r["run"]: r for r in results}
    reference = tail(by_run["bf16"]["losses"])
    summary = {"bf16": {"final_loss": reference, "tokens_per_s": by_run["bf16"]["tokens_per_s"]}}
    failures = []
    for engine in [r["run"] for r in results if r["run"] != "bf16"]:
        run = by_run[engine]
        assert run["engine"] == engine and run["mixed_precision"] == "fp8" and run["world_size"] == 2
        assert run["converted"] >= 4 * 7 and run["fp8_gemms"] > 0, run  # every projection of 4 layers
        final = tail(run["losses"])
        signed = (final - reference) / reference
        gap = max(signed, 0.0) if engine in BELOW_BF16_OK else abs(signed)
        assert run["tied"] == by_run["bf16"]["tied"], (engine, run["tied"])  # lm_head stays tied to the embedding
        summary[engine] = {"final_loss": final, "relative_gap": gap, "vs_bf16": signed, "first_loss": run["losses"][0],
                           "tokens_per_s": run["tokens_per_s"], "seconds": run["seconds"], "scales": run["scales"]}
        if "resumed_losses" in run:
            summary[engine]["resumed_exactly"] = run["resumed_losses"] == run["losses"][-RESUME:]
        if final >= run["losses"][0] or gap > MAX_GAP:
            failures.append((engine, final, reference, gap))
    for mine, theirs in zip(results, other_rank):  # the all-reduced loss agrees
        assert mine["losses"] == theirs["losses"]
        if mine["run"] in summary and mine["run"] != "bf16":  # recorded for all, required of native's
            summary[mine["run"]]["fp8_state_equal_on_ranks"] = mine.get("fp8_state") == theirs.get("fp8_state")
        if mine["run"] == "native":  # delayed scaling: amaxes reduced once per step, one state on both ranks
            assert mine["fp8_state"] == theirs["fp8_state"]
            assert mine["scale_updates"] == [len(mine["losses"])] * 2, mine["scale_updates"]
    return summary, failures


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_fp8_within_1_percent_of_bf16_and_resumes_exactly(tmp_path, stage):
    args = ["--stages", str(stage), "--runs", ",".join(["bf16", *ENGINES]), "--steps", str(STEPS),
            "--resume-steps", str(RESUME), *MODEL]
    if stage == 3:  # the same runs again with models partitioned at construction (accelerate's zero3_init_flag)
        args += ["--zero-init-runs", ",".join(["bf16", *ENGINES]), "--zero-init-steps", str(STEPS)]
    results, other = launch(tmp_path, launch_config(tmp_path, fp8=False), args, timeout=480)
    main = [r for r in results if not r["zero_init"]]
    assert all(r["zero_stage"] == stage for r in main)
    summary, failures = check_against_bf16(main, [r for r in other if not r["zero_init"]])
    if stage == 3:
        init_runs = [r for r in results if r["zero_init"]]
        init_summary, init_failures = check_against_bf16(init_runs, [r for r in other if r["zero_init"]])
        summary["zero_init"] = init_summary
        failures += [("zero.Init",) + f for f in init_failures]
    record(f"deepspeed_zero{stage}", {"stage": stage, "steps": STEPS, "engines": summary})
    resumed = {e: summary[e]["resumed_exactly"] for e in ENGINES}
    assert all(resumed.values()), resumed
    assert not failures, failures


def test_launch_config_trains_fp8_under_deepspeed(tmp_path):
    """`accelerate launch --config_file examples/configs/2gpu_deepspeed_fp8.yaml script.py` with a
    script that builds a plain fp8plug.Accelerator(): engine, stage and precision from the file."""
    config = yaml.safe_load(CONFIG.read_text())
    results, other = launch(tmp_path, launch_config(tmp_path), ["--from-launch", "--steps", "100", *MODEL])
    run = results[0]
    assert run["engine"] == config["fp8_config"]["engine"].lower()
    assert run["zero_stage"] == config["deepspeed_config"]["zero_stage"] and run["mixed_precision"] == "fp8"
    assert run["fp8_gemms"] > 0 and run["losses"] == other[0]["losses"]
    assert tail(run["losses"]) < 0.9 * run["losses"][0]
    record("deepspeed_launch_config", {"engine": run["engine"], "stage": run["zero_stage"],
                                       "first_loss": run["losses"][0], "final_loss": tail(run["losses"]),
                                       "tokens_per_s": run["tokens_per_s"]})
