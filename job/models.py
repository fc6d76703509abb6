"""Workloads: the model, its loss, and the shape of one sample.

`tiny` avoids BatchNorm on purpose (GroupNorm instead): with per-sample normalisation, the gradient of
a batch does not depend on how it is split across cards or micro-steps, so DDP, accumulation and
single-process runs can be compared weight for weight in tests. `resnet50` is torchvision's, BatchNorm
and all, as users run it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[..., nn.Module]
    loss: Callable[..., torch.Tensor]
    """loss(output, target, reduction) -> the mean (or sum) over samples."""
    sample_shape: Callable[..., tuple[int, ...]]
    """Input shape of one sample, from the workload config."""
    unit: str
    """Throughput unit: img or tok."""
    units_per_sample: Callable[..., int]
    is_image: bool


def _classification_loss(out: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(out.float(), target, reduction=reduction)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    # Sum over tokens per sample, then mean/sum over samples: "mean over all samples" stays exact
    # whatever the split, since every sample has seq_len tokens.
    per_token = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
    per_sample = per_token.view(target.shape).mean(dim=1)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


class _Checkpointed(nn.Module):
    """Runs `inner` under activation checkpointing while training (recompute in backward)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)


def _maybe_ckpt(module: nn.Module, enabled: bool) -> nn.Module:
    return _Checkpointed(module) if enabled else module


class TinyCNN(nn.Module):
    def __init__(self, *, width: int, num_classes: int, activation_checkpointing: bool = False):
        super().__init__()
        w = width

        def block(cin: int, cout: int, stride: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                nn.GroupNorm(min(8, cout), cout),
                nn.ReLU(inplace=True),
            )

        ac = activation_checkpointing
        self.features = nn.Sequential(
            _maybe_ckpt(block(3, w, 1), ac),
            _maybe_ckpt(block(w, 2 * w, 2), ac),
            _maybe_ckpt(block(2 * w, 4 * w, 2), ac),
        )
        self.head = nn.Linear(4 * w, num_classes)

    def forward(self, x):
        x = self.features(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_tiny(w, *, activation_checkpointing: bool = False) -> nn.Module:
    return TinyCNN(width=w.width, num_classes=w.num_classes, activation_checkpointing=activation_checkpointing)


def build_resnet50(w, *, activation_checkpointing: bool = False) -> nn.Module:
    from torchvision.models import resnet50

    model = resnet50(num_classes=w.num_classes)
    if activation_checkpointing:
        for name in ("layer1", "layer2", "layer3", "layer4"):
            setattr(model, name, _Checkpointed(getattr(model, name)))
    return model


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
                 dropout: float = 0.0, activation_checkpointing: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            _maybe_ckpt(Block(d_model, heads, dropout), activation_checkpointing) for _ in range(layers)
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


def build_lm(w, *, activation_checkpointing: bool = False) -> nn.Module:
    return DecoderLM(vocab=w.vocab, seq_len=w.seq_len, d_model=w.d_model, heads=w.heads, layers=w.layers,
                     dropout=w.dropout, activation_checkpointing=activation_checkpointing)


WORKLOADS: dict[str, Workload] = {
    "tiny": Workload("tiny", build_tiny, _classification_loss,
                     lambda w: (3, w.image_size, w.image_size), "img", lambda w: 1, True),
    "resnet50": Workload("resnet50", build_resnet50, _classification_loss,
                         lambda w: (3, w.image_size, w.image_size), "img", lambda w: 1, True),
    "lm": Workload("lm", build_lm, _lm_loss, lambda w: (w.seq_len,), "tok", lambda w: w.seq_len, False),
}


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def human(n: float) -> str:
    """1234567 -> '1.23M'."""
    if n < 1000:
        return f"{n:.0f}"
    k = int(math.log10(n) // 3)
    return f"{n / 1000**k:.2f}{' kMGT'[k]}"
