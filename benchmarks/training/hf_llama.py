"""Training a Hugging Face LlamaForCausalLM: bf16, Accelerate's own FP8 and fp8plug, side by side.

The model is a transformers `LlamaForCausalLM` built from a config (no download), trained the way
a user of Accelerate trains it: fp32 master weights, `Accelerator(mixed_precision=...)` (bf16
autocast around the forward), fused AdamW with a linear warm-up, `accelerator.backward`. Every
row changes only the Accelerator:

  bf16                    accelerate.Accelerator(mixed_precision="bf16")
  accelerate-ao           accelerate.Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])
  accelerate-ao-noag      the same with AORecipeKwargs(enable_fsdp_float8_all_gather=False): see BASES
  accelerate-te           the same with TERecipeKwargs()
  fp8plug                 fp8plug.Accelerator(mixed_precision="fp8")   (the automatic engine choice)
  fp8plug-native|ao|te    fp8plug.Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend=...)])
  fp8plug-dpa             the same with FP8RecipeKwargs(fp8_dpa=True): FP8 attention (eager rows; not a default row)

each `-eager`, `-compiled`, `-usercompiled`, `-precompiled` or `-trainer`: compiled = the whole
model under torch.compile through the Accelerator's own `dynamo_backend="inductor"`; usercompiled
= the user's own `torch.compile(model)` after prepare (how most training loops compile);
precompiled = `torch.compile(model)` before prepare; trainer = `transformers.Trainer` with
`TrainingArguments(torch_compile=True)` running the loop instead: bf16 rows a plain
Trainer(bf16=True), fp8plug rows the same Trainer class with `fp8plug.integrations.trainer.FP8TrainerMixin`
and the row's recipe, accelerate-* rows Accelerate's FP8 set through the environment that
`accelerate launch --mixed_precision fp8` exports (TrainingArguments cannot carry a recipe
handler); hf_llama_trainer.py says what it sets to match the other rows and how it measures. The
Accelerator knows how the model will run only in compiled and trainer (Trainer hands it a dynamo
plugin). `--compile-backend` swaps inductor for another torch.compile backend in every compiled
row (the CPU tests use aot_eager). Each row runs in its own process (this script with --row), so
memory, compile caches and engine globals cannot leak between rows. All rows train on the same
data from the same initial weights (hf_llama_task.py).

Reported per row: tokens/s (from the median step time over the steps after the warm-up, CUDA
events), peak memory (torch.cuda.max_memory_allocated over the whole process), time from process
start to the end of the first training step (imports, model construction, compilation included)
and to the end of the warm-up (later recompilations included), and the loss after the last step
(mean over the last 10 steps) on a learnable synthetic task with a known floor (see
`make_batches`). Ratios are against bf16-compiled (else bf16-eager, else bf16-trainer). The JSON
also holds the loss curve, the engine, how many modules run in FP8, how many dynamo graphs were
compiled (more than one: a recompilation) and `params_not_stepped`, the trainable parameters no
optimizer holds (a path that leaves weights untrained is not faster for a good reason).

`--lora R` makes every row a PEFT LoRA fine-tune; `--liger` applies liger-kernel's
`apply_liger_kernel_to_llama()` (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy: its defaults)
before each row builds its model, so `--rows bf16-compiled,fp8plug-compiled --liger` is bf16 + Liger
against fp8plug + Liger (lm_head then stays in high precision in every row: Liger's loss reads its
weight directly, docs/liger.md). The JSON's spec records both (and --compile-backend), and fp8plug
rows record which Linear layers stayed in high precision and why (`high_precision_linears`).

    python3 benchmarks/training/hf_llama.py --json out/hf_llama.json             # the whole table, on a GPU
    python3 benchmarks/training/hf_llama.py --rows bf16-compiled,fp8plug-compiled --steps 50
    python3 benchmarks/training/hf_llama.py --preset toy --device cpu --rows bf16-eager,fp8plug-native-eager
    python3 benchmarks/training/hf_llama.py --rows bf16-compiled,fp8plug-compiled,bf16-eager,fp8plug-eager --liger
    # Trainer(torch_compile=True):
    python3 benchmarks/training/hf_llama.py --rows bf16-trainer,fp8plug-trainer --steps 50
    python3 benchmarks/training/hf_llama.py --preset toy --device cpu --compile-backend aot_eager \\
        --rows bf16-trainer,fp8plug-trainer
    python3 benchmarks/training/hf_llama.py --table a.json b.json                  # merge runs into one table
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # what --row uses when its parent did not pass --t0

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _path in (str(ROOT), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from fresh_process import run_fresh  # noqa: E402
from gpu_time_by_kind import profile_steps  # noqa: E402
from hf_llama_measure import (  # noqa: E402
    StepClock,
    dynamo_graphs,
    fp8_attention_calls,
    gpu_memory,
    model_facts,
    note_early_step,
    step_numbers,
)
from hf_llama_report import merge, save, table, versions  # noqa: E402
from hf_llama_task import ALPHABET, NOISE, build_model, loss_floor, make_batches, training_step, warmup_schedule  # noqa: E402,F401

PRESETS = {
    # the benchmark Llama: 4 layers of Llama-3-8B's width (d=4096, ffn 14336, 32/8 heads)
    "llama": dict(layers=4, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000, seq=2048, batch=4),
    # the probe decoder of benchmarks/training/train_step.py (ffn 16384, no grouped-query
    # attention), as a LlamaForCausalLM
    "probe": dict(layers=4, hidden=4096, intermediate=16384, heads=32, kv_heads=32, vocab=32000, seq=2048, batch=4),
    # Llama-3's shape (vocab 128256) at 8 layers, where lm_head and the loss are a large share of
    # the step. "Batch as fits": 2 x 4096 is the largest power of two every row fits on one H100
    # with fp32 AdamW state (bf16 eager peaks at 52.6 GB at 1 and 67.0 at 2, so 4 would need about
    # 96)
    "llama3": dict(layers=8, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, seq=4096, batch=2),
    # CPU smoke size: every Linear width a multiple of 16 so that every engine converts it
    "toy": dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256, seq=64, batch=2),
}
# row base -> (which Accelerator, mixed precision, engine, recipe arguments); the engine of
# "fp8plug" is its own choice. accelerate-ao-noag: AORecipeKwargs' default turns on FSDP2's float8
# all-gather, which wraps each converted weight in a new Parameter that an optimizer created
# before prepare() never sees (those weights are then never updated: `params_not_stepped`);
# turning it off, as one GPU allows, keeps the Parameters. bf16-skipmask: bf16 with fp8plug's
# changes that are not FP8: the attention change (fp8plug.hf.attention.skip_causal_mask) and, under
# regional compilation, the compiled loss (fp8plug.hf.regional_loss); fp8plug-keepmask: fp8plug without
# it (skip_causal_mask=False): together they split fp8plug's gain into attention's and FP8's.
# fp8plug-dpa: fp8plug with FP8 attention (fp8_dpa=True, fp8plug.hf.fp8_attention; TransformerEngine
# on an sm_90+ GPU): only its eager rows run it (compiled, attention falls back to SDPA), and
# like the mask rows it is left out of the default rows.
BASES = {
    "bf16": ("accelerate", "bf16", None, {}),
    "bf16-skipmask": ("accelerate", "bf16", None, dict(skip_causal_mask=True)),
    "accelerate-ao": ("accelerate", "fp8", "ao", {}),
    "accelerate-ao-noag": ("accelerate", "fp8", "ao", dict(enable_fsdp_float8_all_gather=False)),
    "accelerate-te": ("accelerate", "fp8", "te", {}),
    "fp8plug": ("fp8plug", "fp8", None, {}),
    "fp8plug-keepmask": ("fp8plug", "fp8", None, dict(skip_causal_mask=False)),
    "fp8plug-dpa": ("fp8plug", "fp8", None, dict(fp8_dpa=True)),
    "fp8plug-native": ("fp8plug", "fp8", "native", {}),
    "fp8plug-native-dynamic": ("fp8plug", "fp8", "native", dict(scaling="dynamic")),
    "fp8plug-native-delayed": ("fp8plug", "fp8", "native", dict(scaling="delayed")),
    "fp8plug-ao": ("fp8plug", "fp8", "ao", {}),
    "fp8plug-te": ("fp8plug", "fp8", "te", {}),
    # finer scaling (docs/numerics.md): native's rowwise and blockwise, and the same words on ao and te
    "fp8plug-rowwise": ("fp8plug", "fp8", "native", dict(scaling="rowwise")),
    "fp8plug-rowwise_with_gw_hp": ("fp8plug", "fp8", "native", dict(scaling="rowwise_with_gw_hp")),
    "fp8plug-blockwise": ("fp8plug", "fp8", "native", dict(scaling="blockwise")),
    "fp8plug-ao-rowwise": ("fp8plug", "fp8", "ao", dict(scaling="rowwise")),
    "fp8plug-te-blockwise": ("fp8plug", "fp8", "te", dict(scaling="blockwise")),
}
FINER = ("fp8plug-rowwise", "fp8plug-rowwise_with_gw_hp", "fp8plug-blockwise", "fp8plug-ao-rowwise",
         "fp8plug-te-blockwise")  # not among the default rows
# How the model is held: eager; `compiled`, Accelerate's dynamo_backend="inductor" (the
# Accelerator knows before prepare); `usercompiled`, the user's own torch.compile(model) after
# prepare (most training loops); `precompiled`, torch.compile(model) before prepare; `trainer`,
# transformers.Trainer(torch_compile=True) runs the loop (hf_llama_trainer.py); `regional`,
# Accelerate's TorchDynamoPlugin(use_regional_compilation=True): each decoder layer compiled in
# place, one graph reused for every layer, so the first step pays for one layer's compilation.
MODES = ("eager", "compiled", "usercompiled", "precompiled", "trainer", "regional")
ALL_ROWS = [f"{base}-{mode}" for base in BASES for mode in MODES]
DEFAULT_ROWS = [row for row in ALL_ROWS if row.rsplit("-", 1)[1] in ("eager", "compiled")
                and row not in ("accelerate-ao-eager", "accelerate-ao-noag-eager") and "mask-" not in row
                and "-dpa-" not in row and row.rsplit("-", 1)[0] not in FINER]


# --- one row, in its own process (the task and the model: hf_llama_task.py) -------------------------


def unavailable(row: str, device) -> str:
    """Why `row` cannot run on `device` ('' if it can). Accelerate's rows are judged by Accelerate's
    own checks (which import nothing), fp8plug's by fp8plug's engine choice."""
    kind, _, engine, options = BASES[row.rsplit("-", 1)[0]]
    if options.get("fp8_dpa"):  # without FP8 attention the row would be plain fp8plug's under another name
        from fp8plug.backends.te.attention import fp8_attention_problem

        problem = fp8_attention_problem(device)
        if problem:
            return f"fp8_dpa: {problem}"
    if kind == "accelerate":
        from accelerate.utils import is_torchao_available, is_transformer_engine_available

        if engine == "ao" and not is_torchao_available():
            return "torchao >= 0.6.1 is not installed"
        if engine == "te" and not is_transformer_engine_available():
            return "transformer_engine is not installed"
        if engine == "te" and device.type != "cuda":
            return "Accelerate's TransformerEngine path needs a CUDA GPU"
        return ""
    from fp8plug.backends import BackendUnavailableError, judge, select_backend
    from fp8plug.tuning.hardware import device_info

    if engine is not None:
        verdict = judge(engine, device_info(device))
        return "" if verdict.usable else verdict.reason
    try:  # the Accelerator's own choice for this mode: choosing by order would import every engine,
        # TransformerEngine too, whose cuDNN then costs the row cuDNN attention (seen on the H100)
        select_backend(None, device, compiled=True if row.endswith(("-compiled", "-trainer", "-regional")) else None)
    except BackendUnavailableError as exc:
        return str(exc).splitlines()[0]
    return ""


def liger_unavailable(device) -> str:
    """Why a --liger row cannot run here ('' if it can): liger-kernel missing, or no GPU (its
    kernels are triton's)."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return "--liger: liger-kernel is not installed"
    if device.type != "cuda":
        return "--liger: Liger's kernels need a CUDA GPU (triton)"
    return ""


def setup(row: str, spec: dict, device, steps: int, lr: float):
    """The Accelerator of `row`, and the model, optimizer and scheduler it prepared."""
    import accelerate
    import torch

    base, mode = row.rsplit("-", 1)
    kind, precision, engine, options = BASES[base]
    handlers = []
    if kind == "accelerate" and engine == "ao":
        handlers = [accelerate.utils.AORecipeKwargs(**options)]
    elif kind == "accelerate" and engine == "te":
        handlers = [accelerate.utils.TERecipeKwargs(**options)]
    elif kind == "fp8plug" and (engine is not None or options):
        import fp8plug

        handlers = [fp8plug.FP8RecipeKwargs(backend=engine, **options)]
    if kind == "fp8plug":
        import fp8plug

        cls = fp8plug.Accelerator
    else:
        cls = accelerate.Accelerator
    backend = spec.get("compile_backend", "inductor")
    dynamo = {}
    if mode == "regional":
        dynamo["dynamo_plugin"] = accelerate.utils.TorchDynamoPlugin(backend=backend, use_regional_compilation=True)
    else:
        dynamo["dynamo_backend"] = backend if mode == "compiled" else "no"
    accelerator = cls(mixed_precision=precision, kwargs_handlers=handlers, cpu=device.type == "cpu", **dynamo)
    model = build_model(spec, accelerator.device)
    if kind == "accelerate" and options.get("skip_causal_mask"):
        from fp8plug.hf.attention import skip_causal_mask

        skip_causal_mask(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, fused=accelerator.device.type == "cuda")
    scheduler = warmup_schedule(optimizer, steps)
    if mode == "precompiled":
        model = torch.compile(model, backend=backend)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if kind == "accelerate" and options.get("skip_causal_mask"):  # the loss compiled too, where regional
        from fp8plug.hf.regional_loss import compile_losses

        compile_losses([model], accelerator.state.dynamo_plugin)
    if mode == "usercompiled":
        model = torch.compile(model, backend=backend)
    return accelerator, model, optimizer, scheduler


def run_row(row: str, spec: dict, steps: int, warmup: int, lr: float, device_name: str, t0: float,
            profile: int = 0) -> dict:
    """Train `row` for `steps` steps; its numbers, or `error` saying why it could not."""
    import torch

    result = dict(row=row, tokens_per_s=None, step_ms=None, peak_gb=None, first_step_s=None, warm_s=None,
                  loss=None, loss_floor=loss_floor(spec), loss_curve=None, engine=None, fp8_modules=None,
                  params_not_stepped=None, dynamo_graphs=None, device=None, error=None)
    try:
        device = torch.device(device_name if device_name != "auto" else
                              ("cuda" if torch.cuda.is_available() else "cpu"))
        result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        why = liger_unavailable(device) if spec.get("liger") else ""
        why = why or unavailable(row, device)
        if why:
            result["error"] = f"unavailable: {why}"
            return result
        result.update(train(row, spec, steps, warmup, lr, device, t0, profile))
    except Exception as exc:  # noqa: BLE001 - a row that fails is a row with its reason
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        result["error"] = f"{type(exc).__name__}: {first}"
        traceback.print_exc()
    return result


def train(row: str, spec: dict, steps: int, warmup: int, lr: float, device, t0: float, profile: int = 0) -> dict:
    import torch

    if row.endswith("-trainer"):  # transformers.Trainer runs the loop
        from hf_llama_trainer import train_with_trainer

        return train_with_trainer(BASES[row.rsplit("-", 1)[0]], spec, steps, warmup, lr, device, t0)
    cuda = device.type == "cuda"
    accelerator, model, optimizer, scheduler = setup(row, spec, device, steps, lr)
    prepared_gb = torch.cuda.memory_allocated(device) / 1e9 if cuda else None
    data = make_batches(spec, steps).to(accelerator.device)
    out = model_facts(model, optimizer, accelerator, BASES[row.rsplit("-", 1)[0]][2])
    clock, losses = StepClock(cuda), []

    step = training_step(accelerator, model, optimizer, scheduler, data)
    marks = [clock.mark()]  # the end of each step (the first: the start of step 0)
    for i in range(steps):
        losses.append(step(i))
        marks.append(clock.mark())
        note_early_step(out, i, warmup, t0, cuda)
    if cuda:
        torch.cuda.synchronize()
        out.update(gpu_memory(device, prepared_gb))
        if profile:
            out["profile"] = profile_steps(lambda: step(steps - 1), profile, top=60)
    out.update(step_numbers(spec, steps, warmup, [clock.ms(a, b) for a, b in zip(marks, marks[1:])], losses))
    out["dynamo_graphs"] = dynamo_graphs()
    out.update(fp8_attention_calls(model, accelerator))
    return out


# --- the parent: one process per row, the table ----------------------------------------------------


def spawn(row: str, args, timeout: float) -> dict:
    """run_row in a fresh process of this script (its own process group, so that a timeout also
    ends its compile workers); a crash or timeout is an error row. Unless --warm-cache, the row
    compiles with empty inductor and triton caches, so its first-step time is a first run's."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "row.json"
        sizes = [x for key, value in args.spec.items() for x in (f"--{key.replace('_', '-')}", str(value))]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--row", row, "--json", str(path), *sizes,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr),
               "--device", args.device, "--profile", str(args.profile), "--t0", str(time.time())]
        code, err = run_fresh(cmd, timeout, caches_in=None if args.warm_cache else tmp)
        if code is None:
            sys.stderr.write(err[-2000:])
            return dict(row=row, error=f"timed out after {timeout:.0f} s")
        if path.exists():
            result = json.loads(path.read_text())["rows"][0]
            if result.get("error") and not result["error"].startswith("unavailable"):
                sys.stderr.write(err[-3000:])
            return result
        sys.stderr.write(err[-3000:])
        tail = " | ".join(err.strip().splitlines()[-2:])[-300:]
        return dict(row=row, error=f"process exited {code}: {tail}")


def parse_rows(text: str) -> list:
    names = {"default": DEFAULT_ROWS, "all": ALL_ROWS}
    rows = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part not in names and part not in ALL_ROWS:
            raise SystemExit(f"--rows: unknown row {part!r}; use 'default', 'all' or any of: {', '.join(ALL_ROWS)}")
        rows += [r for r in names.get(part, [part]) if r not in rows]
    if not rows:
        raise SystemExit("--rows: no row given")
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama", help="model and batch size (default llama)")
    for key in PRESETS["llama"]:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"override the preset's {key}")
    p.add_argument("--rows", default="default", help="comma list of rows, 'default' (every row but "
                   "accelerate-ao-eager) or 'all'; rows: " + ", ".join(ALL_ROWS))
    p.add_argument("--steps", type=int, default=200, help="training steps per row (default 200)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: a tenth of --steps, 1..10)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate, linear warm-up over a tenth of the steps (default 3e-4; toy 3e-3)")
    p.add_argument("--device", default="auto", help="auto (a GPU if there is one), cuda or cpu")
    p.add_argument("--timeout", type=float, default=420, help="seconds allowed per row (default 420)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds for the whole run: rows that would start later are reported as not run")
    p.add_argument("--warm-cache", action="store_true",
                   help="let rows use the usual inductor/triton caches (default: each row compiles from empty ones)")
    p.add_argument("--json", default=None, help="write meta and rows here (rewritten after each row)")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON",
                   help="print one table from earlier --json files (later files win per row) and run nothing")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="on a GPU, profile N more steps after the timed ones "
                        "(kernel groups and top kernels in the JSON)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="fine-tune a PEFT LoRA of rank R on every projection (base frozen) instead of the whole model")
    p.add_argument("--liger", type=int, nargs="?", const=1, default=0, metavar="0|1",
                   help="apply liger-kernel's apply_liger_kernel_to_llama() (its defaults) before building the "
                        "model in every row: bf16 + Liger against fp8plug + Liger (needs liger-kernel and a GPU)")
    p.add_argument("--compile-backend", default="inductor", metavar="NAME",
                   help="torch.compile's backend in every compiled row (default inductor; aot_eager traces the same "
                        "graphs without inductor's build: quick on a CPU)")
    p.add_argument("--row", default=None, help="run this one row in this process (what the parent runs)")
    p.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.spec = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in PRESETS[args.preset].items()}
    bad = [k for k, v in args.spec.items() if v < 1]
    if bad or args.steps < 2 or args.lora < 0:
        p.error(f"--{bad[0] if bad else 'steps' if args.steps < 2 else 'lora'} must be at least "
                f"{1 if bad else 2 if args.steps < 2 else 0}")
    args.spec["lora"] = args.lora
    args.spec["liger"] = int(bool(args.liger))
    args.spec["compile_backend"] = args.compile_backend
    if args.lr is None:
        args.lr = 3e-3 if args.preset == "toy" else 3e-4
    if args.warmup is None:
        args.warmup = min(10, max(1, args.steps // 10))
    if not 1 <= args.warmup < args.steps:
        p.error("--warmup must be at least 1 and below --steps")
    if args.row is not None and args.row not in ALL_ROWS:
        p.error(f"--row: unknown row {args.row!r}; rows: {', '.join(ALL_ROWS)}")
    return args


def run_rows(args, meta: dict) -> list:
    """Each row in its own process, one after the other; the JSON is rewritten after each row so
    that a run cut short still leaves the rows it finished. Rows that --deadline leaves no time
    for are reported as not run."""
    names = parse_rows(args.rows)
    rows = []
    for i, row in enumerate(names, 1):
        left = args.deadline - (time.time() - PROCESS_START) if args.deadline else args.timeout
        if left < 30:
            rows.append(dict(row=row, error=f"not run: --deadline {args.deadline:.0f} s reached"))
            continue
        print(f"[{i}/{len(names)}] {row} ...", file=sys.stderr, flush=True)
        rows.append(spawn(row, args, min(args.timeout, left)))
        r = rows[-1]
        print(f"    {r.get('error') or 'ok'}: tok/s {r.get('tokens_per_s')}, first step {r.get('first_step_s')} s, "
              f"loss {r.get('loss')}", file=sys.stderr, flush=True)
        save(args.json, meta, rows)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    meta = dict(spec=args.spec, steps=args.steps, warmup=args.warmup, lr=args.lr, versions=versions(),
                date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                command="python3 benchmarks/training/hf_llama.py " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.row:  # one row, in this process (what the parent's children run)
        rows = [run_row(args.row, args.spec, args.steps, args.warmup, args.lr, args.device, args.t0 or PROCESS_START,
                        args.profile)]
    elif args.table:
        meta, rows = merge(args.table)
    else:
        rows = run_rows(args, meta)
    save(args.json, meta, rows)
    print(table(meta, rows))
    return 0 if args.row or any(r.get("tokens_per_s") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
