"""Telemetry on real GPUs: the card identity of every series, the standalone exporter's cards, two cards in
one scrape (marked, skipped without the cards).
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from _telemetry_helpers import free_port, has_samples, named, samples, stop, wait_for
from conftest import ROOT, job_cmd, need_binary, requires_gpus

from job import devices

# -- GPU ----------------------------------------------------------------------------------------


@requires_gpus(2)
@pytest.mark.gpu
@pytest.mark.parametrize("form", ["index", "uuid"])
def test_gpu_rank0_series_carry_card1_identity(tmp_path, form):
    """Under CUDA_VISIBLE_DEVICES=1 (or its UUID), rank 0's series carry card 1's UUID and PCI bus id."""
    import pynvml

    pynvml.nvmlInit()
    card1 = sorted(devices.nvml_inventory(pynvml), key=lambda c: devices.pci_key(c.pci_bus_id))[1]
    port = free_port()
    cmd = job_cmd("train", "workload=tiny", "train.device=cuda", "strategy=ddp", f"train.run_dir={tmp_path}",
                  "train.run_id=gpu", "train.steps=100000", f"telemetry.port={port}")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1" if form == "index" else card1.uuid}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text = wait_for(f"http://127.0.0.1:{port}/metrics", has_samples({"0"}), proc, timeout=180)
        (alloc,) = named(text, "trainjob_torch_memory_allocated_bytes")
        assert alloc["rank"] == "0" and alloc["uuid"] == card1.uuid
        (used,) = named(text, "trainjob_gpu_memory_used_bytes")
        assert (used["uuid"], used["pci_bus_id"], used["gpu"]) == (card1.uuid, card1.pci_bus_id, str(card1.nvml_index))
        print(f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}: rank 0 -> {card1.uuid} {card1.pci_bus_id}")
    finally:
        stop(proc)


@requires_gpus(1)
@pytest.mark.gpu
def test_gpu_exporter_reports_every_card_by_uuid():
    import pynvml

    pynvml.nvmlInit()
    inventory = devices.nvml_inventory(pynvml)
    port = free_port()
    proc = subprocess.Popen(job_cmd("export", "--port", str(port)), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        text = wait_for(f"http://127.0.0.1:{port}/metrics", lambda t: "trainjob_gpu_memory_used_bytes" in t, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert samples(text)[("trainjob_nvml_up", frozenset())] == 1
    got = {(d["uuid"], d["pci_bus_id"], d["gpu"]) for d in named(text, "trainjob_gpu_memory_total_bytes")}
    assert got >= {(c.uuid, c.pci_bus_id, str(c.nvml_index)) for c in inventory}
    check = subprocess.run([need_binary("promtool", "apt-get install prometheus"), "check", "metrics"], input=text,
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


@requires_gpus(2)
@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["dp", "ddp"])
def test_gpu_two_cards_one_scrape(tmp_path, strategy):
    """dp: one rank, an allocator series on each card; ddp: two ranks, each on its own card; one scrape."""
    import pynvml

    pynvml.nvmlInit()
    cards = sorted(devices.nvml_inventory(pynvml), key=lambda c: devices.pci_key(c.pci_bus_id))[:2]
    port = free_port()
    cmd = job_cmd("train", "workload=tiny", "train.device=cuda", f"strategy={strategy}", f"train.run_dir={tmp_path}",
                  "train.run_id=two", "train.steps=100000", f"telemetry.port={port}")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ranks = {"0"} if strategy == "dp" else {"0", "1"}
    try:
        text = wait_for(f"http://127.0.0.1:{port}/metrics", has_samples(ranks), proc, timeout=240)
    finally:
        stop(proc)
    alloc = {(d["rank"], d["uuid"]) for d in named(text, "trainjob_torch_memory_peak_allocated_bytes")}
    want = {("0", cards[0].uuid), ("0" if strategy == "dp" else "1", cards[1].uuid)}
    assert alloc == want
    assert {d["uuid"] for d in named(text, "trainjob_gpu_memory_used_bytes")} == {c.uuid for c in cards}
