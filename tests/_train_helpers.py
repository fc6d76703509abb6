"""Helpers the trainer's end-to-end tests share: a small CPU run through the real entry point, its final
checkpoint, weights compared, a step waited for, processes waited out."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import torch
from conftest import ROOT, job_cmd

# Small and fast on 2 cores, same code paths as the real workloads.
SMALL = ["workload=tiny", "workload.width=8", "workload.image_size=16", "train.device=cpu", "train.log_every=5"]


def train(tmp: Path, run_id: str, *args: str, env=None, timeout=240) -> subprocess.CompletedProcess:
    """`python -m job train` on SMALL with this run directory and id, to the end."""
    cmd = job_cmd("train", *SMALL, f"train.run_dir={tmp}", f"train.run_id={run_id}", *args)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    return p


def final_model(tmp: Path, run_id: str) -> dict:
    """The newest checkpoint of the run."""
    ckpts = sorted((tmp / run_id / "checkpoints").glob("step_*.pt"))
    assert ckpts, f"no checkpoint in {tmp / run_id}"
    return torch.load(ckpts[-1], map_location="cpu", weights_only=False)


def assert_same_weights(a: dict, b: dict, *, exact: bool, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)


def wait_for_step(path: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until the metrics file at `path` has logged `step` (the trainer must still be running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            steps = [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]
            if steps and steps[-1] >= step:
                return
        assert proc.poll() is None, "trainer exited before the signal"
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (/proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The processes of `pids` still running after up to `timeout` seconds ([] as soon as none is)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if running(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if running(p)]
