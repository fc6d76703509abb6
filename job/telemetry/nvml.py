"""`NvmlCollector`: per card from NVML, read at scrape time (used/total/free bytes, utilisation), labels uuid,
pci_bus_id, gpu (NVML index), name, host; plus `trainjob_nvml_up` (0 when NVML is missing or failing: the
scrape still succeeds, a card that fails a query loses just that series)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from typing import Any

from job import devices
from job.telemetry.labels import CARD_LABELS

log = logging.getLogger("job.telemetry")


class NvmlCollector:
    """Per-card NVML gauges, read at scrape time; `uuids` limits the cards (None: every card)."""

    def __init__(self, *, nvml=None, uuids: Iterable[str] | None = None, host: str | None = None):
        self._nvml = nvml
        self.uuids = None if uuids is None else set(uuids)
        self.host = host or socket.gethostname()
        self._cards: dict[int, tuple[Any, str, str, str, tuple[str, ...]]] = {}
        self._warned: set[tuple[str, str]] = set()

    def _warn_once(self, what: str, where: str, e: Exception) -> None:
        if (what, where) not in self._warned:
            self._warned.add((what, where))
            log.warning("NVML %s failed for %s (%s); its series are dropped while it fails", what, where, e)

    def _identity(self, nv, i: int):
        card = self._cards.get(i)
        if card is None:
            h = nv.nvmlDeviceGetHandleByIndex(i)
            card = (h, devices.nvml_text(nv.nvmlDeviceGetUUID(h)), devices.nvml_text(nv.nvmlDeviceGetPciInfo(h).busId),
                    devices.nvml_text(nv.nvmlDeviceGetName(h)), devices.mig_uuids(nv, h))
            self._cards[i] = card
        return card

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        used = GaugeMetricFamily("trainjob_gpu_memory_used_bytes", "Card memory in use by all processes (NVML).",
                                 labels=CARD_LABELS)
        total = GaugeMetricFamily("trainjob_gpu_memory_total_bytes", "Card memory in total (NVML).",
                                  labels=CARD_LABELS)
        free = GaugeMetricFamily("trainjob_gpu_memory_free_bytes", "Card memory free (NVML).", labels=CARD_LABELS)
        util = GaugeMetricFamily("trainjob_gpu_utilization_ratio",
                                 "Fraction of the last sample period the card was busy (NVML, 0-1).",
                                 labels=CARD_LABELS)
        up = GaugeMetricFamily("trainjob_nvml_up", "1 when NVML answered this scrape, 0 when missing or failing.")
        nv = devices.nvml_or_default(self._nvml)
        ok = 0
        if nv is not None:
            try:
                count = nv.nvmlDeviceGetCount()
                ok = 1
            except Exception as e:
                self._warn_once("device count", "this node", e)
                count = 0
            for i in range(count):
                try:
                    h, uuid, pci, name, migs = self._identity(nv, i)
                except Exception as e:
                    self._warn_once("identity", f"card {i}", e)
                    continue
                targets = [(h, uuid, name, True)]
                for m in migs:  # a MIG instance is a card of its own to CUDA; NVML has no utilisation for it
                    if self.uuids is not None and m not in self.uuids:
                        continue
                    try:
                        mh = nv.nvmlDeviceGetHandleByUUID(m)
                        targets.append((mh, m, devices.nvml_text(nv.nvmlDeviceGetName(mh)), False))
                    except Exception as e:
                        self._warn_once("MIG handle", m, e)
                for handle, u, card_name, has_util in targets:
                    if self.uuids is not None and u not in self.uuids:
                        continue
                    labels = [u, pci, str(i), card_name, self.host]
                    try:
                        mem = nv.nvmlDeviceGetMemoryInfo(handle)
                        used.add_metric(labels, float(mem.used))
                        total.add_metric(labels, float(mem.total))
                        free.add_metric(labels, float(mem.free))
                    except Exception as e:
                        self._warn_once("memory info", u, e)
                    if has_util:
                        try:
                            util.add_metric(labels, nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
                        except Exception as e:
                            self._warn_once("utilisation", u, e)
        up.add_metric([], ok)
        yield up
        for fam in (used, total, free, util):
            if fam.samples:
                yield fam
