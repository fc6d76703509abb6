"""`python -m job export [--port 9400] [--host 127.0.0.1]`: the NVML collector alone, the node-exporter role in
compose and Kubernetes."""

from __future__ import annotations

import logging
import signal
import threading

from job import devices
from job.errors import EXIT_OK, UsageError
from job.telemetry.nvml import NvmlCollector
from job.telemetry.server import _hostport, _serve, _stop

log = logging.getLogger("job.telemetry")

EXPORT_USAGE = "usage: python -m job export [--port 9400] [--host 127.0.0.1]"


def _parse_export_args(argv: list[str]) -> tuple[str, int] | None:
    host, port = "127.0.0.1", 9400
    it = iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            return None
        name, eq, value = arg.partition("=")
        if name not in ("--port", "--host"):
            raise UsageError(f"unexpected argument `{arg}`; {EXPORT_USAGE}")
        if not eq:
            value = next(it, None)
            if value is None:
                raise UsageError(f"{name} needs a value; {EXPORT_USAGE}")
        if name == "--host":
            host = value
        else:
            if not value.isdigit() or not 1 <= int(value) <= 65535:
                raise UsageError(f"--port {value} is not a TCP port; give 1-65535")
            port = int(value)
    return host, port


def export_main(argv: list[str], *, nvml=None, ready: threading.Event | None = None,
                stop: threading.Event | None = None) -> int:
    """`python -m job export`: serve the NVML collector until SIGTERM/SIGINT, then exit 0."""
    from prometheus_client import CollectorRegistry, generate_latest

    parsed = _parse_export_args(argv)
    if parsed is None:
        print(EXPORT_USAGE)
        return EXIT_OK
    host, port = parsed
    registry = CollectorRegistry(auto_describe=False)
    collector = NvmlCollector(nvml=nvml)
    registry.register(collector)

    def health():
        return {"status": "ok", "nvml_up": devices.nvml_or_default(nvml) is not None}

    try:
        httpd, _ = _serve(host, port, lambda: generate_latest(registry), health)
    except OSError as e:
        raise UsageError(f"cannot serve on {_hostport(host, port)} ({e.strerror}); pick a free --port") from None
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    up = devices.nvml_or_default(nvml) is not None
    log.info("exporter: serving http://%s/metrics (NVML %s)", _hostport(host, httpd.server_address[1]),
             "up" if up else "unavailable: trainjob_nvml_up 0")
    if not up:
        log.warning("exporter: NVML cannot start here (no driver library or no GPU device in this container); "
                    "in Kubernetes on a node whose runtime ignores NVIDIA_VISIBLE_DEVICES=all in unprivileged "
                    "containers, use DCGM's exporter (GPU Operator) instead: docs/kubernetes.md, 'Hardened nodes'")
    if ready is not None:
        ready.port = httpd.server_address[1]  # type: ignore[attr-defined]
        ready.set()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        _stop(httpd)
    return EXIT_OK
