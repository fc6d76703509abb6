"""`TrainingCollector`: step-time histogram, samples counter, loss, the card's idle time between steps and
`trainjob_info` of one rank, fed by `observe()` (a few additions under a lock: the loop never waits on a
scrape)."""

from __future__ import annotations

import threading

from job.telemetry.labels import RANK_LABELS

# Step times from a few ms (tiny on CPU) to a minute (a large LM step with accumulation).
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TrainingCollector:
    """Step-time histogram, samples counter, last loss and the info metric of one rank."""

    def __init__(self, *, labels: dict[str, str], info: dict[str, str]):
        self.labels = labels  # rank, local_rank, uuid, strategy, run
        self.info = info
        self._lock = threading.Lock()
        self._buckets = [0] * (len(STEP_BUCKETS) + 1)
        self._sum = 0.0
        self._samples = 0
        self._loss: float | None = None
        self._val: dict | None = None  # the last evaluation (job.evaluate)
        self._card: tuple[float, int] | None = None  # the card's idle seconds between steps, steps measured

    def observe(self, seconds: float, samples: int, loss: float | None,
                card: tuple[float, int] | None = None) -> None:
        """One step: its wall time, the samples trained, the loss, and on a GPU `card`: the card's idle seconds
        between steps and the steps they were measured on so far (job.cardgaps)."""
        i = 0
        while i < len(STEP_BUCKETS) and seconds > STEP_BUCKETS[i]:
            i += 1
        with self._lock:
            self._buckets[i] += 1
            self._sum += seconds
            self._samples += samples
            if loss is not None:
                self._loss = float(loss)
            if card is not None:
                self._card = card

    def observe_validation(self, val: dict) -> None:
        """The last evaluation of the held-out data: val_loss, val_accuracy (or None), val_samples."""
        with self._lock:
            self._val = dict(val)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self._lock:
            counts, total, samples, loss, val = list(self._buckets), self._sum, self._samples, self._loss, self._val
            card = self._card
        row = [self.labels[k] for k in RANK_LABELS]
        cumulative, running = [], 0
        for bound, n in zip((*STEP_BUCKETS, float("inf")), counts, strict=True):
            running += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), running))
        hist = HistogramMetricFamily("trainjob_step_seconds", "Wall time of one optimizer step on this rank.",
                                     labels=RANK_LABELS)
        hist.add_metric(row, cumulative, total)
        yield hist
        ctr = CounterMetricFamily("trainjob_samples", "Samples this rank has trained on.", labels=RANK_LABELS)
        ctr.add_metric(row, float(samples))
        yield ctr
        if card is not None:
            idle = CounterMetricFamily("trainjob_card_idle_seconds", "Seconds this rank's card had nothing to run "
                                       "between steps, over the steps measured (job.cardgaps).", labels=RANK_LABELS)
            idle.add_metric(row, card[0])
            yield idle
            steps = CounterMetricFamily("trainjob_card_idle_steps", "Steps whose idle time between them and the "
                                        "next is in trainjob_card_idle_seconds (log steps are left out).",
                                        labels=RANK_LABELS)
            steps.add_metric(row, float(card[1]))
            yield steps
        if loss is not None:
            g = GaugeMetricFamily("trainjob_loss", "Training loss at the last logged step.", labels=RANK_LABELS)
            g.add_metric(row, loss)
            yield g
        if val is not None:
            g = GaugeMetricFamily("trainjob_val_loss", "Mean loss over the held-out samples at the last evaluation "
                                  "(the same value on every rank).", labels=RANK_LABELS)
            g.add_metric(row, val["val_loss"])
            yield g
            if val.get("val_accuracy") is not None:
                g = GaugeMetricFamily("trainjob_val_accuracy", "Accuracy (ratio) over the held-out data at the last "
                                      "evaluation, as the workload defines it.", labels=RANK_LABELS)
                g.add_metric(row, val["val_accuracy"])
                yield g
            g = GaugeMetricFamily("trainjob_val_step", "Optimizer step of the last evaluation.", labels=RANK_LABELS)
            g.add_metric(row, float(val["step"]))
            yield g
        info = GaugeMetricFamily("trainjob_info", "The run's configuration summary (value always 1).",
                                 labels=list(self.info))
        info.add_metric(list(self.info.values()), 1.0)
        yield info
