"""Checkpoints: strategy-independent state, written atomically, found again by step number.

A checkpoint is `<run>/checkpoints/step_XXXXXXXX.pt`, a dict with the unwrapped model state dict, the
optimizer, the GradScaler, the step, the data position (`sample_position`: global samples consumed, so a
resume under another split or accumulation continues with the same samples) and every rank's
RNG states. It is written to a temporary file in the same folder, flushed to disk, then renamed over the
final name: a crash mid-write leaves the previous checkpoints intact and no partial file under a
checkpoint name.
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path

import torch

from job.errors import UsageError

log = logging.getLogger("job")
PATTERN = re.compile(r"^step_(\d{8})\.pt$")
FORMAT_VERSION = 1


def path_for(folder: Path, step: int) -> Path:
    return folder / f"step_{step:08d}.pt"


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in the folder, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def save(folder: Path, step: int, state: dict, *, keep: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    final = path_for(folder, step)
    tmp = folder / f".{final.name}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if tmp.exists():
            tmp.unlink()
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load(path: Path) -> dict:
    """Read a checkpoint on the CPU; a file that is not one of ours is a UsageError, not a traceback."""
    if not path.is_file():
        raise UsageError(f"checkpoint {path} does not exist; give an existing file or train.resume=auto|never")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise UsageError(
            f"checkpoint {path} is corrupt or not a checkpoint ({type(e).__name__}); delete it to resume from "
            "an earlier one, or set train.resume=never"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION or "model" not in state:
        raise UsageError(
            f"checkpoint {path} is not a format-{FORMAT_VERSION} training checkpoint; use one written by "
            "this version, or set train.resume=never"
        )
    return state


def find_resume(resume: str, folder: Path) -> Path | None:
    """The checkpoint `train.resume` asks for, or None to start fresh."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(folder)
        return found[-1] if found else None
    return Path(resume)


def restore_model(model: torch.nn.Module, state: dict, path: Path, workload: str) -> None:
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        first = str(e).strip().splitlines()[1:2] or [str(e)[:200]]
        saved = state.get("config", {}).get("workload", {}).get("name", "?")
        raise UsageError(
            f"checkpoint {path} does not fit this model (saved workload `{saved}`, now `{workload}`: "
            f"{first[0].strip()}); use the same workload settings, another train.run_id, or train.resume=never"
        ) from None
