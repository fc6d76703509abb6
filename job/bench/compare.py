"""bench.mode=compare, one workload at a time (`bench_workload`; the steps are in job/bench/__init__.py),
and the rule that turns repeats into a table row: the median and the range (min-max) of each run name's
repeats (`summarize`), a ratio of medians called a claim only when the two ranges do not overlap
(`compare`).
"""

from __future__ import annotations

import logging
import re
import statistics
from typing import Any

from job.bench.child import Runs, RunSpec
from job.bench.imagefolder import image_folder, token_file
from job.bench.results import COMPARED, card_key, empty_run, workload_result
from job.bench.settings import FILE_ROW_DATA, multi_process, variant_args, variant_name
from job.breakdown import KINDS
from job.devices import usable_cores
from job.ports import free_port

log = logging.getLogger("job")

# -- repeats: median and range ------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, Any] | None:
    """Median and range of the repeats' values (None when there are none)."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def kinds_spread(per_run: list[dict | None]) -> dict[str, Any] | None:
    """Median and range of each kind of one card over the repeats; a kind some repeat could not measure is None,
    and so is the whole when a repeat has no breakdown of the card."""
    if not per_run or any(k is None for k in per_run):
        return None
    return {kind: spread([k[kind] for k in per_run]) if all(k[kind] is not None for k in per_run) else None
            for kind in KINDS}


def overlapping(a: dict, b: dict) -> bool:
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def compare(a_name: str, b_name: str, metric: str, a: dict, b: dict,
            pairs: list[float] | None = None, step_ms: list[float] | None = None) -> dict[str, Any]:
    """a/b's ratio of medians, stated as a claim only when both have repeats and the ranges do not overlap;
    `pairs`: a/b within each repeat (`paired`), where the two ran minutes apart rather than a whole bench;
    `step_ms`: a's step minus b's in milliseconds within each repeat (`paired_step_ms`): what a costs a step
    over b, a fixed cost per step where it does not follow the step's length."""
    if min(a["n"], b["n"]) < 2:
        verdict = "one run each: no claim"
    elif overlapping(a, b):
        verdict = "overlapping"
    else:
        verdict = "ranges do not overlap"
    return {"a": a_name, "b": b_name, "metric": metric,
            "ratio": a["median"] / b["median"] if b["median"] else None,
            "a_median": a["median"], "b_median": b["median"],
            "claim": verdict == "ranges do not overlap", "verdict": verdict, "paired": spread(pairs or []),
            "paired_step_ms": spread(step_ms or [])}


def _by_repeat(runs: list[dict], name: str, metric: str) -> dict[int, float]:
    return {r["repeat"]: r[metric] for r in runs if r["name"] == name and r["kind"] in COMPARED
            and r["status"] == "ok" and r[metric]}


def paired(runs: list[dict], a_name: str, b_name: str, metric: str = "units_per_s") -> list[float]:
    """a/b of each repeat in which both ran (ok). Every repeat runs each row once, so the two runs of a pair
    are minutes apart, not a whole bench: a machine whose speed drifts over the bench moves them alike."""
    a, b = _by_repeat(runs, a_name, metric), _by_repeat(runs, b_name, metric)
    return [a[k] / b[k] for k in sorted(a.keys() & b.keys())]


def paired_step_ms(runs: list[dict], a_name: str, b_name: str) -> list[float]:
    """a's step time minus b's, in milliseconds, of each repeat in which both ran (ok), as `paired` pairs them."""
    a, b = _by_repeat(runs, a_name, "step_s"), _by_repeat(runs, b_name, "step_s")
    return [(a[k] - b[k]) * 1e3 for k in sorted(a.keys() & b.keys())]


def summarize(runs: list[dict], names: list[str]) -> list[dict]:
    """One row per compared run name (in `names` order): median and range over its repeats."""
    rows = []
    for name in names:
        group = [r for r in runs if r["name"] == name and r["kind"] in COMPARED]
        if not group:
            continue
        ok = [r for r in group if r["status"] == "ok"]
        cards = []
        layout = {tuple(card_key(c) for c in sorted(r["cards"], key=card_key)) for r in ok}
        if ok and len(layout) == 1:
            for i, key in enumerate(next(iter(layout))):
                per = [sorted(r["cards"], key=card_key)[i] for r in ok]
                used = [c["nvml_used_bytes"] for c in per]
                cards.append({"rank": key[0], "device": key[1],
                              "peak_allocated_bytes": spread([c["peak_allocated_bytes"] for c in per]),
                              "peak_reserved_bytes": spread([c["peak_reserved_bytes"] for c in per]),
                              "nvml_used_bytes": spread(used) if None not in used else None,
                              "kinds": kinds_spread([c.get("kinds") for c in per])})
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
            # every run's peaks over its own timed steps (the child notes any other window), the same in each
            "same_window": all(r["window_note"] is None and r["peak_window"] == ok[0]["peak_window"] for r in ok),
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


REAL_DATA = ("imagefolder", "tokens")  # the kinds of rows that read files (bench.imagefolder, bench.tokens)


def comparisons(rows: list[dict], runs: list[dict]) -> list[dict]:
    """Every pair of strategy rows (throughput; busiest card's peak where cards were measured), each real-data
    row against its strategy's synthetic row (throughput: where the input pipeline limits), each imagefolder
    variant against its strategy's plain imagefolder row (which data settings are faster), and each one-card
    row against the hand-written loop (throughput: what the trainer costs). Throughput comparisons also
    carry the ratio within each repeat (`runs`: every run of the rows)."""
    def throughput(a: dict, b: dict) -> dict:
        return compare(a["name"], b["name"], "units_per_s", a["units_per_s"], b["units_per_s"],
                       paired(runs, a["name"], b["name"]), paired_step_ms(runs, a["name"], b["name"]))

    out = []
    strat = [r for r in rows if r["kind"] == "strategy" and r["units_per_s"]]
    for i, a in enumerate(strat):
        for b in strat[i + 1:]:
            out.append(throughput(a, b))
            if a["busiest_peak_bytes"] and b["busiest_peak_bytes"]:
                out.append(compare(a["name"], b["name"], "busiest_peak_bytes", a["busiest_peak_bytes"],
                                   b["busiest_peak_bytes"]))
    for r in rows:
        if r["kind"] in REAL_DATA and r["units_per_s"]:
            syn = next((s for s in strat if s["strategy"] == r["strategy"]), None)
            if syn is not None:
                out.append(throughput(r, syn))
            plain = next((p for p in rows if p["name"] == f"{r['strategy']}+{r['kind']}" and p["units_per_s"]), None)
            if plain is not None and plain is not r:
                out.append(throughput(r, plain))
    loop = next((r for r in rows if r["kind"] == "reference" and r["units_per_s"]), None)
    if loop is not None:
        for r in rows:
            if r["kind"] == "strategy" and r["units_per_s"] and r["units"] == 1:
                out.append(throughput(r, loop))
    return out


def rotated(items: list, repeat: int) -> list:
    """The run order of repeat `repeat` (0-based): rotated by one per repeat."""
    if not items:
        return []
    k = repeat % len(items)
    return items[k:] + items[:k]


def _scaling(runs: list[dict], n: int) -> None:
    """Per run: scaling vs 1 = throughput_n / (n x throughput_1 of the same repeat's baseline)."""
    bases = {r["repeat"]: r for r in runs if r["kind"] == "baseline"}
    for r in runs:
        if r["kind"] not in ("strategy", *REAL_DATA) or r["status"] != "ok":
            continue
        base = bases.get(r["repeat"])
        if base is None or base["status"] != "ok":
            r["scaling_note"] = "no baseline" if base is None else f"baseline {base['status']}"
        elif r["units"] != n:
            r["scaling_note"] = f"ran on {r['units']} card(s)/process(es), the baseline is 1 of {n}"
        else:
            r["scaling_vs_1"] = r["samples_per_s"] / (n * base["samples_per_s"])


# -- the mode: one workload ---------------------------------------------------------------------


def bench_workload(bench: Runs, workload: str) -> dict[str, Any]:
    """compare: the baseline, the strategies (and their imagefolder rows), repeated; then the telemetry pairs."""
    from job import config as config_mod

    ref_cfg = bench.ref_cfg(workload)
    definition = config_mod.workload_of(ref_cfg).workload
    global_batch = int(ref_cfg.train.batch_size)
    n = bench.cards
    label = "1gpu" if bench.cuda else "1proc"
    # (name, kind, strategy, extra args, env), or a row when the plan is refused up front.
    plan: list[tuple] = []
    baseline = bench.settings.baseline not in ("", "none")
    one_card = {"CUDA_VISIBLE_DEVICES": bench.first_card()} if bench.cuda else {}  # the baseline's and the loop's
    if baseline:
        if global_batch % n:
            row = empty_run(label, "baseline", bench.settings.baseline)
            row["reason"] = (f"global batch {global_batch} is not a multiple of {n} cards, so the 1-card "
                             f"baseline cannot have the same per-card batch; use train.batch_size={n}·k")
            log.info("bench: %-22s skipped: %s", label, row["reason"])
            plan.append(row)
        else:
            plan.append((label, "baseline", bench.settings.baseline,
                         [f"train.batch_size={global_batch // n}", "strategy.nprocs=1"], one_card))
    if bench.settings.reference:
        # The loop ignores the strategy; the baseline's keeps the command one the trainer accepts.
        # It trains the global batch on one card, as the one-card rows it is compared with do.
        plan.append(("loop", "reference", bench.settings.baseline if baseline else "ddp", ["strategy.nprocs=1"], one_card))
    for s in bench.settings.strategies:
        plan.append((s, "strategy", s, [], {}))
    images = tokens = None
    # Steps every row trains before bench.warmup: the most an imagefolder row's data.decode=auto takes to choose
    # its decoder (bench.auto_settle; 0 where none chooses), so that every row is timed over the same steps.
    settle = 0
    if bench.settings.imagefolder and "imagefolder" in definition.kinds():
        images = image_folder(bench.images_dir, bench.settings.imagefolder_images, seed=int(ref_cfg.train.seed),
                              short_side=int(bench.settings.imagefolder_short_side))
        for s in bench.settings.strategies:
            extra = _file_args(bench, s, "imagefolder", images["path"])
            plan.append((f"{s}+imagefolder", "imagefolder", s, extra, {}))
            settle = max(settle, _choosing(bench, ref_cfg, extra))
        for v in bench.settings.imagefolder_variants:  # the same files, other data settings: rows of their own
            data_args = variant_args(v)
            for s in bench.settings.strategies:
                extra = _file_args(bench, s, "imagefolder", images["path"], *data_args)
                plan.append((variant_name(s, data_args), "imagefolder", s, extra, {}))
                settle = max(settle, _choosing(bench, ref_cfg, extra))
    if bench.settings.tokens and "tokens" in definition.kinds():
        w = ref_cfg.workload
        # Enough windows that no timed step reads a window twice: the file is read as a real one would be.
        needed = (settle + bench.settings.warmup + bench.settings.steps + 1) * global_batch * int(w.seq_len) + 1
        tokens = token_file(bench.tokens_dir, tokens=needed, vocab=int(w.vocab), seed=int(ref_cfg.train.seed))
        for s in bench.settings.strategies:
            plan.append((f"{s}+tokens", "tokens", s, _file_args(bench, s, "tokens", tokens["path"],
                                                               f"data.token_dtype={tokens['dtype']}"), {}))
    runs: list[dict] = []
    for rep in range(bench.settings.repeats):
        for item in rotated(plan, rep):
            if isinstance(item, dict):
                if rep == 0:
                    runs.append(item)
                continue
            name, kind, strategy, extra, env = item
            runs.append(bench.run(RunSpec(workload, name, kind, strategy, extra=tuple(extra), env=env,
                                          warmup=bench.settings.warmup + settle,
                                          repeat=rep + 1, run_id=f"{workload}-{_slug(name)}-r{rep + 1}",
                                          program="reference" if kind == "reference" else "trainer")))
        if bench.interrupted:  # this repeat's other runs are listed as not run; no further repeats
            break
    _scaling(runs, n)
    overhead = (_telemetry_overhead(bench, workload, runs, warmup=bench.settings.warmup + settle)
                if bench.settings.telemetry_overhead else None)
    names = [p["name"] if isinstance(p, dict) else p[0] for p in plan]
    summary = summarize(runs, names)
    summary_scaling(summary, n)
    return workload_result(workload, ref_cfg, cards=n, runs=runs, summary=summary,
                           comparisons=comparisons(summary, runs), telemetry_overhead=overhead, imagefolder=images,
                           tokens=tokens)


def _slug(name: str) -> str:
    """A row's name as a run directory's: an imagefolder variant's brackets and spaces become underscores."""
    return re.sub(r"[^A-Za-z0-9+._=-]+", "_", name).strip("_")


# _choosing's steps take at least this long (its windows of WINDOW_S seconds are then at most 80 batches):
# ResNet-50 at batch 256 compiled on an H200 takes 38 ms a step. Where steps are shorter, the table says the
# choice fell in the timed steps.
AUTO_SHORTEST_STEP_S = 0.025


def _choosing(bench: Runs, ref_cfg, extra: list[str]) -> int:
    """Steps an imagefolder row trains before its warm-up and timed steps so that data.decode=auto has chosen
    where to decode (SplitTuner.longest, a step a batch: with more micro-batches a step it chooses sooner):
    with bench.auto_settle, on a GPU, where the row's data.decode is auto and it has workers; else 0."""
    from job.data import SplitTuner, tuner_lookahead

    given = dict(e.split("=", 1) for e in extra if e.startswith("data."))
    decode = given.get("data.decode", str(ref_cfg.data.decode))
    workers = int(given.get("data.workers", ref_cfg.data.workers))
    if not (bench.settings.auto_settle and bench.cuda and decode == "auto" and workers):
        return 0
    prefetch = given.get("data.prefetch", "true").lower() == "true"  # the bench's file rows prefetch unless told
    depth = int(given.get("data.prefetch_depth", ref_cfg.data.prefetch_depth)) if prefetch else 1
    return SplitTuner.longest(tuner_lookahead(workers, depth), step_s=AUTO_SHORTEST_STEP_S)


def _file_args(bench: Runs, strategy: str, kind: str, path: str, *more: str) -> list[str]:
    extra = [f"data.kind={kind}", f"data.path={path}", *FILE_ROW_DATA, *more]
    if "data.workers" not in bench.overrides and not any(m.startswith("data.workers=") for m in more):
        # Workers per training process: the cores of its share of those the bench may use (its affinity:
        # taskset, a Slurm or container limit), one left for the process itself (a single-process strategy
        # feeds every card from one loader).
        procs = bench.cards if multi_process(strategy) else 1
        extra.append(f"data.workers={max(1, min(16, usable_cores() // procs - 1))}")
    return extra


def _telemetry_overhead(bench: Runs, workload: str, runs: list[dict], *, warmup: int) -> dict[str, Any]:
    s = bench.settings.telemetry_strategy
    off, on, off_runs, on_runs, scrapes = [], [], [], [], 0
    for i in range(1, bench.settings.telemetry_repeats + 1):
        a = None
        if i == 1 and not bench.overrides.get("telemetry.port"):
            # The strategy's own run had telemetry off and otherwise the same command: it is the
            # first "off" run (one process fewer).
            a = next((r for r in runs if r["kind"] == "strategy" and r["strategy"] == s
                      and r["status"] == "ok"), None)
        if a is None:
            a = bench.run(RunSpec(workload, f"telemetry-off-{i}", "telemetry_off", s, extra=("telemetry.port=0",),
                                  warmup=warmup))
            runs.append(a)
        port = free_port()
        z = bench.run(RunSpec(workload, f"telemetry-on-{i}", "telemetry_on", s,
                              extra=(f"telemetry.port={port}", "telemetry.host=127.0.0.1"), scrape_port=port,
                              warmup=warmup))
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
    return {"strategy": s, "repeats": bench.settings.telemetry_repeats, "scrape_interval_s": float(bench.settings.scrape_interval_s),
            "off_runs": off_runs, "on_runs": on_runs, "off_step_s": off, "on_step_s": on, "off_median_step_s": off_m, "on_median_step_s": on_m,
            "overhead": (on_m / off_m - 1) if off else None, "scrapes_ok": scrapes, "note": note}
