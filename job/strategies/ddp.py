"""`ddp`: DistributedDataParallel, one process per card; and what every one-process-per-card strategy shares.

The process group is set up by job.launch (spawned by the trainer, or joined under torchrun/Slurm).
`ProcessGroupStrategy` holds what ddp and fsdp have in common: the collectives the trainer needs (over a
gloo group for the control plane: stop flag, logging, so they never force a GPU synchronisation), a
sample per rank, this rank's share of each micro-batch, its line of the memory plan. `DDPStrategy` adds
DistributedDataParallel's wrapping (after the memory plan), no_sync under accumulation, and the probes
of strategy.split=auto.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from job import memplan
from job.errors import PeerUsageError, UsageError
from job.strategies.base import Strategy, parse_mode


class ProcessGroupStrategy(Strategy):
    """One process per card in a process group: collectives, a sample per rank, this rank's share."""

    multi_process = True

    def __init__(self, scfg, **kw):
        super().__init__(scfg, **kw)
        self.micro_batch, self.mode = 0, "even"
        self.distributed = dist.is_available() and dist.is_initialized() and self.world_size > 1
        self.ctrl = None
        if self.distributed:
            self.ctrl = (dist.new_group(backend="gloo", timeout=timedelta(seconds=scfg.timeout_s))
                         if dist.get_backend() != "gloo" else dist.group.WORLD)

    def check(self, *, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        if micro_batch < self.world_size:
            raise UsageError(
                f"{self.name}: micro-batch {micro_batch} (train.batch_size / train.accum_steps) cannot give each of "
                f"{self.world_size} ranks a sample; use train.batch_size >= {self.world_size} x train.accum_steps"
            )
        self.mode = parse_mode(self.cfg, self.world_size, micro_batch, minimum=self.min_share)

    def share(self, micro_batch: int) -> tuple[int, int]:
        sizes = self.sizes or memplan.even_split(micro_batch, self.world_size)
        return sum(sizes[: self.rank]), sizes[self.rank]

    def local_cards(self, plan):
        return [plan.cards[self.rank]]

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


class DDPStrategy(ProcessGroupStrategy):
    name = "ddp"

    def __init__(self, scfg, **kw):
        super().__init__(scfg, **kw)
        self.ddp, self.compile = None, False

    def setup(self, model: nn.Module, loss_fn, *, compile: bool = False, blocks=None) -> None:
        super().setup(model, loss_fn)
        self.compile = compile
        # DDP wraps the model after the memory plan (plan_memory): probes then measure the gradients
        # DDP's buckets will hold, not a second copy next to them.

    def _wrap(self) -> None:
        if self.forward is not self.module or self.ddp is not None:
            return
        if self.distributed:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = nn.parallel.DistributedDataParallel(
                self.module, device_ids=ids, find_unused_parameters=self.cfg.find_unused_parameters,
                gradient_as_bucket_view=True, bucket_cap_mb=self.cfg.bucket_mb,
            )
            # Compile the DDP-wrapped module: dynamo's DDPOptimizer splits graphs at bucket boundaries.
            self.forward = torch.compile(self.ddp) if self.compile else self.ddp
        elif self.compile:
            self.forward = torch.compile(self.module)

    def plan_memory(self, planning) -> memplan.Plan:
        """Each rank measures its own card; the ranks exchange what they measured and make the same choice."""
        label = f"rank {self.rank} {self.device}"
        mine = planning.card(self.device, label, self.local_rank)
        cards = self.all_gather_object(mine)
        plan = memplan.Plan(mode="auto" if self.mode == "auto" else "fixed", micro_batch=planning.micro_batch,
                            cards=cards, key=planning.key)
        if self.mode == "auto" and self.device.type == "cuda":
            cached = self._cached(planning, cards)
            if cached is not None:
                plan = cached
            else:
                step = planning.probe_step(self.module, self.device)
                extra = planning.optimizer_bytes(list(self.module.parameters()))
                ahead = planning.batches_ahead * planning.sample_bytes(self.device) if planning.batches_ahead else 0

                def probe_upto(b: int) -> None:
                    memplan.probe(plan.cards[self.rank], self.device, step, upto=b, limit=planning.micro_batch,
                                  extra=extra, extra_per_sample=ahead)

                def exchange(cards):
                    return self.all_gather_object(cards[self.rank])

                try:
                    memplan.auto_plan(plan, {self.rank: probe_upto}, exchange, minimum=self.min_share,
                                      accum_steps=planning.accum_steps, options=memplan.OPTIONS)
                except UsageError as e:  # every rank refuses the same plan: rank 0 says it
                    raise (PeerUsageError if self.rank else UsageError)(str(e)) from None
        else:
            sizes = self.mode if isinstance(self.mode, list) else memplan.even_split(planning.micro_batch, self.world_size)
            plan.mode = "even" if self.mode in ("auto", "even") else "explicit"
            memplan.apply_fixed(plan, sizes)
        self.sizes = plan.sizes
        self._wrap()
        return plan

    def _cached(self, planning, cards):
        """Rank 0 reads the cache; every rank takes its answer (the ranks may not share a file system view)."""
        found = memplan.read_cache(planning.run_dir, planning.key, cards) if self.rank == 0 else None
        doc = self.all_gather_object(found.to_json() if found else None)[0]
        if doc is None:
            return None
        plan = memplan.Plan.from_json(doc)
        plan.reused = True
        return plan

    def loss(self, x, y):
        """This rank's samples' loss sum x world / micro-batch: DDP averages gradients over ranks, so the
        result is the gradient of the full micro-batch's mean whatever the split (the mean of these values
        over ranks is the full-batch mean loss)."""
        self._wrap()
        return self.loss_fn(self.forward(x), y, reduction="sum") * (self.world_size / self.micro_batch)

    def backward_sync(self, enabled: bool):
        self._wrap()
        if self.distributed and not enabled:
            return self.ddp.no_sync()
        return super().backward_sync(enabled)
