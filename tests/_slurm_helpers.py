"""A real Slurm cluster for tests (slurm/cluster.sh), and small functions submitted to it.

Functions here are pickled by reference by submitit, so the jobs import this module: the cluster's
environment puts tests/ on PYTHONPATH (sbatch exports the submitting environment to the job).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _ports import free_port_block
from conftest import ROOT, need_binary

HINT = "apt-get install slurmctld slurmd slurm-client munge (.ci/setup.d/30-slurm.sh)"
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
        "DEADLINE"}
# Small enough that a 2-rank gloo job on 2 CPU cores spends its time starting, not training.
TINY = ["workload=tiny", "workload.width=8", "workload.image_size=16", "train.batch_size=16", "train.log_every=5"]


@dataclass
class Cluster:
    dir: Path
    nodes: int
    env: dict = field(default_factory=dict)  # what a client of this cluster needs (SLURM_CONF, ...)

    def run(self, *cmd: str, check: bool = True, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env={**self.env, **env}, capture_output=True, text=True, check=check,
                              timeout=timeout)

    def state(self, job_id: str) -> str:
        r = self.run("squeue", "-h", "-j", str(job_id), "-t", "all", "-o", "%T", check=False)
        return r.stdout.strip()

    def wait(self, job_id: str, states: set[str], timeout: float = 120, *, what: str = "") -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in states:
                return state
            time.sleep(0.3)
        pytest.fail(f"job {job_id} {what} still {state or 'unknown'} after {timeout} s (wanted {sorted(states)})\n"
                    + self.diagnostics())

    def show(self, job_id: str) -> str:
        return self.run("scontrol", "-d", "show", "job", str(job_id), check=False).stdout

    def diagnostics(self) -> str:
        out = [self.run("sinfo", "-N", check=False).stdout, self.run("squeue", "-t", "all", check=False).stdout]
        for log in sorted((self.dir / "log").glob("*.log")):
            out.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)


def start_cluster(nodes: int, gpus: int = 2) -> Cluster:
    for binary in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue"):
        need_binary(binary, HINT)
    # munged wants every parent directory world-executable: not pytest's 0700 tmp_path.
    d = Path(tempfile.mkdtemp(prefix="jobtest-slurm-", dir="/tmp"))
    env = {**os.environ, "NODES": str(nodes), "GPUS": str(gpus), "PORT": str(free_port_block(nodes + 1))}
    r = subprocess.run(["bash", str(ROOT / "slurm/cluster.sh"), "up", str(d)], env=env, capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        shutil.rmtree(d, ignore_errors=True)
        pytest.fail(f"slurm/cluster.sh up failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    client = {k: v for k, v in os.environ.items() if k not in ("NODES", "GPUS", "PORT")}
    client.update(
        SLURM_CONF=str(d / "slurm.conf"),
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep),
        # Two ranks on two cores: one thread each, or they fight over the cores.
        OMP_NUM_THREADS="1",
    )
    return Cluster(d, nodes, client)


def stop_cluster(c: Cluster) -> None:
    r = subprocess.run(["bash", str(ROOT / "slurm/cluster.sh"), "down", str(c.dir)], env=c.env,
                       capture_output=True, text=True, timeout=120)
    leftover = sorted(p.name for p in c.dir.glob("*.pid"))
    shutil.rmtree(c.dir, ignore_errors=True)
    assert r.returncode == 0 and not leftover, f"cluster.sh down: {r.stdout}{r.stderr} (pid files left: {leftover})"


# -- functions run as submitit jobs ------------------------------------------------------------------
def probe(hold_until: str = "", max_s: float = 120) -> dict:
    """What a task sees: the GPUs Slurm granted, its rank and node. Keeps its allocation until the file
    `hold_until` exists (at most max_s), so a test can run a second job next to it."""
    deadline = time.monotonic() + max_s
    while hold_until and not os.path.exists(hold_until) and time.monotonic() < deadline:
        time.sleep(0.1)
    keys = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_PROCID", "SLURMD_NODENAME", "SUBMITIT_EXECUTOR")
    out = {k: os.environ.get(k) for k in keys}
    # The controller's record of the cards this job holds (only shown while it runs).
    show = subprocess.run(["scontrol", "-d", "show", "job", os.environ["SLURM_JOB_ID"]], capture_output=True,
                          text=True, timeout=60).stdout
    out["granted"] = granted_gpu_indices(show)
    return out


def granted_gpu_indices(scontrol_show: str) -> str:
    """The IDX list of `scontrol -d show job` (e.g. `gpu:1(IDX:1)` -> "1"), comma-joined."""
    import re

    m = re.search(r"GRES=gpu(?::[^(]*)?\(IDX:([0-9,-]+)\)", scontrol_show)
    if not m:
        return ""
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        out += [str(i) for i in range(int(lo), int(hi or lo) + 1)]
    return ",".join(out)


def time_failure(cluster: Cluster, job_id: str, logs: list[Path], pattern: str,
                 timeout: float = 240) -> tuple[float, str]:
    """Seconds from the first log line matching `pattern` (a rank's failure) until Slurm has the job done,
    and the final state. Polls both every 0.2 s."""
    import re

    seen = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if seen is None:
            text = "".join(p.read_text(errors="replace") for p in logs if p.exists())
            if re.search(pattern, text, re.M):
                seen = time.monotonic()
        state = cluster.state(job_id)
        if state in DONE:
            if seen is None:
                pytest.fail(f"job {job_id} ended {state} without {pattern!r}:\n{text[-3000:]}")
            return time.monotonic() - seen, state
        time.sleep(0.2)
    pytest.fail(f"job {job_id} not done after {timeout} s\n{cluster.diagnostics()}")


# -- the user's workload: examples/tabular (an MLP on a CSV), from its own folder, through `make submit` ------
TABULAR = ROOT / "examples" / "tabular"
# Enough steps (a few ms each on one thread) that an interruption lands mid-run; every step logged, so the
# metrics show that a resumed run repeats and skips nothing.
TABULAR_RUN = ["data.kind=csv", "data.val_fraction=0.1", "train.batch_size=256", "workload.hidden=256",
               "train.steps=400", "train.log_every=1", "train.checkpoint_every=0", "train.device=cpu"]


def tabular_csv(folder: Path, rows: int = 2000) -> Path:
    out = folder / "tab.csv"
    subprocess.run([sys.executable, str(TABULAR / "make_data.py"), str(out), str(rows)], check=True,
                   capture_output=True, timeout=60)
    return out


def make_submit(cluster: Cluster, tmp_path: Path, *args: str, strategy: str = "balanced",
                workload: str = "task:workload", make_vars: tuple[str, ...] = ("GPUS=1",),
                timeout: float = 300) -> subprocess.CompletedProcess:
    """`make submit STRATEGY=... WORKLOAD=... ARGS='...'` from the checkout, as a user types it."""
    argv = [*args, f"submit.folder={tmp_path}/submitit/%j", f"train.run_dir={tmp_path}/runs", "submit.cpus_per_task=1"]
    # -o: use the existing .venv as is (the test must not reinstall it).
    return subprocess.run(["make", "-s", "-o", ".venv/.stamp-setup", "submit", f"STRATEGY={strategy}",
                           f"WORKLOAD={workload}", *make_vars, f"ARGS={' '.join(argv)}"], cwd=ROOT, env=cluster.env,
                          capture_output=True, text=True, timeout=timeout)


def submitted_id(stdout: str) -> str:
    first = stdout.splitlines()[0]
    assert first.startswith("submitted slurm job "), stdout
    return first.split()[3].rstrip(":")


def metric_steps(run_dir: Path) -> list[int]:
    import json

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def wait_for_steps(cluster: Cluster, job_id: str, run_dir: Path, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(metric_steps(run_dir)) >= n:
            return
        assert cluster.state(job_id) not in DONE, cluster.diagnostics()
        time.sleep(0.1)
    pytest.fail(f"job {job_id} did not reach step {n} in {timeout} s\n{cluster.diagnostics()}")
