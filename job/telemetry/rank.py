"""`TrainingTelemetry`: the metrics of one training process, wired into the trainer (job/train.py)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from job import devices
from job.telemetry.allocator import AllocatorCollector
from job.telemetry.breakdown import BreakdownCollector
from job.telemetry.labels import _label_name
from job.telemetry.nvml import NvmlCollector
from job.telemetry.peers import _Merged, _write_private, peer_dir_for, private_dir
from job.telemetry.plan import PlanCollector
from job.telemetry.server import _hostport, _serve, _stop
from job.telemetry.training import TrainingCollector

log = logging.getLogger("job.telemetry")


class TrainingTelemetry:
    """Metrics of one training process; local rank 0 also serves the node's merged view.

    `nvml`, `allocator` and `cards` are injectable (tests, the benchmark); by default they are
    pynvml, torch's allocator and `devices.visible_cards()`. `memory` (a job.breakdown.Memory) adds each card's
    memory by kind.
    """

    def __init__(self, tcfg, *, run: str, strategy: str, rank: int, local_rank: int, world_size: int,
                 info: dict[str, str], device, nvml=None, allocator=None, cards: list[devices.Card] | None = None,
                 plan: list[tuple[Any, Any]] | None = None, memory=None):
        self.tcfg = tcfg
        self.run, self.strategy = str(run), str(strategy)
        self.rank, self.local_rank, self.world_size = int(rank), int(local_rank), int(world_size)
        self.device = device
        self._nvml, self._allocator, self._cards = nvml, allocator, cards
        self._plan = plan or []
        self._memory = memory  # job.breakdown.Memory: the cards' memory by kind, refreshed by observe_step
        self.host = socket.gethostname()
        self.cards: list[devices.Card] = []
        self.uuid = ""
        base = {"run": self.run, "strategy": self.strategy, "rank": str(self.rank),
                "local_rank": str(self.local_rank), "world_size": str(self.world_size), "host": self.host}
        extra = {_label_name(k): str(v) for k, v in (info or {}).items()}
        self._info = {**extra, **base}
        self.training = TrainingCollector(labels=self._labels(), info=self._info)
        self.registry = None
        self._httpd = None
        self._merged: _Merged | None = None
        self._registration: Path | None = None
        self.url: str | None = None
        self.steps = 0
        self._last_progress = time.monotonic()  # the last completed step, or the start

    def _labels(self) -> dict[str, str]:
        return {"rank": str(self.rank), "local_rank": str(self.local_rank), "uuid": self.uuid,
                "strategy": self.strategy, "run": self.run}

    def start(self) -> TrainingTelemetry:
        """Build the collectors; serve when telemetry.port > 0 (OSError if the port is taken)."""
        from prometheus_client import CollectorRegistry, generate_latest

        on_cuda = self.device is not None and self.device.type == "cuda"
        if self._cards is not None:
            self.cards = list(self._cards)
        elif on_cuda:
            self.cards = devices.visible_cards(nvml=self._nvml)
        own = next((c for c in self.cards if on_cuda and c.torch_index == (self.device.index or 0)), None)
        self.uuid = own.uuid if own else ""
        self.training.labels = self._labels()
        # Only this job's cards (the standalone exporter reports the whole node). Local rank 0 reports
        # every card it can see; another rank only its own, which rank 0 may not see when each rank
        # is bound to one card, so the merged view holds each card once without parsing it 8 times.
        uuids = {c.uuid for c in self.cards} if self.local_rank == 0 else {self.uuid} - {""}
        self.registry = CollectorRegistry(auto_describe=False)
        self._last_progress = time.monotonic()
        if on_cuda:  # a CPU run has no card to report (and no NVML to call "down")
            self.registry.register(NvmlCollector(nvml=self._nvml, uuids=uuids, host=self.host))
        lab = {k: v for k, v in self._labels().items() if k != "uuid"}
        self.registry.register(AllocatorCollector(labels=lab, device=self.device if on_cuda else None,
                                                  cards=self.cards, source=self._allocator))
        self.registry.register(self.training)
        if self._plan:
            self.registry.register(PlanCollector(labels=lab, plan=self._plan, cards=self.cards))
        if self._memory is not None:
            self._memory.refresh()  # the first scrape's rows, measured here in the thread that trains
            self.registry.register(BreakdownCollector(labels=lab, memory=self._memory))
        if self.tcfg.port <= 0:
            return self
        peer_dir = private_dir(peer_dir_for(self.tcfg, self.run))
        if self.local_rank == 0:
            self._merged = _Merged(self.registry, peer_dir, self.run)
            merged = self._merged
            self._httpd, _ = _serve(self.tcfg.host, self.tcfg.port, lambda: generate_latest(merged), self._health)
            host = self.tcfg.host if self.tcfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
            self.url = f"http://{_hostport(host, self._httpd.server_address[1])}/metrics"
            bound = _hostport(self.tcfg.host, self._httpd.server_address[1])
            where = (f"{bound} (every interface; from this host {self.url})"
                     if self.tcfg.host in ("0.0.0.0", "::") else self.url)
            log.info("telemetry: serving %s (and /health) for the ranks of this node", where)
        else:  # loopback only: local rank 0 fetches it, nobody else needs to
            registry = self.registry
            self._httpd, _ = _serve("127.0.0.1", 0, lambda: generate_latest(registry), self._health)
            self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/metrics"
            reg = peer_dir / f"local_rank-{self.local_rank}.json"
            _write_private(reg, json.dumps({"url": self.url, "pid": os.getpid(), "run": self.run,
                                            "local_rank": self.local_rank, "rank": self.rank}))
            self._registration = reg
        return self

    def _health(self) -> dict:
        """ok, or "stalled" (HTTP 503) once no step has completed for telemetry.stall_s seconds."""
        idle = time.monotonic() - self._last_progress
        stall_s = getattr(self.tcfg, "stall_s", 0)
        stalled = stall_s > 0 and idle > stall_s
        h = {"status": "stalled" if stalled else "ok", "run": self.run, "rank": self.rank,
             "local_rank": self.local_rank, "steps": self.steps, "seconds_since_step": round(idle, 1),
             "stall_s": stall_s}
        if self._merged is not None:
            h["peers"] = len(self._merged.peers())
        return h

    def observe_step(self, seconds: float, samples: int, loss: float, card: tuple[float, int] | None = None) -> None:
        """Record one optimizer step: its wall time, the samples this rank trained on, the current loss, and on a
        GPU the card's idle seconds between steps and the steps measured so far (job.cardgaps)."""
        self.steps += 1
        self._last_progress = time.monotonic()
        self.training.observe(seconds, samples, loss, card)
        if self._memory is not None:  # the breakdown, if a scrape asked since the last step (Memory.live)
            self._memory.refresh()

    def observe_validation(self, val: dict) -> None:
        """The last evaluation of the held-out data (job.evaluate)."""
        self.training.observe_validation(val)

    def close(self) -> None:
        if self._registration is not None:
            self._registration.unlink(missing_ok=True)
            self._registration = None
        if self._httpd is not None:
            _stop(self._httpd)
            self._httpd = None
        if self._merged is not None:
            self._merged.close()
            try:  # this job's folder, once no rank is registered any more
                self._merged.peer_dir.rmdir()
            except OSError:
                pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
