"""`dp`: stock torch.nn.DataParallel, the baseline.

Scatter from GPU 0, replicate every step, gather all outputs onto GPU 0, compute the loss there.
This is the behaviour whose GPU-0 pile-up the project measures; the two departures from the stock
recipe are the smallest fixes of two DataParallel bugs: cuDNN autotuning is turned off (see
base.disable_cudnn_autotune), and each replica's autocast gets the caller's dtype (torch's parallel_apply
passes only `enabled` to the replica threads, so a bf16 autocast ran the replicas in fp16, with no
GradScaler).
"""

from __future__ import annotations

import torch
from torch import nn

from job import phases
from job.strategies.base import Strategy, check_at_least_one_per_card, disable_cudnn_autotune


class DataParallelStrategy(Strategy):
    name = "dp"

    def check(self, *, micro_batch: int) -> None:
        check_at_least_one_per_card(self.name, micro_batch, len(self.devices))

    def setup(self, model: nn.Module, loss_fn, *, compile: bool = False, blocks=None) -> None:
        super().setup(model, loss_fn, compile=compile)
        if self.device.type == "cuda" and len(self.devices) > 1:
            disable_cudnn_autotune(self.name, self.devices)
            # Outputs are gathered on GPU 0 and the loss is computed there (base.loss): the stock recipe.
            self.forward = _DataParallel(_ReplicaAutocast(self.forward), device_ids=[d.index for d in self.devices],
                                         output_device=self.devices[0].index)

    def even_sizes(self, micro_batch: int) -> list[int]:
        """What DataParallel's scatter gives each card: torch.chunk's sizes (ceil; later cards may get less)."""
        n = len(self.devices)
        size = -(-micro_batch // n)
        return [max(0, min(size, micro_batch - k * size)) for k in range(n)]


def _marked(name: str):
    """nn.DataParallel's method `name`, inside phases.mark(name)."""
    inner = getattr(nn.DataParallel, name)

    def method(self, *args, **kwargs):
        with phases.mark(name):
            return inner(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


class _DataParallel(nn.DataParallel):
    """Stock DataParallel; before replicating, it records the caller's autocast (its replicas copy it)."""

    def forward(self, *inputs, **kwargs):
        self.module.amp = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        return super().forward(*inputs, **kwargs)

    # Its four parts, marked for bench.mode=profile (job.phases).
    scatter, replicate, parallel_apply, gather = (_marked(n) for n in ("scatter", "replicate", "parallel_apply",
                                                                        "gather"))


class _ReplicaAutocast(nn.Module):
    """Runs the model under autocast with the dtype of the caller's autocast (set in `amp` per call)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.amp: tuple[bool, torch.dtype | None] = (False, None)

    def forward(self, x):
        enabled, dtype = self.amp
        with torch.autocast("cuda", dtype=dtype, enabled=enabled):
            return self.inner(x)

