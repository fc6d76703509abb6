"""job.data's pieces on their own: which global sample ids a process trains, and in which order the items of a
data set are visited, so that a resumed, re-split or re-accumulated run sees the same samples."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from job import data, devices
from job.datasets import BadImage, SampleIndex
from job.errors import UsageError


def test_the_shares_of_a_micro_batch_tile_it_and_a_resume_continues_the_stream():
    mb = 12
    # any split over the ranks (job.memplan's shares) covers the micro-batch once, in order
    for shares in ([12], [6, 6], [5, 7], [1, 3, 8]):
        ids, offset = [], 0
        for count in shares:
            ids += list(data.sample_ids(3, mb, offset=offset, count=count))
            offset += count
        assert ids == list(range(3 * mb, 4 * mb))
    # a run resumed at sample 36 (base) trains what the uninterrupted run trained from its 4th micro-batch on
    assert data.sample_ids(0, mb, base=36) == data.sample_ids(3, mb)
    # the same samples under accumulation 2 (micro-batch 6) as under 1 (micro-batch 12)
    assert [*data.sample_ids(6, 6), *data.sample_ids(7, 6)] == list(data.sample_ids(3, 12))


def test_each_epoch_visits_every_item_once_in_its_own_seeded_order():
    items = [10, 11, 12, 13, 14, 15, 16]
    order = data.EpochOrder(items, seed=3)
    first, second = order(range(0, 7)), order(range(7, 14))
    assert sorted(first) == items and sorted(second) == items
    assert list(first) != list(second)  # a fresh permutation per epoch
    assert all(isinstance(s, SampleIndex) for s in first)
    assert [s.sample_id for s in second] == list(range(7, 14)) and {s.seed for s in second} == {3}
    # the item of a sample id does not depend on how the ids were asked for (micro-batch, resume, rank)
    again = data.EpochOrder(items, seed=3)
    pieces = [*again(range(9, 14)), *again(range(0, 9))]
    assert [int(s) for s in pieces] == [int(s) for s in (*second[2:], *first, *second[:2])]
    assert [int(s) for s in data.EpochOrder(items, seed=4)(range(7))] != [int(s) for s in first]


def test_an_epochs_slice_read_at_once_gives_each_id_the_item_its_permutation_does():
    """EpochOrder reads a whole slice of an epoch's permutation at once: each sample id still gets item
    indices[perm_e[id % n]] of its epoch e's seeded permutation, for ranges within an epoch, across one or more
    epoch ends, and asked for out of order."""
    import random

    import torch

    items = list(range(100, 113))
    n = len(items)

    def item(i: int, seed: int) -> int:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + i // n))
        return items[int(perm[i % n])]

    order, rng = data.EpochOrder(items, seed=5), random.Random(0)
    for _ in range(40):
        start = rng.randrange(0, 6 * n)
        ids = range(start, start + rng.randrange(0, 3 * n))
        got = order(ids)
        assert [int(s) for s in got] == [item(i, 5) for i in ids]
        assert [s.sample_id for s in got] == list(ids) and {s.seed for s in got} <= {5}


def test_the_batch_sampler_resumed_at_a_position_yields_the_rest_of_the_stream():
    items = list(range(20))

    def stream(start: int, micro_batch: int, offset: int, count: int, n: int) -> list[list[int]]:
        it = iter(data._BatchSampler(data.EpochOrder(items, seed=1), start=start, micro_batch=micro_batch,
                                     offset=offset, count=count))
        return [[int(s) for s in next(it)] for _ in range(n)]

    whole = stream(0, 8, 0, 8, 6)  # 48 samples: over two epochs of 20 items
    assert stream(16, 8, 0, 8, 4) == whole[2:]  # resumed after two micro-batches
    halves = list(zip(stream(0, 8, 0, 3, 6), stream(0, 8, 3, 5, 6)))  # two ranks, shares 3 and 5
    assert [a + b for a, b in halves] == whole


def test_the_held_out_split_is_fixed_disjoint_and_refuses_an_empty_side():
    train, val = data.held_out_split(50, 0.2, path="d")
    assert len(val) == 10 and sorted(train + val) == list(range(50)) and not set(train) & set(val)
    assert (train, val) == data.held_out_split(50, 0.2, path="d")  # not the run's seed: every run holds out the same
    with pytest.raises(UsageError, match=r"data.val_fraction=0.01 of the 50 samples in d leaves no held-out samples"):
        data.held_out_split(50, 0.01, path="d")
    with pytest.raises(UsageError, match="leaves no training samples"):
        data.held_out_split(50, 0.999, path="d")


def test_the_synthetic_pool_gives_a_sample_id_the_same_sample_however_the_batch_is_cut():
    class Pool(data.SyntheticPool):
        def __init__(self):  # a pool without a workload: 5 samples
            self.x, self.y, self.size = torch.arange(5.0).view(5, 1) * 10, torch.arange(5), 5

    pool = Pool()
    x, y = pool.batch(range(3, 11))
    a, b = pool.batch(range(3, 6)), pool.batch(range(6, 11))
    assert torch.equal(torch.cat([a[0], b[0]]), x) and torch.equal(torch.cat([a[1], b[1]]), y)
    assert torch.equal(x[:, 0], y.float() * 10)  # inputs and targets stay paired
    assert len(set(pool.batch(range(0, 5))[1].tolist())) == 5  # one pass of the pool visits every sample


def test_a_pair_that_is_not_x_and_y_of_n_samples_is_one_line():
    good = torch.zeros(4, 3), torch.zeros(4)
    assert data._check_pair("w", "example_batch", good, 4) == good
    with pytest.raises(UsageError, match=r"workload `w`: example_batch gave Tensor, not an \(x, y\) pair"):
        data._check_pair("w", "example_batch", torch.zeros(4), 4)
    with pytest.raises(UsageError, match=r"gave x of shape \(4, 3\) and y of shape \(5,\) for 4 samples"):
        data._check_pair("w", "example_batch", (torch.zeros(4, 3), torch.zeros(5)), 4)


def test_the_prefetcher_moves_the_next_batch_on_its_thread_in_order_and_raises_in_the_callers():
    """data.prefetch: `move` runs one batch ahead on the background thread; the loader is read by the caller's
    thread; batches come out in order, and an exception in `move` (a file that does not decode) is raised by
    `next` in the caller's thread, after the batches before it."""
    import threading

    from job.data import Prefetcher

    main = threading.get_ident()
    read_by, moved_by = [], []

    def loader():
        for i in range(5):
            read_by.append(threading.get_ident())
            yield torch.full((2,), i), torch.tensor([i])

    def move(batch):
        moved_by.append(threading.get_ident())
        x, y = batch
        if int(y) == 3:
            raise BadImage("cannot read image c0/3.jpg (damaged); fix or remove the file")
        return x * 10, y

    p = Prefetcher(loader(), torch.device("cpu"), move)
    assert [int(y) for _, y in (next(p), next(p), next(p))] == [0, 1, 2]
    with pytest.raises(BadImage, match="c0/3.jpg"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)
    assert set(read_by) == {main} and main not in moved_by and len(set(moved_by)) == 1
    done = Prefetcher(iter([(torch.ones(1), torch.zeros(1))]), torch.device("cpu"), lambda b: b)
    assert torch.equal(next(done)[0], torch.ones(1))
    with pytest.raises(StopIteration):
        next(done)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_prefetch_thread_prepares_depth_batches_ahead_in_order(depth):
    """data.prefetch_depth: the loader is read `depth` batches ahead of the one handed out (never more), the
    batches come out in the loader's order, a failed move is raised by the `next` for its batch with nothing
    taken after it, and the end of the loader ends the stream."""
    from job.data import Prefetcher

    taken = []

    def loader(n=8):
        for i in range(n):
            taken.append(i)
            yield torch.full((2,), i), torch.tensor([i])

    def move(batch):
        x, y = batch
        if int(y) == 5:
            raise BadImage("cannot read image c0/5.jpg (damaged); fix or remove the file")
        return x * 10, y

    p = Prefetcher(loader(), torch.device("cpu"), move, depth=depth)
    assert taken == list(range(depth))
    for i in range(5):
        x, y = next(p)
        assert int(y) == i and torch.equal(x, torch.full((2,), 10 * i))
        assert taken == list(range(min(i + 1 + depth, 8)))
    with pytest.raises(BadImage, match="c0/5.jpg"):
        next(p)
    with pytest.raises(StopIteration):
        next(p)
    short = Prefetcher(loader(2), torch.device("cpu"), lambda b: b, depth=depth)
    assert [int(y) for _, y in short] == [0, 1]

    def failing():  # the loader itself fails at batch 2 (a worker's error): raised there, nothing taken after
        yield torch.zeros(1), torch.tensor([0])
        yield torch.zeros(1), torch.tensor([1])
        raise BadImage("cannot read image c1/2.jpg (damaged); fix or remove the file")

    f = Prefetcher(failing(), torch.device("cpu"), lambda b: b, depth=depth)
    assert [int(next(f)[1]) for _ in range(2)] == [0, 1]
    with pytest.raises(BadImage, match="c1/2.jpg"):
        next(f)
    with pytest.raises(StopIteration):
        next(f)


def test_a_deeper_prefetch_moves_the_point_where_auto_changes_the_split_further_ahead():
    from job.data import tuner_lookahead

    assert tuner_lookahead(16) == tuner_lookahead(16, 1) == 16 * 2 + 4
    assert tuner_lookahead(16, 3) == tuner_lookahead(16) + 2


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_stream_times_where_the_wait_for_a_batch_goes(prefetch):
    """InputTimings: the seconds taking batches from the loader (the workers and their hand-over), waiting for
    `move` and running it, on the prefetch thread or the training thread. A loader that takes 40 ms a batch and
    a move of 25 ms, 6 batches: each figure at least what the sleeps add up to, and not far above."""
    from job.data import InputTimings, Prefetcher, _moved

    def loader():
        for i in range(6):
            time.sleep(0.04)
            yield torch.full((2,), i), torch.tensor([i])

    def move(batch):
        time.sleep(0.025)
        return batch

    timings = InputTimings()
    it = Prefetcher(loader(), torch.device("cpu"), move, timings) if prefetch else _moved(loader(), move, timings)
    got = []
    for _, y in it:
        got.append(int(y))
        time.sleep(0.05)  # the step: with data.prefetch the next batch's move runs meanwhile
    assert got == list(range(6))
    take, move_wait, move_busy = timings.read()
    assert 6 * 0.04 <= take < 6 * 0.04 + 1.0, timings.read()
    assert 6 * 0.025 <= move_busy < 6 * 0.025 + 1.0, timings.read()
    if prefetch:  # the training thread hardly waits for a move that ran during its step
        assert move_wait < move_busy / 2, timings.read()
    else:
        assert move_wait == move_busy


def test_the_input_line_says_where_the_wait_went():
    from job.train import input_verdict

    line = input_verdict(0.3, 15.2, 0.9, workers=16, cores=16, split=(0.08, 0.22, 0.97), prefetch=True)
    assert line.startswith("input: the loop waited for data 30% of the timed steps (taking batches from the workers "
                           "8%, moving them to the device 22%; the prefetch thread busy 97%); its 16 workers kept "
                           "15.2 cores busy"), line
    line = input_verdict(0.3, 15.2, 0.9, workers=16, cores=16, split=(0.08, 0.22, 0.22))
    assert line.startswith("input: the loop waited for data 30% of the timed steps (taking batches from the workers "
                           "8%, moving them to the device 22%); its 16"), line



def test_the_input_line_says_when_the_cards_queued_work_covered_the_wait():
    """The card idle between steps (CardGaps) far less than the loop waited: the wait cost nothing, and the
    remedies for a slow input (more workers, cores) would not help; a card that did idle keeps the usual verdict."""
    from job.train import input_verdict

    covered = (": the card's queued work covered the wait, so the card (the model), not the input, set the pace; "
               "more workers or cores would not train faster")
    line = input_verdict(0.12, 8.5, 1.4, workers=16, cores=16, split=(0.01, 0.11, 0.6), prefetch=True, card_idle=0.004)
    assert line == ("input: the loop waited for data 12% of the timed steps (taking batches from the workers 1%, "
                    "moving them to the device 11%; the prefetch thread busy 60%), and the card had nothing to run "
                    "between steps 0% of them; its 16 workers kept 8.5 cores busy and the training process 1.4, of 16"
                    + covered), line
    line = input_verdict(0.12, 8.5, 1.4, workers=16, cores=16, gpu_share=0.55, card_idle=0.01)
    assert line.endswith("; data.decode=auto put 55% of the JPEGs on the GPU, where it trained faster: the card's "
                         "queued work covered the wait, so the card (the model and decoding 55% of the JPEGs), not "
                         "the input, set the pace; more workers or cores would not train faster"), line
    assert input_verdict(0.3, 0.0, 1.0, workers=0, cores=2, card_idle=0.0).endswith(
        "; it reads its own data (data.workers=0)" + covered)
    # The card idled: the wait cost time, the usual verdict (here the host's cores)
    line = input_verdict(0.3, 15.2, 0.9, workers=16, cores=16, card_idle=0.25)
    assert "between steps 25% of them" in line and line.endswith("python -m job.shrink)"), line
    # A wait too small to judge against the card's (an idle share not under half of it) is not called covered
    assert "covered" not in input_verdict(0.03, 15.2, 0.9, workers=16, cores=16, card_idle=0.019)
    # Still choosing: the trials are the news, whatever the card did
    assert "covered" not in input_verdict(0.3, 1.0, 1.2, workers=7, cores=8, gpu_share=1.0, choosing=True,
                                          card_idle=0.0)


class _Items:
    """Sample i: (a 2-vector of i, i)."""

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i):
        return torch.full((2,), float(i)), int(i)


def test_the_stream_counts_what_its_workers_made_against_what_the_loop_took():
    """The training stream with workers says how many samples the workers have collated and how many it handed
    out: the difference is the read-ahead (every batch the DataLoader asked for, done), never more, so a
    window of a run that drew it down shows fewer made than taken (the bench's real-data rows use it)."""
    import time

    sampler = [list(range(k * 6, (k + 1) * 6)) for k in range(40)]
    stream = data._loader("t", _Items(), sampler, workers=2, device=torch.device("cpu"), channels_last=False,
                          prefetch=False, persistent=True)
    assert isinstance(stream, data.Stream)
    for _ in range(3):
        x, y = next(stream)
    assert y.tolist() == list(range(12, 18))
    read_ahead = 2 * data.PREFETCH_FACTOR * 6  # batches asked of the 2 workers and not yet taken, 6 samples each
    deadline = time.monotonic() + 30
    while stream.counts()[0] - stream.counts()[1] < read_ahead and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stream.counts() == (18 + read_ahead, 18)
    time.sleep(0.3)
    assert stream.counts() == (18 + read_ahead, 18)  # the workers stop there: the read-ahead is full
    before = stream.counts()
    for _ in range(4):  # taken from the read-ahead faster than the workers refill it
        next(stream)
    made, taken = stream.counts()
    assert taken - before[1] == 24 and made - before[0] <= 24
    # Held-out loaders (short-lived workers) and loaders without workers are plain iterators.
    val = data._loader("t", _Items(), sampler[:2], workers=2, device=torch.device("cpu"), channels_last=False,
                       prefetch=False, persistent=False)
    none = data._loader("t", _Items(), sampler[:2], workers=0, device=torch.device("cpu"), channels_last=False,
                        prefetch=False, persistent=True)
    assert not isinstance(val, data.Stream) and not isinstance(none, data.Stream)


class _Busy(_Items):
    """_Items, each sample costing 5 ms of CPU."""

    def __getitem__(self, i):
        import time

        start = time.process_time()
        while time.process_time() - start < 0.005:
            pass
        return super().__getitem__(i)


def test_the_stream_says_how_much_cpu_its_workers_used():
    """The stream reads its workers' CPU seconds from /proc: two workers that spend their time making samples
    while the loop takes them add about one to two CPU seconds a second (the bench's and the log line's cores
    figure), and a process's own reading grows with the work it does."""
    import os
    import time

    sampler = [list(range(k * 6, (k + 1) * 6)) for k in range(400)]
    stream = data._loader("t", _Busy(), sampler, workers=2, device=torch.device("cpu"), channels_last=False,
                          prefetch=False, persistent=True)
    assert stream.workers == 2 and len(stream.pids) == 2 and os.getpid() not in stream.pids
    t0, c0 = time.perf_counter(), stream.worker_cpu_s()
    for _ in range(60):  # 360 samples of 5 ms: the workers never rest
        next(stream)
    cores = (stream.worker_cpu_s() - c0) / (time.perf_counter() - t0)
    assert 0.3 < cores < 2.5, cores  # 2 workers sharing 2 cores with the loop (and a parallel test); never over 2
    mine = data.process_cpu_s(os.getpid())
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    assert data.process_cpu_s(os.getpid()) - mine >= 0.2
    assert data.process_cpu_s(2 ** 22 + 12345) is None  # no such process
    assert 1 <= devices.usable_cores() <= (os.cpu_count() or 1)


@pytest.mark.parametrize("busy, own, workers, cores, ranks, says", [
    (15.2, 0.9, 16, 16, 1, "the host's cores are the limit (more cores per card, or smaller files: python -m job.shrink)"),
    # workers and the training process fill the host (the GPU decoder's advice: the test below)
    # data.decode=auto moved JPEGs to the GPU (the last keeps a share: see below)
    (3.7, 1.0, 7, 8, 1, "data.decode=auto put every JPEG on the GPU, where it trained faster: the GPU decoder"),
    (0.5, 1.2, 1, 2, 1, "the host's cores are the limit"),  # one worker, starved by the training process
    (3.5, 0.8, 4, 8, 2, "the host's cores are the limit"),  # two ranks each loading the host like rank 0
    (3.9, 1.0, 4, 16, 1, "every worker is busy and cores are left: raise data.workers"),
    (4.0, 1.0, 16, 16, 1, "the workers are idle part of the time, waiting on the disk or on the training process"),
    (None, None, 4, 16, 1, "how busy its 4 workers were is unknown here (no /proc)"),
    (None, None, 0, 16, 1, "it reads its own data (data.workers=0): set data.workers"),
])
def test_a_run_that_waited_for_data_says_what_held_it_up(busy, own, workers, cores, ranks, says):
    """The run's last line when its loop waited for data: the cores its workers and its own process kept busy,
    and which of the three limits that points to, with the setting to change."""
    from job.train import input_verdict

    share = 1.0 if "every JPEG" in says else None
    line = input_verdict(0.31, busy, own, workers=workers, cores=cores, ranks=ranks, gpu_share=share)
    assert line.startswith("input: the loop waited for data 31% of the timed steps") and says in line, line
    if busy is not None:
        who = "its" if ranks == 1 else "rank 0's"
        assert f"; {who} {workers} worker{'s' if workers != 1 else ''} kept {busy:.1f} cores busy and the training " \
               f"process {own:.1f}, of {cores}{';' if share else ':'}" in line, line
    assert "\n" not in line


@pytest.mark.parametrize("decode, says", [
    (("cpu", 1.0), "; or data.decode=auto, which puts on the GPU the JPEGs the workers fall short of, where that trains faster)"),
    (("gpu", 0.5), "; or data.decode=auto, which measures the GPU's share instead of the data.gpu_share=0.5 set)"),
    (("gpu", 1.0), "python -m job.shrink)"),  # every JPEG on the GPU already: not offered again
    (("auto", 1.0), "python -m job.shrink)"),  # auto kept the workers: it measured the GPU decoder slower
    (None, "python -m job.shrink)"),  # not JPEGs, or no GPU
])
def test_where_the_cores_are_the_limit_the_gpu_decoder_is_offered_only_where_it_was_not_used(decode, says):
    """Where the host's cores are the limit, the advice offers the GPU decoder from the run's data.decode and
    data.gpu_share, never what the run already set (a run at data.decode=gpu data.gpu_share=0.5 was told to
    set exactly that)."""
    from job.train import input_verdict

    line = input_verdict(0.31, 15.2, 0.9, workers=16, cores=16, gpu_share=0.0 if decode == ("auto", 1.0) else None,
                         decode=decode)
    assert ": the host's cores are the limit (more cores per card, or smaller files: python -m job.shrink" in line, line
    assert line.endswith(says), line
    assert "gpu_share=0.5 set" in line or "data.decode=gpu" not in line, line


def test_a_run_whose_auto_decoder_split_the_jpegs_says_both_are_the_limit():
    from job.train import input_verdict

    line = input_verdict(0.2, 7.5, 1.2, workers=7, cores=8, gpu_share=0.5)
    assert line.endswith("; data.decode=auto put half of the JPEGs on the GPU, where it trained faster: the workers "
                         "and the GPU decoder together are the limit (more cores per card, or smaller files: python -m "
                         "job.shrink)"), line
    line = input_verdict(0.1, 2.0, 1.2, workers=7, cores=8, gpu_share=0.7)
    assert "; data.decode=auto put 70% of the JPEGs on the GPU, where it trained faster: the workers and the GPU " \
           "decoder together are the limit" in line, line
    # Still trying shares when the run ended: the trials are in its steps, and what decides for good
    line = input_verdict(0.3, 1.0, 1.2, workers=7, cores=8, gpu_share=1.0, choosing=True)
    assert line.endswith("; data.decode=auto was still choosing where to decode when the run ended (trying every "
                         "JPEG on the GPU), so its trials are in these steps: a longer run chooses (within a few "
                         "hundred steps), and data.decode=cpu or data.decode=gpu decides for good"), line
    assert "where it trained faster" not in line
    # The tuner stayed with the workers: the ordinary verdict, with its remedies
    assert input_verdict(0.2, 7.5, 1.2, workers=7, cores=8, gpu_share=0.0) == input_verdict(0.2, 7.5, 1.2, workers=7,
                                                                                             cores=8)


class _Raises:
    """A dataset whose every item raises `exc` (in a DataLoader worker, for the tests below)."""

    def __init__(self, exc):
        self.exc = exc

    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise self.exc


@pytest.mark.parametrize("exc, line", [
    (ValueError("row 3 is unreadable"), "ValueError: row 3 is unreadable (in DataLoader worker 0, at "),
    (KeyError("no row 3"), "KeyError: 'no row 3' (in DataLoader worker 0, at "),
    (OSError(5, "Input/output error"), "OSError: [Errno 5] Input/output error (in DataLoader worker 0, at "),
])
def test_an_error_in_a_dataloader_worker_is_one_line_with_its_own_message(exc, line):
    """DataLoader re-raises a worker's exception as `Caught ValueError in DataLoader worker process 0.` with the
    traceback as text: the line used to say only that, the worker's message left in the traceback file."""
    from torch.utils.data import DataLoader

    from job.failure import describe

    with pytest.raises(type(exc)) as e:
        next(iter(DataLoader(_Raises(exc), num_workers=1)))
    text, code = describe(e.value)
    assert text.startswith(line) and text.endswith("test_data.py:" + str(_Raises.__getitem__.__code__.co_firstlineno + 1)
                                                    + " in __getitem__)"), text
    assert code == 1
    plain = ValueError("Caught nothing")  # an exception of the training process itself: not a worker's
    assert describe(plain)[0].startswith("ValueError: Caught nothing (at ")


TRUNCATED_READ = r"""
import sys
import numpy as np
from torch.utils.data import DataLoader
from job.datasets import TokenFile
from job.errors import UsageError

path, workers = sys.argv[1], int(sys.argv[2])
np.arange(1 << 16, dtype=np.uint16).tofile(path)
ds = TokenFile(path, seq_len=1023, vocab=1 << 16)
ds[0]  # the first sample opens nothing new: the map's own descriptor answers
open(path, "wb").close()  # rewritten in place: truncated first
try:
    if workers:
        next(iter(DataLoader(ds, batch_size=2, sampler=[60, 61], num_workers=workers)))
    else:
        ds[60]
except UsageError as e:
    print(f"error: {e}")
    sys.exit(2)
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_a_token_file_that_shrinks_while_mapped_is_one_line_not_a_bus_error(tmp_path, workers):
    """A token file rewritten in place while a run maps it: reading a page past its new end killed the process
    with SIGBUS (exit -7, no line, no checkpoint). Now the sample's read says so in one line (from a worker
    too: UsageError keeps the worker's own line), which the trainer turns into a stop with a checkpoint."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", TRUNCATED_READ, str(tmp_path / "t.bin"), str(workers)],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stdout.strip() == (f"error: token file {tmp_path / 't.bin'} shrank from 131,072 to 0 bytes while the "
                                "run read it (rewritten in place?); write new data to another file and point "
                                "data.path at it, or put the old file back"), p.stdout


def test_a_usage_error_from_a_dataloader_worker_keeps_its_own_line():
    from torch.utils.data import DataLoader

    from job.datasets import BadImage
    from job.errors import UsageError

    for exc in (UsageError("data.path x is wrong; fix it"), BadImage("cannot read image a.png (bad); fix or remove")):
        with pytest.raises(type(exc)) as e:
            next(iter(DataLoader(_Raises(exc), num_workers=1)))
        assert str(e.value) == str(exc)


def test_the_threads_scheduler_statistics_count_its_own_time_on_a_core():
    """job.data.thread_sched_s: the calling thread's seconds on a core grow by about what it spun, and a
    thread of its own counts its own."""
    import threading
    import time

    from job.data import thread_sched_s

    if thread_sched_s() is None:
        pytest.skip("no scheduler statistics (/proc/thread-self/schedstat) on this kernel")

    def spin(seconds: float) -> tuple[float, float]:
        a = thread_sched_s()
        end = time.thread_time() + seconds
        while time.thread_time() < end:  # this thread's own CPU time
            pass
        b = thread_sched_s()
        return b[0] - a[0], b[1] - a[1]

    ran, waited = spin(0.2)
    assert 0.15 <= ran <= 0.5 and waited >= 0.0
    other: list = []
    t = threading.Thread(target=lambda: other.append(thread_sched_s()))
    t.start()
    t.join()
    assert other[0][0] < 0.1  # a new thread's own: not this one's 0.2 s


def test_the_clock_gives_the_training_threads_shares_of_the_timed_steps_and_the_line_says_what_to_change():
    from job.train import _Clock, host_verdict

    clock = _Clock()
    clock.thread = [(10.0, 1.0, 0.5), (20.0, 6.0, 3.0)]
    assert clock.host() == (0.5, 0.25)
    clock.thread = [None, (20.0, 6.0, 3.0)]  # no scheduler statistics at the start
    assert clock.host() == (None, None)
    line = host_verdict(0.25, 0.5, workers=16, nice=10, cores=16)
    assert line.startswith("host: the training thread waited for a free core 25% of the timed steps (ready to run, "
                           "not running) and ran 50%, on the 16 cores it may use")
    assert "(this process's other threads, its 16 DataLoader workers at nice 10, other processes); fewer " in line
    assert "data.worker_nice" in line
    alone = host_verdict(0.1, None, workers=0, nice=10, cores=1, ranks=2)
    assert alone.startswith("host: rank 0's training thread waited for a free core 10% of the timed steps (ready "
                            "to run, not running), on the 1 core it may use")
    assert alone.endswith("(this process's other threads, other processes); give the run cores of its own")


def test_the_trainers_close_stops_its_training_streams_workers(tmp_path):
    """Trainer.close stops the training stream's DataLoader workers itself, whatever else still holds the
    stream: left to the stream's release, they outlived the run by 80 s on a card (16 workers, the stream held
    by a cycle). Closing again, and the stream's own release later, do nothing more."""
    from _train_helpers import running, wait_gone

    from job import config, launch
    from job.train import Trainer

    tokens = tmp_path / "t.bin"
    torch.arange(4000, dtype=torch.int16).numpy().tofile(tokens)
    cfg = config.load(["workload=lm", "workload.seq_len=8", "data.kind=tokens", f"data.path={tokens}",
                       "data.workers=2", "train.device=cpu", "train.batch_size=4", f"train.run_dir={tmp_path / 'runs'}"])
    tr = Trainer(cfg, launch.DistEnv(0, 1, 0))
    held = tr.batches  # as a cycle or a traceback would hold it
    next(held)
    assert isinstance(held, data.Stream) and len(held.pids) == 2
    assert all(running(p) for p in held.pids)
    tr.close()
    assert wait_gone(held.pids, 10) == []
    held.close()


BUSY_STOP = """
import functools, json, threading, time
import torch
from torch.utils.data import DataLoader
from job import data

class Items(torch.utils.data.Dataset):
    def __init__(self, sleeps):
        self.sleeps = sleeps
    def __len__(self):
        return 64
    def __getitem__(self, i):
        time.sleep(self.sleeps.get(i, 0))  # a slow read (network storage, a heavy transform)
        return torch.tensor([i])

def start(sleeps):
    loader = DataLoader(Items(sleeps), batch_size=1, num_workers=4, persistent_workers=True, prefetch_factor=2,
                        worker_init_fn=functools.partial(data._worker_start, nice=0))
    it = iter(loader)
    data._WITH_WORKERS.add(it)
    data._defer_worker_deaths()
    assert [int(next(it)[0]) for _ in range(4)] == [0, 1, 2, 3]
    time.sleep(1)  # worker k is now in item 8 + k, or idle with its prefetched ones made
    return it

def stop(sleeps):
    it = start(sleeps)
    workers = list(it._workers)
    t = time.monotonic()
    data._stop_workers(it)
    took = time.monotonic() - t
    data.dead_worker()  # raises a worker death the stream would report
    return took, [w.exitcode for w in workers]

SLOW = {8: 30, 9: 30, 10: 30, 11: 30}
idle_s, idle = stop({})
busy_s, busy = stop(SLOW)
mixed_s, mixed = stop({9: 3, 10: 30, 11: 30})  # worker 0 idle, 1 done 2 s into the stop, 2 and 3 not in time
left = start(SLOW)  # busy workers left to the exit hook

def no_thread(self):  # what Python 3.12 says to a thread started in an exit hook
    raise RuntimeError("can't create new thread at interpreter shutdown")

threading.Thread.start = no_thread
print(json.dumps({"idle_s": idle_s, "idle": idle, "busy_s": busy_s, "busy": busy, "mixed_s": mixed_s,
                  "mixed": mixed, "at": time.time()}), flush=True)
"""


def test_busy_dataloader_workers_stop_within_seconds_and_let_the_process_exit():
    """A trainer's close (or exit) with its DataLoader workers in the middle of slow batches: torch's shutdown
    waited 5 s for each worker in turn, then its SIGTERM only started their 60 s grace: 4 workers in 30 s
    batches took 29 s to stop (this test against that code). Now a worker still busy 5 s after the shutdown
    began is killed, and that is not reported as a worker that died; idle workers, and those whose batch ends
    before then, still exit by themselves (code 0). Busy workers still open when the process exits are
    stopped by the exit hook the same way, starting no thread (Python 3.12 refuses one there: the script
    makes 3.11 refuse it too)."""
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", BUSY_STOP], capture_output=True, text=True, timeout=180,
                       cwd=Path(__file__).resolve().parents[2])
    gone = time.time()
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["idle"] == [0, 0, 0, 0] and out["idle_s"] < 4, out
    assert out["busy"] == [-9, -9, -9, -9] and 4.5 < out["busy_s"] < 15, out
    assert out["mixed"] == [0, 0, -9, -9] and 4.5 < out["mixed_s"] < 15, out  # no kill before the deadline
    assert gone - out["at"] < 12, out  # busy workers left open stop at exit the same way
