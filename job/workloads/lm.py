"""`lm`: a GPT-style decoder LM (6 x 768, vocabulary 50,304, 1,024 tokens by default; the presets lm-12x512,
lm-24x384 and lm-1b3 are other shapes of it), on random tokens or a token file (data.kind=tokens)."""

from __future__ import annotations

from dataclasses import dataclass

from job.workload import Workload
from job.workloads import check_ranges


@dataclass
class Settings:
    layers: int = 6
    """Transformer blocks."""
    d_model: int = 768
    """Hidden size."""
    heads: int = 12
    """Attention heads (must divide d_model)."""
    vocab: int = 50304
    """Vocabulary size (the logits tensor is batch x seq x vocab: the DataParallel pile-up)."""
    seq_len: int = 1024
    """Tokens per sample."""
    dropout: float = 0.0
    """Dropout probability, 0 <= p < 1."""


def build(s: Settings):
    from job.models import DecoderLM

    return DecoderLM(vocab=s.vocab, seq_len=s.seq_len, d_model=s.d_model, heads=s.heads, layers=s.layers,
                     dropout=s.dropout)


def loss(logits, target, reduction: str = "mean"):
    """Mean over each sample's tokens, then mean (or sum) over samples: exact whatever the split, since every
    sample has seq_len tokens."""
    import torch.nn.functional as F

    per_token = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
    per_sample = per_token.view(target.shape).mean(dim=1)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


def accuracy(logits, target):
    """(tokens predicted right, tokens)."""
    return (logits.argmax(dim=-1) == target).sum(), target.numel()


def random_tokens(s: Settings, n: int, generator):
    import torch

    tokens = torch.randint(0, s.vocab, (n, s.seq_len + 1), generator=generator, device=generator.device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def token_file(s: Settings, request):
    from job.datasets import TokenFile

    return TokenFile(request.path, seq_len=s.seq_len, vocab=s.vocab, dtype=request.token_dtype)


def check(s: Settings) -> None:
    check_ranges(s, {"layers": (1, 1024), "d_model": (1, 65536), "heads": (1, 1024), "vocab": (2, 2**24),
                     "seq_len": (1, 2**20)})
    if not 0 <= s.dropout < 1:
        raise ValueError(f"`workload.dropout={s.dropout}` is out of range; give a probability from 0 up to (not "
                         "including) 1")
    if s.d_model % s.heads:
        raise ValueError(f"workload.d_model={s.d_model} is not a multiple of workload.heads={s.heads}")


workload = Workload(
    model=build, loss=loss, settings=Settings, example_batch=random_tokens, dataset=token_file,
    data_kinds=("tokens",), blocks=lambda model: list(model.blocks), accuracy=accuracy, unit="tok",
    units_per_sample=lambda s: s.seq_len, check=check,
)
