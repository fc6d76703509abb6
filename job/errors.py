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
        text = args[0] if len(args) == 1 and isinstance(args[0], str) else ""
        if text.startswith("Caught ") and "Original Traceback" in text:
            name = text.split()[1]  # the traceback's last line names it with its module: job.errors.UsageError
            own = re.findall(rf"^(?:[\w.]+\.)?{re.escape(name)}: (.*)$", text, re.MULTILINE)
            if own:
                args = (own[-1].strip(),)
        super().__init__(*args)


class PeerUsageError(UsageError):
    """The refusal rank 0 reached and printed, seen by another rank: it exits 2 without printing it again."""
