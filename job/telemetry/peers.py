"""The other local ranks of a node: their registration files and the merged view local rank 0 serves.

Every local rank but 0 serves its own metrics on a loopback port and writes a small registration file
(url, pid, run, local rank) into a private folder of the job (`peer_dir_for`, `private_dir`); at each
scrape local rank 0 fetches them all and merges them into one answer (`_Merged`).

Another user of the node must neither redirect those fetches nor block the job (docs/security.md): the folder
of a job started as a plain command is a fresh private one its launcher makes (mkdtemp) and hands to the ranks;
a single process makes its own; only ranks started by torchrun or Slurm meet in a folder named after the user,
the run and the port (under $XDG_RUNTIME_DIR when it is the user's own, else the temp folder; one someone else
made first is refused in one line). A registration is followed only to a URL that parses as
http://127.0.0.1:PORT/metrics.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from job.errors import UsageError

log = logging.getLogger("job.telemetry")
PEER_TIMEOUT_S = 2.0
PEER_DIR_VAR = "TRAINJOB_PEER_DIR"  # set by job.launch.spawn for the ranks it starts


def loopback_metrics_url(url) -> bool:
    """`url` is exactly http://127.0.0.1:PORT/metrics (parsed, not a prefix test: no user part, no other
    host behind an `@`, no query)."""
    try:
        u = urlsplit(str(url))
        port = u.port
    except ValueError:
        return False
    return (u.scheme == "http" and u.netloc == f"127.0.0.1:{port}" and port is not None and 0 < port < 65536
            and u.path == "/metrics" and not u.query and not u.fragment)


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
            if peer.get("run") == self.run and loopback_metrics_url(peer.get("url", "")):
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
    """This job's registration folder on this node, the same for every local rank, another for every job:
    telemetry.peer_dir's `trainjob-telemetry-<uid>-<run>-<port>` when it is set; else the private folder the
    launcher made (job.launch.spawn); else, for a process without local peers, a fresh private one; else (ranks
    of torchrun or Slurm) that name under $XDG_RUNTIME_DIR if it is this user's own, or the temp folder."""
    explicit = getattr(tcfg, "peer_dir", "")
    if not explicit:
        if os.environ.get(PEER_DIR_VAR):
            return Path(os.environ[PEER_DIR_VAR])
        local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1"
        if local == "1":  # nobody to meet: a name nobody can predict
            return Path(tempfile.mkdtemp(prefix="trainjob-telemetry-"))
    base = Path(explicit or _runtime_dir() or tempfile.gettempdir())
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(run)) or "run"
    if len(safe) > 64:  # the name must stay a file name whatever the run id's length
        safe = f"{safe[:40]}-{hashlib.sha256(str(run).encode()).hexdigest()[:16]}"
    return base / f"trainjob-telemetry-{os.geteuid()}-{safe}-{tcfg.port}"


def _runtime_dir() -> str | None:
    """$XDG_RUNTIME_DIR when it is a folder of this user closed to others (no one else can create names in it)."""
    import stat

    path = os.environ.get("XDG_RUNTIME_DIR")
    if not path:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    ok = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
    return path if ok else None


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
