"""job.telemetry without a GPU: every collector against fake NVML and allocators, the trainer's server (peers,
stall health, port 0, promtool on a fake GPU node), the standalone exporter, and the hardened HTTP server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from _telemetry_helpers import free_port, get, named, samples, wait_for
from conftest import ROOT, job_cmd, need_binary
from prometheus_client import CollectorRegistry, generate_latest

from job import devices, fakes, telemetry
from job.errors import UsageError
from job.fakes import FakeAllocator, FakeNvml
from job.telemetry import (
    AllocatorCollector,
    NvmlCollector,
    TrainingCollector,
    TrainingTelemetry,
)


def _registry(*collectors) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    for c in collectors:
        reg.register(c)
    return reg


@pytest.fixture
def nv() -> FakeNvml:
    nv = FakeNvml.h200s(2)
    nv.cards[0].used, nv.cards[1].used = 14_139 << 20, 3_027 << 20
    nv.cards[0].util_percent, nv.cards[1].util_percent = 97, 40
    nv.nvmlInit()
    return nv


def _card_labels(nv: FakeNvml, i: int, host: str = "h") -> dict[str, str]:
    c = nv.cards[i]
    return {"uuid": c.uuid, "pci_bus_id": c.pci_bus_id, "gpu": str(i), "name": c.name, "host": host}


# -- collectors ---------------------------------------------------------------------------------


def test_nvml_collector_reads_every_card_at_scrape_time(nv):
    reg = _registry(NvmlCollector(nvml=nv, host="h"))
    for i, card in enumerate(nv.cards):
        lab = _card_labels(nv, i)
        assert reg.get_sample_value("trainjob_gpu_memory_used_bytes", lab) == card.used
        assert reg.get_sample_value("trainjob_gpu_memory_total_bytes", lab) == card.total
        assert reg.get_sample_value("trainjob_gpu_memory_free_bytes", lab) == card.total - card.used
        assert reg.get_sample_value("trainjob_gpu_utilization_ratio", lab) == card.util_percent / 100
    assert reg.get_sample_value("trainjob_nvml_up") == 1
    nv.cards[1].used = 5 << 30  # read at scrape time, not cached
    assert reg.get_sample_value("trainjob_gpu_memory_used_bytes", _card_labels(nv, 1)) == 5 << 30


def test_nvml_collector_filters_cards_and_reports_mig(nv):
    mig = fakes.FakeCard("MIG-11111111-2222-3333-4444-555555555555", nv.cards[1].pci_bus_id,
                           name="NVIDIA H200 MIG 1g.18gb", total=18 << 30, used=1 << 30)
    nv.cards[1].migs = [mig]
    reg = _registry(NvmlCollector(nvml=nv, uuids={nv.cards[0].uuid, mig.uuid}, host="h"))
    text = generate_latest(reg).decode()
    assert {d["uuid"] for d in named(text, "trainjob_gpu_memory_used_bytes")} == {nv.cards[0].uuid, mig.uuid}
    mig_labels = {**_card_labels(nv, 1), "uuid": mig.uuid, "name": mig.name}
    assert reg.get_sample_value("trainjob_gpu_memory_total_bytes", mig_labels) == 18 << 30
    assert [d["uuid"] for d in named(text, "trainjob_gpu_utilization_ratio")] == [nv.cards[0].uuid]


def test_failing_card_drops_its_series_not_the_scrape(nv, caplog):
    nv.cards[0].fail.add("nvmlDeviceGetMemoryInfo")
    reg = _registry(NvmlCollector(nvml=nv, host="h"))
    for _ in range(3):
        assert reg.get_sample_value("trainjob_gpu_memory_used_bytes", _card_labels(nv, 0)) is None
        assert reg.get_sample_value("trainjob_gpu_utilization_ratio", _card_labels(nv, 0)) == 0.97
        assert reg.get_sample_value("trainjob_gpu_memory_used_bytes", _card_labels(nv, 1)) == nv.cards[1].used
        assert reg.get_sample_value("trainjob_nvml_up") == 1
    assert caplog.text.count("memory info failed") == 1  # warned once, not on every scrape
    nv.cards[0].fail.clear()  # recovers by itself
    assert reg.get_sample_value("trainjob_gpu_memory_used_bytes", _card_labels(nv, 0)) == nv.cards[0].used
    nv.cards[1].fail.add("nvmlDeviceGetHandleByIndex")  # a card that cannot be identified at all
    fresh = _registry(NvmlCollector(nvml=nv, host="h"))
    assert named(generate_latest(fresh).decode(), "trainjob_gpu_memory_used_bytes") == [_card_labels(nv, 0)]


def test_nvml_missing_gives_nvml_up_0():
    uninitialised = FakeNvml.h200s(2)  # every call raises, like NVML after a driver crash
    reg = _registry(NvmlCollector(nvml=uninitialised, host="h"))
    assert reg.get_sample_value("trainjob_nvml_up") == 0
    assert named(generate_latest(reg).decode(), "trainjob_gpu_memory_used_bytes") == []
    if devices.default_nvml() is None:  # the real pynvml on a machine without a driver
        real = _registry(NvmlCollector(host="h"))
        assert real.get_sample_value("trainjob_nvml_up") == 0


def test_allocator_collector_own_card_and_dataparallel_cards(nv):
    cards = [devices.Card(i, c.uuid, c.pci_bus_id, i, c.name) for i, c in enumerate(nv.cards)]
    lab = {"rank": "1", "local_rank": "1", "strategy": "ddp", "run": "r"}
    alloc = FakeAllocator({1: (100, 200, 150)})
    reg = _registry(AllocatorCollector(labels=lab, device=SimpleNamespace(type="cuda", index=1), cards=cards,
                                       source=alloc))
    row = {**lab, "uuid": nv.cards[1].uuid}
    assert reg.get_sample_value("trainjob_torch_memory_allocated_bytes", row) == 100
    assert reg.get_sample_value("trainjob_torch_memory_reserved_bytes", row) == 200
    assert reg.get_sample_value("trainjob_torch_memory_peak_allocated_bytes", row) == 150
    # card 0 belongs to another rank: this process holds nothing there, so no series for it
    assert reg.get_sample_value("trainjob_torch_memory_reserved_bytes", {**lab, "uuid": nv.cards[0].uuid}) is None
    # DataParallel: one process, memory on both cards: one series per card
    dp_lab = {**lab, "rank": "0", "local_rank": "0", "strategy": "dp"}
    dp = _registry(AllocatorCollector(labels=dp_lab, device=SimpleNamespace(type="cuda", index=0), cards=cards,
                                      source=FakeAllocator({0: (14, 15, 16), 1: (3, 4, 5)})))
    assert dp.get_sample_value("trainjob_torch_memory_peak_allocated_bytes", {**dp_lab, "uuid": nv.cards[0].uuid}) == 16
    assert dp.get_sample_value("trainjob_torch_memory_peak_allocated_bytes", {**dp_lab, "uuid": nv.cards[1].uuid}) == 5
    # on CPU: no allocator series at all
    cpu = _registry(AllocatorCollector(labels=lab, device=None, cards=[], source=alloc))
    assert generate_latest(cpu) == b""


def test_torch_allocator_reads_zero_without_initialising_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert telemetry.TorchAllocator().read(0) == (0, 0, 0)
    assert not torch.cuda.is_initialized()


def test_training_collector_histogram_counter_loss_info():
    lab = {"rank": "0", "local_rank": "0", "uuid": "GPU-x", "strategy": "ddp", "run": "r"}
    col = TrainingCollector(labels=lab, info={"workload": "lm", "run": "r"})
    reg = _registry(col)
    assert reg.get_sample_value("trainjob_loss", lab) is None  # no loss before the first step
    for seconds in (0.004, 0.02, 0.02, 0.3, 120.0):
        col.observe(seconds, 16, 2.5)
    assert reg.get_sample_value("trainjob_step_seconds_count", lab) == 5
    assert reg.get_sample_value("trainjob_step_seconds_sum", lab) == pytest.approx(120.344)
    assert reg.get_sample_value("trainjob_step_seconds_bucket", {**lab, "le": "0.005"}) == 1
    assert reg.get_sample_value("trainjob_step_seconds_bucket", {**lab, "le": "0.025"}) == 3
    assert reg.get_sample_value("trainjob_step_seconds_bucket", {**lab, "le": "60.0"}) == 4
    assert reg.get_sample_value("trainjob_step_seconds_bucket", {**lab, "le": "+Inf"}) == 5
    assert reg.get_sample_value("trainjob_samples_total", lab) == 80
    assert reg.get_sample_value("trainjob_loss", lab) == 2.5
    assert reg.get_sample_value("trainjob_info", {"workload": "lm", "run": "r"}) == 1
    # no card (a CPU run): no idle series; on a GPU the trainer's running figures (job.cardgaps), as counters
    assert reg.get_sample_value("trainjob_card_idle_seconds_total", lab) is None
    col.observe(0.02, 16, 2.4, (0.25, 9))
    col.observe(0.02, 16, 2.3, (0.26, 10))
    assert reg.get_sample_value("trainjob_card_idle_seconds_total", lab) == pytest.approx(0.26)
    assert reg.get_sample_value("trainjob_card_idle_steps_total", lab) == 10


def test_observe_step_is_thread_safe_against_scrapes():
    lab = {"rank": "0", "local_rank": "0", "uuid": "", "strategy": "dp", "run": "r"}
    col = TrainingCollector(labels=lab, info={})
    reg = _registry(col)
    done = threading.Event()

    def loop():
        for _ in range(20000):
            col.observe(0.01, 2, 1.0)
        done.set()

    threading.Thread(target=loop).start()
    while not done.is_set():  # every scrape is a consistent snapshot: samples = 2 x steps
        s = samples(generate_latest(reg).decode())
        count = s[("trainjob_step_seconds_count", frozenset(lab.items()))]
        assert s[("trainjob_samples_total", frozenset(lab.items()))] == 2 * count
    assert reg.get_sample_value("trainjob_step_seconds_count", lab) == 20000


# -- the trainer's server -----------------------------------------------------------------------


def _tcfg(port: int, peer_dir: Path) -> SimpleNamespace:
    return SimpleNamespace(port=port, host="127.0.0.1", log_every=0, peer_dir=str(peer_dir))


def _rank(nv, local_rank: int, tcfg, run="r") -> TrainingTelemetry:
    cards = [devices.Card(i, c.uuid, c.pci_bus_id, i, c.name) for i, c in enumerate(nv.cards)]
    return TrainingTelemetry(tcfg, run=run, strategy="ddp", rank=local_rank, local_rank=local_rank, world_size=2,
                             info={"workload": "lm", "batch-size": "16"}, device=SimpleNamespace(type="cuda", index=local_rank),
                             nvml=nv, allocator=FakeAllocator({local_rank: (10 + local_rank, 20, 30)}), cards=cards)


def test_one_scrape_shows_every_local_rank(nv, tmp_path):
    port = free_port()
    tcfg = _tcfg(port, tmp_path)
    r0, r1 = _rank(nv, 0, tcfg).start(), _rank(nv, 1, tcfg).start()
    try:
        assert r1.url.startswith("http://127.0.0.1:") and not r1.url.endswith(f":{port}/metrics")
        r0.observe_step(0.1, 8, 2.0)
        r1.observe_step(0.2, 8, 2.0)
        code, text = get(f"http://127.0.0.1:{port}/metrics")
        assert code == 200
        s = samples(text)  # asserts no duplicate series: card 1 is reported by both ranks, kept once
        ranks = {d["rank"]: d["uuid"] for d in named(text, "trainjob_torch_memory_allocated_bytes")}
        assert ranks == {"0": nv.cards[0].uuid, "1": nv.cards[1].uuid}
        assert {d["rank"] for d in named(text, "trainjob_samples_total")} == {"0", "1"}
        assert len(named(text, "trainjob_gpu_memory_used_bytes")) == 2
        assert s[("trainjob_telemetry_peer_up", frozenset({"local_rank": "1"}.items()))] == 1
        (info0, info1) = sorted(named(text, "trainjob_info"), key=lambda d: d["rank"])
        assert info0["batch_size"] == "16" and info0["world_size"] == "2" and info1["rank"] == "1"
        code, health = get(f"http://127.0.0.1:{port}/health")
        assert code == 200 and json.loads(health) | {"steps": 1, "peers": 1} == json.loads(health)
        assert get(f"http://127.0.0.1:{port}/nope")[0] == 404
    finally:
        r1.close()
    # a rank that left: its registration is gone, and so are its series
    text = get(f"http://127.0.0.1:{port}/metrics")[1]
    assert {d["rank"] for d in named(text, "trainjob_samples_total")} == {"0"}
    assert named(text, "trainjob_telemetry_peer_up") == []
    r0.close()
    with pytest.raises(OSError):
        get(f"http://127.0.0.1:{port}/metrics", timeout=1)


def test_dead_or_silent_peer_costs_its_series_not_the_scrape(nv, tmp_path):
    port = free_port()
    r0 = _rank(nv, 0, _tcfg(port, tmp_path)).start()
    tmp_path = telemetry.peer_dir_for(_tcfg(port, tmp_path), "r")  # the job's registration folder
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        (tmp_path / "local_rank-3.json").write_text(json.dumps(
            {"url": "http://127.0.0.1:9/metrics", "pid": int(dead.stdout), "run": "r", "local_rank": 3}))
        silent = free_port()  # registered, alive (our pid), but nobody listens there
        (tmp_path / "local_rank-2.json").write_text(json.dumps(
            {"url": f"http://127.0.0.1:{silent}/metrics", "pid": os.getpid(), "run": "r", "local_rank": 2}))
        (tmp_path / "local_rank-5.json").write_text(json.dumps(  # another run's leftover
            {"url": f"http://127.0.0.1:{silent}/metrics", "pid": os.getpid(), "run": "old", "local_rank": 5}))
        (tmp_path / "local_rank-6.json").write_text(json.dumps(  # not loopback: never fetched
            {"url": "http://example.invalid/metrics", "pid": os.getpid(), "run": "r", "local_rank": 6}))
        (tmp_path / "local_rank-7.json").write_text("{not json")
        code, text = get(f"http://127.0.0.1:{port}/metrics")
        assert code == 200
        assert named(text, "trainjob_telemetry_peer_up") == [{"local_rank": "2"}]
        assert samples(text)[("trainjob_telemetry_peer_up", frozenset({"local_rank": "2"}.items()))] == 0
        assert not (tmp_path / "local_rank-3.json").exists()  # dead pid: registration removed
        assert {d["rank"] for d in named(text, "trainjob_samples_total")} == {"0"}
    finally:
        r0.close()


def test_port_in_use_is_an_oserror_for_the_trainer(nv, tmp_path):
    port = free_port()
    r0 = _rank(nv, 0, _tcfg(port, tmp_path)).start()
    try:
        with pytest.raises(OSError):
            _rank(nv, 0, _tcfg(port, tmp_path)).start()
    finally:
        r0.close()


def test_health_turns_503_when_no_step_completes_for_stall_s(nv, tmp_path):
    """/health is the trainer pods' liveness probe: ok while steps complete, 503 "stalled" once none has
    for telemetry.stall_s seconds (counted from the start: a first step that never ends is a stall too)."""
    port = free_port()
    tcfg = SimpleNamespace(**vars(_tcfg(port, tmp_path)), stall_s=1)
    r0 = _rank(nv, 0, tcfg).start()
    try:
        url = f"http://127.0.0.1:{port}/health"
        code, body = get(url)
        assert code == 200 and json.loads(body)["status"] == "ok" and json.loads(body)["steps"] == 0
        time.sleep(1.3)  # no step for longer than stall_s
        code, body = get(url)
        h = json.loads(body)
        assert code == 503 and h["status"] == "stalled" and h["stall_s"] == 1 and h["seconds_since_step"] > 1, h
        assert get(f"http://127.0.0.1:{port}/metrics")[0] == 200  # metrics keep answering
        r0.observe_step(0.1, 8, 2.0)  # progress again: healthy again
        code, body = get(url)
        assert code == 200 and json.loads(body) | {"status": "ok", "steps": 1} == json.loads(body)
    finally:
        r0.close()
    # stall_s=0: never stalled
    tcfg0 = SimpleNamespace(**vars(_tcfg(port, tmp_path)), stall_s=0)
    r0 = _rank(nv, 0, tcfg0).start()
    try:
        r0._last_progress -= 10_000
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        r0.close()


@pytest.mark.parametrize("value", ["-1", "x"])
def test_stall_s_must_be_a_non_negative_number(value):
    out = subprocess.run(job_cmd("train", f"telemetry.stall_s={value}"), cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "telemetry.stall_s" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_port_0_serves_nothing_but_still_counts(nv, tmp_path):
    r = _rank(nv, 0, _tcfg(0, tmp_path)).start()
    r.observe_step(0.1, 4, 1.0)
    assert r.url is None and r.registry.get_sample_value("trainjob_samples_total", r.training.labels) == 4
    r.close()


def test_promtool_check_metrics_on_fake_gpu_node(nv, tmp_path):
    promtool = need_binary("promtool", "apt-get install prometheus")
    port = free_port()
    tcfg = _tcfg(port, tmp_path)
    r0, r1 = _rank(nv, 0, tcfg).start(), _rank(nv, 1, tcfg).start()
    try:
        r0.observe_step(0.1, 8, 2.0, (0.004, 1))  # a GPU rank: its card's idle time between steps too
        text = get(f"http://127.0.0.1:{port}/metrics")[1]
        assert "trainjob_card_idle_seconds_total{" in text and "trainjob_card_idle_steps_total{" in text
    finally:
        r1.close()
        r0.close()
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stdout + p.stderr


# -- the standalone exporter --------------------------------------------------------------------


def test_export_main_serves_fake_cards_and_stops(nv):
    port = free_port()
    ready, stop_ev = threading.Event(), threading.Event()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "rc", telemetry.export_main(["--port", str(port)], nvml=nv, ready=ready, stop=stop_ev)))
    t.start()
    try:
        assert ready.wait(30)
        text = get(f"http://127.0.0.1:{port}/metrics")[1]
        assert len(named(text, "trainjob_gpu_memory_used_bytes")) == 2
        assert samples(text)[("trainjob_nvml_up", frozenset())] == 1
        assert json.loads(get(f"http://127.0.0.1:{port}/health")[1])["status"] == "ok"
    finally:
        stop_ev.set()
        t.join(30)
    assert result == {"rc": 0}


def test_export_command_without_driver_and_sigterm(tmp_path):
    port = free_port()
    proc = subprocess.Popen(job_cmd("export", "--port", str(port), "--host", "127.0.0.1"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text = wait_for(f"http://127.0.0.1:{port}/metrics", lambda t: "trainjob_nvml_up" in t, proc, timeout=60)
        if devices.default_nvml() is None:
            assert samples(text)[("trainjob_nvml_up", frozenset())] == 0
            assert "trainjob_gpu_memory_used_bytes" not in text
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0, proc.stdout.read()


@pytest.mark.parametrize("args, needle", [
    (["--port"], "--port needs a value"), (["--port", "http"], "--port http is not a TCP port"),
    (["--port=70000"], "--port 70000 is not a TCP port"), (["--verbose"], "unexpected argument `--verbose`"),
])
def test_export_bad_args_exit_2(args, needle):
    p = subprocess.run(job_cmd("export", *args), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"error: {p.stderr.strip()[7:]}"] and needle in p.stderr


def test_export_port_in_use_exit_2():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run(job_cmd("export", "--port", str(port)), cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
    assert p.returncode == 2 and f"cannot serve on 127.0.0.1:{port}" in p.stderr


def test_bench_scrape_runs():
    r = telemetry.bench_scrape(cards=2, ranks=2, scrapes=5)
    assert r["ranks"] == 2 and r["series"] > 20 and r["p50_ms"] > 0 and r["breakdown_us"] > 0
    o = telemetry.bench_overhead(blocks=2, steps=5, scrape_every=0.01)
    assert o["step_ms_off"] > 0 and o["step_ms_on"] > 0


def test_peer_folder_is_private_and_registrations_are_not_followed(nv, tmp_path):
    """Another user on the node must not be able to plant a registration: the job's folder is made 0700 and
    checked; a folder that is a symlink or open to others is refused; a registration that is a symlink is
    not read."""
    port = free_port()
    folder = telemetry.peer_dir_for(_tcfg(port, tmp_path), "r")
    r0 = _rank(nv, 0, _tcfg(port, tmp_path)).start()
    try:
        assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700
        elsewhere = tmp_path / "planted.json"
        elsewhere.write_text(json.dumps({"url": f"http://127.0.0.1:{free_port()}/metrics", "pid": os.getpid(),
                                         "run": "r", "local_rank": 4}))
        (folder / "local_rank-4.json").symlink_to(elsewhere)
        assert named(get(f"http://127.0.0.1:{port}/metrics")[1], "trainjob_telemetry_peer_up") == []
    finally:
        r0.close()
    for bad, needle in [("symlink", "is a symlink or not a folder"), ("open", r"is open to other users \(mode 777")]:
        port = free_port()
        folder = telemetry.peer_dir_for(_tcfg(port, tmp_path), "r")
        if bad == "symlink":
            (tmp_path / "real").mkdir(mode=0o700, exist_ok=True)
            folder.symlink_to(tmp_path / "real")
        else:
            folder.mkdir()
            folder.chmod(0o777)
        with pytest.raises(UsageError, match=needle):
            _rank(nv, 0, _tcfg(port, tmp_path)).start()


def test_a_failing_request_is_a_generic_500(nv, tmp_path):
    port = free_port()
    r0 = _rank(nv, 0, _tcfg(port, tmp_path)).start()
    try:
        r0._merged.collect = lambda: (_ for _ in ()).throw(RuntimeError("secret detail"))
        code, body = get(f"http://127.0.0.1:{port}/metrics")
        assert code == 500 and "secret" not in body and "internal error" in body
    finally:
        r0.close()



def test_an_idle_client_is_dropped(nv, tmp_path, monkeypatch):
    """A client that connects and says nothing no longer holds a server thread forever."""
    import socket

    monkeypatch.setattr("job.telemetry.server.HTTP_TIMEOUT_S", 1.0)
    port = free_port()
    r0 = _rank(nv, 0, _tcfg(port, tmp_path)).start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            t0 = time.monotonic()
            assert idle.recv(1) == b""  # the server closed it
            assert time.monotonic() - t0 < 5
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        r0.close()


def test_a_trickling_client_is_cut_at_the_request_deadline(nv, tmp_path, monkeypatch):
    """A client that sends a header line every 0.3 s (each read well within the per-read timeout) is cut at
    the whole request's deadline; connections past MAX_CONNECTIONS are closed at once."""
    import socket

    monkeypatch.setattr("job.telemetry.server.HTTP_TIMEOUT_S", 1.0)
    monkeypatch.setattr("job.telemetry.server.REQUEST_DEADLINE_S", 1.5)
    monkeypatch.setattr("job.telemetry.server.MAX_CONNECTIONS", 2)
    port = free_port()
    r0 = _rank(nv, 0, _tcfg(port, tmp_path)).start()
    try:
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        time.sleep(0.3)  # both accepted and being served
        with socket.create_connection(("127.0.0.1", port), timeout=10) as third:
            assert third.recv(1) == b""  # over the cap: closed at once
        t0, cut = time.monotonic(), None
        held[0].sendall(b"GET /metrics HTTP/1.1\r\n")
        while time.monotonic() - t0 < 6:
            try:
                held[0].sendall(b"X-Slow: 1\r\n")
            except OSError:
                cut = time.monotonic() - t0
                break
            time.sleep(0.3)
        assert cut is not None and cut < 3.5, cut
        for s in held:
            s.close()
        time.sleep(0.5)
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200  # the slots are free again
    finally:
        r0.close()
