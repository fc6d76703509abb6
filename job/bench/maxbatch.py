"""bench.mode=maxbatch, one workload at a time (`maxbatch_workload`): per strategy, the largest global batch
that trains, or with bench.maxbatch_key=workload.layers the deepest lm (the largest model), found by real
trials (`search_max_batch`, `classify_trial`; the rules in job/bench/__init__.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from job import config as config_mod
from job.bench.child import Runs, RunSpec
from job.bench.results import workload_result
from job.bench.settings import multi_process
from job.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

log = logging.getLogger("job")
# What a trial's error line says when it ran out of memory: CUDA's and the trainer's wording, and the
# CPU allocator's ("can't allocate memory", "not enough memory").
OOM_WORDS = ("out of memory", "can't allocate memory", "not enough memory")


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


def maxbatch_workload(bench: Runs, workload: str) -> dict[str, Any]:
    """maxbatch: one search per strategy, in bench.strategies order."""
    ref_cfg = bench.ref_cfg(workload)
    runs: list[dict] = []
    results = []
    for s in bench.settings.strategies:
        if bench.interrupted:
            break
        results.append(_search(bench, workload, s, ref_cfg, runs))
    return workload_result(workload, ref_cfg, cards=bench.cards, runs=runs, maxbatch=results)


def _search(bench: Runs, workload: str, strategy: str, ref_cfg, runs: list[dict]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    key = bench.settings.maxbatch_key
    if key == "train.batch_size":
        probe = config_mod.load(bench.args(workload, strategy, "probe", [], warmup=1, steps=1))
        multi = multi_process(strategy)
        ranks = (int(probe.strategy.nprocs) or bench.cuda or 1) if multi else 1
        g, minimum = batch_rule(multi_process=multi, ranks=ranks, cards=bench.cuda or 1,
                                accum=int(probe.train.accum_steps),
                                split=OmegaConf.select(probe, "strategy.split", default=None))
    else:  # any depth of at least one block
        g, minimum = 1, 1
    start = bench.settings.maxbatch_start or int(OmegaConf.select(ref_cfg, key))
    budget_s = bench.settings.maxbatch_minutes * 60
    t0 = time.monotonic()
    by_batch: dict[int, dict] = {}

    def trial(batch: int) -> tuple[str, str | None]:
        left = budget_s - (time.monotonic() - t0)
        row = bench.run(RunSpec(workload, f"{strategy}@{batch}", "maxbatch_trial", strategy,
                                extra=(f"{key}={batch}",), warmup=1, steps=bench.settings.maxbatch_steps - 1,
                                timeout_s=max(60.0, left), trial=True))
        runs.append(row)
        by_batch[batch] = row
        if row["status"] == "interrupted" or bench.interrupted:
            return "interrupted", row["reason"]
        if row["status"] == "skipped":
            return "error", row["reason"]
        outcome = classify_trial(row["exit_code"], row["reason"] if row["status"] != "ok" else None)
        if row["status"] == "failed" and row["reason"] and row["reason"].startswith("timed out"):
            outcome = "error"
        return outcome, row["reason"]

    log.info("bench: maxbatch %s: %s of %d x k, at least %d, from %d", strategy, key, g, minimum, start)
    res = search_max_batch(trial, start=start, granularity=g, minimum=minimum,
                           max_trials=bench.settings.maxbatch_trials, deadline_s=budget_s,
                           precision=bench.settings.maxbatch_precision)
    for t in res["trials"]:
        row = by_batch.get(t["batch"])
        t["run"] = row["name"] if row else None
        t["wall_s"] = row["wall_s"] if row else None
    best = by_batch.get(res["largest"]) if res["largest"] else None
    if res["error"]:
        bench.failed += 1
        log.warning("bench: maxbatch %s: %s", strategy, res["stopped"])
    log.info("bench: maxbatch %s: largest %s that trains %s (too big: %s)", strategy, key, res["largest"],
             res["smallest_too_big"])
    return {"strategy": strategy, **res, "run": best["name"] if best else None,
            "cards": best["cards"] if best else [], "units_per_s": best["units_per_s"] if best else None,
            "params": best.get("params") if best else None}
