"""`python -m job.telemetry [--bench-scrape] [--bench-overhead]`: what a scrape costs, without GPUs.

Fake NVML cards (job.fakes, the one place the product uses them on purpose), one process per rank, the
real merged endpoint over loopback (`bench_scrape`); and a small CPU loop's step time with telemetry off
against on and scraped (`bench_overhead`).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

from job import devices
from job.ports import free_port
from job.telemetry.rank import TrainingTelemetry


class _FakeDevice:
    type = "cuda"

    def __init__(self, index: int):
        self.index = index


def _fake_allocator(stats):
    from job.fakes import FakeAllocator

    return FakeAllocator(stats)


def _bench_cards(n: int):
    """n fake H200s and their cards (the scrape benchmark runs without GPUs)."""
    from job.fakes import FakeNvml

    nv = FakeNvml.h200s(n, used=60 << 30)
    nv.nvmlInit()
    cards = [devices.Card(i, c.uuid, c.pci_bus_id, i, c.name) for i, c in enumerate(nv.cards)]
    return nv, cards


def _bench_memory(local_rank: int, nv, cards, alloc):
    """The memory breakdown of one ddp rank of an lm-sized model: 150 parameters, their gradients and AdamW's two
    moments each on its card, the rank's process and a tenant in NVML's list."""
    import os

    from job.breakdown import Memory
    from job.fakes import FakeLayout, FakeProcess

    nv.cards[local_rank].processes = [FakeProcess(os.getpid(), 61 << 30, "python"),
                                      FakeProcess(2**30 + 2, 20 << 30, "python3")]
    layout = FakeLayout([f"cuda:{local_rank}"], [{"parameters": [1 << 20] * 150, "gradients": [1 << 20] * 150,
                                                  "optimizer_state": [1 << 20] * 300}])
    return Memory(layout, None, rank=local_rank, job_pids=[os.getpid()], nvml=nv, cards=cards, allocator=alloc,
                  caps={})


def _bench_rank(local_rank: int, world: int, n_cards: int, tcfg) -> TrainingTelemetry:
    nv, cards = _bench_cards(n_cards)
    alloc = _fake_allocator({local_rank: (50 << 30, 60 << 30, 55 << 30)})
    tel = TrainingTelemetry(tcfg, run="bench", strategy="ddp", rank=local_rank, local_rank=local_rank,
                            world_size=world, info={"workload": "lm"}, device=_FakeDevice(local_rank),
                            nvml=nv, allocator=alloc, cards=cards, memory=_bench_memory(local_rank, nv, cards, alloc))
    tel.start()
    for i in range(100):
        tel.observe_step(0.1 + i * 1e-3, 16, 3.0)
    return tel


def _loopback_tcfg() -> SimpleNamespace:
    """A telemetry section that serves on a free loopback port, with a fresh registration folder."""
    return SimpleNamespace(port=free_port(), host="127.0.0.1", peer_dir=tempfile.mkdtemp(prefix="trainjob-bench-"))


def _bench_peer(local_rank: int, world: int, n_cards: int, port: int, peer_dir: str) -> None:
    """A peer rank for the benchmark: serve until the parent closes our stdin."""
    tel = _bench_rank(local_rank, world, n_cards, SimpleNamespace(port=port, host="127.0.0.1", peer_dir=peer_dir))
    sys.stdin.read()
    tel.close()


def bench_scrape(*, cards: int = 8, ranks: int = 8, scrapes: int = 200) -> dict[str, float]:
    """Time scrapes of local rank 0's merged endpoint with `ranks` processes and `cards` fake cards."""
    import subprocess
    import urllib.request

    tcfg = _loopback_tcfg()
    port, peer_dir = tcfg.port, tcfg.peer_dir
    code = ("import sys; from job.telemetry.scrapebench import _bench_peer; "
            "_bench_peer(*map(int, sys.argv[1:5]), sys.argv[5])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(ranks), str(cards), str(port), peer_dir],
                              stdin=subprocess.PIPE) for r in range(1, ranks)]
    tel = None
    try:
        tel = _bench_rank(0, ranks, cards, tcfg)
        deadline = time.monotonic() + 60
        while len(tel._merged.peers()) < ranks - 1:
            if time.monotonic() > deadline:
                raise RuntimeError("bench peers did not register within 60 s")
            time.sleep(0.05)
        times, body = [], b""
        for _ in range(scrapes + 5):
            t0 = time.perf_counter()
            with urllib.request.urlopen(tel.url, timeout=10) as r:
                body = r.read()
            times.append(time.perf_counter() - t0)
        times = sorted(times[5:])
        series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
        # observe_step's cost, the only work the training loop itself does for telemetry
        n = 100_000
        t0 = time.perf_counter()
        for _ in range(n):
            tel.observe_step(0.1, 16, 3.0)
        observe_us = (time.perf_counter() - t0) / n * 1e6
        # one memory breakdown of a card (what the step after a scrape, and every logged step, computes)
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            tel._memory.now()
        breakdown_us = (time.perf_counter() - t0) / n * 1e6
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait(timeout=30)
        if tel is not None:
            tel.close()
        shutil.rmtree(peer_dir, ignore_errors=True)
    return {"cards": cards, "ranks": ranks, "scrapes": scrapes, "series": series, "bytes": len(body),
            "p50_ms": 1e3 * times[len(times) // 2], "p95_ms": 1e3 * times[int(len(times) * 0.95)],
            "max_ms": 1e3 * times[-1], "observe_step_us": observe_us, "breakdown_us": breakdown_us}


def bench_overhead(*, blocks: int = 20, steps: int = 150, scrape_every: float = 0.25) -> dict[str, float]:
    """Step time of a small CPU training loop with telemetry off vs on and scraped every `scrape_every` s.

    Blocks alternate (off, on, off, on, ...) so that drifting machine load hits both sides alike; each
    block's mean step time counts, the median over blocks is reported. The
    scrape comes 40x more often than prometheus.yml's 10 s, to lift the effect above the noise.
    One torch thread, so the loop and the server compete for the GIL, not for cores.
    """
    import statistics
    import urllib.request

    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    tcfg = _loopback_tcfg()
    nv, cards = _bench_cards(8)
    tel = TrainingTelemetry(tcfg, run="bench", strategy="dp", rank=0, local_rank=0, world_size=1, info={},
                            device=_FakeDevice(0), nvml=nv, allocator=_fake_allocator({0: (1, 2, 3)}), cards=cards).start()
    stop = threading.Event()

    def scraper():
        while not stop.wait(scrape_every):
            with urllib.request.urlopen(tel.url, timeout=10) as r:
                r.read()

    def block(with_telemetry: bool) -> float:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
            if with_telemetry:
                tel.observe_step(dt, 64, loss.item())
            times.append(time.perf_counter() - t0)
        return statistics.fmean(times)  # the mean: a scrape shows up as a few slower steps

    block(False)  # warm-up
    off, on = [], []
    try:
        for _ in range(blocks):
            off.append(block(False))
            thread = threading.Thread(target=scraper, daemon=True)
            stop.clear()
            thread.start()
            on.append(block(True))
            stop.set()
            thread.join()
    finally:
        tel.close()
        shutil.rmtree(tcfg.peer_dir, ignore_errors=True)
    m_off, m_on = statistics.median(off), statistics.median(on)
    return {"step_ms_off": 1e3 * m_off, "step_ms_on": 1e3 * m_on, "overhead_pct": 100 * (m_on - m_off) / m_off,
            "blocks": blocks, "steps": steps, "scrape_every_s": scrape_every}


def _bench_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m job.telemetry",
                                description="Scrape benchmark: fake NVML cards, one process per rank, loopback.")
    p.add_argument("--bench-scrape", action="store_true", help="time merged scrapes (the default)")
    p.add_argument("--bench-overhead", action="store_true", help="also: a CPU loop's step time, scraped vs not")
    p.add_argument("--cards", type=int, default=8)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--scrapes", type=int, default=200)
    a = p.parse_args(argv)
    r = bench_scrape(cards=a.cards, ranks=a.ranks, scrapes=a.scrapes)
    print("| cards | ranks | scrapes | series | bytes | p50 ms | p95 ms | max ms | observe_step µs | breakdown µs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {r['cards']} | {r['ranks']} | {r['scrapes']} | {r['series']} | {r['bytes']} | {r['p50_ms']:.1f} "
          f"| {r['p95_ms']:.1f} | {r['max_ms']:.1f} | {r['observe_step_us']:.2f} | {r['breakdown_us']:.0f} |")
    if a.bench_overhead:
        o = bench_overhead()
        print()
        every = o["scrape_every_s"]
        print(f"| loop (CPU, 1 thread, {o['blocks']} blocks x {o['steps']} steps each side) | step ms, telemetry off "
              f"| step ms, on + scrape every {every:g} s | overhead | scaled to a 10 s scrape |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| MLP 512-1024-10, bs 64 | {o['step_ms_off']:.3f} | {o['step_ms_on']:.3f} "
              f"| {o['overhead_pct']:+.2f} % | {o['overhead_pct'] * every / 10:+.3f} % |")
    return 0
