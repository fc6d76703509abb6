"""The per-card memory table the project is about, and the short per-card log line.

Rows come from torch's caching allocator (peak allocated and reserved, per device this process
drives) and from NVML (used/total of the same physical card, matched by UUID through job.devices).
"""

from __future__ import annotations

import logging

import torch

from job import breakdown
from job.strategies import graphs

log = logging.getLogger("job")
MB = 1024 * 1024


def card_rows(devices: list[torch.device], *, rank: int, plan_cards=None) -> list[dict]:
    """One row per CUDA device this process drives; [] on CPU. `plan_cards` (job.memplan, same order as
    `devices`) adds each card's planned samples and its headroom: the memory the card had for this job
    when it planned (free + already held) minus this job's peak reserved, i.e. what was still free at peak; under
    memory.cap_gb at most what the cap leaves (`cap_bytes`)."""
    if not devices or devices[0].type != "cuda":
        return []
    from job import devices as devmod

    try:
        cards = {c.torch_index: c for c in devmod.visible_cards()}
    except Exception as e:  # telemetry must never break training
        log.warning("could not map CUDA devices to NVML cards: %s", e)
        cards = {}
    rows = []
    for i, d in enumerate(devices):
        card = cards.get(d.index)
        plan = plan_cards[i] if plan_cards else None
        reserved = torch.cuda.max_memory_reserved(d)
        mem = devmod.card_memory(card) if card is not None else None
        props = torch.cuda.get_device_properties(d)
        cap = breakdown.cap_of(d.index)
        rows.append({
            "rank": rank,
            "device": f"cuda:{d.index}",
            "name": props.name,
            "uuid": card.uuid if card else f"GPU-{props.uuid}",
            "pci_bus_id": card.pci_bus_id if card else "",
            "allocated_bytes": torch.cuda.memory_allocated(d) + graphs.held_bytes(d.index),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(d) + graphs.held_bytes(d.index),
            "peak_reserved_bytes": reserved,
            "nvml_used_bytes": mem[0] if mem else None,
            "nvml_total_bytes": mem[1] if mem else None,
            # the card held below its clocks by its power limit, seconds so far (a running count; None: not kept)
            "power_capped_s": devmod.card_power_capped_s(card) if card is not None else None,
            "planned_samples": plan.samples if plan else None,
            "predicted_peak_bytes": plan.predicted_peak if plan else None,
            "headroom_bytes": breakdown.cap_headroom(
                cap=cap, peak_reserved=reserved,
                card_headroom=plan.free + plan.held - reserved if plan and plan.total else None) if plan else None,
            "cap_bytes": cap,
        })
    return rows


def imbalance(rows: list[dict]) -> float | None:
    """Busiest card's peak allocated over the least busy card's."""
    peaks = [r["peak_allocated_bytes"] for r in rows]
    if len(peaks) < 2 or min(peaks) == 0:
        return None
    return max(peaks) / min(peaks)


def card_line(step: int, rows: list[dict]) -> str:
    """`step 120 | cuda:0 3.1/4.0 GB (peak/reserved) nvml 5.2/141.0 GB | cuda:1 ...`"""
    parts = [f"step {step}"]
    for r in rows:
        nv = (f" nvml {r['nvml_used_bytes'] / 1e9:.1f}/{r['nvml_total_bytes'] / 1e9:.1f} GB"
              if r["nvml_used_bytes"] is not None else "")
        parts.append(f"{r['device']} peak {r['peak_allocated_bytes'] / 1e9:.2f} GB "
                     f"reserved {r['peak_reserved_bytes'] / 1e9:.2f} GB{nv}")
    return " | ".join(parts)


def table(rows: list[dict], *, throughput: float | str, unit: str, title: str) -> str:
    """The per-card table; `throughput` in units/s, or a string saying why there is none."""
    rate = f"{throughput:,.1f} {unit}/s" if not isinstance(throughput, str) else throughput
    if not rows:
        return (f"{title}\nno CUDA cards visible: this run trained on the CPU, so there is no per-card memory "
                f"to show.\nthroughput: {rate}")
    peak_max = max(r["peak_allocated_bytes"] for r in rows) or 1
    head = ["rank", "device", "name", "uuid", "samples", "peak alloc MB", "predicted MB", "peak reserved MB",
            "headroom MB", "nvml used/total MB", "share of busiest"]
    body = []

    def mb(value) -> str:
        return f"{value / MB:,.0f}" if value is not None else "-"

    for r in sorted(rows, key=lambda r: (r["rank"], r["device"])):
        nv = (f"{r['nvml_used_bytes'] / MB:,.0f}/{r['nvml_total_bytes'] / MB:,.0f}"
              if r["nvml_used_bytes"] is not None else "n/a")
        samples = r.get("planned_samples")
        body.append([str(r["rank"]), r["device"], r["name"], r["uuid"][:13],
                     str(samples) if samples is not None else "-", mb(r["peak_allocated_bytes"]),
                     mb(r.get("predicted_peak_bytes")), mb(r["peak_reserved_bytes"]),
                     mb(r.get("headroom_bytes")) + (" (cap)" if r.get("cap_bytes") is not None else ""),
                     nv, f"{r['peak_allocated_bytes'] / peak_max:.0%}"])
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [title, fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*b) for b in body]
    ratio = imbalance(rows)
    lines.append(f"busiest/least busy card (peak allocated): {ratio:.2f}x" if ratio else "single card")
    capped = [f"{r['device']} {r['cap_bytes'] / 1e9:g} GB" for r in rows if r.get("cap_bytes") is not None]
    if capped:
        lines.append(f"(cap): headroom within memory.cap_gb ({', '.join(capped)}), not the card's free memory")
    lines.append(f"throughput: {rate}")
    return "\n".join(lines)
