"""FP8 against bf16 on real text, from scratch, offline: does FP8 training track bf16 over thousands of steps?

The text is what every machine with Python has and nobody here wrote: the source and documentation
files (.py, .md, .rst, .txt) of the installed packages under site-packages, read in sorted path
order up to a byte budget, split by file (about 1 file in 20, by a hash of its path, is held
out). A byte-level BPE tokenizer (vocab 32000, the `tokenizers` package) is trained on part of the
training files; the token streams are cached (--cache-dir), so rows and reruns share them. The
corpus's fingerprint (files, bytes, a hash of the file list) is recorded: another machine's
packages give another corpus.

A transformers LlamaForCausalLM (~160M parameters: hidden 768, 12 layers, 12 heads, FFN 3072,
vocab 32000, sequence 1024, batch 4: 4k tokens a step, 12M tokens in 3000 steps) is trained from
the same initial weights on the same batches in every row: AdamW (0.9, 0.95, weight decay 0.1),
warm-up then cosine, gradients clipped at 1.0, bf16 autocast through the Accelerator,
`torch.compile(model)` after prepare (--no-compile: eager). Every --eval-every steps the loss on a
fixed set of held-out batches.

Rows, each its own process (fresh inductor/triton caches):
  bf16                accelerate.Accelerator(mixed_precision="bf16")
  fp8plug-default     fp8plug.Accelerator(mixed_precision="fp8"), its default recipe (the LM head in
                      bf16, as Accelerate's torchao filter and Megatron's first_last_layers_bf16 keep it)
  fp8plug-fp8head     the default with the LM head in FP8 too (fp8_output_head=True)
  fp8plug-rowwise     FP8RecipeKwargs(backend="native", scaling="rowwise")
  fp8plug-blockwise   FP8RecipeKwargs(backend="native", scaling="blockwise")
  te-delayed          FP8RecipeKwargs(backend="te") (TransformerEngine's delayed scaling)
  accelerate-ao       accelerate.Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(...)])
The fp8plug and te rows set auto_filter=False: every Linear but the LM head runs in FP8, which is
what this benchmark measures (at hidden 768 the automatic speed filter would keep them in bf16,
FP8 being slower there; with it on, the te row would run only its MLPs and head in FP8 and its
attention in bf16). A row whose recipe this fp8plug lacks, or whose engine
is not installed, is an error row saying why. --watch-interval N turns fp8plug's numerics watch
on in the fp8plug rows (its cost shows in `watch_step_ms` against `step_ms`).

Each row writes <out-dir>/<row>.json: the train loss of every step, the eval curve, tokens/s
(from the median step time, eval steps left out), and the loss spikes (a step whose loss exceeds
the median of the previous 50 by 10%). `--plot` reads them and writes the PNG and the markdown
table (final held-out loss against bf16's, spikes bf16 does not have, tokens/s).

    python3 benchmarks/training/real_text.py --device cpu --tiny --out-dir /tmp/rt      # smoke, < 60 s
    python3 benchmarks/training/real_text.py --out-dir $OUT/real_text --parallel       # one GPU per row
    python3 benchmarks/training/real_text.py --plot --out-dir out/real_text --png docs/real_text.png

One seed cannot settle a fraction of a percent (bf16 runs of one seed end up to 0.8% apart): run
`--seed N` for several N and sum them up with benchmarks/training/real_text_seeds.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROWS = ("bf16", "fp8plug-default", "fp8plug-fp8head", "fp8plug-rowwise", "fp8plug-blockwise", "te-delayed",
        "accelerate-ao")
SUFFIXES = (".py", ".md", ".rst", ".txt")
FULL = dict(hidden=768, layers=12, heads=12, ffn=3072, seq=1024, batch=4, vocab=32000, budget_mb=40,
            tokenizer_mb=8, steps=3000, eval_every=250, eval_batches=20, warmup=200, lr=6e-4, seed=0)
TINY = dict(hidden=64, layers=2, heads=4, ffn=128, seq=64, batch=4, vocab=512, budget_mb=2, tokenizer_mb=1,
            steps=30, eval_every=10, eval_batches=2, warmup=5, lr=3e-3, seed=0)
SPIKE_WINDOW, SPIKE_RATIO = 50, 1.10
SPIKE_MATCH = 5  # steps: a spike this close to another run's is the same spike (the same batches)


# --- the corpus and its tokens -------------------------------------------------------------------------


def text_files(budget: int):
    """(path, relative name) of site-packages' text files in sorted order, up to `budget` bytes."""
    import site
    import sysconfig

    roots = sorted({p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if os.path.isdir(p)})
    total = 0
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                if not name.endswith(SUFFIXES):
                    continue
                path = os.path.join(folder, name)
                size = os.path.getsize(path)
                if not 0 < size <= 1 << 20:
                    continue
                yield path, os.path.relpath(path, root)
                total += size
                if total >= budget:
                    return


def held_out(relative: str) -> bool:
    return int(hashlib.md5(relative.encode()).hexdigest(), 16) % 20 == 0


def prepare_data(cache: Path, spec: dict) -> dict:
    """Tokenizer and token files in `cache` (made once); returns the corpus's description."""
    meta_path = cache / f"meta_v{spec['vocab']}_{spec['budget_mb']}mb.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cache.mkdir(parents=True, exist_ok=True)
    train, held, names = [], [], hashlib.sha256()
    for path, relative in text_files(spec["budget_mb"] << 20):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (held if held_out(relative) else train).append(text)
        names.update(relative.encode())
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec["vocab"], special_tokens=["<|eof|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    limit, part, used = spec["tokenizer_mb"] << 20, [], 0
    for text in train[::3]:  # a third of the training files, spread over the corpus
        if used >= limit:
            break
        part.append(text)
        used += len(text)
    tokenizer.train_from_iterator(part, trainer)
    tokenizer.save(str(cache / "tokenizer.json"))
    eof = tokenizer.token_to_id("<|eof|>")
    counts = {}
    for name, texts in (("train", train), ("heldout", held)):
        ids = []
        for start in range(0, len(texts), 2048):
            for encoding in tokenizer.encode_batch(texts[start:start + 2048]):
                ids.extend(encoding.ids)
                ids.append(eof)
        np.asarray(ids, dtype=np.uint16).tofile(cache / f"{name}.bin")
        counts[name] = len(ids)
    meta = dict(files=len(train) + len(held), heldout_files=len(held), bytes=sum(map(len, train + held)),
                file_list_sha256=names.hexdigest(), train_tokens=counts["train"], heldout_tokens=counts["heldout"],
                vocab=spec["vocab"], python=sys.version.split()[0])
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


def batches(cache: Path, name: str, count: int, spec: dict, seed: int):
    """`count` (batch, seq + 1) windows of token file `name`, from a seeded generator: the same in every row."""
    import numpy as np
    import torch

    tokens = np.memmap(cache / f"{name}.bin", dtype=np.uint16, mode="r")
    span = spec["seq"] + 1
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - span, size=(count, spec["batch"]))
    return [torch.from_numpy(np.stack([tokens[s:s + span] for s in row]).astype(np.int64)) for row in starts]


# --- one row ----------------------------------------------------------------------------------------


def accelerator_for(row: str, watch: int):
    """The Accelerator of `row`, or raise ValueError / BackendUnavailableError saying why not."""
    import accelerate

    if row == "bf16":
        return accelerate.Accelerator(mixed_precision="bf16")
    if row == "accelerate-ao":
        handler = accelerate.utils.AORecipeKwargs(enable_fsdp_float8_all_gather=False)
        return accelerate.Accelerator(mixed_precision="fp8", kwargs_handlers=[handler])
    import fp8plug

    options = {"fp8plug-default": {}, "fp8plug-fp8head": dict(fp8_output_head=True),
               "fp8plug-rowwise": dict(backend="native", scaling="rowwise"),
               "fp8plug-blockwise": dict(backend="native", scaling="blockwise"), "te-delayed": dict(backend="te")}[row]
    options["auto_filter"] = False  # every Linear in FP8 (the docstring says why)
    if watch:
        options["numerics_watch_interval"] = watch
    return fp8plug.Accelerator(mixed_precision="fp8", kwargs_handlers=[fp8plug.FP8RecipeKwargs(**options)])


def spikes(losses: list) -> list:
    """Steps whose loss exceeds the median of the previous SPIKE_WINDOW losses by SPIKE_RATIO."""
    import statistics

    return [i for i in range(SPIKE_WINDOW, len(losses))
            if losses[i] > SPIKE_RATIO * statistics.median(losses[i - SPIKE_WINDOW:i])]


def spikes_not_in(mine: list, theirs: list) -> list:
    """The steps of `mine` (spike steps) with no step of `theirs` within SPIKE_MATCH steps: spikes one
    run has that another run of the same batches has not."""
    return [s for s in mine if not any(abs(s - t) <= SPIKE_MATCH for t in theirs)]


def run_row(row: str, args, spec: dict, deadline: float) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cache = Path(args.cache_dir)
    result = dict(row=row, spec=spec, corpus=json.loads(next(cache.glob("meta_*.json")).read_text()))
    accelerator = accelerator_for(row, args.watch_interval)
    device = accelerator.device
    result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    torch.manual_seed(spec["seed"])
    config = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["ffn"],
                         num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                         num_key_value_heads=spec["heads"], max_position_embeddings=spec["seq"],
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device)
    result["params"] = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)],
                                  lr=spec["lr"], betas=(0.9, 0.95), fused=device.type == "cuda")
    steps, warmup = spec["steps"], spec["warmup"]

    def lr_at(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if args.compile:
        model = torch.compile(model)
    train = batches(cache, "train", steps, spec, seed=1 + 7919 * spec["seed"])
    evals = [b.to(device) for b in batches(cache, "heldout", spec["eval_batches"], spec, seed=2)]

    def evaluate():
        model.eval()
        with torch.no_grad():
            total = sum(float(model(input_ids=b[:, :-1], labels=b[:, :-1]).loss) for b in evals)
        model.train()
        return total / len(evals)

    losses, times, watch_times, curve = [], [], [], []
    watching = bool(args.watch_interval) and row not in ("bf16", "accelerate-ao")
    model.train()
    for step in range(steps):
        if time.time() > deadline:
            result["stopped_early"] = f"deadline after {step} steps"
            break
        batch = train[step].to(device, non_blocking=True)
        start = time.perf_counter()
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # synchronises: the step's time is its own
        elapsed = time.perf_counter() - start
        watched = watching and (step + 1) % args.watch_interval == 0
        (watch_times if watched else times).append(elapsed)
        if (step + 1) % spec["eval_every"] == 0 or step + 1 == steps:
            curve.append((step + 1, evaluate()))
        if not math.isfinite(losses[-1]):
            result["diverged_at"] = step
            break
    tokens = spec["batch"] * spec["seq"]
    steady = sorted(times[min(20, len(times) // 2):]) or sorted(times)
    step_s = steady[len(steady) // 2] if steady else None
    result.update(train_loss=losses, eval_curve=curve, final_eval_loss=curve[-1][1] if curve else None,
                  step_ms=1e3 * step_s if step_s else None, tokens_per_s=tokens / step_s if step_s else None,
                  watch_step_ms=1e3 * sum(watch_times) / len(watch_times) if watch_times else None,
                  watch_steps_ms=[round(1e3 * t, 1) for t in watch_times],  # each check's own time
                  spikes=spikes(losses), steps_done=len(losses))
    if hasattr(accelerator, "fp8_coverage"):
        result["engine"] = accelerator.fp8_engine.name if accelerator.fp8_engine is not None else None
        coverage = accelerator.fp8_coverage()
        result.update(fp8_gemms=coverage["fp8_gemms"], high_precision_gemms=coverage["high_precision_gemms"],
                      moved=coverage.get("moved", {}))
    return result


def row_main(args) -> int:
    spec = json.loads(args.spec)
    out = Path(args.out_dir) / f"{args.row}.json"
    try:
        result = run_row(args.row, args, spec, args.deadline_at)
    except Exception as exc:  # noqa: BLE001 - a row that cannot run is a row with its reason
        traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0][:400]
        result = dict(row=args.row, spec=spec, error=f"{type(exc).__name__}: {first}")
    out.write_text(json.dumps(result))
    return 0


# --- the parent -----------------------------------------------------------------------------------------


def spawn(row: str, args, spec: dict, deadline: float, gpu=None) -> subprocess.Popen:
    tmp = tempfile.mkdtemp(prefix=f"rt_{row}_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor", TRITON_CACHE_DIR=f"{tmp}/triton",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["ACCELERATE_USE_CPU"] = "true"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", row, "--spec", json.dumps(spec),
           "--out-dir", args.out_dir, "--cache-dir", args.cache_dir, "--deadline-at", str(deadline),
           "--watch-interval", str(args.watch_interval)] + ([] if args.compile else ["--no-compile"])
    return subprocess.Popen(cmd, env=env, cwd=str(ROOT), start_new_session=True)


def run_rows(args, spec: dict) -> None:
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    began = time.time()
    meta = prepare_data(Path(args.cache_dir), spec)
    print(f"corpus ({time.time() - began:.0f} s): {meta}", flush=True)
    if args.prepare_only:
        return
    end = time.time() + args.timeout
    deadline = end - 30  # rows stop stepping here and still write their JSON
    rows = args.rows.split(",")
    count = 1
    if args.parallel:
        import torch

        count = max(1, torch.cuda.device_count())

    def run_queue(gpu: int) -> None:
        """GPU `gpu`'s share of the rows (every count-th), one after another."""
        for row in rows[gpu::count]:
            proc = spawn(row, args, spec, deadline, gpu=gpu if args.parallel else None)
            try:
                proc.wait(timeout=max(1.0, end - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            path = Path(args.out_dir) / f"{row}.json"
            if not path.exists():
                path.write_text(json.dumps(dict(row=row, error="timed out")))
            result = json.loads(path.read_text())
            print(f"{row}: {result.get('error') or describe(result)}", flush=True)

    threads = [threading.Thread(target=run_queue, args=(gpu,)) for gpu in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def describe(result: dict) -> str:
    tok = result.get("tokens_per_s")
    return (f"final eval loss {result.get('final_eval_loss')}, {result.get('steps_done')} steps, "
            f"{tok:.0f} tok/s, spikes {len(result.get('spikes', []))}" if tok else json.dumps(result)[:200])


# --- the plot and the table --------------------------------------------------------------------------------


def load(out_dir: str) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("*.json"))}


def table(results: dict) -> str:
    """The markdown table: each row's final held-out loss against bf16's, its spikes that bf16 has
    not (within 5 steps), and its tokens/s."""
    base = results.get("bf16", {})
    base_loss, base_spikes = base.get("final_eval_loss"), base.get("spikes", [])
    base_tok = base.get("tokens_per_s")
    lines = ["| row | steps | final held-out loss | vs bf16 | spikes bf16 has not | tokens/s | vs bf16 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in [r for r in ROWS if r in results] + [r for r in results if r not in ROWS]:
        r = results[row]
        if r.get("error"):
            lines.append(f"| {row} | - | - | - | - | - | {r['error'][:120]} |")
            continue
        loss, tok = r.get("final_eval_loss"), r.get("tokens_per_s")
        rel = f"{100 * (loss / base_loss - 1):+.2f}%" if loss and base_loss else "-"
        own = spikes_not_in(r.get("spikes", []), base_spikes)
        speed = f"{tok / base_tok:.2f}x" if tok and base_tok else "-"
        lines.append(f"| {row} | {r.get('steps_done')} | {loss:.4f} | {rel} | {len(own)} | "
                     f"{tok:,.0f} | {speed} |" if loss is not None and tok else f"| {row} | {r.get('steps_done')} | "
                     f"- | - | {len(own)} | - | - |")
    return "\n".join(lines)


def plot(results: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row, r in results.items():
        if r.get("error") or not r.get("eval_curve"):
            continue
        steps, values = zip(*r["eval_curve"])
        left.plot(steps, values, marker="o", markersize=3, label=row)
        train = r["train_loss"]
        k = 25
        smooth = [sum(train[max(0, i - k):i + 1]) / len(train[max(0, i - k):i + 1]) for i in range(len(train))]
        right.plot(range(1, len(smooth) + 1), smooth, linewidth=1, label=row)
    left.set(title="held-out loss", xlabel="step", ylabel="loss")
    right.set(title="training loss (mean of 25 steps)", xlabel="step")
    left.legend()
    left.grid(alpha=0.3)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the CPU smoke size (TINY)")
    p.add_argument("--steps", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--budget-mb", type=int, help="bytes of text read from site-packages")
    p.add_argument("--seed", type=int, help="the initial weights' and the training batches' seed (default 0); "
                   "the held-out batches stay the same")
    p.add_argument("--out-dir", default="real_text_out")
    p.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "fp8plug_real_text"))
    p.add_argument("--timeout", type=float, default=540.0, help="seconds for the whole run (rows stop early)")
    p.add_argument("--parallel", action="store_true", help="rows at once, one GPU each")
    p.add_argument("--watch-interval", type=int, default=0, help="fp8plug rows: numerics_watch_interval")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--prepare-only", action="store_true", help="make the tokenizer and token files, then stop")
    p.add_argument("--plot", action="store_true", help="read --out-dir's JSONs, write --png and the table")
    p.add_argument("--png", default="docs/real_text.png")
    p.add_argument("--row")
    p.add_argument("--spec")
    p.add_argument("--deadline-at", type=float, default=math.inf)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.row:
        return row_main(args)
    if args.plot:
        results = load(args.out_dir)
        plot(results, args.png)
        print(table(results))
        return 0
    spec = dict(TINY if args.tiny else FULL)
    for key in ("steps", "eval_every", "batch", "budget_mb", "seed"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if args.tiny:
        args.compile = False if args.device == "cpu" else args.compile
        if args.rows == ",".join(ROWS):
            args.rows = "bf16,fp8plug-default,fp8plug-blockwise"
        args.cache_dir = args.cache_dir + "_tiny"
    run_rows(args, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
