"""How benchmarks/training/hf_llama.py reports its rows: each row's ratios to the reference row,
the markdown table, the software versions every benchmark here records, and the --json files
(written after each row, merged with --table).

A module of its own so that hf_llama.py holds the rows and how they run; `versions` is also what
train_step.py, moe_llm.py and fsdp2_llama.py record.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_llama_task import loss_floor

REFERENCES = ("bf16-compiled", "bf16-eager", "bf16-trainer")  # the first with numbers is the ratios' base


def summarize(rows: list) -> str:
    """Add `speedup` and `loss_vs_ref_pct` against the reference row to each row; return its name."""
    ok = {r["row"]: r for r in rows if r.get("tokens_per_s")}
    reference = next((name for name in REFERENCES if name in ok), None)
    for r in rows:
        ref = ok.get(reference)
        good = ref is not None and r.get("tokens_per_s")
        r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"] if good else None
        r["loss_vs_ref_pct"] = (r["loss"] / ref["loss"] - 1) * 100 if good and r.get("loss") else None
    return reference


def table(meta: dict, rows: list) -> str:
    """The model, the device and versions, then one markdown line per row."""
    def f(value, spec, suffix=""):
        return "-" if value is None else format(value, spec) + suffix

    s = meta["spec"]
    ref = meta.get("reference") or "bf16"
    backend = s.get("compile_backend", "inductor")
    lines = [
        f"LlamaForCausalLM: {s['layers']} layers, hidden {s['hidden']}, intermediate {s['intermediate']}, "
        f"{s['heads']} heads / {s['kv_heads']} KV, vocab {s['vocab']}; batch {s['batch']} x {s['seq']} tokens; "
        f"{meta['steps']} steps ({meta['warmup']} warm-up), loss floor {loss_floor(s):.3f}"
        + (f"; PEFT LoRA r={s['lora']} on every projection, base frozen" if s.get("lora") else "")
        + ("; Liger kernels (apply_liger_kernel_to_llama defaults: RoPE, RMSNorm, SwiGLU, fused linear "
           "cross-entropy)" if s.get("liger") else "")
        + (f"; torch.compile backend {backend}" if backend != "inductor" else ""),
        f"{meta.get('device') or '-'}; " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "",
        f"| row | engine | tok/s | vs {ref} | peak GB | first step s | warm-up s | loss | loss vs {ref} | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        note = (r.get("error") or "").replace("|", "/")
        if r.get("params_not_stepped"):
            note = f"{r['params_not_stepped'] / 1e6:.1f}M parameters not in the optimizer (never updated) {note}"
        lines.append(
            f"| {r['row']} | {r.get('engine') or '-'} | {f(r.get('tokens_per_s'), ',.0f')} | "
            f"{f(r.get('speedup'), '.2f', 'x')} | {f(r.get('peak_gb'), '.1f')} | "
            f"{f(r.get('first_step_s'), '.1f')} | {f(r.get('warm_s'), '.1f')} | {f(r.get('loss'), '.4f')} | "
            f"{f(r.get('loss_vs_ref_pct'), '+.2f', '%')} | {note.strip()} |")
    return "\n".join(lines) + "\n"


def versions() -> dict:
    """Python's version and each installed package's a row's numbers depend on."""
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "accelerate", "torchao", "transformer_engine", "msamp", "peft",
                 "liger-kernel"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def merge(paths: list):
    """The rows of several --json files: per row the last one with numbers, else the last one."""
    meta, rows = None, {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta = meta or data["meta"]
        for r in data["rows"]:
            if r.get("tokens_per_s") or not rows.get(r["row"], {}).get("tokens_per_s"):
                rows[r["row"]] = r
    meta["command"] = f"{meta['command']} (merged: {', '.join(map(str, paths))})"
    return meta, list(rows.values())


def save(path, meta: dict, rows: list) -> None:
    meta["device"] = next((r["device"] for r in rows if r.get("device")), meta.get("device"))
    meta["reference"] = summarize(rows)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
