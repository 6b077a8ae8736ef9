"""A small Llama-style decoder-only LM, for the demo, the tests and the benchmarks.

Every projection is an nn.Linear (so every engine has something to convert) and every width is a
multiple of 16 by default. The output head (`lm_head`, the most sensitive layer) stays in high
precision by default, through fp8plug.Accelerator and convert_model alike
(FP8RecipeKwargs.fp8_output_head); some examples name it in `modules_to_ignore=["lm_head"]` as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DecoderConfig:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 512
    max_seq_len: int = 256
    norm: str = "rms"  # "rms" or "layer"


def _norm(cfg: DecoderConfig) -> nn.Module:
    return nn.RMSNorm(cfg.dim) if cfg.norm == "rms" else nn.LayerNorm(cfg.dim)


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.attn_norm = _norm(cfg)
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = _norm(cfg)
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyDecoder(nn.Module):
    """Embedding, `n_layers` pre-norm blocks (attention + SwiGLU MLP), final norm, LM head."""

    def __init__(self, cfg: DecoderConfig = DecoderConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def synthetic_batches(n: int, batch: int, seq: int, vocab: int, seed: int = 0, device="cpu"):
    """A learnable token stream with a noise floor: each sequence counts up from a random start
    with a random stride, modulo the vocabulary, and one token in ten is replaced by a random one.
    The loss falls well below log(vocab) within a hundred steps but stays clear of zero, so
    relative comparisons between runs mean something."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 8, (batch, 1), generator=g)
        tokens = (start + stride * torch.arange(seq)) % vocab
        noise = torch.rand(batch, seq, generator=g) < 0.1
        tokens = torch.where(noise, torch.randint(0, vocab, (batch, seq), generator=g), tokens)
        out.append(tokens.to(device))
    return out
