"""Shared by the telemetry and Prometheus tests: ports, scrapes, waiting for a trainer to serve."""

from __future__ import annotations

import subprocess
import time
import urllib.request

from _ports import free_port  # noqa: F401  (re-exported: the telemetry tests take it from here)
from prometheus_client.parser import text_string_to_metric_families


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset(labels)): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate sample {key}"
            out[key] = s.value
    return out


def named(text: str, name: str) -> list[dict[str, str]]:
    """Label sets of every sample called `name`."""
    return [dict(labels) for (n, labels) in samples(text) if n == name]


def wait_for(url: str, predicate, proc: subprocess.Popen | None = None, timeout: float = 90.0) -> str:
    """Scrape `url` until predicate(text) holds; fail with the process output if it exits first."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"process exited {proc.returncode} before {url} was ready:\n{out}\nlast:\n{last}")
        try:
            code, last = get(url, timeout=2)
            if code == 200 and predicate(last):
                return last
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready after {timeout} s; last body:\n{last}")


def stop(proc: subprocess.Popen, timeout: float = 60) -> int:
    """SIGTERM a process we started and wait for its exit code (kill if it ignores us)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def has_samples(ranks: set[str]):
    """A wait_for predicate: every rank in `ranks` (and no other) has counted samples."""
    def ok(text: str) -> bool:
        got = {dict(lab)["rank"] for (n, lab), v in samples(text).items() if n == "trainjob_samples_total" and v > 0}
        return got == ranks
    return ok
