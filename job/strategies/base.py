"""The interface every strategy implements, and the behaviour shared by the single-process ones."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from job.errors import UsageError

log = logging.getLogger("job")


class Strategy:
    """How one optimizer step's batch is spread over the cards.

    The trainer calls, in order: `check(micro_batch=...)`, `setup(model, loss_fn)`, then per micro-step
    `loss(x, y)` inside `backward_sync(enabled)`, and `teardown()` at the end. `module` is always the
    unwrapped model (what checkpoints save and optimizers see).
    """

    name = "base"
    multi_process = False
    run_dir = None  # set by the trainer: where a strategy may keep state (balanced's calibrated split)

    def __init__(self, scfg, *, devices: list[torch.device], rank: int = 0, world_size: int = 1,
                 local_rank: int = 0):
        self.cfg = scfg
        self.devices = devices
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.module: nn.Module | None = None
        self.loss_fn = None

    @property
    def device(self) -> torch.device:
        """Where this process's inputs, targets and unwrapped model live."""
        return self.devices[0]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def local_batch(self, micro_batch: int) -> int:
        """Samples this process loads per micro-step."""
        return micro_batch

    def check(self, *, micro_batch: int) -> None:
        """Refuse batch sizes this strategy cannot split (UsageError with the arithmetic)."""

    def setup(self, model: nn.Module, loss_fn, *, compile: bool = False) -> None:
        self.module, self.loss_fn = model, loss_fn
        self.forward = torch.compile(model) if compile else model

    def build_optimizer(self, factory):
        """`factory(params)` builds the configured optimizer; strategies with replicas widen `params`."""
        return factory(self.module.parameters())

    def optimizer_state_dict(self, opt) -> dict:
        """Optimizer state shaped as for the unwrapped model alone (what checkpoints store)."""
        return opt.state_dict()

    def load_optimizer_state_dict(self, opt, sd: dict) -> None:
        opt.load_state_dict(sd)

    def on_step_end(self, step: int) -> None:
        """Called after each optimizer step (balanced calibrates its split here)."""

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss over this micro-batch (over all ranks' samples, after the gradient reduce)."""
        return self.loss_fn(self.forward(x), y)

    def backward_sync(self, enabled: bool):
        """Context for one micro-step's forward/backward; enabled=False may skip gradient sync."""
        return contextlib.nullcontext()

    # Collective helpers: identity in a single process.
    def all_gather_object(self, obj) -> list:
        return [obj]

    def mean(self, value: float) -> float:
        return value

    def any(self, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        pass

    def teardown(self) -> None:
        pass


def disable_cudnn_autotune(strategy: str, devices: list[torch.device]) -> None:
    """DataParallel-style strategies run replicas in threads; keep cuDNN from re-tuning each step."""
    if len(devices) > 1 and devices[0].type == "cuda" and torch.backends.cudnn.benchmark:
        torch.backends.cudnn.benchmark = False
        log.info(
            "%s: turned cudnn.benchmark off: DataParallel runs each replica in a new thread every step and "
            "cuDNN's autotune cache is per thread, so it would re-tune every step (18x slower measured on "
            "2xH200, DESIGN.md)", strategy,
        )


def check_at_least_one_per_card(strategy: str, micro_batch: int, n_cards: int) -> None:
    if micro_batch < n_cards:
        raise UsageError(
            f"{strategy}: micro-batch {micro_batch} (train.batch_size / train.accum_steps) is smaller than "
            f"the {n_cards} cards; raise train.batch_size to at least {n_cards} x train.accum_steps"
        )
