"""DeepSpeed ZeRO 1, 2 and 3 with fp8plug's native engine on the CPU: two processes over gloo
(`accelerate launch` with a DeepSpeed config, DS_ACCELERATOR=cpu), a tiny transformers Llama,
bf16 and FP8 under the same stage in one launch (tests/support/deepspeed_worker.py). Also the refusals.
Skipped where DeepSpeed is not installed (pip install deepspeed; DS_BUILD_OPS=0 needs no compiler).
"""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.processes import child_env

pytest.importorskip("deepspeed", reason="needs DeepSpeed: DS_BUILD_OPS=0 pip install deepspeed")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "support" / "deepspeed_worker.py"
STEPS, RESUME = 30, 5
LAUNCH = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 2
main_process_port: 0
deepspeed_config:
  zero_stage: 1
"""


@pytest.mark.slow  # three ZeRO stages, each trained, saved and resumed, and zero.Init at stage 3: about 60 s
def test_zero_1_2_3_native_fp8_tracks_bf16_syncs_once_per_step_and_resumes_exactly(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text(LAUNCH)
    env = child_env(tmp_path, DS_ACCELERATOR="cpu", FP8PLUG_DS_CKPT=str(tmp_path))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), str(WORKER),
           "--stages", "1,2,3", "--runs", "bf16,native", "--steps", str(STEPS), "--resume-steps", str(RESUME),
           "--zero-init-runs", "bf16,native", "--zero-init-steps", str(STEPS), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    ranks = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    assert sorted(ranks) == [0, 1], (proc.stdout + proc.stderr)[-4000:]
    assert ranks[0]["error"] is None, ranks[0]["error"]
    results = ranks[0]["results"]
    for stage in (1, 2, 3):
        bf16, fp8 = [r for r in results if r["stage"] == stage and not r["zero_init"]]
        assert bf16["run"] == "bf16" and fp8["run"] == "native"
        for run in (bf16, fp8):
            assert run["zero_stage"] == stage and run["world_size"] == 2
            assert run["optimizer_class"] == (
                "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")
        assert fp8["mixed_precision"] == "fp8" and fp8["converted"] == 14  # 7 per layer; lm_head stays bf16
        assert fp8["fp8_gemms"] == STEPS * 14  # forward GEMMs, every step, all in FP8
        # delayed scaling ended every step exactly once (not per ZeRO param group, not never)
        assert fp8["scale_updates"] == [STEPS, STEPS]
        reference, final = sum(bf16["losses"][-5:]) / 5, sum(fp8["losses"][-5:]) / 5
        assert final < 0.9 * fp8["losses"][0]
        assert abs(final - reference) / reference < 0.01, (stage, final, reference)
        assert fp8["resumed_losses"] == fp8["losses"][-RESUME:]  # save_state/load_state: loss for loss
    # built under deepspeed.zero.Init (accelerate's zero3_init_flag): each weight a 1-D partition when converted
    bf16, fp8 = [r for r in results if r["zero_init"]]
    assert fp8["converted"] == 14 and fp8["fp8_gemms"] == STEPS * 14 and fp8["scale_updates"] == [STEPS, STEPS]
    reference, final = sum(bf16["losses"][-5:]) / 5, sum(fp8["losses"][-5:]) / 5
    assert abs(final - reference) / reference < 0.01, (final, reference)
    other = ranks[1]["results"]
    assert [r["losses"] for r in other] == [r["losses"] for r in results]
    assert [r.get("fp8_state") for r in other] == [r.get("fp8_state") for r in results]  # amaxes reduced


def test_msamp_is_refused_under_deepspeed_with_the_reason():
    from fp8plug.backends.msamp.engine import MSAMPEngine
    from fp8plug.integrations.deepspeed_zero import check_engine

    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 2}})
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), fp8_engine=MSAMPEngine())
    with pytest.raises(ValueError, match=r"MS-AMP engine cannot run under DeepSpeed ZeRO stage 2: .*msamp\.deepspeed"):
        check_engine(accelerator)


def test_fp16_deepspeed_config_is_refused_naming_fp8():
    from accelerate.utils import DeepSpeedPlugin

    from fp8plug.integrations.deepspeed_zero import clearer_init_errors

    plugin = DeepSpeedPlugin(hf_ds_config={"fp16": {"enabled": True}, "zero_optimization": {"stage": 2},
                                           "train_micro_batch_size_per_gpu": 1})
    with pytest.raises(ValueError, match=r"mixed_precision 'fp8' under DeepSpeed: the DeepSpeed config enables fp16"):
        with clearer_init_errors(fp8_on=True):
            plugin.set_mixed_precision("bf16")  # what accelerate does with the bf16 fp8plug asks for


def _plugin():
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1, zero3_init_flag=False)


@pytest.mark.parametrize("where", ["argument", "launch"])
def test_cpu_true_beside_a_deepspeed_config_is_refused_not_ignored(monkeypatch, where):
    """accelerate drops DeepSpeed without a word under cpu=True (a plain DDP run, rc 0)."""
    import fp8plug

    if where == "launch":  # the variable `accelerate launch --cpu` exports
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
        kwargs, message = {}, (r"ACCELERATE_USE_CPU=true \(accelerate launch's --cpu / use_cpu: true\) "
                               r"with a DeepSpeed config")
    else:
        kwargs, message = {"cpu": True, "deepspeed_plugin": _plugin()}, r"cpu=True with a DeepSpeed config"
    with pytest.raises(ValueError, match=message + r" would make accelerate ignore DeepSpeed"):
        fp8plug.Accelerator(mixed_precision="fp8", **kwargs)


def test_deepspeed_process_state_that_counts_one_of_several_processes_is_refused(monkeypatch):
    """Accelerate's state set up earlier without a backend counts one process while DeepSpeed
    runs several; DeepSpeed would fail later with a bare assertion."""
    import fp8plug

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError,
                       match=r"DeepSpeed was launched on 2 processes but accelerate's process state counts 1"):
        fp8plug.Accelerator(mixed_precision="fp8", deepspeed_plugin=_plugin())


def test_launched_cpu_processes_are_joined_only_where_accelerate_would_not(monkeypatch):
    """Without a GPU, launched processes get gloo under DeepSpeed and cpu=True otherwise (else each
    trains alone); not launched, on one process, or with a backend the user chose: untouched."""
    import datetime

    from accelerate.utils import InitProcessGroupKwargs

    from fp8plug.integrations.cpu_processes import join_cpu_processes

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    handlers = []
    join_cpu_processes({}, handlers)
    assert handlers == []  # not launched
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    join_cpu_processes({}, handlers)
    assert handlers == []  # one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    arguments = {}
    join_cpu_processes(arguments, handlers)
    assert [h.backend for h in handlers] == ["gloo"] and "cpu" not in arguments
    timeout = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=5))]  # the user's, backend left default
    join_cpu_processes({}, timeout)
    assert [(h.backend, h.timeout.seconds) for h in timeout] == [("gloo", 5)]
    mpi = [InitProcessGroupKwargs(backend="mpi")]
    join_cpu_processes({}, mpi)
    assert mpi[0].backend == "mpi"  # a backend the user chose stays
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    arguments, handlers = {}, []
    join_cpu_processes(arguments, handlers)
    assert arguments == {"cpu": True} and handlers == []  # DDP: accelerate's MULTI_CPU over gloo


@pytest.mark.slow
def test_the_cpu_deepspeed_example_runs_under_deepspeed_as_documented(tmp_path):
    """examples/configs/cpu_deepspeed_fp8.yaml with examples/train_accelerate.py, the command in
    docs/distributed.md: two ranks under DeepSpeed ZeRO 2 (not plain DDP), FP8 scaling state and
    weights identical on both."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "examples" / "configs" / "cpu_deepspeed_fp8.yaml"),
           str(ROOT / "examples" / "train_accelerate.py"),
           "--steps", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(tmp_path, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        assert result["distributed_type"] == "DistributedType.DEEPSPEED" and result["world_size"] == 2
        assert result["engine"] == "native" and result["converted"] == 14
        assert result["weights"]["sha256"] != result["initial_weights"]["sha256"]
    assert ranks[0]["weights"] == ranks[1]["weights"] and ranks[0]["fp8_state"] == ranks[1]["fp8_state"]
