"""Low-precision Adam states (fp8plug.integrations.optim, torchao's low-bit AdamW) against fp32 AdamW.

What MS-AMP's opt_level O2 offered (FP8 first moment, FP16 second), available on current stacks
through `FP8RecipeKwargs(optimizer_states="fp8" | "8bit" | "4bit")`. For each kind, a small
Llama-style decoder (fp8plug.bench.toy_model.TinyDecoder) trains for --steps steps from the same seed on the
same synthetic batches, each run in its own process, and the table reports:

  state MiB     bytes the optimizer's per-parameter states hold (fp8plug.integrations.optim.state_bytes:
                codes, scales and lookup tables as stored), and the factor against fp32 AdamW
  peak MiB      CUDA: torch.cuda.max_memory_allocated over training (weights, gradients,
                activations, states); CPU: how much the process's peak RSS grew while training
  loss          mean training loss over the last 10 steps, and its difference from fp32 AdamW
  ms/step       mean over the steps after the first 10 (torchao compiles its step at first use)

    python3 benchmarks/training/optimizer_states.py                                 # tiny, CPU
    python3 benchmarks/training/optimizer_states.py --device cuda --out out/optimizer_states_gpu.md

Models: tiny (CPU default: 2 layers, d=64, vocab 256, B=8, T=32) and small (CUDA default:
6 layers, d=768, ffn 3072, vocab 16384, B=16, T=256, about 80M parameters; bf16 autocast, fp32
weights). On the CPU torchao's step runs eagerly by default (--compile to compile it: a compile per
parameter shape, tens of seconds on a small CPU); on CUDA it is compiled, as torchao ships it. CPU
runs use one thread by default (--threads).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=256, batch=8, seq=32),
    "small": dict(dim=768, n_layers=6, n_heads=12, ffn_dim=3072, vocab_size=16384, batch=16, seq=256),
}
KINDS = ("fp32", "fp8", "8bit", "4bit")
RESULT_TAG = "OPTIMIZER_STATES_RESULT "
MiB = 2**20


def _rss_bytes() -> int:
    """This process's resident set size now (Linux), or 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_one(kind: str, model_name: str, device: str, steps: int, lr: float, compile_step: bool,
            threads: int) -> dict:
    """Train once with `kind` optimizer states; runs in its own process (see main)."""
    if not compile_step:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"  # read at every torch.compile call: eager torchao step
    import torch

    if threads > 0:
        torch.set_num_threads(threads)

    from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, lm_loss, synthetic_batches
    from fp8plug.integrations.optim import convert_optimizer, state_bytes
    from fp8plug.recipe.kwargs import FP8RecipeKwargs

    spec = dict(MODELS[model_name])
    batch, seq = spec.pop("batch"), spec.pop("seq")
    cfg = DecoderConfig(max_seq_len=seq, **spec)
    torch.manual_seed(0)
    model = TinyDecoder(cfg).to(device)
    batches = synthetic_batches(steps, batch, seq, cfg.vocab_size, seed=0, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if kind != "fp32":
        optimizer = convert_optimizer(optimizer, FP8RecipeKwargs(optimizer_states=kind))
    cuda = device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before = _rss_bytes()
    losses, times = [], []
    for tokens in batches:
        start = time.perf_counter()
        with autocast:
            loss = lm_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # .item() synchronizes, so the time is the step's
        times.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = max(0, _peak_rss_bytes() - rss_before)
    timed = times[10:] or times
    return dict(
        kind=kind,
        optimizer=f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        params=sum(p.numel() for p in model.parameters()),
        state_bytes=state_bytes(optimizer),
        peak_bytes=peak,
        loss=sum(losses[-10:]) / len(losses[-10:]),
        first_loss=losses[0],
        ms_per_step=1000 * sum(timed) / len(timed),
        first_step_s=times[0],
    )


def table(results, args) -> str:
    base = next((r for r in results if r["kind"] == "fp32" and "error" not in r), None)
    peak_label = "peak CUDA MiB" if args.device.startswith("cuda") else "peak RSS growth MiB"
    lines = [
        f"Optimizer states: model {args.model} ({results[0].get('params', 0) / 1e6:.1f}M parameters), "
        f"{args.steps} steps, device {args.device}, torchao step {'compiled' if args.compile else 'eager'}, "
        f"AdamW lr={args.lr}, weight_decay=0.01.",
        "",
        f"| states | optimizer | state MiB | vs fp32 | {peak_label} | loss (last 10) | vs fp32 | ms/step "
        "| first step s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['kind']} | failed: {r['error']} | | | | | | | |")
            continue
        factor = f"{base['state_bytes'] / r['state_bytes']:.2f}x smaller" if base and r is not base else "-"
        diff = f"{100 * (r['loss'] - base['loss']) / base['loss']:+.2f}%" if base and r is not base else "-"
        lines.append(
            f"| {r['kind']} | {r['optimizer'].rsplit('.', 1)[-1]} | {r['state_bytes'] / MiB:.2f} | {factor} | "
            f"{r['peak_bytes'] / MiB:.1f} | {r['loss']:.4f} | {diff} | {r['ms_per_step']:.1f} | "
            f"{r['first_step_s']:.1f} |"
        )
    lines.append("")
    if not args.device.startswith("cuda"):
        lines.append("Peak RSS growth on the CPU includes allocator and runtime noise of tens of MiB; at the "
                     "tiny size it says little, the state bytes are exact.")
    lines.append(f"Loss at step 1 (same for all, same seed): {results[0].get('first_loss', float('nan')):.4f}; "
                 f"uniform guess log(vocab) = {math.log(MODELS[args.model]['vocab_size']):.4f}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--model", choices=sorted(MODELS), default=None, help="default: tiny on CPU, small on CUDA")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=None, help="default: 3e-3 tiny, 6e-4 small")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile torchao's step (default: on CUDA only)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads per run "
                             "(default: 1 on CPU, where tiny ops run fastest; 0 = torch's default)")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = args.model or ("small" if args.device.startswith("cuda") else "tiny")
    args.lr = args.lr if args.lr is not None else (3e-3 if args.model == "tiny" else 6e-4)
    args.compile = args.device.startswith("cuda") if args.compile is None else args.compile
    args.threads = (0 if args.device.startswith("cuda") else 1) if args.threads is None else args.threads

    if args._one:
        result = run_one(args._one, args.model, args.device, args.steps, args.lr, args.compile, args.threads)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0

    results = []
    for kind in [k.strip() for k in args.kinds.split(",") if k.strip()]:
        if kind not in KINDS:
            parser.error(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
        command = [sys.executable, __file__, "--_one", kind, "--device", args.device, "--model", args.model,
                   "--steps", str(args.steps), "--lr", str(args.lr),
                   "--threads", str(args.threads), "--compile" if args.compile else "--no-compile"]
        print(f"running {kind} ...", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_TAG)]
            if done.returncode or not lines:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                results.append(dict(kind=kind, error=f"exit {done.returncode}: {tail[0][:200]}"))
            else:
                results.append(json.loads(lines[-1][len(RESULT_TAG):]))
        except subprocess.TimeoutExpired:
            results.append(dict(kind=kind, error=f"timed out after {args.timeout} s"))
    text = table(results, args)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
