"""The memory plan: how many samples of each micro-batch each card trains, from what each card has room for.

Per card (a card of `balanced`, or the card of one `ddp` rank):

- **room** = what the driver reports free when the job plans (other processes on the card count) + what
  this job already holds there (its model, data pool, NCCL), capped by `memory.cap_gb`, minus
  `memory.margin_gb`. Mixed card sizes and tenants enter only through this number.
- **cost(b)** = fixed + per_sample x b: the peak memory this job's own step reaches with b samples on the
  card, *measured on the job*: forward + backward of b = 1, 2, 4, ... samples on that card alone (no
  optimizer step: probes do not train, so a run's weights do not depend on them), each probe starting
  from an empty allocator cache. Before each probe the line through the last two points predicts its
  peak; a probe predicted not to fit is not run (the largest size predicted to fit is tried instead),
  and probing stops once the size reaches the micro-batch. Probes start at one sample, so the probing
  itself can only run out of memory where the model alone barely fits (caught: then the card's
  capacity is what the probes reached). The line is fitted on *reserved* memory (what the card really
  gives up, allocator rounding included); the optimizer state (allocated by the first real step) is
  added analytically.
- **split**: each card gets an even share, never more than it has room for; what a card cannot hold goes
  to the cards that can (the smallest largest share: the step is as fast as the busiest card). With
  identical free cards this is the even split. No split fits: refuse before training with the largest
  global batch that would fit.

The plan is logged as a table, cached as `<run>/memory_plan.json` (a resumed run reuses it while the cards
are the same and still have the room it assumed), reported per card in the final table and exported as
metrics. After the first steps the trainer records each card's measured peak next to the prediction.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from job.errors import UsageError

log = logging.getLogger("job")
CACHE_NAME = "memory_plan.json"
GB = 1e9
FORMAT = 1


# -- pure arithmetic (tested for 1-8 cards on the CPU) -------------------------------------------------

def even_split(total: int, n: int) -> list[int]:
    """`total` samples over `n` cards, remainders to the lowest indices. Deterministic, sums to total."""
    if n < 1 or total < 0:
        raise ValueError(f"cannot split {total} samples over {n} cards")
    base, rem = divmod(total, n)
    return [base + (1 if k < rem else 0) for k in range(n)]


def fill_split(total: int, capacities: list[int], *, minimum: int = 0) -> list[int] | None:
    """Integer split of `total` minimising the largest share, with minimum <= share_k <= capacities[k].

    Water-filling: raise a common level L until sum(min(cap_k, L)) >= total; cards below L are full. The
    samples above `total` are taken back one at a time from the cards at level L with the least room to
    spare (highest index first among equals), so the cards with the most room keep the remainder.
    None when sum(capacities) < total or a card cannot take `minimum`.
    """
    n = len(capacities)
    if n == 0 or total < 0 or any(c < minimum for c in capacities) or sum(capacities) < total:
        return None
    if total < minimum * n:
        return None
    lo, hi = minimum, max(minimum, min(max(capacities), total))
    while lo < hi:  # smallest level that holds everything
        mid = (lo + hi) // 2
        if sum(min(c, mid) for c in capacities) >= total:
            hi = mid
        else:
            lo = mid + 1
    sizes = [min(c, lo) for c in capacities]
    excess = sum(sizes) - total
    at_level = sorted((k for k in range(n) if sizes[k] == lo and sizes[k] > minimum),
                      key=lambda k: (capacities[k] - lo, -k))
    for k in at_level[:excess]:
        sizes[k] -= 1
    return sizes


def parse_split(text: str, n: int, micro_batch: int, *, minimum: int) -> str | list[int]:
    """`strategy.split`: "auto", "even", or explicit samples per card ("4,12" or "[4, 12]")."""
    value = str(text).strip().lower()
    if value in ("auto", "even"):
        return value
    body = value.strip("[]() ")
    try:
        sizes = [int(x) for x in body.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(
            f"strategy.split=`{text}` is not valid; give auto, even, or samples per card like 4,12"
        ) from None
    if len(sizes) != n:
        raise UsageError(
            f"strategy.split={text} gives {len(sizes)} shares for {n} cards; give one number per card "
            f"(in order), or auto/even"
        )
    if sum(sizes) != micro_batch or any(s < minimum for s in sizes):
        raise UsageError(
            f"strategy.split={text} sums to {sum(sizes)}, but each micro-batch has {micro_batch} samples "
            f"(train.batch_size / train.accum_steps); shares must sum to {micro_batch}"
            + (f" and each be at least {minimum}" if minimum else "")
        )
    return sizes


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per_sample) through the two largest-b points (nearest the operating point); one point gives
    a flat line. The slope is never negative (memory does not shrink with samples; noise can say so)."""
    pts = sorted(points)
    if not pts:
        raise ValueError("no probe points")
    if len(pts) == 1:
        return float(pts[0][1]), 0.0
    (b1, m1), (b2, m2) = pts[-2], pts[-1]
    slope = max(0.0, (m2 - m1) / (b2 - b1))
    return float(m2 - slope * b2), slope


def capacity(room: float, fixed: float, per_sample: float, *, limit: int) -> int:
    """Largest b <= limit with fixed + per_sample*b <= room (0 when even one sample does not fit)."""
    if fixed > room:
        return 0
    if per_sample <= 0:
        return limit
    return max(0, min(limit, math.floor((room - fixed) / per_sample)))


def room_for(*, free: int, held: int, total: int, cap: float | None, margin: float) -> int:
    """Bytes this job may use at its peak on one card."""
    room = free + held
    if cap is not None:
        room = min(room, int(cap))
    return max(0, int(min(room, total) - margin))


# -- the plan ----------------------------------------------------------------------------------------

@dataclass
class CardPlan:
    """One card's line of the plan (bytes)."""

    label: str                      # "cuda:1" (balanced) or "rank 1 cuda:0" (ddp)
    name: str = "cpu"
    uuid: str = ""
    total: int = 0
    free: int = 0                   # driver's free memory when planning
    held: int = 0                   # this job's reserved memory when planning
    room: int = 0                   # what the plan lets this job use at peak
    fixed: float | None = None      # cost(b) = fixed + per_sample * b, reserved bytes, optimizer state included
    per_sample: float | None = None
    alloc_fixed: float | None = None  # the same line for allocated bytes (what the final table compares)
    alloc_per_sample: float | None = None
    probes: list[list[float]] = field(default_factory=list)  # [samples, peak allocated, peak reserved]
    capacity: int | None = None     # largest share predicted to fit
    probe_failed: bool = False      # a probe ran out of memory: capacity is below it
    samples: int = 0                # this card's share of each micro-batch
    predicted_peak: float | None = None  # allocated bytes at `samples`
    predicted_reserved: float | None = None
    measured_peak: float | None = None   # allocated, over the first real steps

    @property
    def measured(self) -> bool:
        return self.fixed is not None

    def cost(self, b: int) -> float:
        return self.fixed + self.per_sample * b

    def predict(self, b: int) -> None:
        self.samples = b
        if self.measured:
            self.predicted_reserved = self.cost(b)
            self.predicted_peak = self.alloc_fixed + self.alloc_per_sample * b

    @property
    def headroom(self) -> float | None:
        """Card memory left free at the predicted (or, once known, measured) peak."""
        if not self.measured:
            return None
        peak = self.predicted_reserved
        if self.measured_peak is not None and self.predicted_peak:
            peak = max(peak, peak * self.measured_peak / self.predicted_peak)
        return self.free + self.held - peak


@dataclass
class Plan:
    mode: str                       # auto | even | explicit | gpu0_batch
    micro_batch: int
    cards: list[CardPlan]
    key: dict = field(default_factory=dict)
    reused: bool = False

    @property
    def sizes(self) -> list[int]:
        return [c.samples for c in self.cards]

    def to_json(self) -> dict:
        return {"format": FORMAT, "mode": self.mode, "micro_batch": self.micro_batch, "key": self.key,
                "sizes": self.sizes, "cards": [asdict(c) for c in self.cards]}

    @classmethod
    def from_json(cls, doc: dict) -> Plan:
        return cls(mode=doc["mode"], micro_batch=int(doc["micro_batch"]), key=doc.get("key", {}),
                   cards=[CardPlan(**c) for c in doc["cards"]])

    def table(self) -> str:
        head = ["card", "name", "free GB", "room GB", "fixed GB", "MB/sample", "fits", "samples",
                "predicted GB", "measured GB", "headroom GB"]
        rows = []
        for c in self.cards:
            g = (lambda v: f"{v / GB:.2f}" if v is not None else "-")  # noqa: E731
            rows.append([c.label, c.name[:24], g(c.free) if c.total else "-", g(c.room) if c.total else "-",
                         g(c.fixed), f"{c.per_sample / 1e6:.1f}" if c.per_sample is not None else "-",
                         str(c.capacity) if c.capacity is not None else "-", str(c.samples),
                         g(c.predicted_peak), g(c.measured_peak), g(c.headroom)])
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head)] + [fmt.format(*r) for r in rows]
        return "\n".join(lines)


def choose(plan: Plan, *, minimum: int, accum_steps: int, options: str) -> None:
    """Fill `plan`'s shares from measured cards (mode auto); refuse (UsageError, exit 2) when none fits."""
    caps = [c.capacity if c.capacity is not None else plan.micro_batch for c in plan.cards]
    full = [c for c in plan.cards if c.measured and c.fixed > c.room]
    if full:  # even with no samples a card keeps the replica, its gradients and optimizer state
        c = full[0]
        raise UsageError(f"the model does not fit on {c.label}: its fixed cost is {c.fixed / GB:.1f} GB and the card "
                         f"has {c.room / GB:.1f} GB of room ({c.free / GB:.1f} GB free of {c.total / GB:.1f} GB, "
                         f"memory.margin_gb kept); {options}")
    sizes = fill_split(plan.micro_batch, caps, minimum=minimum)
    if sizes is None:
        raise UsageError(no_fit_message(plan, caps, minimum=minimum, accum_steps=accum_steps, options=options))
    for c, s in zip(plan.cards, sizes):
        c.predict(s)


def no_fit_message(plan: Plan, caps: list[int], *, minimum: int, accum_steps: int, options: str) -> str:
    if plan.micro_batch < minimum * len(caps):
        return (f"micro-batch {plan.micro_batch} does not fit {len(caps)} ranks at {minimum} sample(s) each; "
                f"raise train.batch_size to at least {minimum * len(caps)} x train.accum_steps")
    fits = sum(caps) if all(c >= minimum for c in caps) else 0
    per_card = ", ".join(
        f"{c.label} {c.free / GB:.1f} GB free of {c.total / GB:.1f} GB, fits {cap}" for c, cap in zip(plan.cards, caps)
    )
    largest = fits * accum_steps
    head = (f"global batch {plan.micro_batch * accum_steps} does not fit: the largest that fits is {largest} "
            f"({fits} per micro-step x {accum_steps} accumulation steps)" if fits else
            f"global batch {plan.micro_batch * accum_steps} does not fit: a card cannot hold "
            f"{'one sample' if minimum else 'the model'}")
    return f"{head}; {per_card}; {options}"


def apply_fixed(plan: Plan, sizes: list[int]) -> None:
    """Shares the user chose (even, explicit, gpu0_batch): predicted where the cards were measured."""
    for c, s in zip(plan.cards, sizes):
        c.predict(s)


# -- cache ---------------------------------------------------------------------------------------------

def read_cache(run_dir: Path | None, key: dict, cards: list[CardPlan]) -> Plan | None:
    """The cached plan when it was made for this setup on these cards and each card still has the room it
    assumed; None (re-plan) otherwise."""
    if run_dir is None:
        return None
    path = Path(run_dir) / CACHE_NAME
    if not path.is_file():
        return None
    try:
        plan = Plan.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        log.info("memory plan: %s is unreadable; planning again", path)
        return None
    if plan.key != key:
        log.info("memory plan: %s was made for another setup; planning again", path)
        return None
    if [c.uuid for c in plan.cards] != [c.uuid for c in cards]:
        log.info("memory plan: the cards changed since %s; planning again", path)
        return None
    for old, now in zip(plan.cards, cards):
        if old.predicted_reserved is not None and old.predicted_reserved > now.room:
            log.info("memory plan: %s now has %.1f GB of room, the cached plan needs %.1f GB; planning again",
                     now.label, now.room / GB, old.predicted_reserved / GB)
            return None
        old.free, old.held, old.room = now.free, now.held, now.room
    plan.reused = True
    return plan


def write_cache(run_dir: Path | None, plan: Plan) -> None:
    if run_dir is None:
        return
    from job.rundir import write_atomic

    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / CACHE_NAME, json.dumps(plan.to_json(), indent=2) + "\n")
    except OSError as e:  # the plan still holds for this run; only the reuse on resume is lost
        log.warning("memory plan: cannot write %s (%s); a resumed run will plan again", run_dir / CACHE_NAME,
                    e.strerror or e)


# -- measuring on the card (torch) ---------------------------------------------------------------------

def card_state(device, label: str, *, cap_gb: float | None, margin_gb: float) -> CardPlan:
    """The card behind `device` as the plan starts: size, free memory (driver), what this job holds."""
    import torch

    if device.type != "cuda":
        return CardPlan(label=label)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # what the allocator caches but does not use is free for the plan
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    props = torch.cuda.get_device_properties(device)
    cap = cap_gb * GB if cap_gb else None
    room = room_for(free=free, held=held, total=total, cap=cap, margin=margin_gb * GB)
    return CardPlan(label=label, name=props.name, uuid=f"GPU-{props.uuid}", total=total, free=free, held=held,
                    room=room)


def optimizer_slots(optimizer: str, momentum: float) -> int:
    """Tensors the size of the parameters that the optimizer keeps: AdamW two moments, SGD one momentum buffer."""
    return {"adamw": 2, "sgd": 1 if momentum else 0}[optimizer]


def optimizer_state_bytes(params, optimizer: str, momentum: float) -> int:
    """What the optimizer's first step allocates and keeps."""
    return optimizer_slots(optimizer, momentum) * sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def grad_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def available_host_bytes() -> int | None:
    """Host memory still free for this job: MemAvailable, capped by the cgroup's limit (a container's
    memory limit); None where neither can be read."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


def host_shortfall(*, params: int, optimizer: str, momentum: float, procs: int, shards: int,
                   available: int | None) -> str | None:
    """A CPU run keeps the weights, gradients and optimizer state in host memory. Each of its `procs`
    processes on this host builds the whole model (float32) and keeps its gradients and optimizer state,
    split over `shards` ranks under fsdp. What they need before any activation is a lower bound: above
    what is available, the run cannot fit (the kernel would end it without a word). None: it may fit."""
    if available is None:
        return None
    state = params * 4 + params * 4 * (1 + optimizer_slots(optimizer, momentum)) / shards
    need = procs * state
    if need <= available:
        return None
    from job.models import human

    return (f"this CPU run needs at least {need / GB:.1f} GB of host memory ({procs} process{'es' if procs > 1 else ''} x "
            f"{state / GB:.1f} GB: the weights, gradients and {optimizer} state of {human(params)} parameters, "
            f"before activations) and {available / GB:.1f} GB is available; train a smaller model "
            "(workload.*), in fewer processes (strategy.nprocs), or on GPUs")


def probe(card: CardPlan, device, step, *, upto: int, limit: int, extra: float = 0.0,
          extra_per_sample: float = 0.0) -> None:
    """Measure cost(b) on one card until a probe reaches `upto` samples (or the card's predicted room):
    `step(b)` runs forward + backward of b samples there and frees its gradients; `extra` (bytes) is
    what the real step keeps that a probe does not (optimizer state, ...), `extra_per_sample` the same for
    each sample of the card's share (the batches data.prefetch holds ahead). Resumes from earlier probes
    of the same card. Fills fixed/per_sample (reserved), alloc_fixed/alloc_per_sample and capacity."""
    points = [tuple(int(v) for v in p) for p in card.probes]
    budget = card.room - extra
    while not card.probe_failed:
        last = points[-1][0] if points else 0
        if last >= min(upto, limit):
            break
        if len(points) > 1:
            fixed, slope = fit_line([(p[0], p[2]) for p in points])
            nxt = min(upto, limit, 2 * last, capacity(budget, fixed, slope + extra_per_sample, limit=limit))
        else:
            nxt = min(upto, limit, 2 * last) if last else 1
        if nxt <= last:
            break
        measured = _measure(device, step, nxt)
        if measured is None:  # out of memory although predicted to fit: the card stops below nxt
            log.warning("memory plan: %s ran out of memory probing %d samples (caught); its limit is below that",
                        card.label, nxt)
            card.probe_failed = True
            break
        points.append((nxt, *measured))
    card.probes = [list(p) for p in points]
    if not points:
        card.fixed = card.alloc_fixed = float(card.room + 1)
        card.per_sample = card.alloc_per_sample = 0.0
        card.capacity = 0
        return
    fixed, slope = fit_line([(p[0], p[2]) for p in points])
    afixed, aslope = fit_line([(p[0], p[1]) for p in points])
    card.fixed, card.per_sample = fixed + extra, slope + extra_per_sample
    card.alloc_fixed, card.alloc_per_sample = afixed + extra, aslope + extra_per_sample
    fits = capacity(card.room, card.fixed, card.per_sample, limit=limit)
    if card.probe_failed:
        fits = min(fits, points[-1][0])  # the probe above the last point failed: trust the measurement
    card.capacity = fits


def probed_up_to(card: CardPlan) -> int:
    return int(card.probes[-1][0]) if card.probes else 0


def auto_plan(plan: Plan, local: dict, exchange, *, minimum: int, accum_steps: int, options: str) -> None:
    """Probe the cards this process drives (`local`: card index -> probe_upto(b)), share what each card
    measured with the other ranks (`exchange(cards) -> every rank's cards`, identity in one process),
    choose the split; where a card's share is above what it was probed at, probe it up to its share and
    choose again, so the prediction is measured near where the card will run. Every rank sees the same
    cards and makes the same choice, so all leave the loop together."""
    even = max(1, math.ceil(plan.micro_batch / len(plan.cards)))
    want = {k: even for k in local}
    for _ in range(6):
        for k, probe_upto in local.items():
            probe_upto(want[k])
        plan.cards = exchange(plan.cards)
        choose(plan, minimum=minimum, accum_steps=accum_steps, options=options)
        short = [k for k, c in enumerate(plan.cards)
                 if c.samples > probed_up_to(c) and not c.probe_failed]
        if not short:
            return
        want = {k: plan.cards[k].samples for k in local}


def _measure(device, step, b: int) -> tuple[int, int] | None:
    """(peak allocated, peak reserved) of `step(b)` from an empty cache; None on out of memory."""
    import torch

    with torch.cuda.device(device):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        oom = False
        try:
            step(b)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            oom = True  # handled below, once the exception (and the tensors its frames hold) is gone
        if oom:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return None
        out = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return out


@dataclass
class Context:
    """What a strategy needs to plan: the trainer builds it once, before the first step."""

    micro_batch: int
    accum_steps: int
    margin_gb: float
    cap_gb: list[float]             # [] none, [a] every card, one per visible card
    make_batch: object = None       # (b, device) -> (x, y): probe inputs shaped like the real ones
    loss_fn: object = None          # loss(output, target, reduction="sum")
    precision: object = None        # job.precision.Precision: the probes' autocast (None: off)
    optimizer_bytes: object = None  # params -> bytes the first optimizer step will keep
    batches_ahead: int = 0          # moved batches alive beside the one training (data.prefetch_depth)
    run_dir: Path | None = None
    key: dict = field(default_factory=dict)  # what a cached plan must match

    def cap_for(self, index: int) -> float | None:
        if not self.cap_gb:
            return None
        return float(self.cap_gb[0] if len(self.cap_gb) == 1 else self.cap_gb[index])

    def sample_bytes(self, device) -> int:
        """One sample's inputs (x and y) on `device`, as the step receives them."""
        x, y = self.make_batch(1, device)
        return x.numel() * x.element_size() + y.numel() * y.element_size()

    def card(self, device, label: str, index: int) -> CardPlan:
        return card_state(device, label, cap_gb=self.cap_for(index), margin_gb=self.margin_gb)

    def probe_step(self, module, device):
        """step(b): forward + backward of b probe samples through `module` on `device`, gradients freed."""
        import torch

        from job.precision import Precision

        precision = self.precision or Precision("off", device.type)  # off: autocast disabled, as in the run
        buffers = list(module.buffers())

        def step(b: int) -> None:
            # BatchNorm's running statistics must not learn from probe inputs: restored after each probe.
            saved = [t.clone() for t in buffers]
            x, y = self.make_batch(b, device)
            try:
                with precision.autocast(device.type):
                    loss = self.loss_fn(module(x), y, reduction="sum")
                loss.backward()
            finally:
                for p in module.parameters():
                    p.grad = None
                with torch.no_grad():
                    for t, old in zip(buffers, saved):
                        t.copy_(old)

        return step


OPTIONS = ("lower train.batch_size, raise train.accum_steps (same global batch, smaller micro-batches), "
           "or try train.activation_checkpointing=true or train.amp=bf16")
