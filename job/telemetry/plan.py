"""`PlanCollector`: the memory plan per card (planned samples, predicted peak, headroom), labels as the
allocator's series."""

from __future__ import annotations

from typing import Any

from job import devices
from job.breakdown import cap_headroom, cap_of
from job.telemetry.labels import RANK_LABELS


class PlanCollector:
    """The memory plan per card this process drives: its planned samples of each micro-batch, the predicted
    peak, and the headroom: memory the card had for the job when it planned minus the job's peak reserved."""

    def __init__(self, *, labels: dict[str, str], plan: list[tuple[Any, Any]], cards: list[devices.Card]):
        self.labels = labels  # rank, local_rank, strategy, run
        self.plan = plan      # (torch device, job.memplan.CardPlan)
        self.uuid_of = {c.torch_index: c.uuid for c in cards}

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        samples = GaugeMetricFamily("trainjob_plan_samples", "Samples of each micro-batch the memory plan gives "
                                    "this card (balanced) or rank (ddp).", labels=RANK_LABELS)
        predicted = GaugeMetricFamily("trainjob_plan_predicted_peak_bytes", "The memory plan's predicted peak "
                                      "allocated bytes of this job on the card.", labels=RANK_LABELS)
        headroom = GaugeMetricFamily("trainjob_plan_headroom_bytes", "Card memory still free at this job's peak: "
                                     "free + held when it planned, minus its peak reserved (within memory.cap_gb "
                                     "when set).", labels=RANK_LABELS)
        lab = self.labels
        for device, card in self.plan:
            index = device.index if device.type == "cuda" else None
            # A CPU "card" has no UUID: it is named `cpu` (Prometheus drops empty labels, and the panels' legends
            # name the card).
            uuid = self.uuid_of.get(index, card.uuid) or device.type
            row = [lab["rank"], lab["local_rank"], uuid, lab["strategy"], lab["run"]]
            samples.add_metric(row, float(card.samples))
            if card.predicted_peak is not None:
                predicted.add_metric(row, float(card.predicted_peak))
            if card.total and index is not None:
                import torch

                if torch.cuda.is_initialized():
                    peak = torch.cuda.max_memory_reserved(index)
                    room = cap_headroom(cap=cap_of(index), peak_reserved=peak,
                                        card_headroom=card.free + card.held - peak)
                    headroom.add_metric(row, float(room))
        for fam in (samples, predicted, headroom):
            if fam.samples:
                yield fam
