"""Grafana dashboards and provisioning, validated offline (Grafana has no server here).

The live half (every query evaluated against the compose stack's Prometheus) is in tests/infra/test_docker.py.
"""

from __future__ import annotations

import copy
import json
import subprocess

import pytest
import yaml

from tests._dashboards_helpers import (
    DASHBOARDS,
    PROVISIONING,
    ROOT,
    dashboards,
    label_values,
    metric_names,
    panel_queries,
    provisioning,
    substitute,
    validate_dashboard,
    variable_queries,
    variables_used,
)
from tests.conftest import IN_CI, need_binary

ALL = {"host": ".*", "run": ".*", "strategy": ".*", "datasource": "trainjob-prometheus"}


def the_dashboard() -> dict:
    return json.loads((DASHBOARDS / "trainjob.json").read_text())


@pytest.mark.parametrize("name", sorted(p.name for p in DASHBOARDS.glob("*.json")))
def test_dashboard_is_strictly_valid(name):
    problems = validate_dashboard(json.loads((DASHBOARDS / name).read_text()))
    assert problems == [], "\n".join(problems)


def test_dashboard_uids_are_unique():
    uids = [d["uid"] for d in dashboards().values()]
    assert uids and len(uids) == len(set(uids)), uids


# Each mutation of the real dashboard must be caught, naming the place: the validator can fail.
MUTATIONS = {
    "unknown top-level key": (lambda d: d.update(pannels=[]), "unknown key `pannels`"),
    "unknown panel key": (lambda d: d["panels"][0].update(datasorce=d["panels"][0]["datasource"]),
                          "unknown key `datasorce`"),
    "panel without datasource": (lambda d: d["panels"][1].pop("datasource"), "missing key `datasource`"),
    "panel without query": (lambda d: d["panels"][2].update(targets=[]), "needs at least one query"),
    "empty query": (lambda d: d["panels"][2]["targets"][0].update(expr="  "), "empty query"),
    "unknown target key": (lambda d: d["panels"][0]["targets"][0].update(exp="up"), "unknown key `exp`"),
    "fixed datasource uid": (lambda d: d["panels"][3].update(datasource={"type": "prometheus", "uid": "x"}),
                             "datasource must be"),
    "metric outside the contract": (
        lambda d: d["panels"][0]["targets"][0].update(expr="trainjob_gpu_mem_used_bytes"),
        "metric `trainjob_gpu_mem_used_bytes` is not in the metric contract (docs/design.md)"),
    "undefined variable": (lambda d: d["panels"][0]["targets"][0].update(expr='up{job=~"$jobb"}'),
                           "undefined variable $jobb"),
    "unknown unit": (lambda d: d["panels"][0]["fieldConfig"]["defaults"].update(unit="gigabytes"),
                     "`gigabytes` is not one of"),
    "unknown panel type": (lambda d: d["panels"][0].update(type="graph"), "panel type `graph`"),
    "overlapping panels": (lambda d: d["panels"][1]["gridPos"].update(x=0, y=0), "overlaps"),
    "outside the grid": (lambda d: d["panels"][1]["gridPos"].update(x=20, w=8), "24 columns"),
    "bad legend mode": (lambda d: d["panels"][0]["options"]["legend"].update(displayMode="tabel"),
                        "`tabel` is not one of"),
    "option of another panel type": (lambda d: d["panels"][0]["options"].update(reduceOptions={}),
                                     "unknown key `reduceOptions`"),
    "duplicate panel id": (lambda d: d["panels"][1].update(id=d["panels"][0]["id"]), "duplicate panel ids"),
    "variable not label_values": (lambda d: d["templating"]["list"][1].update(query="up"),
                                  "is not label_values"),
    "no datasource variable": (lambda d: d["templating"]["list"].pop(0), "needs the `datasource` variable"),
    "unknown transformation": (lambda d: _by_type(d, "barchart")["transformations"][0].update(id="pivot"),
                               "transformation `pivot` is not one of"),
    "transformation option": (lambda d: _by_type(d, "barchart")["transformations"][0]["options"].update(row="x"),
                              "unknown key `row`"),
    "bar chart over a range query": (lambda d: _by_type(d, "barchart")["targets"][0].update(format="time_series"),
                                     "a bar chart reads instant table queries"),
    "bad stacking": (lambda d: _by_type(d, "barchart")["options"].update(stacking="stacked"),
                     "`stacked` is not one of"),
}


def _by_type(d: dict, kind: str) -> dict:
    return next(p for p in d["panels"] if p["type"] == kind)


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_validator_rejects(case):
    mutate, expected = MUTATIONS[case]
    d = copy.deepcopy(the_dashboard())
    mutate(d)
    problems = validate_dashboard(d)
    assert any(expected in p for p in problems), f"{case}: {expected!r} not in {problems}"


def test_dashboard_shows_what_issue_5_asks_for():
    d = the_dashboard()
    queries = [(t, e) for t, _, e in panel_queries(d)]
    legends = {t["legendFormat"] for p in d["panels"] for t in p["targets"] if t.get("legendFormat")}
    used = set().union(*(metric_names(e) for _, e in queries))
    # Per-card memory over time, by UUID with card name and index.
    assert any("trainjob_gpu_memory_used_bytes" in e for _, e in queries)
    assert any(all(f"{{{{{k}}}}}" in legend for k in ("uuid", "name", "gpu")) for legend in legends), legends
    # GPU 0 versus the rest.
    assert any('gpu="0"' in e and 'gpu!="0"' in e for _, e in queries)
    # Per-rank allocator memory, throughput and step time, active alerts.
    assert {"trainjob_torch_memory_allocated_bytes", "trainjob_torch_memory_reserved_bytes",
            "trainjob_torch_memory_peak_allocated_bytes"} <= used
    assert {"run:trainjob_samples:rate1m", "trainjob_step_seconds_bucket", "ALERTS"} <= used
    # Variables for host, run and strategy, each one usable in the panels.
    names = [n for n, _ in variable_queries(d)]
    assert names == ["host", "run", "strategy"]
    assert {"host", "run", "strategy"} <= set().union(*(variables_used(e) for _, e in queries))


@pytest.mark.parametrize("path", [DASHBOARDS / "trainjob.json", ROOT / "k8s" / "monitoring" / "dashboards" / "trainjob.json"],
                         ids=["compose", "kubernetes"])
def test_dashboard_stacks_each_cards_memory_by_kind(path):
    """Issue 28: one stacked bar per card, its segments the kinds of job/breakdown.py, for the run picked; and the
    other processes by pid and name."""
    d = json.loads(path.read_text())
    (bars,) = [p for p in d["panels"] if p["type"] == "barchart"]
    (query,) = bars["targets"]
    assert metric_names(query["expr"]) == {"trainjob_memory_breakdown_bytes", "trainjob_info"}
    assert "max by (uuid, kind)" in query["expr"] and {"run", "strategy", "host"} <= variables_used(query["expr"])
    assert bars["transformations"] == [{"id": "groupingToMatrix", "options": {
        "columnField": "kind", "rowField": "uuid", "valueField": "Value"}}]
    assert bars["options"]["stacking"] == "normal" and bars["options"]["xField"] == "uuid\\kind"
    assert bars["fieldConfig"]["defaults"]["unit"] == "bytes"
    others = [e for _, _, e in panel_queries(d) if "trainjob_memory_other_process_bytes" in e]
    assert len(others) == 1 and "max by (uuid, pid, process)" in others[0]


def test_every_query_parses_with_promtool(tmp_path):
    """Offline: each panel query (variables as Grafana sends them for All) is a valid PromQL expression."""
    promtool = need_binary("promtool", "apt-get install prometheus")
    rules = []
    for name, d in dashboards().items():
        for i, (title, ref, expr) in enumerate(panel_queries(d)):
            rules.append({"record": f"dashboard:q{i}_{ref}", "expr": substitute(expr, ALL),
                          "labels": {"panel": f"{name}: {title}"}})
        for var, query in variable_queries(d):
            selector, _label = label_values(query)
            rules.append({"record": f"dashboard:var_{var}", "expr": substitute(selector, ALL)})
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout


def test_metric_names_reads_only_metric_identifiers():
    expr = ('histogram_quantile(0.95, sum by (run, le) (rate(trainjob_step_seconds_bucket{run=~"$run"}[5m])))\n'
            'and on (run) trainjob_info{host=~"a|b"} / ignoring(x) up offset 5m')
    assert metric_names(expr) == {"trainjob_step_seconds_bucket", "trainjob_info", "up"}
    assert substitute('rate(x{run=~"$run"}[$__rate_interval])', {"run": "(a|b)"}) == 'rate(x{run=~"(a|b)"}[1m])'


def test_provisioning_matches_compose_mounts():
    prov = provisioning()
    (ds,) = prov["datasources/prometheus.yml"]["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "${PROMETHEUS_URL}" and ds["isDefault"] is True
    (provider,) = prov["dashboards/trainjob.yml"]["providers"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["./monitoring/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./monitoring/grafana/dashboards"] == provider["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (DASHBOARDS / home.rsplit("/", 1)[1]).is_file(), home
    assert "PROMETHEUS_URL" in grafana["environment"]
    # Anonymous viewers read only; the admin password has no default.
    env = grafana["environment"]
    # (GRAFANA_ANONYMOUS=false turns them off: docs/security.md)
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "${GRAFANA_ANONYMOUS:-true}" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    # ... and comes from a file (a compose secret), never from a plain environment variable
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert grafana["secrets"] == ["grafana_admin_password"]
    assert compose["secrets"]["grafana_admin_password"]["file"].startswith("${GRAFANA_ADMIN_PASSWORD_FILE:?")
    assert (PROVISIONING / "datasources").is_dir() and (PROVISIONING / "dashboards").is_dir()


# ------------------------------------------------------------------ Grafana's own models


def _sdk():
    try:
        import grafana_foundation_sdk  # noqa: F401
    except ImportError:
        if IN_CI:
            pytest.fail("grafana-foundation-sdk missing in CI: it comes with the test extra")
        pytest.skip("grafana-foundation-sdk not installed (pip install -e '.[test]')")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    return lambda cls, data: json.loads(json.dumps(cls.from_json(data), cls=JSONEncoder))


def _lost(before, after, path: str) -> list[str]:
    """Keys of `before` that a round trip dropped or changed (defaults it added are fine)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [p for k in before for p in ([f"{path}.{k}"] if k not in after else _lost(before[k], after[k], f"{path}.{k}"))]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [p for i, (b, a) in enumerate(zip(before, after, strict=True)) for p in _lost(b, a, f"{path}[{i}]")]
    return [] if before == after else [f"{path}: {before!r} became {after!r}"]


def grafana_round_trip_losses(d: dict) -> list[str]:
    """What Grafana's published models (grafana-foundation-sdk) do not know in dashboard `d`."""
    import importlib

    round_trip = _sdk()
    from grafana_foundation_sdk.models import dashboard, prometheus

    lost = _lost(d, round_trip(dashboard.Dashboard, d), "dashboard")
    for i, panel in enumerate(d.get("panels", [])):
        kind = importlib.import_module(f"grafana_foundation_sdk.models.{panel['type']}")
        where = f"panels[{i}] ({panel['title']})"
        lost += _lost(panel["options"], round_trip(kind.Options, panel["options"]), f"{where}.options")
        custom = panel["fieldConfig"]["defaults"].get("custom")
        if custom is not None:
            lost += _lost(custom, round_trip(kind.FieldConfig, custom), f"{where}.fieldConfig.defaults.custom")
        for j, t in enumerate(panel["targets"]):
            lost += _lost(t, round_trip(prometheus.Dataquery, t), f"{where}.targets[{j}]")
    return lost


@pytest.mark.parametrize("name", sorted(p.name for p in DASHBOARDS.glob("*.json")))
def test_dashboard_keys_exist_in_grafanas_own_models(name):
    """Every key written, down to panel options and Prometheus targets, survives Grafana's models."""
    lost = grafana_round_trip_losses(json.loads((DASHBOARDS / name).read_text()))
    assert lost == [], lost


@pytest.mark.parametrize("where", ["dashboard", "panel", "options", "target"])
def test_grafana_round_trip_catches_a_misspelt_key(where):
    d = the_dashboard()
    target = {"dashboard": d, "panel": d["panels"][0], "options": d["panels"][0]["options"],
              "target": d["panels"][0]["targets"][0]}[where]
    target["legendFromat"] = "x"
    assert any(p.endswith(".legendFromat") for p in grafana_round_trip_losses(d)), where
