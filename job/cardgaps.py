"""How long the card had nothing to run between training steps: what the loop's wait for data really cost.

The loop's own wait for a batch (the `waited for data` share) is host time. On a GPU the host runs ahead of
the card, so a wait that the card's queued work covers costs nothing: the card, not the input, sets the pace.
The card idles only once its queue runs dry. `CardGaps` measures that directly: a CUDA event on the training
stream after each step's kernels are queued (`ended`), another once the next step's first batch is there
(`started`: after data.prefetch's stream wait on its copy, or after the copy itself without it). The time
between the two events on the card is the time that stream had nothing of the model's to run: from the last
step's last kernel to the next step's input. Within a step (a host too slow to launch the model's kernels,
later micro-batches of train.accum_steps) is not counted.

A device sync or a pause of the clock between the two marks (a log step's loss, a checkpoint, the memory
plan's check) voids the pair: the card idles there because the loop stopped it, not for lack of input.
Pairs are read once the card has passed them (`Event.query`), so the loop never waits for one. Each step costs
two event records and a query or two on the host (their cost on a card is not yet measured: the bench's
trainer-against-loop rows include it); nothing runs on a CPU.
"""

from __future__ import annotations

import collections
from typing import NamedTuple


class Reading(NamedTuple):
    """The card's idle time between steps so far."""

    seconds: float  # idle seconds over the pairs read
    gaps: int  # steps measured (pairs read)
    steps: int  # steps marked, measured or not


class CardGaps:
    """Idle seconds of the training stream between steps, summed over the steps measured (`read`).

    `event` makes a timing CUDA event (a test passes a fake); `stream` gives the stream to record on."""

    def __init__(self, device, *, event=None, stream=None):
        import torch

        self.on = device.type == "cuda"
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._stream = stream or (lambda: torch.cuda.current_stream(device))
        self._capturing = torch.cuda.is_current_stream_capturing if self.on else (lambda: False)
        self._free: list = []  # events read, to record again
        self._end = None  # the last step's `ended` event, until the next step starts or a sync voids it
        self._pending: collections.deque = collections.deque()  # (ended, started) pairs not yet read
        self.seconds = 0.0  # idle seconds over the pairs read
        self.gaps = 0  # pairs read
        self.steps = 0  # steps marked (`ended`), measured or not

    def _mark(self):
        e = self._free.pop() if self._free else self._event()
        e.record(self._stream())
        return e

    def ended(self) -> None:
        """A step's kernels are queued."""
        if not self.on or self._capturing():
            return
        self.steps += 1
        self.void()
        self._end = self._mark()

    def void(self) -> None:
        """The loop synced the device or paused: the card's idle time until the next step is the loop's doing."""
        if self._end is not None:
            self._free.append(self._end)
            self._end = None

    def started(self) -> None:
        """The next step's first batch is on the training stream."""
        if self._end is None:
            return
        self._pending.append((self._end, self._mark()))
        self._end = None
        self._collect()

    def _collect(self) -> None:
        while self._pending and self._pending[0][1].query():
            a, b = self._pending.popleft()
            self.seconds += a.elapsed_time(b) / 1e3  # milliseconds
            self.gaps += 1
            self._free += (a, b)

    def read(self) -> Reading:
        """The pairs the card has passed so far (after a device sync, all): the log lines, the clock, auto's windows."""
        self._collect()
        return self.so_far()

    def so_far(self) -> Reading:
        """As `read`, without asking the card for the pairs it has passed since: each step's telemetry."""
        return Reading(self.seconds, self.gaps, self.steps)


def idle_share(a: Reading | None, b: Reading | None, *, steps: int | None = None, seconds: float) -> float | None:
    """The share of a window of `seconds` wall-clock seconds the card idled between steps, from `read()` at its
    start (`a`) and end (`b`): the mean gap of the steps measured, times the window's steps (`steps`, or the
    steps marked between `a` and `b`), over `seconds` (log steps, whose gaps a sync voids, count as the others).
    None where no step was measured."""
    if a is None or b is None or seconds <= 0:
        return None
    steps = b.steps - a.steps if steps is None else steps
    idle, gaps = b.seconds - a.seconds, b.gaps - a.gaps
    return idle / gaps * steps / seconds if gaps > 0 else None
