"""monitoring/prometheus/ checked by promtool, and a real Prometheus scraping a real CPU training run.

The end-to-end test starts Debian's Prometheus on a free loopback port with a temporary config that
loads the repository's rules, a CPU training run with telemetry on, and the standalone exporter
(in-process, over FakeNvml, since there is no GPU here), then reads the series back from the API.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.parse
from types import SimpleNamespace

import pytest
import yaml
from _telemetry_helpers import free_port, get, stop
from conftest import ROOT, job_cmd, need_binary

from job import devices, fakes, telemetry
from job.fakes import FakeNvml

PROM = ROOT / "monitoring" / "prometheus"
RULES = sorted((PROM / "rules").glob("*.yml"))


def _promtool(*args: str) -> subprocess.CompletedProcess:
    promtool = need_binary("promtool", "apt-get install prometheus")
    return subprocess.run([promtool, *args], cwd=PROM, capture_output=True, text=True, timeout=60)


def test_promtool_check_config():
    p = _promtool("check", "config", "prometheus.yml")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(RULES)} rule files found" in p.stdout


def test_promtool_check_rules():
    assert RULES
    p = _promtool("check", "rules", *map(str, RULES))
    assert p.returncode == 0, p.stdout + p.stderr


def test_promtool_test_rules():
    tests = sorted((PROM / "tests").glob("*.yml"))
    assert tests
    p = _promtool("test", "rules", *map(str, tests))
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_alert_has_a_firing_case():
    alerts = {r["alert"] for f in RULES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
              if "alert" in r}
    assert len(alerts) >= 5
    fired = set()
    for f in (PROM / "tests").glob("*.yml"):
        for case in yaml.safe_load(f.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                if t["exp_alerts"]:
                    fired.add(t["alertname"])
    assert fired == alerts


def test_default_targets_are_loopback():
    for f in (PROM / "targets").glob("*.yml"):
        for group in yaml.safe_load(f.read_text()):
            assert all(t.startswith("127.0.0.1:") for t in group["targets"]), f


# -- end to end ---------------------------------------------------------------------------------


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus on loopback; yields (write_config(targets) -> None, api(query) -> result)."""
    binary = need_binary("prometheus", "apt-get install prometheus")
    port = free_port()
    cfg_file = tmp_path / "prometheus.yml"
    procs: list[subprocess.Popen] = []

    def start(targets: dict[str, int]) -> None:
        # Scrapes 2 s apart with a 2 s timeout: on a loaded 2-core machine a CPU training process sometimes takes
        # more than 1 s to answer, and with 1 s a rate() over 1m had too few samples to say anything.
        cfg = {"global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "1s"},
               "rule_files": [str(r) for r in RULES],
               "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{p}"]}]}
                                  for job, p in targets.items()]}
        cfg_file.write_text(yaml.safe_dump(cfg))
        log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen(
            [binary, f"--config.file={cfg_file}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT))

    def api(path: str, **params) -> dict:
        url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        code, body = get(url)
        assert code == 200, body
        return json.loads(body)["data"]

    yield start, api
    for p in procs:
        stop(p, timeout=30)


def _poll(api, query: str, predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    result = None
    while time.monotonic() < deadline:
        try:
            result = api("query", query=query)["result"]
            if predicate(result):
                return result
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{query}: {result}")


@pytest.mark.prometheus
def test_prometheus_scrapes_training_run_and_exporter(tmp_path, prometheus):
    start_prometheus, api = prometheus
    train_port, export_port = free_port(), free_port()

    nv = FakeNvml.h200s(2)
    nv.cards[0].used, nv.cards[1].used = nv.cards[0].total * 93 // 100, nv.cards[1].total * 30 // 100
    nv.nvmlInit()
    ready, stop_exporter = threading.Event(), threading.Event()
    exporter = threading.Thread(target=telemetry.export_main, args=(["--port", str(export_port)],),
                                kwargs={"nvml": nv, "ready": ready, "stop": stop_exporter})
    exporter.start()
    # A DataParallel process holding memory on both fake cards (the allocator is the one thing that
    # needs CUDA): the run whose cards the imbalance alert compares.
    dp_port = free_port()
    cards = [devices.Card(i, c.uuid, c.pci_bus_id, i, c.name) for i, c in enumerate(nv.cards)]
    dp = telemetry.TrainingTelemetry(
        SimpleNamespace(port=dp_port, host="127.0.0.1", log_every=0, peer_dir=str(tmp_path / "peers")),
        run="dp-fake", strategy="dp", rank=0, local_rank=0, world_size=1, info={"workload": "lm"},
        device=SimpleNamespace(type="cuda", index=0), nvml=nv, cards=cards,
        allocator=fakes.FakeAllocator({0: (80 << 30, 90 << 30, 85 << 30), 1: (20 << 30, 25 << 30, 22 << 30)}),
    ).start()
    trainer = subprocess.Popen(
        job_cmd("train", "strategy=dp", "workload=tiny", "workload.width=8", "workload.image_size=16",
                "train.device=cpu", "train.batch_size=8", "train.checkpoint_every=0", "train.steps=100000",
                f"train.run_dir={tmp_path}", "train.run_id=e2e", f"telemetry.port={train_port}"),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert ready.wait(30)
        start_prometheus({"trainjob": train_port, "trainjob-exporter": export_port, "trainjob-dp": dp_port})

        rows = _poll(api, 'trainjob_samples_total{run="e2e"} > 0', lambda r: len(r) == 1, timeout=120)
        labels = rows[0]["metric"]
        assert labels == {"__name__": "trainjob_samples_total", "job": "trainjob", "instance": f"127.0.0.1:{train_port}",
                          "rank": "0", "local_rank": "0", "strategy": "dp", "run": "e2e"}  # uuid="" on CPU = absent
        (info,) = _poll(api, 'trainjob_info{run="e2e"}', lambda r: len(r) == 1)
        assert info["metric"]["workload"] == "tiny" and info["metric"]["world_size"] == "1"
        _poll(api, 'sum(trainjob_step_seconds_bucket{run="e2e",le="+Inf"}) > 0', lambda r: len(r) == 1)
        try:
            _poll(api, 'run:trainjob_samples:rate1m{run="e2e"} > 0', lambda r: len(r) == 1, timeout=120)
        except AssertionError as e:  # say how the scrapes went
            raise AssertionError(f"{e}; targets: {[(t['labels'], t['health'], t['lastError']) for t in api('targets')['activeTargets']]}") from None
        # the CPU run's memory by kind: its tensors only, as uuid="cpu" (no card, so no ratio of a card); the
        # gradients are 0 when a scrape falls between zero_grad(set_to_none=True) and the backward; SGD keeps one
        # momentum buffer per weight (tiny has no buffers)
        # (polled until the first optimizer step has made the momentum buffers: a scrape may come before it)
        kinds = _poll(api, 'trainjob_memory_breakdown_bytes{run="e2e"}', lambda r: len(r) == 3 and any(
            x["metric"]["kind"] == "optimizer_state" and float(x["value"][1]) > 0 for x in r))
        assert {r["metric"]["kind"] for r in kinds} == {"parameters", "gradients", "optimizer_state"}
        value = {r["metric"]["kind"]: float(r["value"][1]) for r in kinds}
        assert {r["metric"]["uuid"] for r in kinds} == {"cpu"} and value["parameters"] == value["optimizer_state"] > 0

        # per-card series from the exporter, and the recording rules evaluated on them
        ratio = _poll(api, "uuid:trainjob_gpu_memory_used:ratio", lambda r: len(r) == 2)
        got = {r["metric"]["uuid"]: round(float(r["value"][1]), 2) for r in ratio}
        assert got == {nv.cards[0].uuid: 0.93, nv.cards[1].uuid: 0.30}
        assert {r["metric"]["pci_bus_id"] for r in ratio} == {c.pci_bus_id for c in nv.cards}
        _poll(api, 'trainjob_nvml_up{job="trainjob-exporter"} == 1', lambda r: len(r) == 1)
        # the imbalance alert compares the cards of one run: dp-fake holds memory on both (93 % vs 30 %),
        # so it is pending (for: 5m); the CPU run has no card, and no alert names it
        alerts = _poll(api, 'ALERTS{alertname="TrainjobGpuMemoryImbalance"}', lambda r: len(r) == 1)
        assert alerts[0]["metric"]["alertstate"] == "pending" and alerts[0]["metric"]["run"] == "dp-fake"
        spread = _poll(api, "run_uuid:trainjob_gpu_memory_used:ratio", lambda r: len(r) == 2)
        assert {(r["metric"]["run"], round(float(r["value"][1]), 2)) for r in spread} == {("dp-fake", 0.93),
                                                                                          ("dp-fake", 0.3)}

        groups = api("rules")["groups"]
        assert all(rule["health"] == "ok" for g in groups for rule in g["rules"]), groups
        assert {g["name"] for g in groups} == {"trainjob.recording", "trainjob.alerts"}
    finally:
        stop_exporter.set()
        dp.close()
        rc = stop(trainer)
        exporter.join(30)
    assert rc == 75, trainer.stdout.read()

