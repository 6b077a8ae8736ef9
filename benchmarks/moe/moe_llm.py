"""Training a transformers mixture-of-experts model: bf16, Accelerate's own FP8 and fp8plug, side by side.

The model is a transformers MixtralForCausalLM or Qwen3MoeForCausalLM built from a config (no
download), trained as an Accelerate user trains it: fp32 master weights, bf16 autocast, fused
AdamW with a linear warm-up, `accelerator.backward`, on the synthetic task of
benchmarks/training/hf_llama_task.py (a known loss floor). Rows (each its own process, with empty
inductor and triton caches):

  bf16                 accelerate.Accelerator(mixed_precision="bf16")
  bf16-bf16weights     the same with the model cast to bfloat16 first (bf16 weights and AdamW states). Why: with
                       fp32 master weights transformers' experts cast their input to the weights' dtype
                       (grouped_mm is not autocast-aware), so the `bf16` rows' experts GEMMs run in float32
                       (compiled, through transformers' per-expert fallback loop); this row is the bf16
                       grouped_mm baseline an MoE user can also choose
  bf16-bf16weights-skipmask  the same with fp8plug's attention change alone (fp8plug.hf.attention.skip_causal_mask:
                       SDPA's causal kernel instead of the mask transformers builds when compiled), which the
                       fp8plug rows get too: against it, what FP8 itself gains
  accelerate-ao        accelerate.Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])
  fp8plug              fp8plug.Accelerator(mixed_precision="fp8")  (default recipe: grouped FP8 GEMM experts)
  fp8plug-bf16weights  the same on the model cast to bfloat16 first (against bf16-bf16weights: the FP8 casts read
                       bf16 weights, as a user training in pure bf16 has them)
  fp8plug-bf16weights-grouped  the same with every expert GEMM in torch._scaled_grouped_mm, also where the
                       default runs them as dense GEMMs per expert (dense_experts.DENSE_GEMMS_MAX_EXPERTS: Mixtral's 8)
  fp8plug-noexperts    the same with every experts module in modules_to_ignore (splits the gain: Linears vs experts)
  fp8plug-nofilter     the same with auto_filter=False: every aligned Linear and experts module in FP8, whatever
                       the speed filter predicts (checks its verdict: Qwen3-MoE's experts are predicted 0.70x)
  fp8plug-nofilter-unfusedcasts  the same with the grouped GEMM's eager casts as separate torch ops (what
                       backends/native/grouped_cast.py fused; the same bytes): its `-eager` row against
                       fp8plug-nofilter-eager is what the fusion gains on the whole model

each `-eager`, `-compiled` (Accelerate's dynamo_backend="inductor") or `-usercompiled`
(`torch.compile(model)` after prepare). Reported per row: tokens/s (median step after the warm-up),
peak memory, seconds to the first step, the loss (mean of the last 10 steps) and how far it is
from the bf16 row's of the same compile mode (bf16-eager for -eager rows, ...; %), how many
experts modules ran in FP8 (fp8plug.fp8_coverage) and the share of padding rows the grouped GEMM added.

    python3 benchmarks/moe/moe_llm.py --model mixtral --steps 200 --json out/moe_mixtral.json
    python3 benchmarks/moe/moe_llm.py --model qwen3moe --rows bf16-usercompiled,fp8plug-usercompiled --steps 50
    python3 benchmarks/moe/moe_llm.py --device cpu --model toy --steps 4 --backend native \\
        --compile-backend aot_eager --rows bf16-eager,fp8plug-eager,fp8plug-usercompiled   # CPU smoke test
"""

from __future__ import annotations

import time

PROCESS_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _path in (str(ROOT), str(ROOT / "benchmarks" / "training")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from fresh_process import run_fresh  # noqa: E402
from gpu_time_by_kind import profile_steps  # noqa: E402
from hf_llama_measure import StepClock, gpu_memory, note_early_step, step_numbers  # noqa: E402
from hf_llama_report import versions  # noqa: E402
from hf_llama_task import loss_floor, make_batches, training_step, warmup_schedule  # noqa: E402

MODELS = {
    # Mixtral-shaped: 2.9B parameters at 2 layers (fp32 AdamW fits one H100)
    "mixtral": dict(arch="mixtral", layers=2, hidden=4096, expert_ffn=14336, experts=8, top_k=2, heads=32,
                    kv_heads=8, head_dim=128, vocab=32000, seq=2048, batch=4),
    # Qwen3-MoE-shaped: 3.0B parameters at 4 layers; the top-8 routing weights renormalised to sum to one, as
    # Qwen3-30B-A3B's config has them (norm_topk_prob, whose transformers default, False, would weight each token's
    # expert outputs by about 8/128 in all)
    "qwen3moe": dict(arch="qwen3moe", layers=4, hidden=2048, expert_ffn=768, experts=128, top_k=8, heads=32,
                     kv_heads=4, head_dim=128, vocab=151936, seq=2048, batch=4, norm_topk_prob=True),
    # the CPU smoke size
    "toy": dict(arch="mixtral", layers=2, hidden=64, expert_ffn=32, experts=4, top_k=2, heads=4, kv_heads=2,
                head_dim=16, vocab=256, seq=64, batch=2),
}
BASES = {
    "bf16": ("accelerate", "bf16", {}),
    "bf16-bf16weights": ("accelerate", "bf16", dict(bf16_weights=True)),
    "bf16-bf16weights-skipmask": ("accelerate", "bf16", dict(bf16_weights=True, skip_causal_mask=True)),
    "accelerate-ao": ("accelerate", "fp8", {}),
    "fp8plug": ("fp8plug", "fp8", {}),
    "fp8plug-bf16weights": ("fp8plug", "fp8", dict(bf16_weights=True)),
    "fp8plug-bf16weights-grouped": ("fp8plug", "fp8", dict(bf16_weights=True, grouped_gemms=True)),
    "fp8plug-noexperts": ("fp8plug", "fp8", dict(ignore_experts=True)),
    "fp8plug-nofilter": ("fp8plug", "fp8", dict(auto_filter=False)),
    "fp8plug-nofilter-unfusedcasts": ("fp8plug", "fp8", dict(auto_filter=False, unfused_casts=True)),
}
MODES = ("eager", "compiled", "usercompiled")
ALL_ROWS = [f"{base}-{mode}" for base in BASES for mode in MODES]
DEFAULT_ROWS = ["bf16-usercompiled", "bf16-compiled", "fp8plug-usercompiled", "fp8plug-compiled", "bf16-eager",
                "fp8plug-eager", "accelerate-ao-usercompiled", "fp8plug-nofilter-usercompiled",
                "bf16-bf16weights-usercompiled"]


def model_config(spec: dict):
    """(the model class, its config) for `spec`: what every MoE benchmark builds (this one on one
    GPU, benchmarks/distributed/fsdp2_llama.py's `--model` under FSDP2)."""
    import transformers

    common = dict(vocab_size=spec["vocab"], hidden_size=spec["hidden"], num_hidden_layers=spec["layers"],
                  num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                  max_position_embeddings=spec["seq"], tie_word_embeddings=False, use_cache=False)
    if spec["arch"] == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=spec["expert_ffn"], num_local_experts=spec["experts"],
                                            num_experts_per_tok=spec["top_k"], head_dim=spec["head_dim"], **common)
        return transformers.MixtralForCausalLM, config
    config = transformers.Qwen3MoeConfig(moe_intermediate_size=spec["expert_ffn"], num_experts=spec["experts"],
                                         num_experts_per_tok=spec["top_k"], head_dim=spec["head_dim"],
                                         intermediate_size=4 * spec["hidden"], decoder_sparse_step=1,
                                         mlp_only_layers=[], norm_topk_prob=spec.get("norm_topk_prob", False),
                                         **common)
    return transformers.Qwen3MoeForCausalLM, config


def build_model(spec: dict, device):
    """The row's model from a config, fp32 weights on `device`, seed 0."""
    import torch

    cls, config = model_config(spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    return model.train()


def setup(row: str, spec: dict, device, steps: int, lr: float):
    import accelerate
    import torch

    base, mode = row.rsplit("-", 1)
    kind, precision, options = BASES[base]
    model = build_model(spec, device)
    if options.get("bf16_weights"):
        model = model.to(torch.bfloat16)
    if options.get("skip_causal_mask"):
        from fp8plug.hf.attention import skip_causal_mask

        skip_causal_mask(model)
    handlers = []
    if kind == "accelerate" and precision == "fp8":
        handlers = [accelerate.utils.AORecipeKwargs()]
    if kind == "fp8plug":
        import fp8plug
        from fp8plug.hf.experts import experts_modules

        ignore = [fqn for fqn, _ in experts_modules(model)] if options.get("ignore_experts") else None
        engine, extra = spec.get("backend"), {k: v for k, v in options.items() if k == "auto_filter"}
        handlers = ([fp8plug.FP8RecipeKwargs(backend=engine, modules_to_ignore=ignore, **extra)]
                    if ignore or engine or extra else [])
        cls = fp8plug.Accelerator
        from fp8plug.backends.native import dense_experts, grouped

        if options.get("unfused_casts"):
            grouped._fused = lambda t: False
        if options.get("grouped_gemms"):
            dense_experts.DENSE_GEMMS_MAX_EXPERTS = 0
    else:
        cls = accelerate.Accelerator
    accelerator = cls(mixed_precision=precision, kwargs_handlers=handlers, cpu=device.type == "cpu",
                      dynamo_backend=spec.get("compile_backend", "inductor") if mode == "compiled" else "no")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
    scheduler = warmup_schedule(optimizer, steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if mode == "usercompiled":
        model = torch.compile(model, backend=spec.get("compile_backend", "inductor"))
    return accelerator, model, optimizer, scheduler


def padding_share(spec: dict) -> float:
    """Rows the grouped GEMM pads per projection, as a share of the routed rows, at the bound:
    every expert's group padded by up to 15 rows (what uniform routing costs on average is half)."""
    pairs = spec["batch"] * spec["seq"] * spec["top_k"]
    return spec["experts"] * 7.5 / pairs


def train(row: str, spec: dict, steps: int, warmup: int, lr: float, device, t0: float, profile: int = 0) -> dict:
    import torch

    cuda = device.type == "cuda"
    accelerator, model, optimizer, scheduler = setup(row, spec, device, steps, lr)
    data = make_batches(spec, steps).to(accelerator.device)
    engine = getattr(accelerator, "fp8_engine", None)
    clock, losses, out = StepClock(cuda), [], dict(engine=getattr(engine, "name", None))

    step = training_step(accelerator, model, optimizer, scheduler, data)
    marks = [clock.mark()]
    for i in range(steps):
        losses.append(step(i))
        marks.append(clock.mark())
        note_early_step(out, i, warmup, t0, cuda)
    if cuda:
        torch.cuda.synchronize()
        out.update(gpu_memory(device, None))
        if profile:
            out["profile"] = profile_steps(lambda: step(steps - 1), profile, top=60)
    out.update(step_numbers(spec, steps, warmup, [clock.ms(a, b) for a, b in zip(marks, marks[1:])], losses))
    if row.startswith("fp8plug"):
        out.update(experts_facts(accelerator, model), padding_share_bound=padding_share(spec))
    return out


def experts_facts(accelerator, model) -> dict:
    """How many experts modules ran their GEMMs in FP8 (fp8plug.fp8_coverage, counted as they ran),
    out of how many the model has, and why any stayed in high precision (the conversion reports)."""
    import fp8plug

    inner = accelerator.unwrap_model(model)
    layers = fp8plug.fp8_coverage(inner)["layers"]
    experts = {k: v for k, v in layers.items() if k.endswith("experts")}
    return dict(experts_fp8=sum(1 for fp8, _ in experts.values() if fp8),
                experts_total=sum(1 for name, _ in inner.named_modules() if name.endswith("mlp.experts")),
                experts_note="; ".join(sorted({why for report in accelerator.fp8_reports
                                               for fqn, why in report.skipped.items() if fqn in report.experts})))


def run_row(row: str, spec: dict, steps: int, warmup: int, lr: float, device_name: str, t0: float,
            profile: int = 0) -> dict:
    import torch

    result = dict(row=row, tokens_per_s=None, peak_gb=None, loss=None, error=None)
    try:
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device_name if device_name != "auto" else auto)
        result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        if row.startswith("accelerate-ao") and device.type == "cpu":
            result["error"] = "unavailable: Accelerate's AORecipeKwargs needs a CUDA GPU"
            return result
        result.update(train(row, spec, steps, warmup, lr, device, t0, profile))
    except Exception as exc:  # noqa: BLE001 - a failed row is a row with its reason
        result["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
        traceback.print_exc()
    return result


def spawn(row: str, args, timeout: float) -> dict:
    """run_row in a fresh process with empty compile caches; a crash or timeout is an error row."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--row", row, "--json", str(path), "--model", args.model,
               "--layers", str(args.spec["layers"]), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--lr", str(args.lr), "--device", args.device, "--compile-backend", args.compile_backend,
               *(["--backend", args.backend] if args.backend else []),
               "--profile", str(args.profile), "--t0", str(time.time())]
        code, err = run_fresh(cmd, timeout, caches_in=tmp)
        if code is None:
            sys.stderr.write(err[-2000:])
            return dict(row=row, error=f"timed out after {timeout:.0f} s")
        if path.exists():
            result = json.loads(path.read_text())["rows"][0]
            if result.get("error"):
                sys.stderr.write(err[-3000:])
            return result
        sys.stderr.write(err[-3000:])
        return dict(row=row, error=f"process exited {code}: {err.strip().splitlines()[-1:]}")


def loss_vs_bf16(row: dict, ok: dict, ref: dict):
    """(row's loss - bf16's) / bf16's in %, against the bf16 row of the same compile mode where
    there is one (else its attention-change row, else `ref`; a -bf16weights row against
    bf16-bf16weights): FP8's cost in loss, apart from what compiling changes."""
    mode = row["row"].rsplit("-", 1)[1]
    weights = "-bf16weights" if "-bf16weights-" in row["row"] else ""
    base = ok.get(f"bf16{weights}-{mode}") or ok.get(f"bf16{weights}-skipmask-{mode}") or ref
    if not base or row.get("loss") is None or base.get("loss") is None:
        return None, None
    return 100.0 * (row["loss"] - base["loss"]) / base["loss"], base["row"]


def table(meta: dict, rows: list) -> str:
    s = meta["spec"]
    ok = {r["row"]: r for r in rows if r.get("tokens_per_s")}
    ref = next((ok[n] for n in ("bf16-usercompiled", "bf16-compiled", "bf16-eager") if n in ok), None)

    def f(value, spec, suffix=""):
        return "-" if value is None else format(value, spec) + suffix

    lines = [f"{meta['model']}: {s['layers']} layers, hidden {s['hidden']}, {s['experts']} experts top-{s['top_k']}, "
             f"expert ffn {s['expert_ffn']}, {s['heads']}/{s['kv_heads']} heads, vocab {s['vocab']}; batch "
             f"{s['batch']} x {s['seq']}; {meta['steps']} steps; loss floor {loss_floor(s):.3f}",
             f"{meta.get('device') or '-'}; {meta['versions']}", "",
             f"| row | engine | tok/s | vs {ref['row'] if ref else '-'} | peak GB | first step s | loss "
             "| loss vs bf16 % (same mode) | experts in FP8 | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        speed = r["tokens_per_s"] / ref["tokens_per_s"] if ref and r.get("tokens_per_s") else None
        experts = f"{r['experts_fp8']}/{r['experts_total']}" if r.get("experts_total") is not None else "-"
        note = r.get("error") or (r.get("experts_note") or "")[:200]
        lines.append(f"| {r['row']} | {r.get('engine') or '-'} | {f(r.get('tokens_per_s'), ',.0f')} | "
                     f"{f(speed, '.2f', 'x')} | "
                     f"{f(r.get('peak_gb'), '.1f')} | {f(r.get('first_step_s'), '.1f')} | {f(r.get('loss'), '.4f')} | "
                     f"{f(r.get('loss_vs_bf16_pct'), '+.2f')} | {experts} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mixtral")
    p.add_argument("--layers", type=int, default=None,
                   help="fewer layers where a row does not fit (never fewer experts)")
    p.add_argument("--rows", default="default", help="comma list, 'default' or 'all'; rows: " + ", ".join(ALL_ROWS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-4; toy 3e-3)")
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default=None, help="fp8plug rows' engine (default: the automatic choice; "
                   "on a CPU that is ao, whose experts stay bf16, so the smoke test passes native)")
    p.add_argument("--compile-backend", default="inductor", help="aot_eager: quick compiled rows on a CPU")
    p.add_argument("--timeout", type=float, default=420, help="seconds per row")
    p.add_argument("--deadline", type=float, default=None, help="seconds for the whole run")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="on a GPU, profile N more steps after the timed ones: GPU time by kind of kernel "
                        "(benchmarks/training/gpu_time_by_kind.py), the top kernels")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.spec = dict(MODELS[args.model], compile_backend=args.compile_backend, backend=args.backend)
    if args.layers:
        args.spec["layers"] = args.layers
    args.lr = args.lr or (3e-3 if args.model == "toy" else 3e-4)
    args.warmup = args.warmup or min(10, max(1, args.steps // 10))
    if not 1 <= args.warmup < args.steps:
        p.error("--warmup must be at least 1 and below --steps")
    names = {"default": DEFAULT_ROWS, "all": ALL_ROWS}
    args.row_list = [r for part in args.rows.split(",") if part for r in names.get(part, [part])]
    bad = [r for r in args.row_list + ([args.row] if args.row else []) if r not in ALL_ROWS]
    if bad:
        p.error(f"unknown row {bad[0]!r}; rows: {', '.join(ALL_ROWS)}")
    return args


def save(path, meta: dict, rows: list) -> None:
    meta["device"] = next((r["device"] for r in rows if r.get("device")), None)
    ok = {r["row"]: r for r in rows if r.get("tokens_per_s")}
    ref = next((ok[n] for n in ("bf16-usercompiled", "bf16-compiled", "bf16-eager") if n in ok), None)
    for r in rows:
        r["loss_vs_bf16_pct"], r["loss_vs_bf16_of"] = loss_vs_bf16(r, ok, ref)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    meta = dict(model=args.model, spec=args.spec, steps=args.steps, warmup=args.warmup, lr=args.lr,
                versions=versions(), command="python3 benchmarks/moe/moe_llm.py " + " ".join(sys.argv[1:]))
    if args.row:
        rows = [run_row(args.row, args.spec, args.steps, args.warmup, args.lr, args.device, args.t0 or PROCESS_START,
                        args.profile)]
    else:
        rows = []
        for i, row in enumerate(args.row_list, 1):
            left = args.deadline - (time.time() - PROCESS_START) if args.deadline else args.timeout
            if left < 30:
                rows.append(dict(row=row, error="not run: --deadline reached"))
                continue
            print(f"[{i}/{len(args.row_list)}] {row} ...", file=sys.stderr, flush=True)
            rows.append(spawn(row, args, min(args.timeout, left)))
            print(f"    {rows[-1].get('error') or 'ok'}: tok/s {rows[-1].get('tokens_per_s')}", file=sys.stderr,
                  flush=True)
            save(args.json, meta, rows)
    save(args.json, meta, rows)
    print(table(meta, rows))
    return 0 if any(r.get("tokens_per_s") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
