"""`python -m job bench`: the strategies side by side, each in a fresh process through the real trainer.

Three modes (bench.mode):

- **compare** (the default). For every workload (bench.workloads, or the config's one), `bench.repeats`
  times, the order rotated by one each repeat so no strategy always runs first or last:
    1. the 1-card baseline: bench.baseline on the first visible card (CUDA_VISIBLE_DEVICES), global
       batch divided by the card count, so the per-card batch is the same as in the multi-card runs;
    2. every strategy of bench.strategies on all visible cards;
    3. with bench.imagefolder (image workloads): every strategy again on JPEG files generated on disk,
       decoded by DataLoader workers into pinned memory, copied with data.prefetch;
  then, once, with bench.telemetry_overhead, bench.telemetry_strategy with telemetry.port off and on
  (scraped), bench.telemetry_repeats times; the strategy's first run in 2. is the first "off" run.
  The table shows, per row, the median and the range (min-max) of the repeats; a ratio between two
  rows is called a claim only when their ranges do not overlap.
- **maxbatch**: per strategy, the largest global batch that trains: trials of bench.maxbatch_steps real
  steps, each in a fresh `python -m job train`, the batch doubled from bench.maxbatch_start until one
  does not fit, then bisected (search_max_batch). A trial that runs out of memory, or that the memory
  plan refuses ("does not fit", exit 2), is too big; any other failure stops that strategy's search.
- **profile**: where a single-process strategy's step time goes: a few steps under torch.profiler in
  a fresh process (`python -m job.bench`, profile_main), the phases timed between device syncs, the top
  operators by CUDA time (CPU time without a GPU); written to profile-<workload>-<strategy>.txt/.json.

Every trainer run gets the user's overrides (what the command line and --config changed against the
workload's preset) through overrides.yaml, plus the bench's own keys: steps, warm-up, no periodic
checkpoint, run directory. An unknown strategy is refused before anything runs (exit 2); a run that
fails (OOM, crash, timeout) is reported with its error line and the others still run. With
bench.tenant_gb, a child process holds that much memory on card 0 for the whole bench (the shared-card
case), and is killed on every way out.

Throughput comes from the run's metrics.jsonl: the trainer synchronises the devices and logs at step
`warmup` and at the last step (train.log_every = warm-up), so the timed window is exactly the steps
after warm-up. Per-card memory (torch peak allocated/reserved, NVML used at the end) comes from
summary.json; the trainer resets the peak counters when its clock starts, so every strategy's peaks
cover the same window, the timed steps (summary.json's peak_window; checked here).

Without a GPU: `cards` are processes. ddp runs bench.cpu_procs processes over gloo, the baseline
one process with the global batch divided by bench.cpu_procs; dp runs one process (DataParallel on
a CPU is the plain module), so it has no scaling figure. Numbers measured this way say nothing
about GPUs; the CPU run exists so CI exercises the whole path (table, JSON, chart).

Writes to the output folder: bench.json (every number and the environment; RESULT_SCHEMA below),
bench.png (compare: per-card memory and throughput with their ranges; maxbatch: the largest batch and
the per-card peaks at it), overrides.yaml, logs/<run>.log and runs/<run>/ (the trainer's run
directories, checkpoints removed). Prints one table per workload last.
Exit code: 0 if every run that was started succeeded (maxbatch: every search ended without an error),
1 if one failed, 2 on bad input, 75 if the benchmark itself was interrupted (results are still written).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from job import config as config_mod
from job.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError

log = logging.getLogger("job")
MB = 1024 * 1024  # MB in tables means MiB, as in the trainer's table (job/report.py)
GIB = 1024**3
GB = 1e9  # bench.tenant_gb and memory.cap_gb: decimal GB, as the memory plan
SCHEMA_ID = "trainjob-bench/2"
ROOT = Path(__file__).resolve().parent.parent

# Keys the benchmark sets on every run; the user's values for them are not passed on.
BENCH_KEYS = ("train.steps", "train.timing_warmup", "train.log_every", "train.checkpoint_every",
              "train.run_dir", "train.run_id", "train.resume")
# Keys that pick what is compared rather than how it runs.
PICK_KEYS = ("strategy.name", "workload.name")
# Runs whose numbers are compared across repeats (one table row each).
COMPARED = ("baseline", "strategy", "imagefolder")
# What a trial's error line says when it ran out of memory: CUDA's and the trainer's wording, and the
# CPU allocator's ("can't allocate memory", "not enough memory").
OOM_WORDS = ("out of memory", "can't allocate memory", "not enough memory")
IMAGE_CLASSES = 10


# -- the JSON written to bench.json ------------------------------------------------------------


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    """A JSON-schema object with exactly these keys, all required."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


_STR, _INT, _NUM, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


CARD_SCHEMA = _obj({
    "rank": _INT, "device": _STR, "name": _STR, "uuid": _STR, "pci_bus_id": _STR,
    "peak_allocated_bytes": _INT, "peak_reserved_bytes": _INT,
    "nvml_used_bytes": _nullable(_INT), "nvml_total_bytes": _nullable(_INT),
})
RUN_SCHEMA = _obj({
    "name": _STR,
    "kind": {"enum": ["baseline", "strategy", "imagefolder", "telemetry_off", "telemetry_on", "maxbatch_trial",
                      "profile"]},
    "strategy": _STR,
    "repeat": _INT,
    "data": {"enum": ["synthetic", "imagefolder"]},
    "status": {"enum": ["ok", "failed", "skipped", "interrupted"]},
    "reason": _nullable(_STR),
    "exit_code": _nullable(_INT),
    "command": _array(_STR),
    "env": {"type": "object", "additionalProperties": _STR},
    "run_dir": _nullable(_STR),
    "log": _nullable(_STR),
    "wall_s": _nullable(_NUM),
    "batch_size": _nullable(_INT),
    "world_size": _nullable(_INT),
    "units": _nullable(_INT),
    "timed_steps": _nullable(_INT),
    "samples_per_s": _nullable(_NUM),
    "units_per_s": _nullable(_NUM),
    "step_s": _nullable(_NUM),
    "trainer_samples_per_s": _nullable(_NUM),
    "imbalance": _nullable(_NUM),
    "scaling_vs_1": _nullable(_NUM),
    "scaling_note": _nullable(_STR),
    "peak_window": _nullable(_array(_nullable(_INT))),
    "window_note": _nullable(_STR),
    "cards": _array(CARD_SCHEMA),
    "scrapes_ok": _nullable(_INT),
    "scrapes_failed": _nullable(_INT),
})
SPREAD_SCHEMA = _obj({"median": _NUM, "min": _NUM, "max": _NUM, "n": _INT})
SUMMARY_SCHEMA = _obj({
    "name": _STR, "kind": {"enum": list(COMPARED)}, "strategy": _STR,
    "data": {"enum": ["synthetic", "imagefolder"]},
    "runs": _INT, "ok": _INT, "world_size": _nullable(_INT), "units": _nullable(_INT),
    "samples_per_s": _nullable(SPREAD_SCHEMA), "units_per_s": _nullable(SPREAD_SCHEMA),
    "busiest_peak_bytes": _nullable(SPREAD_SCHEMA), "imbalance": _nullable(SPREAD_SCHEMA),
    "scaling_vs_1": _nullable(_NUM), "scaling_note": _nullable(_STR),
    "peak_window": _nullable(_array(_nullable(_INT))), "same_window": _BOOL,
    "cards": _array(_obj({"rank": _INT, "device": _STR, "peak_allocated_bytes": SPREAD_SCHEMA,
                          "peak_reserved_bytes": SPREAD_SCHEMA, "nvml_used_bytes": _nullable(SPREAD_SCHEMA)})),
    "status": _STR,
})
COMPARISON_SCHEMA = _obj({
    "a": _STR, "b": _STR, "metric": {"enum": ["units_per_s", "busiest_peak_bytes"]},
    "ratio": _nullable(_NUM), "a_median": _NUM, "b_median": _NUM,
    "claim": _BOOL, "verdict": {"enum": ["ranges do not overlap", "overlapping", "one run each: no claim"]},
})
TRIAL_SCHEMA = _obj({"batch": _INT, "outcome": {"enum": ["fits", "too_big", "error", "interrupted"]},
                     "reason": _nullable(_STR), "run": _nullable(_STR), "wall_s": _nullable(_NUM)})
MAXBATCH_SCHEMA = _obj({
    "strategy": _STR, "granularity": _INT, "minimum": _INT, "start": _INT,
    "largest": _nullable(_INT), "smallest_too_big": _nullable(_INT), "exact": _BOOL,
    "stopped": _nullable(_STR), "error": _BOOL, "trials": _array(TRIAL_SCHEMA),
    "run": _nullable(_STR), "cards": _array(CARD_SCHEMA), "units_per_s": _nullable(_NUM),
})
OVERHEAD_SCHEMA = _obj({
    "strategy": _STR,
    "repeats": _INT,
    "scrape_interval_s": _NUM,
    "off_runs": _array(_STR),
    "on_runs": _array(_STR),
    "off_step_s": _array(_NUM),
    "on_step_s": _array(_NUM),
    "off_median_step_s": _nullable(_NUM),
    "on_median_step_s": _nullable(_NUM),
    "overhead": _nullable(_NUM),
    "scrapes_ok": _INT,
    "note": _nullable(_STR),
})
PROFILE_SCHEMA = _obj({
    "workload": _STR, "strategy": _STR, "device": _STR, "warmup": _INT, "steps": _INT, "step_ms": _NUM,
    "phases": _array(_obj({"name": _STR, "depth": _INT, "ms_per_step": _NUM, "share": _NUM, "calls": _INT})),
    "sort_by": {"enum": ["self_cuda_ms", "self_cpu_ms"]},
    "top_ops": _array(_obj({"name": _STR, "calls": _INT, "self_cuda_ms": _NUM, "self_cpu_ms": _NUM})),
    "summary": _STR, "trace": _nullable(_STR), "note": _STR,
})
WORKLOAD_SCHEMA = _obj({
    "workload": _STR,
    "unit": {"enum": ["img", "tok"]},
    "units_per_sample": _INT,
    "global_batch": _INT,
    "cards": _INT,
    "runs": _array(RUN_SCHEMA),
    "summary": _array(SUMMARY_SCHEMA),
    "comparisons": _array(COMPARISON_SCHEMA),
    "telemetry_overhead": _nullable(OVERHEAD_SCHEMA),
    "imagefolder": _nullable(_obj({"path": _STR, "images": _INT, "classes": _INT, "bytes": _INT,
                                   "generated_s": _nullable(_NUM)})),
    "maxbatch": _nullable(_array(MAXBATCH_SCHEMA)),
    "profiles": _nullable(_array(PROFILE_SCHEMA)),
})
ENV_SCHEMA = _obj({
    "date": _STR, "hostname": _STR, "command": _STR, "python": _STR, "platform": _STR, "cpu": _STR,
    "cpu_count": _INT, "torch": _STR, "torch_cuda": _nullable(_STR), "cudnn": _nullable(_INT),
    "nccl": _nullable(_STR), "torchvision": _nullable(_STR),
    "driver": _nullable(_STR), "cuda_driver": _nullable(_STR), "gpu_model": _nullable(_STR),
    "gpus": _array(_obj({"name": _STR, "uuid": _STR, "pci_bus_id": _STR, "memory_total_bytes": _nullable(_INT)})),
    "cuda_visible_devices": _nullable(_STR), "commit": _nullable(_STR), "commit_dirty": _nullable(_BOOL),
})
RESULT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "python -m job bench: results",
    **_obj({
        "schema": {"const": SCHEMA_ID},
        "mode": {"enum": ["compare", "maxbatch", "profile"]},
        "device": {"enum": ["cuda", "cpu"]},
        "cards": _INT,
        "settings": _obj({
            "steps": _INT, "warmup": _INT, "repeats": _INT, "strategies": _array(_STR),
            "workloads": _array(_STR), "baseline": _STR, "cpu_procs": _INT, "overrides": {"type": "object"},
            "out": _STR, "imagefolder": _BOOL,
            "maxbatch": _obj({"start": _INT, "steps": _INT, "trials": _INT, "minutes": _NUM, "precision": _NUM}),
        }),
        "tenant": _nullable(_obj({"gb": _NUM, "device": _STR, "pid": _INT})),
        "environment": ENV_SCHEMA,
        "workloads": _array(WORKLOAD_SCHEMA),
        "chart": _nullable(_STR),
        "failed": _INT,
    }),
}


# -- what to pass on to every run --------------------------------------------------------------


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def user_overrides(cfg) -> dict[str, Any]:
    """What the command line and --config changed against the workload's preset: {dotted key: value}.

    These go to every run (every maxbatch trial too). The bench's own keys, the strategy/workload
    picks and bench.* do not.
    """
    from omegaconf import OmegaConf

    base = config_mod.load([f"workload={cfg.workload.name}"])
    have = _flatten(OmegaConf.to_container(cfg, resolve=True))
    ref = _flatten(OmegaConf.to_container(base, resolve=True))
    return {k: v for k, v in have.items()
            if ref.get(k) != v and not k.startswith("bench.") and k not in BENCH_KEYS + PICK_KEYS}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _strategy_arg(name: str) -> str:
    return f"strategy={name}" if name in config_mod.preset_names("strategy") else f"strategy.name={name}"


def _registered_name(name: str) -> str:
    """The registry name a strategy preset selects (the preset's strategy.name; else the name itself)."""
    path = config_mod.CONF_DIR / "strategy" / f"{name}.yaml"
    if path.is_file():
        from omegaconf import OmegaConf

        picked = OmegaConf.select(OmegaConf.load(path), "strategy.name")
        if picked:
            return str(picked)
    return name


def _unknown_strategy(name: str, key: str) -> str | None:
    """Why `name` (a preset or a registered strategy) cannot run, or None."""
    from job.strategies import REGISTRY

    presets = config_mod.preset_names("strategy")
    real = _registered_name(name)
    if real in REGISTRY:
        return None
    choices = ", ".join(sorted(set(presets) | set(REGISTRY)))
    if name in presets:
        return (f"strategy preset `{name}` in {key} selects `{real}`, which job.strategies.REGISTRY does not "
                f"have; choose from: {choices}")
    return f"unknown strategy `{name}` in {key}; choose from: {choices}"


def _multi_process(name: str) -> bool:
    from job.strategies import REGISTRY

    return REGISTRY[_registered_name(name)].multi_process


# -- repeats: median and range ------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, Any] | None:
    """Median and range of the repeats' values (None when there are none)."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def overlapping(a: dict, b: dict) -> bool:
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def compare(a_name: str, b_name: str, metric: str, a: dict, b: dict) -> dict[str, Any]:
    """a/b's ratio of medians, stated as a claim only when both have repeats and the ranges do not overlap."""
    if min(a["n"], b["n"]) < 2:
        verdict = "one run each: no claim"
    elif overlapping(a, b):
        verdict = "overlapping"
    else:
        verdict = "ranges do not overlap"
    return {"a": a_name, "b": b_name, "metric": metric,
            "ratio": a["median"] / b["median"] if b["median"] else None,
            "a_median": a["median"], "b_median": b["median"],
            "claim": verdict == "ranges do not overlap", "verdict": verdict}


def _card_key(c: dict) -> tuple:
    return (c["rank"], c["device"])


def summarize(runs: list[dict], names: list[str], *, window: list[int]) -> list[dict]:
    """One row per compared run name (in `names` order): median and range over its repeats."""
    rows = []
    for name in names:
        group = [r for r in runs if r["name"] == name and r["kind"] in COMPARED]
        if not group:
            continue
        ok = [r for r in group if r["status"] == "ok"]
        cards = []
        layout = {tuple(_card_key(c) for c in sorted(r["cards"], key=_card_key)) for r in ok}
        if ok and len(layout) == 1:
            for i, key in enumerate(next(iter(layout))):
                per = [sorted(r["cards"], key=_card_key)[i] for r in ok]
                used = [c["nvml_used_bytes"] for c in per]
                cards.append({"rank": key[0], "device": key[1],
                              "peak_allocated_bytes": spread([c["peak_allocated_bytes"] for c in per]),
                              "peak_reserved_bytes": spread([c["peak_reserved_bytes"] for c in per]),
                              "nvml_used_bytes": spread(used) if None not in used else None})
        first = group[0]
        reasons = sorted({f"{r['status']}: {r['reason']}" for r in group if r["status"] != "ok"})
        status = "ok" if len(ok) == len(group) else (f"ok {len(ok)}/{len(group)}; " if ok else "") + "; ".join(reasons)
        rows.append({
            "name": name, "kind": first["kind"], "strategy": first["strategy"], "data": first["data"],
            "runs": len(group), "ok": len(ok),
            "world_size": ok[0]["world_size"] if ok else None, "units": ok[0]["units"] if ok else None,
            "samples_per_s": spread([r["samples_per_s"] for r in ok]),
            "units_per_s": spread([r["units_per_s"] for r in ok]),
            "busiest_peak_bytes": spread([max(c["peak_allocated_bytes"] for c in r["cards"]) for r in ok
                                          if r["cards"]]),
            "imbalance": spread([r["imbalance"] for r in ok]),
            "scaling_vs_1": None, "scaling_note": None,
            "peak_window": ok[0]["peak_window"] if ok else None,
            "same_window": all(r["peak_window"] == window for r in ok),
            "cards": cards, "status": status,
        })
    return rows


def summary_scaling(rows: list[dict], n: int) -> None:
    """scaling vs 1 from the medians: throughput_n / (n x throughput_1), for rows that used the n cards."""
    base = next((r for r in rows if r["kind"] == "baseline"), None)
    for r in rows:
        if r["kind"] == "baseline" or r["units_per_s"] is None:
            continue
        if base is None or base["units_per_s"] is None:
            r["scaling_note"] = "no baseline" if base is None else "baseline did not run"
        elif r["units"] != n:
            r["scaling_note"] = f"ran on {r['units']} card(s)/process(es), the baseline is 1 of {n}"
        else:
            r["scaling_vs_1"] = r["units_per_s"]["median"] / (n * base["units_per_s"]["median"])


def comparisons(rows: list[dict]) -> list[dict]:
    """Every pair of strategy rows (throughput; busiest card's peak where cards were measured), and each
    imagefolder row against its strategy's synthetic row (throughput: where the input pipeline limits)."""
    out = []
    strat = [r for r in rows if r["kind"] == "strategy" and r["units_per_s"]]
    for i, a in enumerate(strat):
        for b in strat[i + 1:]:
            out.append(compare(a["name"], b["name"], "units_per_s", a["units_per_s"], b["units_per_s"]))
            if a["busiest_peak_bytes"] and b["busiest_peak_bytes"]:
                out.append(compare(a["name"], b["name"], "busiest_peak_bytes", a["busiest_peak_bytes"],
                                   b["busiest_peak_bytes"]))
    for r in rows:
        if r["kind"] == "imagefolder" and r["units_per_s"]:
            syn = next((s for s in strat if s["strategy"] == r["strategy"]), None)
            if syn is not None:
                out.append(compare(r["name"], syn["name"], "units_per_s", r["units_per_s"], syn["units_per_s"]))
    return out


def rotated(items: list, repeat: int) -> list:
    """The run order of repeat `repeat` (0-based): rotated by one per repeat."""
    if not items:
        return []
    k = repeat % len(items)
    return items[k:] + items[:k]


# -- maxbatch: the search -----------------------------------------------------------------------


def batch_rule(*, multi_process: bool, ranks: int, cards: int, accum: int, split: str | None) -> tuple[int, int]:
    """(granularity, minimum) of the global batches a strategy accepts.

    An even ddp splits every micro-batch equally over its ranks: a multiple of ranks x accum_steps. An
    uneven ddp (strategy.split auto or explicit) and dp/balanced need at least one sample per rank/card
    in every micro-batch: >= ranks (cards) x accum_steps, any multiple of accum_steps.
    """
    if multi_process and ranks > 1:
        if split in (None, "even"):
            return ranks * accum, ranks * accum
        return accum, ranks * accum
    return accum, max(1, cards) * accum


def classify_trial(exit_code: int | None, reason: str | None) -> str:
    """fits | too_big (out of memory, or the memory plan's refusal) | error (anything else)."""
    if exit_code == EXIT_OK:
        return "fits"
    text = (reason or "").lower()
    if exit_code == EXIT_USAGE and "does not fit" in text:
        return "too_big"
    if exit_code not in (None, EXIT_INTERRUPTED) and any(w in text for w in OOM_WORDS):
        return "too_big"
    return "error"


def _hint(reason: str | None) -> int | None:
    """The memory plan's "the largest that fits is N" in a refusal, if any."""
    text = reason or ""
    key = "the largest that fits is "
    at = text.find(key)
    if at < 0:
        return None
    digits = ""
    for ch in text[at + len(key):]:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def search_max_batch(trial: Callable[[int], tuple[str, str | None]], *, start: int, granularity: int,
                     minimum: int, max_trials: int, deadline_s: float, precision: float = 0.0,
                     clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """The largest batch for which `trial(batch)` returns ("fits", _).

    Batches are multiples of `granularity`, at least `minimum`. Doubling from `start` until a trial is
    too big, then bisection between the largest that fits and the smallest too big, until they are one
    granularity apart, or (precision > 0) the gap is at most precision x the largest that fits. A
    refusal naming "the largest that fits is N" (the memory plan) makes N the next trial. An "error"
    (or "interrupted") outcome stops the search; so do `max_trials` trials and `deadline_s` seconds.
    Monotonic in the batch: assumes a batch that fits means every smaller one does.
    """
    g = granularity
    kmin = -(-minimum // g)
    k = max(kmin, -(-start // g))
    lo, hi = kmin - 1, None  # lo: largest k known to fit (kmin - 1: none yet); hi: smallest k known too big
    trials: list[dict] = []
    stopped, error = None, False
    t0 = clock()
    while True:
        if len(trials) >= max_trials:
            stopped = f"stopped after {max_trials} trials (bench.maxbatch_trials)"
            break
        if clock() - t0 >= deadline_s:
            stopped = f"stopped after {deadline_s / 60:g} min (bench.maxbatch_minutes)"
            break
        batch = k * g
        outcome, reason = trial(batch)
        trials.append({"batch": batch, "outcome": outcome, "reason": reason})
        if outcome == "fits":
            lo = max(lo, k)
        elif outcome == "too_big":
            hi = k if hi is None else min(hi, k)
        else:
            stopped, error = f"batch {batch}: {reason}", outcome == "error"
            break
        if hi is None:
            k *= 2
            continue
        if hi - lo <= 1 or (precision > 0 and lo >= kmin and (hi - lo) <= precision * lo):
            break
        k = (lo + hi) // 2
        hinted = _hint(reason) if outcome == "too_big" else None
        if hinted is not None and lo < hinted // g < hi:
            k = hinted // g
    largest = lo * g if lo >= kmin else None
    return {"granularity": g, "minimum": kmin * g, "start": max(kmin, -(-start // g)) * g,
            "largest": largest, "smallest_too_big": hi * g if hi is not None else None,
            "exact": hi is not None and hi - lo <= 1 and not error, "stopped": stopped, "error": error,
            "trials": trials}


# -- a tenant: another process holding memory on card 0 ----------------------------------------

_TENANT_CODE = """
import sys
import torch
nbytes, device = int(sys.argv[1]), sys.argv[2]
x = torch.empty(nbytes, dtype=torch.uint8, device=device)
x.fill_(1)  # touch it: on a CPU, untouched pages are not held
if device.startswith("cuda"):
    torch.cuda.synchronize(device)
print("ready", flush=True)
sys.stdin.read()  # held until the bench closes this pipe, or dies (EOF)
"""


class Tenant:
    """A child process holding `gb` GB on `device` (torch.empty(..., uint8)) until stop().

    It reads its stdin until EOF, so it also ends when the bench dies without cleaning up.
    """

    def __init__(self, gb: float, device: str = "cuda:0", *, timeout_s: float = 300.0):
        self.gb, self.device, self.timeout_s = gb, device, timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> Tenant:
        nbytes = int(self.gb * GB)
        self.proc = subprocess.Popen([sys.executable, "-c", _TENANT_CODE, str(nbytes), self.device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True, env=_plain_env())
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.timeout_s)
        if not line or line[0].strip() != "ready":
            self.stop()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            why = _error_line(err) if err.strip() else f"not ready within {self.timeout_s:g} s"
            raise UsageError(f"bench.tenant_gb={self.gb:g}: the tenant could not hold {self.gb:g} GB on "
                             f"{self.device} ({why}); lower bench.tenant_gb")
        log.info("bench: tenant process %d holds %g GB on %s until the bench ends", self.proc.pid, self.gb,
                 self.device)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(OSError):
            p.stdin.close()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# -- generated JPEG files for the imagefolder rows ----------------------------------------------


def _make_images(args: tuple[str, list[tuple[int, int]], int]) -> int:
    """Write JPEGs [(index, class)] under root: smooth random colour fields with grain, 400-500 px a side,
    so their size and decode cost are like ImageNet's. Returns the bytes written."""
    import numpy as np
    from PIL import Image

    root, items, seed = args
    total = 0
    for i, cls in items:
        rng = np.random.default_rng(seed * 1_000_003 + i)
        w, h = (int(v) for v in rng.integers(400, 501, size=2))
        small = rng.integers(0, 256, size=(int(rng.integers(6, 24)), int(rng.integers(6, 24)), 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.int16)
        img = img + rng.normal(0, 10, size=(h, w, 3)).astype(np.int16)
        path = Path(root) / f"class_{cls:02d}" / f"img_{i:06d}.jpg"
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path, "JPEG", quality=90)
        total += path.stat().st_size
    return total


def image_folder(root: Path, images: int, *, seed: int = 0) -> dict[str, Any]:
    """An ImageFolder root of `images` generated JPEGs in IMAGE_CLASSES classes, reused when its
    MANIFEST.json says it holds the same; returns the manifest (path, images, classes, bytes, generated_s)."""
    manifest = root / "MANIFEST.json"
    want = {"images": images, "classes": IMAGE_CLASSES, "seed": seed, "format": 1}
    if manifest.is_file():
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(manifest.read_text())
            if {k: doc.get(k) for k in want} == want:
                log.info("bench: reusing %d generated JPEG files in %s", images, root)
                return {"path": str(root), "images": images, "classes": IMAGE_CLASSES, "bytes": int(doc["bytes"]),
                        "generated_s": None}
    shutil.rmtree(root, ignore_errors=True)
    for c in range(IMAGE_CLASSES):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    log.info("bench: generating %d JPEG files in %s (once; later benches reuse them)", images, root)
    t = time.monotonic()
    items = [(i, i % IMAGE_CLASSES) for i in range(images)]
    procs = max(1, min(os.cpu_count() or 1, 16, images // 100))
    chunks = [(str(root), items[j::procs], seed) for j in range(procs)]
    if procs == 1:
        total = _make_images(chunks[0])
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(procs) as pool:
            total = sum(pool.map(_make_images, chunks))
    took = round(time.monotonic() - t, 2)
    doc = {**want, "bytes": total, "generated_s": took}
    tmp = manifest.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(manifest)  # written last: a half-generated folder is regenerated next time
    return {"path": str(root), "images": images, "classes": IMAGE_CLASSES, "bytes": total, "generated_s": took}


# -- running one configuration ------------------------------------------------------------------


def _error_line(text: str) -> str:
    """The line that says why a run failed: `error: ...`, else the exception line, else the last line."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    for line in reversed(lines):
        if line.startswith("error:"):
            return line[len("error:"):].strip()
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) and " " not in head:
            return line
    return lines[-1] if lines else "no output"


def timed_throughput(records: list[dict], *, warmup: int, total: int, batch: int) -> float | None:
    """Samples/s between the records logged at step `warmup` and step `total` (None if one is missing)."""
    by_step = {r.get("step"): r for r in records}
    a, b = by_step.get(warmup), by_step.get(total)
    if a is None or b is None or total <= warmup:
        return None
    dt = float(b["time"]) - float(a["time"])
    return (total - warmup) * batch / dt if dt > 0 else None


class _Scraper(threading.Thread):
    """Scrapes a /metrics URL every `interval` seconds, as Prometheus would, while a run trains."""

    def __init__(self, url: str, interval: float):
        super().__init__(daemon=True, name="bench-scraper")
        self.url, self.interval = url, interval
        self.ok = self.failed = 0
        self._halt = threading.Event()
        # Loopback only: never through an http_proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                with self._opener.open(self.url, timeout=5) as r:
                    body = r.read()
                if r.status == 200 and b"trainjob_" in body:
                    self.ok += 1
                else:
                    self.failed += 1
            except OSError:  # not serving yet (model still building) or already closed
                self.failed += 1

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


# Set by torchrun/Slurm for the process they started; a benchmark run must start as a plain command
# (it starts its own ranks), not join the group of whoever started the benchmark.
GROUP_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in GROUP_VARS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bench:
    def __init__(self, cfg):
        self.cfg, self.b = cfg, cfg.bench
        _check(self.b)
        self.overrides = user_overrides(cfg)
        self.cuda = self._cuda_count()
        self.device = "cuda" if self.cuda else "cpu"
        # Without GPUs, processes stand in for cards: the ddp process count (the user's, else cpu_procs).
        self.cards = self.cuda or int(self.overrides.get("strategy.nprocs") or self.b.cpu_procs)
        self.workloads = list(self.b.workloads) or [cfg.workload.name]
        if self.b.tenant_gb and not self.cuda:
            raise UsageError(f"bench.tenant_gb={self.b.tenant_gb:g} holds memory on a CUDA card, and none is "
                             "visible; drop bench.tenant_gb or run where a GPU is")
        if self.b.imagefolder and self.b.mode == "compare":
            from job.models import WORKLOADS

            if not any(WORKLOADS[w].is_image for w in self.workloads):
                raise UsageError(f"bench.imagefolder=true needs an image workload, and bench.workloads is "
                                 f"{self.workloads}; add resnet50 (GPU) or tiny (CPU)")
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        self.out = Path(self.b.out or Path(cfg.train.run_dir) / f"bench-{stamp}")
        self.images_dir = Path(self.b.imagefolder_dir or Path(cfg.train.run_dir) / "bench-images")
        self.failed = 0
        self.child: subprocess.Popen | None = None
        self.interrupted = False
        self.tenant: Tenant | None = None

    def _cuda_count(self) -> int:
        if self.cfg.train.device == "cpu":
            return 0
        import torch  # counting devices does not create a CUDA context here (no memory on any card)

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    # -- building the command of one run ----------------------------------------------------
    def _args(self, workload: str, strategy: str, run_id: str, extra: list[str], *, warmup: int,
              steps: int) -> list[str]:
        args = ["--config", str(self.out / "overrides.yaml"), f"workload={workload}", _strategy_arg(strategy),
                f"train.steps={warmup + steps}", f"train.timing_warmup={warmup}",
                f"train.log_every={warmup}", "train.checkpoint_every=0", "train.resume=never",
                f"train.run_dir={self.out / 'runs'}", f"train.run_id={run_id}"]
        if not self.cuda and "strategy.nprocs" not in self.overrides and not any(
                e.startswith("strategy.nprocs=") for e in extra):
            args.append(f"strategy.nprocs={self.b.cpu_procs}")
        return args + extra

    def _first_card(self) -> str:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            from job.devices import parse_visible

            entries = parse_visible(visible)
            if entries:
                return entries[0]
        return "0"  # CUDA_DEVICE_ORDER=PCI_BUS_ID (job.devices): the first card on the PCI bus

    def _empty(self, name: str, kind: str, strategy: str, *, repeat: int = 1,
               data: str = "synthetic") -> dict[str, Any]:
        return {"name": name, "kind": kind, "strategy": strategy, "repeat": repeat, "data": data,
                "status": "skipped", "reason": None,
                "exit_code": None, "command": [], "env": {}, "run_dir": None, "log": None, "wall_s": None,
                "batch_size": None, "world_size": None, "units": None, "timed_steps": None,
                "samples_per_s": None, "units_per_s": None, "step_s": None, "trainer_samples_per_s": None,
                "imbalance": None, "scaling_vs_1": None, "scaling_note": None, "peak_window": None,
                "window_note": None, "cards": [], "scrapes_ok": None, "scrapes_failed": None}

    def run_one(self, workload: str, name: str, kind: str, strategy: str, *, extra: list[str] = (),
                env: dict[str, str] | None = None, scrape_port: int | None = None, repeat: int = 1,
                run_id: str | None = None, warmup: int | None = None, steps: int | None = None,
                timeout_s: float | None = None, count_failure: bool = True,
                module: str = "job") -> dict[str, Any]:
        data = "imagefolder" if any(e == "data.kind=imagefolder" for e in extra) else "synthetic"
        row = self._empty(name, kind, strategy, repeat=repeat, data=data)
        if self.interrupted:
            row["reason"] = "the benchmark was interrupted before this run"
            return row
        warmup = self.b.warmup if warmup is None else warmup
        steps = self.b.steps if steps is None else steps
        run_id = run_id or f"{workload}-{name}"
        args = self._args(workload, strategy, run_id, list(extra), warmup=warmup, steps=steps)
        try:
            child_cfg = config_mod.load(args)  # the run would refuse it: say why now, spend nothing
        except UsageError as e:
            row["reason"] = str(e)
            log.info("bench: %-22s skipped: %s", name, e)
            return row
        command = ["-m", module] + (["train"] if module == "job" else []) + args
        cmd = [sys.executable, *command]
        row["command"] = ["python", *command]
        row["env"] = dict(env or {})
        row["batch_size"] = int(child_cfg.train.batch_size)
        run_dir = self.out / "runs" / run_id
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{run_id}.log"
        row["run_dir"], row["log"] = str(run_dir), str(log_path)
        log.info("bench: %-22s running (%s)", name, shlex.join(args[2:]))
        scraper = None
        start = time.monotonic()
        limit = self.b.timeout_min * 60 if timeout_s is None else min(timeout_s, self.b.timeout_min * 60)
        with open(log_path, "w") as logf:
            self.child = subprocess.Popen(
                cmd, cwd=os.getcwd(), stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                env={**_plain_env(), **(env or {}), "PYTHONUNBUFFERED": "1"},
            )
            if scrape_port is not None:
                scraper = _Scraper(f"http://127.0.0.1:{scrape_port}/metrics", self.b.scrape_interval_s)
                scraper.start()
            try:
                code = self.child.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                self._stop_child()
                code, timed_out = self.child.returncode, True
            finally:
                if scraper is not None:
                    scraper.stop()
                    row["scrapes_ok"], row["scrapes_failed"] = scraper.ok, scraper.failed
        self.child = None
        row["wall_s"] = round(time.monotonic() - start, 3)
        row["exit_code"] = code
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the bench needs none; they are big
        if self.interrupted:
            row["status"], row["reason"] = "interrupted", "the benchmark was interrupted during this run"
            return row
        if timed_out:
            return self._fail(row, f"timed out after {limit / 60:g} min", count_failure)
        if code != EXIT_OK:
            return self._fail(row, _error_line(log_path.read_text(errors="replace")), count_failure)
        if module != "job":
            row["status"] = "ok"
            return row
        try:
            self._read_results(row, run_dir, child_cfg, warmup=warmup, steps=steps)
        except (OSError, ValueError, KeyError) as e:
            return self._fail(row, f"run finished but its results cannot be read: {e}", count_failure)
        row["status"] = "ok"
        log.info("bench: %-22s ok: %s samples/s", name, f"{row['samples_per_s']:,.1f}")
        return row

    def _fail(self, row: dict, reason: str, count: bool = True) -> dict:
        row["status"], row["reason"] = "failed", reason
        if count:
            self.failed += 1
            log.warning("bench: %-22s FAILED: %s", row["name"], reason)
        else:
            log.info("bench: %-22s failed: %s", row["name"], reason)
        return row

    def _stop_child(self) -> None:
        """SIGTERM the run's session (its ranks too), then SIGKILL after 30 s."""
        p = self.child
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def _read_results(self, row: dict, run_dir: Path, child_cfg, *, warmup: int, steps: int) -> None:
        summary = json.loads((run_dir / "summary.json").read_text())
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        total = warmup + steps
        sps = timed_throughput(records, warmup=warmup, total=total, batch=row["batch_size"])
        if sps is None:
            raise ValueError(f"metrics.jsonl has no records for steps {warmup} and {total}")
        from job.models import WORKLOADS

        k = WORKLOADS[child_cfg.workload.name].units_per_sample(child_cfg.workload)
        cards = [{key: r.get(key) for key in CARD_SCHEMA["properties"]} for r in summary.get("cards", [])]
        world = int(summary["world_size"])
        window = summary.get("peak_window")
        row.update({
            "world_size": world, "units": len(cards) or world, "timed_steps": steps,
            "samples_per_s": sps, "units_per_s": sps * k, "step_s": row["batch_size"] / sps,
            "trainer_samples_per_s": float(summary["samples_per_s"]),
            "imbalance": summary.get("imbalance"), "cards": cards, "peak_window": window,
        })
        if window != [warmup, total]:
            row["window_note"] = (f"peaks cover steps after {window[0]} to {window[1]}, not the timed steps "
                                  f"{warmup + 1}-{total}" if window else "the run did not record its peak window")

    # -- compare: one workload ----------------------------------------------------------------
    def bench_workload(self, workload: str) -> dict[str, Any]:
        from job.models import WORKLOADS

        ref_cfg = config_mod.load(["--config", str(self.out / "overrides.yaml"), f"workload={workload}"])
        spec = WORKLOADS[workload]
        global_batch = int(ref_cfg.train.batch_size)
        n = self.cards
        label = "1gpu" if self.cuda else "1proc"
        # (name, kind, strategy, extra args, env), or a row when the plan is refused up front.
        plan: list[tuple] = []
        if self.b.baseline not in ("", "none"):
            if global_batch % n:
                row = self._empty(label, "baseline", self.b.baseline)
                row["reason"] = (f"global batch {global_batch} is not a multiple of {n} cards, so the 1-card "
                                 f"baseline cannot have the same per-card batch; use train.batch_size={n}·k")
                log.info("bench: %-22s skipped: %s", label, row["reason"])
                plan.append(row)
            else:
                env = {"CUDA_VISIBLE_DEVICES": self._first_card()} if self.cuda else {}
                plan.append((label, "baseline", self.b.baseline,
                             [f"train.batch_size={global_batch // n}", "strategy.nprocs=1"], env))
        for s in self.b.strategies:
            plan.append((s, "strategy", s, [], {}))
        images = None
        if self.b.imagefolder and spec.is_image:
            images = image_folder(self.images_dir, self.b.imagefolder_images, seed=int(ref_cfg.train.seed))
            for s in self.b.strategies:
                plan.append((f"{s}+imagefolder", "imagefolder", s, self._image_args(s, images["path"]), {}))
        runs: list[dict] = []
        for rep in range(self.b.repeats):
            for item in rotated(plan, rep):
                if isinstance(item, dict):
                    if rep == 0:
                        runs.append(item)
                    continue
                name, kind, strategy, extra, env = item
                runs.append(self.run_one(workload, name, kind, strategy, extra=extra, env=env, repeat=rep + 1,
                                         run_id=f"{workload}-{name}-r{rep + 1}"))
            if self.interrupted:  # this repeat's other runs are listed as not run; no further repeats
                break
        _scaling(runs, n)
        overhead = self._telemetry_overhead(workload, runs) if self.b.telemetry_overhead else None
        names = [p["name"] if isinstance(p, dict) else p[0] for p in plan]
        summary = summarize(runs, names, window=[self.b.warmup, self.b.warmup + self.b.steps])
        summary_scaling(summary, n)
        return {"workload": workload, "unit": spec.unit, "units_per_sample": spec.units_per_sample(ref_cfg.workload),
                "global_batch": global_batch, "cards": n, "runs": runs, "summary": summary,
                "comparisons": comparisons(summary), "telemetry_overhead": overhead, "imagefolder": images,
                "maxbatch": None, "profiles": None}

    def _image_args(self, strategy: str, path: str) -> list[str]:
        extra = ["data.kind=imagefolder", f"data.path={path}", "data.prefetch=true"]
        if "data.workers" not in self.overrides:
            # Workers per training process: the cores of its share of the machine, one left for the
            # process itself (a single-process strategy feeds every card from one loader).
            procs = self.cards if _multi_process(strategy) else 1
            extra.append(f"data.workers={max(1, min(16, (os.cpu_count() or 2) // procs - 1))}")
        return extra

    def _telemetry_overhead(self, workload: str, runs: list[dict]) -> dict[str, Any]:
        s = self.b.telemetry_strategy
        off, on, off_runs, on_runs, scrapes = [], [], [], [], 0
        for i in range(1, self.b.telemetry_repeats + 1):
            a = None
            if i == 1 and not self.overrides.get("telemetry.port"):
                # The strategy's own run had telemetry off and otherwise the same command: it is the
                # first "off" run (one process fewer).
                a = next((r for r in runs if r["kind"] == "strategy" and r["strategy"] == s
                          and r["status"] == "ok"), None)
            if a is None:
                a = self.run_one(workload, f"telemetry-off-{i}", "telemetry_off", s, extra=["telemetry.port=0"])
                runs.append(a)
            port = _free_port()
            z = self.run_one(workload, f"telemetry-on-{i}", "telemetry_on", s,
                             extra=[f"telemetry.port={port}", "telemetry.host=127.0.0.1"], scrape_port=port)
            runs.append(z)
            if a["status"] == "ok" and z["status"] == "ok":
                off.append(a["step_s"])
                on.append(z["step_s"])
                off_runs.append(a["name"] + (f" (repeat {a['repeat']})" if a["kind"] == "strategy" else ""))
                on_runs.append(z["name"])
                scrapes += z["scrapes_ok"] or 0
        note = None
        if not off:
            reasons = {r["reason"] for r in runs if r["kind"].startswith("telemetry") and r["reason"]}
            note = "no off/on pair finished: " + "; ".join(sorted(reasons))
        elif scrapes == 0:
            note = "the exporter was never scraped successfully: the 'on' runs measure serving without scrapes"
        off_m = statistics.median(off) if off else None
        on_m = statistics.median(on) if on else None
        return {"strategy": s, "repeats": self.b.telemetry_repeats, "scrape_interval_s": float(self.b.scrape_interval_s),
                "off_runs": off_runs, "on_runs": on_runs, "off_step_s": off, "on_step_s": on, "off_median_step_s": off_m, "on_median_step_s": on_m,
                "overhead": (on_m / off_m - 1) if off else None, "scrapes_ok": scrapes, "note": note}

    # -- maxbatch: one workload ---------------------------------------------------------------
    def maxbatch_workload(self, workload: str) -> dict[str, Any]:
        from job.models import WORKLOADS

        ref_cfg = config_mod.load(["--config", str(self.out / "overrides.yaml"), f"workload={workload}"])
        spec = WORKLOADS[workload]
        runs: list[dict] = []
        results = []
        for s in self.b.strategies:
            if self.interrupted:
                break
            results.append(self._search(workload, s, ref_cfg, runs))
        return {"workload": workload, "unit": spec.unit, "units_per_sample": spec.units_per_sample(ref_cfg.workload),
                "global_batch": int(ref_cfg.train.batch_size), "cards": self.cards, "runs": runs, "summary": [],
                "comparisons": [], "telemetry_overhead": None, "imagefolder": None, "maxbatch": results,
                "profiles": None}

    def _search(self, workload: str, strategy: str, ref_cfg, runs: list[dict]) -> dict[str, Any]:
        from omegaconf import OmegaConf

        probe = config_mod.load(self._args(workload, strategy, "probe", [], warmup=1, steps=1))
        multi = _multi_process(strategy)
        ranks = (int(probe.strategy.nprocs) or self.cuda or 1) if multi else 1
        g, minimum = batch_rule(multi_process=multi, ranks=ranks, cards=self.cuda or 1,
                                accum=int(probe.train.accum_steps),
                                split=OmegaConf.select(probe, "strategy.split", default=None))
        start = self.b.maxbatch_start or int(ref_cfg.train.batch_size)
        budget_s = self.b.maxbatch_minutes * 60
        t0 = time.monotonic()
        by_batch: dict[int, dict] = {}

        def trial(batch: int) -> tuple[str, str | None]:
            left = budget_s - (time.monotonic() - t0)
            row = self.run_one(workload, f"{strategy}@{batch}", "maxbatch_trial", strategy,
                               extra=[f"train.batch_size={batch}"], warmup=1, steps=self.b.maxbatch_steps - 1,
                               timeout_s=max(60.0, left), count_failure=False)
            runs.append(row)
            by_batch[batch] = row
            if row["status"] == "interrupted" or self.interrupted:
                return "interrupted", row["reason"]
            if row["status"] == "skipped":
                return "error", row["reason"]
            outcome = classify_trial(row["exit_code"], row["reason"] if row["status"] != "ok" else None)
            if row["status"] == "failed" and row["reason"] and row["reason"].startswith("timed out"):
                outcome = "error"
            return outcome, row["reason"]

        log.info("bench: maxbatch %s: batches of %d x k, at least %d, from %d", strategy, g, minimum, start)
        res = search_max_batch(trial, start=start, granularity=g, minimum=minimum,
                               max_trials=self.b.maxbatch_trials, deadline_s=budget_s,
                               precision=self.b.maxbatch_precision)
        for t in res["trials"]:
            row = by_batch.get(t["batch"])
            t["run"] = row["name"] if row else None
            t["wall_s"] = row["wall_s"] if row else None
        best = by_batch.get(res["largest"]) if res["largest"] else None
        if res["error"]:
            self.failed += 1
            log.warning("bench: maxbatch %s: %s", strategy, res["stopped"])
        log.info("bench: maxbatch %s: largest batch that trains %s (too big: %s)", strategy, res["largest"],
                 res["smallest_too_big"])
        return {"strategy": strategy, **res, "run": best["name"] if best else None,
                "cards": best["cards"] if best else [], "units_per_s": best["units_per_s"] if best else None}

    # -- profile: one workload ----------------------------------------------------------------
    def profile_workload(self, workload: str) -> dict[str, Any]:
        from job.models import WORKLOADS

        ref_cfg = config_mod.load(["--config", str(self.out / "overrides.yaml"), f"workload={workload}"])
        spec = WORKLOADS[workload]
        runs, profiles = [], []
        total = self.b.warmup + self.b.profile_steps
        for s in self.b.strategies:
            if self.interrupted:
                break
            out = self.out / f"profile-{workload}-{s}"
            row = self.run_one(workload, f"profile-{s}", "profile", s, module="job.bench",
                               extra=[f"train.log_every={total}"], steps=self.b.profile_steps,
                               env={PROFILE_ENV: str(out)})
            runs.append(row)
            if row["status"] == "ok":
                try:
                    profiles.append(json.loads(out.with_suffix(".json").read_text()))
                except (OSError, ValueError) as e:
                    self._fail(row, f"the profile finished but {out.with_suffix('.json')} cannot be read: {e}")
        return {"workload": workload, "unit": spec.unit, "units_per_sample": spec.units_per_sample(ref_cfg.workload),
                "global_batch": int(ref_cfg.train.batch_size), "cards": self.cards, "runs": runs, "summary": [],
                "comparisons": [], "telemetry_overhead": None, "imagefolder": None, "maxbatch": None,
                "profiles": profiles}

    # -- the whole benchmark --------------------------------------------------------------------
    def run(self) -> int:
        from omegaconf import OmegaConf

        overrides_yaml = ("# What the bench command line / --config changed; passed to every run as --config.\n"
                          + OmegaConf.to_yaml(OmegaConf.create(_nest(self.overrides))))
        with tempfile.TemporaryDirectory() as tmp:  # refuse a bad workload or override before anything starts
            (Path(tmp) / "overrides.yaml").write_text(overrides_yaml)
            for w in self.workloads:
                config_mod.load(["--config", str(Path(tmp) / "overrides.yaml"), f"workload={w}"])
        if any(k in os.environ for k in GROUP_VARS):
            log.warning("bench: %s are set but ignored: each run starts its own ranks on this node",
                        "/".join(k for k in GROUP_VARS if k in os.environ))
        results: list[dict] = []
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.b.tenant_gb:
                self.tenant = Tenant(self.b.tenant_gb, "cuda:0").start()
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "overrides.yaml").write_text(overrides_yaml)
            where = (f"{self.cuda} GPU(s)" if self.cuda else
                     f"CPU ({self.cards} ddp processes stand in for cards; no GPU numbers here)")
            b = self.b
            what = {"compare": f"{b.warmup}+{b.steps} steps x {b.repeats} repeat(s)",
                    "maxbatch": f"trials of {b.maxbatch_steps} steps, at most {b.maxbatch_trials} per strategy",
                    "profile": f"{b.profile_steps} steps profiled after {b.warmup}"}[b.mode]
            log.info("bench %s: %s, workloads %s, strategies %s, %s -> %s", b.mode, where, ",".join(self.workloads),
                     ",".join(b.strategies), what, self.out)
            one = {"compare": self.bench_workload, "maxbatch": self.maxbatch_workload,
                   "profile": self.profile_workload}[self.b.mode]
            for w in self.workloads:
                results.append(one(w))
                if self.interrupted:
                    break
        finally:
            if self.tenant is not None:
                self.tenant.stop()
            for s, h in previous.items():
                signal.signal(s, h)
        b = self.b
        doc = {
            "schema": SCHEMA_ID, "mode": b.mode, "device": self.device, "cards": self.cards,
            "settings": {"steps": b.steps, "warmup": b.warmup, "repeats": b.repeats, "strategies": list(b.strategies),
                         "workloads": self.workloads, "baseline": b.baseline, "cpu_procs": b.cpu_procs,
                         "overrides": _nest(self.overrides), "out": str(self.out), "imagefolder": bool(b.imagefolder),
                         "maxbatch": {"start": b.maxbatch_start, "steps": b.maxbatch_steps,
                                      "trials": b.maxbatch_trials, "minutes": float(b.maxbatch_minutes),
                                      "precision": float(b.maxbatch_precision)}},
            "tenant": ({"gb": float(b.tenant_gb), "device": "cuda:0", "pid": self.tenant.pid}
                       if self.tenant is not None else None),
            "environment": environment(results),
            "workloads": results, "chart": None, "failed": self.failed,
        }
        chart = self.out / "bench.png"
        if b.mode != "profile":
            try:
                write_chart(doc, chart)
                doc["chart"] = str(chart)
            except ImportError as e:
                log.warning("bench: no chart (%s); pip install matplotlib", e)
        (self.out / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")
        print("\n\n".join(table(doc, w) for w in results), flush=True)
        print(f"\nresults: {self.out / 'bench.json'}" + (f", chart: {chart}" if doc["chart"] else ""), flush=True)
        if self.interrupted:
            return EXIT_INTERRUPTED
        if self.failed:
            log.error("bench: %d run(s)/search(es) failed (see the table and %s)", self.failed, self.out / "logs")
            return 1
        return EXIT_OK

    def _on_signal(self, signum, _frame) -> None:
        """First signal: SIGTERM the current run (it checkpoints and exits); a second one: SIGKILL it."""
        again = self.interrupted
        log.warning("bench: %s: %s", signal.Signals(signum).name,
                    "killing the current run" if again else
                    "stopping the current run, then writing what was measured (again to kill it)")
        self.interrupted = True
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signal.SIGKILL if again else signal.SIGTERM)


def _check(b) -> None:
    if b.warmup < 1:
        raise UsageError(f"bench.warmup={b.warmup} must be at least 1: the first steps include CUDA/cuDNN "
                         "start-up and must not be timed")
    for key in ("steps", "cpu_procs", "timeout_min", "telemetry_repeats", "repeats", "maxbatch_trials",
                "profile_steps"):
        if getattr(b, key) < 1:
            raise UsageError(f"bench.{key}={getattr(b, key)} must be at least 1")
    if b.maxbatch_steps < 2:
        raise UsageError(f"bench.maxbatch_steps={b.maxbatch_steps} must be at least 2: the first step is "
                         "warm-up, peaks are taken over the others")
    if b.maxbatch_start < 0:
        raise UsageError(f"bench.maxbatch_start={b.maxbatch_start} must not be negative (0: train.batch_size)")
    if not b.maxbatch_minutes > 0:
        raise UsageError(f"bench.maxbatch_minutes={b.maxbatch_minutes} must be positive")
    if not 0 <= b.maxbatch_precision < 1:
        raise UsageError(f"bench.maxbatch_precision={b.maxbatch_precision} must be in [0, 1) (0: exact)")
    if b.tenant_gb < 0:
        raise UsageError(f"bench.tenant_gb={b.tenant_gb} must not be negative (0: no tenant)")
    if b.imagefolder_images < IMAGE_CLASSES:
        raise UsageError(f"bench.imagefolder_images={b.imagefolder_images} must be at least {IMAGE_CLASSES} "
                         "(one per class)")
    if not b.scrape_interval_s > 0:
        raise UsageError(f"bench.scrape_interval_s={b.scrape_interval_s} must be positive")
    if not b.strategies:
        raise UsageError("bench.strategies is empty; give e.g. strategies=[dp,ddp]")
    names = [(s, "bench.strategies") for s in b.strategies]
    if b.mode == "compare" and b.baseline not in ("", "none"):
        names.append((b.baseline, "bench.baseline"))
    if b.mode == "compare" and b.telemetry_overhead:
        names.append((b.telemetry_strategy, "bench.telemetry_strategy"))
    for name, key in names:
        why = _unknown_strategy(name, key)
        if why:
            raise UsageError(why)
    if b.mode == "profile":
        multi = [s for s in b.strategies if _multi_process(s)]
        if multi:
            raise UsageError(f"bench.mode=profile profiles one process; {', '.join(multi)} runs one process per "
                             "card: profile a single-process strategy, e.g. strategies=[dp]")
    workloads = config_mod.preset_names("workload")
    for w in b.workloads:
        if w not in workloads:
            raise UsageError(f"unknown workload `{w}` in bench.workloads; choose from: {', '.join(workloads)}")


def _scaling(runs: list[dict], n: int) -> None:
    """Per run: scaling vs 1 = throughput_n / (n x throughput_1 of the same repeat's baseline)."""
    bases = {r["repeat"]: r for r in runs if r["kind"] == "baseline"}
    for r in runs:
        if r["kind"] not in ("strategy", "imagefolder") or r["status"] != "ok":
            continue
        base = bases.get(r["repeat"])
        if base is None or base["status"] != "ok":
            r["scaling_note"] = "no baseline" if base is None else f"baseline {base['status']}"
        elif r["units"] != n:
            r["scaling_note"] = f"ran on {r['units']} card(s)/process(es), the baseline is 1 of {n}"
        else:
            r["scaling_vs_1"] = r["samples_per_s"] / (n * base["samples_per_s"])


# -- the environment ----------------------------------------------------------------------------


def _git_commit() -> tuple[str | None, bool | None]:
    git = shutil.which("git")
    if git and (ROOT / ".git").exists():
        try:
            head = subprocess.run([git, "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
            dirty = subprocess.run([git, "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10, check=True).stdout.strip()
            return head, bool(dirty)
        except (subprocess.SubprocessError, OSError):
            pass
    return os.environ.get("GIT_COMMIT") or None, None  # an image or copy without .git: set GIT_COMMIT


def _driver() -> tuple[str | None, str | None]:
    """(driver version, CUDA version the driver supports), from NVML, else nvidia-smi."""
    from job.devices import _text, default_nvml

    nv = default_nvml()
    if nv is not None:
        try:
            drv = _text(nv.nvmlSystemGetDriverVersion())
            cuda = None
            with contextlib.suppress(Exception):
                v = int(nv.nvmlSystemGetCudaDriverVersion_v2())
                cuda = f"{v // 1000}.{v % 1000 // 10}"
            return drv, cuda
        except Exception:
            pass
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(subprocess.SubprocessError, OSError, IndexError):
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20, check=True).stdout
            return out.splitlines()[0].strip(), None
    return None, None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _nccl_version() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    with contextlib.suppress(Exception):
        v = torch.cuda.nccl.version()
        return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    return None


def _torchvision_version() -> str | None:
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        return version("torchvision")
    return None


def environment(results: list[dict]) -> dict[str, Any]:
    import torch

    cmd = sys.argv[1:] if sys.argv and sys.argv[0].endswith("__main__.py") else None
    command = shlex.join(["python", "-m", "job", *cmd]) if cmd is not None else shlex.join(sys.argv)
    gpus: dict[str, dict] = {}
    for w in results:
        for r in w["runs"]:
            for c in r["cards"]:
                gpus.setdefault(c["uuid"], {"name": c["name"], "uuid": c["uuid"], "pci_bus_id": c["pci_bus_id"],
                                            "memory_total_bytes": c["nvml_total_bytes"]})
    gpu_list = sorted(gpus.values(), key=lambda g: g["pci_bus_id"])
    driver, cuda_driver = _driver() if gpu_list or torch.cuda.is_available() else (None, None)
    commit, dirty = _git_commit()
    cudnn = None
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            cudnn = torch.backends.cudnn.version()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(), "command": command,
        "python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu_model(),
        "cpu_count": os.cpu_count() or 0, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cudnn": cudnn, "nccl": _nccl_version(), "torchvision": _torchvision_version(),
        "driver": driver, "cuda_driver": cuda_driver,
        "gpu_model": ", ".join(sorted({g["name"] for g in gpu_list})) or None, "gpus": gpu_list,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "commit": commit, "commit_dirty": dirty,
    }


# -- table and chart ----------------------------------------------------------------------------


def _fmt(s: dict | None, scale: float = 1.0, spec: str = ",.0f", suffix: str = "") -> str:
    """`median` for one run (or equal values), else `median (min-max)`."""
    if s is None:
        return "-"
    med = format(s["median"] / scale, spec) + suffix
    if s["n"] < 2 or s["min"] == s["max"]:
        return med
    return f"{med} ({format(s['min'] / scale, spec)}-{format(s['max'] / scale, spec)})"


def versions(env: dict) -> str:
    """`torch 2.14.1, CUDA 12.8, cuDNN 91000, NCCL 2.21.5, driver 580.1; commit 0123456789ab`"""
    parts = [f"torch {env['torch']}"]
    for key, label in (("torch_cuda", "CUDA"), ("cudnn", "cuDNN"), ("nccl", "NCCL")):
        if env.get(key):
            parts.append(f"{label} {env[key]}")
    parts.append(f"driver {env['driver']}" if env.get("driver") else "no GPU driver")
    commit = env["commit"][:12] if env.get("commit") else "unknown commit (no .git; set GIT_COMMIT)"
    if env.get("commit_dirty"):
        commit += " + uncommitted changes"
    return ", ".join(parts) + f"; commit {commit}"


def _header(doc: dict) -> list[str]:
    lines = [versions(doc["environment"])]
    if doc.get("tenant"):
        t = doc["tenant"]
        lines.append(f"tenant: another process (pid {t['pid']}) held {t['gb']:g} GB on {t['device']} during every run")
    return lines


def _grid(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    widths[-1] = len(head[-1])  # the last column may be long: leave it ragged
    fmt = "  ".join(f"{{:<{n}}}" for n in widths)
    return ([fmt.format(*head).rstrip(), fmt.format(*("-" * n for n in widths))]
            + [fmt.format(*row).rstrip() for row in body])


def table(doc: dict, w: dict) -> str:
    if w.get("maxbatch") is not None:
        return _maxbatch_table(doc, w)
    if w.get("profiles") is not None:
        return _profile_table(doc, w)
    s = doc["settings"]
    unit = f"{w['unit']}/s"
    where = f"{w['cards']} GPU(s)" if doc["device"] == "cuda" else f"CPU, {w['cards']} ddp processes"
    warm, steps, reps = s["warmup"], s["steps"], s["repeats"]
    lines = [f"== bench {w['workload']}: global batch {w['global_batch']}, {where}, {warm} warm-up + {steps} "
             f"timed steps, {reps} repeat(s) (order rotated each repeat)",
             f"per-card peaks over the timed steps {warm + 1}-{warm + steps} (each run resets its peak counters "
             "when timing starts); cells: median (min-max) over the repeats", *_header(doc)]
    head = ["run", "strategy", "data", "procs/cards", "peak alloc MB", "peak reserved MB", "NVML used MB",
            "busiest/least", unit, "scaling vs 1", "status"]
    body = []
    for r in w["summary"]:
        ok = r["ok"] > 0

        def cards(key: str, r=r, ok=ok) -> str:
            if not ok:
                return "-"
            if not r["cards"] or any(c[key] is None for c in r["cards"]):
                return "n/a"
            return " / ".join(_fmt(c[key], MB) for c in r["cards"])

        scaling = ("baseline" if r["kind"] == "baseline" and ok else
                   f"{r['scaling_vs_1']:.1%}" if r["scaling_vs_1"] is not None else "-")
        status = r["status"] + ("" if r["same_window"] else f" (peaks over steps {r['peak_window']}: not the timed steps)")
        body.append([
            r["name"], _registered_name(r["strategy"]), r["data"], f"{r['world_size']}/{r['units']}" if ok else "-",
            cards("peak_allocated_bytes"), cards("peak_reserved_bytes"), cards("nvml_used_bytes"),
            _fmt(r["imbalance"], 1, ".2f", "x"),
            _fmt(r["units_per_s"]), scaling, status,
        ])
    lines += _grid(head, body)
    if doc["device"] == "cpu":
        lines.append("(CPU: no per-card memory; throughput numbers only exercise the path)")
    if w["comparisons"]:
        lines.append("ratios of medians (a claim only where the repeats' ranges do not overlap):")
        for c in w["comparisons"]:
            what = unit if c["metric"] == "units_per_s" else "busiest card's peak allocated"
            ratio = f"{c['ratio']:.2f}x" if c["ratio"] is not None else "n/a"
            lines.append(f"  {c['a']} / {c['b']}: {what} {ratio}: {c['verdict']}")
    if w.get("imagefolder"):
        i = w["imagefolder"]
        lines.append(f"imagefolder: {i['images']} generated JPEG files ({i['bytes'] / i['images'] / 1e3:.0f} kB "
                     f"each on average, {i['classes']} classes) in {i['path']}")
    o = w["telemetry_overhead"]
    if o is not None:
        if o["overhead"] is None:
            lines.append(f"telemetry overhead ({o['strategy']}): not measured: {o['note']}")
        else:
            lines.append(f"telemetry overhead ({o['strategy']}, {o['repeats']} pair(s), scraped every "
                         f"{o['scrape_interval_s']:g} s, {o['scrapes_ok']} scrapes): step "
                         f"{o['off_median_step_s'] * 1e3:.2f} ms off -> {o['on_median_step_s'] * 1e3:.2f} ms on "
                         f"= {o['overhead']:+.2%}" + (f" ({o['note']})" if o["note"] else ""))
    return "\n".join(lines)


def _maxbatch_table(doc: dict, w: dict) -> str:
    m = doc["settings"]["maxbatch"]
    where = f"{w['cards']} GPU(s)" if doc["device"] == "cuda" else f"CPU, {w['cards']} ddp processes"
    lines = [f"== bench maxbatch {w['workload']}: the largest global batch each strategy trains, {where}; "
             f"trials of {m['steps']} steps, peaks over steps 2-{m['steps']}", *_header(doc)]
    unit = f"{w['unit']}/s"
    head = ["strategy", "largest batch", "too big at", "batches", "peak alloc MB at largest",
            "peak reserved MB", "NVML used MB", unit, "trials", "note"]
    body = []
    for r in w["maxbatch"]:
        cards = sorted(r["cards"], key=_card_key)

        def col(key: str, cards=cards) -> str:
            if not cards:
                return "n/a" if doc["device"] == "cpu" else "-"
            return " / ".join("n/a" if c[key] is None else f"{c[key] / MB:,.0f}" for c in cards)

        note = r["stopped"] or ("exact" if r["exact"] else f"within {m['precision']:.0%}")
        if r["largest"] is None and not r["error"]:
            note = f"even {r['minimum']} does not fit" if r["smallest_too_big"] == r["minimum"] else note
        body.append([r["strategy"], str(r["largest"] or "-"), str(r["smallest_too_big"] or "-"),
                     f"{r['granularity']}k >= {r['minimum']}", col("peak_allocated_bytes"),
                     col("peak_reserved_bytes"), col("nvml_used_bytes"),
                     f"{r['units_per_s']:,.0f}" if r["units_per_s"] else "-", str(len(r["trials"])), note])
    lines += _grid(head, body)
    for r in w["maxbatch"]:
        lines.append(f"  {r['strategy']} trials: " + ", ".join(
            f"{t['batch']} {t['outcome'].replace('_', ' ')}" for t in r["trials"]))
    return "\n".join(lines)


def _profile_table(doc: dict, w: dict) -> str:
    lines = [f"== bench profile {w['workload']}", *_header(doc)]
    for p in w["profiles"]:
        lines.append(p["summary"])
    for r in w["runs"]:
        if r["status"] != "ok":
            lines.append(f"{r['name']}: {r['status']}: {r['reason']}")
    return "\n".join(lines)


def _si(x: float, _pos=None) -> str:
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:g}{suffix}"
    return f"{x:g}"


def write_chart(doc: dict, path: Path) -> None:
    """Per workload: per-card memory bars (left), throughput or largest batch (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = doc["workloads"] or [{"workload": "none", "unit": "img", "summary": [], "maxbatch": None}]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 4.2 * len(workloads)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    env = doc["environment"]
    for (ax_mem, ax_right), w in zip(axes, workloads, strict=True):
        if w.get("maxbatch") is not None:
            bars = [(r["strategy"], {"peak_allocated_bytes": [c["peak_allocated_bytes"] for c in
                                                              sorted(r["cards"], key=_card_key)],
                                     "peak_reserved_bytes": [c["peak_reserved_bytes"] for c in
                                                             sorted(r["cards"], key=_card_key)],
                                     "devices": [c["device"] for c in sorted(r["cards"], key=_card_key)]})
                    for r in w["maxbatch"] if r["cards"]]
            _memory_bars(ax_mem, bars, doc, f"{w['workload']}: per-card peak at the largest batch")
            shown = w["maxbatch"]
            ys = [r["largest"] or 0 for r in shown]
            hb = ax_right.barh(range(len(shown)), ys, color="#807dba")
            for bar, r in zip(hb, shown, strict=True):
                label = (f"{r['largest']:,}" if r["largest"] else "none fits") + (
                    f" (too big: {r['smallest_too_big']:,})" if r["smallest_too_big"] else "")
                ax_right.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center",
                              fontsize=8)
            ax_right.set_yticks(range(len(shown)), [r["strategy"] for r in shown])
            ax_right.set_xlabel("largest global batch that trains")
            ax_right.set_xlim(0, (max(ys) if any(ys) else 1) * 1.6)
            ax_right.set_title(f"{w['workload']}: largest batch")
            ax_right.invert_yaxis()
            continue
        rows = w.get("summary") or []
        bars = [(r["name"], {"peak_allocated_bytes": [c["peak_allocated_bytes"]["median"] for c in r["cards"]],
                             "peak_reserved_bytes": [c["peak_reserved_bytes"]["median"] for c in r["cards"]],
                             "err": [(c["peak_allocated_bytes"]["median"] - c["peak_allocated_bytes"]["min"],
                                      c["peak_allocated_bytes"]["max"] - c["peak_allocated_bytes"]["median"])
                                     for c in r["cards"]],
                             "devices": [c["device"] for c in r["cards"]]})
                for r in rows if r["ok"] and r["cards"]]
        _memory_bars(ax_mem, bars, doc, f"{w['workload']}: per-card peak over the timed steps (median)")
        ys = [r["units_per_s"]["median"] if r["units_per_s"] else 0.0 for r in rows]
        err = [[(r["units_per_s"]["median"] - r["units_per_s"]["min"]) if r["units_per_s"] else 0 for r in rows],
               [(r["units_per_s"]["max"] - r["units_per_s"]["median"]) if r["units_per_s"] else 0 for r in rows]]
        hb = ax_right.barh(range(len(rows)), ys, xerr=err if rows else None, color="#41ab5d", capsize=3)
        for bar, r in zip(hb, rows, strict=True):
            if not r["units_per_s"]:
                label = r["status"][:40]
            else:
                label = f"{r['units_per_s']['median']:,.0f}"
                if r["scaling_vs_1"] is not None:
                    label += f"  ({r['scaling_vs_1']:.0%} of linear)"
            right = r["units_per_s"]["max"] if r["units_per_s"] else 0.0  # past the range bar
            ax_right.text(right, bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
        ax_right.set_yticks(range(len(rows)), [r["name"] for r in rows])
        ax_right.invert_yaxis()
        ax_right.set_xlabel(f"{w['unit']}/s (median; bars: min-max of {doc['settings']['repeats']} repeats)")
        ax_right.xaxis.set_major_formatter(_si)
        tops = [r["units_per_s"]["max"] for r in rows if r["units_per_s"]]
        ax_right.set_xlim(0, (max(tops) if tops else 1) * 1.6)
        ax_right.set_title(f"{w['workload']}: throughput")
    tenant = f" | tenant {doc['tenant']['gb']:g} GB on {doc['tenant']['device']}" if doc.get("tenant") else ""
    fig.suptitle(f"{env['gpu_model'] or 'CPU'} | torch {env['torch']} | driver {env['driver'] or '-'} | "
                 f"commit {(env['commit'] or '?')[:10]} | {env['date']}{tenant}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _memory_bars(ax, bars: list[tuple[str, dict]], doc: dict, title: str) -> None:
    if bars:
        width = 0.8 / max(len(b["devices"]) for _, b in bars)
        for x, (_, b) in enumerate(bars):
            for i, dev in enumerate(b["devices"]):
                pos = x - 0.4 + width * (i + 0.5)
                first = x == i == 0
                ax.bar(pos, b["peak_reserved_bytes"][i] / GIB, width * 0.9, color="#c6dbef",
                       label="peak reserved" if first else None)
                yerr = None
                if b.get("err"):
                    yerr = [[b["err"][i][0] / GIB], [b["err"][i][1] / GIB]]
                ax.bar(pos, b["peak_allocated_bytes"][i] / GIB, width * 0.9, color="#2171b5", yerr=yerr,
                       capsize=2, label="peak allocated" if first else None)
                ax.text(pos, b["peak_reserved_bytes"][i] / GIB, dev.split(":")[-1], ha="center", va="bottom",
                        fontsize=7)
        ax.set_xticks(range(len(bars)), [name for name, _ in bars], rotation=20, ha="right")
        ax.set_ylabel("GiB per card")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no CUDA cards: per-card memory is not measured on CPU"
                if doc["device"] == "cpu" else "no run finished", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_title(title)


# -- profile: the child process -----------------------------------------------------------------

PROFILE_ENV = "JOB_BENCH_PROFILE_OUT"
# Phases in display order: (name, depth). "forward" and below exist where the strategy has them
# (dp on several GPUs: DataParallel's scatter/replicate/parallel_apply/gather).
PHASES = (("data", 0), ("forward+loss", 0), ("forward", 1), ("scatter", 2), ("replicate", 2),
          ("parallel_apply", 2), ("gather", 2), ("loss", 1), ("backward", 0), ("optimizer", 0))


class _Phases:
    """Wall time per phase, each phase between device syncs (so its GPU work is inside it), while on."""

    def __init__(self, devices):
        self.devices = [d for d in devices if d.type == "cuda"]
        self.on = False
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def sync(self) -> None:
        import torch

        for d in self.devices:
            torch.cuda.synchronize(d)

    def wrap(self, name: str, fn):
        from torch.profiler import record_function

        def timed(*args, **kwargs):
            if not self.on or threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)
            self.sync()
            t = time.perf_counter()
            with record_function(f"bench.{name}"):
                out = fn(*args, **kwargs)
            self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
            self.calls[name] = self.calls.get(name, 0) + 1
            return out

        return timed

    def wrap_iter(self, name: str, it):
        nxt = self.wrap(name, lambda: next(it))
        while True:
            yield nxt()


def _ms(event, *names: str) -> float:
    for n in names:
        v = getattr(event, n, None)
        if v is not None:
            return float(v) / 1e3  # the profiler counts microseconds
    return 0.0


def profile_step(cfg, out: Path) -> dict[str, Any]:
    """Train cfg.train.steps steps; profile the steps after cfg.train.timing_warmup; write out.{txt,json}
    and the trace (out.trace.json.gz). Single-process strategies only."""
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    from job import launch
    from job.train import Trainer

    warm, last = int(cfg.train.timing_warmup), int(cfg.train.steps)
    trainer = Trainer(cfg, launch.DistEnv(0, 1, 0))
    backward = torch.Tensor.backward
    try:
        phases = _Phases(trainer.devices)
        cuda = trainer.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=activities)
        s = trainer.strategy
        # Instrument the instances (and Tensor.backward, in this process only): the trainer's loop runs as is.
        s.loss = phases.wrap("forward+loss", s.loss)
        if s.loss_fn is not None:
            s.loss_fn = phases.wrap("loss", s.loss_fn)
        fwd = getattr(s, "forward", None)
        if isinstance(fwd, nn.DataParallel):
            for name in ("scatter", "replicate", "parallel_apply", "gather"):
                setattr(fwd, name, phases.wrap(name, getattr(fwd, name)))
        if fwd is not None:
            s.forward = phases.wrap("forward", fwd)
        trainer.optimizer.step = phases.wrap("optimizer", trainer.optimizer.step)
        trainer.batches = phases.wrap_iter("data", trainer.batches)
        torch.Tensor.backward = phases.wrap("backward", backward)
        clock: dict[str, float] = {}
        on_step_end = s.on_step_end

        def hook(step: int) -> None:
            on_step_end(step)
            if step == warm:
                phases.sync()
                prof.start()
                phases.on, clock["t0"] = True, time.perf_counter()
            elif phases.on and step == last:
                phases.sync()
                clock["t1"] = time.perf_counter()
                phases.on = False
                prof.stop()

        s.on_step_end = hook
        trainer.fit()
    finally:
        torch.Tensor.backward = backward
        trainer.close()
    if "t1" not in clock:
        raise RuntimeError(f"the profiled window (steps {warm + 1}-{last}) did not run")
    steps = last - warm
    step_ms = (clock["t1"] - clock["t0"]) * 1e3 / steps
    rows = [{"name": n, "depth": d, "ms_per_step": phases.seconds[n] * 1e3 / steps,
             "share": phases.seconds[n] * 1e3 / steps / step_ms, "calls": phases.calls[n]}
            for n, d in PHASES if n in phases.seconds]
    other = step_ms - sum(r["ms_per_step"] for r in rows if r["depth"] == 0)
    rows.append({"name": "other (zero_grad, lr, grad sync hooks, step bookkeeping)", "depth": 0,
                 "ms_per_step": other, "share": other / step_ms, "calls": steps})
    sort_by = "self_cuda_ms" if cuda else "self_cpu_ms"
    ops = []
    for e in prof.key_averages():
        if e.key.startswith(("bench.", "ProfilerStep")):
            continue
        ops.append({"name": e.key, "calls": int(e.count),
                    "self_cuda_ms": _ms(e, "self_device_time_total", "self_cuda_time_total"),
                    "self_cpu_ms": _ms(e, "self_cpu_time_total")})
    ops = sorted(ops, key=lambda o: -o[sort_by])[:15]
    trace = out.parent / (out.name + ".trace.json.gz")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
    where = (f"{len(trainer.devices)} GPU(s)" if cuda else "CPU")
    note = ("phases are timed between device syncs, so each holds its own GPU work; overlap between phases "
            "is removed, so the step is a little slower than unprofiled")
    lines = [f"profile {cfg.strategy.name}, {cfg.workload.name}, global batch {cfg.train.batch_size}, {where}: "
             f"{steps} steps after {warm} warm-up, {step_ms:.2f} ms per step", f"({note})"]
    lines += _grid(["phase", "ms/step", "share", "calls"],
                   [["  " * r["depth"] + r["name"], f"{r['ms_per_step']:.2f}", f"{r['share']:.1%}", str(r["calls"])]
                    for r in rows])
    lines.append(f"top {len(ops)} operators by self {'CUDA' if cuda else 'CPU'} time over the {steps} steps:")
    lines += _grid(["operator", "self CUDA ms", "self CPU ms", "calls"],
                   [[o["name"][:60], f"{o['self_cuda_ms']:.2f}", f"{o['self_cpu_ms']:.2f}", str(o["calls"])]
                    for o in ops])
    lines.append(f"trace (chrome://tracing, Perfetto): {trace}")
    doc = {"workload": cfg.workload.name, "strategy": cfg.strategy.name, "device": str(trainer.device.type),
           "warmup": warm, "steps": steps, "step_ms": step_ms, "phases": rows, "sort_by": sort_by, "top_ops": ops,
           "summary": "\n".join(lines), "trace": str(trace), "note": note}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(doc["summary"] + "\n")
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def profile_main(argv: list[str]) -> int:
    """`python -m job.bench [--config FILE] key=value ...` with JOB_BENCH_PROFILE_OUT=<path without suffix>:
    what bench.mode=profile runs per strategy in a fresh process."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        from job import devices

        devices.prepare_environment()
        out = os.environ.get(PROFILE_ENV)
        if not out:
            raise UsageError(f"{PROFILE_ENV} is not set; run `python -m job bench bench.mode=profile` instead")
        cfg = config_mod.load(argv)
        if _multi_process(cfg.strategy.name):
            raise UsageError(f"the profile runs one process; strategy {cfg.strategy.name} runs one per card")
        doc = profile_step(cfg, Path(out))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(doc["summary"], flush=True)
    return EXIT_OK


def run(cfg) -> int:
    """`python -m job bench`: returns 0 (all runs ok), 1 (a run failed), 75 (interrupted)."""
    return Bench(cfg).run()


__all__ = ["RESULT_SCHEMA", "Tenant", "batch_rule", "classify_trial", "compare", "image_folder", "profile_main",
           "run", "search_max_batch", "spread", "summarize", "summary_scaling", "table", "timed_throughput", "user_overrides",
           "write_chart"]

if __name__ == "__main__":
    sys.exit(profile_main(sys.argv[1:]))
