"""job.cardgaps: the card's idle time between steps, from pairs of events on the training stream. No card here:
fake events stand in for CUDA's (each records the fake card's time when it passes, and is read only once the
card has passed it, as Event.query says); tests/gpu/test_gpu.py measures a real card's."""

from __future__ import annotations

import pytest
import torch

from job.cardgaps import CardGaps, Reading, idle_share


class Card:
    """A card with one stream: `run(ms)` queues that much work; `at(ms)` is the card's clock reaching `ms`."""

    def __init__(self):
        self.now = 0.0  # the card's clock, ms
        self.queue_end = 0.0  # when the work queued so far is done
        self.made = 0

    def run(self, ms: float) -> None:
        self.queue_end = max(self.queue_end, self.now) + ms

    def at(self, ms: float) -> None:
        self.now = ms

    def event(self):
        card = self
        card.made += 1

        class Event:
            def record(self, stream):
                assert stream == "stream"
                self.passes = max(card.queue_end, card.now)  # an event passes once the work before it is done

            def query(self):
                return card.now >= self.passes

            def elapsed_time(self, other):
                assert self.query() and other.query(), "elapsed_time of an event the card has not passed"
                return other.passes - self.passes

        return Event()


def gaps_on(card: Card) -> CardGaps:
    g = CardGaps(torch.device("cpu"), event=card.event, stream=lambda: "stream")
    g.on = True  # as on a GPU; the capture check stays CPU's (never capturing)
    return g


def test_a_step_whose_input_came_late_leaves_the_card_idle_for_the_difference():
    card = Card()
    g = gaps_on(card)
    card.run(30)  # step 1's kernels: the card busy until 30 ms
    g.ended()
    card.at(38)  # the host had the next batch only at 38 ms (the card done at 30): 8 ms with nothing to run
    g.started()
    card.run(30)  # step 2, 38-68
    g.ended()
    card.at(50)  # the next batch at 50 ms, while step 2 still runs: no gap
    g.started()
    assert g.read() == (pytest.approx(0.008), 1, 2)  # step 2's pair not read yet: the card has not passed it
    card.at(70)
    assert g.read() == (pytest.approx(0.008), 2, 2)  # (68 - 68: the next step's start waited for nothing)
    assert g.steps == 2


def test_a_sync_or_pause_between_the_marks_voids_the_pair():
    """A log step's sync drains the card: the idle time after it is the loop's doing, not the input's."""
    card = Card()
    g = gaps_on(card)
    card.run(30)
    g.ended()
    g.void()  # the loop synced: card and host meet at 30 ms
    card.at(45)
    g.started()  # nothing to pair with
    card.at(100)
    assert g.read() == (0.0, 0, 1)
    card.run(30)  # 100-130
    g.ended()
    g.ended()  # a second end without a start (a step that fetched nothing ahead: the last) replaces the first
    card.at(131)
    g.started()
    assert g.read() == (pytest.approx(0.001), 1, 3)


def test_events_are_reused_once_read():
    card = Card()
    g = gaps_on(card)
    for _ in range(50):
        card.run(10)
        g.ended()
        card.at(card.queue_end + 1)
        g.started()
    assert g.read() == (pytest.approx(0.050), 50, 50)
    assert card.made <= 4  # two events a step, read at the next step: a handful, not one per mark


def test_nothing_is_recorded_on_a_cpu_or_while_a_cuda_graph_is_captured():
    made = []
    g = CardGaps(torch.device("cpu"), event=lambda: made.append(1), stream=lambda: "stream")
    g.ended()
    g.started()
    assert g.read() == (0.0, 0, 0) and made == [] and not g.on
    card = Card()
    g = gaps_on(card)
    g._capturing = lambda: True  # recording an event into a graph being captured would put it in the graph
    g.ended()
    g.started()
    assert card.made == 0 and g.read() == (0.0, 0, 0)


def test_the_window_share_is_the_mean_gap_over_every_step_of_the_window():
    # 18 of 20 steps measured (two log steps voided), 0.36 s idle among them: 20 ms a step, 20 steps, over 4 s
    a, b = Reading(1.0, 10, 12), Reading(1.36, 28, 32)
    assert idle_share(a, b, steps=20, seconds=4.0) == pytest.approx(0.1)
    assert idle_share(a, b, seconds=4.0) == pytest.approx(0.1)  # the window's steps: those marked between a and b
    assert idle_share(a, a, steps=20, seconds=4.0) is None  # no step measured (train.log_every=1)
    assert idle_share(None, b, steps=20, seconds=4.0) is None
    assert idle_share(Reading(0.0, 0, 0), Reading(0.1, 5, 5), seconds=0.0) is None


def test_the_training_loop_pairs_each_step_with_the_next_ones_input_and_voids_the_log_steps(tmp_path, monkeypatch):
    """The trainer's marks, on the CPU with host-clock events standing in for the card's: a step's end pairs
    with the next step's batch, except across a log step (its sync) or a pause (the memory plan's check, the
    clock's start); the summary and each log record carry the figures."""
    import json
    import time

    from job import config, train

    class HostEvent:
        def record(self, stream):
            self.t = time.perf_counter()

        def query(self):
            return True

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    paired, made = [], []

    class Gaps(CardGaps):
        def __init__(self, device):
            super().__init__(device, event=HostEvent, stream=lambda: None)
            self.on, self.step = True, 0
            made.append(self)

        def ended(self):
            self.step += 1  # called once a step
            super().ended()

        def started(self):
            if self._end is not None:
                paired.append(self.step)
            super().started()

    monkeypatch.setattr(train, "CardGaps", Gaps)
    cfg = config.load(["workload=tiny", "workload.width=8", "workload.image_size=16", "train.batch_size=8",
                       "strategy=ddp", "train.device=cpu", "train.steps=16", "train.log_every=4",
                       "train.timing_warmup=4", f"train.run_dir={tmp_path}", "train.run_id=r",
                       "train.final_checkpoint=false"])
    assert train.run(cfg) == 0
    assert len(made) == 1 and made[0].step == made[0].steps == 16
    assert not {4, 8, 12, 16} & set(paired) and {5, 6, 7, 9, 10, 11, 13, 14, 15} <= set(paired), paired
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert 0.0 < summary["card_idle_between_steps"] < 1.0
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["card_gaps"] for r in records] == [sum(1 for s in paired if s < r["step"]) for r in records]
