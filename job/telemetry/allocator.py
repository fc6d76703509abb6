"""`AllocatorCollector`: per rank from torch's caching allocator (allocated, reserved, peak allocated), labels
rank, local_rank, uuid, strategy, run; one series per card this process holds memory on (DataParallel's one
process holds several). `TorchAllocator` is the source: it reads the counters without starting CUDA."""

from __future__ import annotations

import logging

from job import devices
from job.telemetry.labels import RANK_LABELS

log = logging.getLogger("job.telemetry")


class TorchAllocator:
    """torch.cuda's caching-allocator counters for one device index; 0 before CUDA starts.

    Reading them never initialises CUDA (torch returns empty stats until it is initialised).
    """

    def _stats(self, index: int) -> dict:
        import torch

        if not torch.cuda.is_initialized():
            return {}
        return torch.cuda.memory_stats(index)

    def read(self, index: int) -> tuple[int, int, int]:
        """(allocated, reserved, peak allocated) bytes."""
        from job.strategies.graphs import held_bytes  # memory in CUDA graphs' pools, unseen by the counters

        s = self._stats(index)
        held = held_bytes(index)
        return (int(s.get("allocated_bytes.all.current", 0)) + held, int(s.get("reserved_bytes.all.current", 0)),
                int(s.get("allocated_bytes.all.peak", 0)) + held)


class AllocatorCollector:
    """Per-rank allocator gauges: this rank's device, plus any other card this process reserved memory on."""

    def __init__(self, *, labels: dict[str, str], device, cards: list[devices.Card], source=None):
        self.labels = labels  # rank, local_rank, strategy, run
        self.device = device
        self.uuid_of = {c.torch_index: c.uuid for c in cards}
        self.source = source or TorchAllocator()

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        if self.device is None or self.device.type != "cuda":
            return
        fams = [GaugeMetricFamily("trainjob_torch_memory_allocated_bytes",
                                  "Bytes in live tensors of this rank on the card (torch allocator).", labels=RANK_LABELS),
                GaugeMetricFamily("trainjob_torch_memory_reserved_bytes",
                                  "Bytes held by this rank's caching allocator on the card.", labels=RANK_LABELS),
                GaugeMetricFamily("trainjob_torch_memory_peak_allocated_bytes",
                                  "Peak of allocated bytes since start or the last peak reset.", labels=RANK_LABELS)]
        own = self.device.index or 0
        for index in sorted(self.uuid_of) or [own]:
            try:
                values = self.source.read(index)
            except Exception as e:
                log.debug("allocator stats for device %d failed: %s", index, e)
                continue
            if index != own and values[1] == 0:
                continue  # another rank's card: this process holds nothing there
            lab = self.labels
            row = [lab["rank"], lab["local_rank"], self.uuid_of.get(index, ""), lab["strategy"], lab["run"]]
            for fam, v in zip(fams, values, strict=True):
                fam.add_metric(row, float(v))
        yield from fams
