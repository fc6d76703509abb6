"""Free ports (job.ports, the tests' and the bench's) come from below the kernel's ephemeral range and bind when drawn."""

from __future__ import annotations

import socket
from contextlib import closing

import pytest

from job import ports as _ports
from job.ports import free_port, free_port_block


def _ephemeral_start() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    start = _ephemeral_start()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1, "every draw gave the same port: not drawn at random"
    for port in ports:
        assert 1024 <= port < start, f"{port} is in the ephemeral range starting at {start}"
        with closing(socket.socket()) as s:
            s.bind(("127.0.0.1", port))


def test_a_block_is_consecutive_free_ports_below_the_range():
    first = free_port_block(3)
    assert first + 3 <= _ephemeral_start()
    held = []
    try:
        for port in range(first, first + 3):
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()


def test_a_port_in_use_is_never_drawn(monkeypatch):
    with closing(socket.socket()) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(_ports, "_below_ephemeral", lambda: range(taken, taken + 2))
        assert {free_port() for _ in range(10)} == {taken + 1}
        monkeypatch.setattr(_ports, "_below_ephemeral", lambda: range(taken, taken + 1))
        with pytest.raises(RuntimeError, match="no block of 1 free ports"):
            free_port()
