"""A small GPT of your own, trained on a token file: the bytes of any text file (no tokenizer to download).

    python examples/gpt/prepare.py README.md /tmp/gpt        # -> /tmp/gpt/train.bin, /tmp/gpt/val.bin
    PYTHONPATH=examples/gpt python -m job train workload=task:workload \
        data.kind=tokens data.path=/tmp/gpt/train.bin data.val_path=/tmp/gpt/val.bin eval.every=50

Everything the job needs is in this file: the settings (workload.layers=4, workload.d_model=128 ...), the
model, the loss, random batches for the memory plan, the token file (job.datasets.TokenFile) and the blocks
that fsdp shards and activation checkpointing recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from job.datasets import TokenFile
from job.workload import Workload


@dataclass
class Settings:
    layers: int = 2
    """Transformer blocks."""
    d_model: int = 64
    """Hidden size."""
    heads: int = 4
    """Attention heads (divide d_model)."""
    seq_len: int = 64
    """Tokens per sample."""
    vocab: int = 256
    """Byte-level: 256 ids."""


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.tok, self.pos = nn.Embedding(s.vocab, s.d_model), nn.Embedding(s.seq_len, s.d_model)
        self.layers = nn.ModuleList(Block(s.d_model, s.heads) for _ in range(s.layers))
        self.ln = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


def loss(logits, target, reduction="mean"):
    """Each sample's mean token loss, then the mean (or sum) over samples: exact under any split."""
    per_sample = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none").mean(dim=1)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


def accuracy(logits, target):
    return (logits.argmax(-1) == target).sum(), target.numel()


def example_batch(s: Settings, n: int, generator: torch.Generator):
    tokens = torch.randint(0, s.vocab, (n, s.seq_len + 1), generator=generator, device=generator.device)
    return tokens[:, :-1], tokens[:, 1:]


def dataset(s: Settings, request):
    return TokenFile(request.path, seq_len=s.seq_len, vocab=s.vocab, dtype=request.token_dtype)


def check(s: Settings) -> None:
    if s.d_model % s.heads:
        raise ValueError(f"workload.d_model={s.d_model} is not a multiple of workload.heads={s.heads}")


workload = Workload(
    model=GPT, loss=loss, settings=Settings, example_batch=example_batch, dataset=dataset,
    data_kinds=("tokens",), blocks=lambda model: list(model.layers), accuracy=accuracy, unit="tok",
    units_per_sample=lambda s: s.seq_len, check=check,
)
