"""bench.png: per workload, per-card memory (left: stacked by kind where the runs have their breakdown) and
throughput or the largest batch/model (right)."""

from __future__ import annotations

from pathlib import Path

from job.bench.results import card_key
from job.bench.settings import MAXBATCH_KEYS
from job.breakdown import KINDS

GIB = 1024**3
# One colour per kind of job/breakdown.py, the tensors in blues, what the allocator and the driver hold in greys,
# other processes in red; free is not drawn (it would dwarf the rest).
KIND_COLORS = {"parameters": "#08519c", "gradients": "#3182bd", "optimizer_state": "#6baed6",
               "activations": "#fd8d3c", "allocator_cache": "#bdbdbd", "cuda_context": "#737373",
               "other_processes": "#de2d26", "unattributed": "#d9d9d9"}


def _si(x: float, _pos=None) -> str:
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:g}{suffix}"
    return f"{x:g}"


def write_chart(doc: dict, path: Path) -> None:
    """Per workload: per-card memory bars (left), throughput or largest batch (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = doc["workloads"] or [{"workload": "none", "unit": "img", "summary": [], "maxbatch": None}]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 4.2 * len(workloads)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    env = doc["environment"]
    for (ax_mem, ax_right), w in zip(axes, workloads, strict=True):
        if w.get("maxbatch") is not None:
            key = doc["settings"]["maxbatch"].get("key", "train.batch_size")
            what = MAXBATCH_KEYS[key][0]
            bars = [(r["strategy"], {"peak_allocated_bytes": [c["peak_allocated_bytes"] for c in
                                                              sorted(r["cards"], key=card_key)],
                                     "peak_reserved_bytes": [c["peak_reserved_bytes"] for c in
                                                             sorted(r["cards"], key=card_key)],
                                     "devices": [c["device"] for c in sorted(r["cards"], key=card_key)]})
                    for r in w["maxbatch"] if r["cards"]]
            _memory_bars(ax_mem, bars, doc, f"{w['workload']}: per-card peak at the largest {what}")
            shown = w["maxbatch"]
            ys = [r["largest"] or 0 for r in shown]
            hb = ax_right.barh(range(len(shown)), ys, color="#807dba")
            for bar, r in zip(hb, shown, strict=True):
                label = (f"{r['largest']:,}" if r["largest"] else "none fits") + (
                    f" (too big: {r['smallest_too_big']:,})" if r["smallest_too_big"] else "")
                ax_right.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center",
                              fontsize=8)
            ax_right.set_yticks(range(len(shown)), [r["strategy"] for r in shown])
            ax_right.set_xlabel(f"largest {what} that trains")
            ax_right.set_xlim(0, (max(ys) if any(ys) else 1) * 1.6)
            ax_right.set_title(f"{w['workload']}: largest {what}")
            ax_right.invert_yaxis()
            continue
        rows = w.get("summary") or []
        bars = [(r["name"], {"peak_allocated_bytes": [c["peak_allocated_bytes"]["median"] for c in r["cards"]],
                             "peak_reserved_bytes": [c["peak_reserved_bytes"]["median"] for c in r["cards"]],
                             "err": [(c["peak_allocated_bytes"]["median"] - c["peak_allocated_bytes"]["min"],
                                      c["peak_allocated_bytes"]["max"] - c["peak_allocated_bytes"]["median"])
                                     for c in r["cards"]],
                             "devices": [c["device"] for c in r["cards"]]})
                for r in rows if r["ok"] and r["cards"]]
        by_kind = [(r["name"], r["cards"]) for r in rows if r["ok"] and r["cards"]]
        if by_kind and all(c.get("kinds") for _, cards in by_kind for c in cards):
            _kind_bars(ax_mem, by_kind, f"{w['workload']}: per-card memory by kind at the peak (median)")
        else:
            _memory_bars(ax_mem, bars, doc, f"{w['workload']}: per-card peak over the timed steps (median)")
        ys = [r["units_per_s"]["median"] if r["units_per_s"] else 0.0 for r in rows]
        err = [[(r["units_per_s"]["median"] - r["units_per_s"]["min"]) if r["units_per_s"] else 0 for r in rows],
               [(r["units_per_s"]["max"] - r["units_per_s"]["median"]) if r["units_per_s"] else 0 for r in rows]]
        hb = ax_right.barh(range(len(rows)), ys, xerr=err if rows else None, color="#41ab5d", capsize=3)
        for bar, r in zip(hb, rows, strict=True):
            if not r["units_per_s"]:
                label = r["status"][:40]
            else:
                label = f"{r['units_per_s']['median']:,.0f}"
                if r["scaling_vs_1"] is not None:
                    label += f"  ({r['scaling_vs_1']:.0%} of linear)"
            right = r["units_per_s"]["max"] if r["units_per_s"] else 0.0  # past the range bar
            ax_right.text(right, bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
        ax_right.set_yticks(range(len(rows)), [r["name"] for r in rows])
        ax_right.invert_yaxis()
        ax_right.set_xlabel(f"{w['unit']}/s (median; bars: min-max of {doc['settings']['repeats']} repeats)")
        ax_right.xaxis.set_major_formatter(_si)
        tops = [r["units_per_s"]["max"] for r in rows if r["units_per_s"]]
        ax_right.set_xlim(0, (max(tops) if tops else 1) * 1.6)
        ax_right.set_title(f"{w['workload']}: throughput")
    tenant = f" | tenant {doc['tenant']['gb']:g} GB on {doc['tenant']['device']}" if doc.get("tenant") else ""
    fig.suptitle(f"{env['gpu_model'] or 'CPU'} | torch {env['torch']} | driver {env['driver'] or '-'} | "
                 f"commit {(env['commit'] or '?')[:10]} | {env['date']}{tenant}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kind_bars(ax, runs: list[tuple[str, list[dict]]], title: str) -> None:
    """One stacked bar per card of every run, a segment per kind (medians of the repeats, GB)."""
    width = 0.8 / max(len(cards) for _, cards in runs)
    labelled, tallest = set(), 0.0
    for x, (_, cards) in enumerate(runs):
        for i, c in enumerate(cards):
            pos, bottom = x - 0.4 + width * (i + 0.5), 0.0
            for kind in KINDS:
                if kind == "free" or c["kinds"][kind] is None:
                    continue
                value = c["kinds"][kind]["median"] / 1e9
                ax.bar(pos, value, width * 0.9, bottom=bottom, color=KIND_COLORS[kind],
                       label=kind.replace("_", " ") if kind not in labelled else None)
                labelled.add(kind)
                bottom += value
            ax.text(pos, bottom, c["device"].split(":")[-1], ha="center", va="bottom", fontsize=7)
            tallest = max(tallest, bottom)
    ax.set_ylim(0, (tallest or 1) * 1.45)  # room for the card labels and the legend above the bars
    ax.set_xticks(range(len(runs)), [name for name, _ in runs], rotation=20, ha="right")
    ax.set_ylabel("GB per card (10^9 bytes; free not drawn)")
    ax.legend(fontsize=7, ncol=4, loc="upper center")
    ax.set_title(title)


def _memory_bars(ax, bars: list[tuple[str, dict]], doc: dict, title: str) -> None:
    if bars:
        width = 0.8 / max(len(b["devices"]) for _, b in bars)
        for x, (_, b) in enumerate(bars):
            for i, dev in enumerate(b["devices"]):
                pos = x - 0.4 + width * (i + 0.5)
                first = x == i == 0
                ax.bar(pos, b["peak_reserved_bytes"][i] / GIB, width * 0.9, color="#c6dbef",
                       label="peak reserved" if first else None)
                yerr = None
                if b.get("err"):
                    yerr = [[b["err"][i][0] / GIB], [b["err"][i][1] / GIB]]
                ax.bar(pos, b["peak_allocated_bytes"][i] / GIB, width * 0.9, color="#2171b5", yerr=yerr,
                       capsize=2, label="peak allocated" if first else None)
                ax.text(pos, b["peak_reserved_bytes"][i] / GIB, dev.split(":")[-1], ha="center", va="bottom",
                        fontsize=7)
        ax.set_xticks(range(len(bars)), [name for name, _ in bars], rotation=20, ha="right")
        ax.set_ylabel("GiB per card")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no CUDA cards: per-card memory is not measured on CPU"
                if doc["device"] == "cpu" else "no run finished", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_title(title)
