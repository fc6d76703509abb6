"""The built-in workloads' models (job.workloads.* describes them as workloads) and two small helpers.

`TinyCNN` avoids BatchNorm on purpose (GroupNorm instead): with per-sample normalisation, the gradient of a
batch does not depend on how it is split across cards or micro-steps, so DDP, accumulation and
single-process runs can be compared weight for weight in tests. `resnet50` is torchvision's, BatchNorm
and all, as users run it. Activation checkpointing is not the models' business: job.recompute wraps the
blocks a workload names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class TinyCNN(nn.Module):
    def __init__(self, *, width: int, num_classes: int):
        super().__init__()
        w = width

        def block(cin: int, cout: int, stride: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                nn.GroupNorm(min(8, cout), cout),
                nn.ReLU(inplace=True),
            )

        self.features = nn.Sequential(block(3, w, 1), block(w, 2 * w, 2), block(2 * w, 4 * w, 2))
        self.head = nn.Linear(4 * w, num_classes)

    def forward(self, x):
        x = self.features(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))




class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class DecoderLM(nn.Module):
    """GPT-style decoder; the output head is tied to the token embedding."""

    def __init__(self, *, vocab: int, seq_len: int, d_model: int, heads: int, layers: int,
                 dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, heads, dropout) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def human(n: float) -> str:
    """1234567 -> '1.23M'."""
    if n < 1000:
        return f"{n:.0f}"
    k = int(math.log10(n) // 3)
    return f"{n / 1000**k:.2f}{' kMGT'[k]}"
