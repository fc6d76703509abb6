"""job.submit without a cluster: the sbatch text (golden files), up-front validation, the plain sbatch's defaults.

Refresh the golden files after an intended change: UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/infra/test_submit.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, job_cmd

from job import submit
from job.config import load
from job.errors import UsageError

GOLDEN = ROOT / "tests" / "golden"
FOLDER = "/runs/submitit/%j"  # fixed, so the text does not depend on the checkout's path
REFRESH = "UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/infra/test_submit.py"

CASES = {
    "sbatch_default": [],
    "sbatch_dp": ["strategy=dp"],
    "sbatch_ddp_2x4": ["strategy=ddp", "submit.nodes=2", "submit.gpus_per_node=4", "submit.timeout_min=240",
                       "submit.partition=gpu", "submit.account=proj1", "submit.qos=high", "submit.mem_gb=64"],
    "sbatch_ddp_cpu": ["strategy=ddp", "submit.gpus_per_node=0", "submit.tasks_per_node=3"],
    # What the job needs on the nodes: working directory (--chdir), literal env, the user's shell lines.
    "sbatch_user_code": ["strategy=balanced", "submit.workdir=/tmp", "submit.env.PYTHONPATH=/home/me/proj:$HOME",
                         "submit.env.HF_HOME=/scratch/hf cache",
                         'submit.setup=["module load cuda/12.4", "source /home/me/venv/bin/activate"]'],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sbatch_text_matches_golden(name):
    text = submit.sbatch_text(load(CASES[name]), folder=FOLDER, python="python")
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; create it with: {REFRESH}"
    assert text == path.read_text(), f"sbatch text for {CASES[name]} changed; if intended, refresh: {REFRESH}"


def _flags(text: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", text, re.M):
        out[m.group(1)] = m.group(2) or "true"
    return out


def test_sbatch_text_layout():
    """One task per GPU for ddp, one task for single-process strategies; GPUs via --gpus-per-node."""
    ddp = _flags(submit.sbatch_text(load(["strategy=ddp", "submit.gpus_per_node=4", "submit.nodes=3"])))
    assert (ddp["nodes"], ddp["ntasks-per-node"], ddp["gpus-per-node"]) == ("3", "4", "4")
    dp = _flags(submit.sbatch_text(load(["strategy=dp", "submit.gpus_per_node=4"])))
    assert (dp["nodes"], dp["ntasks-per-node"], dp["gpus-per-node"]) == ("1", "1", "4")
    cpu = _flags(submit.sbatch_text(load(["strategy=ddp", "submit.gpus_per_node=0", "submit.tasks_per_node=2"])))
    assert "gpus-per-node" not in cpu and cpu["ntasks-per-node"] == "2"
    assert ddp["signal"] == "USR2@120" and ddp["requeue"] == "true"


def test_plain_sbatch_has_the_same_defaults():
    """slurm/train.sbatch and `python -m job submit` (default config) ask Slurm for the same things."""
    plain = _flags((ROOT / "slurm" / "train.sbatch").read_text())
    generated = _flags(submit.sbatch_text(load([])))
    for key in ("nodes", "gpus-per-node", "ntasks-per-node", "cpus-per-task", "time", "signal", "requeue",
                "open-mode"):
        assert plain.get(key) == generated.get(key), f"--{key}: train.sbatch {plain.get(key)} vs submit {generated.get(key)}"
    cfg = load([])
    assert f"MAX_REQUEUES=${{MAX_REQUEUES:-{cfg.submit.max_requeues}}}" in (ROOT / "slurm/train.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "slurm" / "train.sbatch")]).returncode == 0


BAD = [
    (["submit.nodes=0"], "submit.nodes=0` must be at least 1"),
    (["submit.timeout_min=0"], "submit.timeout_min=0` must be at least 1"),
    (["submit.gpus_per_node=-1"], "submit.gpus_per_node=-1` must not be negative"),
    (["submit.max_requeues=-2"], "submit.max_requeues=-2` must not be negative"),
    (["submit.timeout_min=2", "submit.signal_delay_s=120"], "leaves no run time in submit.timeout_min=2"),
    (["submit.partition=gpu;rm"], "`submit.partition=gpu;rm` is not a Slurm name"),
    (["submit.account=a b"], "`submit.account=a b` is not a Slurm name"),
    (["strategy=dp", "submit.nodes=2"], "strategy=dp runs one process on one node, but submit.nodes=2"),
    (["strategy=dp", "submit.tasks_per_node=2"], "strategy=dp runs one process, but submit.tasks_per_node=2"),
    (["strategy=ddp", "submit.gpus_per_node=4", "submit.tasks_per_node=2"],
     "one process per GPU: submit.tasks_per_node=2 but submit.gpus_per_node=4"),
    (["submit.executor=local", "submit.nodes=2"], "the local executor runs on this machine only"),
    (["submit.workdir=/nonexistent/proj"], "submit.workdir /nonexistent/proj is not a directory here"),
    (["submit.env.1X=a"], "submit.env.1X is not an environment variable name"),
    (['submit.setup=["module load x", "  "]'], "submit.setup[1] is empty or holds a control character"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_parameters_are_one_line_errors(overrides, message):
    with pytest.raises(UsageError) as e:
        submit.plan(load(overrides))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_line_breaks_cannot_reach_the_job_script(tmp_path):
    """A line break in submit.env or submit.setup (from a --config file, where YAML keeps it) would start a
    new shell line in the sbatch script: refused when the config is loaded, and by the script's writer too."""
    for text, key in (('submit:\n  env:\n    X: "a\\nrm -rf /"\n', "submit.env.X"),
                      ('submit:\n  setup: ["module load x\\nrm -rf /"]\n', "submit.setup")):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(UsageError, match=re.escape(f"`{key}` holds a control character")):
            load(["--config", str(tmp_path / "c.yaml")])
    cfg = load([])
    cfg.submit.env = {"X": "a\nrm -rf /"}
    with pytest.raises(UsageError, match=re.escape("submit.env.X holds a control character")):
        submit.sbatch_text(cfg)
    cfg = load([])
    cfg.submit.setup = ["module load x\nrm -rf /"]
    with pytest.raises(UsageError, match=re.escape("submit.setup[0] is empty or holds")):
        submit.sbatch_text(cfg)


def test_bad_parameter_from_the_cli_exits_2_before_submitting(tmp_path):
    r = subprocess.run(job_cmd("submit", "strategy=dp", "submit.nodes=2", f"submit.folder={tmp_path}/%j"),
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: strategy=dp runs one process")
    assert "Traceback" not in r.stderr
    assert not any(tmp_path.iterdir()), "nothing may be written before validation passes"


def test_unknown_submit_key_names_the_fix():
    with pytest.raises(UsageError, match="unknown key `submit.gpus`"):
        load(["submit.gpus=2"])


def test_submitit_checks_the_parameters_too():
    """What reaches submitit is also checked by submitit's own sbatch generator."""
    cfg = load([])
    params = submit.slurm_parameters(cfg, submit.plan(cfg, script_only=True))
    from submitit.slurm.slurm import _get_default_parameters

    assert set(params) <= set(_get_default_parameters()), "every key must be a submitit SlurmExecutor parameter"


def test_slurm_executor_writes_the_same_text(tmp_path):
    """The golden text is what submitit's SlurmExecutor really submits (needs srun on PATH)."""
    if shutil.which("srun") is None:
        pytest.skip("srun not installed (SlurmExecutor refuses to start without it)")
    cfg = load(["strategy=ddp", "submit.gpus_per_node=2", f"submit.folder={tmp_path}/%j"])
    p = submit.plan(cfg, script_only=True)
    ex = submit.make_executor(cfg, submit.Plan("slurm", p.nodes, p.tasks_per_node, p.multi_process, p.folder))
    command = ex._submitit_command_str
    assert ex._make_submission_file_text(command, "uid") == submit.sbatch_text(cfg)


def test_job_argv_is_absolute_and_drops_submit_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text("train:\n  steps: 7\n")
    argv = ["--config", "my.yaml", "strategy=dp", "train.steps=9", "submit.nodes=1", "train.run_dir=out"]
    cfg = load(argv)
    out = submit.job_argv(argv, cfg)
    assert out[:2] == ["--config", str(tmp_path / "my.yaml")]
    assert "submit.nodes=1" not in out and f"train.run_dir={tmp_path / 'out'}" in out
    assert load(out).train.steps == 9


def test_job_argv_makes_the_checked_paths_absolute(tmp_path, monkeypatch):
    """What the submission checked (data files, a workload file) is what the tasks read, from any working
    directory (submit.workdir): relative paths become absolute."""
    code = tmp_path / "proj"
    code.mkdir()
    (code / "task.py").write_text((ROOT / "examples" / "tabular" / "task.py").read_text())
    (tmp_path / "rows.csv").write_text("f0,f1,f2,f3,f4,f5,f6,f7,label\n" + "0,0,0,0,0,0,0,0,1\n" * 8)
    monkeypatch.chdir(tmp_path)
    argv = ["workload=proj/task.py:workload", "data.kind=csv", "data.path=rows.csv", "data.val_path=rows.csv",
            "strategy=balanced", "submit.workdir=proj"]
    out = submit.job_argv(argv, load(argv))
    assert f"data.path={tmp_path / 'rows.csv'}" in out and f"data.val_path={tmp_path / 'rows.csv'}" in out
    assert f"workload.name={code / 'task.py'}:workload" in out and not any(a.startswith("submit.") for a in out)
    monkeypatch.chdir(code)  # the task's working directory
    cfg = load(out)
    assert (cfg.workload.name, cfg.data.path) == (f"{code / 'task.py'}:workload", str(tmp_path / "rows.csv"))


def test_dry_run_prints_the_script_without_slurm(tmp_path):
    """`submit.dry_run=true submit.executor=local`: the text, no cluster needed, nothing submitted."""
    r = subprocess.run(job_cmd("submit", "submit.dry_run=true", "submit.executor=local",
                               f"submit.folder={tmp_path}/%j"),
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/bin/bash") and f"--output={tmp_path}/%j/%j_0_log.out" in r.stdout
    assert sys.executable in r.stdout
    assert not any(tmp_path.iterdir())


def test_slurm_executor_without_slurm_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UsageError, match="sbatch/srun are not on PATH"):
        submit.plan(load(["submit.executor=slurm"]))
    assert submit.plan(load(["submit.executor=auto"])).executor == "local"


def test_status_does_not_ask_scontrol_when_slurm_conf_names_no_file(tmp_path, monkeypatch):
    """A SLURM_CONF that names no file (a cluster torn down): scontrol would retry it for 60 s, so status does not
    call it and reads the job's folder alone; with the file there, it asks."""
    from job import status

    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "gone.conf"))
    assert status._scontrol("123") is None and not calls.exists()
    (tmp_path / "gone.conf").write_text("ClusterName=x\n")
    assert status._scontrol("123") is None and calls.read_text() == "show job -o 123\n"


def test_signal_is_submitits_preemption_signal():
    """The requeue path keys on the signal submitit asks Slurm for (--signal=USR2@...)."""
    import signal

    assert submit._usr_sig() == signal.SIGUSR2
    assert "--signal=USR2@" in submit.sbatch_text(load([]))


def test_requeues_are_bounded_and_keep_the_run_id():
    """TrainJob.checkpoint (called by submitit on rank 0) counts requeues; at the bound it returns None,
    which submitit turns into "not requeued" and the job's error result."""
    import pickle

    fn = submit.TrainJob(["train.steps=5"], run_id="slurm-7", multi_process=True, max_requeues=2)
    for n in (1, 2):
        delayed = fn.checkpoint()
        assert delayed is not None and delayed.function is fn and fn.requeues == n
    assert fn.checkpoint() is None and fn.requeues == 2
    again = pickle.loads(pickle.dumps(fn))  # what the requeued job unpickles
    assert (again.run_id, again.requeues, again.argv) == ("slurm-7", 2, ["train.steps=5"])


def test_signals_seen_records_every_handled_signal():
    """submitit's preemption sends SIGTERM then SIGUSR2; the requeue decision must see the SIGUSR2 even when the
    trainer reports the SIGTERM that stopped it first."""
    import signal
    import time

    got = []
    old = {s: signal.signal(s, lambda n, _f: got.append(n)) for s in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        with submit._SignalsSeen() as seen:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.05)
        with submit._SignalsSeen() as quiet:
            pass
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert got == [signal.SIGTERM, signal.SIGUSR2]
    assert seen.signals == {signal.SIGTERM, signal.SIGUSR2} and quiet.signals == set()
    assert signal.set_wakeup_fd(-1) == -1, "the previous wakeup fd is restored"


def test_late_sigusr2_after_a_sigterm_stop_still_reaches_submitits_handler(monkeypatch):
    """The trainer may stop on submitit's SIGTERM before its SIGUSR2 arrives: the attempt waits
    USR2_GRACE_S for it, and submitit's (restored) handler takes it; without one it ends with exit 75."""
    import signal
    import threading
    import types

    monkeypatch.setattr(submit, "USR2_GRACE_S", 1.0)
    fn = submit.TrainJob([], run_id="r", multi_process=False, max_requeues=1)
    env = types.SimpleNamespace(global_rank=0)
    calls = []
    old = signal.signal(signal.SIGUSR2, lambda n, _f: calls.append(n))
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        with pytest.raises(SystemExit) as e:
            fn._stopped(env, requeue=False)
        assert e.value.code == 75 and calls == [signal.SIGUSR2]
        with pytest.raises(SystemExit):  # nothing arrives: still ends as interrupted, after the grace time
            fn._stopped(env, requeue=False)
        assert calls == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_status_refuses_bad_arguments_in_one_line(tmp_path):
    """`python -m job status` without a cluster: no id, two ids, an unknown option, an id with no folder."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    for args, message in ((["1", "2"], "error: give one job id or run id (2 given); usage: python -m job status"),
                          (["1", "--x"], "error: unexpected argument `--x`"),
                          (["4242", f"submit.folder={tmp_path}/%j"],
                           f"error: no job 4242: no submitit folder {tmp_path}/4242 and Slurm does not know it")):
        r = subprocess.run(job_cmd("status", *args), capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith(message), (args, r.stderr)
        assert r.stderr.strip().count("\n") == 0 and not r.stdout, r.stderr
