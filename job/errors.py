"""The one exception type that reaches the user as a single line and exit code 2.

Raise `UsageError` for anything the user can fix by changing input (config, paths, environment, a
checkpoint that does not fit); the message names the problem and the fix. `python -m job` prints
`error: <message>` and exits 2 without a traceback.
"""

import re

EXIT_OK = 0
EXIT_USAGE = 2
# A run stopped by SIGTERM/SIGUSR1/SIGUSR2 after writing its checkpoint: EX_TEMPFAIL ("try again"),
# distinct from success and from a config error, so schedulers can retry on it and only on it.
EXIT_INTERRUPTED = 75


class UsageError(Exception):
    """Bad input the user can fix; printed as one line, exit code 2.

    Raised in a DataLoader worker, it reaches the training process rebuilt from one message holding the
    worker's traceback (`Caught UsageError in DataLoader worker process 0.` ... `UsageError: <line>`): the
    constructor keeps the worker's own line."""

    def __init__(self, *args):
        found = worker_reraise(args[0]) if len(args) == 1 and isinstance(args[0], str) else None
        if found is not None and found[2] is not None:
            args = (found[2],)
        super().__init__(*args)


_WORKER_RERAISE = re.compile(r"^Caught (\w+) in DataLoader worker process (\d+)\.")


def worker_reraise(text: str) -> tuple[str, str, str | None] | None:
    """(exception name, worker number, the worker's own message) of a message DataLoader rebuilt from a
    worker's exception (`Caught ValueError in DataLoader worker process 0.`, the worker's traceback, and its
    last line `ValueError: <message>`, or with the module: `job.errors.UsageError: <message>`); the message
    is None where that line is missing; None for any other text."""
    m = _WORKER_RERAISE.match(text.strip())
    if m is None:
        return None
    own = re.findall(rf"^(?:[\w.]+\.)?{re.escape(m.group(1))}: (.*)$", text, re.MULTILINE)
    return m.group(1), m.group(2), own[-1].strip() if own else None


class PeerUsageError(UsageError):
    """The refusal rank 0 reached and printed, seen by another rank: it exits 2 without printing it again."""
