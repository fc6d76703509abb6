"""job.submit on real GPUs (submitit's local executor: no Slurm on the GPU machine). Skipped without 2 GPUs.

Run on the 2-GPU machine: .venv/bin/python -m pytest tests/gpu/test_submit_gpu.py -v
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from conftest import ROOT, job_cmd, requires_gpus

pytestmark = [pytest.mark.gpu, requires_gpus(2)]


def submit_local(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    r = subprocess.run(
        job_cmd("submit", "submit.executor=local", "submit.wait=true", "workload=tiny", "train.steps=30",
                f"train.run_dir={tmp_path}/runs", f"submit.folder={tmp_path}/submitit/%j", *args),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = re.search(r"^submitted local job (\d+):", r.stdout, re.M).group(1)
    return r, json.loads((tmp_path / "runs" / f"local-{job_id}" / "summary.json").read_text())


def test_ddp_runs_one_task_per_gpu(tmp_path):
    """Two tasks, ranks 0 and 1, each on its own card (cuda:LOCAL_RANK among the visible ones)."""
    _, summary = submit_local(tmp_path, "strategy=ddp", "submit.gpus_per_node=2")
    assert summary["world_size"] == 2
    cards = summary["cards"]
    assert sorted(c["rank"] for c in cards) == [0, 1], cards
    assert len({c["uuid"] for c in cards}) == 2, f"both ranks on one card: {cards}"


def test_single_process_strategy_drives_both_gpus(tmp_path):
    """dp: one task that sees (and uses) both cards."""
    r, summary = submit_local(tmp_path, "strategy=dp", "submit.gpus_per_node=2")
    cards = summary["cards"]
    assert {c["rank"] for c in cards} == {0} and len({c["uuid"] for c in cards}) == 2, cards
    # `python -m job status` finds the finished job and shows the per-card table the trainer printed.
    job_id = re.search(r"^submitted local job (\d+):", r.stdout, re.M).group(1)
    st = subprocess.run(job_cmd("status", f"local-{job_id}", f"train.run_dir={tmp_path}/runs",
                                f"submit.folder={tmp_path}/submitit/%j"), cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
    assert st.returncode == 0 and st.stdout.startswith(f"job {job_id} (local): COMPLETED, exit 0\n"), st.stdout
    table = st.stdout.split("  per-card table: ", 1)[1]
    for c in cards:
        assert c["uuid"][:13] in table, (c["uuid"], table)
