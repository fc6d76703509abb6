"""`python -m job status JOB_ID|RUN_ID [--follow] [key=value ...]`: how a submitted job stands, or how it ended.

Without slurmdbd, `sacct` has nothing to say and `squeue -j ID` shows an empty table once the controller
forgets a finished job (MinJobAge, 300 s by default), so the outcome is read from what is really there:

1. `scontrol show job ID` while the controller still knows the job: its state, exit code, restarts, reason;
2. submitit's job folder (`submit.folder`, `%j` = the job id): every task's result pickle (success, or the
   error it raised: the trainer's exit code and one line), and the tasks' stdout/stderr logs, where the
   trainer's `error: ...` line and the per-card table are;
3. the record `python -m job submit` leaves next to them (`trainjob.json`: executor, run id, run directory),
   which is how a run id (`RUN=`) finds its job. A local job (`submit.executor=local`) is its process id.

Output: one line `job ID (executor): STATE, exit N`, then the reason of a failure (one line) and where the
run directory, the logs and the per-card table are. Exit code: 0 when the command could answer (any job
state), 2 for an id it cannot find; with `--follow` it prints the task-0 logs as they grow, waits until the
job ends and exits with the job's exit code (the trainer's: 0 done, 2 bad input, 75 stopped after a
checkpoint, 1 crashed; a job that ended without a result and without a checkpoint: Slurm's exit code, 128 + the
signal for a kill, or 1).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from job.errors import EXIT_INTERRUPTED, EXIT_OK, UsageError

RECORD = "trainjob.json"
# Slurm states after which the job does not run again by itself.
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "SPECIAL_EXIT"}
_RUN_ID = re.compile(r"^(slurm|local)-(\d+)$")
_TRAINER_CODE = re.compile(r"trainer exited with code (\d+)")
USAGE = ("usage: python -m job status JOB_ID|RUN_ID [--follow] [--config FILE] [submit.folder=...] [train.run_dir=...]  "
         "(make status JOB=ID | RUN=RUN_ID [FOLLOW=1])")


@dataclass
class Job:
    """Where a submitted job's files are."""

    job_id: str
    executor: str  # slurm | local
    folder: Path  # submitit's folder for this job (%j filled in)
    tasks: int = 1
    run_id: str = ""
    run_dir: Path | None = None

    def paths(self, task: int = 0):
        from submitit.core.utils import JobPaths

        return JobPaths(self.folder, job_id=self.job_id, task_id=task)


@dataclass
class Status:
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, REQUEUED, PREEMPTED, ..., UNKNOWN
    exit_code: int | None = None  # the job's (the trainer's where it is known); None while it runs
    reason: str = ""  # one line: why it failed, or why it waits
    restarts: int = 0
    final: bool = False


# -- finding the job ------------------------------------------------------------------------------
def write_record(job, *, executor: str, tasks: int, run_id: str, run_dir: Path) -> None:
    """What `status` needs later, next to submitit's own files (called by `python -m job submit`)."""
    folder = Path(job.paths.folder)
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"job_id": str(job.job_id), "executor": executor, "tasks": tasks, "run_id": run_id,
           "run_dir": str(run_dir), "submitted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    from job.rundir import write_atomic

    write_atomic(folder / RECORD, json.dumps(doc, indent=2) + "\n")  # 0600, never through a link


def _job_folder(template: Path, job_id: str) -> Path:
    return Path(str(template).replace("%j", job_id))


def _from_record(folder: Path) -> Job | None:
    try:
        doc = json.loads((folder / RECORD).read_text())
        return Job(str(doc["job_id"]), doc.get("executor", "slurm"), folder, int(doc.get("tasks", 1)),
                   doc.get("run_id", ""), Path(doc["run_dir"]) if doc.get("run_dir") else None)
    except (OSError, ValueError, KeyError, TypeError):  # none, or not ours: fall back to submitit's files
        return None


def locate(ident: str, cfg) -> Job:
    """The job a job id or a run id names; UsageError (exit 2) if nothing here or in Slurm knows it."""
    template = Path(cfg.submit.folder).expanduser().absolute()
    run_root = Path(cfg.train.run_dir).expanduser().absolute()
    m = _RUN_ID.match(ident)
    job_id = m.group(2) if m else ident if ident.isdigit() else ""
    if job_id:
        folder = _job_folder(template, job_id)
        job = _from_record(folder)
        if job is not None:
            return job
        # Submitted before the record existed, or by submitit directly: submitit's own files.
        if (folder / f"{job_id}_submitted.pkl").exists():
            executor = m.group(1) if m else ("slurm" if _scontrol(job_id) is not None or not _pid_here(job_id) else "local")
            return Job(job_id, executor, folder, _count_tasks(folder, job_id), f"{executor}-{job_id}",
                       run_root / f"{executor}-{job_id}")
        ctl = _scontrol(job_id)
        if ctl is not None:
            raise UsageError(f"Slurm knows job {job_id} ({ctl.get('JobState', '?')}, exit {ctl.get('ExitCode', '?')}, "
                             f"log {ctl.get('StdOut', '?')}) but there is no submitit folder {folder}: submitted with "
                             f"another submit.folder=... (give it), or not by `python -m job submit` (plain sbatch)")
        raise UsageError(f"no job {job_id}: no submitit folder {folder} and Slurm does not know it; check the id "
                         f"(`make submit` printed it) or give the folder it was submitted with: submit.folder=...")
    # A run id of one's own (train.run_id=...): the records under the submitit folder name it.
    if "%j" in str(template):
        pattern = str(template.relative_to(template.anchor)).replace("%j", "*")
        for record in sorted(Path(template.anchor).glob(f"{pattern}/{RECORD}")):
            job = _from_record(record.parent)
            if job is not None and job.run_id == ident:
                return job
    if (run_root / ident).is_dir():
        raise UsageError(f"run {ident} exists in {run_root} but no submitted job under {template} names it "
                         f"(a `python -m job train` run, or submitted with another submit.folder=...)")
    raise UsageError(f"`{ident}` is neither a job id nor a run id of a submitted job (looked in {template} and "
                     f"{run_root}); use the id `make submit` printed")


def _pid_here(pid: str) -> bool:
    return Path(f"/proc/{pid}").exists()


def _slurm_here() -> bool:
    from shutil import which

    return which("scontrol") is not None


def _count_tasks(folder: Path, job_id: str) -> int:
    tasks = {p.name.split("_")[1] for p in folder.glob(f"{job_id}_*_log.*")}
    return max(1, len(tasks))


# -- asking Slurm ---------------------------------------------------------------------------------
def _scontrol(job_id: str) -> dict | None:
    """`scontrol show job -o ID` as a dict; None when the controller does not know the job (or is not here).

    A SLURM_CONF that names no file (a cluster torn down, a shell's stale variable) is no controller to ask:
    scontrol would retry the file for 60 s before failing, and every `status` would wait out the timeout."""
    conf = os.environ.get("SLURM_CONF")
    if not _slurm_here() or (conf and not os.path.exists(conf)):
        return None
    try:
        r = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or "JobState=" not in r.stdout:
        return None
    line = r.stdout.strip().splitlines()[0]
    # Values run to the next ` Key=`; some (Reason, Command) may hold spaces.
    out = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z:/_]+)=(.*?)(?=\s[A-Za-z:/_]+=|$)", line):
        out[m.group(1)] = m.group(2)
    return out


def _slurm_exit(ctl: dict) -> int | None:
    """`ExitCode=a:b`: a, or 128 + b for a job killed by signal b."""
    m = re.match(r"(\d+):(\d+)", ctl.get("ExitCode", ""))
    if not m:
        return None
    code, sig = int(m.group(1)), int(m.group(2))
    return 128 + sig if sig else code


# -- reading the outcome --------------------------------------------------------------------------
class _PlainUnpickler(pickle.Unpickler):
    """submitit's result is `("success", dict)` or `("error", traceback text)`: tuples, dicts, strings and
    numbers, none of which needs a global. Any global (how a planted pickle calls code) is refused unread."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"holds a reference to {module}.{name}, not plain data: not read")


def _foreign(path: Path) -> str:
    """Why a result file may not be this user's job's (another user could have written it), or ''."""
    import stat

    for p, what in ((path, "it"), (path.parent, "its folder")):
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            return f"{what} is a symlink"
        if st.st_uid != os.geteuid():
            return f"{what} belongs to uid {st.st_uid}, not to this user"
        if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getegid()):
            return f"{what} can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _results(job: Job) -> list[tuple[str, object] | None]:
    """Every task's submitit result, read as plain data only and only from files this user's job wrote
    (docs/security.md): a result pickle is not unpickled with code, nor trusted when someone else could
    have planted it."""
    out = []
    for t in range(job.tasks):
        path = job.paths(t).result_pickle
        try:
            why = _foreign(path)
            if why:
                out.append(("unreadable", f"{path} was not read: {why}"))
                continue
            with open(path, "rb") as f:
                result = _PlainUnpickler(f).load()
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], str)):
                raise pickle.UnpicklingError("not a submitit result")
            out.append(result)
        except FileNotFoundError:
            out.append(None)
        except Exception as e:  # half-written or unreadable: not an outcome yet
            out.append(("unreadable", f"{path}: {type(e).__name__}: {e}"))
    return out


def error_line(job: Job) -> str:
    """The last `error: ...` line any task logged (the trainer's one-line reason), else ''."""
    best = ""
    for t in range(job.tasks):
        for path in (job.paths(t).stderr, job.paths(t).stdout):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for line in text.splitlines():
                line = line.strip()
                if re.match(r"^(\[rank\d+\] )?error: ", line):
                    best = line
    return best


def stopped_step(job: Job) -> int | None:
    """The step at which the trainer's last attempt stopped after a checkpoint (exit 75), from task 0's log."""
    try:
        text = job.paths(0).stderr.read_text(errors="replace")
    except OSError:
        return None
    # Only the last attempt counts: a requeued job logs one start line per attempt.
    last = text.rsplit("submitit JobEnvironment(", 1)[-1]
    found = re.findall(r"^stopped at step (\d+); checkpoint written; exit 75$", last, re.M)
    return int(found[-1]) if found else None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _alive(pid: str) -> bool:
    try:
        cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
        state = Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return False
    return b"submitit" in cmdline and state not in ("Z", "X")


def status(job: Job) -> Status:
    results = _results(job)
    ctl = _scontrol(job.job_id) if job.executor == "slurm" else None
    restarts = int(ctl.get("Restarts", "0") or 0) if ctl else 0
    ctl_state = ctl.get("JobState", "") if ctl else ""
    done = all(r is not None and r[0] in ("success", "error") for r in results)
    errors = [r[1] for r in results if r is not None and r[0] == "error"]

    if errors:  # a task raised: the trainer's exit code and its one line
        text = str(errors[0])
        m = _TRAINER_CODE.search(text)
        if m:
            code = int(m.group(1))
        elif "Job not requeued because" in text:  # out of requeues: the trainer checkpointed and stopped
            code = EXIT_INTERRUPTED
        else:
            code = 1
        reason = error_line(job) or _last_line(text)
        if "Job not requeued because" in text:
            reason = _last_line(text) + (f"; the checkpoint is kept: resubmit with train.run_id={job.run_id}"
                                         if job.run_id else "")
        state = ctl_state if ctl_state in FINAL else "FAILED"
        return Status(state, code, reason, restarts, final=ctl_state in FINAL or not ctl_state)
    if done:
        state = ctl_state if ctl_state in FINAL else "COMPLETED"
        return Status(state, EXIT_OK, "", restarts, final=ctl_state in FINAL or not ctl_state)

    if job.executor == "local":
        if _alive(job.job_id):
            return Status("RUNNING", reason=f"local process {job.job_id}")
        return Status("ENDED", 1, error_line(job) or "the local job's process is gone and no task wrote a "
                      "result (killed?)", final=True)

    if ctl is None:
        if not _slurm_here():
            return Status("UNKNOWN", None, "Slurm's scontrol is not on PATH and no task wrote a result yet",
                          final=False)
        started = any(job.paths(t).stderr.exists() for t in range(job.tasks))
        stopped = stopped_step(job)
        if stopped is not None:
            resume = f"; resume: resubmit with train.run_id={job.run_id}" if job.run_id else ""
            return Status("ENDED", EXIT_INTERRUPTED, f"stopped at step {stopped} after writing a checkpoint "
                          f"(cancelled or preempted; the controller no longer knows the job){resume}", final=True)
        reason = error_line(job) or ("the controller no longer knows the job and no task wrote a result: it "
                                     "was cancelled or killed" if started else
                                     "Slurm does not know the job (another cluster? check SLURM_CONF)")
        return Status("ENDED" if started else "UNKNOWN", 1 if started else None, reason, final=started)

    if ctl_state in FINAL:  # ended without a result: cancelled, timed out, node failure, killed
        started = any(job.paths(t).stderr.exists() for t in range(job.tasks))
        stopped = stopped_step(job)
        what = {"CANCELLED": "cancelled (scancel or an admin)", "TIMEOUT": "hit its time limit",
                "NODE_FAIL": "its node failed", "OUT_OF_MEMORY": "killed for host memory (Slurm's limit)"}.get(
                    ctl_state, f"ended {ctl_state}")
        if stopped is not None:  # the trainer finished its step and wrote a checkpoint: the contract's 75
            resume = f"; resume: resubmit with train.run_id={job.run_id}" if job.run_id else ""
            return Status(ctl_state, EXIT_INTERRUPTED, f"{what}; stopped at step {stopped} after writing a "
                          f"checkpoint{resume}", restarts, final=True)
        if not started:
            return Status(ctl_state, 1, f"{what} before it started", restarts, final=True)
        code = _slurm_exit(ctl)
        reason = error_line(job) or f"{what}; no task wrote a result"
        return Status(ctl_state, code if code else 1, reason, restarts, final=True)
    # PENDING, RUNNING, COMPLETING, REQUEUED, PREEMPTED (requeued), SUSPENDED...; COMPLETING with results
    # still being written is caught above once every task's pickle is there.
    reason = ctl.get("Reason", "")
    return Status(ctl_state or "UNKNOWN", None, "" if reason in ("", "None") else reason, restarts)


# -- printing -------------------------------------------------------------------------------------
def describe(job: Job, st: Status) -> list[str]:
    head = f"job {job.job_id} ({job.executor}): {st.state}"
    if st.restarts:
        head += f" (requeued {st.restarts}x)"
    if st.exit_code is not None:
        head += f", exit {st.exit_code}"
    lines = [head]
    if st.reason:
        lines.append(f"  reason:   {st.reason}")
    p = job.paths(0)
    if job.run_dir is not None:
        summary = job.run_dir / "summary.json"
        note = ("  (summary.json: per-card peaks)" if summary.exists() else
                "" if job.run_dir.exists() else "  (not created yet)" if not st.final else "  (never created)")
        lines.append(f"  run:      {job.run_dir}{note}")
    lines.append(f"  log:      {p.stdout}" + (f"  (+ {job.tasks - 1} more task(s) in {job.folder})" if job.tasks > 1
                                              else ""))
    lines.append(f"  errors:   {p.stderr}")
    table = per_card_table(job)
    if table:
        lines.append(f"  per-card table: {p.stdout}, line {table[0]}:")
        lines += [f"    {ln}" for ln in table[1]]
    elif st.final and st.exit_code == EXIT_OK:
        lines.append(f"  per-card table: not found in {p.stdout}")
    return lines


def per_card_table(job: Job) -> tuple[int, list[str]] | None:
    """(line number, lines) of the last per-card table the trainer printed to task 0's stdout."""
    try:
        lines = job.paths(0).stdout.read_text(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, ln in enumerate(lines) if ln.startswith("per-card memory:")]
    if not starts:
        return None
    i = starts[-1]
    end = next((j for j in range(i, len(lines)) if lines[j].startswith("throughput:")), min(i + 20, len(lines) - 1))
    return i + 1, lines[i:end + 1]


def follow(job: Job, *, poll_s: float = 2.0, out=sys.stdout, final_wait_s: float = 10.0) -> Status:
    """Print task 0's logs as they grow until the job ends; the final status."""
    p = job.paths(0)
    offsets = {p.stderr: 0, p.stdout: 0}
    ended_since = None
    while True:
        _print_new(offsets, out)
        st = status(job)
        if st.final:
            # Slurm may report the end a moment before the last task's result pickle lands (or vice versa).
            if _results_complete(job):
                break
            ended_since = ended_since or time.monotonic()
            if time.monotonic() - ended_since > final_wait_s:
                break
        time.sleep(poll_s)
    _print_new(offsets, out)
    return status(job)


def _results_complete(job: Job) -> bool:
    return all(r is not None for r in _results(job))


def _print_new(offsets: dict, out) -> None:
    for path, pos in offsets.items():
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(pos)
                chunk = f.read()
                offsets[path] = f.tell()
        except FileNotFoundError:
            continue
        if chunk:
            out.write(chunk)
            out.flush()


def follow_command(job_id: str, folder_template: Path) -> str:
    """The exact command that follows a job, as `python -m job submit` prints it."""
    py = sys.executable
    try:
        rel = os.path.relpath(py)
        if not rel.startswith(".."):
            py = rel if "/" in rel else f"./{rel}"
    except ValueError:
        pass
    cmd = [py, "-m", "job", "status", str(job_id), "--follow"]
    default = Path("runs/submitit/%j").absolute()
    if Path(folder_template) != default:
        cmd.append(f"submit.folder={folder_template}")
    return shlex.join(cmd)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(USAGE)
        return EXIT_OK
    from job.config import load

    follow_mode = "--follow" in argv
    rest = [a for a in argv if a != "--follow"]
    # The id: the one word that is neither an option, nor --config's file, nor a key=value override.
    at = [i for i, a in enumerate(rest) if "=" not in a and not a.startswith("-") and (i == 0 or rest[i - 1] != "--config")]
    if len(at) != 1:
        raise UsageError(f"give one job id or run id ({len(at)} given); {USAGE}")
    idents = [rest.pop(at[0])]
    cfg = load(rest)  # --config FILE and overrides, as the job was submitted (submit.folder, train.run_dir)
    job = locate(idents[0], cfg)
    if follow_mode:
        st = follow(job)
    else:
        st = status(job)
    for line in describe(job, st):
        print(line)
    if not follow_mode:
        return EXIT_OK
    return st.exit_code if st.exit_code is not None else 1
