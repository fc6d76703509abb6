"""Free loopback ports for a server another process will start, drawn where nothing takes them by itself.

A port from binding port 0 lies in the kernel's ephemeral range, which the kernel hands out again to any other
process's outgoing connection or port-0 bind (Slurm, Prometheus, Docker, a parallel test) before the process
that is given the port binds it: "Address already in use" at random. These come from below that range, which
the kernel never hands out by itself, and bind at the time they are drawn. The bench's telemetry runs and the
tests take their ports from here.
"""

from __future__ import annotations

import random
import socket
from contextlib import closing
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _below_ephemeral() -> range:
    try:
        first = int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768  # Linux's default start
    low = 10000 if first > 20000 else 1024  # clear of well-known services where there is room
    return range(low, first)


def _binds(port: int) -> bool:
    with closing(socket.socket()) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int = 1) -> int:
    """The first of `n` consecutive ports on 127.0.0.1 that all bind now, below the ephemeral range."""
    span = _below_ephemeral()
    if len(span) < n:
        raise RuntimeError(f"no room for {n} ports below the ephemeral range (read from {_RANGE})")
    draw = random.Random()  # seeded from the OS: processes drawing at the same time draw apart
    for _ in range(200):
        first = draw.randrange(span.start, span.stop - n + 1)
        if all(_binds(p) for p in range(first, first + n)):
            return first
    raise RuntimeError(f"no block of {n} free ports on 127.0.0.1 in {span.start}-{span.stop - 1}")


def free_port() -> int:
    """A port on 127.0.0.1 that binds now, below the ephemeral range."""
    return free_port_block(1)
