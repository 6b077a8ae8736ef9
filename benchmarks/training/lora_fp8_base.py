"""LoRA on an FP8 checkpoint: the base kept in FP8 (fp8plug.load_fp8_base) against bf16 LoRA.

The shape is Llama-3-8B's by default (32 layers, hidden 4096, ffn 14336, 32/8 heads, vocab 128256),
randomly initialised (seeded, bf16, on the GPU) and written once as an FP8 checkpoint through
fp8plug's exporter (`save_fp8_checkpoint`, --layout block by default: the layout most FP8 releases
use), in --ckpt-dir (reused when its config matches). Every row trains PEFT LoRA r=--rank on
q, k, v, o, gate, up and down, batch 2 x 2048, gradient checkpointing on (non-reentrant), fused
AdamW on the adapters, bf16 autocast, on the same batches: text by default (--data text: the installed
packages' files, tokenised as benchmarks/training/real_text.py does), or hf_llama_task's synthetic task:

  bf16-lora               the base in bf16, as users load a bf16 release (`torch_dtype=torch.bfloat16`):
                          here the same checkpoint dequantized tensor by tensor into plain bf16 Linears
                          (load_fp8_base(trainable=True), then frozen by PEFT), so both sides hold the same weights
  fp8base-lora            load_fp8_base: the base Linears stay float8 in memory and feed the FP8 GEMMs;
                          then fp8plug.convert_model (native) for the rest (norms, attention change; with
                          --fp8-head, the default, the untied lm_head is stored in FP8 too)
  each `-compiled`: torch.compile(model) after the setup, as a training loop compiles

Each row runs in its own process with empty inductor/triton caches. Reported per row: tok/s
(median step after --warmup, CUDA events), peak memory (torch.cuda.max_memory_allocated over the
whole process, loading included; and apart, the loading's and the training's peaks) and memory after
loading, seconds to the first step, the loss (mean of the last 10 steps) and the curve; ratios
against bf16-lora-compiled (speed) and the bf16 row of the same compile mode (memory, loss).
--deadline stops before the next row would run past it.

    python3 benchmarks/training/lora_fp8_base.py --rows bf16-lora-compiled,fp8base-lora-compiled --json out.json
    python3 benchmarks/training/lora_fp8_base.py --device cpu      # smoke: tiny model, 3 steps, eager rows
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _path in (str(ROOT), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import memory_at_peak  # noqa: E402
from fresh_process import run_fresh  # noqa: E402
from hf_llama_task import loss_floor, make_batches  # noqa: E402

ROWS = ("bf16-lora", "bf16-lora-compiled", "fp8base-lora", "fp8base-lora-compiled")
LLAMA3_8B = dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, seq=2048, batch=2)
TINY = dict(layers=2, hidden=128, ffn=256, heads=4, kv_heads=2, vocab=256, seq=64, batch=2)
TEXT_CORPUS = dict(vocab=32000, budget_mb=24, tokenizer_mb=6)  # real_text.prepare_data's sizes for --data text
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_config(spec: dict):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=spec["hidden"], intermediate_size=spec["ffn"], num_hidden_layers=spec["layers"],
                       num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                       vocab_size=spec["vocab"], max_position_embeddings=max(spec["seq"], 128),
                       tie_word_embeddings=False, rope_theta=500000.0)


def make_checkpoint(spec: dict, directory: Path, layout: str, device: str) -> None:
    """The seeded bf16 model, built on `device` in bf16 (no fp32 copy), written as an FP8 checkpoint."""
    import torch
    from transformers import LlamaForCausalLM

    from fp8plug.checkpoints.export import save_fp8_checkpoint

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(spec))
    finally:
        torch.set_default_dtype(previous)
    save_fp8_checkpoint(model, directory, layout=layout)
    (directory / "bench_spec.json").write_text(json.dumps(dict(spec, layout=layout), sort_keys=True))


def build(row: str, spec: dict, args):
    """The row's PEFT model, ready to train."""
    import torch
    from peft import LoraConfig, get_peft_model

    import fp8plug

    fp8 = row.startswith("fp8base")
    model = fp8plug.load_fp8_base(args.ckpt_dir, device=args.device, dtype=torch.bfloat16, trainable=not fp8,
                                  fp8_head=fp8 and args.fp8_head)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                             target_modules=TARGETS))
    if fp8:
        fp8plug.convert_model(model, recipe=fp8plug.FP8RecipeKwargs(backend="native"))
    model.train()
    return model


def run_row(row: str, spec: dict, args) -> dict:
    import torch

    cuda = args.device.startswith("cuda")
    model = build(row, spec, args)
    loaded_gb = torch.cuda.memory_allocated() / 2**30 if cuda else None
    load_peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # from here: the training's own peak (train_peak_gb)
    if args.memory_snapshot and cuda:
        memory_at_peak.record()  # the training's allocations only: what the summary lists is what training adds
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, fused=cuda)
    step_fn = torch.compile(model) if row.endswith("-compiled") else model
    batches = training_batches(spec, args)
    times, losses, first = [], [], None
    for i in range(args.steps):
        ids = batches[i].to(args.device)
        start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            start.record()
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16):
            loss = step_fn(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if first is None:
            first = time.time() - args.t0
    step_s = statistics.median(times[args.warmup:] or times)
    if args.memory_snapshot and cuda:
        folder = Path(args.memory_snapshot)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{row}.txt").write_text(memory_at_peak.summary(memory_at_peak.dump(str(folder / f"{row}.pickle"))))
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not p.requires_grad)
    train_peak_gb = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return dict(row=row, tokens_per_s=round(spec["batch"] * spec["seq"] / step_s, 1), step_s=round(step_s, 4),
                peak_gb=round(max(load_peak_gb, train_peak_gb), 2) if cuda else None,
                load_peak_gb=round(load_peak_gb, 2) if cuda else None,
                train_peak_gb=round(train_peak_gb, 2) if cuda else None,
                loaded_gb=None if loaded_gb is None else round(loaded_gb, 2),
                frozen_param_gb=round(base_bytes / 2**30, 3),
                first_step_s=round(first, 1), loss=round(sum(losses[-10:]) / len(losses[-10:]), 4),
                losses=[round(x, 4) for x in losses], steps=args.steps)


def training_batches(spec: dict, args) -> list:
    """The rows' batches: text (the installed packages' files, real_text.py's corpus and tokenizer,
    the default) or the synthetic copy task. Text for the loss comparison: the synthetic task's loss
    sits on a plateau and then drops within a few steps, so two runs a few steps apart in leaving
    it differ by far more than 1% at a fixed step; text gives a curve that falls smoothly."""
    if args.data == "synthetic":
        return make_batches(spec, args.steps)
    import real_text

    text = dict(seq=spec["seq"] - 1, batch=spec["batch"], **TEXT_CORPUS)
    return [b.view(spec["batch"], spec["seq"]) for b in real_text.batches(Path(args.text_cache), "train", args.steps,
                                                                           text, seed=1)]


# --- the parent ---------------------------------------------------------------------------------------


def spawn(argv: list, timeout: float, fresh_caches: bool = True):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        code, err = run_fresh([sys.executable, str(Path(__file__).resolve()), *argv, "--out", str(out)], timeout,
                              caches_in=tmp if fresh_caches else None)
        if code is None:
            return dict(error=f"timed out after {timeout:.0f} s"), err
        if out.exists():
            return json.loads(out.read_text()), err
        return dict(error=f"exited {code}: {' | '.join(err.strip().splitlines()[-2:])[-400:]}"), err


def summarize(rows: list) -> None:
    ok = {r["row"]: r for r in rows if r.get("tokens_per_s")}
    speed_ref = ok.get("bf16-lora-compiled") or ok.get("bf16-lora")
    for r in rows:
        if not r.get("tokens_per_s"):
            continue
        same = ok.get("bf16-lora" + ("-compiled" if r["row"].endswith("-compiled") else ""))
        if speed_ref:
            r["speed_vs_bf16_compiled"] = round(r["tokens_per_s"] / speed_ref["tokens_per_s"], 3)
        if same and r.get("peak_gb") and same.get("peak_gb"):
            r["peak_vs_bf16"] = round(r["peak_gb"] / same["peak_gb"], 3)
        if same:
            r["loss_vs_bf16_pct"] = round(100 * (r["loss"] - same["loss"]) / same["loss"], 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layout", default="block", choices=("block", "per_tensor"))
    p.add_argument("--fp8-head", dest="fp8_head", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default="cuda")
    for key, value in LLAMA3_8B.items():
        p.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, default=None, help=f"default {value}")
    p.add_argument("--ckpt-dir", default=None, help="where the FP8 checkpoint is written (reused if it matches)")
    p.add_argument("--data", default=None, choices=("text", "synthetic"),
                   help="default text (synthetic for --device cpu)")
    p.add_argument("--text-cache", default=str(Path(tempfile.gettempdir()) / "fp8plug_lora_text"),
                   help="where --data text keeps its tokenizer and token files")
    p.add_argument("--json", default=None)
    p.add_argument("--memory-snapshot", default=None, metavar="DIR",
                   help="record the allocator's history; write DIR/<row>.txt (what is alive at the peak)")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds from start; no row starts past it")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    p.add_argument("--make-checkpoint", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=PROCESS_START, help=argparse.SUPPRESS)
    args = p.parse_args()
    smoke = args.device == "cpu"
    spec = {k: getattr(args, k) if getattr(args, k) is not None else (TINY if smoke else LLAMA3_8B)[k]
            for k in LLAMA3_8B}
    if smoke and args.rows == ",".join(ROWS):
        args.rows, args.steps, args.warmup = "bf16-lora,fp8base-lora", min(args.steps, 3), 1
    args.data = args.data or ("synthetic" if smoke else "text")
    if args.data == "text" and spec["vocab"] < TEXT_CORPUS["vocab"]:
        raise SystemExit(f"--data text needs --vocab >= {TEXT_CORPUS['vocab']} (its tokenizer's), got {spec['vocab']}")
    tag = "_".join(str(spec[k]) for k in LLAMA3_8B)
    args.ckpt_dir = Path(args.ckpt_dir or Path(tempfile.gettempdir()) / f"fp8plug_lora_fp8_base_{tag}_{args.layout}")
    if args.make_checkpoint or args.row:
        try:
            if args.make_checkpoint:
                make_checkpoint(spec, args.ckpt_dir, args.layout, args.device)
                result = dict(ok=True)
            else:
                result = run_row(args.row, spec, args)
        except Exception as exc:  # an error row, with the traceback on stderr
            traceback.print_exc()
            result = dict(row=args.row, error=f"{type(exc).__name__}: {exc}"[:500])
        Path(args.out).write_text(json.dumps(result))
        return

    def left():
        return args.deadline - (time.time() - PROCESS_START)

    marker = args.ckpt_dir / "bench_spec.json"
    if not (marker.exists() and json.loads(marker.read_text()) == dict(spec, layout=args.layout)):
        print(f"writing the FP8 checkpoint to {args.ckpt_dir} ...", file=sys.stderr, flush=True)
        result, err = spawn(["--make-checkpoint", *forwarded(args, spec)], left(), fresh_caches=False)
        if result.get("error"):
            sys.stderr.write(err[-3000:])
            raise SystemExit(f"checkpoint: {result['error']}")
    corpus = None
    if args.data == "text":
        import real_text

        corpus = real_text.prepare_data(Path(args.text_cache), TEXT_CORPUS)
    meta = dict(spec=spec, data=args.data, corpus=corpus, layout=args.layout, rank=args.rank, steps=args.steps,
                warmup=args.warmup, lr=args.lr,
                fp8_head=args.fp8_head, device=args.device, loss_floor=round(loss_floor(spec), 4),
                checkpoint_s=round(time.time() - PROCESS_START, 1))
    rows = []
    for row in [r for r in args.rows.split(",") if r]:
        if row not in ROWS:
            raise SystemExit(f"--rows: unknown row {row!r}; choose from {', '.join(ROWS)}")
        if left() < 30:
            rows.append(dict(row=row, error=f"not run: --deadline {args.deadline:.0f} s reached"))
            continue
        print(f"{row} ...", file=sys.stderr, flush=True)
        result, err = spawn(["--row", row, "--t0", str(time.time()), *forwarded(args, spec)], left())
        if result.get("error"):
            sys.stderr.write(err[-3000:])
        rows.append(dict(result, row=row))
        summarize(rows)
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    for r in rows:
        print(f"{r['row']:24s} " + (r.get("error") or
              f"{r['tokens_per_s']:>10.0f} tok/s  x{r.get('speed_vs_bf16_compiled', float('nan')):.2f} speed  "
              f"peak {r['peak_gb']} GB (x{r.get('peak_vs_bf16', float('nan')):.2f})  loss {r['loss']} "
              f"({r.get('loss_vs_bf16_pct', float('nan')):+.2f}%)"))


def forwarded(args, spec: dict) -> list:
    out = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr), "--rank", str(args.rank),
           "--layout", args.layout, "--device", args.device, "--ckpt-dir", str(args.ckpt_dir),
           "--fp8-head" if args.fp8_head else "--no-fp8-head", "--data", args.data, "--text-cache", args.text_cache]
    if args.memory_snapshot:
        out += ["--memory-snapshot", args.memory_snapshot]
    for key, value in spec.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


if __name__ == "__main__":
    main()
