"""The parent of benchmarks/distributed/fsdp2_llama.py: each row one launch of the script's ranks
(torch.distributed.run) with empty compile caches, its result or the reason it has none (the
first rank's error, or the steps it finished before its time ran out), the JSON rewritten after
each row, and the table.

Why apart: a row can hang in a collective or be killed at its limit; what the parent does about
that shares nothing with the ranks' training but the arguments.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench_model import flops_per_token
from hf_llama_measure import LOSS_WINDOW
from moe_llm import loss_vs_bf16

ROOT = Path(__file__).resolve().parents[2]


def write_json(path, data) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def stop(proc, tmp: Path) -> None:
    """End a row's launch: SIGTERM to the launcher (it ends its workers), then SIGKILL to whatever
    is left of it and of the workers (their own process groups; pids they wrote at start, each
    still ours while its command line names the row's folder)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid_file in tmp.glob("row.json.pid*"):
        try:
            pid = int(pid_file.read_text())
            if str(tmp) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def partial(row: str, tmp: Path, args, why: str) -> dict:
    """A row ended early, with what its progress file says: the steps it finished, timed as usual
    where some came after the warm-up."""
    result = dict(row=row, error=why)
    progress = tmp / "row.json.progress"
    if progress.exists():
        data = json.loads(progress.read_text())
        ms, losses = data.pop("step_ms_all"), data.pop("losses")
        result.update(data, steps_done=len(ms), step_ms_all=[round(x, 2) for x in ms])
        if len(ms) > args.warmup:
            result["step_ms"] = statistics.median(ms[args.warmup:])
            result["tokens_per_s"] = args.spec["batch"] * args.spec["seq"] / (result["step_ms"] / 1e3) / args.tp
            result["mfu"] = result["tokens_per_s"] * flops_per_token(args.spec) / (args.peak_tflops * 1e12)
            result["loss"] = sum(losses[-LOSS_WINDOW:]) / len(losses[-LOSS_WINDOW:])
        result["error"] = f"{why} after {len(ms)} of {args.steps} steps"
    return result


def spawn(row: str, args, timeout: float, command: Callable[[str, object, Path], list]) -> dict:
    """One row's launch (`command(row, args, json_path)`), with empty compile caches (unless
    --warm-cache); its result, an error from the rank that failed first, or what it finished
    before --timeout."""
    with tempfile.TemporaryDirectory(prefix="fsdp2_llama_") as name:
        tmp = Path(name)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if not args.warm_cache:
            env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"), TRITON_CACHE_DIR=str(tmp / "triton"))
        log_path = Path(args.logs) / f"{row}.log" if args.logs else tmp / "row.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command(row, args, tmp / "row.json"), stdout=log,
                                    stderr=subprocess.STDOUT, cwd=str(ROOT), env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop(proc, tmp)
                rc = None
        tail = log_path.read_text(errors="replace")[-3000:]
        if (tmp / "row.json").exists():
            return json.loads((tmp / "row.json").read_text())
        sys.stderr.write(tail)
        errors = sorted(tmp.glob("row.json.rank*.err"), key=lambda p: p.stat().st_mtime)
        if errors:  # the rank that failed first
            return dict(partial(row, tmp, args, "failed"), error=json.loads(errors[0].read_text())["error"])
        last = " | ".join(tail.strip().splitlines()[-2:])[-300:]
        why = f"timed out after {timeout:.0f} s" if rc is None else f"launch exited {rc}: {last}"
        return partial(row, tmp, args, why)


def run_rows(args, meta: dict, command: Callable[[str, object, Path], list], start: float) -> list:
    """Each row in turn, launched by `spawn`. A row is skipped when less time is left before
    --deadline (counted from `start`) than --min-row-s or than 0.75 x the fastest row so far took;
    a row runs for at most the time left."""
    rows, took = [], []
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    for i, row in enumerate(names, 1):
        left = args.deadline - (time.time() - start) if args.deadline else math.inf
        need = max(args.min_row_s, 0.75 * min(took)) if took else args.min_row_s
        if left < need:
            why = f"not run: {left:.0f} s left before --deadline, a row needs about {need:.0f}"
            rows.append(dict(row=row, error=why))
        else:
            print(f"[{i}/{len(names)}] {row} ({args.nproc} processes) ...", file=sys.stderr, flush=True)
            row_start = time.time()
            rows.append(spawn(row, args, min(args.timeout, left), command))
            if rows[-1].get("tokens_per_s"):
                took.append(time.time() - row_start)
            r = rows[-1]
            print(f"    {r.get('error') or 'ok'}: tok/s/GPU {r.get('tokens_per_s')}, first step "
                  f"{r.get('first_step_s')} s, loss {r.get('loss')}, {time.time() - row_start:.0f} s",
                  file=sys.stderr, flush=True)
        meta["device"] = next((r["device"] for r in rows if r.get("device")), None)
        ok = {r["row"]: r for r in rows if r.get("loss") is not None}
        for r in rows:  # FP8's cost in loss: against the bf16 row of the same compile mode
            r["loss_vs_bf16_pct"], r["loss_vs_bf16_of"] = loss_vs_bf16(r, ok, None)
            base = ok.get(r["loss_vs_bf16_of"]) or {}
            if r.get("heldout_loss") and base.get("heldout_loss"):
                r["heldout_vs_bf16_pct"] = 100.0 * (r["heldout_loss"] - base["heldout_loss"]) / base["heldout_loss"]
        if args.json:
            write_json(args.json, dict(meta=meta, rows=rows))
    return rows


def parallelism(meta: dict) -> str:
    """How the rows shard the model, in words, for the table's heading."""
    tp = meta.get("tp", 1)
    if tp <= 1:
        return "FSDP2" if meta.get("strategy", "fsdp2") == "fsdp2" else "DeepSpeed ZeRO-3"
    dp_shard = meta["nproc"] // tp
    return f"tensor parallel {tp}" + (f" x FSDP2 {dp_shard}" if dp_shard > 1 else "")


def table(meta: dict, rows: list) -> str:
    def f(value, spec, suffix=""):
        return "-" if value is None else format(value, spec) + suffix

    s = meta["spec"]
    ffn = (f"{s['experts']} experts top-{s['top_k']}, expert ffn {s['expert_ffn']}" if "experts" in s
           else f"ffn {s['intermediate']}")
    floor = meta.get("loss_floor")
    lines = [
        f"{meta.get('model', 'llama')}: {s['layers']} layers, hidden {s['hidden']}, {ffn}, "
        f"{s['heads']}/{s['kv_heads']} heads, vocab {s['vocab']}; {parallelism(meta)} over {meta['nproc']} x "
        f"{meta.get('device') or '-'}, batch {s['batch']} x {s['seq']} tokens per GPU"
        f"{', per-layer activation checkpointing' if s.get('checkpointing', True) else ''}; {meta['steps']} steps "
        f"({meta['warmup']} warm-up) on {meta.get('data', 'synthetic')} data; MFU at {meta['peak_tflops']:g} TFLOP/s, "
        f"{meta['flops_per_token'] / 1e9:.1f} GFLOP/token{'' if floor is None else f'; loss floor {floor:.3f}'}",
        "",
        "| row | engine | FP8 linears | FP8 experts | tok/s/GPU | MFU | peak GB/GPU | first step s | loss "
        "| loss vs bf16 % | held-out loss | held-out vs bf16 % | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        note = (r.get("error") or "").replace("|", "/")
        if r.get("params_not_stepped"):
            note += f" {r['params_not_stepped'] / 1e6:.1f}M parameters not stepped"
        if r.get("te_modules") and not r.get("te_modules_ran_fp8"):
            note += " TE layers ran outside FP8 autocast (bf16)"
        fp8 = "-" if r.get("fp8_modules") is None else f"{r['fp8_modules']}/{r.get('linears')}"
        experts = "-" if r.get("experts_total") is None else f"{r['experts_fp8']}/{r['experts_total']}"
        lines.append(f"| {r['row']} | {r.get('engine') or '-'} | {fp8} | {experts} | "
                     f"{f(r.get('tokens_per_s'), ',.0f')} | "
                     f"{f(r.get('mfu') and 100 * r['mfu'], '.1f', '%')} | {f(r.get('peak_gb'), '.1f')} | "
                     f"{f(r.get('first_step_s'), '.0f')} | {f(r.get('loss'), '.4f')} | "
                     f"{f(r.get('loss_vs_bf16_pct'), '+.2f')} | {f(r.get('heldout_loss'), '.4f')} | "
                     f"{f(r.get('heldout_vs_bf16_pct'), '+.2f')} | {note.strip()} |")
    return "\n".join(lines) + "\n"
