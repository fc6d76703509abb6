"""The tables the bench prints last, one per workload (compare, maxbatch, profile), from bench.json's document."""

from __future__ import annotations

from job.bench.environment import versions
from job.bench.results import card_key
from job.bench.settings import MAXBATCH_KEYS, registered_name
from job.breakdown import HEADS, KINDS

MB = 1024 * 1024  # MB in tables means MiB, as in the trainer's table (job/report.py)


def _fmt(s: dict | None, scale: float = 1.0, spec: str = ",.0f", suffix: str = "") -> str:
    """`median` for one run (or equal values), else `median (min-max)`."""
    if s is None:
        return "-"
    med = format(s["median"] / scale, spec) + suffix
    if s["n"] < 2 or s["min"] == s["max"]:
        return med
    return f"{med} ({format(s['min'] / scale, spec)}-{format(s['max'] / scale, spec)})"


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
             f"per-card peaks over the timed steps {_later(w, warm, steps)} (each run resets its "
             "peak counters when timing starts); cells: median (min-max) over the repeats", *_header(doc)]
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
            r["name"], "none (plain loop)" if r["kind"] == "reference" else registered_name(r["strategy"]), r["data"], f"{r['world_size']}/{r['units']}" if ok else "-",
            cards("peak_allocated_bytes"), cards("peak_reserved_bytes"), cards("nvml_used_bytes"),
            _fmt(r["imbalance"], 1, ".2f", "x"),
            _fmt(r["units_per_s"]), scaling, status,
        ])
    lines += _grid(head, body)
    lines += _kinds_table(w["summary"])
    if doc["device"] == "cpu":
        lines.append("(CPU: no per-card memory; throughput numbers only exercise the path)")
    if w["comparisons"]:
        lines.append("ratios of medians (a claim only where the repeats' ranges do not overlap):")
        for c in w["comparisons"]:
            what = unit if c["metric"] == "units_per_s" else "busiest card's peak allocated"
            ratio = f"{c['ratio']:.2f}x" if c["ratio"] is not None else "n/a"
            p = c["paired"]
            pairs = (f"; within each repeat {p['median']:.2f}x ({p['min']:.2f}-{p['max']:.2f}, {p['n']} pairs)"
                     if p and p["n"] > 1 else "")
            d = c["paired_step_ms"]
            if pairs and d:
                pairs += f", {d['median']:+.2f} ms a step ({d['min']:+.2f} to {d['max']:+.2f})"
            lines.append(f"  {c['a']} / {c['b']}: {what} {ratio}: {c['verdict']}{pairs}")
    lines += _input_lines(w, unit)
    lines += _host_lines(w)
    lines += _card_lines(w)
    lines += _power_lines(w)
    if w.get("imagefolder"):
        i = w["imagefolder"]
        side = f", resized to a short side of {i['short_side']} px" if i.get("short_side") else ""
        lines.append(f"imagefolder: {i['images']} generated JPEG files ({i['bytes'] / i['images'] / 1e3:.0f} kB "
                     f"each on average{side}, {i['classes']} classes) in {i['path']}")
        lines += _passes_lines(doc, w, warm)
    if w.get("tokens"):
        k = w["tokens"]
        lines.append(f"tokens: a generated file of {k['tokens']:,} random {k['dtype']} token ids "
                     f"({k['bytes'] / 1e6:,.0f} MB), memory-mapped, in {k['path']}")
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


def _later(w: dict, warm: int, steps: int) -> str:
    """The header's timed steps, and why they start later than bench.warmup where they do (bench.auto_settle: every
    row first trains the steps data.decode=auto takes to choose; benches before that timed only those rows later)."""
    starts = {r["peak_window"][0] for r in w["runs"] if r.get("peak_window")}
    later = sorted(x for x in starts if x > warm)
    if not later:
        return f"{warm + 1}-{warm + steps}"
    if len(starts) == 1:
        return (f"{later[0] + 1}-{later[0] + steps} (every row trains {later[0] - warm} steps first, in which "
                "data.decode=auto chooses where to decode, then the warm-up)")
    return f"{warm + 1}-{warm + steps} (imagefolder rows with data.decode=auto: after its choice, from step {later[0] + 1})"


SLOW_PASSES = 3  # passes over the files in which a row reading them trained slower on a card than later on


def _passes_lines(doc: dict, w: dict, warm: int) -> list[str]:
    """On GPUs, where the timed steps of the rows reading the generated files start within their first SLOW_PASSES
    passes over them: say so, and the bench.warmup that starts them after (measured: docs/benchmarks.md,
    twenty-third section)."""
    import math

    i = w.get("imagefolder")
    starts = [r["peak_window"][0] for r in w["runs"] if r.get("data") == "imagefolder" and r.get("peak_window")]
    if doc["device"] != "cuda" or not i or not starts:
        return []
    first, per_pass = min(starts), i["images"] / w["global_batch"]  # steps trained before the earliest timed one
    if first >= SLOW_PASSES * per_pass:
        return []
    need = warm + math.ceil(SLOW_PASSES * per_pass) - first
    return [f"the imagefolder rows' timed steps start {first / per_pass:.1f} passes over the files in (a pass "
            f"is {per_pass:.1f} steps); on a card, compiled ResNet-50 trained 5 % slower in its first pass over 5,000 "
            f"files and about 2 % in its second than from step 200 on (docs/benchmarks.md, twenty-third section): "
            f"bench.warmup={need} or more starts them after {SLOW_PASSES} passes"]


def _auto_choice(runs: list[dict]) -> str:
    """What data.decode=auto ended with in a row's runs, counted, and whether it had chosen before their timed
    steps (input_auto_settled_step against the run's timed window) or tried shares in them."""
    from job.data import SplitTuner

    tuned = [r for r in runs if r.get("input_gpu_share") is not None]
    before = [r for r in tuned if r.get("input_auto_settled_step") is not None and r.get("peak_window")
              and r["input_auto_settled_step"] <= r["peak_window"][0]]
    ended = [r["input_gpu_share"] for r in tuned]
    if not any(ended) and len(before) == len(tuned):  # the workers kept every JPEG throughout the timed steps
        return ""
    counts = {s: ended.count(s) for s in sorted(set(ended))}
    said = ", ".join(f"{SplitTuner.what(s)} in {n} of {len(runs)}" for s, n in counts.items())
    if len(before) == len(tuned):
        first, last = tuned[0]["peak_window"]
        return f"; data.decode=auto chose {said}, before the timed steps ({first + 1}-{last})"
    return (f"; data.decode=auto ended with {said}; its trials are in the timed steps of {len(tuned) - len(before)} "
            f"of {len(runs)} (bench.auto_settle=true, or a longer bench.warmup, times after them)")


def _input_lines(w: dict, unit: str) -> list[str]:
    """Real-data rows: what the timed steps trained and what the workers made in them (medians); the row shows
    the lower, the rate the run sustains once the batches read ahead during start-up are used up."""
    import statistics

    k, lines = w["units_per_sample"], []
    for name in dict.fromkeys(r["name"] for r in w["runs"] if r["input_samples_per_s"] is not None):
        ok = [r for r in w["runs"] if r["name"] == name and r["status"] == "ok" and r["input_samples_per_s"] is not None]
        if not ok:
            continue
        trained = statistics.median(r["trained_samples_per_s"] for r in ok) * k
        made = statistics.median(r["input_samples_per_s"] for r in ok) * k
        busy = [r["input_worker_cores"] for r in ok if r.get("input_worker_cores") is not None]
        cores = statistics.median(busy) if busy else None
        undecoded = "decode=gpu" in name or any(r.get("input_gpu_share") for r in ok)  # made: some only read
        on = ("" if not cores or cores < 0.05 else f" on {cores:.1f} cores" if undecoded
              else f" on {cores:.1f} cores ({made / cores:,.0f} {unit} a busy core)")
        lines.append(f"  {name}: the timed steps trained {trained:,.0f} {unit}, its workers made {made:,.0f} "
                     f"{unit} in them{on}" + (" (the row: the lower; the rest came from batches read ahead)"
                                              if made < trained else "") + _auto_choice(ok))
    return (["real-data rows (medians): the rate sustained is the lower of what was trained and what the workers "
             "made; its cores are the workers' CPU seconds over the window's"]
            + lines) if lines else []


HOST_WAIT_SHOWN = 0.02  # a row whose training thread waited for a core this share of its timed steps is listed


def _host_lines(w: dict) -> list[str]:
    """Rows whose training thread (rank 0's) was ready to run but waited for a core in the timed steps (medians):
    the host's other work, not the model, set part of their pace."""
    ran = _shares(w, "host_thread_on_core")  # measured with the wait, in the same runs (child.host_thread)
    lines = [f"  {name}: waited {waited:.1%} ({lo:.1%}-{hi:.1%}), ran {ran[name][0]:.1%}"
             for name, (waited, lo, hi) in _shares(w, "host_thread_waited").items() if waited >= HOST_WAIT_SHOWN]
    return (["the training thread waited for a free core (ready to run, not running; /proc's scheduler statistics), "
             "medians over the timed steps:"] + lines) if lines else []


def _shares(w: dict, key: str) -> dict[str, tuple[float, float, float]]:
    """Each row's (median, lowest, highest) of the runs' `key` over its repeats that ran and measured it."""
    import statistics

    shares = {}
    for name in dict.fromkeys(r["name"] for r in w["runs"]):
        each = [r[key] for r in w["runs"] if r["name"] == name and r["status"] == "ok" and r.get(key) is not None]
        if each:
            shares[name] = (statistics.median(each), min(each), max(each))
    return shares


def _share_lines(what: str, shares: dict[str, tuple[float, float, float]]) -> list[str]:
    return [f"{what}, medians over the timed steps:"] + [f"  {name}: {m:.1%} ({lo:.1%}-{hi:.1%})"
                                                         for name, (m, lo, hi) in shares.items()]


CARD_IDLE_SHOWN = 0.02  # a row whose card idled between steps this share of its timed steps lists every row's


def _card_lines(w: dict) -> list[str]:
    """Where one row's card had nothing to run between steps CARD_IDLE_SHOWN of its timed steps or more (medians),
    every row's share, so the rows whose input kept the card busy stand beside it: a loop that waited for data
    while its card stayed busy lost nothing to the wait."""
    shares = _shares(w, "card_idle")
    if not any(m >= CARD_IDLE_SHOWN for m, _, _ in shares.values()):
        return []
    return _share_lines("the card had nothing to run between steps (CUDA events on the training stream)", shares)


POWER_CAPPED_SHOWN = 0.01  # a run whose card was held below its clocks by its power limit this share of its timed steps


def _power_lines(w: dict) -> list[str]:
    """Where one run's card was held below its clocks by its power limit POWER_CAPPED_SHOWN of its timed steps or
    more, every row's share (median and range over its repeats): such a run's rate is partly the card's power
    budget's, not the trainer's or its input's, and a repeat much slower than its others may be that."""
    shares = _shares(w, "card_power_capped")
    if not any(hi >= POWER_CAPPED_SHOWN for _, _, hi in shares.values()):
        return []
    return _share_lines("the card ran below its clocks for its power limit (NVML's violation time; the most capped "
                        "card)", shares)


def _kinds_table(rows: list[dict]) -> list[str]:
    """Each run's cards by kind at the peak (job/breakdown.py), GB (10^9 bytes), medians over the repeats."""
    cards = [(r, c) for r in rows if r["ok"] for c in r["cards"] if c.get("kinds")]
    if not cards:
        return []
    head = ["run", "card", *(HEADS[k] for k in KINDS)]
    body = [[r["name"], f"{c['device']}" + (f" (rank {c['rank']})" if r["world_size"] and r["world_size"] > 1 else ""),
             *("n/a" if c["kinds"][k] is None else f"{c['kinds'][k]['median'] / 1e9:.2f}" for k in KINDS)]
            for r, c in cards]
    return ["memory by kind at the peak, GB (10^9 bytes), median of the repeats (docs/memory-breakdown.md):",
            *_grid(head, body)]


def _maxbatch_table(doc: dict, w: dict) -> str:
    m = doc["settings"]["maxbatch"]
    what, values = MAXBATCH_KEYS[m.get("key", "train.batch_size")]
    where = f"{w['cards']} GPU(s)" if doc["device"] == "cuda" else f"CPU, {w['cards']} ddp processes"
    lines = [f"== bench maxbatch {w['workload']}: the largest {what} each strategy trains, {where}; "
             f"trials of {m['steps']} steps, peaks over steps 2-{m['steps']}", *_header(doc)]
    unit = f"{w['unit']}/s"
    head = ["strategy", f"largest {values}", "too big at", values, "params at largest", "peak alloc MB at largest",
            "peak reserved MB", "NVML used MB", unit, "trials", "note"]
    body = []
    for r in w["maxbatch"]:
        cards = sorted(r["cards"], key=card_key)

        def col(key: str, cards=cards) -> str:
            if not cards:
                return "n/a" if doc["device"] == "cpu" else "-"
            return " / ".join("n/a" if c[key] is None else f"{c[key] / MB:,.0f}" for c in cards)

        note = r["stopped"] or ("exact" if r["exact"] else f"within {m['precision']:.0%}")
        if r["largest"] is None and not r["error"]:
            note = f"even {r['minimum']} does not fit" if r["smallest_too_big"] == r["minimum"] else note
        body.append([r["strategy"], str(r["largest"] or "-"), str(r["smallest_too_big"] or "-"),
                     f"{r['granularity']}k >= {r['minimum']}",
                     f"{r['params'] / 1e9:.2f}B" if r.get("params") else "-", col("peak_allocated_bytes"),
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
