"""`dp`: stock torch.nn.DataParallel, the baseline.

Scatter from GPU 0, replicate every step, gather all outputs onto GPU 0, compute the loss there.
This is the behaviour whose GPU-0 pile-up the project measures; the two departures from the stock
recipe are the smallest fixes of two DataParallel bugs: cuDNN autotuning is turned off (see
base.disable_cudnn_autotune), and each replica runs under the run's autocast (job.precision; torch's
parallel_apply passes only `enabled` to the replica threads, so a bf16 autocast ran the replicas in fp16,
with no GradScaler).
"""

from __future__ import annotations

from torch import nn

from job import phases
from job.precision import Precision
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
            self.forward = _DataParallel(_ReplicaAutocast(self.forward, self.precision),
                                         device_ids=[d.index for d in self.devices], output_device=self.devices[0].index)

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
    """Stock DataParallel, its four parts marked for bench.mode=profile (job.phases)."""

    scatter, replicate, parallel_apply, gather = (_marked(n) for n in ("scatter", "replicate", "parallel_apply",
                                                                        "gather"))


class _ReplicaAutocast(nn.Module):
    """Runs the model (in a replica's thread) under the run's autocast."""

    def __init__(self, inner: nn.Module, precision: Precision):
        super().__init__()
        self.inner, self.precision = inner, precision

    def forward(self, x):
        with self.precision.autocast("cuda"):
            return self.inner(x)

