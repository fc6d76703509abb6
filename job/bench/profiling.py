"""bench.mode=profile, both sides: the bench starts one fresh process per strategy (`profile_workload`),
which runs `python -m job.bench` (`profile_main`): the trainer's own loop under torch.profiler, the phases
timed between device syncs unless bench.profile_phases=false (`profile_step`), what the card ran on each CUDA
stream (`card_streams`, from the trace), written to profile-<workload>-<strategy>.txt/.json and a Chrome trace.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from job import config as config_mod
from job import phases as job_phases
from job.bench.child import Runs, RunSpec
from job.bench.results import workload_result
from job.bench.settings import multi_process
from job.bench.table import _grid
from job.errors import EXIT_OK, EXIT_USAGE, UsageError

PROFILE_ENV = "JOB_BENCH_PROFILE_OUT"
# Phases in display order: (name, depth), as job.phases marks them. "forward" and below exist where the
# strategy has them (dp on several GPUs: DataParallel's scatter/replicate/parallel_apply/gather).
PHASES = (("data", 0), ("forward+loss", 0), ("forward", 1), ("scatter", 2), ("replicate", 2),
          ("parallel_apply", 2), ("gather", 2), ("loss", 1), ("backward", 0), ("optimizer", 0))


class _Phases:
    """A job.phases listener: wall time per phase, each phase between device syncs (so its GPU work is
    inside it) and named in the torch.profiler trace, while on; marks from other threads (the replicas'
    threads of dp and balanced) are not timed."""

    def __init__(self, devices):
        self.devices = [d for d in devices if d.type == "cuda"]
        self.on = False
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def sync(self) -> None:
        import torch

        for d in self.devices:
            torch.cuda.synchronize(d)

    @contextlib.contextmanager
    def _timed(self, name: str):
        from torch.profiler import record_function

        self.sync()
        t = time.perf_counter()
        with record_function(f"bench.{name}"):
            yield
        self.sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
        self.calls[name] = self.calls.get(name, 0) + 1

    def phase(self, name: str):
        if not self.on or threading.current_thread() is not threading.main_thread():
            return contextlib.nullcontext()
        return self._timed(name)


def _ms(event, *names: str) -> float:
    for n in names:
        v = getattr(event, n, None)
        if v is not None:
            return float(v) / 1e3  # the profiler counts microseconds
    return 0.0


def profile_step(cfg, out: Path) -> dict[str, Any]:
    """Train cfg.train.steps steps; profile the steps after cfg.train.timing_warmup; write out.{txt,json}
    and the trace (out.trace.json.gz). Single-process strategies only."""
    from torch.profiler import ProfilerActivity, profile

    from job import launch
    from job.train import Trainer

    warm, last = int(cfg.train.timing_warmup), int(cfg.train.steps)
    timed = bool(cfg.bench.profile_phases)
    trainer = Trainer(cfg, launch.DistEnv(0, 1, 0))
    phases = _Phases(trainer.devices)
    cuda = trainer.device.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    clock: dict[str, float] = {}

    def window(step: int) -> None:  # the trainer's step hook: profile the steps after `warm`
        if step == warm:
            phases.sync()
            prof.start()
            phases.on, clock["t0"] = True, time.perf_counter()
        elif phases.on and step == last:
            phases.sync()
            clock["t1"] = time.perf_counter()
            phases.on = False
            prof.stop()

    trainer.step_hooks.append(window)
    try:
        with job_phases.listening(phases) if timed else contextlib.nullcontext():
            trainer.fit()
    finally:
        trainer.close()
    if "t1" not in clock:
        raise RuntimeError(f"the profiled window (steps {warm + 1}-{last}) did not run")
    steps = last - warm
    step_ms = (clock["t1"] - clock["t0"]) * 1e3 / steps
    rows = [{"name": n, "depth": d, "ms_per_step": phases.seconds[n] * 1e3 / steps,
             "share": phases.seconds[n] * 1e3 / steps / step_ms, "calls": phases.calls[n]}
            for n, d in PHASES if n in phases.seconds]
    if timed:
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
        with open(raw) as f:
            card = card_streams(json.load(f).get("traceEvents", []), steps, device=trainer.device.index or 0)
    where = (f"{len(trainer.devices)} GPU(s)" if cuda else "CPU")
    note = ("phases are timed between device syncs, so each holds its own GPU work; overlap between phases "
            "is removed, so the step is a little slower than unprofiled" if timed else
            "bench.profile_phases=false: no phase is timed and nothing waits for the card inside the profiled "
            "steps, so the data path's thread and the card's streams overlap as when training")
    lines = [f"profile {cfg.strategy.name}, {cfg.workload.name}, global batch {cfg.train.batch_size}, {where}: "
             f"{steps} steps after {warm} warm-up, {step_ms:.2f} ms per step", f"({note})"]
    if rows:
        lines += _grid(["phase", "ms/step", "share", "calls"],
                       [["  " * r["depth"] + r["name"], f"{r['ms_per_step']:.2f}", f"{r['share']:.1%}",
                         str(r["calls"])] for r in rows])
    if card is not None:
        lines += card_lines(card, step_ms)
    lines.append(f"top {len(ops)} operators by self {'CUDA' if cuda else 'CPU'} time over the {steps} steps:")
    lines += _grid(["operator", "self CUDA ms", "self CPU ms", "calls"],
                   [[o["name"][:60], f"{o['self_cuda_ms']:.2f}", f"{o['self_cpu_ms']:.2f}", str(o["calls"])]
                    for o in ops])
    lines.append(f"trace (chrome://tracing, Perfetto): {trace}")
    doc = {"workload": cfg.workload.name, "strategy": cfg.strategy.name, "device": str(trainer.device.type),
           "warmup": warm, "steps": steps, "step_ms": step_ms, "phases_timed": timed, "phases": rows,
           "card": card, "sort_by": sort_by, "top_ops": ops,
           "summary": "\n".join(lines), "trace": str(trace), "note": note}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(doc["summary"] + "\n")
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


# What the card runs, in a torch.profiler trace: its kernels, copies and memory sets, each with its CUDA stream.
CARD_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _common(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """The length both unions of spans cover (each merged and sorted)."""
    i = j = 0
    both = 0.0
    while i < len(x) and j < len(y):
        both += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return both


def card_streams(events: list[dict], steps: int, *, device: int = 0, top: int = 4) -> dict[str, Any] | None:
    """What card `device` (the training process's first) ran over the profiled steps, from the trace's `events`
    (a Chrome trace's traceEvents):
    each CUDA stream's time a step (its kernels, copies and sets) with its `top` entries, the busiest stream
    first (the model's: the training thread's stream, where the step's kernels go); the card's busy time a
    step (the union over every stream); and how much of the busiest stream's time another stream ran beside
    it (the data path's copies and decoding share the card with the model there). None without such
    events (a CPU run)."""
    spans: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    time_of: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    calls: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        args = e.get("args") or {}
        if (e.get("cat") not in CARD_EVENTS or not isinstance(e.get("dur"), (int, float))
                or int(args.get("device", device)) != device):
            continue
        stream = int(args.get("stream", -1))
        spans[stream].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        time_of[stream][str(e.get("name", "?"))] += float(e["dur"])
        calls[stream][str(e.get("name", "?"))] += 1
    if not spans:
        return None
    per = 1e3 * steps  # microseconds over the window -> ms a step
    order = sorted(spans, key=lambda s: -sum(time_of[s].values()))
    merged = {s: _merged(spans[s]) for s in order}
    main, rest = merged[order[0]], _merged([x for s in order[1:] for x in spans[s]])
    both = _common(main, rest)
    busy = _length(main) + _length(rest) - both  # the union of every stream's spans
    return {"device": device, "busy_ms": busy / per, "main_stream": order[0], "main_beside_ms": both / per,
            "streams": [{"stream": s, "ms_per_step": _length(merged[s]) / per,
                         "events_per_step": sum(calls[s].values()) / steps,
                         "top": [{"name": n, "ms_per_step": t / per, "calls": calls[s][n]}
                                 for n, t in time_of[s].most_common(top)]} for s in order]}


def card_lines(card: dict[str, Any], step_ms: float) -> list[str]:
    """card_streams' figures as the profile's text."""
    main = card["streams"][0]
    lines = [f"card {card['device']} (kernels, copies and sets of every CUDA stream, from the trace): busy "
             f"{card['busy_ms']:.2f} "
             f"ms a step of {step_ms:.2f}; the busiest stream ({card['main_stream']}, the model's) "
             f"{main['ms_per_step']:.2f} ms, {card['main_beside_ms']:.2f} of it beside another stream's work"]
    for s in card["streams"]:
        lines.append(f"  stream {s['stream']}: {s['ms_per_step']:.2f} ms a step, {s['events_per_step']:.1f} "
                     "events a step")
        lines += [f"    {t['ms_per_step']:8.3f} ms  {t['calls']:6d} calls  {t['name'][:80]}" for t in s["top"]]
    return lines


def profile_main(argv: list[str]) -> int:
    """`python -m job.bench [--config FILE] key=value ...` with JOB_BENCH_PROFILE_OUT=<path without suffix>:
    what bench.mode=profile runs per strategy in a fresh process."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        from job import devices, launch

        devices.prepare_environment()
        out = os.environ.get(PROFILE_ENV)
        if not out:
            raise UsageError(f"{PROFILE_ENV} is not set; run `python -m job bench bench.mode=profile` instead")
        cfg = config_mod.load(argv)
        if multi_process(cfg.strategy.name) and launch.nprocs_for(cfg, launch.cuda_count(cfg)) > 1:
            raise UsageError(f"the profile runs one process; strategy {cfg.strategy.name} runs one per card here")
        doc = profile_step(cfg, Path(out))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(doc["summary"], flush=True)
    return EXIT_OK


def profile_workload(bench: Runs, workload: str) -> dict[str, Any]:
    """profile: one profiled process per strategy; its profile-<workload>-<strategy>.json joins the result."""
    ref_cfg = bench.ref_cfg(workload)
    runs, profiles = [], []
    total = bench.settings.warmup + bench.settings.profile_steps
    for s in bench.settings.strategies:
        if bench.interrupted:
            break
        out = bench.out / f"profile-{workload}-{s}"
        row = bench.run(RunSpec(workload, f"profile-{s}", "profile", s, program="profile",
                                extra=(f"train.log_every={total}",
                                       f"bench.profile_phases={str(bench.settings.profile_phases).lower()}"),
                                steps=bench.settings.profile_steps,
                                env={PROFILE_ENV: str(out)}))
        runs.append(row)
        if row["status"] == "ok":
            try:
                profiles.append(json.loads(out.with_suffix(".json").read_text()))
            except (OSError, ValueError) as e:
                bench.fail(row, f"the profile finished but {out.with_suffix('.json')} cannot be read: {e}")
    return workload_result(workload, ref_cfg, cards=bench.cards, runs=runs, profiles=profiles)
