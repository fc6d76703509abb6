"""`balanced`: one process, one persistent replica per card, an uneven split that evens out memory.

What DataParallel does every step, and what this does instead:
- replicate the model from GPU 0 (Python-heavy, every step)   -> replicas built once; they stay equal
  because every card applies the same all-reduced gradient with its own optimizer state (as DDP does);
- run replicas in fresh threads (cuDNN's per-thread autotune cache is lost each step: 18x slower)
                                                                -> one persistent thread per card, so
  cudnn.benchmark stays on and tunes once;
- gather every output onto GPU 0 and compute the loss there (the GPU-0 pile-up)
                                                                -> each replica computes the *sum* of its
  samples' losses; only those scalars cross to GPU 0, divided by the global sample count, so the loss is
  exactly the full-batch mean whatever the split;
- keep master weights, gradients and optimizer state on GPU 0  -> every card holds its own (symmetric).

What remains uneven (the input batch arrives on GPU 0, which also hosts the loss scalars), and any
difference in free memory between the cards (another process on card 0, cards of different sizes), is
taken into account by the memory plan (job.memplan): `strategy.split=auto` probes each card with its own
replica and gives every card an even share unless it has no room for it; `even`, explicit shares, and
`strategy.gpu0_batch` (an int, 0 = GPU 0 only coordinates, or a fraction) fix the split instead. The
gradient, and so training, does not depend on the split.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import threading

import torch
from torch import nn

from job import memplan
from job.errors import UsageError
from job.strategies.base import Strategy, parse_gpu0, parse_mode, split_sizes

__all__ = ["BalancedStrategy", "parse_gpu0", "split_sizes"]
log = logging.getLogger("job")


class _Worker:
    """A persistent thread that runs one replica's forward (and its loss) on request."""

    def __init__(self, name: str):
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, done = job
            try:
                done.put((True, fn()))
            except BaseException as e:  # re-raised in the caller's thread
                done.put((False, e))

    def submit(self, fn) -> queue.Queue:
        done: queue.Queue = queue.Queue(maxsize=1)
        self.jobs.put((fn, done))
        return done

    def stop(self):
        self.jobs.put(None)
        self.thread.join(timeout=10)


def _result(done: queue.Queue):
    ok, value = done.get()
    if not ok:
        raise value
    return value


class BalancedStrategy(Strategy):
    name = "balanced"
    min_share = 0  # a card may only coordinate (GPU 0 with strategy.gpu0_batch=0)

    def __init__(self, scfg, **kw):
        super().__init__(scfg, **kw)
        self.replicas: list[nn.Module] = []
        self.workers: list[_Worker] = []
        self.micro_batch = 0
        self.mode: str | list[int] = "even"
        self._last_sizes: list[int] | None = None

    def check(self, *, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        n = len(self.devices)
        self.mode = parse_mode(self.cfg, n, micro_batch, minimum=self.min_share)
        zero_ok = isinstance(self.mode, list) and 0 in self.mode
        if n > 1 and micro_batch < n and not zero_ok:
            raise UsageError(
                f"balanced: micro-batch {micro_batch} cannot give every one of {n} cards a sample; "
                f"raise train.batch_size to at least {n} x train.accum_steps"
            )

    # -- setup ------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, loss_fn, *, compile: bool = False) -> None:
        super().setup(model, loss_fn)
        self.replicas = [model] + [copy.deepcopy(model).to(d) for d in self.devices[1:]]
        if compile:
            self.replicas = [torch.compile(r) for r in self.replicas]
        self.workers = [_Worker(f"balanced-{d}") for d in self.devices[1:]]
        # Listed once: the per-step gradient reduce and buffer sync walk these, not the module trees.
        plain = self._plain_replicas()
        self._params = [list(r.parameters()) for r in plain]
        self._buffers = [list(r.buffers()) for r in plain]
        if self.devices[0].type == "cuda" and len(self.devices) > 1:
            log.info("balanced: %d persistent replicas, one thread each: cudnn.benchmark stays %s "
                     "(each thread tunes once)", len(self.devices),
                     "on" if torch.backends.cudnn.benchmark else "off")
        self.sizes = split_sizes(self.micro_batch, len(self.devices)) if self.micro_batch else []

    def plan_memory(self, ctx) -> memplan.Plan:
        """Every card probed with its own replica (one at a time: the probes measure one card each)."""
        n, mb = len(self.devices), ctx.micro_batch
        cards = [ctx.card(d, str(d), k) for k, d in enumerate(self.devices)]
        plan = memplan.Plan(mode="auto", micro_batch=mb, cards=cards, key=ctx.key)
        if self.mode == "auto" and self.devices[0].type == "cuda":
            cached = memplan.read_cache(ctx.run_dir, ctx.key, cards)
            if cached is not None:
                plan = cached
            else:
                plain = self._plain_replicas()
                extra = ctx.optimizer_bytes(self._params[0])
                x0, y0 = ctx.make_batch(1, self.devices[0])
                # The whole micro-batch's inputs arrive on card 0 before they are split.
                inputs = mb * (x0.numel() * x0.element_size() + y0.numel() * y0.element_size())
                del x0, y0

                def prober(k: int):
                    step = ctx.probe_step(plain[k], self.devices[k])

                    def probe_upto(b: int) -> None:
                        memplan.probe(plan.cards[k], self.devices[k], step, upto=b, limit=mb,
                                      extra=extra + (inputs if k == 0 else 0))
                    return probe_upto

                memplan.auto_plan(plan, {k: prober(k) for k in range(n)}, lambda c: c, minimum=self.min_share,
                                  accum_steps=ctx.accum_steps, options=memplan.OPTIONS)
        else:
            if isinstance(self.mode, list):
                sizes, plan.mode = self.mode, "explicit"
            else:
                sizes, plan.mode = split_sizes(mb, n), "even"
            memplan.apply_fixed(plan, sizes)
        self.sizes = plan.sizes
        if n > 1:
            log.info("balanced: split %s of micro-batch %d (%s)", self.sizes, mb, plan.mode)
        return plan

    def build_optimizer(self, factory):
        """One optimizer over every replica's parameters, one param group per replica (same settings):
        fused/foreach kernels run per device, and GradScaler sees every card's gradients."""
        opt = factory([{"params": params} for params in self._params])
        self._n_params = len(self._params[0])
        return opt

    def optimizer_state_dict(self, opt) -> dict:
        """Replica 0's share only, shaped like a single-model optimizer's state (strategy-independent)."""
        sd = opt.state_dict()
        n = self._n_params
        group = dict(sd["param_groups"][0])
        return {"state": {i: s for i, s in sd["state"].items() if i < n}, "param_groups": [group]}

    def load_optimizer_state_dict(self, opt, sd: dict) -> None:
        if len(sd["param_groups"]) != 1:
            raise UsageError("balanced: the checkpoint's optimizer has several param groups; "
                             "resume it with the strategy that wrote it, or train.resume=never")
        n, groups, state = self._n_params, [], {}
        for k in range(len(self.replicas)):
            g = dict(sd["param_groups"][0])
            g["params"] = [k * n + i for i in g["params"]]
            groups.append(g)
            for i, s in sd["state"].items():
                state[k * n + int(i)] = {key: (v.clone() if torch.is_tensor(v) else v) for key, v in s.items()}
        opt.load_state_dict({"state": state, "param_groups": groups})

    def _plain_replicas(self) -> list[nn.Module]:
        return [getattr(r, "_orig_mod", r) for r in self.replicas]

    # -- one micro-step ---------------------------------------------------------------------------
    def loss(self, x, y):
        total = x.shape[0]
        sizes = self.sizes if sum(self.sizes) == total else split_sizes(total, len(self.devices))
        xs, ys = x.split(sizes), y.split(sizes)
        amp = {d.type: (torch.is_autocast_enabled(d.type), torch.get_autocast_dtype(d.type)) for d in self.devices}
        grad = torch.is_grad_enabled()

        def forward(k: int):
            dev = self.devices[k]
            xk = xs[k].to(dev, non_blocking=True)
            yk = ys[k].to(dev, non_blocking=True)
            enabled, dtype = amp[dev.type]
            ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
            with ctx, torch.set_grad_enabled(grad), torch.autocast(dev.type, dtype=dtype, enabled=enabled):
                return self.loss_fn(self.replicas[k](xk), yk, reduction="sum")

        pending = [(k, self.workers[k - 1].submit(lambda k=k: forward(k)))
                   for k in range(1, len(self.devices)) if sizes[k]]
        sums = [forward(0)] if sizes[0] else []
        sums += [_result(done) for _, done in pending]
        self._last_sizes = sizes
        dev0 = self.devices[0]
        # Only scalars cross to GPU 0: the mean over all samples, whatever the split.
        return torch.stack([s.to(dev0) for s in sums]).sum() / total

    @contextlib.contextmanager
    def backward_sync(self, enabled: bool):
        self._last_sizes = None
        yield
        if self._last_sizes is not None:  # after backward: BatchNorm's saved inputs are no longer needed
            self._average_buffers(self._last_sizes)
        if enabled and len(self.replicas) > 1:
            self._allreduce_grads()

    def _allreduce_grads(self) -> None:
        """Sum every replica's gradients (each is its samples' share of the full-batch mean). A parameter
        that got no gradient on any replica keeps none, as in one process (no zeros for AdamW to decay);
        a replica that trained no samples takes the others'."""
        per_replica = self._params
        used = [i for i in range(len(per_replica[0])) if any(params[i].grad is not None for params in per_replica)]
        if not used:
            return
        flats = []
        for params in per_replica:
            grads = [params[i].grad if params[i].grad is not None else torch.zeros_like(params[i]) for i in used]
            flats.append(_flatten(grads))
        _allreduce_sum(flats, self.devices)
        for params, flat in zip(per_replica, flats):
            chosen = [params[i] for i in used]
            for p, g in zip(chosen, _unflatten(flat, chosen)):
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)

    def _average_buffers(self, sizes: list[int]) -> None:
        """After a micro-step, every replica's BatchNorm statistics become the sample-weighted mean of what
        the replicas computed (for running means this equals one process's update on the whole batch);
        counters (num_batches_tracked) come from the replica with the largest share. A card with a small
        or empty share therefore neither loses nor dilutes the statistics, and replica 0 (which the
        checkpoint saves) holds them too."""
        bufs = self._buffers
        if len(self.replicas) < 2 or not bufs[0]:
            return
        total = sum(sizes)
        floats = [i for i, b in enumerate(bufs[0]) if b.is_floating_point()]
        others = [i for i, b in enumerate(bufs[0]) if not b.is_floating_point()]
        src = max(range(len(sizes)), key=lambda k: (sizes[k], -k))
        with torch.no_grad():
            if floats:
                flats = [_flatten([bufs[k][i] * (sizes[k] / total) for i in floats])
                         for k in range(len(bufs))]
                _allreduce_sum(flats, self.devices)
                for k, flat in enumerate(flats):
                    targets = [bufs[k][i] for i in floats]
                    for t, v in zip(targets, _unflatten(flat, targets)):
                        t.copy_(v)
            for k in range(len(bufs)):
                if k != src:
                    for i in others:
                        bufs[k][i].copy_(bufs[src][i], non_blocking=True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """One process's clipping: the norm of one replica's (all-reduced, identical) gradients, and the
        same factor applied on every replica (a norm over the optimizer's params would count each copy)."""
        grads = [p.grad for p in self._params[0] if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
        for k, params in enumerate(self._params):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(self.devices[k]))
        return total

    def on_step_end(self, step: int) -> None:
        every = self.cfg.check_replicas_every
        if every and step % every == 0 and len(self.replicas) > 1:
            self.check_replicas(step)

    def check_replicas(self, step: int) -> None:
        """The replicas must stay identical (same gradient, same optimizer); a drift is a bug: fail loudly."""
        with torch.no_grad():
            ref = self._params[0]
            for k in range(1, len(self._params)):
                worst = max(((p.detach().to(ref[0].device) - q.detach()).abs().max().item() for p, q in
                            zip(self._params[k], ref)), default=0.0)
                if worst > 0:
                    raise RuntimeError(f"balanced: replica {k} ({self.devices[k]}) drifted from replica 0 by up to "
                                       f"{worst:.3g} at step {step}; report this with the run's config")

    def teardown(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer of same-dtype tensors (one all-reduce instead of one per tensor)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `like`."""
    return [chunk.view_as(t) for chunk, t in zip(flat.split([t.numel() for t in like]), like)]


def _allreduce_sum(flats: list[torch.Tensor], devices: list[torch.device]) -> None:
    """Sum equal-shaped tensors, one per device, in place on every device."""
    if devices[0].type == "cuda":
        try:
            from torch.cuda import nccl

            if nccl.is_available(flats):
                nccl.all_reduce(flats)
                return
        except (ImportError, RuntimeError):
            pass
        reduced = torch.cuda.comm.reduce_add(flats, destination=devices[0].index)
        for f, r in zip(flats, torch.cuda.comm.broadcast(reduced, [d.index for d in devices])):
            f.copy_(r)
        return
    total = flats[0].clone()
    for f in flats[1:]:
        total += f
    for f in flats:
        f.copy_(total)
