"""Checkpoints: strategy-independent state, written atomically, read without running code.

A checkpoint is `<run>/checkpoints/step_XXXXXXXX.pt`, a dict with the unwrapped model state dict, the
optimizer, the GradScaler, the step, the data position (`sample_position`: global samples consumed, so a
resume under another split or accumulation continues with the same samples), every rank's
RNG states and the resolved config: tensors and plain Python data only, so it loads with
`torch.load(weights_only=True)`. A file holding anything else (a pickle that would import or call code)
is refused unread.

It is written to a hidden temporary file in the same folder (`.step_XXXXXXXX.pt.tmp.<pid>`), flushed to
disk, then renamed over the final name. A failed write (disk full, quota, I/O error) removes the
temporary file and raises `WriteFailed`; older checkpoints are deleted only after the new one is in
place. A writer killed mid-write leaves only its temporary file, which the next run removes
(job.rundir).
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import warnings
from pathlib import Path

import torch

from job.errors import UsageError
from job.rundir import free_space, temp_path

log = logging.getLogger("job")
PATTERN = re.compile(r"^step_(\d{8})\.pt$")
FORMAT_VERSION = 1
_IN_FLIGHT: list[Path] = []  # the temporary file `save` is writing now, for a stop that cannot wait for it


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


class WriteFailed(Exception):
    """A checkpoint could not be written; the checkpoints already on disk are intact."""


class _Recorder:
    """The file torch.save writes into: keeps the OSError that torch turns into a vague RuntimeError."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save(folder: Path, step: int, state: dict, *, keep: int) -> Path:
    """Write `state` as the checkpoint of `step`, then delete all but the newest `keep`. Any OSError of the
    write (disk full, quota, I/O error, too many open files) is `WriteFailed` and leaves the checkpoints as
    they were. The file is created 0600, never through a symlink."""
    final = path_for(folder, step)
    tmp = temp_path(final)
    _IN_FLIGHT[:] = [tmp]
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            out = _Recorder(f)
            try:
                torch.save({"format": FORMAT_VERSION, **state}, out)
            except RuntimeError:
                if out.error is None:
                    raise
                raise out.error from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        raise WriteFailed(
            f"checkpoint {final} was not written ({e.strerror or e}; {free_space(folder)} free there)"
        ) from None
    finally:
        _IN_FLIGHT.clear()
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    try:  # the new one is in place: an old one that cannot be deleted now is deleted by a later save
        for old in list_checkpoints(folder)[:-keep]:
            old.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not delete older checkpoints in %s (%s); they are deleted at the next checkpoint",
                    folder, e.strerror or e)
    return final


def discard_partial() -> None:
    """Remove the half-written file of a checkpoint being saved now, if any: a process that leaves at once
    (a second Ctrl-C, job.failure.stop_now) leaves no partial checkpoint behind. The checkpoints already
    written are untouched."""
    for tmp in list(_IN_FLIGHT):
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def step_of(path: Path) -> int | None:
    m = PATTERN.match(path.name)
    return int(m.group(1)) if m else None


def load(path: Path) -> dict:
    """Read a checkpoint on the CPU, tensors and plain data only; anything else is a UsageError."""
    if not path.is_file():
        raise UsageError(f"checkpoint {path} does not exist; give an existing file or train.resume=auto|never")
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols before refusing
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if "Weights only load failed" in str(e) and "GLOBAL" in str(e):
            raise UsageError(
                f"checkpoint {path} holds Python objects other than tensors and plain data ({_unsafe_detail(e)}) "
                "and was not loaded: unpickling it could run code. Resume from a checkpoint this job wrote, "
                "or start over (another train.run_id, or train.resume=overwrite)"
            ) from None
        raise UsageError(
            f"checkpoint {path} is corrupt or not a checkpoint ({type(e).__name__}{_detail(e)}); delete it to resume from "
            "an earlier one, or start over (another train.run_id, or train.resume=overwrite)"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION or "model" not in state:
        raise UsageError(
            f"checkpoint {path} is not a format-{FORMAT_VERSION} training checkpoint; use one written by "
            "this version, or start over (another train.run_id, or train.resume=overwrite)"
        )
    for key in ("step", "data_position"):
        if not isinstance(state.get(key), int) or isinstance(state.get(key), bool) or state[key] < 0:
            raise UsageError(
                f"checkpoint {path} has no valid `{key}` (found {_shown(state.get(key))}); it is not a complete "
                "training checkpoint: delete it to resume from an earlier one, or start over (another train.run_id, "
                "or train.resume=overwrite)"
            )
    problem = _field_problem(state)
    if problem:
        raise UsageError(f"checkpoint {path} has a corrupt {problem}; delete it to resume from an earlier one, or "
                         "start over (another train.run_id, or train.resume=overwrite)")
    return state


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_count(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _field_problem(state: dict) -> str | None:
    """What in a loaded checkpoint cannot be used as the trainer will use it (None: every field can): each
    field is checked here, before any of it is restored, so a bad one is one line and nothing is half-set."""
    model = state["model"]
    if not isinstance(model, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in model.items()):
        return "`model` (not a state dict of named tensors)"
    if "sample_position" in state and not _is_count(state["sample_position"]):
        return f"`sample_position` (found {_shown(state['sample_position'])}, not a count of samples)"
    if "world_size" in state and not _is_count(state["world_size"], 1):
        return f"`world_size` (found {_shown(state['world_size'])})"
    opt = state.get("optimizer")
    if opt is not None and not (isinstance(opt, dict) and isinstance(opt.get("state", {}), dict)
                                and isinstance(opt.get("param_groups", []), list)):
        return "`optimizer` (not an optimizer state dict)"
    for key in ("scaler", "config"):
        if state.get(key) is not None and not isinstance(state[key], dict):
            return f"`{key}` (found {type(state[key]).__name__}, not a mapping)"
    scale = (state.get("scaler") or {}).get("scale")
    if scale is not None and not isinstance(scale, (int, float)):
        return f"`scaler.scale` (found {_shown(scale)})"
    rngs = state.get("rng")
    if rngs is None:
        return None
    if not isinstance(rngs, list):
        return f"`rng` (found {type(rngs).__name__}, not a list of per-rank states)"
    for rank, rng in enumerate(rngs):
        problem = _rng_problem(rng)
        if problem:
            return f"`rng[{rank}]` ({problem})"
    return None


def _rng_problem(rng) -> str | None:
    """Why one rank's saved RNG state cannot be restored, tried on throw-away generators."""
    if not isinstance(rng, dict) or "python" not in rng or "torch" not in rng:
        return "not a mapping with python and torch states"
    try:
        random.Random().setstate(rng["python"])
    except (TypeError, ValueError, OverflowError) as e:
        return f"python state: {e}"
    t = rng["torch"]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        return "torch state is not a byte tensor"
    try:
        torch.Generator().set_state(t)
    except (RuntimeError, TypeError, ValueError) as e:
        return f"torch state: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    cuda = rng.get("cuda", [])
    if not isinstance(cuda, list) or not all(isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in cuda):
        return "cuda states are not byte tensors"
    return None


def _detail(e: Exception) -> str:
    return f": {_unsafe_detail(e)}" if "Weights only load failed" in str(e) else ""


def _unsafe_detail(e: Exception) -> str:
    """The line of torch's weights-only refusal that says what was found (e.g. `GLOBAL posix.system`)."""
    for line in str(e).splitlines():
        line = line.strip()
        if line and not line.startswith(("Weights only load failed", "Please file", "Check the documentation",
                                          "WeightsUnpickler error")):
            return line.rstrip(".")
    return "not a weights-only file"


def check_fits(state: dict, path: Path, cfg) -> None:
    """Refuse a checkpoint that would poison this run: another optimizer, or non-finite weights."""
    want = cfg.train.optimizer
    saved = (state.get("config") or {}).get("train", {}).get("optimizer") or _optimizer_kind(state.get("optimizer"))
    if saved and saved != want:
        raise UsageError(
            f"checkpoint {path} holds {saved} optimizer state but train.optimizer={want}; resume with "
            f"train.optimizer={saved}, or start over with another train.run_id or train.resume=overwrite"
        )
    for name, tensor in (state.get("model") or {}).items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = "nan" if torch.isnan(tensor).any() else "inf"
            raise UsageError(
                f"checkpoint {path} holds non-finite weights ({bad} in `{name}`); delete it to resume from an "
                "earlier checkpoint, or start over (another train.run_id, or train.resume=overwrite)"
            )
    scale = (state.get("scaler") or {}).get("scale")
    if isinstance(scale, float) and not math.isfinite(scale):
        raise UsageError(f"checkpoint {path} holds a non-finite fp16 loss scale ({scale}); delete it to resume "
                         "from an earlier checkpoint, or start over (another train.run_id, or train.resume=overwrite)")


def _optimizer_kind(sd) -> str | None:
    """sgd/adamw from the state's keys, for checkpoints that carry no config."""
    for per_param in ((sd or {}).get("state") or {}).values():
        if "exp_avg" in per_param:
            return "adamw"
        if "momentum_buffer" in per_param:
            return "sgd"
    return None


def find_resume(resume: str, folder: Path) -> Path | None:
    """The checkpoint `train.resume` asks for, or None to start fresh."""
    if resume == "overwrite":  # asked for: the run directory's earlier run is replaced (job.rundir)
        return None
    if resume == "never":
        found = run_files(folder.parent)
        if found:
            raise UsageError(
                f"train.resume=never but {folder.parent} already holds a run ({', '.join(found)}), which starting "
                "over would replace; pick a new train.run_id, or say train.resume=overwrite to replace it"
            )
        return None
    if resume == "auto":
        found = list_checkpoints(folder)
        return found[-1] if found else None
    return Path(resume)


def run_files(run: Path) -> list[str]:
    """What of a run the directory holds: checkpoints, metrics, config, summary (empty: no run there)."""
    found = []
    n = len(list_checkpoints(run / "checkpoints"))
    if n:
        found.append(f"{n} checkpoint{'s' if n > 1 else ''}")
    found += [name for name in ("metrics.jsonl", "config.yaml", "summary.json") if (run / name).is_file()]
    return found


def mismatch(model_state: dict, saved: dict, *, shown: int = 3) -> str:
    """The first few differences between a model's state dict and a checkpoint's, with their counts."""
    missing = [k for k in model_state if k not in saved]
    unexpected = [k for k in saved if k not in model_state]
    shapes = [f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}" for k, v in model_state.items()
              if k in saved and isinstance(saved[k], torch.Tensor) and tuple(saved[k].shape) != tuple(v.shape)]
    parts = []
    for what, items in (("missing from the checkpoint", missing), ("not in this model", unexpected),
                        ("of another shape (saved vs now)", shapes)):
        if items:
            more = f" and {len(items) - shown} more" if len(items) > shown else ""
            parts.append(f"{len(items)} {what}: {', '.join(items[:shown])}{more}")
    return "; ".join(parts)


def restore_model(model: torch.nn.Module, state: dict, path: Path, workload: str) -> None:
    saved = ((state.get("config") or {}).get("workload") or {}).get("name", "?")
    diff = mismatch(model.state_dict(), state["model"])
    try:
        if diff:
            raise RuntimeError(diff)
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        what = diff or (str(e).strip().splitlines() or ["?"])[0][:200]
        raise UsageError(
            f"checkpoint {path} does not fit this model (saved workload `{saved}`, now `{workload}`; {what}); use "
            "the same workload settings, another train.run_id, or train.resume=overwrite"
        ) from None
