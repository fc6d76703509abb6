"""Helpers the breakdown tests share (tests/unit/test_breakdown.py, tests/e2e/test_breakdown_runs.py)."""

from __future__ import annotations

from job import config


def built(*argv: str):
    """A built-in workload's model and the workload, through the public interface."""
    cfg = config.load(list(argv))
    return config.workload_of(cfg).workload.model(config.workload_settings(cfg)), config.workload_of(cfg).workload


def nbytes(tensors) -> int:
    """The bytes of `tensors`, each counted whole."""
    return sum(t.numel() * t.element_size() for t in tensors)
