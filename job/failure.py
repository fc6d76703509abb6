"""What a rank of a multi-process job does when something goes wrong (docs/failures.md).

- The rank whose own code failed (out of memory, bad data, a bug) prints one line naming itself and its card,
  `error: rank 1 (cuda:1, GPU-…): <what>; <fix>`, runs no collective, aborts its process group and exits.
- A rank whose collective failed because a peer failed, died or hung does not repeat anyone's error: it asks
  the job's rendezvous store (the TCPStore every launcher starts) which ranks reported an error and which are
  still there; the lowest rank still alive says, once, which rank failed, left or did not answer.
- Every exit path is bounded: a watchdog ends the process even if an abort or the store hangs.

The store is used only here, on the error path, with a short timeout; the training loop never touches it.

`JOB_FAULT=rank:step:kind[,...]` is a test hook (off unless set): during step `step` (1-based), rank `rank`
raises (`raise`), runs out of memory (`oom`: raises torch.OutOfMemoryError), kills itself (`kill`: SIGKILL),
stops itself (`stop`: SIGSTOP, a hung rank), turns its loss into NaN (`nan`) or sleeps SLOW_STEP_S before the
step's work (`slow`: a step still running when a signal lands). tests/e2e/test_failure.py uses it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from job.errors import EXIT_USAGE, PeerUsageError, UsageError

EXIT_CRASH = 1
EXIT_CTRL_C = 130  # as a shell reports a process ended by SIGINT
FAULT_VAR = "JOB_FAULT"
STORE_TIMEOUT_S = 3.0  # each store operation on the error path
ROLL_CALL_S = 3.0  # how long a rank waits for the others to say whether they are alive or failed
HOST_LINGER_S = 4.0  # how long the rank hosting the store stays so its peers can read it
USAGE_WAIT_S = 5.0  # how long a rank with bad input (or a bug in the user's code) waits for rank 0's same line
WATCHDOG_S = 20.0  # the error path's own bound: exit even if an abort or the store hangs
OOM_FIX = "lower train.batch_size, or try train.amp=bf16 or train.activation_checkpointing=true"


def card(device) -> str:
    """`cuda:1, GPU-<uuid>` or `cpu`: the card a rank ran on, as nvidia-smi and the metrics name it."""
    if device is None:
        return "device not chosen yet"
    if getattr(device, "type", None) != "cuda":
        return "cpu"
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device.index).uuid)
        return f"{device}, {uuid if uuid.startswith('GPU-') else 'GPU-' + uuid}"
    except Exception:
        return str(device)


def who(env, device) -> str:
    """`rank 1 (cuda:1, GPU-…)`, with the host when the job spans nodes."""
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    host = f"{socket.gethostname()}, " if local_world and int(local_world) < env.world_size else ""
    return f"rank {env.rank} ({host}{card(device)})"


def describe(exc: BaseException) -> tuple[str, int]:
    """The one line for an exception and the exit code it ends the process with."""
    import torch

    from job.launch import RendezvousError

    if isinstance(exc, UsageError):
        return str(exc), EXIT_USAGE
    unresolved = _unresolved(exc)
    if unresolved:
        return unresolved, EXIT_USAGE
    if isinstance(exc, RendezvousError):
        return str(exc), EXIT_CRASH
    if isinstance(exc, torch.OutOfMemoryError) or (
            isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)):  # the CPU allocator's
        # torch's message: what was asked, the card's size and free memory, who holds it; then allocator advice.
        first = re.split(r"\.\s+(?=Of the allocated|If reserved|See documentation)", first_line(exc))[0]
        where = getattr(exc, "job_context", "")  # what the job was doing, set where it knows (graph capture)
        return f"{(first or 'out of memory').rstrip('.')}{' ' + where if where else ''}; {OOM_FIX}", EXIT_CRASH
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C); the last checkpoint written, if any, is kept", EXIT_CTRL_C
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else EXIT_CRASH
        return f"exited with code {code}", code
    from job.workload import describe_user_error, describe_worker_error, user_frames

    worker = describe_worker_error(exc)
    if worker:  # raised in a DataLoader worker: its message and frames, which the re-raise turned into text
        return worker, EXIT_CRASH
    died = _WORKER_DIED.search(first_line(exc)) if isinstance(exc, RuntimeError) else None
    if died:  # torch's line for a worker gone without a Python error
        signal_name = died.group(2) or ""
        how = f"was killed by signal ({signal_name})" if signal_name else "exited unexpectedly"
        why = ("a file it read shrank while mapped, or shared memory (/dev/shm) ran out: give the container a "
               "larger --shm-size" if signal_name == "Bus error" else
               "killed from outside, or the host ran out of memory (the kernel's OOM killer; `dmesg` says): if "
               "memory is short, lower data.workers")
        return f"DataLoader worker (pid {died.group(1)}) {how}: {why}", EXIT_CRASH
    if user_frames(exc):  # raised in the user's workload code: their file and line, not ours
        return describe_user_error(exc), EXIT_CRASH
    return f"{type(exc).__name__}: {first_line(exc)} (at {_where(exc)})", EXIT_CRASH


_WORKER_DIED = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) "
                          r"(?:exited unexpectedly|is killed by signal: ([\w ]+?))\.?\s*$")


def _unresolved(exc: BaseException) -> str:
    """A config interpolation that did not resolve where a value was read before validation could name it."""
    try:
        from omegaconf.errors import InterpolationResolutionError
    except ImportError:
        return ""
    if not isinstance(exc, InterpolationResolutionError):
        return ""
    return (f"`{exc.full_key or '?'}` cannot be resolved ({first_line(exc)}); write the value itself, or "
            "interpolate a key that exists, e.g. ${train.run_dir}")


def is_collective_error(exc: BaseException) -> bool:
    """A collective (gloo/NCCL) or the store failed: the trouble is, or may be, another rank's."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        k in text for k in ("gloo", "Gloo", "NCCL", "Connection closed by peer", "Connection reset by peer",
                            "Socket Timeout", "TCPStore"))


def _is_timeout(exc: BaseException) -> bool:
    return re.search(r"time(d)?[ -]?out", str(exc), re.IGNORECASE) is not None


def _short(exc: BaseException) -> str:
    """A collective's error without gloo's source location and advice: `Connection closed by peer …`."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", first_line(exc))
    return text.split(". ")[0].rstrip(".")


def first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else ""


def _where(exc: BaseException) -> str:
    """The innermost frame of the traceback in this project's code (else the innermost): file:line."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f"{os.sep}job{os.sep}" in f.filename]
    f = (ours or frames or [None])[-1]
    return f"{Path(f.filename).name}:{f.lineno}" if f else "?"


# -- the error path ---------------------------------------------------------------------------------
def fail(exc: BaseException, *, env, device, timeout_s: float, cleanup=None, log_dir: Path | None = None):
    """End this rank because of `exc`: one line (or none, if another rank already said why), no collective,
    abort the group, exit. Never returns."""
    from job import launch

    line, code = describe(exc)
    collective = is_collective_error(exc)
    if collective:
        code = EXIT_CRASH
    _watchdog(code)
    if cleanup is not None:
        try:
            cleanup()
        except Exception:
            pass
    store = _store(env)  # before the abort, which takes this rank's store connection with it
    missing: list[int] = []
    if isinstance(exc, KeyboardInterrupt):  # every rank got it: rank 0 says so
        if env.rank == 0:
            _say(f"error: {line}")
        launch.abort_group()
        store = None
    elif not collective:
        # A refusal every rank reached together (PeerUsageError), or the line rank 0 already said: quiet.
        if not isinstance(exc, PeerUsageError) and not _said_by_rank0(store, env, exc, line):
            _say(f"error: {who(env, device)}: {line}{traceback_note(exc, rank=env.rank, log_dir=log_dir)}")
        _tell(store, env, "failed", line)  # before the abort: the peers learn of it when theirs fail
        launch.abort_group()
    else:
        missing, reachable = _explain_peer_failure(store, env, device, exc, timeout_s)
        launch.abort_group()
        if not reachable:
            store = None
    if store is not None:
        # A failing host just leaves (its peers then see it gone), unless its peers may be comparing their
        # own bad-input error with its one.
        if _hosts_store(env) and (collective or isinstance(exc, UsageError) or _in_user_code(exc)):
            _linger(store, env, skip=missing)
        else:
            _tell(store, env, "done")  # read what it needed: the store's host may leave
    _flush()
    os._exit(code)


def stop_now(message: str) -> None:
    """The second Ctrl-C: leave at once (rank 0 says so), no checkpoint, no collective; exit 130. A checkpoint
    being written is abandoned: its temporary file is removed, the earlier checkpoints are kept."""
    from job import checkpoint, launch

    checkpoint.discard_partial()
    if os.environ.get("RANK", "0") == "0":
        _say(message)
    launch.abort_group()
    _flush()
    os._exit(EXIT_CTRL_C)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _flush() -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass


def _watchdog(code: int) -> None:
    t = threading.Timer(WATCHDOG_S, lambda: (_flush(), os._exit(code)))
    t.daemon = True
    t.start()


def traceback_note(exc: BaseException, *, rank: int, log_dir: Path | None) -> str:
    """A bug's full traceback goes to a file (the terminal keeps one line per failure)."""
    import torch

    from job.launch import RendezvousError

    if isinstance(exc, (UsageError, RendezvousError, torch.OutOfMemoryError, KeyboardInterrupt, SystemExit)) \
            or _unresolved(exc):
        return ""
    text = "".join(traceback.format_exception(exc))
    try:
        return f"; traceback: {write_traceback(text, rank=rank, log_dir=log_dir)}"
    except OSError:
        sys.stderr.write(text)
        return ""


def write_traceback(text: str, *, rank: int, log_dir: Path | None) -> Path:
    """`rank<N>-error.txt` in the run directory (this rank's, or the one this process holds), else in a new
    private folder of the temp folder (mkdtemp: unpredictable, 0700); created exclusively, 0600, never through
    a symlink (docs/security.md)."""
    from job import rundir

    folder = log_dir if log_dir is not None else rundir.held_dir()
    if folder is not None:
        try:
            rundir.check_private(folder)
        except (UsageError, OSError):
            folder = None
    if folder is None or not folder.is_dir():
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix=f"job-rank{rank}-error-"))
    path = folder / f"rank{rank}-error.txt"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # an earlier crash's (ours: the folder is private)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _store(env):
    """The job's rendezvous store (the connection the group already has), or None before the group exists.

    Its own connection, not a new one: a new client to a stopped host would add seconds and C++ noise.
    """
    if env.world_size < 2:
        return None
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        return store
    except Exception:
        return None


def _bounded(fn, seconds: float, default=None):
    """fn() in a daemon thread, with stderr (fd 2) silenced: a store whose host is gone or stopped makes
    c10d print a C++ stack per failed operation, and may block longer than its own timeout."""
    result: list = []

    def target():
        try:
            result.append(fn())
        except Exception:
            result.append(default)

    _flush()
    saved = os.dup(2)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        t = threading.Thread(target=target, daemon=True)
        t.start()
        t.join(seconds)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return result[0] if result else default


def _prefix() -> str:
    # A torchrun restart keeps the agent's store: keys of an earlier attempt must not count.
    return f"trainjob/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _tell(store, env, what: str, text: str = "1") -> None:
    if store is not None:
        _bounded(lambda: store.set(f"{_prefix()}{what}/{env.rank}", text), STORE_TIMEOUT_S)


def _in_user_code(exc: BaseException) -> bool:
    from job.workload import user_frames

    return bool(user_frames(exc))


def _said_by_rank0(store, env, exc: BaseException, line: str) -> bool:
    """Bad input is usually seen by every rank (the same config, the same checkpoint), and so is a bug in the
    user's workload code (the same code at the same step): a rank other than 0 stays quiet when rank 0
    reported the very same line."""
    if store is None or env.rank == 0 or not (isinstance(exc, UsageError) or _in_user_code(exc)):
        return False
    key = f"{_prefix()}failed/0"

    def same() -> bool:
        deadline = time.monotonic() + USAGE_WAIT_S
        while not store.check([key]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return store.get(key).decode(errors="replace") == line

    return bool(_bounded(same, USAGE_WAIT_S + STORE_TIMEOUT_S, False))


def _has(store, key: str) -> bool:
    return bool(_bounded(lambda: store.check([f"{_prefix()}{key}"]), STORE_TIMEOUT_S, False))


def _roll_call(store, env) -> tuple[list[int], list[int]] | None:
    """(ranks that reported an error, ranks neither alive nor failed), or None if the store is gone."""
    deadline = time.monotonic() + ROLL_CALL_S
    while True:
        def look():
            return ([r for r in range(env.world_size) if store.check([f"{_prefix()}failed/{r}"])],
                    [r for r in range(env.world_size) if store.check([f"{_prefix()}alive/{r}"])])

        seen = _bounded(look, STORE_TIMEOUT_S)
        if seen is None:
            return None
        failed, alive = seen
        missing = [r for r in range(env.world_size) if r not in failed and r not in alive]
        if not missing or time.monotonic() > deadline:
            return failed, missing
        time.sleep(0.2)


def _explain_peer_failure(store, env, device, exc: BaseException,
                          timeout_s: float) -> tuple[list[int], bool]:
    """This rank's collective failed: say once which rank is to blame (or nothing, if it said so itself).
    Returns the ranks that neither answered nor reported an error, and whether the store answered."""
    me = who(env, device)
    timed_out = _is_timeout(exc)
    answer = None
    if store is not None and _bounded(lambda: store.set(f"{_prefix()}alive/{env.rank}", "1") or True,
                                      STORE_TIMEOUT_S, False):
        answer = _roll_call(store, env)
    if answer is None:
        # The store lives in rank 0's process (or torchrun's agent): it is gone or stopped too.
        host = "rank 0" if _hosts_store_rank() == 0 else "the rendezvous store"
        if env.rank == 0:
            _say(f"error: {me}: a collective with the other ranks failed ({_short(exc)})")
        elif timed_out:
            _say(f"error: {host} did not answer within strategy.timeout_s={timeout_s:g} s (hung, stopped, or "
                 f"its node is lost); {me} stops")
        else:
            _say(f"{me}: stopping: lost {host} ({_short(exc)})")
        return [], False
    failed, missing = answer
    alive = [r for r in range(env.world_size) if r not in failed and r not in missing]
    if not alive or env.rank != min(alive):
        return missing, True  # the lowest rank still alive speaks for all of them
    if failed:
        _say(f"{me}: stopping: rank {', '.join(map(str, failed))} failed (its error line is above)")
    elif missing:
        ranks = ", ".join(map(str, missing))
        if timed_out:
            _say(f"error: rank {ranks} did not answer within strategy.timeout_s={timeout_s:g} s (hung, stopped, "
                 "or its node is lost); the job stops")
        else:
            _say(f"error: rank {ranks} left without an error line (killed, or crashed outside Python: see the "
                 f"launcher's exit status); the job stops")
    else:
        _say(f"error: {me}: a collective failed on every rank ({_short(exc)})")
    return missing, True


def _hosts_store_rank() -> int | None:
    """The rank whose process hosts the rendezvous store (None: torchrun's agent does)."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


def _hosts_store(env) -> bool:
    return _hosts_store_rank() == env.rank


def _linger(store, env, *, skip: list[int]) -> None:
    """The store dies with this process: stay until every other rank still there has read it (or
    HOST_LINGER_S)."""
    deadline = time.monotonic() + HOST_LINGER_S
    others = [r for r in range(env.world_size) if r != env.rank and r not in skip]
    while time.monotonic() < deadline:
        if all(_has(store, f"done/{r}") for r in others):
            return
        time.sleep(0.1)


# -- the test hook ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str


KINDS = ("raise", "oom", "kill", "stop", "nan", "slow")
SLOW_STEP_S = 30.0  # how long a `slow` fault's step sleeps


def faults(environ=os.environ) -> list[Fault]:
    """Parse JOB_FAULT (empty unless set); a malformed value is bad input."""
    value = environ.get(FAULT_VAR, "").strip()
    out = []
    for item in filter(None, (v.strip() for v in value.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in KINDS:
            raise UsageError(f"{FAULT_VAR}={value!r}: each fault is rank:step:kind with kind one of "
                             f"{'|'.join(KINDS)} (a test hook; unset it for real runs)")
        out.append(Fault(int(parts[0]), int(parts[1]), parts[2]))
    return out


def inject(plan: list[Fault], *, rank: int, step: int) -> bool:
    """Run the faults planned for this rank and step; True if the loss should become NaN."""
    nan = False
    for f in plan:
        if f.rank != rank or f.step != step:
            continue
        if f.kind == "raise":
            raise RuntimeError(f"injected fault ({FAULT_VAR}) on rank {rank} at step {step}")
        if f.kind == "oom":
            import torch

            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {FAULT_VAR} on rank {rank} at step "
                                         f"{step})")
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if f.kind == "nan":
            nan = True
        if f.kind == "slow":
            print(f"fault ({FAULT_VAR}): rank {rank} sleeps {SLOW_STEP_S:.0f} s in step {step}", file=sys.stderr,
                  flush=True)  # where a test can wait for the step to be under way
            time.sleep(SLOW_STEP_S)  # a signal's handler still runs in it
    return nan
