"""`python -m job bench`: the strategies side by side, each in a fresh process through the real trainer.

For every workload (bench.workloads, or the config's one) the benchmark runs, one after the other:
  1. the 1-card baseline: bench.baseline on the first visible card (CUDA_VISIBLE_DEVICES), global
     batch divided by the card count, so the per-card batch is the same as in the multi-card runs;
  2. every strategy of bench.strategies on all visible cards;
  3. with bench.telemetry_overhead, bench.telemetry_strategy with telemetry.port off, then on (and
     scraped), bench.telemetry_repeats times; the strategy's own run in 2. is the first "off" run.
Each run is `python -m job train` in a fresh process (its own session, so a timeout stops its ranks
too), with the user's overrides (what the command line and --config changed against the workload's
preset) written to overrides.yaml, plus the bench's own keys: steps, warm-up, no periodic checkpoint,
run directory. A strategy the registry does not have is skipped with the reason; a run that fails
(OOM, crash, timeout) is reported with its error line and the others still run.

Throughput comes from the run's metrics.jsonl: the trainer synchronises CUDA and logs at step
`warmup` and at the last step (train.log_every = bench.warmup), so the timed window is exactly the
steps after warm-up, and nothing after the last step (the final checkpoint write) is in it. The
trainer's own summary.json figure is kept beside it (`trainer_samples_per_s`). Per-card memory
(torch peak allocated/reserved, NVML used at the end) comes from summary.json.

Without a GPU: `cards` are processes. ddp runs bench.cpu_procs processes over gloo, the baseline
one process with the global batch divided by bench.cpu_procs; dp runs one process (DataParallel on
a CPU is the plain module), so it has no scaling figure. Numbers measured this way say nothing
about GPUs; the CPU run exists so CI exercises the whole path (table, JSON, chart).

Writes to the output folder: bench.json (every number and the environment; RESULT_SCHEMA below),
bench.png (per-card memory bars per run, throughput beside), overrides.yaml, logs/<run>.log and
runs/<run>/ (the trainer's run directories, checkpoints removed). Prints one table per workload last.
Exit code: 0 if every run that was started succeeded, 1 if one failed, 2 on bad input, 75 if the
benchmark itself was interrupted (partial results are still written).
"""

from __future__ import annotations

import contextlib
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
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from job import config as config_mod
from job.errors import EXIT_INTERRUPTED, EXIT_OK, UsageError

log = logging.getLogger("job")
MB = 1024 * 1024  # MB in tables means MiB, as in the trainer's table (job/report.py)
GIB = 1024**3
SCHEMA_ID = "trainjob-bench/1"
ROOT = Path(__file__).resolve().parent.parent

# Keys the benchmark sets on every run; the user's values for them are not passed on.
BENCH_KEYS = ("train.steps", "train.timing_warmup", "train.log_every", "train.checkpoint_every",
              "train.run_dir", "train.run_id", "train.resume")
# Keys that pick what is compared rather than how it runs.
PICK_KEYS = ("strategy.name", "workload.name")


# -- the JSON written to bench.json ------------------------------------------------------------


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    """A JSON-schema object with exactly these keys, all required."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


_STR, _INT, _NUM, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


CARD_SCHEMA = _obj({
    "rank": _INT, "device": _STR, "name": _STR, "uuid": _STR, "pci_bus_id": _STR,
    "peak_allocated_bytes": _INT, "peak_reserved_bytes": _INT,
    "nvml_used_bytes": _nullable(_INT), "nvml_total_bytes": _nullable(_INT),
})
RUN_SCHEMA = _obj({
    "name": _STR,
    "kind": {"enum": ["baseline", "strategy", "telemetry_off", "telemetry_on"]},
    "strategy": _STR,
    "status": {"enum": ["ok", "failed", "skipped", "interrupted"]},
    "reason": _nullable(_STR),
    "exit_code": _nullable(_INT),
    "command": {"type": "array", "items": _STR},
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
    "cards": {"type": "array", "items": CARD_SCHEMA},
    "scrapes_ok": _nullable(_INT),
    "scrapes_failed": _nullable(_INT),
})
OVERHEAD_SCHEMA = _obj({
    "strategy": _STR,
    "repeats": _INT,
    "scrape_interval_s": _NUM,
    "off_runs": {"type": "array", "items": _STR},
    "on_runs": {"type": "array", "items": _STR},
    "off_step_s": {"type": "array", "items": _NUM},
    "on_step_s": {"type": "array", "items": _NUM},
    "off_median_step_s": _nullable(_NUM),
    "on_median_step_s": _nullable(_NUM),
    "overhead": _nullable(_NUM),
    "scrapes_ok": _INT,
    "note": _nullable(_STR),
})
WORKLOAD_SCHEMA = _obj({
    "workload": _STR,
    "unit": {"enum": ["img", "tok"]},
    "units_per_sample": _INT,
    "global_batch": _INT,
    "cards": _INT,
    "runs": {"type": "array", "items": RUN_SCHEMA},
    "telemetry_overhead": _nullable(OVERHEAD_SCHEMA),
})
ENV_SCHEMA = _obj({
    "date": _STR, "hostname": _STR, "command": _STR, "python": _STR, "platform": _STR, "cpu": _STR,
    "cpu_count": _INT, "torch": _STR, "torch_cuda": _nullable(_STR), "cudnn": _nullable(_INT),
    "driver": _nullable(_STR), "cuda_driver": _nullable(_STR), "gpu_model": _nullable(_STR),
    "gpus": {"type": "array", "items": _obj({"name": _STR, "uuid": _STR, "pci_bus_id": _STR,
                                              "memory_total_bytes": _nullable(_INT)})},
    "cuda_visible_devices": _nullable(_STR), "commit": _nullable(_STR), "commit_dirty": _nullable(_BOOL),
})
RESULT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "python -m job bench: results",
    **_obj({
        "schema": {"const": SCHEMA_ID},
        "device": {"enum": ["cuda", "cpu"]},
        "cards": _INT,
        "settings": _obj({
            "steps": _INT, "warmup": _INT, "strategies": {"type": "array", "items": _STR},
            "workloads": {"type": "array", "items": _STR}, "baseline": _STR, "cpu_procs": _INT,
            "overrides": {"type": "object"}, "out": _STR,
        }),
        "environment": ENV_SCHEMA,
        "workloads": {"type": "array", "items": WORKLOAD_SCHEMA},
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

    These go to every run. The bench's own keys, the strategy/workload picks and bench.* do not.
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


def _unregistered(name: str) -> str | None:
    from job.strategies import REGISTRY

    real = _registered_name(name)
    if real in REGISTRY:
        return None
    via = f" (preset `{name}` selects `{real}`)" if real != name else ""
    return (f"strategy `{real}` is not registered{via}; job.strategies.REGISTRY has: "
            f"{', '.join(sorted(REGISTRY))}")


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
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        self.out = Path(self.b.out or Path(cfg.train.run_dir) / f"bench-{stamp}")
        self.failed = 0
        self.child: subprocess.Popen | None = None
        self.interrupted = False

    def _cuda_count(self) -> int:
        if self.cfg.train.device == "cpu":
            return 0
        import torch  # counting devices does not create a CUDA context here (no memory on any card)

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    # -- building the command of one run ----------------------------------------------------
    def _args(self, workload: str, strategy: str, run_id: str, extra: list[str]) -> list[str]:
        b = self.b
        args = ["--config", str(self.out / "overrides.yaml"), f"workload={workload}", _strategy_arg(strategy),
                f"train.steps={b.warmup + b.steps}", f"train.timing_warmup={b.warmup}",
                f"train.log_every={b.warmup}", "train.checkpoint_every=0", "train.resume=never",
                f"train.run_dir={self.out / 'runs'}", f"train.run_id={run_id}"]
        if not self.cuda and "strategy.nprocs" not in self.overrides and not any(
                e.startswith("strategy.nprocs=") for e in extra):
            args.append(f"strategy.nprocs={b.cpu_procs}")
        return args + extra

    def _first_card(self) -> str:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            from job.devices import parse_visible

            entries = parse_visible(visible)
            if entries:
                return entries[0]
        return "0"  # CUDA_DEVICE_ORDER=PCI_BUS_ID (job.devices): the first card on the PCI bus

    def _empty(self, name: str, kind: str, strategy: str) -> dict[str, Any]:
        return {"name": name, "kind": kind, "strategy": strategy, "status": "skipped", "reason": None,
                "exit_code": None, "command": [], "env": {}, "run_dir": None, "log": None, "wall_s": None,
                "batch_size": None, "world_size": None, "units": None, "timed_steps": None,
                "samples_per_s": None, "units_per_s": None, "step_s": None, "trainer_samples_per_s": None,
                "imbalance": None, "scaling_vs_1": None, "scaling_note": None, "cards": [],
                "scrapes_ok": None, "scrapes_failed": None}

    def run_one(self, workload: str, name: str, kind: str, strategy: str, *, extra: list[str] = (),
                env: dict[str, str] | None = None, scrape_port: int | None = None) -> dict[str, Any]:
        row = self._empty(name, kind, strategy)
        if self.interrupted:
            row["reason"] = "the benchmark was interrupted before this run"
            return row
        reason = _unregistered(strategy)
        if reason:
            row["reason"] = reason
            log.info("bench: %-22s skipped: %s", name, reason)
            return row
        run_id = f"{workload}-{name}"
        args = self._args(workload, strategy, run_id, list(extra))
        try:
            child_cfg = config_mod.load(args)  # the run would refuse it: say why now, spend nothing
        except UsageError as e:
            row["reason"] = str(e)
            log.info("bench: %-22s skipped: %s", name, e)
            return row
        cmd = [sys.executable, "-m", "job", "train", *args]
        row["command"] = ["python", "-m", "job", "train", *args]
        row["env"] = dict(env or {})
        row["batch_size"] = int(child_cfg.train.batch_size)
        run_dir = self.out / "runs" / run_id
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{run_id}.log"
        row["run_dir"], row["log"] = str(run_dir), str(log_path)
        log.info("bench: %-22s running (%s)", name, shlex.join(row["command"][4:]))
        scraper = None
        start = time.monotonic()
        with open(log_path, "w") as logf:
            self.child = subprocess.Popen(
                cmd, cwd=os.getcwd(), stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                env={**_plain_env(), **(env or {}), "PYTHONUNBUFFERED": "1"},
            )
            if scrape_port is not None:
                scraper = _Scraper(f"http://127.0.0.1:{scrape_port}/metrics", self.b.scrape_interval_s)
                scraper.start()
            try:
                code = self.child.wait(timeout=self.b.timeout_min * 60)
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
            return self._fail(row, f"timed out after bench.timeout_min={self.b.timeout_min} min")
        if code != EXIT_OK:
            return self._fail(row, _error_line(log_path.read_text(errors="replace")))
        try:
            self._read_results(row, run_dir, child_cfg)
        except (OSError, ValueError, KeyError) as e:
            return self._fail(row, f"run finished but its results cannot be read: {e}")
        row["status"] = "ok"
        log.info("bench: %-22s ok: %s samples/s", name, f"{row['samples_per_s']:,.1f}")
        return row

    def _fail(self, row: dict, reason: str) -> dict:
        row["status"], row["reason"] = "failed", reason
        self.failed += 1
        log.warning("bench: %-22s FAILED: %s", row["name"], reason)
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

    def _read_results(self, row: dict, run_dir: Path, child_cfg) -> None:
        summary = json.loads((run_dir / "summary.json").read_text())
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        total = self.b.warmup + self.b.steps
        sps = timed_throughput(records, warmup=self.b.warmup, total=total, batch=row["batch_size"])
        if sps is None:
            raise ValueError(f"metrics.jsonl has no records for steps {self.b.warmup} and {total}")
        from job.models import WORKLOADS

        k = WORKLOADS[child_cfg.workload.name].units_per_sample(child_cfg.workload)
        cards = [{key: r.get(key) for key in CARD_SCHEMA["properties"]} for r in summary.get("cards", [])]
        world = int(summary["world_size"])
        row.update({
            "world_size": world, "units": len(cards) or world, "timed_steps": self.b.steps,
            "samples_per_s": sps, "units_per_s": sps * k, "step_s": row["batch_size"] / sps,
            "trainer_samples_per_s": float(summary["samples_per_s"]),
            "imbalance": summary.get("imbalance"), "cards": cards,
        })

    # -- one workload ---------------------------------------------------------------------------
    def bench_workload(self, workload: str) -> dict[str, Any]:
        from job.models import WORKLOADS

        ref_cfg = config_mod.load(["--config", str(self.out / "overrides.yaml"), f"workload={workload}"])
        spec = WORKLOADS[workload]
        global_batch = int(ref_cfg.train.batch_size)
        n = self.cards
        runs = []
        label = "1gpu" if self.cuda else "1proc"
        if self.b.baseline not in ("", "none"):
            if global_batch % n:
                row = self._empty(label, "baseline", self.b.baseline)
                row["reason"] = (f"global batch {global_batch} is not a multiple of {n} cards, so the 1-card "
                                 f"baseline cannot have the same per-card batch; use train.batch_size={n}·k")
                log.info("bench: %-22s skipped: %s", label, row["reason"])
            else:
                env = {"CUDA_VISIBLE_DEVICES": self._first_card()} if self.cuda else {}
                row = self.run_one(workload, label, "baseline", self.b.baseline, env=env,
                                   extra=[f"train.batch_size={global_batch // n}", "strategy.nprocs=1"])
            runs.append(row)
        for s in self.b.strategies:
            runs.append(self.run_one(workload, s, "strategy", s))
        _scaling(runs, n)
        overhead = self._telemetry_overhead(workload, runs) if self.b.telemetry_overhead else None
        return {"workload": workload, "unit": spec.unit, "units_per_sample": spec.units_per_sample(ref_cfg.workload),
                "global_batch": global_batch, "cards": n, "runs": runs, "telemetry_overhead": overhead}

    def _telemetry_overhead(self, workload: str, runs: list[dict]) -> dict[str, Any]:
        s = self.b.telemetry_strategy
        off, on, off_runs, on_runs, scrapes = [], [], [], [], 0
        for i in range(1, self.b.telemetry_repeats + 1):
            a = None
            if i == 1 and not self.overrides.get("telemetry.port"):
                # The strategy's own run just now had telemetry off and otherwise the same command: it is
                # the first "off" run (one process fewer; with the default order it ran right before).
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
                off_runs.append(a["name"])
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

    # -- the whole benchmark --------------------------------------------------------------------
    def run(self) -> int:
        from omegaconf import OmegaConf

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "overrides.yaml").write_text(
            "# What the bench command line / --config changed; passed to every run as --config.\n"
            + OmegaConf.to_yaml(OmegaConf.create(_nest(self.overrides))))
        for w in self.workloads:  # refuse a bad workload or override before the first run starts
            config_mod.load(["--config", str(self.out / "overrides.yaml"), f"workload={w}"])
        if any(k in os.environ for k in GROUP_VARS):
            log.warning("bench: %s are set but ignored: each run starts its own ranks on this node",
                        "/".join(k for k in GROUP_VARS if k in os.environ))
        where = (f"{self.cuda} GPU(s)" if self.cuda else
                 f"CPU ({self.cards} ddp processes stand in for cards; no GPU numbers here)")
        log.info("bench: %s, workloads %s, strategies %s, %d+%d steps -> %s", where, ",".join(self.workloads),
                 ",".join(self.b.strategies), self.b.warmup, self.b.steps, self.out)
        results: list[dict] = []
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for w in self.workloads:
                results.append(self.bench_workload(w))
                if self.interrupted:
                    break
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        doc = {
            "schema": SCHEMA_ID, "device": self.device, "cards": self.cards,
            "settings": {"steps": self.b.steps, "warmup": self.b.warmup, "strategies": list(self.b.strategies),
                         "workloads": self.workloads, "baseline": self.b.baseline, "cpu_procs": self.b.cpu_procs,
                         "overrides": _nest(self.overrides), "out": str(self.out)},
            "environment": environment(results),
            "workloads": results, "chart": None, "failed": self.failed,
        }
        chart = self.out / "bench.png"
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
            log.error("bench: %d run(s) failed (see the table and %s)", self.failed, self.out / "logs")
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
    for key in ("steps", "cpu_procs", "timeout_min", "telemetry_repeats"):
        if getattr(b, key) < 1:
            raise UsageError(f"bench.{key}={getattr(b, key)} must be at least 1")
    if not b.scrape_interval_s > 0:
        raise UsageError(f"bench.scrape_interval_s={b.scrape_interval_s} must be positive")
    if not b.strategies:
        raise UsageError("bench.strategies is empty; give e.g. strategies=[dp,ddp]")
    names = config_mod.preset_names("workload")
    for w in b.workloads:
        if w not in names:
            raise UsageError(f"unknown workload `{w}` in bench.workloads; choose from: {', '.join(names)}")


def _scaling(runs: list[dict], n: int) -> None:
    """scaling vs 1 = throughput_n / (n x throughput_1), for the runs that used the n cards."""
    base = next((r for r in runs if r["kind"] == "baseline"), None)
    ok_base = base is not None and base["status"] == "ok"
    for r in runs:
        if r["kind"] == "baseline" or r["status"] != "ok":
            continue
        if not ok_base:
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
        "cudnn": cudnn, "driver": driver, "cuda_driver": cuda_driver,
        "gpu_model": ", ".join(sorted({g["name"] for g in gpu_list})) or None, "gpus": gpu_list,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "commit": commit, "commit_dirty": dirty,
    }


# -- table and chart ----------------------------------------------------------------------------


def _per_card(r: dict, key: str) -> str:
    vals = [c[key] for c in sorted(r["cards"], key=lambda c: (c["rank"], c["device"]))]
    if not vals or any(v is None for v in vals):
        return "n/a"
    return " / ".join(f"{v / MB:,.0f}" for v in vals)


def table(doc: dict, w: dict) -> str:
    unit = f"{w['unit']}/s"
    where = f"{w['cards']} GPU(s)" if doc["device"] == "cuda" else f"CPU, {w['cards']} ddp processes"
    title = (f"== bench {w['workload']}: global batch {w['global_batch']}, {where}, "
             f"{doc['settings']['warmup']} warm-up + {doc['settings']['steps']} timed steps")
    head = ["run", "strategy", "procs/cards", "peak alloc MB", "peak reserved MB", "NVML used MB", "busiest/least",
            unit, "scaling vs 1", "status"]
    body = []
    for r in w["runs"]:
        ok = r["status"] == "ok"
        scaling = ("baseline" if r["kind"] == "baseline" and ok else
                   f"{r['scaling_vs_1']:.1%}" if r["scaling_vs_1"] is not None else "-")
        body.append([
            r["name"], _registered_name(r["strategy"]), f"{r['world_size']}/{r['units']}" if ok else "-",
            _per_card(r, "peak_allocated_bytes") if ok else "-", _per_card(r, "peak_reserved_bytes") if ok else "-",
            _per_card(r, "nvml_used_bytes") if ok else "-",
            f"{r['imbalance']:.2f}x" if r["imbalance"] else "-",
            f"{r['units_per_s']:,.0f}" if ok else "-", scaling,
            r["status"] if ok else f"{r['status']}: {r['reason']}",
        ])
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    widths[-1] = len(head[-1])  # the status column may be long: leave it ragged
    fmt = "  ".join(f"{{:<{n}}}" for n in widths)
    lines = [title, fmt.format(*head).rstrip(), fmt.format(*("-" * n for n in widths))]
    lines += [fmt.format(*row).rstrip() for row in body]
    if doc["device"] == "cpu":
        lines.append("(CPU: no per-card memory; throughput numbers only exercise the path)")
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


def _si(x: float, _pos=None) -> str:
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:g}{suffix}"
    return f"{x:g}"


def write_chart(doc: dict, path: Path) -> None:
    """Per workload: per-card memory bars per run (left), throughput per run (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = doc["workloads"] or [{"workload": "none", "unit": "img", "runs": []}]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 4.2 * len(workloads)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    env = doc["environment"]
    for (ax_mem, ax_thr), w in zip(axes, workloads, strict=True):
        runs = [r for r in w["runs"] if r["status"] == "ok" and r["kind"] in ("baseline", "strategy")]
        names = [r["name"] for r in runs]
        has_cards = any(r["cards"] for r in runs)
        if has_cards:
            width = 0.8 / max(len(r["cards"]) for r in runs)
            for x, r in enumerate(runs):
                for i, c in enumerate(sorted(r["cards"], key=lambda c: (c["rank"], c["device"]))):
                    pos = x - 0.4 + width * (i + 0.5)
                    ax_mem.bar(pos, c["peak_reserved_bytes"] / GIB, width * 0.9, color="#c6dbef",
                               label="peak reserved" if x == i == 0 else None)
                    ax_mem.bar(pos, c["peak_allocated_bytes"] / GIB, width * 0.9, color="#2171b5",
                               label="peak allocated" if x == i == 0 else None)
                    if c["nvml_used_bytes"] is not None:
                        ax_mem.plot([pos - width * 0.45, pos + width * 0.45], [c["nvml_used_bytes"] / GIB] * 2,
                                    color="black", lw=2, label="NVML used" if x == i == 0 else None)
                    ax_mem.text(pos, c["peak_reserved_bytes"] / GIB, c["device"].split(":")[-1], ha="center",
                                va="bottom", fontsize=7)
            ax_mem.set_xticks(range(len(runs)), names, rotation=20, ha="right")
            ax_mem.set_ylabel("GiB per card")
            ax_mem.legend(fontsize=8)
        else:
            ax_mem.text(0.5, 0.5, "no CUDA cards: per-card memory is not measured on CPU"
                        if doc["device"] == "cpu" else "no run finished", ha="center", va="center",
                        transform=ax_mem.transAxes)
            ax_mem.set_xticks([])
            ax_mem.set_yticks([])
        ax_mem.set_title(f"{w['workload']}: per-card memory")
        # Throughput: every compared run, failed and skipped ones named with their status.
        shown = [r for r in w["runs"] if r["kind"] in ("baseline", "strategy")]
        ys = [r["units_per_s"] or 0.0 for r in shown]
        bars = ax_thr.barh(range(len(shown)), ys, color="#41ab5d")
        for bar, r in zip(bars, shown, strict=True):
            if r["status"] != "ok":
                label = r["status"]
            else:
                label = f"{r['units_per_s']:,.0f}"
                if r["scaling_vs_1"] is not None:
                    label += f"  ({r['scaling_vs_1']:.0%} of linear)"
            ax_thr.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
        ax_thr.set_yticks(range(len(shown)), [r["name"] for r in shown])
        ax_thr.invert_yaxis()
        ax_thr.set_xlabel(f"{w['unit']}/s")
        ax_thr.xaxis.set_major_formatter(_si)
        ax_thr.set_xlim(0, (max(ys) if any(ys) else 1) * 1.5)
        ax_thr.set_title(f"{w['workload']}: throughput")
    fig.suptitle(f"{env['gpu_model'] or 'CPU'} | torch {env['torch']} | driver {env['driver'] or '-'} | "
                 f"commit {(env['commit'] or '?')[:10]} | {env['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg) -> int:
    """`python -m job bench`: returns 0 (all runs ok), 1 (a run failed), 75 (interrupted)."""
    return Bench(cfg).run()


__all__ = ["RESULT_SCHEMA", "run", "table", "timed_throughput", "user_overrides", "write_chart"]
