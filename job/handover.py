"""How a DataLoader worker's batch reaches the training process: in shared-memory slots the worker reuses.

By default each batch a worker returns is a fresh shared-memory file: the worker stacks the batch into it,
the training process maps it (a page fault per 4 kB page), the DataLoader's pinning thread copies it into
pinned memory, and the file is unmapped and deleted. For ResNet-50's uint8 batch of 256 (38.5 MB) that
cost the training process 35 ms of CPU a batch on an H200 host (`python -m job.bench.decoders`' hand-over),
most of a core at 25 batches a second, beside the thread that launches the model's kernels.

Here each worker keeps a ring of `prefetch_factor + SPARE_SLOTS` slots, made on its first batch, and
stacks each batch into its next free slot. The training process keeps every ring it has seen mapped (torch's
sharing then finds the mapping it already has: no page faults, no new file), copies the batch out (into
pinned memory on a GPU, in the pinning thread; a tensor of its own on the CPU) and hands the slot back at
once. The samples are the same as the default hand-over's.

A slot holds one (x, y) pair of tensors. A batch whose first item names its large tensors (`HANDOVER_TENSORS`:
job.datasets.EncodedBatch's JPEG bytes, the pixels the workers decoded, where each goes), with the labels as
its second, crosses in a ring of byte slots instead, sized to the largest batch so far: those tensors and the
labels are laid out in one slot, and the training process copies them out as it does a pair. Freeing the
fresh shared-memory files of the default hand-over (unmapping them) holds the interpreter lock: py-spy on an
H100 host found the pinning thread there 12 % of the time while it handed such batches over, in the time the
model's kernels are launched. Anything else a collate function returns (dicts, a batch of another shape than
the first) crosses the default way.

Where the collate function is torch's default_collate, or says it collates (tensor, label) items as
default_collate does (an attribute `default_collate_for_tensors = True`, as job.datasets.ImageFolder's), the
worker stacks such items straight into its slot, laid out as the samples are: channels-last images (what a
JPEG decoder writes, and the workers' crops) stack into a channels-last slot, a plain copy a sample, where
default_collate's contiguous batch transposes each one (84 against 23 us a 224 x 224 image, one core of the
development machine).
"""
from __future__ import annotations

import itertools
import os
import time
import weakref

import torch

SPARE_SLOTS = 2  # beyond the DataLoader's prefetch_factor: the batch being copied out, and one spare
SLOT_WAIT_S = 600.0  # a worker waiting this long for a slot the training process never released gives up


class _InSlot:
    """A collated batch in slot j of a worker's ring (flags[j] is 1 until the training process has its own copy
    of it), from the loader whose HostSlots carries `token`."""

    def pin_memory(self, device=None):
        """What a DataLoader's pinning thread calls (on a GPU): the batch copied into pinned memory, its
        slot handed back."""
        host = _HOSTS.get(self.token) or HostSlots()  # the loader's (gone: a throw-away one)
        return host.take(self, pinned=True)


class SlotBatch(_InSlot):
    """A collated (x, y) batch in slot j of a worker's (x, y) ring."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, flags: torch.Tensor, j: int, token: int):
        self.x, self.y, self.flags, self.j, self.token = x, y, flags, j, token

    def __len__(self) -> int:
        return len(self.x)


class _Slots:
    """A worker's ring of `slots` slots: flags[j] is 1 while the training process has not copied slot j out."""

    def __init__(self, slots: int):
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


class _Ring(_Slots):
    """Slots for one (x, y) pair each, shaped and laid out as the ring's first batch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, slots: int):
        super().__init__(slots)
        self.key = _key(x, y)
        self.xs, self.ys = _slots_like(x, slots), _slots_like(y, slots)


class _ByteRing(_Slots):
    """Slots of `capacity` bytes each, for the tensors of a PackedBatch."""

    def __init__(self, capacity: int, slots: int):
        super().__init__(slots)
        self.capacity = capacity
        self.bufs = torch.empty((slots, capacity), dtype=torch.uint8).share_memory_()


ALIGN = 64  # each tensor's bytes start at a multiple of this in its slot (any dtype can view them)
GROWTH = 1.25  # a batch larger than the byte slots makes a new ring, this much larger, in whole MiB


def _in_memory(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """t's elements as they lie in memory (a contiguous view, or a contiguous copy where t is neither contiguous
    nor channels-last), and the permutation that lays that out as t again (None: as it is)."""
    if _channels_last(t):
        return t.permute(0, 2, 3, 1), (0, 3, 1, 2)
    return t.contiguous(), None


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _packed_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


def _pack(tensors: list[torch.Tensor], slot: torch.Tensor) -> list[torch.Tensor]:
    """Each of `tensors` copied into the uint8 `slot`, one after another; views of the slot laid out as they are."""
    views, offset = [], 0
    for t in tensors:
        mem, perm = _in_memory(t)
        n = mem.numel() * mem.element_size()
        view = slot[offset:offset + n].view(mem.dtype).view(mem.shape)
        view.copy_(mem)
        views.append(view.permute(*perm) if perm else view)
        offset += _aligned(n)
    return views


class PackedBatch(_InSlot):
    """A collated (batch, y) pair whose batch's HANDOVER_TENSORS and labels y lie in slot j of a worker's byte
    ring."""

    def __init__(self, batch, y: torch.Tensor, flags: torch.Tensor, j: int, token: int):
        self.batch, self.y, self.flags, self.j, self.token = batch, y, flags, j, token

    def __len__(self) -> int:
        return len(self.y)


def _handover_names(batch) -> list[str]:
    """The names in type(batch).HANDOVER_TENSORS that hold a tensor on this batch (a field may be None)."""
    return [n for n in type(batch).HANDOVER_TENSORS if torch.is_tensor(getattr(batch, n, None))]


def _packable(batch) -> bool:
    return (isinstance(batch, (tuple, list)) and len(batch) == 2 and hasattr(type(batch[0]), "HANDOVER_TENSORS")
            and torch.is_tensor(batch[1]) and batch[1].device.type == "cpu")


def _channels_last(t: torch.Tensor) -> bool:
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _slots_like(t: torch.Tensor, slots: int) -> torch.Tensor:
    """`slots` x t's shape in shared memory, each slot laid out as t is (contiguous, or channels-last as a
    dataset's own collate may make it), so filling one is a plain copy."""
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

    def __init__(self, collate, slots: int, token: int):
        self.collate, self.slots, self.token = collate, slots, token
        self._ring: _Ring | None = None
        self._bytes: _ByteRing | None = None

    def __getstate__(self):  # to spawned workers: each makes its own rings
        return {**self.__dict__, "_ring": None, "_bytes": None}

    def __call__(self, items):
        from torch.utils.data import default_collate, get_worker_info

        worker = get_worker_info() is not None
        if worker and (self.collate is default_collate or getattr(self.collate, "default_collate_for_tensors", False)):
            stacked = self._stacked(items)
            if stacked is not None:
                return stacked
        batch = self.collate(items)
        if worker and _packable(batch):
            return self._packed(*batch)
        if not worker or not _pair(batch):
            return batch
        x, y = batch
        if self._ring is None:
            self._ring = _Ring(x, y, self.slots)
        ring = self._ring
        if ring.key != _key(x, y):  # another shape than the first batch: the default hand-over
            return batch
        return self._fill(lambda xs, ys: (xs.copy_(x), ys.copy_(y)))

    def _fill(self, write) -> SlotBatch:
        """The ring's next free slot, written by write(x slot, y slot) and marked full."""
        ring = self._ring
        j = ring.slot()
        write(ring.xs[j], ring.ys[j])
        ring.flags[j] = 1
        return SlotBatch(ring.xs[j], ring.ys[j], ring.flags, j, self.token)

    def _packed(self, batch, y: torch.Tensor) -> PackedBatch:
        """batch's HANDOVER_TENSORS (those that are tensors) and y, copied into the byte ring's next free slot;
        batch holds views of it from then on. A batch larger than the slots makes a larger ring (the training
        process keeps the old one mapped, as every ring it has seen)."""
        names = _handover_names(batch)
        tensors = [getattr(batch, n) for n in names] + [y]
        need = _packed_bytes(tensors)
        if self._bytes is None or need > self._bytes.capacity:
            mib = 1 << 20
            self._bytes = _ByteRing(-(-int(need * GROWTH) // mib) * mib, self.slots)
        ring = self._bytes
        j = ring.slot()
        views = _pack(tensors, ring.bufs[j])
        for name, view in zip(names, views):
            setattr(batch, name, view)
        ring.flags[j] = 1
        return PackedBatch(batch, views[-1], ring.flags, j, self.token)

    def _stacked(self, items) -> SlotBatch | None:
        """default_collate's batch of (tensor, int or tensor) items, stacked straight into the next slot (in
        a worker, default_collate would stack into a new shared-memory file, the very cost the slots save);
        None where the items are not such a batch, or not like the ring's. The first such batch makes the
        ring, laid out as its first sample is (channels-last where that is)."""
        if not items or not all(isinstance(it, (tuple, list)) and len(it) == 2 and torch.is_tensor(it[0])
                                for it in items):
            return None
        x0, labels = items[0][0], [y for _, y in items]
        if not all(x.shape == x0.shape and x.dtype == x0.dtype for x, _ in items):
            return None  # default_collate's to refuse, or a collate of the dataset's own to batch
        if all(type(y) is int for y in labels):
            ids, y_like = torch.tensor(labels), torch.empty((len(items),), dtype=torch.int64, device="meta")
        elif all(torch.is_tensor(y) and y.shape == labels[0].shape and y.dtype == labels[0].dtype for y in labels):
            ids, y_like = None, torch.empty((len(items), *labels[0].shape), dtype=labels[0].dtype, device="meta")
        else:
            return None
        x_like = batch_like(x0, len(items))
        if self._ring is None:
            self._ring = _Ring(x_like, y_like, self.slots)
        xs, ys = self._ring.xs[0], self._ring.ys[0]
        if (xs.shape, xs.dtype, ys.shape, ys.dtype) != (x_like.shape, x_like.dtype, y_like.shape, y_like.dtype):
            return None  # a batch of another shape than the first (a short last batch): the default hand-over

        def write(x_slot, y_slot):
            torch.stack([x for x, _ in items], out=x_slot)
            if ids is None:
                torch.stack(labels, out=y_slot)
            else:
                y_slot.copy_(ids)

        return self._fill(write)


def batch_like(x0: torch.Tensor, n: int, device: str = "meta") -> torch.Tensor:
    """An empty batch of n samples like x0 (a meta one by default: its shape and layout), channels-last where
    x0 is a C x H x W image stored H x W x C, so stacking such samples into it copies each as it is."""
    if x0.dim() == 3 and not x0.is_contiguous() and x0.permute(1, 2, 0).is_contiguous():
        c, h, w = x0.shape
        return torch.empty((n, h, w, c), dtype=x0.dtype, device=device).permute(0, 3, 1, 2)
    return torch.empty((n, *x0.shape), dtype=x0.dtype, device=device)


class HostSlots:
    """The training process's side of the workers' rings: keeps each ring it has seen mapped, so the next
    batch in it maps nothing; `take` copies a SlotBatch out and hands its slot back."""

    def __init__(self):
        self._rings: dict[int, torch.Tensor] = {}  # storage address -> the ring, kept mapped
        self.token = next(_TOKENS)  # what its loader's SlotBatches carry, to find it from the pinning thread
        _HOSTS[self.token] = self

    def take(self, batch: SlotBatch | PackedBatch, *, pinned: bool = False) -> tuple:
        """(x, y) of a SlotBatch, (batch, y) of a PackedBatch, in memory of their own (pinned, from the pinning
        thread); the slot handed back."""
        packed = isinstance(batch, PackedBatch)
        for t in (batch.y, batch.flags) if packed else (batch.x, batch.y, batch.flags):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._rings:  # a ring seen for the first time: kept mapped from now on
                self._rings[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(storage)

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory() if pinned and t.numel() else t.clone()  # either keeps t's layout

        if packed:
            out = batch.batch
            for name in _handover_names(out):
                setattr(out, name, own(getattr(out, name)))
            out = out, own(batch.y)
        else:
            out = own(batch.x), own(batch.y)
        batch.flags[batch.j] = 0
        return out


_TOKENS = itertools.count(1)
_HOSTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # token -> its loader's HostSlots
