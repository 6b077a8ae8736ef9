"""What benchmarks/distributed/fsdp2_llama.py trains and evaluates on: hf_llama_task's synthetic
task, or with --data text windows of real text (benchmarks/training/real_text.py's corpus and
tokenizer), and the held-out loss the --data text rows are compared by.

A module of its own so that fsdp2_llama.py holds the rows and how each strategy runs them. The
parent makes the corpus once (`text_dir`, `text_spec`); each rank reads its own windows.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hf_llama_task import make_batches

TEXT_CACHE = Path(tempfile.gettempdir()) / "fp8plug_fsdp2_text"
HELDOUT_BATCHES = 8  # --data text: held-out batches each data-parallel rank evaluates after training


def train_batches(spec: dict, args, rank: int):
    """The batches of data-parallel rank `rank`, (steps, batch, seq) token ids: hf_llama_task's
    synthetic task, or with --data text windows of real text (benchmarks/training/real_text.py's
    corpus of site-packages sources and its BPE tokenizer, made once by the parent in --text-cache),
    each rank its own seed."""
    import torch

    if args.data == "synthetic":
        return make_batches(spec, args.steps, seed=1234 + rank)
    return torch.stack(text_windows(spec, args, "train", args.steps, seed=1234 + rank))


def text_windows(spec: dict, args, name: str, count: int, seed: int) -> list:
    """`count` (batch, seq) windows of --data text's token file `name` ("train", "heldout"), from
    a seeded generator (real_text.batches, whose windows carry one more token, cut off here)."""
    from real_text import batches

    return [w[:, :spec["seq"]] for w in batches(text_dir(args), name, count, spec, seed=seed)]


def text_spec(args) -> dict:
    """real_text.prepare_data's spec for --data text: its tokenizer's vocabulary fills the model's
    up to 32000 (the token files hold uint16)."""
    return dict(vocab=min(args.spec["vocab"], 32000), budget_mb=args.text_mb, tokenizer_mb=max(1, args.text_mb // 5))


def text_dir(args) -> Path:
    """Where --data text's tokenizer and token files are: one folder per vocabulary and text size."""
    spec = text_spec(args)
    return Path(args.text_cache) / f"v{spec['vocab']}_{spec['budget_mb']}mb"


def heldout_loss(model, spec: dict, args, device, dp_rank: int) -> float:
    """--data text: the trained model's mean loss on held-out text (real_text.py's held-out file;
    HELDOUT_BATCHES batches a data-parallel rank, the same in every row), averaged over the ranks.
    Every row evaluates in eval mode, where FP8 rows run in high precision as bf16 rows do (the
    weights are compared, not the arithmetic), and outside torch.compile's wrapper, which would
    compile the model again for eval mode. A step's training loss is one batch's, rounded to bf16:
    too noisy at a few hundred steps to tell 1% apart."""
    import torch

    inner = getattr(model, "_orig_mod", model)
    windows = [w.to(device) for w in text_windows(spec, args, "heldout", HELDOUT_BATCHES, seed=4321 + dp_rank)]
    inner.eval()
    with torch.no_grad():
        loss = torch.stack([inner(input_ids=w, labels=w).loss.float() for w in windows]).mean()
    inner.train()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(loss)
        loss /= torch.distributed.get_world_size()
    return loss.item()
