"""`ddp`: DistributedDataParallel, one process per card.

The process group is set up by job.launch (spawned by the trainer, or joined under torchrun/Slurm);
this module wraps the model and provides the collectives the trainer needs. Control-plane collectives
(stop flag, logging) go over a gloo group so they never force a GPU synchronisation.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from job.errors import UsageError
from job.strategies.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"
    multi_process = True

    def __init__(self, scfg, **kw):
        super().__init__(scfg, **kw)
        self.distributed = dist.is_available() and dist.is_initialized() and self.world_size > 1
        self.ctrl = None
        if self.distributed:
            self.ctrl = (dist.new_group(backend="gloo", timeout=timedelta(seconds=scfg.timeout_s))
                         if dist.get_backend() != "gloo" else dist.group.WORLD)

    def check(self, *, micro_batch: int) -> None:
        if micro_batch % self.world_size:
            raise UsageError(
                f"ddp: micro-batch {micro_batch} (train.batch_size / train.accum_steps) is not a multiple of "
                f"{self.world_size} ranks; use train.batch_size = {self.world_size} x train.accum_steps x k"
            )

    def local_batch(self, micro_batch: int) -> int:
        return micro_batch // self.world_size

    def setup(self, model: nn.Module, loss_fn, *, compile: bool = False) -> None:
        super().setup(model, loss_fn)
        if self.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = nn.parallel.DistributedDataParallel(
                model, device_ids=ids, find_unused_parameters=self.cfg.find_unused_parameters,
                gradient_as_bucket_view=True,
            )
            # Compile the DDP-wrapped module: dynamo's DDPOptimizer splits graphs at bucket boundaries.
            self.forward = torch.compile(self.ddp) if compile else self.ddp
        elif compile:
            self.forward = torch.compile(model)
        # loss() is the base one: the mean over the local slice; DDP averages gradients over equal
        # slices, which is the global mean.

    def backward_sync(self, enabled: bool):
        if self.distributed and not enabled:
            return self.ddp.no_sync()
        return super().backward_sync(enabled)

    def all_gather_object(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def mean(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.ctrl)
        return float(t.item()) / self.world_size

    def any(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return bool(t.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.ctrl)
