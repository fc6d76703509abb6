"""Activation checkpointing of a workload's blocks: each block's forward is recomputed in backward instead of
keeping its activations.

A block is checkpointed by giving it a subclass of its own class whose `forward` runs the original under
`torch.utils.checkpoint` (non-reentrant) while training with gradients; eval and no-grad forwards run plainly.
The module tree and its parameter names stay as they are, so a checkpoint file is the same with and without
recomputation, DataParallel's and balanced's replicas copy it like any module, and fsdp shards the block
after it is wrapped (torchtitan's order: recomputation runs after the block's weights are gathered again).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

_classes: dict[type, type] = {}


def checkpoint_blocks(blocks: Iterable[nn.Module]) -> int:
    """Checkpoint every block in place; returns how many (a block already checkpointed counts once)."""
    n = 0
    for block in blocks:
        if not isinstance(block, nn.Module):
            raise TypeError(f"blocks() returned a {type(block).__name__}, not a torch.nn.Module")
        if not getattr(type(block), "_job_recomputed", False):
            block.__class__ = _checkpointed(type(block))
        n += 1
    return n


def _checkpointed(cls: type) -> type:
    if cls not in _classes:
        base_forward = cls.forward

        def forward(self, *args, **kwargs):
            import torch
            from torch.utils.checkpoint import checkpoint

            if self.training and torch.is_grad_enabled():
                return checkpoint(base_forward, self, *args, use_reentrant=False, **kwargs)
            return base_forward(self, *args, **kwargs)

        _classes[cls] = type(f"Recomputed{cls.__name__}", (cls,),
                             {"forward": forward, "_job_recomputed": True, "__module__": cls.__module__})
    return _classes[cls]
