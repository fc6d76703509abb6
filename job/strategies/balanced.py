"""`balanced`: one process, one persistent replica per card, an uneven split that evens out memory.

What DataParallel does every step, and what this does instead:
- replicate the model from GPU 0 (Python-heavy, every step)   -> replicas built once; they stay equal
  because every card applies the same all-reduced gradient with its own optimizer state (as DDP does);
- run replicas in fresh threads (cuDNN's per-thread autotune cache is lost each step: 18x slower)
                                                                -> one persistent thread per card, or with
  strategy.replica_threads=false every card's forward launched from the main thread in turn (kernels run
  asynchronously, and one thread does not hand Python's GIL back and forth at every operation: faster
  when Python, not the GPUs, is the limit); either way cudnn.benchmark stays on and tunes once;
- gather every output onto GPU 0 and compute the loss there (the GPU-0 pile-up)
                                                                -> each replica computes the *sum* of its
  samples' losses; only those scalars cross to GPU 0, divided by the global sample count, so the loss is
  exactly the full-batch mean whatever the split;
- keep master weights, gradients and optimizer state on GPU 0  -> every card holds its own (symmetric);
- (DDP across processes) sum the gradients in buckets during the backward
                                                                -> the same, in one process (comm.py).

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

import torch
from torch import nn

from job import memplan, phases
from job.errors import UsageError
from job.strategies import comm, graphs
from job.strategies.base import Strategy, optimizer_state_tensors, parse_gpu0, parse_mode, split_sizes
from job.strategies.workers import Worker, result

__all__ = ["BalancedStrategy", "parse_gpu0", "split_sizes"]
log = logging.getLogger("job")


class BalancedStrategy(Strategy):
    name = "balanced"
    min_share = 0  # a card may only coordinate (GPU 0 with strategy.gpu0_batch=0)

    def __init__(self, scfg, **kw):
        super().__init__(scfg, **kw)
        self.replicas: list[nn.Module] = []
        self.workers: list[Worker] = []
        self.micro_batch = 0
        self.mode: str | list[int] = "even"
        self._last_sizes: list[int] | None = None
        self._sync = True
        self.reducer: comm.GradReducer | None = None
        self._stats: list[comm.FlatViews] = []  # per replica: BatchNorm statistics (floats), then counters
        self.graphs: dict[int, graphs.StepGraph] | None = None  # strategy.cuda_graphs: card -> captured step
        self._check_every = int(scfg.check_replicas_every)  # read every step: not through OmegaConf (~12 µs a read)

    def check(self, *, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        n = len(self.devices)
        self.mode = parse_mode(self.cfg, n, micro_batch, minimum=self.min_share)
        if self.cfg.cuda_graphs and self.devices[0].type != "cuda":
            raise UsageError("strategy.cuda_graphs=true needs CUDA cards, and no GPU is visible to this run; "
                             "drop strategy.cuda_graphs or run on GPUs")
        zero_ok = isinstance(self.mode, list) and 0 in self.mode
        if n > 1 and micro_batch < n and not zero_ok:
            raise UsageError(
                f"balanced: micro-batch {micro_batch} cannot give every one of {n} cards a sample; "
                f"raise train.batch_size to at least {n} x train.accum_steps"
            )

    # -- setup ------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, loss_fn, *, compile: bool = False, blocks=None) -> None:
        super().setup(model, loss_fn)
        self.replicas = [model] + [copy.deepcopy(model).to(d) for d in self.devices[1:]]
        if compile:
            self.replicas = [torch.compile(r) for r in self.replicas]
        if self.cfg.cuda_graphs:
            self.graphs = {}
        if self.cfg.replica_threads:
            self.workers = [Worker(f"balanced-{d}") for d in self.devices[1:]]
        plain = self._plain_replicas()
        self._params = [list(r.parameters()) for r in plain]
        if len(self.replicas) > 1:
            # Each replica's normalisation statistics in flat tensors (floats, counters): one kernel
            # averages them all. Other buffers (masks, tables) are the same on every replica and left alone.
            bufs = [_running_stats(r) for r in plain]
            floats = [i for i, b in enumerate(bufs[0]) if b.is_floating_point()]
            others = [i for i, b in enumerate(bufs[0]) if not b.is_floating_point()]
            float_groups = comm.group_by(bufs[0], floats)
            groups = float_groups + comm.group_by(bufs[0], others)
            self._n_float_groups = len(float_groups)
            self._stats = [comm.rehome_buffers(r, b, groups) for r, b in zip(plain, bufs)]
        if self.devices[0].type == "cuda" and len(self.devices) > 1:
            log.info("balanced: %d persistent replicas, forwards launched %s: cudnn.benchmark stays %s "
                     "(tuned once)", len(self.devices),
                     "from one thread per card" if self.workers else "from the main thread in turn",
                     "on" if torch.backends.cudnn.benchmark else "off")
        self.sizes = split_sizes(self.micro_batch, len(self.devices)) if self.micro_batch else []

    def plan_memory(self, planning) -> memplan.Plan:
        """Every card probed with its own replica (one at a time: the probes measure one card each)."""
        n, mb = len(self.devices), planning.micro_batch
        cards = [planning.card(d, str(d), k) for k, d in enumerate(self.devices)]
        plan = memplan.Plan(mode="auto", micro_batch=mb, cards=cards, key=planning.key)
        if self.mode == "auto" and self.devices[0].type == "cuda":
            cached = memplan.read_cache(planning.run_dir, planning.key, cards)
            if cached is not None:
                plan = cached
            else:
                plain = self._plain_replicas()
                extra = planning.optimizer_bytes(self._params[0])
                # The whole micro-batch's inputs arrive on card 0 before they are split, and so do the batches
                # data.prefetch holds ahead.
                inputs = mb * planning.sample_bytes(self.devices[0]) * (1 + planning.batches_ahead)

                def prober(k: int):
                    step = planning.probe_step(plain[k], self.devices[k])

                    def probe_upto(b: int) -> None:
                        memplan.probe(plan.cards[k], self.devices[k], step, upto=b, limit=mb,
                                      extra=extra + (inputs if k == 0 else 0))
                    return probe_upto

                memplan.auto_plan(plan, {k: prober(k) for k in range(n)}, lambda c: c, minimum=self.min_share,
                                  accum_steps=planning.accum_steps, options=memplan.OPTIONS)
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
                             "resume it with the strategy that wrote it, or start over with train.resume=overwrite")
        n, groups, state = self._n_params, [], {}
        for k in range(len(self.replicas)):
            g = dict(sd["param_groups"][0])
            g["params"] = [k * n + i for i in g["params"]]
            groups.append(g)
            for i, s in sd["state"].items():
                state[k * n + int(i)] = {key: (v.clone() if torch.is_tensor(v) else v) for key, v in s.items()}
        opt.load_state_dict({"state": state, "param_groups": groups})

    def set_training(self, mode: bool) -> None:
        for r in self.replicas:
            r.train(mode)

    def _plain_replicas(self) -> list[nn.Module]:
        return [getattr(r, "_orig_mod", r) for r in self.replicas]

    # -- one micro-step ---------------------------------------------------------------------------
    def loss(self, x, y):
        total = x.shape[0]
        sizes = self.sizes if sum(self.sizes) == total else split_sizes(total, len(self.devices))
        xs, ys = x.split(sizes), y.split(sizes)
        grad = torch.is_grad_enabled()

        def forward(k: int):
            dev = self.devices[k]
            xk = xs[k].to(dev, non_blocking=True)
            yk = ys[k].to(dev, non_blocking=True)
            graph = self.graphs.get(k) if self.graphs is not None and grad else None
            if graph is not None and graph.matches(xk, yk, self.precision.key()) and self.replicas[k].training:
                with torch.cuda.device(dev):
                    return graph.run(xk, yk)
            on_card = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
            with on_card, torch.set_grad_enabled(grad), self.precision.autocast(dev.type):
                with phases.mark("forward"):
                    out = self.replicas[k](xk)
                with phases.mark("loss"):
                    return self.loss_fn(out, yk, reduction="sum")

        # Graphed steps need the gradients in buckets even on one card: autograd adds the graph's gradients
        # into them (a gradient it could take over would be the graph's own buffer, overwritten next step).
        if grad and (len(self.replicas) > 1 or self.graphs is not None):
            if self.reducer is None:  # after the memory plan, whose probes measure gradients without buckets
                self.reducer = comm.GradReducer(self._params, self.devices, self.cfg.bucket_mb)
            if self.graphs is not None:
                self._capture(xs, ys, sizes)
            self.reducer.prepare([n > 0 for n in sizes], sync=self._sync)
        if not self.workers:  # every card's forward launched from this thread in turn (no GIL hand-offs)
            sums = [forward(k) for k in range(len(self.devices)) if sizes[k]]
        else:
            pending = [(k, self.workers[k - 1].submit(lambda k=k: forward(k)))
                       for k in range(1, len(self.devices)) if sizes[k]]
            sums = [forward(0)] if sizes[0] else []
            sums += [result(done) for _, done in pending]
        self._last_sizes = sizes
        dev0 = self.devices[0]
        # Only scalars cross to GPU 0: the mean over all samples, whatever the split.
        return torch.stack([s.to(dev0) for s in sums]).sum() / total

    def _capture(self, xs, ys, sizes: list[int]) -> None:
        """At the first training micro-step of the planned split, capture every card's step (here in the main
        thread, before any replica runs); later shapes run eagerly."""
        if self.graphs or sizes != self.sizes or not self.replicas[0].training:
            return
        for k, dev in enumerate(self.devices):
            if sizes[k]:
                x, y = xs[k].to(dev), ys[k].to(dev)
                self.graphs[k] = graphs.capture(k, self.replicas[k], self.loss_fn, x, y, amp=self.precision.key())
        log.info("balanced: each card's step captured as CUDA graphs (shares %s); other shapes run eagerly",
                 [n for n in sizes if n])

    @contextlib.contextmanager
    def backward_sync(self, enabled: bool):
        self._last_sizes, self._sync = None, enabled
        yield
        if self._last_sizes is not None:  # after backward: BatchNorm's saved inputs are no longer needed
            self._average_buffers(self._last_sizes)
        if self.reducer is not None:
            self.reducer.finish()

    def _average_buffers(self, sizes: list[int]) -> None:
        """After a micro-step, every replica's running statistics (BatchNorm, InstanceNorm) become the sample-weighted mean of what
        the replicas computed (for running means this equals one process's update on the whole batch);
        counters (num_batches_tracked) come from the replica with the largest share. A card with a small
        or empty share therefore neither loses nor dilutes the statistics, and replica 0 (which the
        checkpoint saves) holds them too."""
        if not self._stats:
            return
        total = sum(sizes)
        src = max(range(len(sizes)), key=lambda k: (sizes[k], -k))
        nf = self._n_float_groups
        with torch.no_grad():
            for g in range(len(self._stats[0].flats)):
                flats = [home.flats[g] for home in self._stats]
                if g < nf:
                    for flat, n in zip(flats, sizes):
                        flat.mul_(n / total)
                    comm.allreduce_sum(flats, self.devices)
                else:
                    for k, flat in enumerate(flats):
                        if k != src:
                            flat.copy_(flats[src], non_blocking=True)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """One process's clipping: the norm of one replica's (all-reduced, identical) gradients, and the
        same factor applied on every replica (a norm over the optimizer's params would count each copy)."""
        grads = [p.grad for p in self._params[0] if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
        for k, params in enumerate(self._params):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(self.devices[k]))
        return total

    def on_step_end(self, step: int) -> None:
        every = self._check_every
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
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None

    def memory_tensors(self, optimizer) -> list[dict[str, list[torch.Tensor]]]:
        """Card k holds replica k: its parameters and buffers, its gradients (the reducer's buckets whole, which
        stay allocated between steps) and its share of the one optimizer's state."""
        out = []
        for k, (replica, params) in enumerate(zip(self._plain_replicas(), self._params, strict=True)):
            grads = [p.grad for p in params if p.grad is not None]
            if self.reducer is not None:
                grads = list(self.reducer.homes[k].flats) + grads
            out.append({"parameters": params + list(replica.buffers()), "gradients": grads,
                        "optimizer_state": optimizer_state_tensors(optimizer, params)})
        return out


def _running_stats(module: nn.Module) -> list[torch.Tensor]:
    """The running statistics of the normalisation layers (running mean/var, batches tracked), in order."""
    from torch.nn.modules.batchnorm import _NormBase

    return [b for m in module.modules() if isinstance(m, _NormBase)
            for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
