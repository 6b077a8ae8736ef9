"""Timing one case: the median of timed repeats after warm-up (CUDA events on a GPU, the wall
clock on the CPU), and one result row per case with its TFLOP/s, speed-up over bf16, or the reason
it failed."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Dict, List, Optional

import torch

from fp8plug.backends.gemm import speedup
from fp8plug.bench.cases import BF16, BenchSkip, EngineSpec, Shape, build_case

TIMINGS = ("queued", "synced")


def flops_fwd_bwd(m: int, k: int, n: int) -> int:
    """Forward, input-gradient and weight-gradient GEMMs: 3 x 2*M*K*N."""
    return 6 * m * k * n


class Timer:
    """Median of `repeats` runs of `step` after `warmup` runs; `reset` runs untimed before each.

    On a GPU there are two ways to time, and they answer different questions:
      queued  every repeat is enqueued behind a GPU sleep long enough for the CPU to enqueue them
              all, so each CUDA-event interval is the GPU's own time for one step. This is what a
              Linear costs inside a model whose host runs ahead of the GPU (compiled blocks,
              large batches), and what fp8plug.tuning.roofline is calibrated on. The default.
      synced  each repeat is enqueued alone on an idle GPU, so its interval also holds the host's
              time to issue the step: what one Linear called by itself costs.
    """

    def __init__(self, device: torch.device, warmup: int, repeats: int, timing: str = "queued"):
        if timing not in TIMINGS:
            raise ValueError(f"--timing: {timing!r} is not one of {', '.join(TIMINGS)}.")
        self.device, self.warmup, self.repeats, self.timing = device, warmup, repeats, timing

    def __call__(self, step, reset) -> float:
        start_wall = time.perf_counter()
        for _ in range(self.warmup):
            reset()
            step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            host_ms = (time.perf_counter() - start_wall) * 1e3 / max(self.warmup, 1)
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
            if self.timing == "queued":
                # a warm-up step's wall time bounds the host's time to enqueue one step
                _gpu_sleep(self.device, 1.5 * host_ms * self.repeats + 5.0)
            for start, end in zip(starts, ends):
                reset()
                start.record()
                step()
                end.record()
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        else:
            times = []
            for _ in range(self.repeats):
                reset()
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


_SLEEP_CYCLES_PER_MS: Dict[int, float] = {}


def _gpu_sleep(device: torch.device, ms: float) -> None:
    """Keep the GPU busy for about `ms` milliseconds (torch.cuda._sleep spins for a cycle count,
    measured once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SLEEP_CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize(device)
        _SLEEP_CYCLES_PER_MS[index] = cycles / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(min(ms, 10_000.0) * _SLEEP_CYCLES_PER_MS[index]))


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, BenchSkip):
        return str(exc)
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "CUDA out of memory at this shape"
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def measure(spec: EngineSpec, shape: Shape, mode: str, device: torch.device, timer: Timer,
            unavailable_reason: Optional[str] = None) -> dict:
    """One row: the median ms and TFLOP/s of `spec` at `shape` in `mode`, or the reason it failed."""
    m, k, n = shape
    row = {
        "shape": f"{m}x{k}x{n}", "M": m, "K": k, "N": n, "mode": mode,
        "engine": spec.label,
        "backend": spec.backend, "scaling": spec.scaling, "default_scaling": spec.default_scaling,
        "ms": None, "tflops": None, "speedup": None, "vs_bf16_compiled": None, "error": None,
    }
    if unavailable_reason:
        row["error"] = f"unavailable: {unavailable_reason}"
        return row
    if mode == "compiled":
        torch._dynamo.reset()  # one compile per case; never hit the recompile limit and run eager
    try:
        step, reset = build_case(spec, shape, mode, device)
        ms = timer(step, reset)
        row["ms"] = ms
        row["tflops"] = flops_fwd_bwd(m, k, n) / (ms * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001 - a failing engine is a row with its reason
        row["error"] = _error_text(exc)
    finally:
        step = reset = None
        if mode == "compiled":
            torch._dynamo.reset()  # drop the compiled code, and with it the last case's tensors
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def merge_rounds(rows: List[dict]) -> List[dict]:
    """One row per case (shape, mode, engine) from rows measured in several rounds: the median of
    the rounds' times, each round's under `ms_rounds`. A case that failed in any round is a row
    with that round's error: a flaky engine is reported, not averaged away."""
    cases: Dict[tuple, List[dict]] = {}
    for row in rows:
        cases.setdefault((row["shape"], row["mode"], row["engine"]), []).append(row)
    merged = []
    for group in cases.values():
        row = dict(group[0])
        if len(group) > 1:
            failed = [r for r in group if r["ms"] is None]
            row["ms_rounds"] = [r["ms"] for r in group]
            if failed:
                row.update(ms=None, tflops=None, error=failed[0]["error"])
            else:
                row["ms"] = statistics.median(row["ms_rounds"])
                row["tflops"] = flops_fwd_bwd(row["M"], row["K"], row["N"]) / (row["ms"] * 1e-3) / 1e12
        merged.append(row)
    return merged


def add_speedups(rows: List[dict]) -> List[dict]:
    """speedup = bf16 ms / this row's ms (fp8plug.backends.gemm.speedup: bigger is faster), against
    bf16 at the same shape and mode; and
    vs_bf16_compiled, against compiled bf16 at the same shape (the usual baseline, e.g. for an
    engine that only runs eager)."""
    base = {(r["shape"], r["mode"]): r["ms"] for r in rows if r["engine"] == BF16 and r["ms"]}
    for row in rows:
        row["speedup"] = speedup(base.get((row["shape"], row["mode"])), row["ms"])
        row["vs_bf16_compiled"] = speedup(base.get((row["shape"], "compiled")), row["ms"])
    return rows
