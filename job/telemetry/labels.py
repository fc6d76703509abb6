"""The label sets of the series: per card (NVML) and per rank (allocator, plan, training)."""

from __future__ import annotations

import re

CARD_LABELS = ("uuid", "pci_bus_id", "gpu", "name", "host")
RANK_LABELS = ("rank", "local_rank", "uuid", "strategy", "run")


def _label_name(key: str) -> str:
    """A key of trainjob_info as a valid Prometheus label name (`train.amp` -> `train_amp`)."""
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return name if re.match(r"^[a-zA-Z_]", name) and not name.startswith("__") else f"x_{name.lstrip('_')}"
