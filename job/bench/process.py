"""The bench's child processes: a plain environment, the line that says why one failed, stopping one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

# Set by torchrun/Slurm for the process they started; a benchmark run must start as a plain command
# (it starts its own ranks), not join the group of whoever started the benchmark.
GROUP_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in GROUP_VARS}


def error_line(text: str) -> str:
    """The line that says why a run failed: `error: ...`, else the exception line, else the last line."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    for line in reversed(lines):
        if line.startswith("error:"):
            return line[len("error:"):].strip()
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) and " " not in head:
            return line
    return lines[-1] if lines else "no output"


def wait_or_kill(p: subprocess.Popen, timeout_s: float) -> None:
    """Wait up to `timeout_s` for `p` to end, else SIGKILL its session (it was started in one) and reap it."""
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
