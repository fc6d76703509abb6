"""One benchmark run in a fresh process, the seam every bench mode (compare, maxbatch, profiling) uses.

A mode describes a run as a `RunSpec` and hands it to `Runs.run`, which builds the command (`Runs.args`: the
user's overrides.yaml, the workload, the strategy, the bench's own keys), checks it as the trainer would
(a refused run is a row with its reason, nothing started), starts it in its own session, logs it to
logs/<run>.log, stops it at its time limit, and reads what it measured (metrics.jsonl and summary.json;
what they hold is in job/bench/__init__.py) into one row of bench.json. `Runs` also holds what the modes
read about the bench: its settings (the bench.* section), the cards, the output folders, failures and interruption.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from job import config as config_mod
from job.bench.process import error_line, plain_env, wait_or_kill
from job.bench.results import CARD_SCHEMA, empty_run
from job.bench.settings import strategy_arg
from job.errors import EXIT_OK, UsageError

log = logging.getLogger("job")

# What a run starts: the trainer, a profiled trainer (job.bench.profiling reads its files) or the
# hand-written loop (job.bench.reference: the same results files as the trainer's).
PROGRAMS = {"trainer": ("-m", "job", "train"), "profile": ("-m", "job.bench"),
            "reference": ("-m", "job.bench.reference")}


@dataclass(frozen=True)
class RunSpec:
    """One run of the bench: `name` is its row (and, with the repeat, its run id); `kind` what the row is
    (baseline, strategy, imagefolder, tokens, reference, telemetry_off/on, maxbatch_trial, profile)."""

    workload: str  # the workload preset
    name: str
    kind: str
    strategy: str
    extra: tuple[str, ...] = ()  # key=value arguments after the bench's own
    env: Mapping[str, str] = field(default_factory=dict)
    repeat: int = 1
    run_id: str | None = None  # default <workload>-<name>
    warmup: int | None = None  # default bench.warmup; timed steps after it: default bench.steps
    steps: int | None = None
    timeout_s: float | None = None  # at most bench.timeout_min
    scrape_port: int | None = None  # scrape this /metrics port while the run trains
    trial: bool = False  # a maxbatch trial: its failure is an outcome, not a failure of the bench
    program: str = "trainer"  # a key of PROGRAMS


def _edges(records: list[dict], warmup: int, total: int) -> tuple[dict | None, dict | None]:
    """The records logged at step `warmup` and step `total` (None where one is missing)."""
    by_step = {r.get("step"): r for r in records}
    return by_step.get(warmup), by_step.get(total)


def timed_throughput(records: list[dict], *, warmup: int, total: int, batch: int) -> float | None:
    """Samples/s between the records logged at step `warmup` and step `total` (None if one is missing)."""
    a, b = _edges(records, warmup, total)
    if a is None or b is None or total <= warmup:
        return None
    dt = float(b["time"]) - float(a["time"])
    return (total - warmup) * batch / dt if dt > 0 else None


def input_throughput(records: list[dict], *, warmup: int, total: int, batch: int) -> float | None:
    """Samples/s the run's input pipeline made over the later half of the records' window (from the first
    record at or past its middle), on the scale of the timed samples/s: the rate the loop trained at in that
    half x samples rank 0's DataLoader workers made / samples its loop took in it (job.data.Stream). None
    where the run has no workers' counts (synthetic data, data.workers=0).

    Below the trained rate, the timed steps drew on batches the workers had read ahead (during start-up they
    fill data.workers x 2 batches while the loop waits for its first step): a rate the run does not
    sustain. Why the later half: workers that keep up still draw the read-ahead down after the first step,
    until the batches asked for since come back (a worker's batch, and the one queued before it, later:
    0.5-1 s of 256 ImageNet-sized files on slow cores, 10-20 steps of compiled ResNet-50), so a window that
    starts within that time reads them short (a model of the pipeline: 2.7 % at 0.7 s a batch,
    docs/results/dev-2026-12-06-read-ahead); by the later half the read-ahead has settled where they keep
    up (read within one batch either way: one finished just before or after a record), and still falls
    where they do not. A window without a record in between is read whole, and so is one whose later half
    saw the workers make nothing (they had made every batch the run asks for, as from a file holding just
    those steps' samples; or a window of a step or two); where they made nothing in the whole window there
    is no figure (None), never a rate of 0."""
    a, b = _edges(records, warmup, total)
    if a is None or b is None or a.get("data_made") is None or b.get("data_made") is None:
        return None

    def since(start: dict) -> float | None:
        taken = int(b["data_taken"]) - int(start["data_taken"])
        made = int(b["data_made"]) - int(start["data_made"])
        dt = float(b["time"]) - float(start["time"])
        if taken <= 0 or made <= 0 or dt <= 0:
            return None
        return (total - int(start["step"])) * batch / dt * made / taken

    middle = warmup + (total - warmup) // 2
    later = [r for r in records if middle <= (r.get("step") or 0) < total and r.get("data_made") is not None]
    made = since(min(later, key=lambda r: r["step"])) if later else None
    return made if made is not None else since(a)


def input_cores(records: list[dict], *, warmup: int, total: int) -> float | None:
    """Cores rank 0's DataLoader workers kept busy over the same records' window: their CPU seconds
    (`data_cpu_s`, from /proc) over the window's seconds. None where the run has no workers' CPU times."""
    a, b = _edges(records, warmup, total)
    if a is None or b is None or a.get("data_cpu_s") is None or b.get("data_cpu_s") is None:
        return None
    dt = float(b["time"]) - float(a["time"])
    return (float(b["data_cpu_s"]) - float(a["data_cpu_s"])) / dt if dt > 0 else None


def host_thread(records: list[dict], *, warmup: int, total: int) -> tuple[float | None, float | None]:
    """(the share of the same records' window rank 0's training thread ran on a core, the share it was ready
    to run but waited for one), from its scheduler statistics (`train_thread_s`); None where there are none."""
    a, b = _edges(records, warmup, total)
    if a is None or b is None or not a.get("train_thread_s") or not b.get("train_thread_s"):
        return None, None
    dt = float(b["time"]) - float(a["time"])
    if dt <= 0:
        return None, None
    return tuple((float(y) - float(x)) / dt for x, y in zip(a["train_thread_s"], b["train_thread_s"]))


def card_idle(records: list[dict], *, warmup: int, total: int) -> float | None:
    """The share of the same records' window rank 0's card had nothing to run between steps, from its running
    idle seconds and steps measured (`card_idle_s`, `card_gaps`: job.cardgaps); None off a GPU."""
    from job.cardgaps import Reading, idle_share

    a, b = _edges(records, warmup, total)
    if a is None or b is None or a.get("card_gaps") is None or b.get("card_gaps") is None:
        return None
    mark = lambda r: Reading(float(r["card_idle_s"]), int(r["card_gaps"]), 0)  # noqa: E731 (steps given below)
    return idle_share(mark(a), mark(b), steps=total - warmup, seconds=float(b["time"]) - float(a["time"]))


def card_power_capped(records: list[dict], *, warmup: int, total: int) -> float | None:
    """The largest share of the same records' window that one of the run's cards ran below its clocks for its
    power limit, from each card's running count (`cards[].power_capped_s`: NVML's violation time); None where a
    card has no count (off a GPU, a driver or card that does not keep it). The most capped card: in a step the
    ranks synchronise, the slowest card sets everyone's pace."""
    a, b = _edges(records, warmup, total)
    if a is None or b is None:
        return None
    count = lambda r: {(c["rank"], c["device"]): c.get("power_capped_s") for c in r.get("cards") or []}  # noqa: E731
    before, after = count(a), count(b)
    dt = float(b["time"]) - float(a["time"])
    if not after or before.keys() != after.keys() or None in (*before.values(), *after.values()) or dt <= 0:
        return None
    return max((after[k] - before[k]) / dt for k in after)


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


class Runs:
    """The bench's child runs, one at a time, and what the modes read about the bench.

    settings: the bench.* section of the config; cuda: visible GPUs (0 on a CPU); cards: GPUs, or the
    processes standing in for them; overrides: the user's key=values every run gets; out: the output folder;
    images_dir and tokens_dir: where the generated files go; failed: runs and searches that failed;
    interrupted: set by the first SIGINT/SIGTERM (`interrupt`), after which no run starts."""

    def __init__(self, settings, *, cuda: int, cards: int, overrides: dict, out: Path, images_dir: Path,
                 tokens_dir: Path):
        self.settings, self.cuda, self.cards, self.overrides = settings, cuda, cards, overrides
        self.out, self.images_dir, self.tokens_dir = out, images_dir, tokens_dir
        self.failed = 0
        self.interrupted = False
        self._child: subprocess.Popen | None = None

    # -- what a run is -----------------------------------------------------------------------------
    def args(self, workload: str, strategy: str, run_id: str, extra: list[str], *, warmup: int, steps: int,
             overrides: Path | None = None) -> list[str]:
        """A run's key=value arguments: the overrides, the workload and strategy, the bench's own keys, extra."""
        args = ["--config", str(overrides or self.out / "overrides.yaml"), f"workload={workload}",
                strategy_arg(strategy), f"train.steps={warmup + steps}", f"train.timing_warmup={warmup}",
                f"train.log_every={warmup}", "train.checkpoint_every=0", "train.final_checkpoint=false",
                "train.resume=overwrite", f"train.run_dir={self.out / 'runs'}", f"train.run_id={run_id}"]
        if not self.cuda and "strategy.nprocs" not in self.overrides and not any(
                e.startswith("strategy.nprocs=") for e in extra):
            args.append(f"strategy.nprocs={self.settings.cpu_procs}")
        return args + list(extra)

    def first_card(self) -> str:
        """The card a one-card row runs on: the first of CUDA_VISIBLE_DEVICES, else the first on the PCI bus."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            from job.devices import parse_visible

            entries = parse_visible(visible)
            if entries:
                return entries[0]
        return "0"  # CUDA_DEVICE_ORDER=PCI_BUS_ID (job.devices)

    def ref_cfg(self, workload: str):
        """The workload's config as every run starts from it: its preset plus the user's overrides."""
        return config_mod.load(["--config", str(self.out / "overrides.yaml"), f"workload={workload}"])

    # -- running one ---------------------------------------------------------------------------------
    def run(self, spec: RunSpec) -> dict[str, Any]:
        """Start the run, wait for it, read its results: its row, status ok, failed, skipped or interrupted."""
        data = next((e.split("=", 1)[1] for e in spec.extra if e.startswith("data.kind=")), "synthetic")
        row = empty_run(spec.name, spec.kind, spec.strategy, repeat=spec.repeat, data=data)
        if self.interrupted:
            row["reason"] = "the benchmark was interrupted before this run"
            return row
        warmup = self.settings.warmup if spec.warmup is None else spec.warmup
        steps = self.settings.steps if spec.steps is None else spec.steps
        run_id = spec.run_id or f"{spec.workload}-{spec.name}"
        args = self.args(spec.workload, spec.strategy, run_id, list(spec.extra), warmup=warmup, steps=steps)
        try:
            child_cfg = config_mod.load(args)  # the run would refuse it: say why now, spend nothing
        except UsageError as e:
            row["reason"] = str(e)
            log.info("bench: %-22s skipped: %s", spec.name, e)
            return row
        command = [*PROGRAMS[spec.program], *args]
        row["command"] = ["python", *command]
        row["env"] = dict(spec.env)
        row["batch_size"] = int(child_cfg.train.batch_size)
        run_dir = self.out / "runs" / run_id
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{run_id}.log"
        row["run_dir"], row["log"] = str(run_dir), str(log_path)
        log.info("bench: %-22s running (%s)", spec.name, shlex.join(args[2:]))
        limit = self.settings.timeout_min * 60 if spec.timeout_s is None else min(spec.timeout_s, self.settings.timeout_min * 60)
        start = time.monotonic()
        code, timed_out = self._wait([sys.executable, *command], spec, row, log_path, limit)
        row["wall_s"] = round(time.monotonic() - start, 3)
        row["exit_code"] = code
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the bench needs none; they are big
        count = not spec.trial
        if self.interrupted:
            row["status"], row["reason"] = "interrupted", "the benchmark was interrupted during this run"
            return row
        if timed_out:
            return self.fail(row, f"timed out after {limit / 60:g} min", count)
        if code != EXIT_OK:
            return self.fail(row, error_line(log_path.read_text(errors="replace")), count)
        if spec.program == "profile":  # its results are the profile's files, read by the mode
            row["status"] = "ok"
            return row
        try:
            self._read_results(row, run_dir, child_cfg, warmup=warmup, steps=steps)
        except (OSError, ValueError, KeyError) as e:
            return self.fail(row, f"run finished but its results cannot be read: {e}", count)
        row["status"] = "ok"
        log.info("bench: %-22s ok: %s samples/s", spec.name, f"{row['samples_per_s']:,.1f}")
        return row

    def fail(self, row: dict, reason: str, count: bool = True) -> dict:
        """Mark the row failed with its reason; `count`: it fails the bench (exit 1)."""
        row["status"], row["reason"] = "failed", reason
        if count:
            self.failed += 1
            log.warning("bench: %-22s FAILED: %s", row["name"], reason)
        else:
            log.info("bench: %-22s failed: %s", row["name"], reason)
        return row

    def interrupt(self, again: bool) -> None:
        """The bench got a signal: SIGTERM the current run (it checkpoints and exits), SIGKILL it `again`."""
        self.interrupted = True
        if self._child is not None and self._child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._child.pid, signal.SIGKILL if again else signal.SIGTERM)

    def _wait(self, cmd: list[str], spec: RunSpec, row: dict, log_path: Path, limit: float) -> tuple[int, bool]:
        """Run `cmd` in its own session, logged to log_path, scraped if asked: (exit code, timed out)."""
        scraper = None
        with open(log_path, "w") as logf:
            self._child = subprocess.Popen(
                cmd, cwd=os.getcwd(), stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                env={**plain_env(), **spec.env, "PYTHONUNBUFFERED": "1"},
            )
            if spec.scrape_port is not None:
                scraper = _Scraper(f"http://127.0.0.1:{spec.scrape_port}/metrics", self.settings.scrape_interval_s)
                scraper.start()
            try:
                return self._child.wait(timeout=limit), False
            except subprocess.TimeoutExpired:
                self._stop_child()
                return self._child.returncode, True
            finally:
                if scraper is not None:
                    scraper.stop()
                    row["scrapes_ok"], row["scrapes_failed"] = scraper.ok, scraper.failed
                self._child = None

    def _stop_child(self) -> None:
        """SIGTERM the run's session (its ranks too), then SIGKILL after 30 s."""
        p = self._child
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        wait_or_kill(p, 30)

    def _read_results(self, row: dict, run_dir: Path, child_cfg, *, warmup: int, steps: int) -> None:
        summary = json.loads((run_dir / "summary.json").read_text())
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        total = warmup + steps
        sps = timed_throughput(records, warmup=warmup, total=total, batch=row["batch_size"])
        if sps is None:
            raise ValueError(f"metrics.jsonl has no records for steps {warmup} and {total}")
        made = input_throughput(records, warmup=warmup, total=total, batch=row["batch_size"])
        trained, sps = sps, min(sps, made) if made is not None else sps  # what the run sustains
        k = config_mod.workload_of(child_cfg).workload.units(config_mod.workload_settings(child_cfg))
        kinds = {(b["rank"], b["device"]): b["kinds"] for b in summary.get("memory_breakdown", [])}
        cards = [{**{key: r.get(key) for key in CARD_SCHEMA["properties"]}, "kinds": kinds.get((r["rank"], r["device"]))}
                 for r in summary.get("cards", [])]
        world = int(summary["world_size"])
        window = summary.get("peak_window")
        ran, waited = host_thread(records, warmup=warmup, total=total)
        row.update({
            "world_size": world, "units": len(cards) or world, "timed_steps": steps,
            "samples_per_s": sps, "units_per_s": sps * k, "step_s": row["batch_size"] / sps,
            "trainer_samples_per_s": float(summary["samples_per_s"]),
            "trained_samples_per_s": trained, "input_samples_per_s": made,
            "input_worker_cores": input_cores(records, warmup=warmup, total=total),
            "input_gpu_share": summary.get("data_gpu_share"),  # data.decode=auto's choice (rank 0's), at the end
            "input_auto_settled_step": summary.get("data_auto_settled_step"),  # every later step trained with it
            "host_thread_on_core": ran, "host_thread_waited": waited,
            "card_idle": card_idle(records, warmup=warmup, total=total),
            "card_power_capped": card_power_capped(records, warmup=warmup, total=total),
            "imbalance": summary.get("imbalance"), "cards": cards, "peak_window": window,
            "params": summary.get("params"),
        })
        if window != [warmup, total]:
            row["window_note"] = (f"peaks cover steps after {window[0]} to {window[1]}, not the timed steps "
                                  f"{warmup + 1}-{total}" if window else "the run did not record its peak window")
