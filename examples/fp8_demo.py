"""fp8plug's main demo: train a small decoder-only LM in FP8 and compare its loss with bf16.

Runs on the CPU, or on a GPU with --device cuda; each run prints its progress every 25 steps. On 2
CPU cores both runs take about 10 s where the CPU has bf16 instructions (measured: 8.5 s on an
AVX-512 EPYC with avx512_bf16, 8-12 s on an AMX Xeon) and up to a minute where it has AVX2 only,
which runs bf16 GEMMs slowly (measured: 58-60 s on an AVX2 EPYC; 38-63 s on the AVX-512 EPYC with
torch held to AVX2, ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2). FP8 GEMMs are emulated on a
CPU (float32 arithmetic, fp8plug.backends.gemm), so the times printed there say how the CPU runs
bf16 and float32, never what FP8 gains; on a GPU the time line gives FP8's speed-up.

Both runs start from the same weights and see the same batches; the FP8 run converts the model's
Linear layers with the chosen engine (default: fp8plug's embedded `native` engine) and trains
under the context-aware FP8 autocast; everything else runs under bf16 autocast, as in the bf16 run.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import fp8plug
from fp8plug.backends.gemm import EMULATION_NOTE, emulates, format_speedup, speedup
from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, lm_loss, synthetic_batches


def train(model, batches, device, steps, lr, label):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        tokens = batches[step % len(batches)]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % 25 == 0 or step + 1 == steps:
            print(f"  {label}: step {step + 1}/{steps}, loss {losses[-1]:.4f}, "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    return losses


def tail_mean(losses, n=10):
    return sum(losses[-n:]) / min(n, len(losses))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="native", help="msamp, te, ao, native, or auto (default: native)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    cfg = DecoderConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, ffn_dim=512, max_seq_len=64)
    base = TinyDecoder(cfg).to(device)
    batches = synthetic_batches(16, batch=8, seq=64, vocab=cfg.vocab_size, seed=args.seed, device=device)

    start = time.perf_counter()
    bf16_losses = train(copy.deepcopy(base), batches, device, args.steps, args.lr, "bf16")
    bf16_time = time.perf_counter() - start

    fp8_model = copy.deepcopy(base)
    backend = None if args.backend == "auto" else args.backend
    # auto_filter=False: the demo wants every Linear in FP8 to compare the losses, even where an
    # FP8PLUG_AUTO_FILTER=true environment asks for the speed filter (convert_model filters only then).
    recipe = fp8plug.FP8RecipeKwargs(backend=backend, modules_to_ignore=["lm_head"], auto_filter=False)
    selection = fp8plug.select_backend(recipe.backend, device)
    report = fp8plug.convert_model(fp8_model, recipe=recipe, backend=selection.name)
    fp8plug.apply_fp8_autowrap(fp8_model, recipe, backend=selection.backend)
    start = time.perf_counter()
    fp8_losses = train(fp8_model, batches, device, args.steps, args.lr, f"fp8 ({selection.name})")
    fp8_time = time.perf_counter() - start

    bf16_final, fp8_final = tail_mean(bf16_losses), tail_mean(fp8_losses)
    gap = abs(fp8_final - bf16_final) / bf16_final
    print(f"engine: {selection.name} ({selection.backend.title}) on {selection.device.describe()}")
    print(f"converted {len(report.fp8_linears)} Linear layers to FP8, skipped {len(report.skipped)}: "
          + ", ".join(f"{k} ({v})" for k, v in report.skipped.items()))
    print(f"steps: {args.steps}; loss at step 1: {bf16_losses[0]:.4f} (bf16) {fp8_losses[0]:.4f} (fp8)")
    print(f"final loss (mean of last 10 steps): fp8 {fp8_final:.4f} | bf16 {bf16_final:.4f} | "
          f"relative gap {gap:.2%}")
    print(f"time: fp8 {fp8_time:.1f} s, bf16 {bf16_time:.1f} s" + (
        f" ({EMULATION_NOTE})" if emulates(device)
        else f" (fp8 at {format_speedup(speedup(bf16_time, fp8_time))} bf16's speed)"))
    return 0 if gap <= 0.10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
