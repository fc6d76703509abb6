"""Batches: deterministic by position, so a resumed or re-split run sees exactly the same samples.

A run consumes global sample ids 0, 1, 2, ... in micro-batches of B = train.batch_size / train.accum_steps.
A process that trains a slice of it (a DDP rank) takes its contiguous share of those ids, whatever the split
(even or uneven, job.memplan), so a run resumed under another split or accumulation sees the same samples.
A checkpoint saves the number of samples consumed (`sample_position`).

- synthetic: a pool of `data.synthetic_pool` samples from the workload's `example_batch`, made once from
  the seed, kept on the device and indexed by sample id; no host work per step, so it never limits GPU
  throughput.
- any other data.kind: the workload's `dataset` (job.workload; job.datasets has the token-file and
  image-folder readers), read by DataLoader workers with pinned memory. Sample id i of epoch e = i // n is
  item perm_e[i % n] of a fresh seeded permutation per epoch; the item index handed to the dataset is a
  `job.datasets.SampleIndex`, which carries the sample id for augmentation seeded per sample.
- held-out data (validation): data.val_path, or data.val_fraction of data.path (a fixed seeded choice of
  items, never trained on), or with synthetic data a pool from another seed; read in a fixed order.

Broken data is bad input, reported in one line naming the file: the dataset is built, and the first batch
read, before the run writes anything; a file that fails later stops the run with its line.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import math
import signal
import threading
import time
import weakref
from collections.abc import Iterator

import torch

from job import workload as wl
from job.cardgaps import idle_share
from job.datasets import BadImage, GpuSplit, SampleIndex  # noqa: F401  (BadImage: the data layer's one-line error)
from job.errors import UsageError
from job.handover import SPARE_SLOTS, HostSlots, PackedBatch, SlotBatch, SlotCollate

log = logging.getLogger("job")
SPLIT_SEED = 2_147_483_647  # the held-out choice of data.val_fraction: fixed, so train.seed does not move it
SYNTHETIC_VAL = 256  # held-out synthetic samples when eval.samples is 0


def sample_ids(g: int, micro_batch: int, *, offset: int = 0, count: int | None = None, base: int = 0) -> range:
    """Global sample ids of this process's share of the g-th micro-batch after sample `base`: `count`
    samples from position `offset` (a ddp rank's share under any split, job.memplan); all by default."""
    start = base + g * micro_batch + offset
    return range(start, start + (micro_batch if count is None else count))


class Data:
    """One run's data: the workload, its settings and the data section, and what each part of the job asks
    for (probe batches, the training stream, the held-out batches)."""

    def __init__(self, resolved: wl.Resolved, settings, dcfg, *, seed: int, device: torch.device | None = None):
        self.resolved, self.settings, self.cfg, self.seed = resolved, settings, dcfg, seed
        self.workload = resolved.workload
        self.device = device  # the training device: where data.decode=auto decodes images
        self._train: tuple | None = None
        self._split = GpuSplit() if self.adaptive else None  # made before any worker starts: they share it
        self._valset: tuple | None = None  # val_set's (dataset, indices)
        self._val: tuple | None = None  # (what it was made for, the held-out DataLoader, move): val_batches'

    @property
    def decode(self) -> str:
        """data.decode resolved: "gpu" or "cpu"."""
        cuda = self.device is not None and self.device.type == "cuda"
        if self.cfg.decode == "gpu" and not cuda:
            raise UsageError("data.decode=gpu decodes images on the training GPU, and this run trains on the CPU; "
                             "use data.decode=auto or data.decode=cpu")
        if self.cfg.decode == "auto":
            # Measured on one H200 (docs/benchmarks.md): 16 workers decoding on the CPU keep eager ResNet-50 at
            # 1.00x synthetic and compiled at 0.99x on a host whose cores decode ~700 img/s each; any share on
            # the GPU decoder was slower than the workers, eager and compiled, on every host measured (nvJPEG's
            # per-image waits queue behind the model's kernels), so with workers auto leaves the card to the
            # model. Without workers the GPU decoder is the faster by far.
            return "gpu" if cuda and not self.cfg.workers else "cpu"
        return self.cfg.decode

    @property
    def adaptive(self) -> bool:
        """data.decode=auto with workers on a GPU, from files: the workers decode, and the training stream may
        move a share of the JPEGs to the GPU decoder where it measures that this trains faster (SplitTuner)."""
        return (self.cfg.decode == "auto" and bool(self.cfg.workers) and not self.synthetic
                and self.device is not None and self.device.type == "cuda")

    @property
    def synthetic(self) -> bool:
        return self.cfg.kind == "synthetic"

    def _follows_split(self, ds) -> bool:
        """Whether dataset `ds` takes this run's GpuSplit (job.datasets.ImageFolder does; a workload's own
        dataset may ignore DataRequest.gpu_split): only then may the training stream move JPEGs."""
        return self._split is not None and getattr(ds, "gpu_split", None) is self._split

    def _dataset(self, path: str, split: str):
        request = wl.DataRequest(kind=self.cfg.kind, path=path, split=split, seed=self.seed,
                                 token_dtype=self.cfg.token_dtype, decode=self.decode,
                                 gpu_share=float(self.cfg.gpu_share), max_pixels=int(self.cfg.max_pixels),
                                 gpu_split=self._split if split == "train" else None)
        ds = wl.call(f"workload `{self.resolved.name}`: dataset(kind={self.cfg.kind}, split={split})",
                     self.workload.dataset, self.settings, request)
        if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            raise UsageError(f"workload `{self.resolved.name}`: dataset() returned a {type(ds).__name__}, not a "
                             "map-style Dataset (with __getitem__ and __len__)")
        if wl.call(f"workload `{self.resolved.name}`: len(dataset)", len, ds) == 0:
            raise UsageError(f"workload `{self.resolved.name}`: the {split} dataset at {path} holds no samples; "
                             "point data.path at data")
        return ds

    def _decoded(self, ds) -> str:
        """How the training dataset's samples are decoded, for its line ("" where it does not say)."""
        decoded = getattr(ds, "decode", None)
        if not isinstance(decoded, str):
            return ""
        if decoded == "gpu" and getattr(ds, "gpu_share", 1.0) < 1.0:
            decoded = f"gpu ({ds.gpu_share:.0%} of the JPEGs; the workers decode the rest)"
        if decoded == "cpu" and self._follows_split(ds):
            decoded = "cpu, a share moving to the gpu if the workers cannot keep up and it trains faster"
        return f", decoded on the {decoded} (data.decode={self.cfg.decode})"

    def train_set(self) -> tuple:
        """(dataset, the item indices that are training data); built once a run, with one line saying so."""
        if self._train is None:
            ds = self._dataset(self.cfg.path, "train")
            indices, held = list(range(len(ds))), ""
            if self.cfg.val_fraction:
                indices = held_out_split(len(ds), self.cfg.val_fraction, path=self.cfg.path)[0]
                held = f" ({len(ds) - len(indices):,} more held out: data.val_fraction={self.cfg.val_fraction})"
            log.info("data: %s %s: %s training samples%s%s", self.cfg.kind, self.cfg.path, f"{len(indices):,}", held,
                     self._decoded(ds))
            self._train = (ds, indices)
        return self._train

    def val_set(self) -> tuple | None:
        """(dataset, held-out item indices), or None where no held-out data is configured. Built once a run (a
        folder of images is listed once, not at every evaluation)."""
        d = self.cfg
        if self._valset is None and d.val_path:
            ds = self._dataset(d.val_path, "val")
            log.info("data: %s %s: %s held-out samples", d.kind, d.val_path, f"{len(ds):,}")
            self._valset = (ds, list(range(len(ds))))
        elif self._valset is None and d.val_fraction:
            ds = self._dataset(d.path, "val")
            self._valset = (ds, held_out_split(len(ds), d.val_fraction, path=d.path)[1])
        return self._valset

    def check(self) -> None:
        """Build the data sets now and read one sample of each (rank 0, before anything is written)."""
        if self.synthetic:
            return
        for ds, indices in [s for s in (self.train_set(), self.val_set()) if s is not None]:
            wl.call(f"workload `{self.resolved.name}`: dataset[{indices[0]}]", ds.__getitem__,
                    SampleIndex(indices[0], 0, self.seed))

    # -- the memory plan's probes, and the check that the model's output fits its loss ------------------
    def probe_batch(self, n: int, device: torch.device, *, channels_last: bool):
        """n samples shaped like the real ones, on `device`: from example_batch, else the dataset's first."""
        if self.workload.example_batch is not None:
            gen = torch.Generator(device=device).manual_seed(12345)
            x, y = _check_pair(self.resolved.name, "example_batch", wl.call(
                f"workload `{self.resolved.name}`: example_batch", self.workload.example_batch, self.settings, n, gen), n)
            return _format(x.to(device), channels_last), y.to(device)
        ds, indices = self.train_set()
        items = [wl.call(f"workload `{self.resolved.name}`: dataset[{indices[i % len(indices)]}]", ds.__getitem__,
                         SampleIndex(indices[i % len(indices)], i, self.seed)) for i in range(n)]
        collate, move = _hooks(self.resolved.name, ds, device, channels_last)
        return _check_pair(self.resolved.name, "dataset items", move(collate(items)), n)

    # -- the training stream ------------------------------------------------------------------------
    def batches(self, *, micro_batch: int, start: int, offset: int, count: int, device: torch.device,
                channels_last: bool, prefetch: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless iterator of this process's (x, y) micro-batches from global sample id `start` on:
        `count` samples from position `offset` of each."""
        if self.synthetic:
            pool = SyntheticPool(self, size=self.cfg.synthetic_pool, seed=self.seed + 7919, device=device)

            def gen():
                g = 0
                while True:
                    x, y = pool.batch(sample_ids(g, micro_batch, offset=offset, count=count, base=start))
                    yield _format(x, channels_last), y
                    g += 1

            return gen()
        ds, indices = self.train_set()
        order = EpochOrder(indices, seed=self.seed)
        sampler = _BatchSampler(order, start=start, micro_batch=micro_batch, offset=offset, count=count)
        tuner = None
        depth = int(self.cfg.prefetch_depth) if prefetch else 1  # batches moved ahead (without prefetch: the next)
        if self._follows_split(ds):
            tuner = SplitTuner(self._split, first_id=lambda g: start + g * micro_batch,
                               lookahead=tuner_lookahead(self.cfg.workers, depth), device=device)
        return _loader(self.resolved.name, ds, sampler, workers=self.cfg.workers, device=device, channels_last=channels_last,
                       prefetch=prefetch, depth=depth, persistent=True, nice=self.cfg.worker_nice, tuner=tuner,
                       seed=self.seed * 1_000_003 + start * 1_009 + offset)

    # -- held-out batches ---------------------------------------------------------------------------
    def has_val(self, eval_every: int) -> bool:
        return bool(self.cfg.val_path or self.cfg.val_fraction or (self.synthetic and eval_every > 0))

    def val_batches(self, *, batch: int, limit: int, rank: int, world: int, device: torch.device,
                    channels_last: bool):
        """This rank's share of every held-out batch, as (x, y, n): n real samples; a rank whose share is
        empty gets one sample with n = 0 (under fsdp every rank must run every forward). Equal counts of
        batches on every rank."""
        from job.memplan import even_split

        if self.synthetic:
            size = limit or SYNTHETIC_VAL
            pool = SyntheticPool(self, size=size, seed=self.seed + 104_729, device=device)
            total, fetch = size, None
        else:
            ds, indices = self.val_set()
            if limit:
                indices = indices[:limit]
            total, fetch = len(indices), (ds, indices)
        index_lists, counts = [], []
        for first in range(0, total, batch):
            size = min(batch, total - first)
            shares = even_split(size, world)
            lo = first + sum(shares[:rank])
            n = shares[rank]
            index_lists.append(list(range(lo, lo + n)) if n else [first])
            counts.append(n)
        if fetch is None:
            for ids, n in zip(index_lists, counts):
                x, y = pool.take(ids)
                yield _format(x, channels_last), y, n
            return
        key = (batch, limit, rank, world, str(device), channels_last)
        if self._val is None or self._val[0] != key:
            self.close()
            ds, indices = fetch
            picked = [[SampleIndex(indices[i], i, self.seed) for i in ids] for ids in index_lists]
            self._val = (key, *_held_out_loader(self.resolved.name, ds, picked, workers=self.cfg.workers,
                                                device=device, channels_last=channels_last, nice=self.cfg.worker_nice,
                                                seed=self.seed * 1_000_003 + 104_729 + rank))
        _, loader, move = self._val
        it = iter(loader)
        if self.cfg.workers:
            _WITH_WORKERS.add(it)
        for b, n in zip(it, counts):
            x, y = move(b)
            yield x, y, n

    def close(self) -> None:
        """Stop the held-out loader's workers (the training stream's stop with its iterator)."""
        if self._val is not None:
            it = self._val[1]._iterator  # None without workers
            self._val = None
            if it is not None:
                _stop_workers(it)


def held_out_split(n: int, fraction: float, *, path: str = "") -> tuple[list[int], list[int]]:
    """(training items, held-out items) of a data set of n items: a fixed seeded choice of round(n x fraction)."""
    n_val = round(n * fraction)
    if n_val < 1 or n_val >= n:
        raise UsageError(f"data.val_fraction={fraction} of the {n} samples in {path} leaves "
                         f"{'no held-out' if n_val < 1 else 'no training'} samples; use a fraction between "
                         f"{1 / n:.3g} and {(n - 1) / n:.3g}, or data.val_path")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


class EpochOrder:
    """Global sample id -> item index: epoch e = id // n visits the n items in a fresh seeded permutation."""

    def __init__(self, indices: list[int], *, seed: int):
        self.indices, self.seed = indices, seed
        self._epoch, self._perm = -1, None

    def __call__(self, ids: range) -> list[SampleIndex]:
        """The samples `ids` (consecutive), one slice of each epoch's permutation read at once: read element by
        element (a tensor index each) it took the training thread 0.54 ms a batch of 256, under the interpreter
        lock the model's launches need."""
        n, out, i = len(self.indices), [], ids.start
        while i < ids.stop:
            e = i // n
            if e != self._epoch:
                self._epoch = e
                self._perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000003 + e))
            end = min(ids.stop, (e + 1) * n)
            out += [SampleIndex(self.indices[k], j, self.seed)
                    for j, k in zip(range(i, end), self._perm[i - e * n:end - e * n].tolist())]
            i = end
        return out


class SyntheticPool:
    """`size` samples from the workload's example_batch, made once from `seed` on the CPU, kept on the device."""

    def __init__(self, data: Data, *, size: int, seed: int, device: torch.device):
        gen = torch.Generator().manual_seed(seed)
        x, y = _check_pair(data.resolved.name, "example_batch", wl.call(
            f"workload `{data.resolved.name}`: example_batch", data.workload.example_batch, data.settings, size, gen),
            size)
        self.x, self.y = x.to(device), y.to(device)
        self.size = size

    def batch(self, ids: range) -> tuple[torch.Tensor, torch.Tensor]:
        # Made on the device: a copy from pageable host memory would stall the CPU until the GPU
        # drained its queue, every micro-step.
        ids_t = torch.arange(ids.start, ids.stop, dtype=torch.int64, device=self.x.device)
        # A fixed scramble so consecutive batches differ even when the pool is small.
        idx = (ids_t * 40503 + ids_t // self.size) % self.size
        return self.x.index_select(0, idx), self.y.index_select(0, idx)

    def take(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(ids, dtype=torch.int64, device=self.x.device)
        return self.x.index_select(0, idx), self.y.index_select(0, idx)


def _check_pair(name: str, what: str, pair, n: int):
    """`what` returned an (x, y) pair of tensors with n samples each: else one line naming the workload."""
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(torch.is_tensor(t) for t in pair)):
        shown = type(pair).__name__ if not isinstance(pair, (tuple, list)) else \
            f"({', '.join(type(t).__name__ for t in pair)})"
        raise UsageError(f"workload `{name}`: {what} gave {shown}, not an (x, y) pair of tensors (the sample's "
                         "input and target; a dataset item (x, y) is collated into one)")
    x, y = pair
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != n or y.shape[0] != n:
        raise UsageError(f"workload `{name}`: {what} gave x of shape {tuple(x.shape)} and y of shape "
                         f"{tuple(y.shape)} for {n} samples; the first dimension of both is the sample")
    return x, y


class _BatchSampler:
    def __init__(self, order: EpochOrder, *, start: int, micro_batch: int, offset: int, count: int):
        self.order, self.start, self.mb, self.offset, self.count = order, start, micro_batch, offset, count

    def __iter__(self):
        g = 0
        while True:
            yield self.order(sample_ids(g, self.mb, offset=self.offset, count=self.count, base=self.start))
            g += 1


def _hooks(name: str, ds, device: torch.device, channels_last: bool):
    """(collate, move) for batches of `ds`: the dataset's own `collate` and `to_device` (job.workload) where it
    has them, else torch's default_collate and a plain copy; `move` also applies train.channels_last (and
    tells a to_device with a `memory_format` keyword, which can write its batch in that layout at once)."""
    from torch.utils.data import default_collate

    collate = getattr(ds, "collate", None) or default_collate
    to_device = getattr(ds, "to_device", None)
    layout = {"memory_format": torch.channels_last if channels_last else torch.contiguous_format} \
        if to_device is not None and _takes(to_device, "memory_format") else {}

    def move(batch):
        if to_device is not None:
            batch = wl.call(f"workload `{name}`: dataset.to_device", to_device, batch, device, **layout)
            x, y = _check_pair(name, "dataset.to_device", batch, _rows(batch))
        else:
            x, y = batch
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return _format(x, channels_last), y

    return collate, move


def _takes(fn, keyword: str) -> bool:
    """Whether fn takes `keyword` (a dataset's to_device that writes its batch in train.channels_last's layout)."""
    import inspect

    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature Python can read
        return False


def _loader(name: str, ds, batch_sampler, *, workers: int, device: torch.device, channels_last: bool, prefetch: bool,
            persistent: bool, nice: int = 0, tuner: SplitTuner | None = None, seed: int = 0, depth: int = 1):
    collate, move = _hooks(name, ds, device, channels_last)
    made = None
    if workers and persistent:  # the training stream: its batches cross in slots the workers reuse
        collate, move = _through_slots(collate, move)
        made = torch.zeros(workers, dtype=torch.int64).share_memory_()
        collate = CountingCollate(collate, made)
    loader = _data_loader(ds, batch_sampler, collate, workers=workers, device=device, persistent=persistent, nice=nice,
                          seed=seed)
    it = iter(loader)
    if workers:
        _WITH_WORKERS.add(it)
        _defer_worker_deaths()
    try:
        first = next(it)
    except StopIteration:
        return iter(())
    # The first batch now, so a file that does not decode is refused before the run writes anything. Its pair
    # is checked here, or by `move` after the dataset's own to_device made the tensors.
    _check_items(name, ds, first)
    first = move(first)
    timings = InputTimings()
    if prefetch:
        stream = itertools.chain([first], Prefetcher(it, device, move, timings, depth=depth))
    else:
        stream = itertools.chain([first], _moved(it, move, timings))
    if made is None:
        return stream
    return Stream(stream, made, pids=[int(w.pid) for w in getattr(it, "_workers", []) if w.pid is not None],
                  tuner=tuner, timings=timings, loader_it=it)


class BatchFailed(Exception):
    """A batch could not be made (a file that does not decode, a dataset's own error, a killed worker): `error`
    is why, or None on a rank whose own batch was fine and that stops with a rank whose batch was not. The
    trainer stops every rank at the last whole step with a checkpoint of it (job.train)."""

    def __init__(self, error: BaseException | None):
        super().__init__(str(error))
        self.error = error


def take_or_stop(take, strategy, *, vote: bool):
    """`take()`'s batch; BatchFailed where it raised. With `vote`, under several ranks, the ranks vote after
    taking (one small CPU collective), so all raise BatchFailed together: `error` None on those whose own
    batch was fine. StopIteration passes through."""
    failed = batch = None
    try:
        batch = take()
    except StopIteration:
        raise
    except Exception as e:
        failed = e
    if strategy.any(failed is not None) if vote and strategy.world_size > 1 else failed is not None:
        raise BatchFailed(failed)
    return batch


class InputTimings:
    """Where the training thread's wait for a batch goes, in seconds since the stream started: `take`, taking the
    next batch from the DataLoader (waiting for the workers, and receiving it: the hand-over); `move_wait`,
    waiting for `move` (the copy to the device and the dataset's to_device, data.decode=gpu's decoding): on
    the training thread itself, or with data.prefetch for the prefetch thread; `move_busy`, the seconds `move`
    ran (with data.prefetch, on its own thread: over a window, how busy that thread was)."""

    __slots__ = ("take", "move_wait", "move_busy")

    def __init__(self):
        self.take = self.move_wait = self.move_busy = 0.0

    def read(self) -> tuple[float, float, float]:
        return self.take, self.move_wait, self.move_busy


def _moved(it, move, timings: InputTimings):
    """The loader's batches, moved on the calling thread (no data.prefetch), timed."""
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        t1 = time.perf_counter()
        out = move(batch)
        t2 = time.perf_counter()
        timings.take += t1 - t0
        timings.move_wait += t2 - t1
        timings.move_busy += t2 - t1
        yield out


PREFETCH_FACTOR = 2  # batches each worker prepares ahead (DataLoader's default)


def _check_items(name: str, ds, batch) -> None:
    """A loader's first collated batch must be an (x, y) pair; where the dataset has its own to_device, `move`
    checks the pair that made instead (a SlotBatch is a pair)."""
    if getattr(ds, "to_device", None) is None and not isinstance(batch, SlotBatch):
        _check_pair(name, "dataset items", batch, _rows(batch))


def _data_loader(ds, batch_sampler, collate, *, workers: int, device: torch.device, persistent: bool, nice: int,
                 seed: int):
    """A DataLoader with this module's settings. Its own generator, seeded with `seed`, gives the workers'
    base seed: a DataLoader without one draws it from torch's global generator each time an iterator starts,
    which moved the training's random stream (dropout) by one draw wherever a run built its stream, so a
    resumed run with dropout did not train the steps an uninterrupted one did."""
    import functools

    from torch.utils.data import DataLoader

    if workers:
        # Many tensors returned by workers exhaust file descriptors under the default strategy (seen on
        # a GPU host as "Bad file descriptor").
        torch.multiprocessing.set_sharing_strategy("file_system")
    return DataLoader(ds, batch_sampler=batch_sampler, num_workers=workers, pin_memory=device.type == "cuda",
                      collate_fn=collate, persistent_workers=persistent and workers > 0,
                      worker_init_fn=functools.partial(_worker_start, nice=nice) if workers else None,
                      prefetch_factor=PREFETCH_FACTOR if workers else None,
                      generator=torch.Generator().manual_seed(seed))


def _held_out_loader(name: str, ds, batches: list, *, workers: int, device: torch.device, channels_last: bool,
                     nice: int, seed: int):
    """(DataLoader, move) for the held-out batches, read whole at every evaluation. Its workers start at the
    first evaluation and are kept for the next ones: forked once a run, not once an evaluation. (A fork while
    another thread creates or drops a Python thread state can leave the child of a CPython 3.11 without the fix
    of python/cpython#112275, such as 3.11.7, waiting forever on a lock in PyOS_AfterFork_Child; seen once in
    a CPU test with 3 evaluations.) The first batch's pair is checked as the training stream's is."""
    collate, move = _hooks(name, ds, device, channels_last)
    loader = _data_loader(ds, batches, collate, workers=workers, device=device, persistent=True, nice=nice,
                          seed=seed)
    checked = False

    def move_checked(batch):
        nonlocal checked
        if not checked:
            _check_items(name, ds, batch)
            checked = True
        return move(batch)

    return loader, move_checked


class CountingCollate:
    """A DataLoader's collate_fn: `collate`, then (in a worker) the batch's samples added to the worker's own
    cell of `made`, a shared-memory counter the training process reads (Stream.counts)."""

    def __init__(self, collate, made: torch.Tensor):
        self.collate, self.made = collate, made

    def __call__(self, items):
        from torch.utils.data import get_worker_info

        batch = self.collate(items)
        info = get_worker_info()
        if info is not None:
            self.made[info.id] += len(items)
        return batch


class Stream:
    """The training stream of a loader with workers: its (x, y) batches, how many samples the workers have
    made against how many the loop has taken (`counts`), and the CPU time the workers have used
    (`worker_cpu_s`: with the wall time between two readings, how many cores they kept busy).

    The workers read ahead (data.workers x PREFETCH_FACTOR batches, filled while the first step compiles
    or autotunes), so for a while a run can train faster than its input pipeline makes samples, drawing
    the read-ahead down. Over a window, samples made / samples taken below 1 says so, whatever the
    loop's own rate: the bench's real-data rows use it to report the rate a run sustains."""

    def __init__(self, it, made: torch.Tensor, pids: list[int] | None = None, tuner: SplitTuner | None = None,
                 timings: InputTimings | None = None, loader_it=None):
        self.it, self.made, self.taken = it, made, 0
        self.pids = list(pids or [])
        self.tuner = tuner
        self.timings = timings
        self._loader_it = loader_it  # the DataLoader's iterator, whose workers `close` stops
        if tuner is not None and self.pids:
            # each window's line says how many cores the workers kept busy. The pids, not a method of this
            # stream: that cycle kept the stream and its workers past the trainer's `del` (docs/benchmarks.md's
            # Known issues: runs from JPEGs on a card exited 80 s late).
            tuner.cpu = functools.partial(workers_cpu_s, tuple(self.pids))

    def __iter__(self):
        return self

    def __next__(self):
        dead_worker()
        if self.tuner is None or not self.tuner.observing:
            x, y = next(self.it)
            self.taken += len(x)
            return x, y
        t = time.perf_counter()
        x, y = next(self.it)
        now = time.perf_counter()
        self.taken += len(x)
        self.tuner.observe(now, now - t, *self.counts())
        return x, y

    def watch_card(self, read) -> None:
        """Give data.decode=auto's windows the card's idle time between steps: `read` returns a CardGaps'
        Reading."""
        if self.tuner is not None:
            self.tuner.card = read

    def exclude(self, seconds: float) -> None:
        """The training process paused `seconds` (a checkpoint, an evaluation, a log line): left out of the
        tuner's window, as the trainer's own clock leaves it out."""
        if self.tuner is not None:
            self.tuner.exclude(seconds)

    @property
    def gpu_share(self) -> float | None:
        """data.decode=auto's share of the JPEGs on the GPU (SplitTuner); None where the stream has no tuner."""
        return None if self.tuner is None else self.tuner.share

    @property
    def settled_batch(self) -> int | None:
        """Batches this stream handed out before data.decode=auto's choice held (SplitTuner.settled_batch);
        None where it has no tuner or is still choosing."""
        return None if self.tuner is None else self.tuner.settled_batch

    def counts(self) -> tuple[int, int]:
        """(samples the workers have collated, samples this stream has handed out) since it started."""
        return int(self.made.sum()), self.taken

    @property
    def workers(self) -> int:
        return len(self.made)

    def input_s(self) -> tuple[float, float, float] | None:
        """(take, move_wait, move_busy) seconds since the stream started (InputTimings); None without them."""
        return None if self.timings is None else self.timings.read()

    def worker_cpu_s(self) -> float | None:
        """CPU seconds (user + system) the workers have used since they started, from /proc; None where the
        system has no /proc or a worker's entry cannot be read."""
        return workers_cpu_s(self.pids)

    def close(self) -> None:
        """Stop the workers now (the trainer's close), not whenever the stream is freed."""
        if self._loader_it is not None:
            _stop_workers(self._loader_it)
            self._loader_it = None


def workers_cpu_s(pids) -> float | None:
    """CPU seconds (user + system) processes `pids` have used, from /proc; None where there are none, the system
    has no /proc, or an entry cannot be read."""
    total = 0.0
    for pid in pids:
        used = process_cpu_s(pid)
        if used is None:
            return None
        total += used
    return total if pids else None


def tuner_lookahead(workers: int, depth: int = 1) -> int:
    """Batches past the one handed out now that `workers` may have started (data.workers x PREFETCH_FACTOR,
    a few in the pinning and prefetch threads, and the prefetch thread's further `depth` - 1,
    data.prefetch_depth's): where a SplitTuner change takes effect."""
    return workers * PREFETCH_FACTOR + 4 + max(0, depth - 1)


class SplitTuner:
    """data.decode=auto's choice of decoder for JPEGs on a GPU, made by measuring the training stream itself.

    The workers decode every JPEG at first. Once the read-ahead the workers filled while the first steps
    compiled is behind (`lookahead` + FIRST batches), a window of WINDOW batches and WINDOW_S seconds at least
    (less the trainer's pauses: `exclude`) is timed: the samples a second the loop took, and those the
    workers made; the rate a share sustains is the lower of the two. Where the loop waited for data WAIT of
    the window or more, or took more than the workers made (it was living on the read-ahead), the workers
    are the limit, and three steps follow, each a change from the first sample id of the batch `lookahead`
    batches on (one the workers have not started: their read-ahead is at most data.workers x
    PREFETCH_FACTOR batches), then a timed window:

    1. Every JPEG goes to the GPU decoder, which sustains G samples a second against the workers' W.
    2. Where the two together would make GAIN more than the faster alone, a mix is tried: the share G / (W + G)
       (to the nearest MIX_STEP), which gives each its part of what they make together, or where it is smaller,
       the least share at which the workers make MARGIN more than the loop takes without waiting (L: what it
       took over the workers' window, less the time it waited, or where the card's idle time between steps is
       measured and shorter, over the time the card was busy), rounded up to a MIX_STEP. A JPEG handed to the
       GPU still costs a worker about HANDED of decoding it (it is read, parsed and packed: 1xH200, 16 slow
       cores, at 20 % on the card the workers made 11 % more a busy core; a worker's CPU time alone, on 2 EPYC
       cores, 0.22-0.27 over 2 batches of 256, 0.11 over 10 of 128: python -m job.bench.decoders), so at share s they make
       W / (1 - (1 - HANDED) s), and that share is (1 - W / (MARGIN L)) / (1 - HANDED); each JPEG on the card costs the model's
       step time there (1xH100, 16 CPUs, compiled ResNet-50 whose workers made 93-101 % of its rate: 30 % on
       the card trained 0.98x synthetic, half 0.965x, 3 repeats each; 15 % and 20 % 0.98x in one run each). This is tried even where the loop
       no longer waits with every JPEG on the GPU: the GPU decoder runs on the card the model trains on, and
       the time it takes there is not the loop's wait (on 16 slow cores compiled ResNet-50 trained 4,894
       samples/s without waiting, where half of the JPEGs on the GPU made 5,900-6,000). Otherwise the choice
       ends: every JPEG on the GPU where that sustained GAIN more than the workers, else the workers.
    3. The mix is kept where it sustained GAIN more than the workers and at least as much as the fallback
       (MIX_GAIN more, where the loop did not wait with every JPEG on the GPU: a mix that only matches it
       hands the workers JPEGs for nothing): every JPEG on the GPU where that sustained GAIN more than the
       workers, else the workers, which come back otherwise. MIX_GAIN is below GAIN: compiled ResNet-50 on 8
       CPUs of an H100 host gave back mixes that sustained 3.6 % and 3.9 % more than every JPEG on the GPU,
       and the one run that kept its mix trained 1.6-2.0 % faster than those two once settled. A mix about to
       be given back is first timed on for as long again, and judged on both windows as one: a window of 2 s
       varies by 10-30 % on a host of slow cores (1xH200, 16 cores, compiled ResNet-50: the mix's windows
       4,371-6,121 samples/s across nine runs, the synthetic rate within 0.1 %), and one low window gave back
       a mix that trained 5,791 (median) in the other runs for every JPEG on the GPU at 5,095, in 3 runs of 9.

    Where the first window finds the workers keeping up, the choice holds, but the windows go on being timed: a
    shortfall of a few per cent is hidden for hundreds of steps by the read-ahead of many workers (16 workers'
    36 batches last ~450 steps at 8 % short), and a host gets busier. Where the loop waits WAIT or more in WATCH
    windows running, or the workers made less than SHORT of what the loop took over them, the three steps start
    then, once (1xH100, 16 CPUs, compiled ResNet-50: the first window kept the workers, the timed steps waited
    8-11 % of the time for them, and 30 % of the JPEGs on the card trained 7 % faster).

    Each step is one log line; where the trainer gives it the card's idle time between steps (`card`: a
    CardGaps' read), each window's share is in it too (the loop's wait is host time, which the card's queued
    work may cover), and where the stream reads the workers' CPU time (`cpu`), the cores they kept busy (1xH100,
    16 CPUs, 16 workers under compiled ResNet-50: 12.5-13.9 cores in the first window, the training process on
    about one, Inductor's compile helper on one more for its first 9-13 s, every core busy). The samples are
    the same crops either way (the pixels within the two decoders' rounding); a resumed run chooses again.
    `settled_batch` says from which batch the choice holds; `longest` bounds how many batches choosing can
    take."""

    WINDOW = 40  # batches a window times, at least
    WINDOW_S = 2.0  # seconds a window lasts, at least (a model of very short steps: enough of them to time)
    WAIT = 0.05  # the loop waiting this share of a window or more: the input is the limit
    GAIN = 1.05  # JPEGs stay on the GPU only where that sustained this much more than the workers alone
    MIX_GAIN = 1.02  # a mix stays only where it sustained this much more than every JPEG on the GPU without a wait
    MIX_STEP = 0.05  # the mix's share is a multiple of this, from MIX_STEP to 1 - MIX_STEP
    HANDED = 0.5  # the share of a worker's time a JPEG costs it that it hands to the GPU undecoded
    MARGIN = 1.05  # a mix asks the workers for what the loop takes without waiting, and this much more
    WATCH = 2  # windows judged together once a first window kept the workers: a wait or a shortfall starts the trials
    SHORT = 0.95  # the workers making less than this share of what the loop took over WATCH windows: the limit
    SETTLE = 5  # batches of a new share taken before its window starts
    FIRST = 10  # batches past the read-ahead the workers filled at the start before the first window
    MIN_FREE = 1 << 30  # bytes free on the card to try its decoder (decoded images, nvJPEG's buffers)

    def __init__(self, split: GpuSplit, *, first_id, lookahead: int, device: torch.device | None = None,
                 say=None, free_bytes=None):
        self.split, self.first_id, self.lookahead, self.device = split, first_id, int(lookahead), device
        self.say = say or log.info
        self.free_bytes = free_bytes or self._free_bytes
        self.g = 0  # batches the stream has handed out
        self.share = 0.0  # the share of the JPEGs on the GPU now (the last change's, once the workers reach it)
        self.start_at = self.lookahead + self.FIRST
        # [time, made, taken, seconds waited, batches, card's read, the workers' CPU mark] at its start (the
        # mark's own time: `exclude` moves the first)
        self.window: list | None = None
        self.card = None  # () -> the card's idle time between steps (a CardGaps' Reading), or None
        self.cpu = None  # () -> CPU seconds the workers have used (workers_cpu_s), or None
        self.rates: dict[float, float] = {}  # samples a second each share tried sustained, in the order tried
        self.gpu_waited = True  # whether the loop waited for data with every JPEG on the GPU
        self.done = False
        self.watching = False  # the first window kept the workers; the loop's wait may still start the trials
        self.recent: list = []  # while watching: (wait, made, taken, batches, seconds, card idle) of the last WATCH windows
        self.loop_rate: float | None = None  # samples a second the loop took with the workers, less its wait (L: _unwaited)
        self.since = 0  # batches the stream had handed out before the first one of the share now
        # (rate, batches) of a mix's first window where that would have given it back: its window then lasts twice
        # as long (a second look)
        self.first_look: tuple[float, int] | None = None

    @classmethod
    def longest(cls, lookahead: int, *, step_s: float = float("inf")) -> int:
        """Batches after which the choice holds at the latest, where no batch takes less than `step_s` seconds
        (a window lasts WINDOW batches, or WINDOW_S seconds where those are shorter): the first window, two
        trials, the mix's second window and the last change's `lookahead`."""
        window = max(cls.WINDOW, math.ceil(cls.WINDOW_S / step_s))
        return lookahead + cls.FIRST + window + 2 * (lookahead + cls.SETTLE + window) + window + lookahead

    @property
    def observing(self) -> bool:
        """Whether the stream's batches still go to `observe`: while choosing, and while watching."""
        return not self.done or self.watching

    @property
    def settled_batch(self) -> int | None:
        """Batches the stream had handed out before the chosen share applied to every later one; None while
        it is still choosing (a run watching the loop's wait after its first window kept the workers has chosen
        them, until that wait starts the trials)."""
        return self.since if self.done else None

    @staticmethod
    def what(share: float) -> str:
        """A share of the JPEGs on the GPU, in words."""
        if share <= 0:
            return "the workers decoding every JPEG"
        if share >= 1:
            return "every JPEG on the GPU"
        return "half of the JPEGs on the GPU" if share == 0.5 else f"{share:.0%} of the JPEGs on the GPU"

    def _free_bytes(self) -> int | None:
        if self.device is None or self.device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(self.device)[0])

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` the loop spent on something else (Stream.exclude) out of the window."""
        if self.window is not None:
            self.window[0] += seconds

    def observe(self, now: float, waited: float, made: int, taken: int) -> None:
        """One batch handed out at `now`, after the loop waited `waited` s for it; `made` and `taken` are the
        stream's counts (Stream.counts) after it."""
        self.g += 1
        if not self.observing or self.g < self.start_at:
            return
        if self.window is None:
            self.window = [now, made, taken, 0.0, 0, self.card() if self.card else None, self._cpu_mark(now)]
            return
        w = self.window
        w[3] += waited
        w[4] += 1
        seconds = now - w[0]
        span = 1 if self.first_look is None else 2
        if w[4] < self.WINDOW * span or seconds < self.WINDOW_S * span or seconds <= 0:
            return
        trained, input_rate = (taken - w[2]) / seconds, (made - w[1]) / seconds
        rate = min(trained, input_rate)
        if 0.0 < self.share < 1.0 and span == 1 and not self._keeps(rate):
            self.first_look = (rate, w[4])  # the same window goes on, twice as long
            return
        self.window = None
        wait = w[3] / seconds
        idle = None
        if self.card:  # over the window's optimizer steps (a step may take several batches: train.accum_steps)
            a, b = w[5], self.card()
            idle = idle_share(a, b, seconds=seconds)
        cores = per_second(w[6], self._cpu_mark(now), 1)
        if self.watching:
            return self._watch(rate, wait, made - w[1], taken - w[2], w[4], idle, seconds, cores)
        if self.share == 0.0:
            self.loop_rate = self._unwaited(taken - w[2], seconds, w[3], idle)
        self._decide(rate, wait, wait >= self.WAIT or input_rate < 0.93 * trained, w[4], idle,
                     kept=input_rate / trained if trained > 0 else 1.0, cores=cores)

    def _watch(self, rate: float, wait: float, made: int, taken: int, w_steps: int, idle: float | None,
               seconds: float, cores: float | None) -> None:
        """A window after the first one kept the workers: the trials start where, over the last WATCH windows,
        the loop waited WAIT or more in each, or the workers made less than SHORT of what it took (the read-ahead
        running down: over one window's few dozen batches that is hard to tell from noise, over several it is
        not)."""
        self.recent = (self.recent + [(wait, made, taken, w_steps, seconds, idle)])[-self.WATCH:]
        if len(self.recent) < self.WATCH:
            return
        steps = sum(r[3] for r in self.recent)
        took = sum(r[2] for r in self.recent)
        kept = sum(r[1] for r in self.recent) / max(1, took)
        if all(r[0] >= self.WAIT for r in self.recent):
            least = min(r[0] for r in self.recent)
            why = (f"the loop waited for data {least:.0%} or more of each of its last {self.WATCH} windows "
                   f"({steps} steps)")
        elif kept < self.SHORT:
            why = (f"the workers made {kept:.0%} of what the loop took over the last {steps} steps (its read-ahead "
                   "running down)")
        else:
            return
        self.rates[0.0] = rate
        span = sum(r[4] for r in self.recent)
        idles = [r[5] for r in self.recent]
        idle_all = None if None in idles else sum(i * r[4] for i, r in zip(idles, self.recent)) / span
        self.loop_rate = self._unwaited(took, span, sum(r[0] * r[4] for r in self.recent), idle_all)
        self.watching = self.done = False
        card = self._window_words(idle, cores)
        self._try(1.0, f"after its first window kept the workers, {why} ({self.what(0.0)} sustained {rate:,.0f} "
                       "samples/s" + (f"; {card})" if card else ")"))

    @staticmethod
    def _unwaited(taken: int, seconds: float, waited: float, idle: float | None = None) -> float:
        """L: the samples a second the loop would take without waiting: `taken` over the `seconds` less the `waited`
        of them it spent waiting for data, and where the card's idle share between steps (`idle`) is measured, no
        more than `taken` over the seconds the card was busy. The card's queued work covers part of a wait, and
        the loop takes its next batches faster after one, so the first alone overshoots: 1xH100, compiled
        ResNet-50 that trained 5,618 samples/s from synthetic data, the loop waiting 13 % and the card idle 5 %,
        gave 6,071 where the card's busy time gives 5,560."""
        rate = taken / max(seconds - waited, 1e-9)
        return rate if idle is None else min(rate, taken / max(seconds * (1 - idle), 1e-9))

    def _cpu_mark(self, now: float) -> tuple:
        """(now, the CPU seconds the workers have used, or None where the stream does not read them)."""
        return now, self.cpu() if self.cpu else None

    @staticmethod
    def _window_words(idle: float | None, cores: float | None) -> str:
        """A window's cores the workers kept busy and share of the card's idle time between steps, in words; ""
        where the stream gives neither. Fewer cores than workers while the loop waits: the host gave them no
        more (other processes, the training process's own threads)."""
        words = [] if cores is None else [f"the workers busy on {cores:.1f} cores"]
        return "; ".join(words + ([] if idle is None else [f"the card idle between steps {idle:.0%}"]))

    def _decide(self, rate: float, wait: float, limited: bool, w_steps: int, idle: float | None = None, *,
                kept: float = 1.0, cores: float | None = None) -> None:
        share = self.share
        self.rates[share] = rate
        card = self._window_words(idle, cores)
        over = "" if self.first_look is None else (  # a mix timed on (observe): both windows, and the first's rate
            f" over {w_steps} steps ({self.first_look[0]:,.0f} over the first {self.first_look[1]}, which would "
            "have given it back)")
        sustained = f"{self.what(share)} sustained {rate:,.0f} samples/s{over}"
        if share == 0.0:  # the workers alone
            if limited:
                self._try(1.0, f"the loop waited for data {wait:.0%} of {w_steps} steps ({sustained}"
                               + (f"; {card})" if card else ")"))
            else:  # said once, with the window's figures; the windows go on (_watch)
                self.done = self.watching = True
                self.say(f"data.decode=auto: the workers kept up (they made {kept:.0%} of what the loop took over "
                         f"{w_steps} steps, and it waited for data {wait:.0%}" + (f"; {card}" if card else "")
                         + "): keeping them, and watching for a shortfall")
            return
        sustained += f" ({card})" if card else ""
        workers = self.rates[0.0]
        fallback = self._fallback()  # the GPU decoder is kept for a 5 % gain only
        if share == 1.0:
            versus = f"{sustained} against {workers:,.0f} with {self.what(0.0)}"
            if workers + rate < self.GAIN * max(workers, rate):
                return self._end(fallback, f"{versus}: " + ("keeping it" if fallback else f"back to {self.what(0.0)}"))
            self.gpu_waited = limited
            mix, why = self._mix(rate, workers)
            waited = (f"and the loop still waited for data {wait:.0%}" if limited else
                      "and the loop no longer waited for data, but the GPU decodes on the card the model trains on")
            return self._try(mix, f"{versus}, {waited}; {why}")
        versus = f"{sustained} against {self.rates[fallback]:,.0f} with {self.what(fallback)}"
        if self._keeps(rate):
            return self._end(share, f"{versus}: keeping it")
        self._end(fallback, f"{versus}: back to {self.what(fallback)}")

    def _mix(self, gpu: float, workers: float) -> tuple[float, str]:
        """The share a mix tries, and why in words: G / (W + G) to the nearest MIX_STEP, or where smaller, the
        least share at which the workers make MARGIN more than the loop takes without waiting, rounded up."""
        share = gpu / (gpu + workers)
        steps, why = round(share / self.MIX_STEP), f"together they make {workers + gpu:,.0f}"
        least = (1 - workers / (self.MARGIN * self.loop_rate)) / (1 - self.HANDED) if self.loop_rate else share
        if least < share:
            steps = math.ceil(least / self.MIX_STEP - 1e-6)
            why = (f"the workers make {workers / self.loop_rate:.0%} of what the loop takes without waiting "
                   f"({self.loop_rate:,.0f}), so the card takes what they fall short of")
        return round(min(max(steps * self.MIX_STEP, self.MIX_STEP), 1 - self.MIX_STEP), 6), why

    def _fallback(self) -> float:
        """The share a mix gives way to: every JPEG on the GPU where that sustained GAIN more than the workers."""
        return 1.0 if self.rates.get(1.0, 0.0) >= self.rates[0.0] * self.GAIN else 0.0

    def _keeps(self, rate: float) -> bool:
        """Whether a mix that sustained `rate` is kept: GAIN more than the workers, and at least as much as the
        fallback (MIX_GAIN more, where the loop did not wait with every JPEG on the GPU)."""
        fallback = self._fallback()
        beat = self.rates[fallback] * (self.MIX_GAIN if fallback == 1.0 and not self.gpu_waited else 1.0)
        return rate >= beat and rate >= self.rates[0.0] * self.GAIN

    def _end(self, share: float, said: str) -> None:
        """The choice made: `share`, from the next batch the workers have not started where it is not the one now."""
        self.done = True
        if share != self.share:
            first = self.first_id(self.g + self.lookahead)
            self.split.set(first, share)
            self.share, self.since = share, self.g + self.lookahead
            said += f" from sample {first:,}"
        self.say(f"data.decode=auto: {said} (data.decode=cpu, or data.decode=gpu data.gpu_share=F, decides for good)")

    def _try(self, share: float, why: str) -> None:
        free = self.free_bytes()
        if free is not None and free < self.MIN_FREE:
            self.done = True
            self.say(f"data.decode=auto: {why}; the GPU decoder is not tried: {free / 2**20:,.0f} MB free on "
                     f"{self.device}, below {self.MIN_FREE / 2**20:,.0f} MB")
            return
        first = self.first_id(self.g + self.lookahead)
        if not self.split.set(first, share):
            self.done = True
            return
        self.share, self.since = share, self.g + self.lookahead
        self.start_at = self.g + self.lookahead + self.SETTLE
        self.say(f"data.decode=auto: {why}; trying {self.what(share)} from sample {first:,}")


def per_second(a: tuple | None, b: tuple | None, k: int) -> float | None:
    """A count's rate between two marks (time first): (b[k] - a[k]) over the seconds between them, e.g. the cores
    CPU seconds kept busy; None without both marks or both counts."""
    if a is None or b is None or b[0] <= a[0] or len(a) <= k or a[k] is None or b[k] is None:
        return None
    return (b[k] - a[k]) / (b[0] - a[0])


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process `pid` has used, from /proc/<pid>/stat; None where it cannot be read."""
    import os

    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None


def thread_sched_s() -> tuple[float, float] | None:
    """The calling thread's (seconds it ran on a core, seconds it was ready to run but waited for a core), from
    the kernel's scheduler statistics (/proc/thread-self/schedstat); None where there are none."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return None


def _through_slots(collate, move):
    """(collate, move) that hand each (x, y) batch, and each batch that names its HANDOVER_TENSORS, over in the
    worker's reusable slots (job.handover): the worker copies it into its next free slot; the training process
    copies it out (the DataLoader's pinning thread on a GPU, `move` on the CPU) and hands the slot back."""
    slots = HostSlots()

    def move_slot(batch):
        return move(slots.take(batch) if isinstance(batch, (SlotBatch, PackedBatch)) else batch)

    return SlotCollate(collate, PREFETCH_FACTOR + SPARE_SLOTS, slots.token), move_slot


# -- DataLoader workers and stop signals --------------------------------------------------------------
# Slurm's time limit and preemption, `kill -TERM -<pgid>` and a terminal's Ctrl-C signal every process of the
# job, the DataLoader workers too. A worker killed by SIGTERM made the training process fail ("DataLoader
# worker ... is killed by signal: Terminated") while it finished its step and wrote the checkpoint the stop
# promised: nothing was saved. So the workers leave stop signals to the training process, which stops at the
# end of its step, checkpoints, and shuts them down (when it frees its loaders, or at exit: shutdown_workers);
# a worker whose parent dies exits by itself (DataLoader's watchdog, within 5 s).
WORKER_GRACE_S = 60.0  # a worker told to stop that nobody shuts down exits after this long
WORKER_STOP_S = 5.0  # a worker still busy this long after its loader was shut down is killed
_WITH_WORKERS: weakref.WeakSet = weakref.WeakSet()


def _worker_start(_worker_id: int, *, nice: int) -> None:
    """A DataLoader worker's start: its priority lowered by `nice` (data.worker_nice), SIGINT ignored, SIGTERM
    only starts the grace period. A worker forked inside the training loop (validation's) inherits its paused
    garbage collector (train.gc_every): it gets its own back."""
    import gc
    import os

    if nice:
        try:
            os.nice(nice)
        except OSError:  # a sandbox that forbids it: the worker keeps the training process's priority
            pass
    gc.enable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _worker_sigterm)


def _worker_sigterm(signum, frame) -> None:
    import os

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    timer = threading.Timer(WORKER_GRACE_S, os._exit, args=(0,))
    timer.daemon = True
    timer.start()


_WORKER_DEATH: list[str] = []  # torch's line for a DataLoader worker that died, until a batch is taken


def _defer_worker_deaths() -> None:
    """torch's SIGCHLD handler raises "DataLoader worker (pid N) is killed by signal: Killed." in the main
    thread wherever it is: in the middle of a forward, a backward or an optimizer step, where the weights
    may be half updated and no checkpoint can be trusted. Wrapped, the death is only noted here, and the
    training stream raises it when the next batch is taken (`dead_worker`), between steps, where the trainer
    stops with a checkpoint of the last whole step. (The DataLoader also finds the dead worker itself when
    that worker's batch does not come within 5 s.) A note left by an earlier stream's workers is dropped."""
    _WORKER_DEATH.clear()
    current = signal.getsignal(signal.SIGCHLD)
    if not callable(current) or getattr(current, "job_defers", False) or \
            threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        try:
            current(signum, frame)
        except RuntimeError as e:
            if not _WORKER_DEATH:
                _WORKER_DEATH.append(str(e))

    handler.job_defers = True
    signal.signal(signal.SIGCHLD, handler)


def dead_worker() -> None:
    """Raise the death of a DataLoader worker that _defer_worker_deaths noted (once)."""
    if _WORKER_DEATH:
        raise RuntimeError(_WORKER_DEATH.pop())


def shutdown_workers() -> None:
    """Stop the DataLoader workers of every loader still open in this process; at exit, before torch's own exit
    hook, which would leave them to multiprocessing's terminate (and a SIGTERM no longer stops them)."""
    for it in list(_WITH_WORKERS):
        _stop_workers(it)


def _stop_workers(it) -> None:
    """Stop one DataLoader iterator's workers (none: nothing to do) within WORKER_STOP_S seconds however busy
    they are. torch's shutdown tells them all to stop, then waits up to 5 s for each in turn and SIGTERMs those
    left, which here only starts their grace period: 4 workers each in the middle of a 30 s batch took 29 s
    to stop, and 16 in slower batches could take 160 s (5 s for each, twice). Here its waits share one
    deadline, WORKER_STOP_S after the shutdown began; a worker still running then is killed (SIGKILL: a batch
    being made is no promise anyone keeps) and reaped within WORKER_STOP_S more. Their pids leave torch's
    SIGCHLD watch first, so a kill is not reported as a worker that died. (No thread keeps the deadline:
    Python 3.12 starts none at exit, where shutdown_workers runs.)"""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        workers = list(getattr(it, "_workers", ()))
        _forget_worker_pids(it)
        deadline = time.monotonic() + WORKER_STOP_S
        for w in workers:  # torch's shutdown joins each worker in turn, after it has told them all to stop
            w.join = functools.partial(_join_or_kill, w, workers, deadline)
        try:
            shutdown()
        except Exception as e:  # a worker already gone: nothing left to stop
            log.debug("data: shutting the workers down: %s", e)
        for w in workers:  # any torch did not wait for (it raised, or does nothing once Python exits)
            _join_or_kill(w, workers, deadline)
    _WITH_WORKERS.discard(it)


def _join_or_kill(w, workers, deadline: float, timeout: float | None = None) -> None:
    """Worker `w`'s join in torch's shutdown: it waits until the deadline shared by all the loader's `workers`
    (not `timeout`, torch's 5 s for each in turn); past it, every worker still running is killed. A worker
    that exits before the deadline kills nobody: the others may still finish their batch in time."""
    type(w).join(w, max(0.0, deadline - time.monotonic()))
    if time.monotonic() >= deadline:
        _kill_running(workers, deadline)


def _forget_worker_pids(it) -> None:
    """Take `it`'s workers out of the pids torch's SIGCHLD handler watches (as its shutdown does at its end), so
    a worker killed by _stop_workers is not raised as "DataLoader worker ... is killed by signal"."""
    if getattr(it, "_worker_pids_set", False):
        from torch.utils.data._utils import signal_handling

        signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False


def _kill_running(workers, deadline: float) -> None:
    """SIGKILL the worker processes not reaped yet (Process.kill leaves a reaped one alone, whose pid may be
    another process's by now; one that exited keeps its exit code), and reap them, waiting until WORKER_STOP_S
    after `deadline` at most (a process in uninterruptible I/O dies when its read returns)."""
    for w in workers:
        w.kill()
    for w in workers:
        type(w).join(w, max(0.0, deadline + WORKER_STOP_S - time.monotonic()))


atexit.register(shutdown_workers)  # registered after torch's exit hook, so it runs before it


def _rows(batch) -> int:
    """Samples in a collated (x, y) batch (0 when it is not one: _check_pair then says what it is)."""
    return len(batch[0]) if isinstance(batch, (tuple, list)) and batch and torch.is_tensor(batch[0]) else 0


def _format(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A 4-d batch in train.channels_last's layout: channels-last, or torch's default (contiguous) one, whatever
    layout the batch crossed in (the workers' image batches cross channels-last)."""
    if x.dim() != 4:
        return x
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


class Prefetcher:
    """Prepares batch n+1 while batch n trains: `move` (the copy to the device, and the dataset's to_device
    work, such as decoding JPEGs on the GPU) runs on one background thread, so its Python and its waits
    happen off the thread that launches the model's kernels. (Measured on one H200: free with the workers'
    decoding; it did not keep the GPU decoder from halving the run, docs/benchmarks.md.)

    The loader is still read by the calling thread, in order (with data.workers=0 the samples are made
    there, as without prefetch); only `move` runs on the prefetch thread, `depth` batches ahead
    (data.prefetch_depth; at 1 no more batches are alive than without prefetch: the one training, the one
    being made; each more holds one more moved batch on the device, and takes one more batch from the loader
    ahead). Moves run one at a time, in order. On a GPU `move` runs on a side
    stream: the consumer's stream waits on its event before use, and `record_stream` tells the caching
    allocator the tensors are used on the compute stream, so their memory is not reused too early. An
    exception in `move` or in taking a batch from the loader (a file that does not decode) is raised by the
    `next` that would have returned that batch, in the training thread; no batch after it is taken.
    """

    def __init__(self, it, device: torch.device, move, timings: InputTimings | None = None, depth: int = 1):
        import collections
        from concurrent.futures import ThreadPoolExecutor

        self.it, self.device, self.move, self.depth = it, device, move, max(1, int(depth))
        self.timings = timings if timings is not None else InputTimings()
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="job-prefetch")
        self.pending: collections.deque = collections.deque()  # the moves submitted, in the loader's order
        self.ended = False  # the loader is done, or failed: nothing more is taken from it
        self._fill()

    def _fill(self) -> None:
        while not self.ended and len(self.pending) < self.depth:
            future = self._submit()
            if future is not None:
                self.pending.append(future)

    def _submit(self):
        """The move of the loader's next batch (a future), a future holding the loader's error, or None at its
        end; after either of the last two, `ended`."""
        t = time.perf_counter()
        try:
            batch = next(self.it)
        except StopIteration:
            self.ended = True
            return None
        except Exception as e:  # raised by `next` for this batch, not for the one being handed out now
            from concurrent.futures import Future

            failed = Future()
            failed.set_exception(e)
            self.ended = True
            return failed
        finally:
            self.timings.take += time.perf_counter() - t
        return self.pool.submit(self._move, batch)

    def _move(self, batch):
        t = time.perf_counter()
        try:
            if self.stream is None:
                return (*self.move(batch), None)
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                x, y = self.move(batch)
                event = torch.cuda.Event()
                event.record(self.stream)
            return x, y, event
        finally:
            self.timings.move_busy += time.perf_counter() - t  # only this thread writes it

    def __iter__(self):
        return self

    def __next__(self):
        if not self.pending:
            self.pool.shutdown(wait=False)
            raise StopIteration
        t = time.perf_counter()
        try:
            x, y, event = self.pending.popleft().result()
        except BaseException:
            self.pending.clear()
            self.ended = True
            self.pool.shutdown(wait=False)
            raise
        finally:
            self.timings.move_wait += time.perf_counter() - t
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            x.record_stream(stream)
            y.record_stream(stream)
        self._fill()
        return x, y
