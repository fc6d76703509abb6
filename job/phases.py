"""The named phases of a training step, marked where they happen, for whoever wants to time them.

The trainer's loop marks `data` (taking the next batch), `forward+loss`, `backward` and `optimizer`; the
strategies mark `forward` and `loss` inside `forward+loss`, and `dp` marks DataParallel's `scatter`,
`replicate`, `parallel_apply` and `gather` inside `forward`. Nothing listens by default: a mark is then a
shared no-op context manager (one global read). `bench.mode=profile` (job/bench/profiling.py) listens with
a timer that syncs the devices around each phase and names it in the torch.profiler trace.

    from job import phases
    with phases.mark("forward"):
        out = model(x)
"""

from __future__ import annotations

import contextlib
from typing import Protocol

NAMES = ("data", "forward+loss", "forward", "scatter", "replicate", "parallel_apply", "gather", "loss",
         "backward", "optimizer")


class Listener(Protocol):
    def phase(self, name: str) -> contextlib.AbstractContextManager: ...


_NOTHING = contextlib.nullcontext()
_listener: Listener | None = None


def mark(name: str) -> contextlib.AbstractContextManager:
    """A context manager around phase `name` of the current step (one of NAMES)."""
    return _NOTHING if _listener is None else _listener.phase(name)


@contextlib.contextmanager
def listening(listener: Listener):
    """Hand every mark in this process to `listener` inside the block."""
    global _listener
    previous, _listener = _listener, listener
    try:
        yield listener
    finally:
        _listener = previous
