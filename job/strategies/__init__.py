"""Strategy registry: one module per strategy, one dict. `build` is the only constructor."""

from __future__ import annotations

from job.strategies.balanced import BalancedStrategy
from job.strategies.base import Strategy
from job.strategies.ddp import DDPStrategy
from job.strategies.dp import DataParallelStrategy
from job.strategies.fsdp import FSDPStrategy

REGISTRY: dict[str, type[Strategy]] = {
    "balanced": BalancedStrategy,
    "dp": DataParallelStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
}


def build(name: str, *, strategy_cfg, devices, rank: int = 0, world_size: int = 1,
          local_rank: int = 0, precision=None) -> Strategy:
    """`precision`: the run's job.precision.Precision (train.amp; off when None)."""
    from job.errors import UsageError

    if name not in REGISTRY:
        raise UsageError(f"unknown strategy `{name}`; choose one of: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name](strategy_cfg, devices=devices, rank=rank, world_size=world_size,
                          local_rank=local_rank, precision=precision)
