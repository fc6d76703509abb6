"""The benchmark as a whole: `Bench.run`.

`Bench` checks the settings, holds the tenant (bench.tenant_gb), hands every workload to its mode
(job.bench.compare, .maxbatch, .profiling) with the bench's `Runs` (job.bench.child: one run in a fresh
process), writes bench.json, bench.png and overrides.yaml, prints one table per workload and returns the
exit code; a first SIGINT/SIGTERM stops the current run and writes what was measured, a second one kills it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from job import config as config_mod
from job.bench.chart import write_chart
from job.bench.child import Runs
from job.bench.compare import bench_workload
from job.bench.environment import environment
from job.bench.imagefolder import images_dir_name
from job.bench.maxbatch import maxbatch_workload
from job.bench.process import GROUP_VARS
from job.bench.profiling import profile_workload
from job.bench.results import SCHEMA_ID
from job.bench.settings import (
    FILE_ROW_DATA,
    check_settings,
    multi_process,
    nest,
    user_overrides,
    variant_args,
)
from job.bench.table import table
from job.bench.tenant import Tenant
from job.errors import EXIT_INTERRUPTED, EXIT_OK, UsageError

log = logging.getLogger("job")


class Bench:
    """One `python -m job bench`: its settings, output folder and cards; its child runs, failures and interruption
    in `runs` (job.bench.child.Runs, what every mode is given)."""

    def __init__(self, cfg, workload: str | None = None):
        self.cfg, self.settings = cfg, cfg.bench
        check_settings(self.settings)
        preset = workload or cfg.workload.name  # the preset the command line picked, or the config's workload
        self.overrides = user_overrides(cfg, preset)
        self.cuda = self._cuda_count()
        self.device = "cuda" if self.cuda else "cpu"
        # Without GPUs, processes stand in for cards: the ddp process count (the user's, else cpu_procs).
        self.cards = self.cuda or int(self.overrides.get("strategy.nprocs") or self.settings.cpu_procs)
        if self.settings.mode == "profile":
            multi = [s for s in self.settings.strategies if multi_process(s)]
            if multi and self.cards > 1:  # on one card such a strategy is one process, profiled as any other
                raise UsageError(
                    f"bench.mode=profile profiles one process; {', '.join(multi)} runs one process per card and "
                    f"{'there are' if self.cuda else 'it would start'} {self.cards}: profile a single-process "
                    "strategy (strategies=[dp]), or one card (CUDA_VISIBLE_DEVICES=0; on a CPU strategy.nprocs=1)")
        self.workloads = list(self.settings.workloads) or [preset]  # workload presets, one table each
        # The workload each preset builds (lm-24x384 is an lm), and its settings' keys.
        loaded = {w: config_mod.load([f"workload={w}"]) for w in self.workloads}
        self.workload_names = {w: c.workload.name for w, c in loaded.items()}
        self.kinds = {w: config_mod.workload_of(c).workload.kinds() for w, c in loaded.items()}  # data.kind each reads
        if self.settings.tenant_gb and not self.cuda:
            raise UsageError(f"bench.tenant_gb={self.settings.tenant_gb:g} holds memory on a CUDA card, and none is "
                             "visible; drop bench.tenant_gb or run where a GPU is")
        for key, kind, hint in (("imagefolder", "imagefolder", "add resnet50 (GPU) or tiny (CPU)"),
                                ("tokens", "tokens", "add lm")):
            if self.settings[key] and self.settings.mode == "compare" and not any(
                    kind in kinds for kinds in self.kinds.values()):
                raise UsageError(f"bench.{key}=true needs a workload that reads data.kind={kind}, and "
                                 f"bench.workloads is {self.workloads}; {hint}")
        if self.settings.mode == "maxbatch" and self.settings.maxbatch_key == "workload.layers":
            flat = [w for w, c in loaded.items() if "layers" not in c.workload]
            if flat:
                raise UsageError(f"bench.maxbatch_key=workload.layers searches a workload's depth (its "
                                 f"workload.layers setting), and {', '.join(flat)} has none; use workload=lm or a "
                                 "workload of yours with a `layers` setting")
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        self.out = Path(self.settings.out or Path(cfg.train.run_dir) / f"bench-{stamp}")
        self.runs = Runs(self.settings, cuda=self.cuda, cards=self.cards, overrides=self.overrides, out=self.out,
                         images_dir=Path(self.settings.imagefolder_dir
                                         or Path(cfg.train.run_dir) / images_dir_name(self.settings.imagefolder_short_side)),
                         tokens_dir=Path(cfg.train.run_dir) / "bench-tokens")
        self.tenant: Tenant | None = None

    def _cuda_count(self) -> int:
        if self.cfg.train.device == "cpu":
            return 0
        import torch  # counting devices does not create a CUDA context here (no memory on any card)

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def _check_variants(self, overrides: Path) -> None:
        """Each bench.imagefolder_variants entry by the trainer's own rules, as its row runs (the overrides, the
        settings the bench gives every row that reads files, then the entry's), before any run; an entry that
        leaves the plain imagefolder row's data settings as they are would time that row again: refused."""
        if not (self.settings.imagefolder and self.settings.mode == "compare"):
            return
        for w in (w for w in self.workloads if "imagefolder" in self.kinds[w]):
            row = ["--config", str(overrides), f"workload={w}", *FILE_ROW_DATA]
            plain = config_mod.load(row).data
            for v in self.settings.imagefolder_variants:
                try:
                    data = config_mod.load([*row, *variant_args(v)]).data
                except UsageError as e:
                    raise UsageError(f"bench.imagefolder_variants entry \"{v}\": {e}") from None
                if data == plain:
                    raise UsageError(f"bench.imagefolder_variants entry \"{v}\" changes none of the plain imagefolder "
                                     f"row's data settings (every row that reads files has {' '.join(FILE_ROW_DATA)}): "
                                     "its row would time that one again; drop it, or give it a setting of its own")

    def _refuse_if_nothing_runs(self, overrides: Path) -> None:
        """A run the trainer would refuse is skipped with its reason; when that is every strategy of every
        workload, the bench would measure nothing: one line, exit 2, before anything is written."""
        reasons = []
        for w in self.workloads:
            for name in self.settings.strategies:
                try:
                    config_mod.load(self.runs.args(w, name, "check", [], warmup=self.settings.warmup, steps=self.settings.steps,
                                               overrides=overrides))
                except UsageError as e:
                    reasons.append(f"{name}: {e}")
        if reasons and len(reasons) == len(self.workloads) * len(self.settings.strategies):
            raise UsageError(f"no strategy in bench.strategies can run with these settings ({reasons[0]})")

    def run(self) -> int:
        from omegaconf import OmegaConf

        overrides_yaml = ("# What the bench command line / --config changed; passed to every run as --config.\n"
                          + OmegaConf.to_yaml(OmegaConf.create(nest(self.overrides))))
        with tempfile.TemporaryDirectory() as tmp:  # refuse a bad workload or override before anything starts
            (Path(tmp) / "overrides.yaml").write_text(overrides_yaml)
            for w in self.workloads:
                config_mod.load(["--config", str(Path(tmp) / "overrides.yaml"), f"workload={w}"])
            self._check_variants(Path(tmp) / "overrides.yaml")
            self._refuse_if_nothing_runs(Path(tmp) / "overrides.yaml")
        if any(k in os.environ for k in GROUP_VARS):
            log.warning("bench: %s are set but ignored: each run starts its own ranks on this node",
                        "/".join(k for k in GROUP_VARS if k in os.environ))
        results: list[dict] = []
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.settings.tenant_gb:
                self.tenant = Tenant(self.settings.tenant_gb, "cuda:0").start()
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "overrides.yaml").write_text(overrides_yaml)
            where = (f"{self.cuda} GPU(s)" if self.cuda else
                     f"CPU ({self.cards} ddp processes stand in for cards; no GPU numbers here)")
            b = self.settings
            what = {"compare": f"{b.warmup}+{b.steps} steps x {b.repeats} repeat(s)",
                    "maxbatch": f"trials of {b.maxbatch_steps} steps, at most {b.maxbatch_trials} per strategy",
                    "profile": f"{b.profile_steps} steps profiled after {b.warmup}"
                               + ("" if b.profile_phases else " (phases not timed)")}[b.mode]
            log.info("bench %s: %s, workloads %s, strategies %s, %s -> %s", b.mode, where, ",".join(self.workloads),
                     ",".join(b.strategies), what, self.out)
            mode = {"compare": bench_workload, "maxbatch": maxbatch_workload, "profile": profile_workload}[self.settings.mode]
            for w in self.workloads:
                results.append(mode(self.runs, w))
                if self.runs.interrupted:
                    break
        finally:
            if self.tenant is not None:
                self.tenant.stop()
            for s, h in previous.items():
                signal.signal(s, h)
        b = self.settings
        doc = {
            "schema": SCHEMA_ID, "mode": b.mode, "device": self.device, "cards": self.cards,
            "settings": {"steps": b.steps, "warmup": b.warmup, "repeats": b.repeats, "strategies": list(b.strategies),
                         "workloads": self.workloads, "baseline": b.baseline, "cpu_procs": b.cpu_procs,
                         "overrides": nest(self.overrides), "out": str(self.out), "imagefolder": bool(b.imagefolder),
                         "imagefolder_variants": [str(v) for v in b.imagefolder_variants],
                         "imagefolder_short_side": int(b.imagefolder_short_side),
                         "auto_settle": bool(b.auto_settle), "tokens": bool(b.tokens), "reference": bool(b.reference),
                         "maxbatch": {"key": b.maxbatch_key, "start": b.maxbatch_start, "steps": b.maxbatch_steps,
                                      "trials": b.maxbatch_trials, "minutes": float(b.maxbatch_minutes),
                                      "precision": float(b.maxbatch_precision)}},
            "tenant": ({"gb": float(b.tenant_gb), "device": "cuda:0", "pid": self.tenant.pid}
                       if self.tenant is not None else None),
            "environment": environment(results),
            "workloads": results, "chart": None, "failed": self.runs.failed,
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
        if self.runs.interrupted:
            return EXIT_INTERRUPTED
        if self.runs.failed:
            log.error("bench: %d run(s)/search(es) failed (see the table and %s)", self.runs.failed,
                      self.out / "logs")
            return 1
        return EXIT_OK

    def _on_signal(self, signum, _frame) -> None:
        """First signal: SIGTERM the current run (it checkpoints and exits); a second one: SIGKILL it."""
        again = self.runs.interrupted
        log.warning("bench: %s: %s", signal.Signals(signum).name,
                    "killing the current run" if again else
                    "stopping the current run, then writing what was measured (again to kill it)")
        self.runs.interrupt(again)
