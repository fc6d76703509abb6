"""The tests' free loopback ports: job.ports' (below the kernel's ephemeral range, bound when drawn)."""

from job.ports import free_port, free_port_block  # noqa: F401
