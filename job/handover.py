"""How a DataLoader worker's batch reaches the training process: in shared-memory slots the worker reuses.

By default each batch a worker returns is a fresh shared-memory file: the worker copies the batch into it,
the training process maps it (a page fault per 4 kB page), a pinning thread copies it again into pinned
memory, and the file is unmapped and deleted. For ResNet-50's uint8 batch of 256 (38.5 MB) that cost the
training process 35-39 ms of CPU a batch (`python -m job.bench.decoders`' hand-over), most of a core at
25 batches a second, beside the thread that launches the model's kernels.

Here each worker keeps a ring of `prefetch_factor + SPARE_SLOTS` slots, made on its first batch, and
collates into them. The training process keeps each ring mapped (torch's sharing then finds the mapping it
already has: no page faults), pins it once on a GPU (cudaHostRegister, after the workers exist: pinned
memory is not inherited by a fork), copies from it straight to the card, and hands the slot back once that
copy has finished (a release thread waits on the copy's CUDA event). On the 2-core development machine a
batch of 256 costs the training process 1.3 ms this way, without the copy.

A slot holds one (x, y) pair of tensors; anything else a collate function returns (EncodedBatch, dicts, a
batch of another shape than the first) crosses the default way. The samples are the same either way.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import weakref

import torch

SPARE_SLOTS = 2  # beyond the DataLoader's prefetch_factor: the batch being copied to the card, and one spare
SLOT_WAIT_S = 600.0  # a worker waiting this long for a slot the training process never released gives up


class SlotBatch:
    """A collated (x, y) batch in slot j of a worker's ring; flags[j] is 1 until the training process has
    its own copy of it."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, flags: torch.Tensor, j: int):
        self.x, self.y, self.flags, self.j = x, y, flags, j

    def pin_memory(self, device=None):  # a DataLoader's pinning thread: the ring is pinned once, by HostSlots
        return self

    def __len__(self) -> int:
        return len(self.x)


class _Ring:
    def __init__(self, x: torch.Tensor, y: torch.Tensor, slots: int):
        self.key = _key(x, y)
        self.xs, self.ys = _slots_like(x, slots), _slots_like(y, slots)
        self.flags = torch.zeros(slots, dtype=torch.int32).share_memory_()
        self.next = 0
        self.parent = os.getppid()

    def slot(self) -> int:
        """The next slot, once the training process has released it."""
        j = self.next
        self.next = (j + 1) % len(self.flags)
        start = time.monotonic()
        while int(self.flags[j]):
            if os.getppid() != self.parent:  # the training process is gone: DataLoader's own watchdog does this
                os._exit(0)
            if time.monotonic() - start > SLOT_WAIT_S:
                raise RuntimeError(f"data: the training process did not release a batch slot in {SLOT_WAIT_S:.0f} s")
            time.sleep(0.0002)
        return j


def _channels_last(t: torch.Tensor) -> bool:
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _slots_like(t: torch.Tensor, slots: int) -> torch.Tensor:
    """`slots` x t's shape in shared memory, each slot laid out as t is (contiguous, or channels-last as a
    batch stacked from the workers' crops is), so filling one is a plain copy."""
    if _channels_last(t):  # N x H x W x C underneath
        n, c, h, w = t.shape
        return torch.empty((slots, n, h, w, c), dtype=t.dtype).share_memory_().permute(0, 1, 4, 2, 3)
    return torch.empty((slots, *t.shape), dtype=t.dtype).share_memory_()


def _key(x: torch.Tensor, y: torch.Tensor):
    return tuple(x.shape), x.dtype, _channels_last(x), tuple(y.shape), y.dtype, _channels_last(y)


def _pair(batch) -> bool:
    return (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(torch.is_tensor(t) for t in batch)
            and batch[0].device.type == "cpu" and batch[1].device.type == "cpu")


class SlotCollate:
    """A DataLoader's collate_fn: `collate`, then (in a worker) the batch copied into the worker's next slot."""

    def __init__(self, collate, slots: int):
        self.collate, self.slots = collate, slots
        self._ring: _Ring | None = None

    def __getstate__(self):  # to spawned workers: each makes its own ring
        return {**self.__dict__, "_ring": None}

    def __call__(self, items):
        from torch.utils.data import default_collate, get_worker_info

        worker = get_worker_info() is not None
        if worker and self._ring is not None and self.collate is default_collate:
            stacked = self._stacked(items)
            if stacked is not None:
                return stacked
        batch = self.collate(items)
        if not worker or not _pair(batch):
            return batch
        x, y = batch
        if self._ring is None:
            self._ring = _Ring(x, y, self.slots)
        ring = self._ring
        if ring.key != _key(x, y):  # another shape than the first batch: the default hand-over
            return batch
        j = ring.slot()
        ring.xs[j].copy_(x)
        ring.ys[j].copy_(y)
        ring.flags[j] = 1
        return SlotBatch(ring.xs[j], ring.ys[j], ring.flags, j)

    def _stacked(self, items) -> SlotBatch | None:
        """default_collate's batch of (tensor, int or tensor) items, stacked straight into the next slot (in
        a worker, default_collate would stack into a new shared-memory file, the very cost the slots save);
        None where the items are not like the first batch's."""
        ring = self._ring
        xs, ys = ring.xs[0], ring.ys[0]
        if len(items) != len(xs) or not all(isinstance(it, (tuple, list)) and len(it) == 2 for it in items):
            return None
        if not all(torch.is_tensor(x) and x.shape == xs.shape[1:] and x.dtype == xs.dtype for x, _ in items):
            return None
        labels = [y for _, y in items]
        if all(type(y) is int for y in labels):
            if ys.dim() != 1 or ys.dtype != torch.int64:
                return None
            ids = torch.tensor(labels)
        elif all(torch.is_tensor(y) and y.shape == ys.shape[1:] and y.dtype == ys.dtype for y in labels):
            ids = None
        else:
            return None
        j = ring.slot()
        torch.stack([x for x, _ in items], out=ring.xs[j])
        if ids is None:
            torch.stack(labels, out=ring.ys[j])
        else:
            ring.ys[j].copy_(ids)
        ring.flags[j] = 1
        return SlotBatch(ring.xs[j], ring.ys[j], ring.flags, j)


class HostSlots:
    """The training process's side of the workers' rings: `take` turns a SlotBatch into the (x, y) pair to
    copy from (the ring kept mapped, and pinned on a GPU), and `release` hands the slot back once that copy
    is done: at once on the CPU (where `take` returns copies), after the copy's CUDA event on a GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self._rings: dict[int, torch.Tensor] = {}  # storage address -> the ring's tensor, kept mapped
        self._pinned: list[int] = []
        self._pending: queue.SimpleQueue | None = None
        if device.type == "cuda":
            self._pending = queue.SimpleQueue()
            threading.Thread(target=_release_loop, args=(self._pending,), name="job-slot-release",
                             daemon=True).start()
        self._finalizer = weakref.finalize(self, _close, self._pending, self._pinned, device)
        self._finalizer.atexit = False  # at exit the process ends: nothing to hand back or unpin

    def take(self, batch: SlotBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self._keep(batch.x, pin=True)
        self._keep(batch.y, pin=True)
        self._keep(batch.flags, pin=False)
        if self._pending is None:  # the CPU: the model trains on this very memory, so a copy of its own
            x, y = batch.x.clone(), batch.y.clone()
            batch.flags[batch.j] = 0
            return x, y
        return batch.x, batch.y

    def release(self, batch: SlotBatch) -> None:
        """After the copies from `take`'s tensors are queued on the current stream (a no-op on the CPU)."""
        if self._pending is None:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._pending.put((event, batch.flags, batch.j))

    def _keep(self, t: torch.Tensor, *, pin: bool) -> None:
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if address in self._rings:
            return
        self._rings[address] = torch.empty(0, dtype=torch.uint8).set_(storage)
        if pin and self._pending is not None and not t.is_pinned():
            if int(torch.cuda.cudart().cudaHostRegister(address, storage.nbytes(), 1)) == 0:  # 1: portable
                self._pinned.append(address)
            # else: not pinned; the copies from it are then synchronous, and the samples the same


def _release_loop(pending: queue.SimpleQueue) -> None:
    while True:
        item = pending.get()
        if item is None:
            return
        event, flags, j = item
        event.synchronize()
        flags[j] = 0


def _close(pending, pinned: list[int], device: torch.device) -> None:
    if pending is not None:
        pending.put(None)
    if pinned:
        torch.cuda.synchronize(device)  # no copy from a ring is still in flight
        for address in pinned:
            int(torch.cuda.cudart().cudaHostUnregister(address))
        pinned.clear()
