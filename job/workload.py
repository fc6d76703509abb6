"""The public workload interface: what a job trains, written in the user's own code.

A workload is a `Workload` object: how to build the model, its loss, its data and its own typed settings.
The job finds it by name in the config (`workload=NAME` on the command line, `workload.name` in a file):

- `package.module:attribute` (or `path/to/file.py:attribute`): imported from the working directory,
  `PYTHONPATH` or an installed package; the attribute is a `Workload` (or a function returning one);
- a name registered in the entry-point group `trainjob.workloads` by an installed package;
- a built-in: `tiny`, `resnet50`, `lm` are ordinary workloads of `job.workloads.*`, nothing more.

The name travels in the resolved config, so every process of the job (the plain launcher's ranks, torchrun,
Slurm tasks, containers, pods) imports the same thing. The workload's settings are the config's
`workload.*` keys, typed and checked like every other key.

    from dataclasses import dataclass
    import torch, torch.nn.functional as F
    from torch import nn
    from job.workload import Workload

    @dataclass
    class Settings:
        features: int = 8
        hidden: int = 64
        classes: int = 3

    def model(s: Settings) -> nn.Module:
        return nn.Sequential(nn.Linear(s.features, s.hidden), nn.ReLU(), nn.Linear(s.hidden, s.classes))

    def loss(out, y, reduction="mean"):
        return F.cross_entropy(out, y, reduction=reduction)

    def example_batch(s: Settings, n: int, generator: torch.Generator):
        x = torch.randn(n, s.features, generator=generator, device=generator.device)
        return x, torch.randint(0, s.classes, (n,), generator=generator, device=generator.device)

    workload = Workload(model=model, loss=loss, settings=Settings, example_batch=example_batch)

`python -m job train workload=mytask:workload workload.hidden=128 strategy=ddp` then trains it under any
strategy. docs/workloads.md has the whole interface, real data and validation.

This module imports no torch: loading a config (status, submit, --help) stays fast.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from job.errors import UsageError, worker_reraise

# data.max_pixels' default, the most pixels an image file may have: Pillow's own limit, past which it refuses a
# file as a decompression bomb. 537 MB decoded (RGB): one such image in each worker at once, or alone in a GPU
# decode call (within the memory plan's 1.5 GB margin), where a file of a few KB can claim 65,500 x 65,500
# pixels (12.9 GB).
MAX_PIXELS = 178_956_970

ENTRY_POINT_GROUP = "trainjob.workloads"
BUILTIN = {
    "tiny": "job.workloads.tiny:workload",
    "resnet50": "job.workloads.resnet50:workload",
    "lm": "job.workloads.lm:workload",
}
READERS = ("synthetic",)  # the data kind every workload with an example_batch reads; others come from the workload


@dataclass(frozen=True)
class DataRequest:
    """What `Workload.dataset` is asked for: one data set of `kind` (a `data.kind` the workload lists in
    `data_kinds`) at `path`, for `split` "train" (augment if you do) or "val" (deterministic)."""

    kind: str
    path: str
    split: str = "train"
    seed: int = 0
    token_dtype: str = "uint16"  # data.token_dtype, for token files
    decode: str = "cpu"  # data.decode resolved: where image files are decoded, "cpu" (the workers) or "gpu"
    gpu_share: float = 1.0  # data.gpu_share: with decode "gpu", the fraction of JPEG samples decoded there
    # data.decode=auto on a GPU with workers: a job.datasets.GpuSplit saying, by sample id, which share of the
    # JPEGs to hand undecoded to to_device for the GPU (it starts at none; the run raises it when the workers
    # cannot keep up, and keeps it only where it trains faster). None otherwise; a dataset may ignore it.
    gpu_split: Any = None
    max_pixels: int = MAX_PIXELS  # data.max_pixels: the most pixels an image file may claim (0: no limit)


@dataclass(frozen=True)
class Workload:
    """What a job trains. Only `model` and `loss` are required; every other field has a default.

    Batches are pairs `(x, y)` of tensors whose first dimension is the sample: every strategy splits them
    there. Every callable receives the workload's settings object (an instance of `settings`) first.
    """

    model: Callable[..., Any]
    """model(settings) -> torch.nn.Module, built on the CPU (the strategy moves or shards it)."""
    loss: Callable[..., Any]
    """loss(output, target, reduction="mean") -> scalar: the mean (or, with reduction="sum", the sum) over the
    samples of a per-sample loss. Both reductions are needed: a batch split over cards or ranks is summed
    per part and divided by the whole batch, so the gradient is the full batch's whatever the split."""
    settings: type | None = None
    """A dataclass of the workload's own settings (the config's workload.* keys), with a default each and a
    docstring under each field (shown by --help); None: no settings."""
    example_batch: Callable[..., Any] | None = None
    """example_batch(settings, n, generator) -> (x, y): n random samples shaped like real ones, made on
    `generator.device` from `generator`. Used for data.kind=synthetic and the memory plan's probes; None:
    the probes take the first samples of the dataset, and data.kind=synthetic is not offered."""
    dataset: Callable[..., Any] | None = None
    """dataset(settings, request: DataRequest) -> a map-style torch Dataset whose items are (x, y) samples.
    Samples are addressed by index: the job draws indices by global sample id (a seeded permutation per
    epoch), so resume and any split see the same samples. Two optional methods of the dataset shape the
    path to the model: `collate(items) -> batch` (the DataLoader's collate_fn; default torch's
    default_collate) and `to_device(batch, device) -> (x, y)` (run in the training process; with
    data.prefetch on a background thread, on a side CUDA stream, one batch ahead: draw any randomness from
    the samples' seeds, not a global generator; default: each tensor copied as it is). A to_device with a
    `memory_format` keyword is given train.channels_last's layout (torch.channels_last or
    torch.contiguous_format), to write a 4-d x in it at once; x is put in that layout after it either way.
    job.datasets.ImageFolder uses them to send uint8 pixels, or undecoded JPEGs, and finish the work on the GPU."""
    data_kinds: tuple[str, ...] = ()
    """The data.kind values `dataset` reads (e.g. ("tokens",), ("imagefolder",), ("csv",))."""
    blocks: Callable[..., Sequence[Any]] | None = None
    """blocks(model) -> the repeated sub-modules (transformer blocks, ResNet stages): fsdp shards each on its
    own, train.activation_checkpointing recomputes each in backward. None: fsdp shards the model as one unit
    and activation checkpointing is refused."""
    accuracy: Callable[..., Any] | None = None
    """accuracy(output, target) -> (correct, counted): validation's accuracy, summed over the batch (e.g.
    correct predictions and samples; tokens for an LM). None: validation reports the loss alone."""
    unit: str = "sample"
    """The throughput unit: img, tok, sample..."""
    units_per_sample: Callable[..., int] | int = 1
    """Units in one sample (an int, or units_per_sample(settings): seq_len for an LM)."""
    check: Callable[..., None] | None = None
    """check(settings): raise ValueError("what is wrong; how to fix it") for settings that do not fit
    together (e.g. a width not divisible by the heads). Called when the config is loaded."""

    def units(self, settings) -> int:
        n = self.units_per_sample
        return int(n(settings) if callable(n) else n)

    def kinds(self) -> tuple[str, ...]:
        """Every data.kind this workload reads."""
        synthetic = ("synthetic",) if self.example_batch is not None else ()
        return synthetic + tuple(k for k in self.data_kinds if k != "synthetic")


@dataclass(frozen=True)
class Resolved:
    """A workload found by name, with what the config needs to type its settings."""

    name: str
    workload: Workload
    where: str  # "module:attribute", for messages


# -- finding a workload by name ---------------------------------------------------------------------
_cache: dict[str, Resolved] = {}


def is_reference(name: str) -> bool:
    """A name that points into code (module:attribute or a .py file) rather than a preset or a built-in."""
    return ":" in name or name.endswith(".py")


def resolve(name: str) -> Resolved:
    """The workload called `name` (see the module docstring); UsageError in one line if there is none."""
    if name in _cache:
        return _cache[name]
    if name in BUILTIN:
        target = BUILTIN[name]
    elif not is_reference(name):
        target = _entry_point(name)
        if target is None:
            raise UsageError(f"unknown workload `{name}`; choose one of: {', '.join(known_names())}, or give an "
                             "import path such as `mypackage.task:workload` (your own Workload) or a name in the "
                             f"`{ENTRY_POINT_GROUP}` entry-point group")
    else:
        target = name
    resolved = Resolved(name, _load(name, target), target)
    _cache[name] = resolved
    return resolved


def short_name(name: str) -> str:
    """A workload name fit for run ids and job names: `pkg.task:workload` -> `task`, `task.py:gpt` -> `task-gpt`."""
    import re

    module, _, attr = name.rpartition(":")
    if not module:
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
    stem = Path(module).stem if module.endswith(".py") else module.rsplit(".", 1)[-1]
    short = stem if attr in ("workload", "") else f"{stem}-{attr}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", short)


def known_names() -> list[str]:
    """The workload presets (job/conf/workload), the built-ins and the installed entry points."""
    presets = {p.stem for p in (Path(__file__).parent / "conf" / "workload").glob("*.yaml")}
    return sorted(presets | set(BUILTIN) | set(_entry_points()))


def _entry_points() -> dict[str, str]:
    from importlib.metadata import entry_points

    try:
        return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    except Exception:  # a broken installed distribution must not stop the job
        return {}


def _entry_point(name: str) -> str | None:
    return _entry_points().get(name)


def _load(name: str, target: str) -> Workload:
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"workload `{name}` is not an import path; write it as `module:attribute` "
                         "(e.g. `mytask:workload` for a `workload` object in mytask.py)")
    module = _import(name, module_name)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = sorted(k for k, v in vars(module).items() if isinstance(v, Workload))
            hint = f"; it defines the Workload {', '.join(found)}" if found else (
                "; define `workload = Workload(model=..., loss=...)` there (job.workload)")
            raise UsageError(f"workload `{name}`: {module.__name__} ({_file_of(module)}) has no attribute "
                             f"`{attr}`{hint}")
        obj = getattr(obj, part)
    if not isinstance(obj, Workload) and callable(obj) and not isinstance(obj, type):
        try:
            obj = obj()
        except Exception as e:
            raise UserCodeError(f"workload `{name}`: calling {target}() failed", e) from None
    if not isinstance(obj, Workload):
        raise UsageError(f"workload `{name}`: {target} is a {type(obj).__name__}, not a job.workload.Workload; "
                         "point at `Workload(model=..., loss=...)` or a function returning one")
    _check_shape(name, obj)
    return obj


def _import(name: str, module_name: str):
    if module_name.endswith(".py"):  # a file: its folder goes on the path, so spawned processes find it too
        path = Path(module_name)
        if not path.is_file():
            raise UsageError(f"workload `{name}`: file {module_name} does not exist (relative to {os.getcwd()})")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module_name = path.stem
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise UsageError(
                f"workload `{name}`: no module `{module_name}` on the Python path; run from the folder that "
                f"holds it, add that folder to PYTHONPATH, or pip install your package (working directory: "
                f"{os.getcwd()})") from None
        raise UserCodeError(f"workload `{name}`: importing {module_name} failed", e) from None
    except Exception as e:
        raise UserCodeError(f"workload `{name}`: importing {module_name} failed", e) from None


def _file_of(module) -> str:
    path = getattr(module, "__file__", None)
    return _short_path(path) if path else "?"


def _check_shape(name: str, w: Workload) -> None:
    """The fields are what they claim to be: refused here, before any process starts or any file is written."""
    for key in ("model", "loss"):
        if not callable(getattr(w, key)):
            raise UsageError(f"workload `{name}`: `{key}` must be callable, not {type(getattr(w, key)).__name__}")
    for key in ("example_batch", "dataset", "blocks", "accuracy", "check"):
        value = getattr(w, key)
        if value is not None and not callable(value):
            raise UsageError(f"workload `{name}`: `{key}` must be a function or None, not {type(value).__name__}")
    if w.settings is not None:
        if not (isinstance(w.settings, type) and dataclasses.is_dataclass(w.settings)):
            raise UsageError(f"workload `{name}`: `settings` must be a dataclass (the workload.* keys), not "
                             f"{w.settings!r}")
        clash = [f.name for f in dataclasses.fields(w.settings) if f.name == "name"]
        if clash:
            raise UsageError(f"workload `{name}`: its settings may not have a field `name` (workload.name is the "
                             "workload itself); rename the field")
        missing = [f.name for f in dataclasses.fields(w.settings)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise UsageError(f"workload `{name}`: settings field(s) {', '.join(missing)} have no default; give "
                             "each a default (the config overrides it)")
    if w.example_batch is None and w.dataset is None:
        raise UsageError(f"workload `{name}` has neither `example_batch` nor `dataset`, so there is nothing to "
                         "train on; give one of them")
    if w.dataset is not None and not w.data_kinds:
        raise UsageError(f"workload `{name}` has a `dataset` but no `data_kinds`; list the data.kind values it "
                         "reads, e.g. data_kinds=(\"csv\",)")
    if not isinstance(w.unit, str) or not w.unit:
        raise UsageError(f"workload `{name}`: `unit` must be a short name such as img or tok")


def settings_fields(w: Workload) -> list[dataclasses.Field]:
    return list(dataclasses.fields(w.settings)) if w.settings is not None else []


def settings_object(w: Workload, section) -> Any:
    """The workload's settings object from the config's workload section (a DictConfig or a mapping)."""
    if w.settings is None:
        return None
    values = {f.name: section[f.name] for f in settings_fields(w) if f.name in section}
    return w.settings(**values)


def check_settings(r: Resolved, section) -> None:
    """The workload's own `check`, as one line naming the workload."""
    if r.workload.check is None:
        return
    settings = settings_object(r.workload, section)
    try:
        r.workload.check(settings)
    except (ValueError, TypeError, AssertionError) as e:
        raise UsageError(f"workload `{r.name}`: {e or type(e).__name__}") from None
    except Exception as e:
        raise UserCodeError(f"workload `{r.name}`: its check() failed", e) from None


# -- errors in the user's code ----------------------------------------------------------------------
_OURS = (os.sep + "job" + os.sep,)


def user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of `exc`'s traceback in the user's code: not this package, not the standard library, not
    installed packages (torch...)."""
    return [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]


def _is_user_file(filename: str) -> bool:
    """Whether a traceback's file is the user's: not this package, not the standard library, not installed
    packages (torch...), not generated code (`<string>`)."""
    if filename.startswith("<"):
        return False
    path = str(Path(filename).resolve())
    here = str(Path(__file__).resolve().parent)
    if path.startswith(here + os.sep) or "site-packages" in path or "dist-packages" in path:
        return False
    prefixes = {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    return not any(path.startswith(p + os.sep + "lib") for p in prefixes)


def describe_user_error(exc: BaseException) -> str:
    """`ValueError: bad shape (at task.py:14 in model <- task.py:40 in forward)`: the exception and the user's
    frames, innermost last, in one line."""
    first = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    frames = user_frames(exc)
    if frames:
        where = " <- ".join(f"{_short_path(f.filename)}:{f.lineno} in {f.name}" for f in reversed(frames[-3:]))
        text += f" (at {where})"
    return text


_TB_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)', re.MULTILINE)


def describe_worker_error(exc: BaseException) -> str | None:
    """An exception a DataLoader worker raised, as the training process re-raises it (`Caught ValueError in
    DataLoader worker process 0.` and the worker's traceback as text), in one line: the worker's own message
    and its frames in the user's code, `ValueError: row 52 is unreadable (in DataLoader worker 0, at
    task.py:20 in __getitem__)`; None for any other exception."""
    # The message itself: str() of a KeyError is its repr, quoted, with the traceback's line breaks escaped.
    text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    found = worker_reraise(text)
    if found is None:
        return None
    name, worker, message = found
    frames = [(path, line, fn) for path, line, fn in _TB_FRAME.findall(text) if _is_user_file(path)]
    where = f"in DataLoader worker {worker}"
    if frames:
        where += ", at " + " <- ".join(f"{_short_path(p)}:{ln} in {fn}" for p, ln, fn in reversed(frames[-3:]))
    return f"{name}: {message} ({where})" if message is not None else f"{name} ({where})"


def _short_path(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


class UserCodeError(UsageError):
    """An exception raised in the user's workload code, reported once as one line with the user's frames."""

    def __init__(self, what: str, exc: BaseException):
        super().__init__(f"{what}: {describe_user_error(exc)}")
        self.original = exc


def call(what: str, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs); an exception in it becomes one UserCodeError line naming `what` and the user's
    frames."""
    try:
        return fn(*args, **kwargs)
    except UsageError:
        raise
    except Exception as e:
        raise UserCodeError(what, e) from None


def settings_docs(cls: type) -> dict[str, str]:
    """Field -> docstring (the string under each field), for --help."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    docs = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and i + 1 < len(body):
                    nxt = body[i + 1]
                    if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                        docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs
