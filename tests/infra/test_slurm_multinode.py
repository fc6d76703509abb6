"""Multi-node DDP through submitit on a real two-node Slurm (two slurmd on this host, nodes n1 and n2)."""

from __future__ import annotations

import re
import subprocess

import pytest
import submitit
from _slurm_helpers import (
    DONE,
    TABULAR_RUN,
    TINY,
    make_submit,
    metric_steps,
    start_cluster,
    stop_cluster,
    submitted_id,
    tabular_csv,
    time_failure,
    wait_for_steps,
)
from conftest import ROOT, job_cmd

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RUN = [*TINY, "strategy=ddp", "train.steps=8", "train.device=cpu"]


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(nodes=2, gpus=1)
    try:
        yield c
    finally:
        stop_cluster(c)


def test_ddp_two_nodes_one_task_each_matches_single_process(cluster, tmp_path):
    import torch

    r = subprocess.run(
        job_cmd("submit", *RUN, "submit.nodes=2", "submit.gpus_per_node=1", "submit.cpus_per_task=1",
                f"submit.folder={tmp_path}/submitit/%j", f"train.run_dir={tmp_path}/runs", "submit.wait=true"),
        capture_output=True, text=True, cwd=ROOT, env=cluster.env, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr + cluster.diagnostics()
    job_id = r.stdout.split()[3].rstrip(":")
    results = submitit.SlurmJob(folder=tmp_path / "submitit" / "%j", job_id=job_id, tasks=[0, 1]).results()
    assert [(x["rank"], x["cuda_visible_devices"]) for x in results] == [(0, "0"), (1, "0")], results
    assert {x["exit_code"] for x in results} == {0}
    logs = [(tmp_path / "submitit" / job_id / f"{job_id}_{t}_log.err").read_text() for t in (0, 1)]
    assert "node=0(2)" in logs[0] and "node=1(2)" in logs[1], "one task on each node"

    from job.config import load
    from job.train import run

    assert run(load([*RUN, "strategy=dp", f"train.run_dir={tmp_path}/ref", "train.run_id=one"])) == 0

    def final(run_dir):
        return torch.load(sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1], weights_only=False)

    two, one = final(tmp_path / "runs" / f"slurm-{job_id}"), final(tmp_path / "ref" / "one")
    assert two["step"] == one["step"] == 8
    for k in one["model"]:
        torch.testing.assert_close(two["model"][k], one["model"][k], rtol=1e-4, atol=1e-5, msg=k)


def test_a_failing_rank_ends_the_two_node_job(cluster, tmp_path):
    """2 nodes x 1 task through submitit: rank 1 (on n2) raises at step 3 (the JOB_FAULT test hook); rank 0
    leaves too, and the job is over within 30 s of the error line, which appears once."""
    r = subprocess.run(
        job_cmd("submit", *TINY, "strategy=ddp", "train.steps=300", "train.device=cpu", "submit.nodes=2",
                "submit.gpus_per_node=1", "submit.cpus_per_task=1", f"submit.folder={tmp_path}/submitit/%j",
                f"train.run_dir={tmp_path}/runs"),
        capture_output=True, text=True, cwd=ROOT, env={**cluster.env, "JOB_FAULT": "1:3:raise"}, timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.split()[3].rstrip(":")
    logs = [tmp_path / "submitit" / job_id / f"{job_id}_{t}_log.err" for t in (0, 1)]
    seconds, state = time_failure(cluster, job_id, logs, r"^error: rank 1 \(.*\): RuntimeError: injected fault")
    text = "".join(p.read_text() for p in logs)
    assert state == "FAILED" and seconds < 30, f"{state} after {seconds:.1f} s\n{text[-3000:]}"
    assert text.count("injected fault") == 1, text[-3000:]
    assert "stopping: rank 1 failed" in logs[0].read_text(), text[-3000:]


def test_users_workload_on_two_nodes_is_requeued_and_resumes(cluster, tmp_path):
    """examples/tabular from its own folder on both nodes (`make submit STRATEGY=ddp NODES=2`, submit.workdir):
    one rank per node; `scontrol requeue` mid-run (SIGTERM: every rank stops at the same step, rank 0
    checkpoints, Slurm starts the job again) resumes it, and it ends COMPLETED with every step logged once."""
    csv = tabular_csv(tmp_path)
    r = make_submit(cluster, tmp_path, *TABULAR_RUN, f"data.path={csv}", "submit.workdir=examples/tabular",
                    strategy="ddp", make_vars=("NODES=2", "GPUS=1"))
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = submitted_id(r.stdout)
    assert "ddp/task:workload, 2 node(s) x 1 task(s)" in r.stdout, r.stdout
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    wait_for_steps(cluster, job_id, run_dir, 10)
    cluster.run("scontrol", "requeue", job_id)
    state = cluster.wait(job_id, DONE, timeout=240, what="after the requeue")
    logs = [(tmp_path / "submitit" / job_id / f"{job_id}_{t}_log.err").read_text() for t in (0, 1)]
    assert state == "COMPLETED" and "Restarts=1" in cluster.show(job_id), logs[0][-3000:] + logs[1][-2000:]
    assert "node=0(2)" in logs[0] and "node=1(2)" in logs[1], "one task on each node"
    resumed = [int(m) for m in re.findall(r"^resumed from \S+ at step (\d+)", logs[0], re.M)]
    assert len(resumed) == 1 and 10 <= resumed[0] < 400, logs[0][-3000:]
    assert metric_steps(run_dir) == list(range(1, 401))
    st = subprocess.run(job_cmd("status", job_id, f"submit.folder={tmp_path}/submitit/%j",
                                f"train.run_dir={tmp_path}/runs"),
                        cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert st.stdout.startswith(f"job {job_id} (slurm): COMPLETED (requeued 1x), exit 0\n"), st.stdout + st.stderr
    assert "    per-card memory: ddp, task:workload, global batch 256, 400 steps" in st.stdout, st.stdout
