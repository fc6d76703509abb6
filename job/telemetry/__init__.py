"""Per-card and per-rank metrics for Prometheus, read at scrape time.

Five collectors, each over one injected source (read at scrape time), none with a polling thread, one file
each:
- `NvmlCollector` (nvml.py): per card from NVML (used/total/free bytes, utilisation), labels uuid,
  pci_bus_id, gpu (NVML index), name, host; plus `trainjob_nvml_up` (0 when NVML is missing or failing:
  the scrape still succeeds, a card that fails a query loses just that series).
- `AllocatorCollector` (allocator.py): per rank from torch's caching allocator (allocated, reserved, peak
  allocated), labels rank, local_rank, uuid, strategy, run; one series per card this process holds
  memory on (DataParallel's one process holds several).
- `TrainingCollector` (training.py): step-time histogram, samples counter, loss, and `trainjob_info`, fed
  by `observe_step()` (a few additions under a lock: the loop never waits on a scrape).
- `PlanCollector` (plan.py): the memory plan per card (planned samples, predicted peak, headroom).
- `BreakdownCollector` (breakdown.py): each card's memory by kind (`trainjob_memory_breakdown_bytes{kind}`,
  job/breakdown.py), the other processes on it by pid, and the memory.cap_gb cap.

`TrainingTelemetry` (rank.py) wires them into a trainer. With several ranks on a node, local rank 0
serves the public port and, at each scrape, fetches the other local ranks' own loopback endpoints (found
through small registration files, peers.py) and merges them, so one scrape shows every rank;
docs/telemetry.md says why this design and not prometheus_client's multiprocess mode. The HTTP server
(server.py) is http.server's around prometheus_client's exposition; its docstring says why.

`python -m job export --port 9400` (`export_main`, export.py) serves the NVML collector alone: the
node-exporter role in compose and Kubernetes. `python -m job.telemetry --bench-scrape` (scrapebench.py)
measures a scrape. prometheus_client and pynvml are imported lazily; nothing here touches CUDA or NVML at
import time.
"""

from __future__ import annotations

from job.telemetry.allocator import AllocatorCollector, TorchAllocator
from job.telemetry.breakdown import BreakdownCollector
from job.telemetry.export import export_main
from job.telemetry.labels import CARD_LABELS, RANK_LABELS
from job.telemetry.nvml import NvmlCollector
from job.telemetry.peers import peer_dir_for, private_dir
from job.telemetry.plan import PlanCollector
from job.telemetry.rank import TrainingTelemetry
from job.telemetry.scrapebench import bench_overhead, bench_scrape
from job.telemetry.training import STEP_BUCKETS, TrainingCollector

__all__ = ["CARD_LABELS", "RANK_LABELS", "STEP_BUCKETS", "AllocatorCollector", "BreakdownCollector", "NvmlCollector",
           "PlanCollector",
           "TorchAllocator", "TrainingCollector", "TrainingTelemetry", "bench_overhead", "bench_scrape",
           "export_main", "peer_dir_for", "private_dir"]
