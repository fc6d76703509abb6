"""bench.json: the schema every result document follows, and the records it is built from.

RESULT_SCHEMA (JSON Schema 2020-12) fixes every key and type; every object is closed. A run's record
(`empty_run`, filled by job.bench.runner) and a workload's result (`workload_result`, one per workload
whatever the mode) are built here so that every mode writes the same keys in the same order.
"""

from __future__ import annotations

from typing import Any

from job.breakdown import KINDS

SCHEMA_ID = "trainjob-bench/16"  # 3: each card's memory by kind (cards[].kinds); 4: tokens and reference rows;
# 5: comparisons[].paired; 6: runs' trained_samples_per_s and input_samples_per_s (samples_per_s: the lower);
# 7: runs' input_worker_cores, the environment's cpu_cores (physical cores); 8: settings.imagefolder_variants;
# 9: runs' input_gpu_share (data.decode=auto's choice); 10: comparisons[].paired_step_ms; 11: the environment's
# cpus (the CPUs the bench may use); 12: runs' input_auto_settled_step, settings.auto_settle; 13:
# settings.imagefolder_short_side, the imagefolder's short_side; 14: runs' host_thread_on_core and
# host_thread_waited (the training thread's scheduling over the timed steps); 15: runs' card_idle (the card
# with nothing to run between steps); 16: runs' card_power_capped (the card held below its clocks by its power
# limit)
# Runs whose numbers are compared across repeats (one table row each).
COMPARED = ("baseline", "reference", "strategy", "imagefolder", "tokens")
DATA = ("synthetic", "imagefolder", "tokens")


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    """A JSON-schema object with exactly these keys, all required."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


_STR, _INT, _NUM, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


# A card's memory by kind at the peak (job/breakdown.py; bytes, None where a source could not say); None for a
# run whose summary.json has no breakdown of that card.
KINDS_SCHEMA = _nullable(_obj(dict.fromkeys(KINDS, _nullable(_INT))))
CARD_SCHEMA = _obj({
    "rank": _INT, "device": _STR, "name": _STR, "uuid": _STR, "pci_bus_id": _STR,
    "peak_allocated_bytes": _INT, "peak_reserved_bytes": _INT,
    "nvml_used_bytes": _nullable(_INT), "nvml_total_bytes": _nullable(_INT), "kinds": KINDS_SCHEMA,
})
RUN_SCHEMA = _obj({
    "name": _STR,
    "kind": {"enum": [*COMPARED, "telemetry_off", "telemetry_on", "maxbatch_trial", "profile"]},
    "strategy": _STR,
    "repeat": _INT,
    "data": {"enum": list(DATA)},
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
    "trained_samples_per_s": _nullable(_NUM),
    "input_samples_per_s": _nullable(_NUM),
    "input_worker_cores": _nullable(_NUM),
    "input_gpu_share": _nullable(_NUM),
    "input_auto_settled_step": _nullable(_INT),
    "host_thread_on_core": _nullable(_NUM),
    "host_thread_waited": _nullable(_NUM),
    "card_idle": _nullable(_NUM),
    "card_power_capped": _nullable(_NUM),
    "imbalance": _nullable(_NUM),
    "scaling_vs_1": _nullable(_NUM),
    "scaling_note": _nullable(_STR),
    "peak_window": _nullable(_array(_nullable(_INT))),
    "window_note": _nullable(_STR),
    "cards": _array(CARD_SCHEMA),
    "scrapes_ok": _nullable(_INT),
    "scrapes_failed": _nullable(_INT),
    "params": _nullable(_INT),
})
SPREAD_SCHEMA = _obj({"median": _NUM, "min": _NUM, "max": _NUM, "n": _INT})
SUMMARY_SCHEMA = _obj({
    "name": _STR, "kind": {"enum": list(COMPARED)}, "strategy": _STR,
    "data": {"enum": list(DATA)},
    "runs": _INT, "ok": _INT, "world_size": _nullable(_INT), "units": _nullable(_INT),
    "samples_per_s": _nullable(SPREAD_SCHEMA), "units_per_s": _nullable(SPREAD_SCHEMA),
    "busiest_peak_bytes": _nullable(SPREAD_SCHEMA), "imbalance": _nullable(SPREAD_SCHEMA),
    "scaling_vs_1": _nullable(_NUM), "scaling_note": _nullable(_STR),
    "peak_window": _nullable(_array(_nullable(_INT))), "same_window": _BOOL,
    "cards": _array(_obj({"rank": _INT, "device": _STR, "peak_allocated_bytes": SPREAD_SCHEMA,
                          "peak_reserved_bytes": SPREAD_SCHEMA, "nvml_used_bytes": _nullable(SPREAD_SCHEMA),
                          "kinds": _nullable(_obj(dict.fromkeys(KINDS, _nullable(SPREAD_SCHEMA))))})),
    "status": _STR,
})
COMPARISON_SCHEMA = _obj({
    "a": _STR, "b": _STR, "metric": {"enum": ["units_per_s", "busiest_peak_bytes"]},
    "ratio": _nullable(_NUM), "a_median": _NUM, "b_median": _NUM,
    "claim": _BOOL, "verdict": {"enum": ["ranges do not overlap", "overlapping", "one run each: no claim"]},
    "paired": _nullable(SPREAD_SCHEMA), "paired_step_ms": _nullable(SPREAD_SCHEMA),
})
# A trial's "batch" is the value of settings.maxbatch.key it tried (the global batch, or the lm's layers).
TRIAL_SCHEMA = _obj({"batch": _INT, "outcome": {"enum": ["fits", "too_big", "error", "interrupted"]},
                     "reason": _nullable(_STR), "run": _nullable(_STR), "wall_s": _nullable(_NUM)})
MAXBATCH_SCHEMA = _obj({
    "strategy": _STR, "granularity": _INT, "minimum": _INT, "start": _INT,
    "largest": _nullable(_INT), "smallest_too_big": _nullable(_INT), "exact": _BOOL,
    "stopped": _nullable(_STR), "error": _BOOL, "trials": _array(TRIAL_SCHEMA),
    "run": _nullable(_STR), "cards": _array(CARD_SCHEMA), "units_per_s": _nullable(_NUM),
    "params": _nullable(_INT),
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
    "phases_timed": _BOOL,
    "phases": _array(_obj({"name": _STR, "depth": _INT, "ms_per_step": _NUM, "share": _NUM, "calls": _INT})),
    "card": _nullable(_obj({
        "device": _INT, "busy_ms": _NUM, "main_stream": _INT, "main_beside_ms": _NUM,
        "streams": _array(_obj({"stream": _INT, "ms_per_step": _NUM, "events_per_step": _NUM,
                                "top": _array(_obj({"name": _STR, "ms_per_step": _NUM, "calls": _INT}))}))})),
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
    "imagefolder": _nullable(_obj({"path": _STR, "images": _INT, "classes": _INT, "short_side": _INT,
                                   "bytes": _INT, "generated_s": _nullable(_NUM)})),
    "tokens": _nullable(_obj({"path": _STR, "tokens": _INT, "dtype": _STR, "bytes": _INT,
                              "generated_s": _nullable(_NUM)})),
    "maxbatch": _nullable(_array(MAXBATCH_SCHEMA)),
    "profiles": _nullable(_array(PROFILE_SCHEMA)),
})
ENV_SCHEMA = _obj({
    "date": _STR, "hostname": _STR, "command": _STR, "python": _STR, "platform": _STR, "cpu": _STR,
    "cpu_count": _INT, "cpus": _STR, "cpu_cores": _nullable(_INT), "torch": _STR, "torch_cuda": _nullable(_STR), "cudnn": _nullable(_INT),
    "nccl": _nullable(_STR), "torchvision": _nullable(_STR),
    "driver": _nullable(_STR), "cuda_driver": _nullable(_STR), "gpu_model": _nullable(_STR),
    "gpus": _array(_obj({"name": _STR, "uuid": _STR, "pci_bus_id": _STR, "memory_total_bytes": _nullable(_INT)})),
    "cuda_visible_devices": _nullable(_STR), "cuda_device_max_connections": _nullable(_STR),
    "commit": _nullable(_STR), "commit_dirty": _nullable(_BOOL),
    "code": _STR,
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
            "out": _STR, "imagefolder": _BOOL, "imagefolder_variants": _array(_STR), "imagefolder_short_side": _INT,
            "auto_settle": _BOOL, "tokens": _BOOL,
            "reference": _BOOL, "maxbatch": _obj({"key": _STR, "start": _INT, "steps": _INT, "trials": _INT, "minutes": _NUM, "precision": _NUM}),
        }),
        "tenant": _nullable(_obj({"gb": _NUM, "device": _STR, "pid": _INT})),
        "environment": ENV_SCHEMA,
        "workloads": _array(WORKLOAD_SCHEMA),
        "chart": _nullable(_STR),
        "failed": _INT,
    }),
}


def card_key(c: dict) -> tuple:
    return (c["rank"], c["device"])


def empty_run(name: str, kind: str, strategy: str, *, repeat: int = 1, data: str = "synthetic") -> dict[str, Any]:
    """A run's record before it ran: status "skipped", every measured field None (RUN_SCHEMA)."""
    return {"name": name, "kind": kind, "strategy": strategy, "repeat": repeat, "data": data,
            "status": "skipped", "reason": None,
            "exit_code": None, "command": [], "env": {}, "run_dir": None, "log": None, "wall_s": None,
            "batch_size": None, "world_size": None, "units": None, "timed_steps": None,
            "samples_per_s": None, "units_per_s": None, "step_s": None, "trainer_samples_per_s": None,
            "trained_samples_per_s": None, "input_samples_per_s": None, "input_worker_cores": None, "input_gpu_share": None,
            "input_auto_settled_step": None, "host_thread_on_core": None, "host_thread_waited": None, "card_idle": None, "card_power_capped": None, "imbalance": None, "scaling_vs_1": None, "scaling_note": None, "peak_window": None, "window_note": None, "cards": [], "scrapes_ok": None,
            "scrapes_failed": None, "params": None}


def workload_result(workload: str, ref_cfg, *, cards: int, runs: list[dict], summary: list[dict] | None = None,
                    comparisons: list[dict] | None = None, telemetry_overhead: dict | None = None,
                    imagefolder: dict | None = None, tokens: dict | None = None, maxbatch: list[dict] | None = None,
                    profiles: list[dict] | None = None) -> dict[str, Any]:
    """One workload's part of bench.json (WORKLOAD_SCHEMA); `ref_cfg` is the workload's config as every run
    starts from it. The fields of the other modes stay empty (summary, comparisons) or None."""
    from job import config as config_mod

    definition = config_mod.workload_of(ref_cfg).workload
    return {"workload": workload, "unit": definition.unit, "units_per_sample": definition.units(config_mod.workload_settings(ref_cfg)),
            "global_batch": int(ref_cfg.train.batch_size), "cards": cards, "runs": runs,
            "summary": summary or [], "comparisons": comparisons or [], "telemetry_overhead": telemetry_overhead,
            "imagefolder": imagefolder, "tokens": tokens, "maxbatch": maxbatch, "profiles": profiles}
