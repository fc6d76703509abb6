"""The bench's settings: bench.* checked before anything runs, and what every run is given besides.

Every trainer run gets the user's overrides (`user_overrides`: what the command line and --config changed
against the workload's preset), the strategy as a preset or a registered name (`strategy_arg`), and the
bench's own keys (BENCH_KEYS, set by job.bench.runner). A setting out of range, an unknown strategy or
workload is refused here (UsageError: exit 2).
"""

from __future__ import annotations

from typing import Any

from job import config as config_mod
from job.bench.imagefolder import IMAGE_CLASSES, SHORT_SIDES
from job.errors import UsageError

# Keys the benchmark sets on every run; the user's values for them are not passed on.
BENCH_KEYS = ("train.steps", "train.timing_warmup", "train.log_every", "train.checkpoint_every",
              "train.final_checkpoint", "train.run_dir", "train.run_id", "train.resume")
# What bench.mode=maxbatch can search (the batch, or the depth of the lm: the largest model), with what the
# table and chart call the result and the values.
MAXBATCH_KEYS = {"train.batch_size": ("global batch", "batches"), "workload.layers": ("lm depth (layers)", "layers")}
# Keys that pick what is compared rather than how it runs.
PICK_KEYS = ("strategy.name", "workload.name")


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def user_overrides(cfg, preset: str | None = None) -> dict[str, Any]:
    """What the command line and --config changed against the workload's preset (`preset`, default the
    preset named like the config's workload): {dotted key: value}.

    These go to every run (every maxbatch trial too). The bench's own keys, the strategy/workload
    picks and bench.* do not.
    """
    from omegaconf import OmegaConf

    base = config_mod.load([f"workload={preset or cfg.workload.name}"])
    have = _flatten(OmegaConf.to_container(cfg, resolve=True))
    ref = _flatten(OmegaConf.to_container(base, resolve=True))
    return {k: v for k, v in have.items()
            if ref.get(k) != v and not k.startswith("bench.") and k not in BENCH_KEYS + PICK_KEYS}


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def strategy_arg(name: str) -> str:
    return f"strategy={name}" if name in config_mod.preset_names("strategy") else f"strategy.name={name}"


def registered_name(name: str) -> str:
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
    real = registered_name(name)
    if real in REGISTRY:
        return None
    choices = ", ".join(sorted(set(presets) | set(REGISTRY)))
    if name in presets:
        return (f"strategy preset `{name}` in {key} selects `{real}`, which job.strategies.REGISTRY does not "
                f"have; choose from: {choices}")
    return f"unknown strategy `{name}` in {key}; choose from: {choices}"


def multi_process(name: str) -> bool:
    from job.strategies import REGISTRY

    return REGISTRY[registered_name(name)].multi_process


FILE_ROW_DATA = ("data.prefetch=true",)  # what the bench adds to every row that reads files, before a variant's own settings
VARIANT_KEYS = ("decode", "gpu_share", "workers", "worker_nice", "prefetch", "prefetch_depth")  # data.* an imagefolder variant sets


def variant_args(text: str) -> list[str]:
    """One bench.imagefolder_variants entry -> its data.KEY=VALUE overrides; UsageError for anything else."""
    tokens = str(text).split()
    if not tokens:
        raise UsageError('bench.imagefolder_variants has an empty entry; give data settings, e.g. '
                         '"data.decode=gpu data.gpu_share=0.5"')
    for t in tokens:
        key, eq, value = t.partition("=")
        if not (eq and value and key.startswith("data.") and key[5:] in VARIANT_KEYS):
            raise UsageError(f"bench.imagefolder_variants: `{t}` is not a setting a variant may change; use "
                             f"data.KEY=VALUE with KEY one of {', '.join(VARIANT_KEYS)} (space-separated)")
    return tokens


def variant_name(strategy: str, tokens: list[str]) -> str:
    """The row of an imagefolder variant: ddp+imagefolder[decode=gpu gpu_share=0.5]."""
    return f"{strategy}+imagefolder[{' '.join(t[len('data.'):] for t in tokens)}]"


def check_settings(b) -> None:
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
        raise UsageError(f"bench.maxbatch_start={b.maxbatch_start} must not be negative (0: the config's value)")
    if b.maxbatch_key not in MAXBATCH_KEYS:
        raise UsageError(f"bench.maxbatch_key={b.maxbatch_key} cannot be searched; choose one of: "
                         f"{', '.join(MAXBATCH_KEYS)}")
    if not b.maxbatch_minutes > 0:
        raise UsageError(f"bench.maxbatch_minutes={b.maxbatch_minutes} must be positive")
    if not 0 <= b.maxbatch_precision < 1:
        raise UsageError(f"bench.maxbatch_precision={b.maxbatch_precision} must be in [0, 1) (0: exact)")
    if b.tenant_gb < 0:
        raise UsageError(f"bench.tenant_gb={b.tenant_gb} must not be negative (0: no tenant)")
    if b.imagefolder_images < IMAGE_CLASSES:
        raise UsageError(f"bench.imagefolder_images={b.imagefolder_images} must be at least {IMAGE_CLASSES} "
                         "(one per class)")
    if b.imagefolder_short_side and not SHORT_SIDES[0] <= b.imagefolder_short_side <= SHORT_SIDES[1]:
        raise UsageError(f"bench.imagefolder_short_side={b.imagefolder_short_side} must be 0 (ImageNet-like files) "
                         f"or a side from {SHORT_SIDES[0]} to {SHORT_SIDES[1]} px")
    if b.imagefolder_variants and not b.imagefolder:
        raise UsageError("bench.imagefolder_variants adds rows to bench.imagefolder's: set bench.imagefolder=true")
    variants = [" ".join(variant_args(v)) for v in b.imagefolder_variants]
    if len(set(variants)) < len(variants):
        raise UsageError(f"bench.imagefolder_variants lists the same settings twice: {variants}")
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
    workloads = config_mod.preset_names("workload")
    for w in b.workloads:
        if w not in workloads:
            raise UsageError(f"unknown workload `{w}` in bench.workloads; choose from: {', '.join(workloads)}")
