"""`make submit EXECUTOR=local` on a machine without Slurm: submitit's local executor runs the same TrainJob."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

SLURM_TOOLS = {"sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo", "sacct", "salloc"}


def path_without_slurm(bin_dir: Path) -> str:
    """A PATH holding every command of this machine except Slurm's client tools."""
    bin_dir.mkdir()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not d or not Path(d).is_dir():
            continue
        for exe in Path(d).iterdir():
            target = bin_dir / exe.name
            if exe.name not in SLURM_TOOLS and not target.exists() and os.access(exe, os.X_OK):
                target.symlink_to(exe)
    return str(bin_dir)


@pytest.mark.slow
def test_make_submit_local_without_slurm(tmp_path):
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed")
    env = {**os.environ, "PATH": path_without_slurm(tmp_path / "bin"), "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_CONF", None)
    args = (f"workload.width=8 workload.image_size=16 train.batch_size=16 train.steps=10 train.log_every=5 "
            f"train.run_dir={tmp_path}/runs submit.folder={tmp_path}/submitit/%j submit.wait=true")
    # -o: use the existing .venv as is (the test must not reinstall it).
    r = subprocess.run([make, "-s", "-o", ".venv/.stamp-setup", "submit", "STRATEGY=balanced", "EXECUTOR=local",
                        f"ARGS={args}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"^submitted local job (\d+):", r.stdout, re.M)
    assert m, r.stdout
    run_dir = tmp_path / "runs" / f"local-{m.group(1)}"
    assert f"finished: exit 0 (run {run_dir})" in r.stdout
    assert "step 10/10" in r.stdout, "submit.wait follows the job's log"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 10
    # `make status RUN=local-<pid>`: the local job's outcome from its folder, without Slurm.
    st = subprocess.run([make, "-s", "-o", ".venv/.stamp-setup", "status", f"RUN=local-{m.group(1)}",
                         f"ARGS=submit.folder={tmp_path}/submitit/%j train.run_dir={tmp_path}/runs"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert st.returncode == 0 and st.stdout.startswith(f"job {m.group(1)} (local): COMPLETED, exit 0\n"), \
        st.stdout + st.stderr
    assert f"  run:      {run_dir}  (summary.json" in st.stdout


def test_make_status_needs_a_job_or_run():
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed")
    r = subprocess.run([make, "-s", "-o", ".venv/.stamp-setup", "status"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    # One line of ours (make adds its own `make: *** ... Error 2`).
    assert r.returncode == 2 and r.stderr.startswith("error: give JOB=<job id> or RUN=<run id>"), r.stderr


@pytest.mark.slow
def test_make_submit_local_runs_the_users_workload_from_its_workdir(tmp_path):
    """`make submit EXECUTOR=local WORKLOAD=task:workload ARGS='submit.workdir=examples/tabular ...'`: the local
    executor's task runs in the workdir (a `cd` in its setup), where examples/tabular's module is found."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed")
    env = {**os.environ, "PATH": path_without_slurm(tmp_path / "bin"), "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_CONF", None)
    env.pop("PYTHONPATH", None)
    csv = tmp_path / "tab.csv"
    subprocess.run([str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "examples" / "tabular" / "make_data.py"),
                    str(csv), "200"], check=True, capture_output=True, timeout=60)
    args = (f"submit.workdir=examples/tabular data.kind=csv data.path={csv} train.steps=10 train.log_every=5 "
            f"train.run_dir={tmp_path}/runs submit.folder={tmp_path}/submitit/%j submit.wait=true")
    r = subprocess.run([make, "-s", "-o", ".venv/.stamp-setup", "submit", "STRATEGY=balanced", "EXECUTOR=local",
                        "WORKLOAD=task:workload", f"ARGS={args}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "balanced/task:workload" in r.stdout and "step 10/10" in r.stdout, r.stdout
    assert "per-card memory: balanced, task:workload" in r.stdout, r.stdout
