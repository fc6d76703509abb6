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
