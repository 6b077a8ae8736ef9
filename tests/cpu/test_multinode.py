"""Multi-node semantics without a cluster: two "nodes" of two CPU processes each, on this machine.

Each node is its own `accelerate launch` (torchrun with `--nnodes 2`, static rendezvous at
127.0.0.1 on a free port, gloo), both started together with examples/configs/cpu_2nodes_fp8.yaml
and only `--machine_rank` different, as on two machines. They run tests/support/multinode_worker.py, a
user's script with fp8plug.Accelerator (native engine, delayed scaling, history 4, max), on data
that differs per rank: rank r's inputs are (r + 1) times rank 0's. The first pair trains 8 steps
and calls save_state after step 4; the second pair starts from other weights, calls load_state and
trains steps 5-8. Checked:

- the four ranks are two nodes of two (torchrun's GROUP_RANK, LOCAL_RANK), one gloo world of 4;
- one FP8 scaling state on all four ranks: after every step, each layer's newest amax is the max
  of what the four ranks measured themselves (read before the reduction), which for the input
  slot is rank 3's and not what ranks 0-2 saw; the whole state (histories, scales, update counts)
  gathered with accelerator.gather is identical on every rank, and so is every rank's JSON copy;
- the resume is exact: on every rank, steps 5-8 of the resumed run repeat those of the unbroken
  run bit for bit (losses, amaxes, weights after each step), down to the final weights, FP8 state
  and learning rate. The checkpoint holds all four ranks' RNG states (the dropout masks differ
  per rank), written by processes of both nodes into one directory (one file system, as on a
  cluster with shared storage).

Both pairs pass DistributedDataParallelKwargs(find_unused_parameters=True). With DDP's default,
its first backward after any (re)start all-reduces the gradients in the initial bucket layout
(parameters in definition order) and rebuilds the buckets in gradient-ready order for later
steps. On more than two ranks the order of the parameters in the flat buffer decides the order
in which gloo adds the ranks' gradients, so the first step after a resume rounds a few
weights differently from the unbroken run (by one float32 ulp: measured 19 of 4,720 elements,
at most 7.5e-9), while the FP8 state and the losses still matched. find_unused_parameters keeps
the initial layout for good (no rebuild), so the resumed run adds in the same order as the
unbroken one. docs/distributed.md ("Several nodes") says the same.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "cpu_2nodes_fp8.yaml"
WORKER = ROOT / "tests" / "support" / "multinode_worker.py"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
STEPS, SAVE_AT = 8, 4
LAYERS = ("up", "down", "head")
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
E4M3_MAX = 448.0
TIMEOUT = 240  # seconds for one pair of launches; 11 s on an idle two-core machine, 20 s on a busy one

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """End a launcher that is still running, and the workers it started (torchrun starts each with
    start_new_session, a process group of its own): SIGTERM first, which torchrun forwards to its
    workers, then SIGKILL."""
    import psutil

    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def launch_nodes(tmp_path: Path, name: str, worker_args) -> dict:
    """Start both nodes' `accelerate launch` at once and wait for both; {rank: result}. A failure
    shows each node's command, exit status and the end of its output (stdout and stderr)."""
    run_dir = tmp_path / name
    out = run_dir / "results"
    env = child_env(tmp_path, OMP_NUM_THREADS="1")
    for attempt in range(2):  # a second try only where another process took the free port first
        port = free_port()
        procs, logs, cmds = [], [], []
        for node in range(NODES):
            log = run_dir / f"node{node}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
                   "--machine_rank", str(node), "--main_process_port", str(port),
                   str(WORKER), *map(str, worker_args), "--out", str(out)]
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT))
            logs.append(log)
            cmds.append(cmd)
        deadline = time.monotonic() + TIMEOUT
        timed_out = False
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out:
            for proc in procs:
                if proc.poll() is None:
                    stop(proc)
        codes = [proc.returncode for proc in procs]
        texts = [log.read_text(errors="replace") for log in logs]
        if not timed_out and all(code == 0 for code in codes):
            break
        port_taken = any("already in use" in text or "EADDRINUSE" in text for text in texts)
        if attempt == 0 and port_taken and not timed_out:
            continue
        report = [f"{name}: the two-node launch failed" + (f" (timed out after {TIMEOUT} s)" if timed_out else "")]
        for node in range(NODES):
            report.append(f"--- node {node}: exit status {codes[node]}\n$ {' '.join(cmds[node])}\n"
                          f"{texts[node][-4000:]}")
        pytest.fail("\n".join(report), pytrace=False)
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    assert sorted(results) == list(range(WORLD)), (f"{name}: result files of ranks {sorted(results)}\n"
                                                   + texts[0][-3000:])
    return results


def first_difference(a: list, b: list) -> str:
    """Which step of two runs' step records differs first, and in what."""
    for x, y in zip(a, b):
        if x != y:
            keys = [k for k in x if x[k] != y.get(k)]
            return f"step {x['step']} differs in {keys}: {[x[k] for k in keys]} vs {[y[k] for k in keys]}"
    return f"{len(a)} vs {len(b)} steps"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The unbroken run (saving after step SAVE_AT) and the resumed run, each a pair of launches."""
    tmp_path = tmp_path_factory.mktemp("multinode")
    checkpoint = tmp_path / "checkpoint"
    common = ["--steps", STEPS, "--find-unused-parameters"]
    start = time.monotonic()
    trained = launch_nodes(tmp_path, "train", [*common, "--save-at", SAVE_AT, "--save-dir", checkpoint])
    files = sorted(os.listdir(checkpoint))
    resumed = launch_nodes(tmp_path, "resume", [*common, "--resume", checkpoint])
    print(f"two pairs of two-node launches: {time.monotonic() - start:.1f} s")
    return trained, resumed, files


def test_two_nodes_of_two_processes_make_one_world(runs):
    trained, resumed, _ = runs
    for results in (trained, resumed):
        for rank, result in results.items():
            assert result["rank"] == rank and result["world_size"] == WORLD
            assert (result["node"], result["local_rank"]) == divmod(rank, PER_NODE)
            assert result["nodes"] == NODES
            assert result["distributed_type"] == "DistributedType.MULTI_CPU" and result["backend"] == "gloo"
            assert result["engine"] == "native"
            recipe = result["recipe"]  # from the config's fp8_config
            assert (recipe["amax_history_len"], recipe["amax_compute_algo"]) == (4, "max")
            for layer in LAYERS:  # converted, with delayed scaling (a dynamic layer keeps no history)
                assert len(result["fp8_state"][layer]["fp8_amax_history"]) == 4


def test_one_fp8_scale_on_all_four_ranks(runs):
    trained, _, _ = runs
    # the whole state, gathered by the worker on every rank, and the copies the ranks wrote
    for result in trained.values():
        assert result["gathered_ranks"] == WORLD and result["gathered_identical"]
        assert result["fp8_state"] == trained[0]["fp8_state"]
        assert result["weights"]["sha256"] == trained[0]["weights"]["sha256"]  # DDP kept them equal
    assert len({tuple(s["loss"] for s in result["steps"]) for result in trained.values()}) == WORLD  # own data
    for step in range(STEPS):
        records = [trained[rank]["steps"][step] for rank in range(WORLD)]
        for layer in LAYERS:
            local = [record["local_amax"][layer] for record in records]  # each rank's own, before the reduction
            shared = records[0]["newest_amax"][layer]
            assert all(record["newest_amax"][layer] == shared for record in records), (step, layer)
            assert shared == [max(values) for values in zip(*local)], (step, layer, local, shared)
            assert len({values[GRAD_OUTPUT] for values in local}) == WORLD  # every rank saw other gradients
        # the first layer's input: rank 3's inputs are the largest, and ranks 0-2 alone would have
        # recorded less (so a run without the reduction fails here)
        inputs = [record["local_amax"]["up"][INPUT] for record in records]
        assert inputs[0] < inputs[1] < inputs[2] < inputs[3] == records[0]["newest_amax"]["up"][INPUT]
    # the scale every rank casts the first layer's input with: from the shared history's max
    state = trained[0]["fp8_state"]["up"]
    history = torch.tensor(state["fp8_amax_history"])
    expected = torch.tensor(E4M3_MAX) / history[:, INPUT].max()
    assert state["fp8_scale"][INPUT] == expected.item()
    own = max(s["local_amax"]["up"][INPUT] for s in trained[0]["steps"][-4:])  # rank 0's own last 4 amaxes
    assert state["fp8_scale"][INPUT] < (torch.tensor(E4M3_MAX) / own).item()
    assert state["fp8_step"] == [STEPS] * 3  # one update per step, every slot


def test_resume_on_two_nodes_is_exact(runs):
    trained, resumed, files = runs
    assert {f"random_states_{rank}.pkl" for rank in range(WORLD)} <= set(files), files  # both nodes' ranks
    assert "fp8_state.pt" in files, files
    for rank in range(WORLD):
        before, after = trained[rank], resumed[rank]
        assert after["start_step"] == SAVE_AT
        assert after["start_weights_sha256"] == before["steps"][SAVE_AT - 1]["weights_sha256"]
        tail = before["steps"][SAVE_AT:]
        assert after["steps"] == tail, f"rank {rank}: " + first_difference(tail, after["steps"])
        assert after["weights"] == before["weights"], f"rank {rank}: final weights differ"
        assert after["fp8_state"] == before["fp8_state"], f"rank {rank}: final FP8 state differs"
        assert after["lr"] == before["lr"]
        assert after["gathered_identical"]
