"""Training-step throughput of a Llama-style decoder in FP8, engine by engine, against bf16.

For each engine three ways of training the same model are timed, each in its own process so
that memory, compile caches and engine globals cannot leak from one run into the next:

  bf16      the plain model, bf16 weights, torch.compile, AdamW            (the baseline)
  fp8plug   fp8plug.Accelerator(mixed_precision="fp8",
            kwargs_handlers=[FP8RecipeKwargs(backend=...)]) + prepare + torch.compile, with every
            default, the speed filter (auto_filter) included: on an H100/H200 it converts every
            Linear of the probe and 1b models; FP8PLUG_AUTO_FILTER=false turns it off
  raw       the engine used directly, without fp8plug: torchao convert_to_float8_training;
            TransformerEngine te.Linear/te.RMSNorm under te.autocast(DelayedScaling ...);
            native NativeFP8Linear conversion under its autocast; msamp.initialize
  raw+autocast  (only if asked for in --paths) raw, also under torch.autocast(bf16), which the
            Accelerator adds for mixed_precision="fp8": it splits fp8plug's overhead into
            accelerate's autocast and the rest

Reported per run: tokens/s, ms per step, peak CUDA memory (torch.cuda.max_memory_allocated over
the timed steps), the final loss, and how many modules the engine converted; then the speed-up
over bf16 and fp8plug's overhead against the raw engine ((raw tokens/s / fp8plug tokens/s - 1),
in %). The output head stays in bf16 on every FP8 path (modules_to_ignore), as is usual.

    python3 benchmarks/training/train_step.py --model probe --out out/          # on a GPU
    python3 benchmarks/training/train_step.py --tiny --out /tmp/ts              # CPU smoke run

Models (fp8plug.bench.toy_model.TinyDecoder: pre-norm attention + SwiGLU MLP, RMSNorm):
  probe  4 layers, d=4096, ffn=16384, 32 heads, vocab 32000, B=4, T=2048 (the probe decoder)
  1b     16 layers, d=2048, ffn=8192, 16 heads, vocab 32000, B=4, T=2048 (about 1.2B parameters)
  tiny   2 layers, d=64, ffn=256, vocab 256, B=2, T=32 (CPU smoke)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train_step_te as raw_te  # noqa: E402  (this folder is on the path: the script's own)
from hf_llama_report import versions  # noqa: E402

MODELS = {
    "probe": dict(dim=4096, n_layers=4, n_heads=32, ffn_dim=16384, vocab_size=32000, batch=4, seq=2048),
    "1b": dict(dim=2048, n_layers=16, n_heads=16, ffn_dim=8192, vocab_size=32000, batch=4, seq=2048),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, ffn_dim=256, vocab_size=256, batch=2, seq=32),
}
PATHS = ("bf16", "fp8plug", "raw", "raw+autocast")
ENGINES = ("native", "ao", "te", "msamp")
IGNORE = ["decoder.lm_head"]
FP8_MODULE_PREFIXES = ("fp8plug.backends", "torchao.float8", "transformer_engine", "msamp")
RESULT_TAG = "TRAIN_STEP_RESULT "


# --- the model ------------------------------------------------------------------------------------


def build_model(spec: dict, device, dtype):
    """TinyDecoder wrapped so forward(tokens) returns the loss: the logits never leave the graph."""
    import torch
    from torch import nn

    from fp8plug.bench.toy_model import DecoderConfig, TinyDecoder, lm_loss

    class WithLoss(nn.Module):
        def __init__(self, decoder):
            super().__init__()
            self.decoder = decoder

        def forward(self, tokens):
            return lm_loss(self.decoder(tokens), tokens)

    cfg = DecoderConfig(vocab_size=spec["vocab_size"], dim=spec["dim"], n_layers=spec["n_layers"],
                        n_heads=spec["n_heads"], ffn_dim=spec["ffn_dim"], max_seq_len=spec["seq"])
    torch.manual_seed(0)
    with torch.device(device):
        model = WithLoss(TinyDecoder(cfg))
    return model.to(dtype).train()


def count_fp8_modules(model) -> int:
    """The FP8 engines' GEMM layers in `model` (their norms, TE's or the native engine's fused
    ones, hold no GEMM and are not counted)."""
    return sum(type(m).__module__.startswith(FP8_MODULE_PREFIXES) and not list(m.children())
               and not type(m).__name__.endswith("Norm") for m in model.modules())


def compile_model(model, how: str):
    """torch.compile the whole model, each decoder block (one compile reused by all blocks, as
    torchtitan does), or nothing. Returns what to call."""
    import torch

    if how == "none":
        return model
    if how == "blocks":
        for block in _blocks(model):
            block.compile()
        return model
    return torch.compile(model)


def _blocks(model):
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            return list(module)
    raise RuntimeError("no nn.ModuleList of blocks found to compile")


# --- the paths ------------------------------------------------------------------------------------


class Run:
    """A prepared training setup: call step() to train one step and get the loss."""

    def __init__(self, forward, backward, optimizer, context=None, model=None):
        self.forward, self.backward, self.optimizer = forward, backward, optimizer
        self.context, self.model = context, model

    def step(self, tokens):
        if self.context is None:
            loss = self.forward(tokens)
        else:
            with self.context():
                loss = self.forward(tokens)
        self.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def _adamw(model, device):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")


def setup(path: str, engine: str, scaling, spec: dict, device, dtype, compile_how: str) -> Run:
    """Build the model and its optimizer for one path, convert it, compile it."""
    import contextlib

    import torch

    if path == "raw+autocast":
        run = setup("raw", engine, scaling, spec, device, dtype, compile_how)
        inner = run.context

        def context():
            stack = contextlib.ExitStack()
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
            if inner is not None:
                stack.enter_context(inner())
            return stack

        run.context = context
        return run

    model = build_model(spec, device, dtype)
    plain_backward = lambda loss: loss.backward()  # noqa: E731
    if path == "bf16":
        optimizer = _adamw(model, device)
        return Run(compile_model(model, compile_how), plain_backward, optimizer, model=model)

    if path == "fp8plug":
        import fp8plug

        recipe = fp8plug.FP8RecipeKwargs(backend=engine, scaling=scaling, modules_to_ignore=IGNORE)
        accelerator = fp8plug.Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe],
                                          cpu=device.type == "cpu")
        optimizer = _adamw(model, device)
        model, optimizer = accelerator.prepare(model, optimizer)
        return Run(compile_model(model, compile_how), accelerator.backward, optimizer, model=model)

    # raw engines
    if engine == "native":
        from fp8plug.backends import get_backend
        from fp8plug.recipe.kwargs import FP8RecipeKwargs

        native = get_backend("native")
        recipe = FP8RecipeKwargs(backend="native", scaling=scaling, modules_to_ignore=IGNORE)
        native.convert(model, recipe)
        optimizer = _adamw(model, device)
        return Run(compile_model(model, compile_how), plain_backward, optimizer,
                   context=lambda: native.autocast(recipe, enabled=True), model=model)
    if engine == "ao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(scaling or "tensorwise")
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn not in IGNORE)
        optimizer = _adamw(model, device)
        return Run(compile_model(model, compile_how), plain_backward, optimizer, model=model)
    if engine == "te":
        te_recipe = raw_te.recipe(scaling or "delayed")
        raw_te.swap_modules(model, dtype, IGNORE)
        optimizer = _adamw(model, device)
        return Run(compile_model(model, compile_how), plain_backward, optimizer,
                   context=lambda: raw_te.autocast(te_recipe), model=model)
    if engine == "msamp":
        import msamp

        optimizer = _adamw(model, device)
        model, optimizer = msamp.initialize(model, optimizer, opt_level="O2")
        return Run(compile_model(model, compile_how), plain_backward, optimizer, model=model)
    raise ValueError(f"unknown engine {engine!r}")


# --- one run (in a child process) ---------------------------------------------------------------------


def run_one(config: dict) -> dict:
    """Time one path. If it fails compiled, it is tried once more uncompiled and the row says so
    (TransformerEngine's modules, for one, are not all torch.compile-friendly)."""
    result = dict(path=config["path"], engine=config["engine"], scaling=config["scaling"],
                  label=config["label"], tokens_per_s=None, step_ms=None, peak_mem_gb=None,
                  fp8_modules=None, loss=None, compile=config["compile"], error=None)
    try:
        result.update(_measure(config, config["compile"]))
        return result
    except Exception as exc:  # noqa: BLE001 - a failing engine is a row with its reason
        result["error"] = _reason(exc)
        result["traceback"] = traceback.format_exc(limit=6)
    if config["compile"] != "none" and not config.get("no_fallback"):
        _free()
        first_error = result["error"]
        try:
            result.update(_measure(config, "none"), compile="none",
                          error=f"ran eager: compiled ({config['compile']}) failed with {first_error}")
            result.pop("traceback", None)
        except Exception as exc:  # noqa: BLE001
            result["error"] = f"{first_error}; eager too: {_reason(exc)}"
    return result


def _reason(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {first}"


def _free():
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measure(config: dict, compile_how: str) -> dict:
    """Warm-up steps (compilation happens there), then timed steps; raises on any failure."""
    import torch

    spec = config["spec"]
    device = torch.device(config["device"])
    dtype = getattr(torch, config["dtype"])
    out = {}
    run = setup(config["path"], config["engine"], config["scaling"], spec, device, dtype, compile_how)
    out["fp8_modules"] = count_fp8_modules(run.model)
    if config["path"] != "bf16" and out["fp8_modules"] == 0:
        raise RuntimeError("no module was converted to FP8")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec["vocab_size"], (spec["batch"], spec["seq"]), generator=g).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(config["warmup"]):
        run.step(tokens)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(config["steps"]):
        loss = run.step(tokens)
    sync()
    elapsed = time.perf_counter() - start
    out["step_ms"] = elapsed / config["steps"] * 1e3
    out["tokens_per_s"] = spec["batch"] * spec["seq"] * config["steps"] / elapsed
    out["loss"] = float(loss.detach().float())
    if device.type == "cuda":
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    if not math.isfinite(out["loss"]):
        raise FloatingPointError(f"loss is {out['loss']} after {config['warmup'] + config['steps']} steps")
    return out


def run_child(config: dict, timeout: float) -> dict:
    """run_one in a fresh Python process; a crash or timeout becomes an error row."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", json.dumps(config)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return _failed(config, f"timed out after {timeout:.0f} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    return _failed(config, f"process exited {proc.returncode}: {tail[-300:]}")


def _failed(config: dict, why: str) -> dict:
    return dict(path=config["path"], engine=config["engine"], scaling=config["scaling"],
                label=config["label"], tokens_per_s=None, step_ms=None, peak_mem_gb=None,
                fp8_modules=None, loss=None, compile=config["compile"], error=why)


# --- the parent -----------------------------------------------------------------------------------


def parse_engines(text: str):
    """`native,ao:rowwise,te:current` -> [(engine, scaling or None), ...]."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        name, _, scaling = part.partition(":")
        if name == "torchao":
            name = "ao"
        if name not in ENGINES:
            raise SystemExit(f"--engines: unknown engine {name!r}; use {', '.join(ENGINES)} (optionally name:scaling).")
        out.append((name, scaling or None))
    return out


def unavailable_reason(engine: str, device) -> str:
    """Why `engine` cannot run here ('' if it can), from fp8plug's own judgement."""
    from fp8plug.backends import judge
    from fp8plug.tuning.hardware import device_info

    verdict = judge(engine, device_info(device))
    return "" if verdict.usable else verdict.reason


def summarize(rows: list) -> list:
    """Add speed-up over bf16 and fp8plug's overhead against the raw engine to each row."""
    base = next((r["tokens_per_s"] for r in rows if r["path"] == "bf16" and r["tokens_per_s"]), None)
    raw = {(r["engine"], r["scaling"]): r["tokens_per_s"] for r in rows if r["path"] == "raw" and r["tokens_per_s"]}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base if base and r["tokens_per_s"] else None
        ref = raw.get((r["engine"], r["scaling"]))
        r["overhead_pct"] = ((ref / r["tokens_per_s"] - 1) * 100
                             if r["path"] == "fp8plug" and ref and r["tokens_per_s"] else None)
    return rows


def markdown(meta: dict, rows: list) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [
        f"# Training step: {meta['model']} ({meta['params_m']:.4g}M parameters, B={meta['batch']}, T={meta['seq']})",
        "",
        f"Device: {meta['device']}; torch {meta['torch']}; compile: {meta['compile']}; "
        f"{meta['steps']} timed steps after {meta['warmup']} warm-up; {meta['date_utc']}.",
        f"Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items()) or '-'}.",
        f"Command: `{meta['command']}`",
        "",
        "| run | tokens/s | ms/step | vs bf16 | peak GB | FP8 modules | overhead vs raw | loss | compile | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        overhead = "-" if r["overhead_pct"] is None else f"{r['overhead_pct']:+.1f}%"
        note = (r["error"] or "").replace("|", "/")
        lines.append(
            f"| {r['label']} | {f(r['tokens_per_s'], ',.0f')} | {f(r['step_ms'], '.1f')} | {speedup} | "
            f"{f(r['peak_mem_gb'], '.2f')} | {f(r['fp8_modules'], 'd')} | {overhead} | {f(r['loss'], '.3f')} | "
            f"{r.get('compile', '-')} | {note} |"
        )
    lines += ["", "overhead vs raw = raw engine tokens/s / fp8plug tokens/s - 1 (positive: fp8plug slower)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="probe")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: --model tiny, 2 steps, no compile")
    parser.add_argument("--engines", default="native,ao,te,msamp",
                        help="comma list of engine[:scaling]; engines that cannot run here get a row saying why")
    parser.add_argument("--paths", default="bf16,fp8plug,raw",
                        help="which of bf16, fp8plug, raw, raw+autocast to run (default: the first three)")
    parser.add_argument("--compile", choices=("model", "blocks", "none"), default=None,
                        help="torch.compile the whole model, each block, or nothing (default: blocks on a GPU, "
                             "none with --tiny)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --tiny)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="out/train_step", help="folder for train_step.json and train_step.md")
    parser.add_argument("--no-subprocess", action="store_true",
                        help="run every path in this process (debugging, tests)")
    parser.add_argument("--timeout", type=float, default=540, help="seconds allowed per run")
    parser.add_argument("--no-fallback", action="store_true",
                        help="a run that fails compiled is an error, instead of being retried uncompiled")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._child:
        print(RESULT_TAG + json.dumps(run_one(json.loads(args._child))), flush=True)
        return 0

    import torch

    model_name = "tiny" if args.tiny else args.model
    spec = dict(MODELS[model_name])
    spec["batch"] = args.batch or spec["batch"]
    spec["seq"] = args.seq or spec["seq"]
    device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda"))
    compile_how = args.compile or ("none" if args.tiny or device.type == "cpu" else "blocks")
    steps = args.steps or (2 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise SystemExit(f"--paths: unknown {bad}; use {', '.join(PATHS)}.")
    engines = parse_engines(args.engines)

    configs, rows = [], []
    if steps < 1 or warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0.")
    base = dict(spec=spec, device=str(device), dtype="bfloat16", compile=compile_how, steps=steps, warmup=warmup,
                no_fallback=args.no_fallback)
    if "bf16" in paths:
        configs.append(dict(base, path="bf16", engine=None, scaling=None, label="bf16"))
    for engine, scaling in engines:
        why = unavailable_reason(engine, device)
        for path in (p for p in PATHS[1:] if p in paths):
            label = f"{path} {engine}" + (f":{scaling}" if scaling else "")
            config = dict(base, path=path, engine=engine, scaling=scaling, label=label)
            if why:
                rows.append(_failed(config, f"unavailable: {why}"))
            else:
                configs.append(config)
    for i, config in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {config['label']} ...", file=sys.stderr, flush=True)
        result = run_one(config) if args.no_subprocess else run_child(config, args.timeout)
        if result.get("error"):
            print(f"    {result['error']}", file=sys.stderr, flush=True)
            if result.get("traceback"):
                print(result["traceback"], file=sys.stderr, flush=True)
        rows.append(result)
    engine_order = {name: i for i, (name, _) in enumerate(engines)}
    rows.sort(key=lambda r: (r["path"] != "bf16", engine_order.get(r["engine"], -1), r["scaling"] or "",
                             PATHS.index(r["path"])))
    summarize(rows)

    n_params = _count_params(spec)
    meta = dict(
        model=model_name, params_m=n_params / 1e6, batch=spec["batch"], seq=spec["seq"], spec=spec,
        device=(torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"),
        torch=torch.__version__, versions=versions(), compile=compile_how, steps=steps, warmup=warmup,
        dtype="bfloat16", date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        command="python3 benchmarks/training/train_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("traceback", None)
    (out / "train_step.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    text = markdown(meta, rows)
    (out / "train_step.md").write_text(text)
    print(text)
    return 0 if any(r["tokens_per_s"] for r in rows) else 1


def _count_params(spec: dict) -> int:
    d, f, v, n = spec["dim"], spec["ffn_dim"], spec["vocab_size"], spec["n_layers"]
    return n * (4 * d * d + 3 * d * f + 2 * d) + 2 * v * d + spec["seq"] * d + d


if __name__ == "__main__":
    sys.exit(main())
