"""`python -m job train|bench|export|submit|status [--config FILE] [key=value ...]`: dispatch only."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys

from job.errors import EXIT_USAGE, PeerUsageError, UsageError

COMMANDS = ("train", "bench", "export", "submit", "status")
USAGE = ("usage: python -m job {train|bench|export|submit} [--config FILE] [key=value ...]  (--help lists keys) | "
         "python -m job status JOB_ID|RUN_ID [--follow]")


def _setup_logging() -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}] " if rank not in (None, "0") else ""
    logging.basicConfig(level=logging.INFO, format=f"{prefix}%(message)s", stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else EXIT_USAGE
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command `{command}`; {USAGE}", file=sys.stderr)
        return EXIT_USAGE
    _setup_logging()
    try:
        # Before anything can start CUDA: device order and CUDA_VISIBLE_DEVICES are fixed here.
        from job import devices, launch

        launch.raise_open_file_limit()
        devices.prepare_environment()
        if command == "export":
            from job.telemetry import export_main

            return export_main(rest)
        if command == "submit":
            from job.submit import main as submit_main

            return submit_main(rest)
        if command == "status":
            from job.status import main as status_main

            return status_main(rest)
        from job import config

        if "-h" in rest or "--help" in rest:
            print(config.help_text(rest))
            return 0
        cfg = config.load(rest)
        if command == "bench":
            from job.bench import run as bench_run

            return bench_run(cfg, config.preset_picks(rest).get("workload"))
        from job.train import run

        return run(cfg)
    except UsageError as e:
        if not isinstance(e, PeerUsageError):  # a peer's refusal is printed once, by rank 0
            print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C); the last checkpoint written, if any, is kept", file=sys.stderr)
        return 130
    except Exception as e:  # a crash of a one-process command: one line; a bug's traceback goes to a file
        from job import failure

        line, code = failure.describe(e)
        print(f"error: {line}{failure.traceback_note(e, rank=0, log_dir=None)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a crash in native code (SIGSEGV, SIGABRT) prints every thread's stack
    code = main()
    if os.environ.get("TRAINJOB_EXIT_DIR"):  # a worker of `python -m job.torchrun`: it reads the code
        from job.torchrun import record_exit

        record_exit(code)
    sys.exit(code)
