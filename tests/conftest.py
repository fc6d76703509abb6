"""Shared test helpers: GPU marks and the rule for tests that need a system service.

Where a test is (the markers say what it needs, the folder what it tests):
- unit/   one file per module of job/ (test_<module>.py), in-process, fast; a few of them also run one
          command line to check the one-line refusal a user sees.
- e2e/    `python -m job` in fresh processes on the CPU: training, failures, fsdp and ddp over gloo, the
          bench, telemetry of real runs, security, the user's workloads.
- infra/  against real services the tests start and stop: Slurm, Docker (compose, the image, pods run as
          containers), Prometheus; Kubernetes and Grafana validated offline (no server here).
- gpu/    tests that need CUDA cards, all marked and skipped without them (other folders hold a few too,
          next to their CPU counterparts).
- `_<area>_helpers.py` here: what several test files share (import them as top-level modules).

- `@requires_gpus(n)`: skipped unless n CUDA devices are visible (GPU tests run on the lent H200s).
- `need_binary(name)`: a test that needs a real service binary (slurmctld, prometheus, dockerd)
  fails in CI when it is missing (CI installs it, so missing means broken CI) and is skipped with
  the install hint on a developer machine.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from job.devices import CONNECTIONS, CONNECTIONS_VAR

ROOT = Path(__file__).resolve().parent.parent
# Tests that start CUDA in their own process start it as `python -m job` does (job.devices.prepare_environment):
# with that many hardware queues a card, which decides whether another stream's work waits behind queued kernels.
os.environ.setdefault(CONNECTIONS_VAR, CONNECTIONS)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def requires_gpus(n: int):
    return pytest.mark.skipif(cuda_count() < n, reason=f"needs {n} CUDA GPU(s)")


def need_binary(name: str, hint: str) -> str:
    path = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists() else None)
    if path:
        return path
    if IN_CI:
        pytest.fail(f"{name} is missing in CI; .ci/setup.d should install it ({hint})")
    pytest.skip(f"{name} not installed ({hint})")


def job_cmd(*args: str) -> list[str]:
    """The real entry point, as a user runs it. The shared argument lists (SMALL...) pick `workload=tiny` and
    set its keys first; a test that picks another workload after them drops those earlier workload keys,
    which the other workload does not have."""
    picks = [i for i, a in enumerate(args) if a.startswith("workload=")]
    if len(picks) > 1:
        last = picks[-1]
        args = tuple(a for i, a in enumerate(args)
                     if i >= last or not (a.startswith("workload=") or a.startswith("workload.")))
    return [sys.executable, "-m", "job", *args]


# -- two workers (make test runs pytest-xdist with --dist loadgroup) ----------------------------------------
# Tests that share one daemon stay on one worker, in file order: the two Slurm files (one munged, and their
# clusters' slurmd share this host's name) and the two Docker files (one engine on one data root). They run
# first, as they are the longest; every other test goes to whichever worker is free.
SHARED = {"test_slurm.py": "slurm", "test_slurm_multinode.py": "slurm",
          "test_docker.py": "docker", "test_k8s_docker.py": "docker"}


# tryfirst: xdist's worker turns an `xdist_group` mark into the nodeid's `@group` suffix (which is what
# --dist loadgroup schedules by) in its own pytest_collection_modifyitems, registered after this conftest
# and so called before this hook unless this one goes first. Without it the marks came too late: both
# workers ran Docker and Slurm tests at once, each starting its own engine (one waited for the other's
# data-root lock) and its own cluster.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    first = []
    for item in items:
        group = SHARED.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        first.append(group is None)
    order = sorted(range(len(items)), key=lambda i: first[i])  # stable: file order within each part
    items[:] = [items[i] for i in order]


def pytest_collection_finish(session):
    """Under --dist loadgroup, every test of a shared daemon carries its group in its nodeid (a worker's check)."""
    config = session.config
    if not (os.environ.get("PYTEST_XDIST_WORKER") and config.getoption("loadgroup", default=False)):
        return
    lost = [item.nodeid for item in session.items if item.path.name in SHARED and not item.nodeid.endswith(
        f"@{SHARED[item.path.name]}")]
    if lost:
        line = (f"error: {len(lost)} tests lost their xdist group (e.g. {lost[0]}): they would run on both workers at "
                "once (pytest-dev/pytest-xdist#1386: pytest 9.2 with xdist 3.8; pyproject.toml pins pytest below it)")
        print(line, file=sys.stderr)  # a worker's own error would reach the terminal only as its crashed first test
        raise pytest.UsageError(line)
