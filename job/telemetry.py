"""Per-card and per-rank metrics for Prometheus, read at scrape time.

Four collectors, each over one injected source (read at scrape time), none with a polling thread:
- `NvmlCollector`: per card from NVML (used/total/free bytes, utilisation), labels uuid, pci_bus_id,
  gpu (NVML index), name, host; plus `trainjob_nvml_up` (0 when NVML is missing or failing: the
  scrape still succeeds, a card that fails a query loses just that series).
- `AllocatorCollector`: per rank from torch's caching allocator (allocated, reserved, peak
  allocated), labels rank, local_rank, uuid, strategy, run; one series per card this process holds
  memory on (DataParallel's one process holds several).
- `TrainingCollector`: step-time histogram, samples counter, loss, and `trainjob_info`, fed by
  `observe_step()` (three additions under a lock: the loop never waits on a scrape).
- `PlanCollector`: the memory plan per card (planned samples, predicted peak, headroom).

`TrainingTelemetry` wires them into a trainer. With several ranks on a node, local rank 0 serves
the public port and, at each scrape, fetches the other local ranks' own loopback endpoints (found
through small registration files) and merges them, so one scrape shows every rank; docs/telemetry.md
says why this design and not prometheus_client's multiprocess mode.

The exposition is prometheus_client's (`generate_latest`); the HTTP server around it (`_serve`) is
http.server's, not prometheus_client's `start_http_server`/`make_wsgi_app`, because those serve one registry
on every path: a liveness probe needs `/health` answering 503 when training stalled, and a scrape endpoint
on a training node needs a per-connection timeout (an idle client must not hold a thread); both are a few
lines on http.server and would be a WSGI dispatcher plus a patched server class on the library's.

`python -m job export --port 9400` (`export_main`) serves the NVML collector alone: the node-exporter
role in compose and Kubernetes. `python -m job.telemetry --bench-scrape` measures a scrape.
prometheus_client and pynvml are imported lazily; nothing here touches CUDA or NVML at import time.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from job import devices
from job.errors import EXIT_OK, UsageError

log = logging.getLogger("job.telemetry")

CARD_LABELS = ("uuid", "pci_bus_id", "gpu", "name", "host")
RANK_LABELS = ("rank", "local_rank", "uuid", "strategy", "run")
# Step times from a few ms (tiny on CPU) to a minute (a large LM step with accumulation).
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PEER_TIMEOUT_S = 2.0
HTTP_TIMEOUT_S = 10.0  # a /metrics or /health client idle this long is disconnected


# -- collectors ---------------------------------------------------------------------------------


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
            card = (h, devices._text(nv.nvmlDeviceGetUUID(h)), devices._text(nv.nvmlDeviceGetPciInfo(h).busId),
                    devices._text(nv.nvmlDeviceGetName(h)), devices._mig_uuids(nv, h))
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
        nv = devices._nvml(self._nvml)
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
                        targets.append((mh, m, devices._text(nv.nvmlDeviceGetName(mh)), False))
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
        s = self._stats(index)
        return (int(s.get("allocated_bytes.all.current", 0)), int(s.get("reserved_bytes.all.current", 0)),
                int(s.get("allocated_bytes.all.peak", 0)))


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
                                     "free + held when it planned, minus its peak reserved.", labels=RANK_LABELS)
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
                    headroom.add_metric(row, float(card.free + card.held - peak))
        for fam in (samples, predicted, headroom):
            if fam.samples:
                yield fam


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

    def observe(self, seconds: float, samples: int, loss: float | None) -> None:
        i = 0
        while i < len(STEP_BUCKETS) and seconds > STEP_BUCKETS[i]:
            i += 1
        with self._lock:
            self._buckets[i] += 1
            self._sum += seconds
            self._samples += samples
            if loss is not None:
                self._loss = float(loss)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        with self._lock:
            counts, total, samples, loss = list(self._buckets), self._sum, self._samples, self._loss
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
        if loss is not None:
            g = GaugeMetricFamily("trainjob_loss", "Training loss at the last logged step.", labels=RANK_LABELS)
            g.add_metric(row, loss)
            yield g
        info = GaugeMetricFamily("trainjob_info", "The run's configuration summary (value always 1).",
                                 labels=list(self.info))
        info.add_metric(list(self.info.values()), 1.0)
        yield info


def _label_name(key: str) -> str:
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return name if re.match(r"^[a-zA-Z_]", name) and not name.startswith("__") else f"x_{name.lstrip('_')}"


# -- HTTP ---------------------------------------------------------------------------------------


def _serve(host: str, port: int, metrics, health) -> tuple[Any, threading.Thread]:
    """A threaded HTTP server for /metrics (metrics() -> bytes) and /health (health() -> dict; HTTP 200
    when its "status" is "ok", else 503).

    Raises OSError when the address cannot be bound.
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            try:
                if path == "/metrics":
                    body, ctype, code = metrics(), CONTENT_TYPE_LATEST, 200
                elif path == "/health":  # 503 unless the status is "ok": what a liveness probe checks
                    h = health()
                    code = 200 if h.get("status") == "ok" else 503
                    body, ctype = (json.dumps(h) + "\n").encode(), "application/json"
                elif path == "/":
                    body, ctype, code = b"trainjob telemetry: /metrics /health\n", "text/plain", 200
                else:
                    body, ctype, code = b"not found: try /metrics or /health\n", "text/plain", 404
            except Exception:  # a bug costs one scrape, not the server thread; details stay in the log
                log.exception("serving %s failed", path)
                body, ctype, code = b"internal error: see the trainer's log\n", "text/plain", 500
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        # An idle or slow client is dropped after this many seconds instead of holding a thread forever.
        timeout = HTTP_TIMEOUT_S

        def log_message(self, *args):  # one line per scrape would drown the training log
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = Server((host, port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                              name=f"metrics-{httpd.server_address[1]}", daemon=True)
    thread.start()
    return httpd, thread


def _stop(httpd) -> None:
    httpd.shutdown()
    httpd.server_close()


class _Merged:
    """Local collectors plus every registered peer rank of this node, merged family by family.

    A sample already present (same name and labels: e.g. the same card's NVML series reported by
    two ranks) is kept once; a peer that does not answer loses its series and reads
    trainjob_telemetry_peer_up 0, the scrape still succeeds.
    """

    def __init__(self, registry, peer_dir: Path, run: str):
        self.registry, self.peer_dir, self.run = registry, peer_dir, run
        self._pool = None

    def peers(self) -> list[dict]:
        out = []
        for f in sorted(self.peer_dir.glob("local_rank-*.json")):
            try:
                peer = json.loads(_read_private(f))
                os.kill(int(peer["pid"]), 0)
            except ProcessLookupError:
                f.unlink(missing_ok=True)  # left by a rank that died without close()
                continue
            except (OSError, ValueError, KeyError):
                continue
            # only this run's ranks, and only loopback: a file in /tmp must not make us fetch elsewhere
            if peer.get("run") == self.run and str(peer.get("url", "")).startswith("http://127.0.0.1:"):
                out.append(peer)
        return out

    def _fetch(self, peer: dict):
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(peer["url"], timeout=PEER_TIMEOUT_S) as r:
                return list(text_string_to_metric_families(r.read().decode()))
        except Exception as e:
            log.debug("peer local rank %s did not answer: %s", peer.get("local_rank"), e)
            return None

    def collect(self):
        from concurrent.futures import ThreadPoolExecutor

        from prometheus_client.core import GaugeMetricFamily

        merged: dict[str, Any] = {}
        seen: set = set()

        def add(families):
            for fam in families:
                into = merged.get(fam.name)
                if into is None:
                    into = merged[fam.name] = _empty_like(fam)
                for s in fam.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    if key not in seen:
                        seen.add(key)
                        into.samples.append(s)

        add(self.registry.collect())
        peers = self.peers()
        if peers:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="metrics-peer")
            results = list(self._pool.map(self._fetch, peers))
            peer_up = GaugeMetricFamily("trainjob_telemetry_peer_up",
                                        "1 when this node's rank answered the merged scrape.", labels=["local_rank"])
            for peer, fams in zip(peers, results, strict=True):
                peer_up.add_metric([str(peer.get("local_rank"))], 0.0 if fams is None else 1.0)
                if fams is not None:
                    add(fams)
            add([peer_up])
        yield from merged.values()

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _empty_like(fam):
    from prometheus_client.metrics_core import Metric

    return Metric(fam.name, fam.documentation, fam.type, fam.unit)


def peer_dir_for(tcfg, run: str) -> Path:
    """This job's registration folder on this node: `<telemetry.peer_dir or $TMPDIR>/trainjob-telemetry-
    <run>-<port>`, the same for every local rank (they share the run id), another for every job."""
    base = Path(getattr(tcfg, "peer_dir", "") or tempfile.gettempdir())
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(run)) or "run"
    return base / f"trainjob-telemetry-{safe}-{tcfg.port}"


def private_dir(path: Path) -> Path:
    """Create `path` with mode 0700 (or accept it as it is), then check that it is a real folder, not a
    symlink, owned by this user and closed to everyone else: a file another user could plant there would
    make local rank 0 fetch from a URL it chose. UsageError otherwise."""
    import stat

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = path.lstat()
    problem = None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is a symlink or not a folder"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    elif st.st_mode & 0o077:
        problem = f"is open to other users (mode {stat.S_IMODE(st.st_mode):o}, needs 700)"
    if problem:
        raise UsageError(f"telemetry's peer folder {path} {problem}; remove it, or set telemetry.peer_dir to a "
                         "folder of your own")
    return path


def _write_private(path: Path, text: str) -> None:
    """Write a file readable by this user only, never through a symlink, and rename it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _read_private(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        return f.read()


# -- the trainer's side -------------------------------------------------------------------------


class TrainingTelemetry:
    """Metrics of one training process; local rank 0 also serves the node's merged view.

    `nvml`, `allocator` and `cards` are injectable (tests, the benchmark); by default they are
    pynvml, torch's allocator and `devices.visible_cards()`.
    """

    def __init__(self, tcfg, *, run: str, strategy: str, rank: int, local_rank: int, world_size: int,
                 info: dict[str, str], device, nvml=None, allocator=None, cards: list[devices.Card] | None = None,
                 plan: list[tuple[Any, Any]] | None = None):
        self.tcfg = tcfg
        self.run, self.strategy = str(run), str(strategy)
        self.rank, self.local_rank, self.world_size = int(rank), int(local_rank), int(world_size)
        self.device = device
        self._nvml, self._allocator, self._cards = nvml, allocator, cards
        self._plan = plan or []
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

    def observe_step(self, seconds: float, samples: int, loss: float) -> None:
        """Record one optimizer step: its wall time, the samples this rank trained on, the current loss."""
        self.steps += 1
        self._last_progress = time.monotonic()
        self.training.observe(seconds, samples, loss)

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


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- the standalone exporter --------------------------------------------------------------------

EXPORT_USAGE = "usage: python -m job export [--port 9400] [--host 127.0.0.1]"


def _parse_export_args(argv: list[str]) -> tuple[str, int] | None:
    host, port = "127.0.0.1", 9400
    it = iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            return None
        name, eq, value = arg.partition("=")
        if name not in ("--port", "--host"):
            raise UsageError(f"unexpected argument `{arg}`; {EXPORT_USAGE}")
        if not eq:
            value = next(it, None)
            if value is None:
                raise UsageError(f"{name} needs a value; {EXPORT_USAGE}")
        if name == "--host":
            host = value
        else:
            if not value.isdigit() or not 1 <= int(value) <= 65535:
                raise UsageError(f"--port {value} is not a TCP port; give 1-65535")
            port = int(value)
    return host, port


def export_main(argv: list[str], *, nvml=None, ready: threading.Event | None = None,
                stop: threading.Event | None = None) -> int:
    """`python -m job export`: serve the NVML collector until SIGTERM/SIGINT, then exit 0."""
    from prometheus_client import CollectorRegistry, generate_latest

    parsed = _parse_export_args(argv)
    if parsed is None:
        print(EXPORT_USAGE)
        return EXIT_OK
    host, port = parsed
    registry = CollectorRegistry(auto_describe=False)
    collector = NvmlCollector(nvml=nvml)
    registry.register(collector)

    def health():
        return {"status": "ok", "nvml_up": devices._nvml(nvml) is not None}

    try:
        httpd, _ = _serve(host, port, lambda: generate_latest(registry), health)
    except OSError as e:
        raise UsageError(f"cannot serve on {_hostport(host, port)} ({e.strerror}); pick a free --port") from None
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    up = devices._nvml(nvml) is not None
    log.info("exporter: serving http://%s/metrics (NVML %s)", _hostport(host, httpd.server_address[1]),
             "up" if up else "unavailable: trainjob_nvml_up 0")
    if not up:
        log.warning("exporter: NVML cannot start here (no driver library or no GPU device in this container); "
                    "in Kubernetes on a node whose runtime ignores NVIDIA_VISIBLE_DEVICES=all in unprivileged "
                    "containers, use DCGM's exporter (GPU Operator) instead: docs/kubernetes.md, 'Hardened nodes'")
    if ready is not None:
        ready.port = httpd.server_address[1]  # type: ignore[attr-defined]
        ready.set()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        _stop(httpd)
    return EXIT_OK


# -- benchmark: python -m job.telemetry --bench-scrape -------------------------------------------


class _FakeDevice:
    type = "cuda"

    def __init__(self, index: int):
        self.index = index


def _fake_allocator(stats):
    from job.fakes import FakeAllocator

    return FakeAllocator(stats)


def _bench_cards(n: int):
    """n fake H200s and their cards (the scrape benchmark runs without GPUs)."""
    from job.fakes import FakeNvml

    nv = FakeNvml.h200s(n, used=60 << 30)
    nv.nvmlInit()
    cards = [devices.Card(i, c.uuid, c.pci_bus_id, i, c.name) for i, c in enumerate(nv.cards)]
    return nv, cards


def _bench_rank(local_rank: int, world: int, n_cards: int, tcfg) -> TrainingTelemetry:
    nv, cards = _bench_cards(n_cards)
    alloc = _fake_allocator({local_rank: (50 << 30, 60 << 30, 55 << 30)})
    tel = TrainingTelemetry(tcfg, run="bench", strategy="ddp", rank=local_rank, local_rank=local_rank,
                            world_size=world, info={"workload": "lm"}, device=_FakeDevice(local_rank),
                            nvml=nv, allocator=alloc, cards=cards)
    tel.start()
    for i in range(100):
        tel.observe_step(0.1 + i * 1e-3, 16, 3.0)
    return tel


def _bench_peer(local_rank: int, world: int, n_cards: int, port: int, peer_dir: str) -> None:
    """A peer rank for the benchmark: serve until the parent closes our stdin."""
    from types import SimpleNamespace

    tel = _bench_rank(local_rank, world, n_cards, SimpleNamespace(port=port, host="127.0.0.1", peer_dir=peer_dir))
    sys.stdin.read()
    tel.close()


def bench_scrape(*, cards: int = 8, ranks: int = 8, scrapes: int = 200) -> dict[str, float]:
    """Time scrapes of local rank 0's merged endpoint with `ranks` processes and `cards` fake cards."""
    import subprocess
    import urllib.request
    from types import SimpleNamespace

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer_dir = tempfile.mkdtemp(prefix="trainjob-bench-")
    tcfg = SimpleNamespace(port=port, host="127.0.0.1", peer_dir=peer_dir)
    code = "import sys; from job.telemetry import _bench_peer; _bench_peer(*map(int, sys.argv[1:5]), sys.argv[5])"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(ranks), str(cards), str(port), peer_dir],
                              stdin=subprocess.PIPE) for r in range(1, ranks)]
    tel = None
    try:
        tel = _bench_rank(0, ranks, cards, tcfg)
        deadline = time.monotonic() + 60
        while len(tel._merged.peers()) < ranks - 1:
            if time.monotonic() > deadline:
                raise RuntimeError("bench peers did not register within 60 s")
            time.sleep(0.05)
        times, body = [], b""
        for _ in range(scrapes + 5):
            t0 = time.perf_counter()
            with urllib.request.urlopen(tel.url, timeout=10) as r:
                body = r.read()
            times.append(time.perf_counter() - t0)
        times = sorted(times[5:])
        series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
        # observe_step's cost, the only work the training loop itself does for telemetry
        n = 100_000
        t0 = time.perf_counter()
        for _ in range(n):
            tel.observe_step(0.1, 16, 3.0)
        observe_us = (time.perf_counter() - t0) / n * 1e6
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait(timeout=30)
        if tel is not None:
            tel.close()
        shutil.rmtree(peer_dir, ignore_errors=True)
    return {"cards": cards, "ranks": ranks, "scrapes": scrapes, "series": series, "bytes": len(body),
            "p50_ms": 1e3 * times[len(times) // 2], "p95_ms": 1e3 * times[int(len(times) * 0.95)],
            "max_ms": 1e3 * times[-1], "observe_step_us": observe_us}


def bench_overhead(*, blocks: int = 20, steps: int = 150, scrape_every: float = 0.25) -> dict[str, float]:
    """Step time of a small CPU training loop with telemetry off vs on and scraped every `scrape_every` s.

    Blocks alternate (off, on, off, on, ...) so that drifting machine load hits both sides alike; each
    block's mean step time counts, the median over blocks is reported. The
    scrape comes 40x more often than prometheus.yml's 10 s, to lift the effect above the noise.
    One torch thread, so the loop and the server compete for the GIL, not for cores.
    """
    import statistics
    import urllib.request
    from types import SimpleNamespace

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tcfg = SimpleNamespace(port=port, host="127.0.0.1", peer_dir=tempfile.mkdtemp(prefix="trainjob-bench-"))
    nv, cards = _bench_cards(8)
    tel = TrainingTelemetry(tcfg, run="bench", strategy="dp", rank=0, local_rank=0, world_size=1, info={},
                            device=_FakeDevice(0), nvml=nv, allocator=_fake_allocator({0: (1, 2, 3)}), cards=cards).start()
    stop = threading.Event()

    def scraper():
        while not stop.wait(scrape_every):
            with urllib.request.urlopen(tel.url, timeout=10) as r:
                r.read()

    def block(with_telemetry: bool) -> float:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
            if with_telemetry:
                tel.observe_step(dt, 64, loss.item())
            times.append(time.perf_counter() - t0)
        return statistics.fmean(times)  # the mean: a scrape shows up as a few slower steps

    block(False)  # warm-up
    off, on = [], []
    try:
        for _ in range(blocks):
            off.append(block(False))
            thread = threading.Thread(target=scraper, daemon=True)
            stop.clear()
            thread.start()
            on.append(block(True))
            stop.set()
            thread.join()
    finally:
        tel.close()
        shutil.rmtree(tcfg.peer_dir, ignore_errors=True)
    m_off, m_on = statistics.median(off), statistics.median(on)
    return {"step_ms_off": 1e3 * m_off, "step_ms_on": 1e3 * m_on, "overhead_pct": 100 * (m_on - m_off) / m_off,
            "blocks": blocks, "steps": steps, "scrape_every_s": scrape_every}


def _bench_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m job.telemetry",
                                description="Scrape benchmark: fake NVML cards, one process per rank, loopback.")
    p.add_argument("--bench-scrape", action="store_true", help="time merged scrapes (the default)")
    p.add_argument("--bench-overhead", action="store_true", help="also: a CPU loop's step time, scraped vs not")
    p.add_argument("--cards", type=int, default=8)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--scrapes", type=int, default=200)
    a = p.parse_args(argv)
    r = bench_scrape(cards=a.cards, ranks=a.ranks, scrapes=a.scrapes)
    print("| cards | ranks | scrapes | series | bytes | p50 ms | p95 ms | max ms | observe_step µs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {r['cards']} | {r['ranks']} | {r['scrapes']} | {r['series']} | {r['bytes']} | {r['p50_ms']:.1f} "
          f"| {r['p95_ms']:.1f} | {r['max_ms']:.1f} | {r['observe_step_us']:.2f} |")
    if a.bench_overhead:
        o = bench_overhead()
        print()
        every = o["scrape_every_s"]
        print(f"| loop (CPU, 1 thread, {o['blocks']} blocks x {o['steps']} steps each side) | step ms, telemetry off "
              f"| step ms, on + scrape every {every:g} s | overhead | scaled to a 10 s scrape |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| MLP 512-1024-10, bs 64 | {o['step_ms_off']:.3f} | {o['step_ms_on']:.3f} "
              f"| {o['overhead_pct']:+.2f} % | {o['overhead_pct'] * every / 10:+.3f} % |")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(_bench_main(sys.argv[1:]))
