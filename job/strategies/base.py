"""The interface every strategy implements, and the behaviour shared by the single-process ones."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from job import memplan, phases
from job.errors import UsageError
from job.precision import Precision

log = logging.getLogger("job")


class Strategy:
    """How one optimizer step's batch is spread over the cards.

    The trainer calls, in order: `check(micro_batch=...)`, `setup(model, loss_fn)`, `plan_memory(planning)`
    (the split of each micro-batch, job.memplan), then per micro-step
    `loss(x, y)` inside `backward_sync(enabled)`, and `teardown()` at the end. `module` is always the
    unwrapped model (what checkpoints save and optimizers see).
    """

    name = "base"
    multi_process = False
    min_share = 1  # fewest samples a card (balanced) or rank (ddp) may get in a split

    def __init__(self, scfg, *, devices: list[torch.device], rank: int = 0, world_size: int = 1,
                 local_rank: int = 0, precision: Precision | None = None):
        self.cfg = scfg
        # train.amp (job.precision): replicas run in its autocast; fsdp builds its policy from it.
        self.precision = precision or Precision("off", devices[0].type)
        self.devices = devices
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.module: nn.Module | None = None
        self.loss_fn = None
        self.sizes: list[int] = []  # samples of each micro-batch per card (balanced) or per rank (ddp)

    @property
    def device(self) -> torch.device:
        """Where this process's inputs, targets and unwrapped model live."""
        return self.devices[0]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, micro_batch: int) -> tuple[int, int]:
        """(offset, count): the samples of each micro-batch this process loads, by position."""
        return 0, micro_batch

    def plan_memory(self, planning) -> memplan.Plan:
        """The memory plan (job.memplan): here, each card's room for the table, and an even split."""
        cards = [planning.card(d, str(d), k) for k, d in enumerate(self.devices)]
        plan = memplan.Plan(mode="even", micro_batch=planning.micro_batch, cards=cards)
        memplan.apply_fixed(plan, self.even_sizes(planning.micro_batch))
        self.sizes = plan.sizes
        return plan

    def even_sizes(self, micro_batch: int) -> list[int]:
        return memplan.even_split(micro_batch, len(self.devices))

    def local_cards(self, plan: memplan.Plan) -> list[memplan.CardPlan]:
        """The plan's lines for the cards this process drives, in self.devices order."""
        return plan.cards

    def check(self, *, micro_batch: int) -> None:
        """Refuse batch sizes this strategy cannot split (UsageError with the arithmetic)."""

    def to_device(self, model: nn.Module) -> nn.Module:
        """Where the freshly built model goes before checkpoint weights are loaded into it and `setup`."""
        return model.to(self.device)

    def setup(self, model: nn.Module, loss_fn, *, compile: bool = False, blocks: list[nn.Module] | None = None
              ) -> None:
        """`blocks`: the workload's repeated sub-modules (fsdp shards each on its own)."""
        self.module, self.loss_fn = model, loss_fn
        self.forward = torch.compile(model) if compile else model

    def set_training(self, mode: bool) -> None:
        """Train or eval mode for every copy of the model this process runs (validation switches it)."""
        self.module.train(mode)

    def eval_output(self, x: torch.Tensor):
        """The model's output for a held-out batch (no gradients; validation, job.evaluate)."""
        return self.forward(x)

    def build_optimizer(self, factory):
        """`factory(params)` builds the configured optimizer; strategies with replicas widen `params`."""
        return factory(self.module.parameters())

    def optimizer_state_dict(self, opt) -> dict:
        """Optimizer state shaped as for the unwrapped model alone (what checkpoints store)."""
        return opt.state_dict()

    def load_optimizer_state_dict(self, opt, sd: dict) -> None:
        opt.load_state_dict(sd)

    def checkpoint_state(self, opt) -> tuple[dict, dict] | None:
        """(model, optimizer) state of the unwrapped model alone, on rank 0 (None elsewhere). Every rank calls
        it: a sharded strategy gathers the full state here."""
        if not self.is_main:
            return None
        return self.module.state_dict(), self.optimizer_state_dict(opt)

    def local_parameters(self):
        """The parameter tensors this process holds (its shards under fsdp), e.g. to check they are finite."""
        return list(self.module.parameters())

    def on_step_end(self, step: int) -> None:
        """Called after each optimizer step (balanced checks its replicas here)."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the (reduced) gradients to a global norm, as one process would; returns the norm."""
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss over this micro-batch (over all ranks' samples, after the gradient reduce)."""
        with phases.mark("forward"):
            out = self.forward(x)
        with phases.mark("loss"):
            return self.loss_fn(out, y)

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

    def memory_tensors(self, optimizer) -> list[dict[str, list[torch.Tensor]]]:
        """Per card this process drives (self.devices order): the tensors that are its parameters (and buffers),
        gradients and optimizer state, for job.breakdown (which counts each storage once). Here every tensor goes
        to the card it lives on: under dp the module, its reduced gradients and the optimizer state all sit on
        card 0 (the replicas DataParallel makes on the other cards every step are temporaries)."""
        params = unique_tensors([p for g in optimizer.param_groups for p in g["params"]]
                                + list(self.module.parameters()))  # frozen ones too
        return tensors_by_device(self.devices, params=params, buffers=list(self.module.buffers()),
                                 optimizer=optimizer)


def unique_tensors(tensors: list) -> list:
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]


def optimizer_state_tensors(optimizer, params) -> list[torch.Tensor]:
    """The optimizer's state tensors (moments, step counters) of `params`."""
    state = optimizer.state
    return [v for p in params for v in list(state.get(p, {}).values()) if torch.is_tensor(v)]


def tensors_by_device(devices, *, params, buffers, optimizer, local=lambda t: t) -> list[dict[str, list[torch.Tensor]]]:
    """The three kinds per device of `devices`, each tensor (as `local` gives it) on the card it lives on."""
    kinds = {"parameters": [local(t) for t in params + buffers],
             "gradients": [local(p.grad) for p in params if p.grad is not None],
             "optimizer_state": [local(t) for t in optimizer_state_tensors(optimizer, params)]}
    out: list[dict[str, list[torch.Tensor]]] = [{k: [] for k in kinds} for _ in devices]
    for kind, tensors in kinds.items():
        for t in tensors:
            k = next((i for i, d in enumerate(devices) if t.device == d), None)
            if k is not None:  # elsewhere (a CPU copy): not on any of this process's cards
                out[k][kind].append(t)
    return out


def disable_cudnn_autotune(strategy: str, devices: list[torch.device]) -> None:
    """DataParallel-style strategies run replicas in threads; keep cuDNN from re-tuning each step."""
    if len(devices) > 1 and devices[0].type == "cuda" and torch.backends.cudnn.benchmark:
        torch.backends.cudnn.benchmark = False
        log.info(
            "%s: turned cudnn.benchmark off: DataParallel runs each replica in a new thread every step and "
            "cuDNN's autotune cache is per thread, so it would re-tune every step (18x slower measured on "
            "2xH200, docs/design.md)", strategy,
        )


def check_at_least_one_per_card(strategy: str, micro_batch: int, n_cards: int) -> None:
    if micro_batch < n_cards:
        raise UsageError(
            f"{strategy}: micro-batch {micro_batch} (train.batch_size / train.accum_steps) is smaller than "
            f"the {n_cards} cards; raise train.batch_size to at least {n_cards} x train.accum_steps"
        )


def parse_gpu0(value: str, micro_batch: int) -> int | None:
    """`strategy.gpu0_batch` as samples of each micro-batch; None means auto."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    try:
        if "." in text or "e" in text:
            frac = float(text)
            if not 0.0 < frac < 1.0:
                raise ValueError
            samples = round(frac * micro_batch)
        else:
            samples = int(text)
    except ValueError:
        raise UsageError(
            f"strategy.gpu0_batch=`{value}` is not valid; give samples (an int >= 0), a fraction in (0, 1), or auto"
        ) from None
    if not 0 <= samples <= micro_batch:
        raise UsageError(
            f"strategy.gpu0_batch={value} is outside the micro-batch of {micro_batch} samples "
            "(train.batch_size / train.accum_steps); give 0..micro-batch, a fraction, or auto"
        )
    return samples


def split_sizes(total: int, n: int, gpu0: int | None = None) -> list[int]:
    """Samples per card: card 0 gets `gpu0` (even share if None), the rest spread evenly, remainders to
    the lowest card indices first. Deterministic; sums to total; never negative."""
    if n == 1:
        return [total]
    if gpu0 is None:
        return memplan.even_split(total, n)
    if not 0 <= gpu0 <= total:
        raise ValueError(f"gpu0={gpu0} outside 0..{total}")
    return [gpu0] + memplan.even_split(total - gpu0, n - 1)


def parse_mode(scfg, n: int, micro_batch: int, *, minimum: int) -> str | list[int]:
    """`strategy.split` and `strategy.gpu0_batch` together: "auto", "even", or the shares of n cards/ranks."""
    split = memplan.parse_split(scfg.split, n, micro_batch, minimum=minimum)
    gpu0 = parse_gpu0(scfg.gpu0_batch, micro_batch)
    if gpu0 is None:
        return split
    if split != "auto":
        raise UsageError(f"strategy.split={scfg.split} and strategy.gpu0_batch={scfg.gpu0_batch} both choose the "
                         "split; set one of them (the other to auto)")
    sizes = split_sizes(micro_batch, n, gpu0)
    if min(sizes) < minimum:
        raise UsageError(f"strategy.gpu0_batch={scfg.gpu0_batch} leaves a card or rank of {sizes} with fewer than "
                         f"{minimum} sample(s) of micro-batch {micro_batch}; give each at least {minimum}")
    return sizes
