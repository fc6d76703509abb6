"""The benchmark as a whole (`Bench.run`) and one configuration in a fresh process (`Bench.run_one`).

`Bench.run` checks the settings, holds the tenant (bench.tenant_gb), hands every workload to its mode
(job.bench.compare, .maxbatch, .profiling), writes bench.json, bench.png and overrides.yaml, prints one
table per workload and returns the exit code; a first SIGINT/SIGTERM stops the current run and writes what
was measured, a second one kills it. `Bench.run_one` starts `python -m job train` in its own session, logs
it to logs/<run>.log, stops it at bench.timeout_min and reads its metrics.jsonl and summary.json
(`_read_results`; what they hold is in job/bench/__init__.py).
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
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from job import config as config_mod
from job.bench.chart import write_chart
from job.bench.compare import bench_workload
from job.bench.environment import environment
from job.bench.maxbatch import maxbatch_workload
from job.bench.process import GROUP_VARS, error_line, plain_env, wait_or_kill
from job.bench.profiling import profile_workload
from job.bench.results import CARD_SCHEMA, SCHEMA_ID, empty_run
from job.bench.settings import check_settings, nest, strategy_arg, user_overrides
from job.bench.table import table
from job.bench.tenant import Tenant
from job.errors import EXIT_INTERRUPTED, EXIT_OK, UsageError

log = logging.getLogger("job")


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


class Bench:
    """One `python -m job bench`: its settings, output folder and cards, the run in progress, the failures."""

    def __init__(self, cfg, workload: str | None = None):
        self.cfg, self.b = cfg, cfg.bench
        check_settings(self.b)
        preset = workload or cfg.workload.name  # the preset the command line picked, or the config's workload
        self.overrides = user_overrides(cfg, preset)
        self.cuda = self._cuda_count()
        self.device = "cuda" if self.cuda else "cpu"
        # Without GPUs, processes stand in for cards: the ddp process count (the user's, else cpu_procs).
        self.cards = self.cuda or int(self.overrides.get("strategy.nprocs") or self.b.cpu_procs)
        self.workloads = list(self.b.workloads) or [preset]  # workload presets, one table each
        # The workload each preset builds (lm-24x384 is an lm), and its settings' keys.
        loaded = {w: config_mod.load([f"workload={w}"]) for w in self.workloads}
        self.kinds = {w: c.workload.name for w, c in loaded.items()}
        if self.b.tenant_gb and not self.cuda:
            raise UsageError(f"bench.tenant_gb={self.b.tenant_gb:g} holds memory on a CUDA card, and none is "
                             "visible; drop bench.tenant_gb or run where a GPU is")
        for key, kind, hint in (("imagefolder", "imagefolder", "add resnet50 (GPU) or tiny (CPU)"),
                                ("tokens", "tokens", "add lm")):
            if self.b[key] and self.b.mode == "compare" and not any(
                    kind in config_mod.workload_of(c).workload.kinds() for c in loaded.values()):
                raise UsageError(f"bench.{key}=true needs a workload that reads data.kind={kind}, and "
                                 f"bench.workloads is {self.workloads}; {hint}")
        if self.b.mode == "maxbatch" and self.b.maxbatch_key == "workload.layers":
            flat = [w for w, c in loaded.items() if "layers" not in c.workload]
            if flat:
                raise UsageError(f"bench.maxbatch_key=workload.layers searches a workload's depth (its "
                                 f"workload.layers setting), and {', '.join(flat)} has none; use workload=lm or a "
                                 "workload of yours with a `layers` setting")
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        self.out = Path(self.b.out or Path(cfg.train.run_dir) / f"bench-{stamp}")
        self.images_dir = Path(self.b.imagefolder_dir or Path(cfg.train.run_dir) / "bench-images")
        self.tokens_dir = Path(cfg.train.run_dir) / "bench-tokens"
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
    def run_args(self, workload: str, strategy: str, run_id: str, extra: list[str], *, warmup: int,
              steps: int, overrides: Path | None = None) -> list[str]:
        args = ["--config", str(overrides or self.out / "overrides.yaml"), f"workload={workload}", strategy_arg(strategy),
                f"train.steps={warmup + steps}", f"train.timing_warmup={warmup}",
                f"train.log_every={warmup}", "train.checkpoint_every=0", "train.final_checkpoint=false",
                "train.resume=overwrite",
                f"train.run_dir={self.out / 'runs'}", f"train.run_id={run_id}"]
        if not self.cuda and "strategy.nprocs" not in self.overrides and not any(
                e.startswith("strategy.nprocs=") for e in extra):
            args.append(f"strategy.nprocs={self.b.cpu_procs}")
        return args + extra

    def first_card(self) -> str:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            from job.devices import parse_visible

            entries = parse_visible(visible)
            if entries:
                return entries[0]
        return "0"  # CUDA_DEVICE_ORDER=PCI_BUS_ID (job.devices): the first card on the PCI bus

    def ref_cfg(self, workload: str):
        """The workload's config as every run starts from it: its preset plus the user's overrides."""
        return config_mod.load(["--config", str(self.out / "overrides.yaml"), f"workload={workload}"])

    def run_one(self, workload: str, name: str, kind: str, strategy: str, *, extra: list[str] = (),
                env: dict[str, str] | None = None, scrape_port: int | None = None, repeat: int = 1,
                run_id: str | None = None, warmup: int | None = None, steps: int | None = None,
                timeout_s: float | None = None, count_failure: bool = True,
                module: str = "job") -> dict[str, Any]:
        data = next((e.split("=", 1)[1] for e in extra if e.startswith("data.kind=")), "synthetic")
        row = empty_run(name, kind, strategy, repeat=repeat, data=data)
        if self.interrupted:
            row["reason"] = "the benchmark was interrupted before this run"
            return row
        warmup = self.b.warmup if warmup is None else warmup
        steps = self.b.steps if steps is None else steps
        run_id = run_id or f"{workload}-{name}"
        args = self.run_args(workload, strategy, run_id, list(extra), warmup=warmup, steps=steps)
        try:
            child_cfg = config_mod.load(args)  # the run would refuse it: say why now, spend nothing
        except UsageError as e:
            row["reason"] = str(e)
            log.info("bench: %-22s skipped: %s", name, e)
            return row
        # module: job (the trainer), job.bench (a profiled run: job.bench.profiling reads its files) or
        # job.bench.reference (the hand-written loop: the same results files as the trainer's).
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
                env={**plain_env(), **(env or {}), "PYTHONUNBUFFERED": "1"},
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
            return self.fail(row, f"timed out after {limit / 60:g} min", count_failure)
        if code != EXIT_OK:
            return self.fail(row, error_line(log_path.read_text(errors="replace")), count_failure)
        if module == "job.bench":
            row["status"] = "ok"
            return row
        try:
            self._read_results(row, run_dir, child_cfg, warmup=warmup, steps=steps)
        except (OSError, ValueError, KeyError) as e:
            return self.fail(row, f"run finished but its results cannot be read: {e}", count_failure)
        row["status"] = "ok"
        log.info("bench: %-22s ok: %s samples/s", name, f"{row['samples_per_s']:,.1f}")
        return row

    def fail(self, row: dict, reason: str, count: bool = True) -> dict:
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
        wait_or_kill(p, 30)

    def _read_results(self, row: dict, run_dir: Path, child_cfg, *, warmup: int, steps: int) -> None:
        summary = json.loads((run_dir / "summary.json").read_text())
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        total = warmup + steps
        sps = timed_throughput(records, warmup=warmup, total=total, batch=row["batch_size"])
        if sps is None:
            raise ValueError(f"metrics.jsonl has no records for steps {warmup} and {total}")
        k = config_mod.workload_of(child_cfg).workload.units(config_mod.workload_settings(child_cfg))
        kinds = {(b["rank"], b["device"]): b["kinds"] for b in summary.get("memory_breakdown", [])}
        cards = [{**{key: r.get(key) for key in CARD_SCHEMA["properties"]}, "kinds": kinds.get((r["rank"], r["device"]))}
                 for r in summary.get("cards", [])]
        world = int(summary["world_size"])
        window = summary.get("peak_window")
        row.update({
            "world_size": world, "units": len(cards) or world, "timed_steps": steps,
            "samples_per_s": sps, "units_per_s": sps * k, "step_s": row["batch_size"] / sps,
            "trainer_samples_per_s": float(summary["samples_per_s"]),
            "imbalance": summary.get("imbalance"), "cards": cards, "peak_window": window,
            "params": summary.get("params"),
        })
        if window != [warmup, total]:
            row["window_note"] = (f"peaks cover steps after {window[0]} to {window[1]}, not the timed steps "
                                  f"{warmup + 1}-{total}" if window else "the run did not record its peak window")

    def _refuse_if_nothing_runs(self, overrides: Path) -> None:
        """A run the trainer would refuse is skipped with its reason; when that is every strategy of every
        workload, the bench would measure nothing: one line, exit 2, before anything is written."""
        reasons = []
        for w in self.workloads:
            for name in self.b.strategies:
                try:
                    config_mod.load(self.run_args(w, name, "check", [], warmup=self.b.warmup, steps=self.b.steps,
                                               overrides=overrides))
                except UsageError as e:
                    reasons.append(f"{name}: {e}")
        if reasons and len(reasons) == len(self.workloads) * len(self.b.strategies):
            raise UsageError(f"no strategy in bench.strategies can run with these settings ({reasons[0]})")

    def run(self) -> int:
        from omegaconf import OmegaConf

        overrides_yaml = ("# What the bench command line / --config changed; passed to every run as --config.\n"
                          + OmegaConf.to_yaml(OmegaConf.create(nest(self.overrides))))
        with tempfile.TemporaryDirectory() as tmp:  # refuse a bad workload or override before anything starts
            (Path(tmp) / "overrides.yaml").write_text(overrides_yaml)
            for w in self.workloads:
                config_mod.load(["--config", str(Path(tmp) / "overrides.yaml"), f"workload={w}"])
            self._refuse_if_nothing_runs(Path(tmp) / "overrides.yaml")
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
            one = {"compare": bench_workload, "maxbatch": maxbatch_workload, "profile": profile_workload}[self.b.mode]
            for w in self.workloads:
                results.append(one(self, w))
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
                         "overrides": nest(self.overrides), "out": str(self.out), "imagefolder": bool(b.imagefolder),
                         "tokens": bool(b.tokens), "reference": bool(b.reference),
                         "maxbatch": {"key": b.maxbatch_key, "start": b.maxbatch_start, "steps": b.maxbatch_steps,
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
