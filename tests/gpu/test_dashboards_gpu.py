"""The dashboards' card and allocator panels against a real 2-GPU run (run on the lent GPU machine).

On CPU those panels can only be parsed (tests/infra/test_docker.py evaluates them without data); here a
`strategy=dp` run on two cards serves real NVML and allocator series, so each panel must return data
whose labels fill its legend. No Docker and no Grafana are needed: the trainer and Prometheus run on the
host, on loopback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse

import pytest

from tests._dashboards_helpers import OTHER_PROCESSES, RULES, dashboards, evaluate_live, panel_targets
from tests._telemetry_helpers import free_port, get, named, stop, wait_for
from tests.conftest import ROOT, job_cmd, need_binary, requires_gpus


def _two_card_run(tmp_path, port: int) -> subprocess.Popen:
    cmd = job_cmd("train", "workload=tiny", "train.device=cuda", "strategy=dp", f"train.run_dir={tmp_path}",
                  "train.run_id=dash", "train.steps=1000000", f"telemetry.port={port}")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ready(text: str) -> bool:
    # Card 1's allocator series appears once DataParallel's first step has run a replica there; the
    # NVML series of card 1 are there from the start, so they alone do not mean ready.
    return 'gpu="1"' in text and text.count("trainjob_torch_memory_peak_allocated_bytes{") >= 2


@requires_gpus(2)
@pytest.mark.gpu
def test_gpu_exposition_carries_every_label_the_card_panels_use(tmp_path):
    port = free_port()
    proc = _two_card_run(tmp_path, port)
    try:
        text = wait_for(f"http://127.0.0.1:{port}/metrics", _ready, proc, timeout=240)
    finally:
        stop(proc)
    used = named(text, "trainjob_gpu_memory_used_bytes")
    assert {d["gpu"] for d in used} >= {"0", "1"}, used
    for d in used:
        assert set(d) >= {"uuid", "pci_bus_id", "gpu", "name", "host"} and d["uuid"].startswith(("GPU-", "MIG-")), d
    peaks = named(text, "trainjob_torch_memory_peak_allocated_bytes")
    assert {p["uuid"] for p in peaks} == {d["uuid"] for d in used if d["gpu"] in ("0", "1")}, peaks
    # The host variable joins the card series and the runs through the same `host` value.
    assert {i["host"] for i in named(text, "trainjob_info")} == {d["host"] for d in used}
    # Labels the card/allocator legends print are on the series they read.
    series_labels = set().union(*(set(d) for d in used + peaks))
    for d in dashboards().values():
        for _title, t in panel_targets(d):
            if re.search(r"trainjob_(gpu|torch)_memory_\w+_bytes\{", t["expr"]) and "max by" not in t["expr"]:
                legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
                assert legend <= series_labels, (t["expr"], legend - series_labels)


@requires_gpus(2)
@pytest.mark.gpu
@pytest.mark.prometheus
def test_gpu_every_dashboard_panel_has_data(tmp_path):
    """All panels but Active alerts return data (with legends filled) for a 2-card dp run."""
    prometheus = need_binary("prometheus", "apt-get install prometheus")
    port, prom_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML; 2 s scrapes so rate(...[1m]) has points quickly
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "rule_files": [str(RULES / "*.yml")],
        "scrape_configs": [{"job_name": "trainjob", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
    }))
    proc = _two_card_run(tmp_path / "runs", port)
    prom = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{prom_port}"

    def api(path: str, **params) -> dict:
        try:
            _code, body = get(f"{base}{path}?{urllib.parse.urlencode(params, doseq=True)}", timeout=10)
        except OSError as e:  # Prometheus still starting
            return {"status": "unreachable", "error": str(e)}
        return json.loads(body)

    try:
        wait_for(f"http://127.0.0.1:{port}/metrics", _ready, proc, timeout=240)
        deadline = time.monotonic() + 60
        while api("/api/v1/query", query='run:trainjob_samples:rate1m{run="dash"}').get("data", {}).get("result") in (None, []):
            assert time.monotonic() < deadline, "Prometheus has no rate for the run after 60 s"
            time.sleep(2)
        # every panel has data on a GPU run, the memory plan's and the memory by kind included; other processes
        # only where a tenant shares the cards (tests/gpu/test_breakdown_gpu.py)
        chosen = evaluate_live(api, needs_data=lambda metrics: "ALERTS" not in metrics and not metrics & OTHER_PROCESSES,
                               timeout=90)
        print(f"dashboard variables on the GPU run: {chosen}")
    finally:
        stop(proc)
        stop(prom)

