"""Strict offline validation of the Grafana dashboards, and their PromQL for live evaluation.

Grafana has no server here, so tests/infra/test_dashboards.py checks the JSON against the subset of
Grafana's dashboard model this project uses (unknown keys are errors, not ignored), checks every
metric name against the metric contract (docs/design.md) and the recording rules, and parses every query with
promtool; tests/infra/test_docker.py evaluates the same queries against the live Prometheus of the
compose stack. Both substitute Grafana's variables the way Grafana does before it sends a query.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "monitoring" / "grafana" / "dashboards"
PROVISIONING = ROOT / "monitoring" / "grafana" / "provisioning"
RULES = ROOT / "monitoring" / "prometheus" / "rules"

# The metric contract (docs/design.md) (base names; a histogram adds _bucket/_sum/_count).
CONTRACT = {
    "trainjob_gpu_memory_used_bytes", "trainjob_gpu_memory_total_bytes", "trainjob_gpu_utilization_ratio",
    "trainjob_torch_memory_allocated_bytes", "trainjob_torch_memory_reserved_bytes",
    "trainjob_torch_memory_peak_allocated_bytes", "trainjob_samples_total", "trainjob_loss", "trainjob_info",
    "trainjob_nvml_up",
    "trainjob_step_seconds_bucket", "trainjob_step_seconds_sum", "trainjob_step_seconds_count",
    "trainjob_card_idle_seconds_total", "trainjob_card_idle_steps_total",
} | {
    # the memory plan's per-card gauges (labels rank, local_rank, uuid, strategy, run), see PLAN
    "trainjob_plan_samples", "trainjob_plan_headroom_bytes",
} | {
    # each card's memory by kind (job/breakdown.py), and the other processes on it (labels as the plan's + kind,
    # pid, process)
    "trainjob_memory_breakdown_bytes", "trainjob_memory_other_process_bytes",
}
# The memory plan's series come from a real trainer (job/memplan.py); the fake node of the live test has
# none, so there the panel built on them may be empty (the docker and GPU tests require them).
PLAN = {"trainjob_plan_samples", "trainjob_plan_headroom_bytes"}
# Other processes exist only where something else holds memory on the job's cards (a tenant): a run alone on its
# cards has none, so the panel built on them may be empty there (tests/infra/test_dashboards_live.py's node has one).
OTHER_PROCESSES = {"trainjob_memory_other_process_bytes"}
PROMETHEUS_BUILTIN = {"up", "ALERTS"}
# Series a CPU training run produces (no card, no allocator): the panels built only on these must
# return data in the docker end-to-end test; the others must parse and evaluate.
TRAINING = {
    "trainjob_samples_total", "trainjob_loss", "trainjob_info", "trainjob_step_seconds_bucket",
    "trainjob_step_seconds_sum", "trainjob_step_seconds_count", "run:trainjob_samples:rate1m", "up",
    "trainjob_nvml_up", "trainjob_plan_samples",
}
# What Grafana puts in for its built-in interval variables (datasource timeInterval 10s, 1 h range).
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}

# ------------------------------------------------------------------ the model this project uses

DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
PANEL_TYPES = {"timeseries", "stat", "bargauge", "table", "gauge", "barchart"}
UNITS = {"bytes", "percentunit", "s", "none", "short"}
PANEL_OPTIONS = {
    "timeseries": {"legend", "tooltip"},
    "stat": {"reduceOptions", "colorMode", "graphMode", "textMode", "justifyMode", "orientation"},
    "gauge": {"reduceOptions", "orientation", "showThresholdLabels", "showThresholdMarkers"},
    "bargauge": {"reduceOptions", "orientation", "displayMode", "showUnfilled"},
    "table": {"showHeader", "cellHeight", "footer"},
    "barchart": {"legend", "tooltip", "orientation", "stacking", "showValue", "xField"},
}
# Transformations this project uses, with their options (Grafana's transformer ids).
TRANSFORMATIONS = {"groupingToMatrix": {"columnField", "rowField", "valueField"}}
ENUMS = {
    "legend.displayMode": {"list", "table", "hidden"},
    "legend.placement": {"bottom", "right"},
    "tooltip.mode": {"single", "multi", "none"},
    "tooltip.sort": {"none", "asc", "desc"},
    "colorMode": {"value", "background", "none"},
    "graphMode": {"area", "none"},
    "textMode": {"auto", "value", "value_and_name", "name", "none"},
    "justifyMode": {"auto", "center"},
    "orientation": {"auto", "horizontal", "vertical"},
    "displayMode": {"gradient", "lcd", "basic"},
    "cellHeight": {"sm", "md", "lg"},
    "custom.drawStyle": {"line", "bars", "points"},
    "custom.showPoints": {"auto", "never", "always"},
    "format": {"time_series", "table", "heatmap"},
    "stacking": {"none", "normal", "percent"},
    "showValue": {"auto", "always", "never"},
}
CALCS = {"lastNotNull", "last", "max", "min", "mean", "sum", "firstNotNull", "first"}


class Problems(list):
    def need(self, cond: bool, where: str, what: str) -> bool:
        if not cond:
            self.append(f"{where}: {what}")
        return cond

    def keys(self, obj, where: str, required: set[str], optional: set[str] = frozenset()) -> bool:
        if not self.need(isinstance(obj, dict), where, f"expected an object, got {type(obj).__name__}"):
            return False
        for k in sorted(obj.keys() - required - optional):
            self.append(f"{where}: unknown key `{k}` (allowed: {', '.join(sorted(required | optional))})")
        for k in sorted(required - obj.keys()):
            self.append(f"{where}: missing key `{k}`")
        return required <= obj.keys()  # callers read required keys only when all are there

    def enum(self, value, where: str, key: str) -> None:
        self.need(value in ENUMS[key], where, f"`{value}` is not one of {sorted(ENUMS[key])}")

    def typed(self, obj: dict, where: str, types: dict[str, type | tuple]) -> None:
        for k, t in types.items():
            if k in obj:
                self.need(isinstance(obj[k], t) and not (t is int and isinstance(obj[k], bool)),
                          f"{where}.{k}", f"expected {t}, got {type(obj[k]).__name__}")


def _validate_target(p: Problems, t, where: str) -> None:
    if not p.keys(t, where, {"datasource", "refId", "expr"},
                  {"legendFormat", "range", "instant", "format", "interval", "hide"}):
        return
    p.need(t["datasource"] == DATASOURCE_REF, where, f"datasource must be {DATASOURCE_REF}")
    p.need(isinstance(t["expr"], str) and t["expr"].strip() != "", where, "empty query")
    p.typed(t, where, {"refId": str, "legendFormat": str, "range": bool, "instant": bool, "interval": str,
                       "hide": bool})
    if "format" in t:
        p.enum(t["format"], where, "format")
    if t.get("format") == "table" or t.get("instant"):
        p.need(t.get("instant") is True and t.get("range") is False, where,
               "a table or instant query needs instant: true and range: false")


def _validate_options(p: Problems, kind: str, opts, where: str) -> None:
    if not p.keys(opts, where, set(), PANEL_OPTIONS.get(kind, set())):
        return
    for k in ("colorMode", "graphMode", "textMode", "justifyMode", "orientation", "displayMode", "cellHeight",
              "stacking", "showValue"):
        if k in opts:
            p.enum(opts[k], f"{where}.{k}", k)
    if "legend" in opts and p.keys(opts["legend"], f"{where}.legend", {"showLegend", "displayMode", "placement"},
                                   {"calcs"}):
        p.enum(opts["legend"]["displayMode"], f"{where}.legend", "legend.displayMode")
        p.enum(opts["legend"]["placement"], f"{where}.legend", "legend.placement")
        p.need(set(opts["legend"].get("calcs", [])) <= CALCS, f"{where}.legend.calcs", f"allowed: {sorted(CALCS)}")
    if "tooltip" in opts and p.keys(opts["tooltip"], f"{where}.tooltip", {"mode"}, {"sort"}):
        p.enum(opts["tooltip"]["mode"], f"{where}.tooltip", "tooltip.mode")
        if "sort" in opts["tooltip"]:
            p.enum(opts["tooltip"]["sort"], f"{where}.tooltip", "tooltip.sort")
    if "reduceOptions" in opts and p.keys(opts["reduceOptions"], f"{where}.reduceOptions",
                                          {"calcs", "fields", "values"}):
        calcs = opts["reduceOptions"]["calcs"]
        p.need(isinstance(calcs, list) and len(calcs) == 1 and set(calcs) <= CALCS,
               f"{where}.reduceOptions.calcs", f"one of {sorted(CALCS)}")
    if "footer" in opts:
        p.keys(opts["footer"], f"{where}.footer", {"show"}, {"reducer", "fields"})


def _validate_field_config(p: Problems, kind: str, fc, where: str) -> None:
    if not p.keys(fc, where, {"defaults", "overrides"}):
        return
    d = fc["defaults"]
    if not p.keys(d, f"{where}.defaults", {"unit"}, {"min", "max", "decimals", "custom", "thresholds", "color",
                                                     "mappings"}):
        return
    p.need(d["unit"] in UNITS, f"{where}.defaults.unit", f"`{d['unit']}` is not one of {sorted(UNITS)}")
    p.typed(d, f"{where}.defaults", {"min": (int, float), "max": (int, float), "decimals": int})
    if "custom" in d:
        p.need(kind == "timeseries", f"{where}.defaults.custom", "only timeseries panels take custom settings")
        if p.keys(d["custom"], f"{where}.defaults.custom", set(),
                  {"drawStyle", "lineWidth", "fillOpacity", "showPoints", "spanNulls", "stacking"}):
            for k in ("drawStyle", "showPoints"):
                if k in d["custom"]:
                    p.enum(d["custom"][k], f"{where}.defaults.custom", f"custom.{k}")
    p.need(fc["overrides"] == [] or isinstance(fc["overrides"], list), f"{where}.overrides", "must be a list")


def _validate_panel(p: Problems, panel, where: str) -> None:
    if not p.keys(panel, where, {"id", "type", "title", "datasource", "gridPos", "targets", "fieldConfig",
                                 "options"}, {"description", "transparent", "interval", "maxDataPoints",
                                              "transformations"}):
        return
    p.typed(panel, where, {"id": int, "title": str, "description": str})
    p.need(panel["type"] in PANEL_TYPES, where, f"panel type `{panel['type']}` is not one of {sorted(PANEL_TYPES)}")
    p.need(panel["datasource"] == DATASOURCE_REF, where, f"datasource must be {DATASOURCE_REF}")
    g = panel["gridPos"]
    if p.keys(g, f"{where}.gridPos", {"x", "y", "w", "h"}):
        p.typed(g, f"{where}.gridPos", dict.fromkeys("xywh", int))
        if all(isinstance(g[k], int) for k in "xywh"):
            p.need(0 <= g["x"] and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["y"] >= 0 and g["h"] > 0,
                   f"{where}.gridPos", "must lie within Grafana's 24 columns")
    targets = panel["targets"]
    if p.need(isinstance(targets, list) and targets, where, "needs at least one query"):
        refs = [t.get("refId") for t in targets if isinstance(t, dict)]
        p.need(len(refs) == len(set(refs)), where, f"duplicate refIds {refs}")
        for i, t in enumerate(targets):
            _validate_target(p, t, f"{where}.targets[{i}]")
    for i, tr in enumerate(panel.get("transformations", [])):
        at = f"{where}.transformations[{i}]"
        if p.keys(tr, at, {"id", "options"}) and p.need(tr["id"] in TRANSFORMATIONS, at,
                                                        f"transformation `{tr['id']}` is not one of "
                                                        f"{sorted(TRANSFORMATIONS)}"):
            p.keys(tr["options"], f"{at}.options", TRANSFORMATIONS[tr["id"]])
    if panel["type"] == "barchart":
        tables = isinstance(targets, list) and all(t.get("format") == "table" for t in targets if isinstance(t, dict))
        p.need(tables, where, "a bar chart reads instant table queries")
    _validate_field_config(p, panel["type"], panel["fieldConfig"], f"{where}.fieldConfig")
    _validate_options(p, panel["type"], panel["options"], f"{where}.options")


def _validate_variable(p: Problems, v, where: str) -> None:
    common = {"name", "label", "type", "query", "refresh", "regex", "includeAll", "multi", "current", "options",
              "hide"}
    if not isinstance(v, dict):
        p.append(f"{where}: expected an object")
        return
    if v.get("type") == "datasource":
        if p.keys(v, where, common):
            p.need(v["query"] == "prometheus", where, "the datasource variable must list prometheus data sources")
        return
    if not p.keys(v, where, common | {"datasource", "sort"}, {"allValue"}):
        return
    p.need(v["type"] == "query", where, "variables are `query` or `datasource`")
    p.need(v["datasource"] == DATASOURCE_REF, where, f"datasource must be {DATASOURCE_REF}")
    p.need(label_values(v["query"]) is not None, where, f"query `{v['query']}` is not label_values(selector, label)")
    if v["includeAll"]:
        p.need(v.get("allValue") == ".*", where, "with includeAll, allValue must be .* (used with =~)")


def validate_dashboard(d) -> list[str]:
    """Every problem found, as `path: what`; [] when the dashboard is valid."""
    p = Problems()
    top_required = {"uid", "title", "schemaVersion", "panels", "templating", "time", "refresh", "editable",
                    "version", "tags"}
    top_optional = {"description", "timezone", "graphTooltip", "timepicker", "links", "annotations"}
    if not p.keys(d, "dashboard", top_required, top_optional):
        return p
    p.typed(d, "dashboard", {"uid": str, "title": str, "schemaVersion": int, "editable": bool, "version": int,
                             "tags": list, "refresh": str, "description": str})
    p.need(isinstance(d["uid"], str) and 0 < len(d["uid"]) <= 40 and re.fullmatch(r"[a-zA-Z0-9_-]+", d["uid"]),
           "dashboard.uid", "1-40 characters of [a-zA-Z0-9_-]")
    p.need(isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36, "dashboard.schemaVersion",
           "36 or later (Grafana 9+)")
    p.keys(d["time"], "dashboard.time", {"from", "to"})
    if p.keys(d["templating"], "dashboard.templating", {"list"}):
        names = []
        for i, v in enumerate(d["templating"]["list"]):
            _validate_variable(p, v, f"dashboard.templating.list[{i}]")
            names.append(v.get("name") if isinstance(v, dict) else None)
        p.need("datasource" in names, "dashboard.templating", "needs the `datasource` variable the panels use")
        p.need(len(names) == len(set(names)), "dashboard.templating", f"duplicate variable names {names}")
    if "annotations" in d and p.keys(d["annotations"], "dashboard.annotations", {"list"}):
        p.need(d["annotations"]["list"] == [], "dashboard.annotations.list", "annotations are not used")
    panels = d["panels"]
    if not p.need(isinstance(panels, list) and panels, "dashboard.panels", "needs panels"):
        return p
    for i, panel in enumerate(panels):
        _validate_panel(p, panel, f"dashboard.panels[{i}] ({panel.get('title', '?') if isinstance(panel, dict) else '?'})")
    ids = [q.get("id") for q in panels if isinstance(q, dict)]
    p.need(len(ids) == len(set(ids)), "dashboard.panels", f"duplicate panel ids {ids}")
    _check_overlap(p, panels)
    _check_references(p, d)
    return p


def _check_overlap(p: Problems, panels: list) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        g = panel.get("gridPos") if isinstance(panel, dict) else None
        if not isinstance(g, dict) or not all(isinstance(g.get(k), int) for k in "xywh"):
            continue
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                other = cells.setdefault((x, y), panel.get("title", "?"))
                if other != panel.get("title", "?"):
                    p.append(f"panel `{panel.get('title')}` overlaps `{other}` at x={x}, y={y}")
                    return


def _check_references(p: Problems, d: dict) -> None:
    defined = {v.get("name") for v in d["templating"].get("list", []) if isinstance(v, dict)}
    known = metric_contract()
    queries = [(f"panel `{t}` {r}", e) for t, r, e in panel_queries(d)]
    queries += [(f"variable `{n}`", (label_values(q) or (q, ""))[0]) for n, q in variable_queries(d)]
    for where, expr in queries:
        for name in variables_used(expr):
            p.need(name in defined or name in GRAFANA_BUILTINS, where, f"uses undefined variable ${name}")
        for m in metric_names(expr):
            p.need(m in known, where, f"metric `{m}` is not in the metric contract (docs/design.md) nor a recording rule")


# ------------------------------------------------------------------ queries and substitution


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def recording_rules() -> set[str]:
    names = set()
    for path in sorted(RULES.glob("*.yml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            names |= {r["record"] for r in group.get("rules", []) if "record" in r}
    return names


def metric_contract() -> set[str]:
    return CONTRACT | PROMETHEUS_BUILTIN | recording_rules()


def panel_queries(d: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query of every panel."""
    return [(p.get("title", "?"), t.get("refId", "?"), t.get("expr", ""))
            for p in d.get("panels", []) if isinstance(p, dict)
            for t in p.get("targets", []) if isinstance(t, dict)]


def panel_targets(d: dict) -> list[tuple[str, dict]]:
    """(panel title, target) of every query of every panel."""
    return [(p.get("title", "?"), t) for p in d.get("panels", []) if isinstance(p, dict)
            for t in p.get("targets", []) if isinstance(t, dict)]


def variable_queries(d: dict) -> list[tuple[str, str]]:
    return [(v["name"], v["query"]) for v in d.get("templating", {}).get("list", [])
            if isinstance(v, dict) and v.get("type") == "query"]


_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def variables_used(expr: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in _VAR.finditer(expr)}


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's interpolation: $x, ${x} and [[x]] become the variable's value (regex-joined when multi)."""
    def repl(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]

    return _VAR.sub(repl, expr)


def regex_value(selected: list[str]) -> str:
    """What Grafana puts in for a multi-value variable used with =~ (All: the allValue .*)."""
    if not selected:
        return ".*"
    return selected[0] if len(selected) == 1 else "(" + "|".join(re.escape(s) for s in selected) + ")"


def label_values(query: str) -> tuple[str, str] | None:
    """label_values(selector, label) -> (selector, label); None for anything else."""
    m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*", query, re.S)
    return (m.group(1), m.group(2)) if m else None


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
             "bool", "inf", "nan", "label_values"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (identifiers outside strings, matchers, grouping clauses)."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors
    s = _VAR.sub(" ", s)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    # A selector given only as {__name__=~"..."} names no metric; skip it.
    return names


def provisioning() -> dict[str, dict]:
    return {str(p.relative_to(PROVISIONING)): yaml.safe_load(p.read_text())
            for p in sorted(PROVISIONING.rglob("*.yml"))}


# ------------------------------------------------------------------ live evaluation


def evaluate_live(api, *, needs_data, timeout: float = 60.0) -> dict[str, dict[str, str]]:
    """Run every dashboard's variable and panel queries against a live Prometheus, as Grafana would.

    `api(path, **params) -> dict` calls Prometheus's HTTP API. Variables are resolved in order through
    /api/v1/label/<label>/values (each must return values); panel queries are evaluated with the
    variables' values and with All (.*): each must succeed, and those for which
    `needs_data(metric_names(expr))` is true must return data within `timeout` seconds.
    Returns {dashboard: {variable: regex value}}.
    """
    import time

    chosen_all = {}
    for name, d in dashboards().items():
        chosen: dict[str, str] = {}
        for var, query in variable_queries(d):
            selector, label = label_values(query)
            res = api(f"/api/v1/label/{label}/values", **{"match[]": substitute(selector, chosen)})
            assert res.get("status") == "success" and res["data"], f"{name} ${var}: {res}"
            chosen[var] = regex_value(res["data"])
        for values in (chosen, dict.fromkeys(chosen, ".*")):
            for title, target in panel_targets(d):
                ref, expr = target["refId"], target["expr"]
                promql = substitute(expr, values)
                wanted = needs_data(metric_names(expr))
                deadline = time.monotonic() + timeout
                while True:
                    res = api("/api/v1/query", query=promql)
                    assert res.get("status") == "success", f"{name} `{title}` {ref}: {promql}\n{res}"
                    if res["data"]["result"] or not wanted or time.monotonic() > deadline:
                        break
                    time.sleep(3)
                assert res["data"]["result"] or not wanted, f"{name} `{title}` {ref} returned no data: {promql}"
                # Every {{label}} of the legend is a label of every series the query returns.
                legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
                for series in res["data"]["result"]:
                    missing = legend - set(series["metric"])
                    assert not missing, f"{name} `{title}` {ref}: legend labels {missing} absent from {series}"
        chosen_all[name] = chosen
    return chosen_all
