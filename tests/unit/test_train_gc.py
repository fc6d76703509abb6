"""train.gc_every: the training loop's garbage collection (job.train._collecting_every). Start-up's objects are
frozen and automatic collection is off inside the loop, so no full collection of them lands in a timed step;
the loop collects what the steps made every N steps; everything is as before once the loop ends."""

from __future__ import annotations

import gc

from job.train import _collecting_every


class Cycle:
    def __init__(self):
        self.me = self


def test_the_loop_freezes_start_up_turns_automatic_collection_off_and_restores_both():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    start_up = Cycle()
    with _collecting_every(50):
        assert not gc.isenabled() and gc.get_freeze_count() > 1000
        made = Cycle()
        before = len(gc.get_objects())
        del made
        assert gc.collect() >= 1  # the loop's own collection frees what the steps made
        assert len(gc.get_objects()) < before
        assert not any(o is start_up for o in gc.get_objects())  # frozen: no collection walks it
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert any(o is start_up for o in gc.get_objects())


def test_gc_every_0_leaves_python_as_it_is():
    with _collecting_every(0):
        assert gc.isenabled() and gc.get_freeze_count() == 0
    assert gc.isenabled()


def test_an_exception_in_the_loop_still_restores_collection():
    try:
        with _collecting_every(10):
            raise RuntimeError("a step failed")
    except RuntimeError:
        pass
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_settle_freezes_what_warm_up_made_so_the_loops_collections_skip_it():
    """What the first steps make (torch.compile's graphs, autotuning) stays for the whole run: once warm-up
    is over the loop freezes it, and a later collection no longer walks it."""
    with _collecting_every(50) as settle:
        frozen = gc.get_freeze_count()
        compiled = [Cycle() for _ in range(100)]  # warm-up's objects
        garbage = Cycle()
        del garbage
        settle()
        assert gc.get_freeze_count() >= frozen + 100  # kept, and frozen
        assert not any(o is compiled[0] for o in gc.get_objects())
        assert gc.collect() == 0  # nothing left for the loop's own collection to walk and free
    assert any(o is compiled[0] for o in gc.get_objects())
    with _collecting_every(0) as settle:
        settle()
        assert gc.get_freeze_count() == 0


class _Trainer:
    """What job.train._Window reads and calls on a trainer, recorded."""

    def __init__(self, first: int, steps: int):
        from types import SimpleNamespace

        from job.train import _Clock

        self.step, self.cfg, self.clock, self.calls = first, SimpleNamespace(train=SimpleNamespace(steps=steps)), _Clock(), []
        self.batches = iter(())  # a stream without workers: the clock's marks have no CPU times

    def _restart_peaks(self):
        self.calls.append("peaks")

    def _check_plan(self):
        self.calls.append("plan")

    def _sync(self):
        pass


def test_the_window_settles_once_at_the_end_of_warm_up_outside_the_timed_seconds():
    import time

    from job.train import _Window

    for first, warmup, steps, want in ((0, 10, 30, 10), (5, 3, 30, 8), (0, 0, 30, 1), (0, -1, 100, 10),
                                       (0, 10, 10, None)):
        tr, settled = _Trainer(first, steps), []

        def settle(tr=tr, settled=settled):
            settled.append(tr.step)
            time.sleep(0.05)

        window = _Window(tr, warmup=warmup, settle=settle)
        for step in range(first + 1, steps + 1):
            tr.step = step
            window.after_step(step)
        assert settled == ([want] if want else []), (first, warmup, steps)
        if want and warmup == 0:  # no warm-up: the clock runs, and the collection is left out of it
            assert tr.clock.excluded >= 0.05
