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

What remains uneven (the input batch arrives on GPU 0, which also hosts the loss scalars) is measured
and corrected by the split: `strategy.gpu0_batch` = an int (0: GPU 0 computes nothing), a fraction, or
`auto`: after one warm-up step, run `calibration_steps` steps at an even split and as many at a shifted
one (after one settling step: a new shape's first step allocates and autotunes), fit per-card peak = intercept_k + slope x samples_k (one shared slope: the replicas are the same
model), and pick the integer split that minimises the largest predicted peak. Calibration steps are real
training steps (the gradient does not depend on the split). The choice is logged with predicted and
measured peaks and cached in the run directory, so a resumed run does not calibrate again.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import queue
import threading
from pathlib import Path

import torch
from torch import nn

from job.errors import UsageError
from job.strategies.base import Strategy

log = logging.getLogger("job")
CACHE_NAME = "balanced_split.json"


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
    """Samples per card: GPU 0 gets `gpu0` (even share if None), the rest spread evenly, remainders to
    the lowest card indices first. Deterministic; sums to total; never negative."""
    if n < 1 or total < 0:
        raise ValueError(f"cannot split {total} samples over {n} cards")
    if n == 1:
        return [total]
    if gpu0 is None:
        base, rem = divmod(total, n)
        return [base + (1 if k < rem else 0) for k in range(n)]
    if not 0 <= gpu0 <= total:
        raise ValueError(f"gpu0={gpu0} outside 0..{total}")
    base, rem = divmod(total - gpu0, n - 1)
    return [gpu0] + [base + (1 if k < rem else 0) for k in range(n - 1)]


def best_split(total: int, intercepts: list[float], slope: float) -> list[int]:
    """Integer split minimising max_k(intercept_k + slope * b_k): give each sample to the card whose
    peak would be lowest after taking it (optimal for increasing linear costs; ties to the lower index)."""
    sizes = [0] * len(intercepts)
    for _ in range(total):
        k = min(range(len(sizes)), key=lambda i: (intercepts[i] + slope * (sizes[i] + 1), i))
        sizes[k] += 1
    return sizes


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

    def __init__(self, scfg, **kw):
        super().__init__(scfg, **kw)
        self.replicas: list[nn.Module] = []
        self.workers: list[_Worker] = []
        self.sizes: list[int] | None = None
        self.micro_batch = 0
        self.fixed: int | None = None
        self.run_dir: Path | None = None
        self._calib: dict | None = None
        self._steps = 0

    def check(self, *, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        self.fixed = parse_gpu0(self.cfg.gpu0_batch, micro_batch)
        n = len(self.devices)
        if n > 1 and micro_batch < n - (1 if self.fixed == 0 else 0):
            raise UsageError(
                f"balanced: micro-batch {micro_batch} cannot give every one of {n} cards a sample; "
                f"raise train.batch_size to at least {n} x train.accum_steps"
            )
        if self.cfg.calibration_steps < 1:
            raise UsageError(f"strategy.calibration_steps={self.cfg.calibration_steps} must be at least 1")

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
        self.sizes = self._initial_sizes()

    def _initial_sizes(self) -> list[int]:
        n, mb = len(self.devices), self.micro_batch
        if n == 1:
            return [mb]
        if self.fixed is not None:
            sizes = split_sizes(mb, n, self.fixed)
            log.info("balanced: split %s of micro-batch %d (strategy.gpu0_batch=%s)", sizes, mb, self.cfg.gpu0_batch)
            return sizes
        cached = self._read_cache()
        if cached:
            log.info("balanced: split %s from %s (calibrated earlier; not recalibrating)", cached,
                     self.run_dir / CACHE_NAME)
            return cached
        self._calib = {"phase": "warmup", "left": 1, "trials": []}
        return split_sizes(mb, n)

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
        sizes = self.sizes if sum(self.sizes) == total else split_sizes(total, len(self.devices), None)
        self._sync_buffers()
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
        dev0 = self.devices[0]
        # Only scalars cross to GPU 0: the mean over all samples, whatever the split.
        return torch.stack([s.to(dev0) for s in sums]).sum() / total

    @contextlib.contextmanager
    def backward_sync(self, enabled: bool):
        yield
        if enabled and len(self.replicas) > 1:
            self._allreduce_grads()

    def _allreduce_grads(self) -> None:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        per_replica = self._params
        flats = []
        for params in per_replica:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flats.append(_flatten_dense_tensors(grads))
        _allreduce_sum(flats, self.devices)
        for params, flat in zip(per_replica, flats):
            for p, g in zip(params, _unflatten_dense_tensors(flat, params)):
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)

    def _sync_buffers(self) -> None:
        """BatchNorm running stats etc.: replica 0's win (as DDP's broadcast_buffers)."""
        if len(self.replicas) < 2:
            return
        bufs = self._buffers
        if not bufs[0]:
            return
        with torch.no_grad():
            for k in range(1, len(bufs)):
                for src, dst in zip(bufs[0], bufs[k]):
                    dst.copy_(src, non_blocking=True)

    # -- auto calibration -------------------------------------------------------------------------
    def on_step_end(self, step: int) -> None:
        c = self._calib
        if c is None:
            return
        if c.pop("settle", False):
            # The first step at a new split allocates and (with cudnn.benchmark) autotunes for the new
            # shapes: its peak is not the steady state, so measuring starts after it.
            self._reset_peaks()
            return
        c["left"] -= 1
        if c["left"] > 0:
            return
        if c["phase"] == "warmup":
            self._reset_peaks()
            c.update(phase="trial", left=self.cfg.calibration_steps)
            return
        if c["phase"] == "trial":
            c["trials"].append((list(self.sizes), self._peaks()))
            if len(c["trials"]) == 1:
                self.sizes = self._shifted(self.sizes)
                c.update(left=self.cfg.calibration_steps, settle=True)
                return
            self._choose()
            self._release_cache()
            c.update(phase="verify", left=self.cfg.calibration_steps, settle=True)
            return
        if c["phase"] == "verify":
            measured = self._peaks()
            log.info("balanced: measured peaks %s GB at split %s (predicted %s GB)",
                     _gb(measured), self.sizes, _gb(c["predicted"]))
            self._write_cache(measured)
            self._calib = None

    def _shifted(self, sizes: list[int]) -> list[int]:
        """A second trial split: move a quarter of the largest share to the smallest."""
        hi = max(range(len(sizes)), key=lambda k: (sizes[k], -k))
        lo = min((k for k in range(len(sizes)) if k != hi), key=lambda k: (sizes[k], k))
        d = max(1, sizes[hi] // 4)
        new = list(sizes)
        new[hi] -= d
        new[lo] += d
        return new

    def _choose(self) -> None:
        (sa, pa), (sb, pb) = self._calib["trials"]
        slopes = [(pb[k] - pa[k]) / (sb[k] - sa[k]) for k in range(len(sa)) if sb[k] != sa[k]]
        # Memory grows with samples; a flat or negative fit (noise, or a card with nothing to move)
        # falls back to the smallest positive slope, which keeps the choice close to even.
        slope = max(sum(slopes) / len(slopes), 1.0) if slopes else 1.0
        intercepts = [pa[k] - slope * sa[k] for k in range(len(sa))]
        self.sizes = best_split(self.micro_batch, intercepts, slope)
        predicted = [intercepts[k] + slope * self.sizes[k] for k in range(len(sa))]
        self._calib["predicted"] = predicted
        log.info("balanced: auto split %s of micro-batch %d; per-sample %.1f MB; trials %s -> %s GB and %s -> "
                 "%s GB; predicted peaks %s GB", self.sizes, self.micro_batch, slope / 2**20, sa, _gb(pa), sb,
                 _gb(pb), _gb(predicted))

    def _release_cache(self) -> None:
        """Give back what the trial splits reserved, so reserved/NVML figures show the chosen split."""
        for d in self.devices:
            if d.type == "cuda":
                with torch.cuda.device(d):
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()

    def _reset_peaks(self) -> None:
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
                torch.cuda.reset_peak_memory_stats(d)

    def _peaks(self) -> list[float]:
        out = []
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
                out.append(float(torch.cuda.max_memory_allocated(d)))
            else:
                out.append(0.0)
        return out

    def _cache_key(self) -> dict:
        names = [torch.cuda.get_device_name(d) if d.type == "cuda" else "cpu" for d in self.devices]
        return {"micro_batch": self.micro_batch, "devices": names}

    def _read_cache(self) -> list[int] | None:
        if self.run_dir is None or not (self.run_dir / CACHE_NAME).is_file():
            return None
        try:
            doc = json.loads((self.run_dir / CACHE_NAME).read_text())
        except (OSError, ValueError):
            return None
        if doc.get("key") != self._cache_key() or sum(doc.get("sizes", [])) != self.micro_batch:
            log.info("balanced: cached split in %s is for another setup; recalibrating", self.run_dir / CACHE_NAME)
            return None
        return list(doc["sizes"])

    def _write_cache(self, measured: list[float]) -> None:
        if self.run_dir is None or not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        doc = {"key": self._cache_key(), "sizes": self.sizes, "predicted_peak_bytes": self._calib["predicted"],
               "measured_peak_bytes": measured, "trials": self._calib["trials"]}
        from job.rundir import write_atomic

        try:
            write_atomic(self.run_dir / CACHE_NAME, json.dumps(doc, indent=2) + "\n")
        except OSError as e:  # a full disk costs the cache (a resume recalibrates), not the run
            log.warning("balanced: cannot cache the split in %s (%s)", self.run_dir / CACHE_NAME, e.strerror)

    def teardown(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []


def _gb(values: list[float]) -> list[float]:
    return [round(v / 1e9, 2) for v in values]


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
