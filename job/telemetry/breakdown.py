"""`BreakdownCollector`: each card's memory by kind (job.breakdown), as of the last step, labels as the
allocator's series plus `kind`; the other processes on the card with their pid and name; the cap.

- `trainjob_memory_breakdown_bytes{kind=...}`: one series per card this process drives and kind (parameters,
  gradients, optimizer_state, activations, allocator_cache, cuda_context, other_processes, unattributed, free).
  The kinds add up to the card's `trainjob_gpu_memory_total_bytes` (join on `uuid`); a kind a source cannot
  give (NVML down) is left out, not reported as 0. A CPU run reports its three tensor kinds as `uuid="cpu"`.
- `trainjob_memory_other_process_bytes{pid, process}`: every other process NVML lists on the card.
- `trainjob_memory_cap_bytes`: what `memory.cap_gb` lets this process use on the card, when set.

The source is a `job.breakdown.Memory` (its `live()`): the strategy's tensors, torch's allocator and NVML,
measured by the thread that trains at the first step end after a scrape asked (`observe_step` calls
`Memory.refresh`), never in the scrape's thread, where reading tensors while backward assigns gradients
crashed the process. A scrape serves the last rows measured; a source that fails drops this collector's
series for that scrape, not the scrape.
"""

from __future__ import annotations

import logging

from job.breakdown import KINDS
from job.telemetry.labels import RANK_LABELS

log = logging.getLogger("job.telemetry")


class BreakdownCollector:
    def __init__(self, *, labels: dict[str, str], memory):
        self.labels = labels  # rank, local_rank, strategy, run
        self.memory = memory

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        kinds = GaugeMetricFamily("trainjob_memory_breakdown_bytes", "Memory of the card by kind (job.breakdown): "
                                  "the kinds add up to the card's total.", labels=(*RANK_LABELS, "kind"))
        others = GaugeMetricFamily("trainjob_memory_other_process_bytes", "Memory another process holds on the card "
                                   "(NVML's process list, less this job's processes).",
                                   labels=(*RANK_LABELS, "pid", "process"))
        cap = GaugeMetricFamily("trainjob_memory_cap_bytes", "What memory.cap_gb lets this process use on the card.",
                                labels=RANK_LABELS)
        try:
            rows = self.memory.live()
        except Exception as e:  # e.g. the optimizer's state dict growing during the first step
            log.debug("memory breakdown failed at this scrape: %s", e)
            return
        lab = self.labels
        for r in rows:
            row = [lab["rank"], lab["local_rank"], r["uuid"] or r["device"], lab["strategy"], lab["run"]]
            for kind in KINDS:
                if r["kinds"][kind] is not None:
                    kinds.add_metric([*row, kind], float(r["kinds"][kind]))
            for p in r["other_processes"]:
                if p["bytes"] is not None:
                    others.add_metric([*row, str(p["pid"]), p["name"] or ""], float(p["bytes"]))
            if r["cap_bytes"] is not None:
                cap.add_metric(row, float(r["cap_bytes"]))
        for fam in (kinds, others, cap):
            if fam.samples:
                yield fam
