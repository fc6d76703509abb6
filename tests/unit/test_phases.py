"""job.phases: a mark is a shared no-op until a listener listens, and a listener is handed back on the way out."""

from __future__ import annotations

import contextlib

import pytest

from job import phases


class Recorder:
    def __init__(self):
        self.seen: list[str] = []

    @contextlib.contextmanager
    def phase(self, name):
        self.seen.append(name)
        yield


def test_marks_do_nothing_without_a_listener():
    assert phases.mark("data") is phases.mark("backward")  # the one shared nullcontext: nothing allocated
    with phases.mark("data"):
        pass


def test_a_listener_sees_the_marks_inside_its_block_only():
    outer, inner = Recorder(), Recorder()
    with phases.listening(outer):
        with phases.mark("data"):
            pass
        with pytest.raises(ValueError), phases.listening(inner):
            with phases.mark("forward"):
                raise ValueError
        with phases.mark("optimizer"):
            pass
    with phases.mark("loss"):
        pass
    assert (outer.seen, inner.seen) == (["data", "optimizer"], ["forward"])
