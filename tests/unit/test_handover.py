"""The training stream's hand-over from DataLoader workers (job.handover): each batch is collated into a slot the
worker reuses, and the training process gets the very samples it would get the default way, however many
batches it keeps, whatever the layout; batches that are not an (x, y) pair, or of another shape, cross the
default way; a slot never handed back is one line in the worker, not a hang."""

from __future__ import annotations

import pytest
import torch

import job.handover as handover
from job.data import _loader
from job.handover import HostSlots, SlotBatch, SlotCollate

CPU = torch.device("cpu")


class Ids:
    """Sample i: x a 3 x 4 x 5 block of i (channels-last underneath if asked, as the workers' crops are)."""

    def __init__(self, channels_last: bool = False):
        self.channels_last = channels_last

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i):
        x = torch.full((4, 5, 3), float(i)).permute(2, 0, 1) if self.channels_last else torch.full((3, 4, 5), float(i))
        return x, int(i)


def _batches(n: int, size: int = 6, last: int | None = None) -> list[list[int]]:
    out = [list(range(k * size, (k + 1) * size)) for k in range(n)]
    return out + ([list(range(n * size, n * size + last))] if last else [])


def _spy(monkeypatch, hosts: list | None = None) -> list[int]:
    taken: list[int] = []
    take = HostSlots.take

    def counting(self, batch, **kw):
        taken.append(batch.j)
        if hosts is not None and self not in hosts:
            hosts.append(self)
        return take(self, batch, **kw)

    monkeypatch.setattr(HostSlots, "take", counting)
    return taken


@pytest.mark.parametrize("channels_last", [False, True])
def test_every_batch_kept_is_its_own_samples_though_the_slots_are_reused(monkeypatch, channels_last):
    """30 batches from 2 workers (4 slots each) all kept: a batch handed over in slot memory the worker
    refills would show another batch's samples here."""
    hosts: list = []
    taken = _spy(monkeypatch, hosts)
    order = _batches(30)
    got = list(_loader("t", Ids(channels_last), order, workers=2, device=CPU, channels_last=False, prefetch=False,
                       persistent=True))
    assert len(got) == 30 and len(taken) == 30 and set(taken) <= set(range(4))  # every batch through a slot
    assert len(hosts) == 1 and len(hosts[0]._rings) == 2 * 3  # each worker's ring (x, y, flags) mapped once
    for (x, y), ids in zip(got, order):
        assert x.shape == (6, 3, 4, 5) and torch.equal(y, torch.tensor(ids))
        assert torch.equal(x, torch.tensor(ids, dtype=torch.float32).view(6, 1, 1, 1).expand(6, 3, 4, 5))


def test_a_batch_of_another_shape_and_the_held_out_loader_cross_the_default_way(monkeypatch):
    taken = _spy(monkeypatch)
    order = _batches(5, last=4)  # the last batch is short
    got = list(_loader("t", Ids(), order, workers=2, device=CPU, channels_last=False, prefetch=True, persistent=True))
    assert [len(y) for _, y in got] == [6] * 5 + [4] and len(taken) == 5
    assert torch.equal(got[-1][1], torch.arange(30, 34)) and float(got[-1][0][3].max()) == 33.0
    taken.clear()
    val = list(_loader("t", Ids(), _batches(3), workers=2, device=CPU, channels_last=False, prefetch=False,
                       persistent=False))
    assert len(val) == 3 and not taken  # short-lived workers keep no rings


class Doubled(Ids):
    """A dataset with a collate of its own that makes a pair: copied into the slot, not bypassed."""

    def collate(self, items):
        return torch.stack([x for x, _ in items]) * 2, torch.tensor([y for _, y in items])


def test_a_datasets_own_collate_is_what_crosses(monkeypatch):
    taken = _spy(monkeypatch)
    got = list(_loader("t", Doubled(), _batches(12), workers=2, device=CPU, channels_last=False, prefetch=True,
                       persistent=True))
    assert len(taken) == 12
    for (x, _), ids in zip(got, _batches(12)):
        assert torch.equal(x, 2 * torch.tensor(ids, dtype=torch.float32).view(6, 1, 1, 1).expand(6, 3, 4, 5))


class Dicts(Ids):
    """A dataset whose own collate makes a dict, and whose to_device makes the pair."""

    def collate(self, items):
        return {"x": torch.stack([x for x, _ in items]), "y": torch.tensor([y for _, y in items])}

    def to_device(self, batch, device):
        return batch["x"].to(device), batch["y"].to(device)


def test_what_is_not_an_x_y_pair_of_tensors_passes_through(monkeypatch):
    taken = _spy(monkeypatch)
    got = list(_loader("t", Dicts(), _batches(4), workers=2, device=CPU, channels_last=False, prefetch=False,
                       persistent=True))
    assert [y.tolist() for _, y in got] == _batches(4) and not taken
    plain = SlotCollate(lambda items: (torch.zeros(2), torch.ones(2)), slots=4, token=0)
    x, y = plain([1, 2])  # outside a worker (the memory plan's probes): as collated
    assert torch.equal(x, torch.zeros(2)) and torch.equal(y, torch.ones(2))


def test_the_cpu_side_hands_the_slot_back_with_a_copy_of_its_own():
    ring = handover._Ring(torch.zeros(2, 3), torch.zeros(2), slots=4)
    j = ring.slot()
    ring.xs[j].fill_(7)
    ring.flags[j] = 1
    slots = HostSlots()
    x, _ = slots.take(SlotBatch(ring.xs[j], ring.ys[j], ring.flags, j, slots.token))
    assert int(ring.flags[j]) == 0  # handed back at once
    ring.xs[j].fill_(9)  # the worker refills it
    assert float(x.max()) == 7.0


def test_a_slot_never_handed_back_is_one_line_not_a_hang(monkeypatch):
    monkeypatch.setattr(handover, "SLOT_WAIT_S", 0.05)
    ring = handover._Ring(torch.zeros(2, 3), torch.zeros(2), slots=2)
    ring.flags.fill_(1)
    with pytest.raises(RuntimeError, match="did not release a batch slot in 0 s"):
        ring.slot()


class Labelled(Ids):
    """Sample i with a label of another kind: a tensor (a token window's targets), or a float."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def __getitem__(self, i):
        x, _ = super().__getitem__(i)
        return x, (torch.full((2,), i, dtype=torch.int64) if self.kind == "tensor" else float(i))


@pytest.mark.parametrize("kind", ["tensor", "float"])
def test_the_slots_give_default_collates_batches_for_every_kind_of_label(monkeypatch, kind):
    from torch.utils.data import default_collate

    taken = _spy(monkeypatch)
    ds = Labelled(kind)
    got = list(_loader("t", ds, _batches(12), workers=2, device=CPU, channels_last=False, prefetch=False,
                       persistent=True))
    assert len(taken) == 12
    for (x, y), ids in zip(got, _batches(12)):
        want_x, want_y = default_collate([ds[i] for i in ids])
        assert torch.equal(x, want_x) and torch.equal(y, want_y) and y.dtype == want_y.dtype


class Niceness(Ids):
    """Sample i: x the nice value of the process that made it."""

    def __getitem__(self, i):
        import os

        return torch.full((3, 4, 5), float(os.nice(0))), int(i)


def test_the_workers_run_at_the_training_processs_priority_lowered_by_data_worker_nice():
    """data.worker_nice: both loaders' workers add it to the training process's nice value (capped at 19, the
    lowest priority); 0 leaves them at the training process's."""
    import os

    from job.data import _held_out_loader

    base = os.nice(0)
    for persistent in (True, False):
        for nice, want in ((7, min(19, base + 7)), (0, base)):
            got = list(_loader("t", Niceness(), _batches(4), workers=2, device=CPU, channels_last=False,
                               prefetch=False, persistent=persistent, nice=nice))
            assert {float(x.max()) for x, _ in got} == {float(want)}, (persistent, nice)
    for nice, want in ((7, min(19, base + 7)), (0, base)):
        loader, move = _held_out_loader("t", Niceness(), _batches(4), workers=2, device=CPU, channels_last=False, seed=0,
                                        nice=nice)
        got = [move(b) for b in loader]
        assert {float(x.max()) for x, _ in got} == {float(want)}, ("held-out", nice)
        loader._iterator._shutdown_workers()
    assert os.nice(0) == base  # the training process keeps its own


def test_data_worker_nice_reaches_both_loaders_and_defaults_to_10(tmp_path, monkeypatch):
    import job.data as data
    from job import config
    from job.data import Data

    seen = []

    def spy(name, real):
        def call(*a, **kw):
            seen.append((name, kw["nice"]))
            return real(*a, **kw)
        return call

    monkeypatch.setattr(data, "_loader", spy("training", data._loader))
    monkeypatch.setattr(data, "_held_out_loader", spy("held-out", data._held_out_loader))
    tokens = tmp_path / "t.bin"
    torch.arange(4000, dtype=torch.int16).numpy().tofile(tokens)
    for args, nice in (([], 10), (["data.worker_nice=3"], 3)):
        cfg = config.load(["workload=lm", "workload.seq_len=8", "data.kind=tokens", f"data.path={tokens}",
                           f"data.val_path={tokens}", "data.workers=1", "train.device=cpu", *args])
        d = Data(config.workload_of(cfg), config.workload_settings(cfg), cfg.data, seed=0, device=CPU)
        next(d.batches(micro_batch=2, start=0, offset=0, count=2, device=CPU, channels_last=False, prefetch=False))
        next(d.val_batches(batch=2, limit=2, rank=0, world=1, device=CPU, channels_last=False))
        assert seen[-2:] == [("training", nice), ("held-out", nice)]
        d.close()
    with pytest.raises(config.UsageError, match="data.worker_nice"):
        config.load(["data.worker_nice=20"])


def test_the_held_out_workers_are_forked_once_a_run_and_every_evaluation_reads_the_same_batches(tmp_path):
    """Validation's DataLoader workers start at the first evaluation and serve the later ones (one fork a run,
    not one an evaluation); every evaluation reads the same batches as one without workers; another shape
    of the held-out batches (a re-split) gets a new loader; close() stops the workers."""
    from job import config
    from job.data import Data

    tokens = tmp_path / "t.bin"
    torch.arange(4000, dtype=torch.int16).numpy().tofile(tokens)

    def data(workers):
        cfg = config.load(["workload=lm", "workload.seq_len=8", "data.kind=tokens", f"data.path={tokens}",
                           f"data.val_path={tokens}", f"data.workers={workers}", "train.device=cpu"])
        return Data(config.workload_of(cfg), config.workload_settings(cfg), cfg.data, seed=0, device=CPU)

    def evaluate(d, batch=4, rank=0, world=1):
        return [(x.clone(), y.clone(), n) for x, y, n in
                d.val_batches(batch=batch, limit=20, rank=rank, world=world, device=CPU, channels_last=False)]

    plain = data(0)
    want = evaluate(plain)
    plain.close()  # no workers: nothing to stop
    d = data(2)
    pids = []
    for _ in range(3):
        got = evaluate(d)
        assert len(got) == len(want) == 5
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(got, want))
        pids.append(sorted(w.pid for w in d._val[1]._iterator._workers))
    assert pids[0] == pids[1] == pids[2] and len(pids[0]) == 2
    kept = d._val[1]._iterator._workers
    half = evaluate(d, rank=1, world=2)  # the ranks changed: this rank's shares of the same batches
    assert [n for *_, n in half] == [2, 2, 2, 2, 2]
    assert all(not w.is_alive() for w in kept)
    now = d._val[1]._iterator._workers
    d.close()
    assert d._val is None and all(not w.is_alive() for w in now)


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_worker_killed_while_the_model_runs_is_raised_by_the_next_batch_not_inside_the_model(prefetch):
    """torch's SIGCHLD handler raised a dead worker's RuntimeError in the training thread wherever it was (a
    forward, an optimizer step: weights half updated, no checkpoint to trust). Now it is noted, and the
    training stream raises it when the next batch is taken, between steps, where the trainer checkpoints."""
    import os
    import signal
    import time

    stream = _loader("t", Ids(), _batches(100), workers=1, device=CPU, channels_last=False, prefetch=prefetch,
                     persistent=True)
    next(stream)
    [worker] = [w for w in stream.pids]
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 2.0
    spins = 0
    while time.monotonic() < deadline:  # the "model": Python bytecode, where a signal handler runs
        spins += 1
    assert spins > 1000
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pids?(\(s\))? {worker}\) "):
        for _ in range(100):  # batches already made may come first
            next(stream)


def _in_a_worker(monkeypatch):
    import torch.utils.data as tud

    monkeypatch.setattr(tud, "get_worker_info", lambda: object())


@pytest.mark.parametrize("channels_last", [False, True])
def test_samples_stack_into_a_slot_laid_out_as_they_are(monkeypatch, channels_last):
    """In a worker, default_collate's items are stacked into the slot without default_collate: a slot laid out
    as the samples are (channels-last images, as the workers' crops are, into a channels-last slot, which
    copies each image as it is instead of transposing it), holding default_collate's very batch."""
    from torch.utils.data import default_collate

    _in_a_worker(monkeypatch)
    ds = Ids(channels_last)
    collate = SlotCollate(default_collate, slots=4, token=0)
    for ids in _batches(3):
        out = collate([ds[i] for i in ids])
        assert isinstance(out, SlotBatch)
        want_x, want_y = default_collate([ds[i] for i in ids])
        assert torch.equal(out.x, want_x) and torch.equal(out.y, want_y)
        assert out.x.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert out.x.is_contiguous() != channels_last


class ImageCollate:
    """A collate that says it collates (tensor, label) items as default_collate does, and counts its calls."""

    default_collate_for_tensors = True

    def __init__(self):
        self.calls = 0

    def __call__(self, items):
        from torch.utils.data import default_collate

        self.calls += 1
        return default_collate(items)


def test_a_collate_that_says_it_is_default_collate_for_tensors_is_stacked_by_the_slots(monkeypatch):
    """job.datasets.ImageFolder's collate with data.decode=auto: its batches of pixels only are stacked
    straight into the slot (not collated into a batch of their own, then copied); a plain collate of its
    own is what crosses."""
    _in_a_worker(monkeypatch)
    ds = Ids(channels_last=True)
    marked, plain = ImageCollate(), ImageCollate()
    plain.default_collate_for_tensors = False
    for collate in (marked, plain):
        slots = SlotCollate(collate, slots=4, token=0)
        for ids in _batches(2):
            out = slots([ds[i] for i in ids])
            assert isinstance(out, SlotBatch) and torch.equal(out.y, torch.tensor(ids))
    assert marked.calls == 0 and plain.calls == 2


def test_a_batch_reaches_the_model_in_train_channels_lasts_layout_whatever_it_crossed_in(monkeypatch):
    """The workers' channels-last batch reaches the model contiguous with train.channels_last=false (torch's
    default layout, which the model's convolutions would otherwise follow), channels-last with true."""
    for flag in (False, True):
        got = list(_loader("t", Ids(channels_last=True), _batches(3), workers=2, device=CPU, channels_last=flag,
                           prefetch=False, persistent=True))
        for x, _ in got:
            assert x.is_contiguous(memory_format=torch.channels_last if flag else torch.contiguous_format)
            assert not x.is_contiguous(memory_format=torch.contiguous_format if flag else torch.channels_last)


class Layout(Ids):
    """A dataset whose to_device takes the model's layout, and records what it was given."""

    def __init__(self):
        super().__init__(channels_last=True)
        self.given: list = []

    def to_device(self, batch, device, memory_format=None):
        self.given.append(memory_format)
        x, y = batch
        return x.to(device).contiguous(memory_format=memory_format), y.to(device)


def test_a_to_device_with_a_memory_format_keyword_is_given_train_channels_lasts_layout():
    for flag, fmt in ((False, torch.contiguous_format), (True, torch.channels_last)):
        ds = Layout()
        got = list(_loader("t", ds, _batches(2), workers=0, device=CPU, channels_last=flag, prefetch=False,
                           persistent=False))
        assert ds.given == [fmt, fmt] and all(x.is_contiguous(memory_format=fmt) for x, _ in got)


def test_samples_of_different_shapes_are_left_to_the_collate_and_make_no_slots(monkeypatch):
    """Items default_collate cannot stack (images of two sizes): its own error, as without the slots, and no
    ring of slots made from the first sample's shape."""
    from torch.utils.data import default_collate

    _in_a_worker(monkeypatch)
    collate = SlotCollate(default_collate, slots=4, token=0)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        collate([(torch.zeros(3, 4, 5), 0), (torch.zeros(3, 5, 5), 1)])
    assert collate._ring is None


class Encoded:
    """A batch that names its large tensors, as job.datasets.EncodedBatch does: bytes of a length that varies
    with the batch (ids >= 60: over 2 MB, beyond the first ring's slots), channels-last pixels, an empty index,
    a field that is None, and a plain list."""

    HANDOVER_TENSORS = ("data", "pixels", "empty", "none")

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.data = torch.cat([torch.full((2_100_000 if i >= 60 else 1000 + i,), i % 251, dtype=torch.uint8)
                               for i in ids])
        self.pixels = torch.stack([torch.full((4, 5, 3), float(i)) for i in ids]).permute(0, 3, 1, 2)
        self.empty, self.none = torch.zeros(0, dtype=torch.long), None

    def __len__(self) -> int:
        return len(self.ids)


class EncodedIds(Ids):
    """A dataset whose collate makes (Encoded, labels) and whose to_device keeps what crossed."""

    def __init__(self):
        super().__init__()
        self.crossed: list = []

    def collate(self, items):
        return Encoded([y for _, y in items]), torch.tensor([y for _, y in items])

    def to_device(self, batch, device):
        self.crossed.append(batch)
        encoded, y = batch
        return encoded.pixels.to(device), y.to(device)


def test_a_batch_that_names_its_large_tensors_crosses_in_byte_slots_as_it_was_made(monkeypatch):
    """Every batch kept is the one the worker made (bytes, channels-last pixels, labels; an empty index and a
    None field as they were), though the slots are reused and a larger batch makes a larger ring; every batch
    through a slot, the training process's copies its own."""
    hosts: list = []
    taken = _spy(monkeypatch, hosts)
    ds = EncodedIds()
    order = _batches(12)  # batch 10 holds ids 60-65: the rings grow
    got = list(_loader("t", ds, order, workers=2, device=CPU, channels_last=False, prefetch=False, persistent=True))
    assert len(got) == 12 and len(taken) == 12
    assert len(hosts) == 1 and len(hosts[0]._rings) > 2 * 2  # each worker's flags and bytes, then larger bytes
    for (encoded, y), ids in zip(ds.crossed, order):
        want = Encoded(ids)
        assert encoded.ids == ids and torch.equal(y, torch.tensor(ids))
        assert torch.equal(encoded.data, want.data) and torch.equal(encoded.pixels, want.pixels)
        assert encoded.pixels.is_contiguous(memory_format=torch.channels_last)
        assert encoded.empty.numel() == 0 and encoded.empty.dtype == torch.long and encoded.none is None
        ring = encoded.data.untyped_storage().data_ptr()
        assert all(ring != r for r in hosts[0]._rings)  # a copy of its own, not the slot


def test_the_byte_slots_hand_back_at_once_and_grow_past_a_larger_batch(monkeypatch):
    _in_a_worker(monkeypatch)
    collate = SlotCollate(EncodedIds().collate, slots=2, token=0)
    small = collate([(None, i) for i in range(3)])
    assert isinstance(small, handover.PackedBatch) and collate._bytes.capacity == 1 << 20
    slots = HostSlots()
    encoded, y = slots.take(small)
    assert int(small.flags[small.j]) == 0 and torch.equal(y, torch.tensor([0, 1, 2]))
    big = collate([(None, i) for i in (60, 61)])  # 4.2 MB: a new ring, 1.25 x that in whole MiB
    assert collate._bytes.capacity == 6 << 20 and torch.equal(big.batch.data, Encoded([60, 61]).data)
    assert torch.equal(encoded.data, Encoded([0, 1, 2]).data)  # the first batch's copy is untouched


def test_the_pinning_thread_pins_every_tensor_of_a_packed_batch_and_hands_its_slot_back(monkeypatch):
    """What the DataLoader's pinning thread calls on a GPU run (PackedBatch.pin_memory), with Tensor.pin_memory
    stood in for (no CUDA here): every non-empty tensor of the batch and the labels pinned, in their layouts,
    the slot handed back to its worker, through the loader's HostSlots found by token."""
    pinned = []

    def pin_memory(t, device=None):
        copy = t.clone()
        pinned.append(copy)
        return copy

    _in_a_worker(monkeypatch)
    collate = SlotCollate(EncodedIds().collate, slots=2, token=0)
    packed = collate([(None, i) for i in range(4)])
    host = HostSlots()
    packed.token = host.token
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    encoded, y = packed.pin_memory()
    assert int(packed.flags[packed.j]) == 0 and host._rings
    assert all(any(t is p for p in pinned) for t in (encoded.data, encoded.pixels, y))
    assert not any(encoded.empty is p for p in pinned) and encoded.none is None  # empty: copied, not pinned
    assert encoded.pixels.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(encoded.data, Encoded([0, 1, 2, 3]).data) and torch.equal(y, torch.arange(4))
