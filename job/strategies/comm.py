"""One process, several cards: sums across the cards, and the flat buffers that make them cheap.

torch.distributed needs one process per card. `balanced` drives every card from one process, so its sums
go through NCCL's single-process API (`torch.cuda.nccl.all_reduce`, one tensor per card in one group
call, as DataParallel's own collectives do), falling back to reduce-add + broadcast where NCCL cannot
take the tensors, and to plain sums on a CPU.

Summing many small tensors costs one launch each; so the tensors that are summed every step live as
views of a few flat tensors (`FlatViews`): a replica's normalisation statistics in one flat tensor per
dtype, its gradients in buckets. Nothing is flattened (copied) per step, which is why torch's private
`_flatten_dense_tensors` is not used: the tensors already live in the flat buffers, as in DDP's reducer
with gradient_as_bucket_view. `GradReducer` sums each bucket as soon as every card's backward has produced
it, on a side stream, while the backward goes on with earlier layers (what DDP does across processes);
only the last bucket's sum is left when the backward ends.
"""

from __future__ import annotations

import threading
from functools import partial

import torch
from torch import nn

MB = 1024 * 1024


def _view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The part of `flat` at `offset` shaped like `like`, with its strides when it is dense (a channels_last
    weight gets a channels_last gradient: fused optimizers need matching layouts, as DDP's bucket views)."""
    if _dense(like):
        return flat.as_strided(like.shape, like.stride(), offset)
    return flat[offset:offset + like.numel()].view(like.shape)


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill exactly numel() consecutive slots, in some dimension order."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def nccl_ok(tensors: list[torch.Tensor]) -> bool:
    """Whether NCCL's single-process all-reduce takes these tensors (one per card)."""
    if tensors[0].device.type != "cuda":
        return False
    try:
        from torch.cuda import nccl

        return bool(nccl.is_available(tensors))
    except (ImportError, RuntimeError):
        return False


def allreduce_sum(flats: list[torch.Tensor], devices: list[torch.device],
                  streams: list[torch.cuda.Stream] | None = None) -> None:
    """Sum equal-shaped tensors, one per device, in place on every device (on `streams` when given,
    else each device's current stream)."""
    if nccl_ok(flats):
        from torch.cuda import nccl

        nccl.all_reduce(flats, streams=streams)
        return
    if devices[0].type == "cuda":
        reduced = torch.cuda.comm.reduce_add(flats, destination=devices[0].index)
        for f, r in zip(flats, torch.cuda.comm.broadcast(reduced, [d.index for d in devices])):
            f.copy_(r)
        return
    total = flats[0].clone()
    for f in flats[1:]:
        total += f
    for f in flats:
        f.copy_(total)


class FlatViews:
    """Tensors re-homed, in order, into flat tensors: one per group of indices given. `views[i]` is
    tensor i's new home (a view of `flats[g]`); `group_of[i]` its group."""

    def __init__(self, tensors: list[torch.Tensor], groups: list[list[int]], *, copy: bool):
        self.flats: list[torch.Tensor] = []
        self.views: dict[int, torch.Tensor] = {}
        self.group_of: dict[int, int] = {}
        for g, ids in enumerate(groups):
            like = tensors[ids[0]]
            flat = torch.zeros(sum(tensors[i].numel() for i in ids), dtype=like.dtype, device=like.device)
            offset = 0
            for i in ids:
                v = _view(flat, offset, tensors[i])
                if copy:
                    v.copy_(tensors[i])
                self.views[i], self.group_of[i] = v, g
                offset += tensors[i].numel()
            self.flats.append(flat)


def group_by(tensors: list[torch.Tensor], ids: list[int], cap_bytes: float = float("inf")) -> list[list[int]]:
    """Consecutive runs of `ids` with one dtype and at most cap_bytes each (a tensor alone may exceed it)."""
    groups: list[list[int]] = []
    size, dtype = 0, None
    for i in ids:
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        if not groups or t.dtype != dtype or size + nbytes > cap_bytes:
            groups.append([])
            size, dtype = 0, t.dtype
        groups[-1].append(i)
        size += nbytes
    return groups


def rehome_buffers(module: nn.Module, buffers: list[torch.Tensor], groups: list[list[int]]) -> FlatViews:
    """Make `module`'s buffers views of flat tensors (their values kept), so that one kernel touches
    them all; every place the module registers one of them points to its view."""
    home = FlatViews(buffers, groups, copy=True)
    new = {id(buffers[i]): home.views[i] for i in home.views}
    for mod in module.modules():
        for name, b in mod._buffers.items():
            if b is not None and id(b) in new:
                mod._buffers[name] = new[id(b)]
    return home


class GradReducer:
    """Every replica's gradients as views of its buckets (same layout on every card); after the last
    micro-step's backward each bucket holds the sum over the cards.

    A bucket is summed as soon as every replica that trained samples has accumulated all of its
    gradients (a post-accumulate-grad hook per parameter counts them): on CUDA with NCCL, on a side
    stream per card, launched from the autograd thread that completed it, overlapping the rest of the
    backward. Buckets follow the parameters in reverse order (backward produces the last layers'
    gradients first). What the backward never completed (parameters one replica did not use, or no
    NCCL) is summed when it ends. A parameter that got no gradient on any replica during the step keeps
    none, as in one process; a replica that trained no samples holds zeros and takes the others' sum.
    """

    def __init__(self, params: list[list[nn.Parameter]], devices: list[torch.device], bucket_mb: float):
        self.params, self.devices = params, devices
        ids = [i for i in reversed(range(len(params[0]))) if params[0][i].requires_grad]
        self.buckets = group_by(params[0], ids, bucket_mb * MB)
        self.homes = [FlatViews(replica, self.buckets, copy=False) for replica in params]
        self.size = [len(ids_) for ids_ in self.buckets]
        self.overlap = len(devices) > 1 and nccl_ok([h.flats[0] for h in self.homes]) if self.buckets else False
        self.streams = [torch.cuda.Stream(d) for d in devices] if self.overlap else None
        if self.overlap:  # NCCL builds its communicator on first use: here, not in an autograd thread
            allreduce_sum([torch.zeros(1, device=d) for d in devices], devices)
        self._lock = threading.Lock()
        self._pairs = [(replica[i], v) for replica, home in zip(params, self.homes) for i, v in home.views.items()]
        self.armed, self.closing, self.active = False, False, [True] * len(devices)
        self.touched: list[set[int]] = [set() for _ in params]
        self.pending: list[list[int]] = []
        self.events: list[list] = []
        self.ready: list[int] = []
        self.launched: list[bool] = []
        self.handles = [p.register_post_accumulate_grad_hook(partial(self._accumulated, k, i))
                        for k, replica in enumerate(params) for i in ids for p in (replica[i],)]

    def prepare(self, active: list[bool], *, sync: bool) -> None:
        """Before a micro-step's backward. A step starts when the optimizer has set every gradient to None:
        the buckets are zeroed and become the gradients. `active[k]`: replica k trains samples in this
        micro-step; `sync` arms the per-bucket sums for its backward (the last micro-step)."""
        if all(p.grad is None for p, _ in self._pairs):
            for home in self.homes:
                for flat in home.flats:
                    flat.zero_()
            for p, v in self._pairs:
                p.grad = v
            self.touched = [set() for _ in self.params]
        else:  # mid-step, or gradients zeroed in place: any gradient not in its bucket moves there
            for p, v in self._pairs:
                if p.grad is not v:
                    v.copy_(p.grad) if p.grad is not None else v.zero_()
                    p.grad = v
        n = len(self.buckets)
        self.pending = [list(self.size) for _ in self.params]
        self.events = [[None] * n for _ in self.params]
        self.ready, self.launched = [0] * n, [False] * n
        self.active, self.armed = active, sync and len(self.devices) > 1
        self.closing = sync
        if self.armed and self.overlap:  # the side streams start after what is queued (zeroing, optimizer)
            for d, s in zip(self.devices, self.streams):
                s.wait_stream(torch.cuda.current_stream(d))

    def _accumulated(self, k: int, i: int, _param) -> None:
        self.touched[k].add(i)
        if not self.armed or not self.active[k]:
            return
        b = self.homes[k].group_of[i]
        with self._lock:
            self.pending[k][b] -= 1
            if self.pending[k][b]:
                return
            if self.overlap:
                self.events[k][b] = torch.cuda.current_stream(self.devices[k]).record_event()
            self.ready[b] += 1
            if self.ready[b] < sum(self.active) or not self.overlap:
                return
            self.launched[b] = True
        self._launch(b)

    def _launch(self, b: int) -> None:
        for event, stream in zip((ev[b] for ev in self.events), self.streams):
            if event is not None:
                stream.wait_event(event)
        allreduce_sum([home.flats[b] for home in self.homes], self.devices, self.streams)

    def finish(self) -> None:
        """After the last micro-step's backward: sum what is left (several cards), order each card's
        stream after the sums, and take the gradient away from parameters no replica gave one."""
        if not self.closing:
            return
        self.closing = False
        if self.armed:
            self.armed = False
            if self.overlap:
                for d, s in zip(self.devices, self.streams):
                    s.wait_stream(torch.cuda.current_stream(d))
            for b, done in enumerate(self.launched):
                if not done:
                    allreduce_sum([home.flats[b] for home in self.homes], self.devices, self.streams)
            if self.overlap:
                for d, s in zip(self.devices, self.streams):
                    torch.cuda.current_stream(d).wait_stream(s)
        used = set().union(*self.touched)
        for replica, home in zip(self.params, self.homes):
            for i in home.views:
                if i not in used:
                    replica[i].grad = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
