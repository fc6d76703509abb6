"""`python -m job submit`: the trainer as a Slurm job through submitit, or a local job without Slurm.

Layout. A multi-process strategy (ddp) runs one task per GPU (`submit.tasks_per_node` overrides) on
`submit.nodes` nodes; each task joins the group from submitit's `TorchDistributedEnvironment`. A
single-process strategy (dp, balanced) runs one task on one node that drives every granted card. The card
list Slurm grants reaches the trainer as CUDA_VISIBLE_DEVICES, untouched.

Validation happens before anything is submitted: our own range checks, submitit's own check of the sbatch
parameters, then `sbatch --test-only` (the cluster's verdict on partition, account, QOS, GPUs, time).

Preemption and time limits. sbatch asks for SIGUSR2 `submit.signal_delay_s` before the limit; submitit's
preemption path sends SIGTERM + SIGUSR2. submitit installs its SIGUSR2 handler (checkpoint + requeue) before
calling `TrainJob`, but the trainer installs its own while it trains, so the signal only sets a stop flag:
every rank finishes the step it is in, rank 0 writes the checkpoint, and `train.run` returns 75 with
submitit's handlers restored. Then, and only if SIGUSR2 was among the signals, rank 0 runs submitit's
handler itself: `TrainJob.checkpoint` (bounded by `submit.max_requeues`), `scontrol requeue`, exit. The
requeued job keeps its job id, so `train.run_id=slurm-<job id>` is stable and `train.resume=auto` continues
from the checkpoint. Any other stop (scancel, an admin's `scontrol requeue`: SIGTERM) checkpoints and ends the
attempt; Slurm decides whether the job runs again. An interrupted attempt leaves no result file, so a waiting
client never reads it as the job's outcome. docs/slurm.md has the details and the tests.

Following a job and reading its outcome afterwards (`python -m job status`, `submit.wait=true`): job/status.py.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import submitit
from submitit.helpers import Checkpointable

from job.config import load, split_args
from job.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, PeerUsageError, UsageError

log = logging.getLogger("job")
# sbatch lines for every job: device order before CUDA starts (docs/design.md: device identity).
SETUP = ["export CUDA_DEVICE_ORDER=PCI_BUS_ID"]
_NAME = re.compile(r"^[A-Za-z0-9_.+-]*$")
# After a stop without SIGUSR2: how long to wait for the SIGUSR2 that submitit's preemption sends after SIGTERM.
USR2_GRACE_S = 3.0


@dataclass(frozen=True)
class Plan:
    """What will be asked of the scheduler, derived and checked once."""

    executor: str  # slurm | local
    nodes: int
    tasks_per_node: int
    multi_process: bool
    folder: Path  # absolute; may contain %j
    workdir: Path | None = None  # the tasks' working directory (absolute); None: where you submit


def _multi_process(strategy: str) -> bool:
    from job.strategies import REGISTRY

    return bool(getattr(REGISTRY[strategy], "multi_process", False))


def plan(cfg, *, script_only: bool = False) -> Plan:
    """Check the submit section against the strategy; UsageError names the fix.

    `script_only`: plan the sbatch script (executor slurm) whether or not Slurm is on this machine.
    """
    s = cfg.submit
    for key in ("nodes", "timeout_min", "cpus_per_task"):
        if s[key] < 1:
            raise UsageError(f"`submit.{key}={s[key]}` must be at least 1")
    for key in ("gpus_per_node", "tasks_per_node", "mem_gb", "max_requeues", "signal_delay_s"):
        if s[key] < 0:
            raise UsageError(f"`submit.{key}={s[key]}` must not be negative")
    if s.signal_delay_s >= s.timeout_min * 60:
        raise UsageError(
            f"submit.signal_delay_s={s.signal_delay_s} leaves no run time in submit.timeout_min={s.timeout_min} "
            f"(= {s.timeout_min * 60} s); lower the delay or raise the time limit"
        )
    for key in ("partition", "account", "qos"):
        if not _NAME.match(s[key]):
            raise UsageError(f"`submit.{key}={s[key]}` is not a Slurm name; use letters, digits and _.+-")
    if not s.folder:
        raise UsageError("submit.folder is empty; give a folder for submitit's pickles and logs")

    multi = _multi_process(cfg.strategy.name)
    if not multi:
        if s.nodes > 1:
            raise UsageError(
                f"strategy={cfg.strategy.name} runs one process on one node, but submit.nodes={s.nodes}; "
                "use submit.nodes=1 or strategy=ddp"
            )
        if s.tasks_per_node > 1:
            raise UsageError(
                f"strategy={cfg.strategy.name} runs one process, but submit.tasks_per_node={s.tasks_per_node}; "
                "use submit.tasks_per_node=0 or strategy=ddp"
            )
    tasks = (s.tasks_per_node or max(1, s.gpus_per_node)) if multi else 1
    if multi and s.gpus_per_node and tasks != s.gpus_per_node:
        raise UsageError(
            f"strategy={cfg.strategy.name} runs one process per GPU: submit.tasks_per_node={tasks} but "
            f"submit.gpus_per_node={s.gpus_per_node}; set them equal (or tasks_per_node=0)"
        )

    executor = "slurm" if script_only else s.executor
    if executor == "auto" or (executor == "slurm" and not script_only):
        has_slurm = shutil.which("sbatch") is not None and shutil.which("srun") is not None
        if executor == "auto":
            executor = "slurm" if has_slurm else "local"
        elif not has_slurm:
            raise UsageError("submit.executor=slurm but sbatch/srun are not on PATH; install the Slurm client "
                             "or use submit.executor=local")
    if executor == "local" and s.nodes > 1:
        raise UsageError(f"the local executor runs on this machine only, but submit.nodes={s.nodes}; "
                         "use submit.nodes=1 or submit.executor=slurm")
    job_setup(s)  # refused here, before anything is written
    return Plan(executor, s.nodes, tasks, multi, Path(s.folder).expanduser().absolute(), _workdir(s))


# -- what the job needs on the nodes: working directory, environment, setup lines --------------------
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _workdir(s) -> Path | None:
    """submit.workdir made absolute; it must exist here (the nodes are expected to see the same path)."""
    if not s.workdir:
        return None
    path = Path(s.workdir).expanduser().absolute()
    if not path.is_dir():
        raise UsageError(f"submit.workdir {s.workdir} is not a directory here (working directory {os.getcwd()}); "
                         "give the folder the tasks should run in, on a filesystem the nodes share")
    return path


def job_setup(s) -> list[str]:
    """The job script's lines for submit.env (literal values) and submit.setup (shell, one line each)."""
    lines = []
    for key, value in s.env.items():
        if not _ENV_NAME.match(str(key)):
            raise UsageError(f"submit.env.{key} is not an environment variable name; use letters, digits and _, "
                             "not starting with a digit")
        if _control(str(value)):
            raise UsageError(f"submit.env.{key} holds a control character (a line break?); give a one-line value")
        lines.append(f"export {key}={shlex.quote(str(value))}")
    for i, line in enumerate(s.setup):
        if _control(line) or not line.strip():
            raise UsageError(f"submit.setup[{i}] is empty or holds a control character (a line break?); give one "
                             "shell line per list entry")
        lines.append(line)
    return lines


def _control(text: str) -> bool:
    return any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in text)


def slurm_parameters(cfg, p: Plan) -> dict:
    """submitit SlurmExecutor parameters (sbatch option names) for this config."""
    from job.workload import short_name

    s = cfg.submit
    params: dict = {
        "job_name": f"job-{cfg.strategy.name}-{short_name(cfg.workload.name)}",
        "time": s.timeout_min,
        "nodes": p.nodes,
        "ntasks_per_node": p.tasks_per_node,
        "cpus_per_task": s.cpus_per_task,
        "signal_delay_s": s.signal_delay_s,
        "setup": [*SETUP, *job_setup(s)],
        # Requeue works even where the cluster's JobRequeue default is 0.
        "additional_parameters": {"requeue": True, **({"chdir": str(p.workdir)} if p.workdir else {})},
        # One rank failing ends the step: 10 s after the first task ends, srun kills the rest (a rank stuck in
        # a collective with a dead peer). Not --kill-on-bad-exit: ranks exiting 75 after a checkpoint, a few
        # milliseconds apart, would be killed and the exit code lost (docs/failures.md).
        "srun_args": ["--wait=10"],
    }
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    if s.mem_gb:
        params["mem"] = f"{s.mem_gb}GB"
    for key in ("partition", "account", "qos"):
        if s[key]:
            params[key] = s[key]
    return params


def submitit_command(folder: Path | str, python: str | None = None) -> str:
    """What each task runs: the same line submitit's executors build."""
    python = shlex.quote(sys.executable) if python is None else python
    return f"{python} -u -m submitit.core._submit {shlex.quote(str(folder))}"


def sbatch_text(cfg, *, folder: Path | str | None = None, python: str | None = None) -> str:
    """The sbatch script submitit will submit for `cfg` (what `submit.dry_run=true` prints)."""
    from submitit.slurm.slurm import _make_sbatch_string  # submitit's own generator and check

    p = plan(cfg, script_only=True)
    folder = p.folder if folder is None else folder
    params = slurm_parameters(cfg, p)
    _check_script_values({"folder": str(folder), "python": python or sys.executable, **params})
    try:
        return _make_sbatch_string(command=submitit_command(folder, python), folder=folder, **params)
    except (ValueError, TypeError) as e:
        raise UsageError(f"submitit rejects the Slurm parameters: {_first_line(e)}") from None


def _check_script_values(values: dict) -> None:
    """Nothing that goes into the sbatch script holds a line break or another control character (config keys
    are checked when loaded; this also covers what comes from the environment: the Python path, the cwd)."""
    from job.config import _CONTROL

    def walk(name, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{name}.{k}", x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(name, x)
        elif isinstance(v, str) and (m := _CONTROL.search(v)):
            raise UsageError(f"the sbatch script's {name} holds a control character ({m.group()!r} in {v[:60]!r}), "
                             "which would add lines of its own to the script; remove it")

    for k, v in values.items():
        walk(k, v)


def check_with_slurm(text: str) -> None:
    """Slurm's verdict on the request without submitting it (`sbatch --test-only`); UsageError if refused."""
    r = subprocess.run(["sbatch", "--test-only"], input=text, capture_output=True, text=True, timeout=60)
    if r.returncode == 0:
        return
    lines = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
    msg = lines[-1] if lines else f"sbatch --test-only exited {r.returncode}"
    for prefix in ("sbatch: error: ", "sbatch: fatal: "):
        msg = msg.removeprefix(prefix)
    if any(k in " ".join(lines) for k in ("configuration source", "Unable to contact slurm controller")):
        raise UsageError(f"no Slurm controller answers ({msg}); start one (make slurm-up, then export the "
                         "SLURM_CONF it prints) or use submit.executor=local")
    raise UsageError(f"Slurm refuses the job: {msg}; fix submit.* (partition, account, qos, gpus, time)")


# -- the callable every task runs -------------------------------------------------------------------
class TrainJob(Checkpointable):
    """`python -m job train <argv>` inside a submitit task; requeued on SIGUSR2 from its checkpoint."""

    def __init__(self, argv: list[str], *, run_id: str, multi_process: bool, max_requeues: int) -> None:
        self.argv = list(argv)
        self.run_id = run_id  # empty: slurm-<job id>, fixed at first start and kept across requeues
        self.multi_process = multi_process
        self.max_requeues = max_requeues
        self.requeues = 0

    def __call__(self) -> dict:
        env = submitit.JobEnvironment()
        if not self.run_id:
            self.run_id = f"{env.cluster}-{env.job_id}"
        if self.multi_process:
            # Ranks from submitit; CUDA_VISIBLE_DEVICES stays as Slurm granted it (the trainer picks
            # cuda:LOCAL_RANK among the visible cards).
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
            if env.cluster == "local":  # one machine: loopback, however its hostname resolves
                os.environ["MASTER_ADDR"] = "127.0.0.1"
        _setup_logging(env.global_rank)
        from job import devices, train

        with _SignalsSeen() as seen:
            try:
                # The config is loaded again here, on the node: the workload is imported from this task's
                # working directory and Python path, and data paths are checked where the job reads them.
                devices.prepare_environment()
                cfg = load([*self.argv, f"train.run_id={self.run_id}"])
                log.info("submitit %s: run %s (Slurm restarts %s, submitit requeues %d of %d)", env, self.run_id,
                         os.environ.get("SLURM_RESTART_COUNT", "0"), self.requeues, self.max_requeues)
                rc = train.run(cfg)
            except UsageError as e:  # bad input found in the job (a missing checkpoint...): one line, exit 2
                if not isinstance(e, PeerUsageError):  # a peer's refusal is printed once, by rank 0
                    print(f"error: {e}", file=sys.stderr, flush=True)
                self._refused(env, e)
        if rc == EXIT_INTERRUPTED:
            self._stopped(env, requeue=_usr_sig() in seen.signals | _stop_signals(train))
        if rc != EXIT_OK:
            raise RuntimeError(f"trainer exited with code {rc} (run {self.run_id})")
        return {"run_id": self.run_id, "run_dir": str(Path(cfg.train.run_dir) / self.run_id),
                "rank": env.global_rank, "exit_code": rc, "requeues": self.requeues,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def _refused(self, env, e: UsageError) -> None:
        """Bad input found in the task: the contract's exit 2, with the one line and no traceback.

        submitit records a raised exception with its traceback and the task then exits 1, so the task writes
        its own error result (what `status` reads: the code and the line) and leaves with SystemExit(2),
        which submitit's process_job lets through: Slurm's ExitCode is 2:0.
        """
        from submitit.core import utils

        with utils.temporary_save_path(env.paths.result_pickle) as tmp:
            utils.cloudpickle_dump(("error", f"trainer exited with code {EXIT_USAGE} (run {self.run_id}): "
                                             f"error: {e}"), tmp)
        sys.exit(EXIT_USAGE)

    def _stopped(self, env, *, requeue: bool) -> None:
        """The trainer finished its step, wrote the checkpoint and returned 75: end this attempt.

        No rank leaves a result file for an interrupted attempt (SystemExit passes through submitit's
        process_job), so a waiting client never mistakes it for the job's outcome.
        """
        if requeue and env.global_rank == 0:
            handler = signal.getsignal(_usr_sig())
            if callable(handler):
                # submitit's own path: timed-out bookkeeping, self.checkpoint(), scontrol requeue, exit;
                # raises UncompletedJobError (-> the job's error result) when out of requeues.
                handler(_usr_sig(), None)
            log.warning("submitit's %s handler is not installed; not requeuing", submitit.JobEnvironment.USR_SIG)
        elif requeue:
            log.info("stopped for requeue; rank 0 requeues the job")
        else:
            # submitit's preemption sends SIGTERM and then SIGUSR2; if the trainer stopped on the SIGTERM before
            # the SIGUSR2 arrived, give it a moment: submitit's handler (restored) then requeues from here.
            deadline = time.monotonic() + USR2_GRACE_S
            while time.monotonic() < deadline:
                time.sleep(0.1)
            log.warning("stopped by a signal other than %s (scancel, scontrol requeue): not requeuing here; Slurm "
                        "decides whether the job runs again", submitit.JobEnvironment.USR_SIG)
        sys.exit(EXIT_INTERRUPTED)

    def checkpoint(self, *args, **kwargs):
        """submitit calls this on rank 0 before requeuing; the trainer's checkpoint is already on disk."""
        if self.requeues >= self.max_requeues:
            log.warning("not requeuing: submit.max_requeues=%d reached (resubmit with train.run_id=%s)",
                        self.max_requeues, self.run_id)
            return None  # submitit: "checkpoint function returned None" -> job ends, no requeue
        self.requeues += 1
        return super().checkpoint(*args, **kwargs)


def _usr_sig() -> int:
    return submitit.JobEnvironment._usr_sig()


class _SignalsSeen:
    """The signals delivered to this process inside the `with`, whichever Python handler took them.

    submitit's preemption path sends SIGTERM and then SIGUSR2 (both land within one training step), and only
    SIGUSR2 means "requeue"; the trainer reports the signal that stopped it, which may be the SIGTERM. Python
    writes every handled signal's number to the wakeup fd, so this sees both.
    """

    def __enter__(self) -> _SignalsSeen:
        self.signals: set[int] = set()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        try:
            self._prev = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: nothing to record
            self._prev = None
        return self

    def __exit__(self, *exc) -> None:
        if self._prev is not None:
            signal.set_wakeup_fd(self._prev)
        try:
            while chunk := os.read(self._r, 4096):
                self.signals.update(chunk)
        except BlockingIOError:
            pass
        os.close(self._r)
        os.close(self._w)


def _stop_signals(train) -> set[int]:
    """What the trainer says stopped it (job.train.stop_signals()/stop_signal(), whichever it has)."""
    if hasattr(train, "stop_signals"):
        return set(train.stop_signals())
    sig = train.stop_signal() if hasattr(train, "stop_signal") else None
    return {sig} if sig is not None else set()


def _setup_logging(rank: int) -> None:
    """The trainer's log lines ("job" logger) to the task's stderr, as `python -m job train` prints them.

    Only the "job" logger: submitit's logger already has its handler, and the root one would print it twice.
    """
    job_log = logging.getLogger("job")
    if not job_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank{rank}] %(message)s" if rank else "%(message)s"))
        job_log.addHandler(handler)
    job_log.setLevel(logging.INFO)
    job_log.propagate = False


# -- submitting -------------------------------------------------------------------------------------
def job_argv(argv: list[str], cfg) -> list[str]:
    """The command line the job re-loads: submit.* dropped, and every path the submission checked made
    absolute (--config, train.run_dir, data.path, data.val_path, a workload file), so the tasks read what
    was checked here whatever their working directory (submit.workdir)."""
    config_file, overrides, _ = split_args(argv)
    out = ["--config", str(config_file.absolute())] if config_file else []
    out += [o for o in overrides if not o.startswith(("submit.", "train.run_dir=", "train.run_id="))]
    out.append(f"train.run_dir={Path(cfg.train.run_dir).expanduser().absolute()}")
    for key in ("path", "val_path"):
        value = cfg.data[key]
        if value and not Path(value).is_absolute():
            out.append(f"data.{key}={Path(value).absolute()}")
    module, sep, attr = cfg.workload.name.rpartition(":")
    if sep and module.endswith(".py") and not Path(module).is_absolute():
        out.append(f"workload.name={Path(module).absolute()}:{attr}")
    return out


def make_executor(cfg, p: Plan):
    s = cfg.submit
    if p.executor == "slurm":
        ex = submitit.SlurmExecutor(folder=p.folder, max_num_timeout=s.max_requeues)
        try:
            ex.update_parameters(**slurm_parameters(cfg, p))
        except ValueError as e:
            raise UsageError(f"submitit rejects the Slurm parameters: {_first_line(e)}") from None
        return ex
    ex = submitit.LocalExecutor(folder=p.folder, max_num_timeout=s.max_requeues)
    # LocalExecutor rewrites CUDA_VISIBLE_DEVICES to 0..gpus-1; put back what the caller sees.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    restore = f"export CUDA_VISIBLE_DEVICES={shlex.quote(visible)}" if visible is not None else \
        "unset CUDA_VISIBLE_DEVICES"
    workdir = [f"cd {shlex.quote(str(p.workdir))}"] if p.workdir else []
    ex.update_parameters(timeout_min=s.timeout_min, tasks_per_node=p.tasks_per_node,
                         gpus_per_node=s.gpus_per_node, signal_delay_s=s.signal_delay_s,
                         setup=[*SETUP, restore, *workdir, *job_setup(s)])
    return ex


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return EXIT_OK
    _workdir_first_on_path(argv)
    cfg = load(argv)
    if cfg.submit.dry_run:
        text = sbatch_text(cfg)
        print(text)
        if shutil.which("sbatch") and cfg.submit.executor != "local":
            check_with_slurm(text)
            print("# sbatch --test-only: accepted", file=sys.stderr)
        return EXIT_OK
    p = plan(cfg)
    if p.executor == "slurm":
        check_with_slurm(sbatch_text(cfg))  # the cluster's verdict before anything is written or submitted
    ex = make_executor(cfg, p)
    fn = TrainJob(job_argv(argv, cfg), run_id=cfg.train.run_id, multi_process=p.multi_process,
                  max_requeues=cfg.submit.max_requeues)
    try:
        job = ex.submit(fn)
    except submitit.core.utils.FailedJobError as e:
        raise UsageError(f"submission failed: {_first_line(e)}") from None
    run_id = cfg.train.run_id or f"{p.executor}-{job.job_id}"
    run_dir = Path(cfg.train.run_dir).expanduser().absolute() / run_id
    from job import status

    status.write_record(job, executor=p.executor, tasks=p.nodes * p.tasks_per_node, run_id=run_id, run_dir=run_dir)
    print(f"submitted {p.executor} job {job.job_id}: {cfg.strategy.name}/{cfg.workload.name}, "
          f"{p.nodes} node(s) x {p.tasks_per_node} task(s), {cfg.submit.gpus_per_node} GPU(s)/node")
    print(f"  run:    {run_dir}")
    print(f"  log:    {job.paths.stdout}")
    print(f"  errors: {job.paths.stderr}")
    follow_cmd = status.follow_command(job.job_id, p.folder)
    print(f"  follow: {follow_cmd}    (state and exit code only: without --follow)")
    if p.executor == "slurm":
        print(f"  cancel: scancel {job.job_id}")
    if not cfg.submit.wait:
        return EXIT_OK
    return follow(status.locate(str(job.job_id), cfg))


def _workdir_first_on_path(argv: list[str]) -> None:
    """submit.workdir goes first on this process's Python path too (it is first on the tasks'), so the
    submission imports and checks the workload exactly as the tasks will find it."""
    config_file, overrides, _ = split_args(argv)
    value = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("submit.workdir=")), None)
    if value is None and config_file is not None:
        try:
            from omegaconf import OmegaConf

            value = OmegaConf.select(OmegaConf.load(config_file), "submit.workdir", default=None)
        except Exception:  # not readable or not YAML: load() says so in one line
            value = None
    if value and not any(ord(c) < 32 or ord(c) == 127 for c in str(value)):  # load() refuses such a value
        path = str(Path(str(value)).expanduser().absolute())
        if path not in sys.path and Path(path).is_dir():  # load() refuses one that is not a folder
            sys.path.insert(0, path)


def follow(job, *, out=sys.stdout) -> int:
    """Print rank 0's log as it grows until the job ends; its exit code (0 done, 2, 75, 1: job.status)."""
    from job import status

    st = status.follow(job, out=out)
    if st.exit_code == EXIT_OK:
        print(f"job {job.job_id} finished: exit 0 (run {job.run_dir})", file=out)
        return EXIT_OK
    for line in status.describe(job, st):
        print(line, file=sys.stderr)
    return st.exit_code if st.exit_code is not None else 1


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__

