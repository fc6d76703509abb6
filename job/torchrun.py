"""`python -m job.torchrun [torchrun options] -m job train ...`: torchrun, ending with the project's exit codes.

torchrun (`torch.distributed.run`) ends with a code of its own whatever its workers said: 0, or 1. On SIGTERM
(a pod being stopped, `scancel`, a node drain) it forwards the signal to its workers, waits for them
(`--shutdown-timeout`, 30 s by default; then SIGKILL) and raises `SignalException`: a traceback and exit 1,
although every rank finished its step and rank 0 wrote the checkpoint. A scheduler that retries on 75
("interrupted after a checkpoint") then does not retry, and a config error (every rank exits 2) reads as a
crash. A signal it does not handle (SIGUSR2, which Slurm sends before a time limit) kills torchrun itself.

This module runs torchrun's own `main` with the same arguments and changes two things:

- each worker started as `python -m job ...` writes the code it exits with to a private temporary folder
  (`TRAINJOB_EXIT_DIR`, made here, removed at the end), and this process exits with the workers' code when
  they agree: **75** when every local worker reported and all exited 75 or 0 (at least one 75), **2** when
  the codes known are 2, 75 or 0 (at least one 2; a worker that torchrun stopped after another failed, by
  SIGTERM or SIGKILL, says nothing); otherwise torchrun's own outcome: 0, 1 for a failed worker, 128 + N after
  signal N;
- unless `--signals-to-handle` (or `PET_SIGNALS_TO_HANDLE`) is given, torchrun also handles SIGUSR1 and
  SIGUSR2 as it handles SIGTERM (forwarded to the workers, which stop after a checkpoint).

One line says what was decided; torchrun's own messages stay as they are. docs/failures.md and
docs/kubernetes.md ("Multi-node") describe how the manifests use it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from job.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

EXIT_DIR = "TRAINJOB_EXIT_DIR"
# torchrun's default set, plus the signals the trainer stops on (Slurm's --signal=USR2@..., a user's SIGUSR1).
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"


def record_exit(code: int) -> None:
    """In a worker: leave `code` for the launcher (called by `python -m job` as it exits, when EXIT_DIR is set)."""
    folder = os.environ.get(EXIT_DIR)
    if not folder or not Path(folder).is_dir():
        return
    local = os.environ.get("LOCAL_RANK", "0")
    doc = {"local_rank": int(local), "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
           "rank": int(os.environ.get("RANK", local)), "code": int(code)}
    tmp = Path(folder) / f".{local}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(doc))
        tmp.replace(Path(folder) / f"rank-{local}.json")
    except OSError:  # nothing to report then: the launcher falls back to torchrun's own code
        pass


def reported(folder: Path) -> tuple[dict[int, int], int | None]:
    """{local rank: exit code} the workers left, and the local world size they said."""
    codes, world = {}, None
    for path in folder.glob("rank-*.json"):
        try:
            doc = json.loads(path.read_text())
            codes[int(doc["local_rank"])] = int(doc["code"])
            world = int(doc["local_world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return codes, world


def outcome(codes: dict[int, int], world: int | None, *, fallback: int, all_needed: bool) -> int:
    """The launcher's exit code from its workers' codes (see the module docstring).

    `all_needed`: every local worker must have reported (after a signal: one that did not may have been
    killed before its checkpoint); otherwise the codes known are enough (a failed worker ended the others).
    """
    values = set(codes.values())
    complete = world is not None and len(codes) >= world
    if not values or (all_needed and not complete):
        return fallback
    if values <= {EXIT_OK, EXIT_INTERRUPTED} and EXIT_INTERRUPTED in values and complete:
        return EXIT_INTERRUPTED
    if values <= {EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED} and EXIT_USAGE in values:
        return EXIT_USAGE
    return fallback


def consequences_dropped(failures: dict[int, int]) -> dict[int, int]:
    """torchrun's failures without the workers it ended itself after another one exited (SIGTERM, then SIGKILL:
    exit codes -15 and -9): those said nothing of their own. Kept when no worker exited by itself."""
    own = {r: c for r, c in failures.items() if c not in (-signal.SIGTERM, -signal.SIGKILL)}
    return own if own else failures


def _with_signals(argv: list[str]) -> list[str]:
    """argv with --signals-to-handle added before the entry point, unless the caller chose the signals."""
    head = []
    for arg in argv:
        if not arg.startswith("-") or arg in ("-m", "--module", "--no-python", "--no_python"):
            break  # the training script or `-m module`: what follows is the trainer's
        head.append(arg)
    chosen = any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in head)
    if chosen or os.environ.get("PET_SIGNALS_TO_HANDLE"):
        return argv
    return [f"--signals-to-handle={SIGNALS}", *argv]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    with tempfile.TemporaryDirectory(prefix="trainjob-exit-") as folder:
        os.environ[EXIT_DIR] = folder  # torchrun passes its environment on to the workers
        failures: dict[int, int] = {}
        try:
            torchrun(_with_signals(argv))
            return EXIT_OK
        except SignalException as e:
            name = signal.Signals(e.sigval).name
            fallback, all_needed, what = 128 + int(e.sigval), True, f"torchrun stopped by {name}"
        except ChildFailedError as e:
            failures = consequences_dropped({f.local_rank: f.exitcode for f in e.failures.values()})
            fallback, all_needed, what = 1, False, "a worker ended"
        codes, world = reported(Path(folder))
        codes = {**failures, **codes}
    rc = outcome(codes, world, fallback=fallback, all_needed=all_needed)
    got = ", ".join(f"{r}: {c}" for r, c in sorted(codes.items())) or "none"
    meaning = {EXIT_INTERRUPTED: "stopped after a checkpoint", EXIT_USAGE: "bad input"}.get(rc, "torchrun's own code")
    print(f"job.torchrun: {what}; local workers' exit codes {{{got}}} of {world or '?'}: exit {rc} ({meaning})",
          file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
