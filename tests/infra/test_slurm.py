"""job.submit against a real single-node Slurm 22.05 (slurmctld + slurmd + munged, 2 fake GPUs via gres).

The module starts the cluster (slurm/cluster.sh up) and stops it at the end, pass or fail. No slurmdbd:
job states come from squeue/scontrol, which keep finished jobs for MinJobAge=600 s.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import submitit
from _slurm_helpers import (
    DONE,
    TABULAR,
    TABULAR_RUN,
    TINY,
    make_submit,
    metric_steps,
    probe,
    start_cluster,
    stop_cluster,
    submitted_id,
    tabular_csv,
    time_failure,
    wait_for_steps,
)
from conftest import ROOT, job_cmd

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Shared by the uninterrupted and the preempted ddp runs: same config, so the weights must match bit for bit.
# Steps are long enough (~10 s on 2 cores) that the interruption lands mid-run. Every checkpoint is kept: the
# one at step 8 is compared with a single process (float summation order makes runs drift apart later:
# max |diff| 4e-6 after 10 steps, 3e-2 after 160, measured on CPU).
CMP_STEP = 8
DDP_RUN = [*TINY, "strategy=ddp", "workload.width=16", "workload.image_size=32", "train.batch_size=64",
           "train.steps=160", "train.log_every=1", f"train.checkpoint_every={CMP_STEP}",
           "train.keep_checkpoints=100", "train.device=cpu"]
DDP_SUBMIT = ["submit.gpus_per_node=2", "submit.cpus_per_task=1", "submit.timeout_min=10",
              "submit.signal_delay_s=30"]


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(nodes=1, gpus=2)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for key in ("SLURM_CONF", "PYTHONPATH", "OMP_NUM_THREADS"):
                mp.setenv(key, c.env[key])
            yield c
    finally:
        stop_cluster(c)


def submit_cli(cluster, tmp_path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        job_cmd("submit", f"submit.folder={tmp_path}/submitit/%j", f"train.run_dir={tmp_path}/runs", *args),
        capture_output=True, text=True, cwd=ROOT, env=cluster.env, timeout=timeout,
    )


def status_cli(cluster, tmp_path, *args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(job_cmd("status", *args, f"submit.folder={tmp_path}/submitit/%j",
                                  f"train.run_dir={tmp_path}/runs"),
                          capture_output=True, text=True, cwd=ROOT, env={**cluster.env, **env}, timeout=timeout)


def job_id_of(stdout: str) -> str:
    first = stdout.splitlines()[0]
    assert first.startswith("submitted slurm job "), stdout
    return first.split()[3].rstrip(":")


def final_weights(run_dir, step: int | None = None):
    import torch

    ckpts = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    assert ckpts, f"no checkpoint in {run_dir}"
    path = ckpts[-1] if step is None else run_dir / "checkpoints" / f"step_{step:08d}.pt"
    return torch.load(path, map_location="cpu", weights_only=False)


def test_submitit_job_sees_the_gpus_slurm_granted(cluster, tmp_path):
    """A trivial submitit function: results come back, and CUDA_VISIBLE_DEVICES is the card Slurm granted."""
    ex = submitit.SlurmExecutor(folder=tmp_path / "%j")
    ex.update_parameters(time=5, gpus_per_node=1, cpus_per_task=1, ntasks_per_node=1)
    release = tmp_path / "release"
    holder = ex.submit(probe, str(release))  # holds one card until the second job has run
    cluster.wait(holder.job_id, {"RUNNING"})
    second = ex.submit(probe)
    cluster.wait(second.job_id, DONE)
    release.touch()
    cluster.wait(holder.job_id, DONE)
    for job in (holder, second):
        got = job.result()
        assert got["SUBMITIT_EXECUTOR"] == "slurm" and got["SLURM_JOB_ID"] == job.job_id
        assert got["granted"] and got["CUDA_VISIBLE_DEVICES"] == got["granted"], got
    assert {holder.result()["CUDA_VISIBLE_DEVICES"], second.result()["CUDA_VISIBLE_DEVICES"]} == {"0", "1"}


def test_bad_partition_is_refused_before_submission(cluster, tmp_path):
    before = cluster.run("squeue", "-h", "-t", "all", "-o", "%i").stdout
    r = submit_cli(cluster, tmp_path, "submit.partition=nosuch", "submit.cpus_per_task=1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("error: Slurm refuses the job:") and "partition" in r.stderr.lower()
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert cluster.run("squeue", "-h", "-t", "all", "-o", "%i").stdout == before, "nothing may be submitted"
    assert not (tmp_path / "submitit").exists(), "nothing may be written before Slurm accepts the request"
    r = submit_cli(cluster, tmp_path, "submit.gpus_per_node=3", "submit.cpus_per_task=1")  # the node has 2
    assert r.returncode == 2 and r.stderr.startswith("error: Slurm refuses the job:"), r.stderr


def test_tiny_job_completes_and_reports(cluster, tmp_path):
    r = submit_cli(cluster, tmp_path, *TINY, "strategy=balanced", "train.steps=20", "submit.gpus_per_node=1",
                   "submit.cpus_per_task=1", "submit.wait=true")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = job_id_of(r.stdout)
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    assert f"run:    {run_dir}" in r.stdout and f"finished: exit 0 (run {run_dir})" in r.stdout
    assert "step 20/20" in r.stdout, "submit.wait follows the job's log"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20
    result = submitit.SlurmJob(folder=tmp_path / "submitit" / "%j", job_id=job_id).result()
    # The one card Slurm granted (the only job running, so the first of the node's two), untouched.
    assert result == {"run_id": f"slurm-{job_id}", "run_dir": str(run_dir), "rank": 0, "exit_code": 0,
                      "requeues": 0, "cuda_visible_devices": "0"}
    assert "step 20/20" in (tmp_path / "submitit" / job_id / f"{job_id}_0_log.err").read_text()
    assert cluster.wait(job_id, DONE, timeout=60) == "COMPLETED"
    # Following it later: the command `submit` printed, by job id or run id, and once the controller has
    # forgotten the job (here: no controller answers; `squeue -j` then shows an empty table), from its files.
    follow = re.search(r"^  follow: (.*) -m job status (\d+) --follow submit\.folder=(\S+)", r.stdout, re.M)
    assert follow and follow.group(2) == job_id and follow.group(3) == f"{tmp_path}/submitit/%j", r.stdout
    for ident, env in ((job_id, {}), (f"slurm-{job_id}", {"SLURM_CONF": str(tmp_path / "no-such-slurm.conf")})):
        s = status_cli(cluster, tmp_path, ident, **env)
        assert s.returncode == 0 and s.stdout.startswith(f"job {job_id} (slurm): COMPLETED, exit 0\n"), s.stdout + s.stderr
        assert f"  run:      {run_dir}  (summary.json" in s.stdout
        assert f"  log:      {tmp_path}/submitit/{job_id}/{job_id}_0_log.out" in s.stdout
        assert "  per-card table: " in s.stdout and "    throughput:" in s.stdout, s.stdout


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    """The first CMP_STEP steps as one plain process: what a 2-rank run must reproduce (up to float order)."""
    from job.config import load
    from job.train import run

    out = tmp_path_factory.mktemp("ref")
    cfg = load([*DDP_RUN, "strategy=dp", f"train.steps={CMP_STEP}", f"train.run_dir={out}", "train.run_id=ref"])
    assert run(cfg) == 0
    return final_weights(out / "ref")


@pytest.fixture(scope="module")
def ddp_uninterrupted(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    r = submit_cli(cluster, tmp, *DDP_RUN, *DDP_SUBMIT, "submit.wait=true")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = job_id_of(r.stdout)
    return job_id, tmp / "runs" / f"slurm-{job_id}"


def _assert_close(a: dict, b: dict, *, exact: bool) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{k} differs"
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_ddp_two_tasks_matches_single_process(cluster, ddp_uninterrupted, ddp_reference):
    job_id, run_dir = ddp_uninterrupted
    assert final_weights(run_dir)["step"] == 160
    ckpt = final_weights(run_dir, CMP_STEP)
    assert ckpt["step"] == ddp_reference["step"] == CMP_STEP
    _assert_close(ckpt["model"], ddp_reference["model"], exact=False)
    results = submitit.SlurmJob(folder=run_dir.parent.parent / "submitit" / "%j", job_id=job_id,
                                tasks=[0, 1]).results()
    # One task per GPU; each sees the node's two granted cards as Slurm set them (it uses cuda:LOCAL_RANK).
    assert [(x["rank"], x["cuda_visible_devices"]) for x in results] == [(0, "0,1"), (1, "0,1")], results


def _metric_steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def _wait_for_steps(cluster, job_id: str, run_dir, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(_metric_steps(run_dir)) >= n:
            return
        assert cluster.state(job_id) not in DONE, cluster.diagnostics()
        time.sleep(0.1)
    pytest.fail(f"job {job_id} did not reach step {n} in {timeout} s\n{cluster.diagnostics()}")


def test_preempted_and_requeued_job_ends_with_the_same_weights(cluster, tmp_path, ddp_uninterrupted):
    """Two interruptions of one 2-rank job, then it finishes as if never interrupted.

    1. submitit's preemption path (`job._interrupt()`: SIGTERM + SIGUSR2 to every task): the ranks finish the
       step, rank 0 checkpoints, submitit's handler requeues (TrainJob.checkpoint counts it).
    2. Slurm's own requeue (`scontrol requeue`, as an admin or PreemptMode=REQUEUE does): SIGTERM, checkpoint,
       the same job id starts again. Both times the run resumes from the checkpoint (train.resume=auto).
    """
    r = submit_cli(cluster, tmp_path, *DDP_RUN, *DDP_SUBMIT)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = job_id_of(r.stdout)
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    job = submitit.SlurmJob(folder=tmp_path / "submitit" / "%j", job_id=job_id, tasks=[0, 1])
    log = tmp_path / "submitit" / job_id / f"{job_id}_0_log.err"

    _wait_for_steps(cluster, job_id, run_dir, 5)
    job._interrupt()  # scancel --signal SIGTERM, then --signal USR2: what submitit does for preemption
    while "resumed from" not in log.read_text():
        assert cluster.state(job_id) not in DONE, cluster.diagnostics()
        time.sleep(0.2)
    first = len(_metric_steps(run_dir))
    _wait_for_steps(cluster, job_id, run_dir, first + 5)
    cluster.run("scontrol", "requeue", job_id)

    cluster.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=240, what="after the interruptions")
    show = cluster.show(job_id)
    assert "JobState=COMPLETED" in show and "Restarts=2" in show, show + log.read_text()[-3000:]
    results = job.results()
    assert [x["exit_code"] for x in results] == [0, 0] and results[0]["requeues"] == 1, results
    st = status_cli(cluster, tmp_path, job_id)
    assert st.stdout.startswith(f"job {job_id} (slurm): COMPLETED (requeued 2x), exit 0\n"), st.stdout + st.stderr
    text = log.read_text() + log.with_suffix(".out").read_text()  # trainer: .err; submitit's logger: .out
    resumed = [int(m) for m in re.findall(r"^resumed from \S+ at step (\d+)", text, re.M)]
    assert len(resumed) == 2 and 0 < resumed[0] < resumed[1] < 160, text[-3000:]
    # 1: submitit's handler ran (called by TrainJob after the checkpoint); 2: a SIGTERM stop, no requeue by us.
    assert "Caught signal SIGUSR2" in text and f"Requeued job {job_id}" in text, text[-3000:]
    assert text.count("stop requested (SIGTERM)") >= 1 and "not requeuing here" in text, text[-3000:]
    # Nothing lost or repeated: every step 1..160 logged exactly once over the three attempts.
    assert _metric_steps(run_dir) == list(range(1, 161))
    ckpt, ref = final_weights(run_dir), final_weights(ddp_uninterrupted[1])
    assert ckpt["step"] == 160
    _assert_close(ckpt["model"], ref["model"], exact=True)


def test_plain_sbatch_script_requeues_itself(cluster, tmp_path):
    """slurm/train.sbatch without submitit: srun + the same entry point, run id slurm-<job id>; on SIGUSR2 (what
    --signal=USR2@120 sends before the time limit) the trainer checkpoints, exits 75, the script requeues the job
    and the next attempt resumes."""
    run = [*DDP_RUN, "strategy=dp", "train.steps=120", f"train.run_dir={tmp_path}/runs"]
    r = cluster.run("sbatch", "--parsable", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1",
                    f"--output={tmp_path}/%j.out", f"--chdir={ROOT}", str(ROOT / "slurm" / "train.sbatch"), *run,
                    check=False, PYTHON=sys.executable)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    _wait_for_steps(cluster, job_id, run_dir, 5)
    cluster.run("scancel", "--signal=USR2", job_id)
    state = cluster.wait(job_id, DONE, timeout=180)
    out = (tmp_path / f"{job_id}.out").read_text()
    assert state == "COMPLETED" and "Restarts=1" in cluster.show(job_id), out[-3000:]
    assert f"requeueing job {job_id}" in out and "resumed from" in out, out[-3000:]
    assert _metric_steps(run_dir) == list(range(1, 121))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 120
    # `status` knows it is not a submitit job and says where Slurm has its log, in one line.
    st = status_cli(cluster, tmp_path, job_id)
    assert st.returncode == 2 and st.stderr.count("\n") == 1, st.stderr
    assert f"Slurm knows job {job_id} (COMPLETED, exit 0:0, log {tmp_path}/{job_id}.out)" in st.stderr, st.stderr
    assert "(plain sbatch)" in st.stderr


def test_a_failing_rank_ends_the_plain_sbatch_job(cluster, tmp_path):
    """slurm/train.sbatch, 2 tasks: rank 1 raises at step 3 (the JOB_FAULT test hook). Its error line appears
    once, rank 0 notices and leaves, srun --wait bounds the rest: the job is FAILED within 30 s of the error."""
    run = [*TINY, "strategy=ddp", "train.steps=300", "train.device=cpu", f"train.run_dir={tmp_path}/runs"]
    r = cluster.run("sbatch", "--parsable", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1",
                    f"--output={tmp_path}/%j.out", f"--chdir={ROOT}", str(ROOT / "slurm" / "train.sbatch"), *run,
                    check=False, PYTHON=sys.executable, JOB_FAULT="1:3:raise")
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    out = tmp_path / f"{job_id}.out"
    seconds, state = time_failure(cluster, job_id, [out], r"^error: rank 1 \(cpu\): RuntimeError: injected fault")
    text = out.read_text()
    assert state == "FAILED" and seconds < 30, f"{state} after {seconds:.1f} s\n{text[-3000:]}"
    assert text.count("injected fault") == 1 and "Traceback" not in text, text[-3000:]
    assert "rank 0 (cpu): stopping: rank 1 failed" in text, text[-3000:]
    assert "Restarts=0" in cluster.show(job_id), "a crash is not requeued"


def test_max_requeues_bounds_the_requeues(cluster, tmp_path):
    """submit.max_requeues=0: a SIGUSR2 still checkpoints, but the job is not requeued and ends with an error
    result that says why; the checkpoint stays for a resubmission with the same train.run_id."""
    r = submit_cli(cluster, tmp_path, *DDP_RUN, "strategy=balanced", "submit.max_requeues=0",
                   "submit.gpus_per_node=1", "submit.cpus_per_task=1", "submit.timeout_min=10",
                   "submit.signal_delay_s=30")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = job_id_of(r.stdout)
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    _wait_for_steps(cluster, job_id, run_dir, 5)
    cluster.run("scancel", "--signal=USR2", job_id)
    cluster.wait(job_id, DONE, timeout=120)
    assert "Restarts=0" in cluster.show(job_id)
    job = submitit.SlurmJob(folder=tmp_path / "submitit" / "%j", job_id=job_id)
    # submitit's timeout countdown (max_num_timeout=submit.max_requeues; a SIGUSR2 in a job of <= 10 min counts
    # as a time-out) or TrainJob.checkpoint's own count refuses, whichever comes first.
    with pytest.raises(submitit.core.utils.FailedJobError,
                       match="Job not requeued because: (timed-out too many times|checkpoint function returned None)"):
        job.result()
    st = status_cli(cluster, tmp_path, job_id)  # the contract's 75: stopped after a checkpoint, not requeued
    head, reason = st.stdout.splitlines()[:2]
    assert re.fullmatch(rf"job {job_id} \(slurm\): \w+, exit 75", head), st.stdout + st.stderr
    assert "Job not requeued because" in reason and f"resubmit with train.run_id=slurm-{job_id}" in reason, reason
    stopped = final_weights(run_dir)
    assert 5 <= stopped["step"] < 160 and stopped["step"] == _metric_steps(run_dir)[-1]


def test_status_of_a_failed_job_shows_its_exit_code_and_reason(cluster, tmp_path):
    """The trainer fails at step 2 (the JOB_FAULT test hook): the exit code is the trainer's, the reason its
    one error line; --follow exits with that code."""
    r = subprocess.run(
        job_cmd("submit", f"submit.folder={tmp_path}/submitit/%j", f"train.run_dir={tmp_path}/runs", *TINY,
                "strategy=balanced", "train.steps=50", "submit.gpus_per_node=1", "submit.cpus_per_task=1"),
        capture_output=True, text=True, cwd=ROOT, env={**cluster.env, "JOB_FAULT": "0:2:raise"}, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = job_id_of(r.stdout)
    f = status_cli(cluster, tmp_path, job_id, "--follow")
    assert f.returncode == 1, f.stdout + f.stderr
    head, reason = f.stdout.splitlines()[-5:-3]
    assert head == f"job {job_id} (slurm): FAILED, exit 1", f.stdout
    assert reason == "  reason:   RuntimeError: injected fault (JOB_FAULT) on rank 0 at step 2", f.stdout
    s = status_cli(cluster, tmp_path, job_id, SLURM_CONF=str(tmp_path / "no-such-slurm.conf"))
    assert s.returncode == 0 and s.stdout.splitlines()[:2] == [head, reason], s.stdout + s.stderr


def test_bad_input_found_in_the_job_is_exit_2_with_its_line(cluster, tmp_path):
    """A refusal the trainer makes inside the job (here a checkpoint that does not exist) is the contract's exit 2
    with the trainer's one line, not a traceback and exit 1."""
    r = submit_cli(cluster, tmp_path, *TINY, "strategy=balanced", "submit.gpus_per_node=1", "submit.cpus_per_task=1",
                   f"train.resume={tmp_path}/nope.pt", "submit.wait=true")
    assert r.returncode == 2, r.stdout + r.stderr
    job_id = job_id_of(r.stdout)
    err = (tmp_path / "submitit" / job_id / f"{job_id}_0_log.err").read_text()
    # The refusal is one line, and nothing else: no traceback of submitit's either (the task writes its error
    # result itself and exits 2, Slurm's ExitCode too).
    assert f"error: checkpoint {tmp_path}/nope.pt does not exist" in err and "Traceback" not in err, err
    assert "ExitCode=2:0" in cluster.show(job_id)
    assert r.stderr.splitlines()[:2] == [f"job {job_id} (slurm): FAILED, exit 2",
                                        f"  reason:   error: checkpoint {tmp_path}/nope.pt does not exist; give an "
                                        "existing file or train.resume=auto|never"], r.stderr
    assert f"  run:      {tmp_path}/runs/slurm-{job_id}  (never created)" in r.stderr


def test_status_of_pending_and_cancelled_jobs(cluster, tmp_path):
    """A job waiting for the cards another holds is PENDING with Slurm's reason; `scancel` of the running one
    makes the trainer checkpoint and exit 75 (CANCELLED, exit 75, how to resume), of the waiting one (found by
    its own train.run_id): cancelled before it started. With no controller to ask, the first still reads as
    stopped after a checkpoint."""
    args = [*TINY, "strategy=balanced", "train.steps=100000", "submit.gpus_per_node=2", "submit.cpus_per_task=1"]
    running = job_id_of(submit_cli(cluster, tmp_path, *args).stdout)
    waiting = job_id_of(submit_cli(cluster, tmp_path, *args, "train.run_id=my-run").stdout)
    _wait_for_steps(cluster, running, tmp_path / "runs" / f"slurm-{running}", 1)
    # A run id of one's own. Slurm sets a pending job's reason on a scheduling pass (None until then, and status
    # prints no reason line; Priority while the first job was still pending): the test cluster passes every second
    # (slurm/cluster/slurm.conf.in; Slurm's defaults would take up to the backfill interval, 30 s, or sched_interval, 60 s).
    deadline = time.monotonic() + 90
    while True:
        head, reason = status_cli(cluster, tmp_path, "my-run").stdout.splitlines()[:2]
        if reason == "  reason:   Resources" or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert (head, reason) == (f"job {waiting} (slurm): PENDING", "  reason:   Resources"), (head, reason)
    cluster.run("scancel", running, waiting)
    cluster.wait(running, DONE)
    cluster.wait(waiting, DONE)
    for ident, env, state in ((running, {}, "CANCELLED"), (running, {"SLURM_CONF": "/nonexistent"}, "ENDED")):
        head, reason = status_cli(cluster, tmp_path, ident, **env).stdout.splitlines()[:2]
        assert head == f"job {running} (slurm): {state}, exit 75", (head, reason)
        assert re.fullmatch(rf"  reason:   .*stopped at step \d+ after writing a checkpoint.*; resume: resubmit with "
                            rf"train.run_id=slurm-{running}", reason), reason
    head, reason = status_cli(cluster, tmp_path, waiting).stdout.splitlines()[:2]
    assert (head, reason) == (f"job {waiting} (slurm): CANCELLED, exit 1",
                              "  reason:   cancelled (scancel or an admin) before it started"), (head, reason)


def test_status_of_an_unknown_job_is_one_line_exit_2(cluster, tmp_path):
    for ident in ("999999", "slurm-999999", "no-such-run"):
        s = status_cli(cluster, tmp_path, ident)
        assert s.returncode == 2, s.stdout + s.stderr
        assert s.stderr.startswith("error: ") and s.stderr.strip().count("\n") == 0 and not s.stdout, s.stderr
        assert ("no job 999999: " if ident[-1].isdigit() else "`no-such-run` is neither a job id") in s.stderr


# -- the user's own workload (examples/tabular, outside job/) -------------------------------------------------
def test_users_workload_through_make_submit_completes_and_resumes_exactly(cluster, tmp_path):
    """`make submit STRATEGY=balanced WORKLOAD=task:workload ARGS='submit.workdir=examples/tabular ...'`: the
    module is found only through submit.workdir (the tasks' working directory; the submission checks it
    from there too). Interrupted by submitit's preemption path (SIGTERM + SIGUSR2), the job is requeued,
    resumes, and ends COMPLETED with every step logged once and the weights of an uninterrupted run, bit for
    bit; the per-card table is in its log (`make status`)."""
    import torch

    csv = tabular_csv(tmp_path)
    run = [*TABULAR_RUN, f"data.path={csv}"]
    # The uninterrupted reference: the same config as one plain process, one thread like the tasks.
    ref = subprocess.run(job_cmd("train", f"workload={TABULAR}/task.py:workload", "strategy=balanced", *run,
                                 f"train.run_dir={tmp_path}/ref", "train.run_id=ref", "train.log_every=100"),
                         capture_output=True, text=True, cwd=tmp_path, env=cluster.env, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]

    r = make_submit(cluster, tmp_path, *run, "submit.workdir=examples/tabular", "submit.timeout_min=10",
                    "submit.signal_delay_s=30")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = submitted_id(r.stdout)
    assert "balanced/task:workload, 1 node(s) x 1 task(s)" in r.stdout, r.stdout
    assert f"--chdir={TABULAR}" in (tmp_path / "submitit" / job_id / f"{job_id}_submission.sh").read_text()
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    wait_for_steps(cluster, job_id, run_dir, 10)
    submitit.SlurmJob(folder=tmp_path / "submitit" / "%j", job_id=job_id)._interrupt()
    state = cluster.wait(job_id, DONE, timeout=240, what="after the interruption")
    log = (tmp_path / "submitit" / job_id / f"{job_id}_0_log.err").read_text()
    assert state == "COMPLETED" and "Restarts=1" in cluster.show(job_id), log[-3000:]
    resumed = [int(m) for m in re.findall(r"^resumed from \S+ at step (\d+)", log, re.M)]
    assert len(resumed) == 1 and 10 <= resumed[0] < 400, log[-3000:]
    assert metric_steps(run_dir) == list(range(1, 401)), "every step exactly once over the two attempts"
    assert "validation: loss" in log
    got = torch.load(run_dir / "checkpoints" / "step_00000400.pt", weights_only=False)
    want = torch.load(tmp_path / "ref" / "ref" / "checkpoints" / "step_00000400.pt", weights_only=False)
    assert got["model"].keys() == want["model"].keys()
    for k in want["model"]:
        assert torch.equal(got["model"][k], want["model"][k]), f"{k} differs from the uninterrupted run"
    st = subprocess.run(["make", "-s", "-o", ".venv/.stamp-setup", "status", f"JOB={job_id}",
                         f"ARGS=submit.folder={tmp_path}/submitit/%j train.run_dir={tmp_path}/runs"],
                        cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert st.stdout.startswith(f"job {job_id} (slurm): COMPLETED (requeued 1x), exit 0\n"), st.stdout + st.stderr
    assert "    per-card memory: balanced, task:workload, global batch 256, 400 steps" in st.stdout, st.stdout
    assert "    throughput: " in st.stdout and " row/s" in st.stdout, st.stdout


def test_users_workload_missing_in_the_job_is_exit_2_in_one_line(cluster, tmp_path):
    """The submission finds the workload (PYTHONPATH here) but the job's environment does not
    (submit.env.PYTHONPATH replaces it): the task refuses in one line, no traceback, and the job's own exit
    code is the contract's 2 (Slurm's ExitCode=2:0, `submit.wait` exits 2)."""
    csv = tabular_csv(tmp_path, rows=200)
    env = {**cluster.env, "PYTHONPATH": f"{TABULAR}:{cluster.env['PYTHONPATH']}"}
    r = subprocess.run(job_cmd("submit", "strategy=balanced", "workload=task:workload", *TABULAR_RUN,
                               f"data.path={csv}", "submit.env.PYTHONPATH=/nonexistent", "submit.gpus_per_node=1",
                               "submit.cpus_per_task=1", f"submit.folder={tmp_path}/submitit/%j",
                               f"train.run_dir={tmp_path}/runs", "submit.wait=true"),
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    job_id = submitted_id(r.stdout)
    err = (tmp_path / "submitit" / job_id / f"{job_id}_0_log.err").read_text()
    line = "error: workload `task:workload`: no module `task` on the Python path"
    assert err.count(line) == 1 and "Traceback" not in err, err
    assert "ExitCode=2:0" in cluster.show(job_id), cluster.show(job_id)
    assert r.stderr.startswith(f"job {job_id} (slurm): FAILED, exit 2\n  reason:   {line}"), r.stderr
