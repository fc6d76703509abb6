"""Every dashboard panel against a live Prometheus scraping a fake two-card node (no GPU here).

The card and allocator panels have no series in a CPU run, so tests/infra/test_docker.py can only check
that they evaluate. Here the project's own telemetry serves a DataParallel-shaped node through its
injectable sources (job.fakes.FakeNvml for NVML, job.fakes.FakeAllocator for torch's allocator:
the two things that cannot run without a GPU), a real Prometheus scrapes it with the project's rules,
and every panel must return data whose labels fill its legend, with the pile-up numbers it was given: card 0
holds the parameters, gradients and optimizer state (job.fakes.FakeLayout stands in for the tensors) and shares
the card with another process, whose pid the other-processes panel names.
tests/gpu/test_dashboards_gpu.py repeats this with real cards on the GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.parse
from types import SimpleNamespace

import pytest

from job import devices, fakes
from job.breakdown import KINDS, Memory
from job.fakes import FakeAllocator, FakeLayout, FakeProcess
from job.telemetry import TrainingTelemetry
from tests._dashboards_helpers import PLAN, RULES, evaluate_live
from tests._telemetry_helpers import free_port, get, stop
from tests.conftest import need_binary

GIB = 1 << 30
TENANT = 2**30 + 2  # a pid above Linux's pid_max: not this test's process nor a child of it


class _Cuda:
    type = "cuda"
    index = 0


@pytest.fixture
def fake_dp_node(tmp_path):
    """One dp process on two fake H200s: card 0 holds 140 GiB (9 of them another process's), card 1 30 GiB; allocator
    peaks 125/22 GiB; card 0 holds the parameters, gradients and optimizer state."""
    nv = fakes.FakeNvml.h200s(2)
    nv.cards[0].used, nv.cards[1].used = 140 * GIB, 30 * GIB
    nv.cards[0].processes = [FakeProcess(os.getpid(), 130 * GIB + GIB // 2, "python"),
                             FakeProcess(TENANT, 9 * GIB, "python3")]
    nv.cards[1].processes = [FakeProcess(os.getpid(), 29 * GIB, "python")]
    nv.nvmlInit()
    cards = [devices.Card(i, c.uuid, c.pci_bus_id, i, c.name) for i, c in enumerate(nv.cards)]
    alloc = FakeAllocator({0: (120 * GIB, 130 * GIB, 125 * GIB), 1: (20 * GIB, 25 * GIB, 22 * GIB)})
    port = free_port()
    tcfg = SimpleNamespace(port=port, host="127.0.0.1", log_every=0, peer_dir=str(tmp_path / "peers"))
    layout = FakeLayout(["cuda:0", "cuda:1"], [{"parameters": [10 * GIB], "gradients": [10 * GIB],
                                                "optimizer_state": [10 * GIB, 10 * GIB]}, {}])
    memory = Memory(layout, None, rank=0, job_pids=[os.getpid()], nvml=nv, cards=cards, allocator=alloc, caps={})
    tel = TrainingTelemetry(tcfg, run="fake-dp", strategy="dp", rank=0, local_rank=0, world_size=1,
                            info={"workload": "lm"}, device=_Cuda(), nvml=nv, allocator=alloc, cards=cards,
                            memory=memory).start()
    done = threading.Event()

    def train():  # steps keep coming so rates and the step-time histogram move
        idle, measured = 0.0, 0
        while not done.wait(0.1):
            idle, measured = idle + 0.002, measured + 1  # the card idle 2 ms between steps (job.cardgaps)
            tel.observe_step(0.1, 16, 2.5, (idle, measured))

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        yield port, cards
    finally:
        done.set()
        thread.join(5)
        tel.close()


@pytest.mark.prometheus
def test_every_panel_has_data_for_a_fake_dp_node(tmp_path, fake_dp_node):
    prometheus = need_binary("prometheus", "apt-get install prometheus")
    port, cards = fake_dp_node
    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML; 1 s scrapes so rate(...[1m]) has points quickly
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES / "*.yml")],
        "scrape_configs": [{"job_name": "trainjob", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
    }))
    prom = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)

    def api(path: str, **params) -> dict:
        try:
            _code, body = get(f"http://127.0.0.1:{prom_port}{path}?{urllib.parse.urlencode(params, doseq=True)}")
        except OSError as e:
            return {"status": "unreachable", "error": str(e)}
        return json.loads(body)

    def value(expr: str) -> float:
        (row,) = api("/api/v1/query", query=expr)["data"]["result"]
        return float(row["value"][1])

    try:
        deadline = time.monotonic() + 60
        while not api("/api/v1/query", query='run:trainjob_samples:rate1m{run="fake-dp"}').get("data", {}).get("result"):
            assert prom.poll() is None, "prometheus exited"
            assert time.monotonic() < deadline, "no rate for the fake run after 60 s"
            time.sleep(1)
        # the fake node's sources have no memory plan: its panel must evaluate, not return data
        chosen = evaluate_live(api, needs_data=lambda metrics: "ALERTS" not in metrics and not metrics & PLAN,
                               timeout=30)
        assert chosen["trainjob.json"]["run"] == "fake-dp" and chosen["trainjob.json"]["strategy"] == "dp"
        # The pile-up the panels must show: GPU 0 over the rest, and the allocator's max over min.
        d = json.loads((RULES.parent.parent / "grafana" / "dashboards" / "trainjob.json").read_text())
        by_title = {p["title"]: p["targets"][0]["expr"] for p in d["panels"]}
        gpu0 = by_title["GPU 0 versus the rest: used bytes ratio"].replace("$host", ".*")
        assert value(gpu0) == pytest.approx(140 / 30)
        assert value('run:trainjob_torch_memory_peak_allocated:max_over_min{run="fake-dp"}') == pytest.approx(125 / 22)
        assert {r["metric"]["uuid"] for r in api("/api/v1/query", query=by_title["Memory used per card"]
                                                 .replace("$host", ".*"))["data"]["result"]} == {c.uuid for c in cards}
        # Memory by kind: every kind of both cards, joined with NVML's total by uuid, adds up to the card.
        bars = api("/api/v1/query", query=by_title["Memory by kind per card"].replace("$run", "fake-dp")
                   .replace("$strategy", ".*").replace("$host", ".*"))["data"]["result"]
        got = {(r["metric"]["uuid"], r["metric"]["kind"]): float(r["value"][1]) for r in bars}
        assert set(got) == {(c.uuid, k) for c in cards for k in KINDS}
        a, b = cards[0].uuid, cards[1].uuid
        assert got[a, "optimizer_state"] == 20 * GIB and got[b, "optimizer_state"] == 0  # the dp pile-up
        assert got[a, "other_processes"] == 9 * GIB and got[b, "other_processes"] == 0
        assert got[a, "activations"] == 120 * GIB - 40 * GIB  # allocated now minus the tensors
        rest = api("/api/v1/query", query='sum by (uuid) (trainjob_memory_breakdown_bytes{run="fake-dp"}) - on (uuid) '
                                          'max by (uuid) (trainjob_gpu_memory_total_bytes)')["data"]["result"]
        assert {r["metric"]["uuid"]: float(r["value"][1]) for r in rest} == {a: 0.0, b: 0.0}
        (tenant,) = api("/api/v1/query", query=by_title["Other processes on the run's cards"].replace("$run", ".*")
                        .replace("$strategy", ".*").replace("$host", ".*"))["data"]["result"]
        assert tenant["metric"] == {"uuid": a, "pid": str(TENANT), "process": "python3"}
    finally:
        stop(prom)
