"""job.breakdown on its own: every card's memory split into kinds that add up to its total, against fake NVML,
allocators and layouts (what the sources cannot say is said, not hidden), memory.cap_gb, the printed table,
the strategies' tensors per card, and the Prometheus series.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from _breakdown_helpers import built, nbytes
from omegaconf import OmegaConf

from job import breakdown, config, devices
from job.breakdown import KINDS, Memory, Process
from job.config import StrategyCfg
from job.fakes import FakeAllocator, FakeLayout, FakeNvml, FakeProcess, FakeTensor

G = 10**9
ME = os.getpid()
RANK1 = 2**30 + 1  # pids above Linux's pid_max: no such process here, so only the job's list makes them ours
TENANT = 2**30 + 2
TOTAL = 150_754_820_096  # an H200's NVML total (FakeCard's default)


def _node(*, used: list[int], processes: list[list[FakeProcess]]) -> tuple[FakeNvml, list[devices.Card]]:
    nv = FakeNvml.h200s(len(used))
    for card, u, procs in zip(nv.cards, used, processes, strict=True):
        card.used, card.processes = u, procs
    nv.nvmlInit()
    return nv, [devices.Card(i, c.uuid, c.pci_bus_id, i, c.name) for i, c in enumerate(nv.cards)]


def _memory(layout: FakeLayout, nv, cards, stats, *, rank=0, pids=(ME,), caps=None) -> Memory:
    return Memory(layout, None, rank=rank, job_pids=pids, nvml=nv, cards=cards, allocator=FakeAllocator(stats),
                  caps=caps or {})


def _kinds(row: dict) -> dict[str, float | None]:
    return {k: (None if v is None else round(v / G, 3)) for k, v in row["kinds"].items()}


# -- the layouts: what each strategy puts where --------------------------------------------------------

def _dp():
    """One process, two cards; DataParallel keeps the module, the reduced gradients and AdamW's state on card 0,
    and gathers the outputs there; a tenant holds 50 GB of card 0."""
    nv, cards = _node(used=[int(64.9 * G), int(4.8 * G)],
                      processes=[[FakeProcess(ME, int(14.6 * G), "python"), FakeProcess(TENANT, 50 * G, "python3")],
                                 [FakeProcess(ME, int(4.5 * G), "python")]])
    layout = FakeLayout(["cuda:0", "cuda:1"], [
        {"parameters": [G], "gradients": [G], "optimizer_state": [G, G]}, {}])
    # (allocated now, reserved, peak allocated): card 1 only ever holds the replica and its share's activations
    m = _memory(layout, nv, cards, {0: (5 * G, 14 * G, 12 * G), 1: (G // 2, 4 * G, 3 * G)})
    return m.measure(peak=True), [
        dict(parameters=1, gradients=1, optimizer_state=2, activations=8, allocator_cache=2, cuda_context=0.6,
             other_processes=50, unattributed=0.3, free=round((TOTAL - 64.9 * G) / G, 3)),
        dict(parameters=0, gradients=0, optimizer_state=0, activations=3, allocator_cache=1, cuda_context=0.5,
             other_processes=0, unattributed=0.3, free=round((TOTAL - 4.8 * G) / G, 3))]


def _balanced():
    """One process, a replica per card: each card holds its own parameters, gradients and optimizer state."""
    nv, cards = _node(used=[int(9.8 * G), int(9.8 * G)],
                      processes=[[FakeProcess(ME, int(9.5 * G))], [FakeProcess(ME, int(9.5 * G))]])
    replica = {"parameters": [G], "gradients": [G], "optimizer_state": [G, G]}
    m = _memory(FakeLayout(["cuda:0", "cuda:1"], [replica, replica]), nv, cards,
                {0: (5 * G, 9 * G, 8 * G), 1: (5 * G, 9 * G, 7 * G)})
    same = dict(parameters=1, gradients=1, optimizer_state=2, allocator_cache=1, cuda_context=0.5,
                other_processes=0, unattributed=0.3, free=round((TOTAL - 9.8 * G) / G, 3))
    return m.measure(peak=True), [{**same, "activations": 4}, {**same, "activations": 3, "allocator_cache": 2}]


def _ranks(per_rank_tensors, stats, used, processes):
    """Two processes, one card each (ddp, fsdp): each measures its card; rows are gathered in rank order."""
    nv, cards = _node(used=used, processes=processes)
    rows = []
    for rank, tensors in enumerate(per_rank_tensors):
        layout = FakeLayout([f"cuda:{rank}"], [tensors])
        rows += _memory(layout, nv, cards, {rank: stats[rank]}, rank=rank, pids=(ME, RANK1)).measure(peak=True)
    return rows


def _ddp():
    """Every rank holds the whole model; rank 1 also left a CUDA context on card 0 (0.5 GB): the job's, not another
    process's."""
    full = {"parameters": [G], "gradients": [G], "optimizer_state": [G, G]}
    rows = _ranks([full, full], {0: (5 * G, 9 * G, 8 * G), 1: (5 * G, 9 * G, 8 * G)},
                  used=[int(10.3 * G), int(9.8 * G)],
                  processes=[[FakeProcess(ME, int(9.5 * G)), FakeProcess(RANK1, G // 2)],
                             [FakeProcess(RANK1, int(9.5 * G))]])
    same = dict(parameters=1, gradients=1, optimizer_state=2, activations=4, allocator_cache=1, other_processes=0,
                unattributed=0.3)
    return rows, [{**same, "cuda_context": 1.0, "free": round((TOTAL - 10.3 * G) / G, 3)},
                  {**same, "cuda_context": 0.5, "free": round((TOTAL - 9.8 * G) / G, 3)}]


def _fsdp():
    """Each rank holds half of every parameter, its gradient and state; the all-gathered weights of a block exist
    only while it runs: temporaries at the peak."""
    shard = {"parameters": [G // 2], "gradients": [G // 2], "optimizer_state": [G // 2, G // 2]}
    rows = _ranks([shard, shard], {0: (3 * G, 7 * G, 6 * G), 1: (3 * G, 7 * G, 6 * G)},
                  used=[int(7.8 * G), int(7.8 * G)],
                  processes=[[FakeProcess(ME, int(7.5 * G))], [FakeProcess(RANK1, int(7.5 * G))]])
    same = dict(parameters=0.5, gradients=0.5, optimizer_state=1, activations=4, allocator_cache=1, cuda_context=0.5,
                other_processes=0, unattributed=0.3, free=round((TOTAL - 7.8 * G) / G, 3))
    return rows, [same, same]


@pytest.mark.parametrize("layout", [_dp, _balanced, _ddp, _fsdp], ids=["dp", "balanced", "ddp", "fsdp"])
def test_layouts_split_every_card_into_kinds_that_add_up_to_its_total(layout):
    rows, expected = layout()
    one_process = layout in (_dp, _balanced)
    assert [(r["rank"], r["device"]) for r in rows] == ([(0, "cuda:0"), (0, "cuda:1")] if one_process else
                                                        [(0, "cuda:0"), (1, "cuda:1")])
    for row, want in zip(rows, expected, strict=True):
        assert _kinds(row) == pytest.approx(want, abs=1e-3), row
        assert row["total_bytes"] == TOTAL and abs(row["rest_bytes"]) <= 2, row  # int() of the fake GB figures
        assert row["at"] == "peak" and row["notes"] == [] and row["uuid"].startswith("GPU-")


def test_dp_pile_up_and_the_tenant_are_named():
    rows, _ = _dp()
    card0, card1 = rows
    assert card0["kinds"]["optimizer_state"] == 2 * G and card1["kinds"]["optimizer_state"] == 0
    assert card0["other_processes"] == [{"pid": TENANT, "name": "python3", "bytes": 50 * G}]
    assert card1["other_processes"] == []


def test_storages_are_counted_once():
    """Gradients that are views of one bucket count the bucket once; a storage already counted as a parameter is
    not counted again as a gradient; meta tensors hold nothing."""
    bucket = FakeTensor(3 * G)
    views = [FakeTensor(storage=bucket.untyped_storage()) for _ in range(3)]
    p = FakeTensor(G)
    got = breakdown.tensor_bytes({"parameters": [p, FakeTensor(storage=p.untyped_storage())],
                                  "gradients": [*views, FakeTensor(storage=p.untyped_storage())],
                                  "optimizer_state": [torch.empty(10**6, device="meta")]})
    assert got == {"parameters": G, "gradients": 3 * G, "optimizer_state": 0}
    real = torch.zeros(1000)
    assert breakdown.tensor_bytes({"parameters": [real[:10], real[500:]], "gradients": [real]}) == \
        {"parameters": 4000, "gradients": 0, "optimizer_state": 0}


# -- what the sources cannot say -----------------------------------------------------------------------

def _one_card(processes, *, fail=()):
    nv, cards = _node(used=[int(60.3 * G)], processes=[processes])
    nv.cards[0].fail = set(fail)
    layout = FakeLayout(["cuda:0"], [{"parameters": [G]}])
    return _memory(layout, nv, cards, {0: (4 * G, 9 * G, 6 * G)}).measure(peak=True)[0]


def test_a_job_that_nvml_does_not_list_counts_context_and_others_as_unattributed():
    """In a container NVML gives host pids: none is this job's. The context and other processes are unknown."""
    row = _one_card([FakeProcess(12345678, int(9.5 * G)), FakeProcess(TENANT, 50 * G)])
    assert row["kinds"]["cuda_context"] is None and row["kinds"]["other_processes"] is None
    assert row["kinds"]["unattributed"] == int(60.3 * G) - 9 * G
    assert "lists no process of this job" in row["notes"][0] and abs(row["rest_bytes"]) <= 1


def test_nvml_without_a_process_list_or_without_the_card():
    row = _one_card([FakeProcess(ME, int(9.5 * G))], fail={"nvmlDeviceGetComputeRunningProcesses"})
    assert "NVML cannot list the card's processes" in row["notes"][0] and row["kinds"]["cuda_context"] is None
    row = _one_card([], fail={"nvmlDeviceGetMemoryInfo"})
    assert row["kinds"]["free"] is None and row["total_bytes"] is None and row["rest_bytes"] is None
    assert _kinds(row)["parameters"] == 1 and _kinds(row)["activations"] == 5 and _kinds(row)["allocator_cache"] == 3
    assert "NVML cannot read this card" in row["notes"][0]


def test_a_process_whose_memory_nvml_does_not_give():
    row = _one_card([FakeProcess(ME, int(9.5 * G)), FakeProcess(TENANT, None, "python3")])
    assert row["kinds"]["other_processes"] == 0 and _kinds(row)["unattributed"] == 50.8
    assert f"does not give the memory of pid {TENANT}" in row["notes"][0]
    assert row["other_processes"] == [{"pid": TENANT, "name": "python3", "bytes": None}]


def test_tensors_outside_the_allocator_are_said_not_hidden():
    kinds, _, notes = breakdown.split(tensors={"parameters": 3 * G}, allocated=2 * G, reserved=4 * G, used=None,
                                      total=None, free=None, processes=None, ours=lambda pid: True)
    assert kinds["activations"] == 0 and "exceed the allocator's allocated bytes" in notes[0]


def test_processes_of_the_job_include_its_children():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ours = breakdown.ours_by_ancestry({ME})
        assert ours(ME) and ours(child.pid) and not ours(TENANT) and not ours(1)
    finally:
        child.stdin.close()
        child.wait(10)


def test_nvml_process_names_and_the_two_lists():
    nv, _ = _node(used=[0], processes=[[FakeProcess(ME, G, "python"), FakeProcess(TENANT, 2 * G)]])
    got = breakdown.nvml_processes(nv, nv.cards[0])
    assert got == [Process(ME, "python", G), Process(TENANT, None, 2 * G)]  # bytes from NVML become text
    nv.cards[0].fail = {"nvmlDeviceGetComputeRunningProcesses"}
    assert breakdown.nvml_processes(nv, nv.cards[0]) is None


# -- memory.cap_gb -------------------------------------------------------------------------------------

def test_headroom_and_free_against_the_cap():
    """Under memory.cap_gb=[30] the card's free memory (129.7 GB) is not what the job has left: the cap is."""
    assert breakdown.cap_headroom(cap=None, peak_reserved=20 * G, card_headroom=129 * G) == 129 * G
    assert breakdown.cap_headroom(cap=30 * G, peak_reserved=20 * G, card_headroom=129 * G) == 10 * G
    assert breakdown.cap_headroom(cap=30 * G, peak_reserved=20 * G, card_headroom=5 * G) == 5 * G
    assert breakdown.cap_headroom(cap=30 * G, peak_reserved=20 * G, card_headroom=None) == 10 * G
    nv, cards = _node(used=[21 * G], processes=[[FakeProcess(ME, int(20.5 * G))]])
    row = _memory(FakeLayout(["cuda:0"], [{}]), nv, cards, {0: (10 * G, 20 * G, 15 * G)}, caps={0: 30 * G}).now()[0]
    assert row["at"] == "now" and row["cap_bytes"] == 30 * G and row["cap_free_bytes"] == 10 * G
    assert row["kinds"]["activations"] == 10 * G and row["kinds"]["allocator_cache"] == 10 * G  # now, not the peak
    text = breakdown.table([row], title="t")
    assert "cuda:0: memory.cap_gb caps this job at 30.00 GB: 10.00 GB of it is free (the card's free is 129.75 GB)" \
        in text


# -- the printed table ---------------------------------------------------------------------------------

def test_table_one_row_per_card_and_what_adds_up():
    rows, _ = _dp()
    lines = breakdown.table(rows, title="memory by kind").splitlines()
    assert lines[0] == "memory by kind"
    assert lines[1].split() == ["rank", "device", "params", "grads", "optimizer", "activations", "cache", "context",
                                "other", "procs", "unattrib.", "free", "total"]
    assert lines[3].split() == ["0", "cuda:0", "1.00", "1.00", "2.00", "8.00", "2.00", "0.60", "50.00", "0.30",
                                "85.85", "150.75"]
    assert lines[4].split()[:3] == ["0", "cuda:1", "0.00"]
    assert max(len(x) for x in lines[1:5]) <= 120
    assert "cuda:0: the kinds add up to 150.75 GB of the card's 150.75 GB (NVML total; rest +0.00 GB)" in lines
    assert f"cuda:0: other processes: pid {TENANT} python3 50.00 GB" in lines


def test_cpu_rows_say_there_is_no_card():
    model = torch.nn.Linear(100, 10)  # 1010 float32 parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 100)).sum().backward()
    opt.step()
    strategy = SimpleNamespace(devices=[torch.device("cpu")], all_gather_object=lambda o: [o],
                               memory_tensors=lambda o: [{"parameters": list(model.parameters()),
                                                          "gradients": [p.grad for p in model.parameters()],
                                                          "optimizer_state": [opt.state[p]["momentum_buffer"]
                                                                              for p in model.parameters()]}])
    (row,) = Memory(strategy, opt, rank=0).measure(peak=True)
    assert row["device"] == "cpu" and row["uuid"] == "cpu" and row["total_bytes"] is None
    assert {k: v for k, v in row["kinds"].items() if v is not None} == {
        "parameters": 4040, "gradients": 4040, "optimizer_state": 4040}
    text = breakdown.table([row], title="t")
    assert text.splitlines()[1].split() == ["rank", "device", "params", "grads", "optimizer"]
    assert text.splitlines()[-1] == breakdown.NO_CARD


def test_tensor_bytes_are_counted_again_only_when_the_optimizer_state_or_the_gradients_change():
    """Counting every tensor took 3-4 ms of a log step: Memory counts again when the first optimizer step made
    the state, or when gradients appeared or were dropped, and never gives a count that is out of date."""
    model = torch.nn.Linear(100, 10)  # 1010 float32 parameters: 4040 bytes
    opt = torch.optim.AdamW(model.parameters())
    asked = []

    def memory_tensors(o):
        asked.append(1)
        return [{"parameters": list(model.parameters()), "gradients": [p.grad for p in model.parameters()],
                 "optimizer_state": [v for p in model.parameters() for v in o.state.get(p, {}).values()]}]

    strategy = SimpleNamespace(devices=[torch.device("cpu")], all_gather_object=lambda o: [o],
                               memory_tensors=memory_tensors)
    memory = Memory(strategy, opt, rank=0)

    def held():
        (row,) = memory.measure(peak=True)
        return [row["kinds"][k] for k in breakdown.TENSOR_KINDS]

    assert held() == [4040, 0, 0] and len(asked) == 1
    model(torch.randn(4, 100)).sum().backward()
    assert held() == [4040, 4040, 0] and len(asked) == 2  # gradients appeared
    opt.step()  # AdamW's two moments and its step counters (two 4-byte scalars)
    assert held() == [4040, 4040, 8088] and len(asked) == 3
    for _ in range(3):  # the steps of a run: the same tensors' sizes, not counted again
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 100)).sum().backward()
        opt.step()
        assert held() == [4040, 4040, 8088]
    assert len(asked) == 3
    opt.zero_grad(set_to_none=True)
    assert held() == [4040, 0, 8088] and len(asked) == 4  # gradients dropped


TINY_LOSS = config.workload_of(config.load(["workload=tiny"])).workload.loss


def _tiny():
    torch.manual_seed(0)
    model, _ = built("workload=tiny", "workload.width=8", "workload.image_size=16")
    return model, torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))


# -- the strategies say which tensors are which, on each card -------------------------------------------

def test_one_process_strategy_puts_everything_on_its_card():
    from job.strategies.dp import DataParallelStrategy

    model, x, y = _tiny()
    s = DataParallelStrategy(OmegaConf.structured(StrategyCfg(name="dp")), devices=[torch.device("cpu")])
    s.check(micro_batch=8)
    s.setup(model, TINY_LOSS)
    opt = s.build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3))
    s.loss(x, y).backward()
    opt.step()
    (card,) = [breakdown.tensor_bytes(g) for g in s.memory_tensors(opt)]
    params = list(model.parameters())
    assert card["parameters"] == nbytes(params) + nbytes(model.buffers())
    assert card["gradients"] == nbytes(params)
    assert card["optimizer_state"] == 2 * nbytes(params) + 4 * len(params)  # exp_avg, exp_avg_sq, a float32 step


def test_balanced_names_each_replicas_tensors_on_its_card():
    from job.strategies.balanced import BalancedStrategy

    model, x, y = _tiny()
    s = BalancedStrategy(OmegaConf.structured(StrategyCfg(name="balanced", bucket_mb=0.001)),
                         devices=[torch.device("cpu")] * 2)
    s.check(micro_batch=8)
    s.setup(model, TINY_LOSS)
    opt = s.build_optimizer(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    try:
        with s.backward_sync(True):
            s.loss(x, y).backward()
        opt.step()
        per_card = s.memory_tensors(opt)
        seen: set = set()
        cards = [breakdown.tensor_bytes(g, seen) for g in per_card]
    finally:
        s.teardown()
    p = nbytes(model.parameters())
    for k, card in enumerate(cards):
        assert card["parameters"] == p + nbytes(s.replicas[k].buffers()), k
        assert p <= card["gradients"] <= p * 1.01, k  # the reducer's buckets, counted whole
        assert card["optimizer_state"] == p, k  # one momentum buffer per parameter of this replica
    ptrs = [{t.untyped_storage().data_ptr() for t in c["parameters"]} for c in per_card]
    assert not ptrs[0] & ptrs[1]  # card 1's parameters are replica 1's own


# -- the Prometheus series ----------------------------------------------------------------------------

def _registry(memory):
    from prometheus_client import CollectorRegistry

    from job.telemetry.breakdown import BreakdownCollector

    if hasattr(memory, "refresh"):
        memory.refresh()  # as TrainingTelemetry.start does, in the thread that trains
    reg = CollectorRegistry(auto_describe=False)
    reg.register(BreakdownCollector(labels={"rank": "0", "local_rank": "0", "strategy": "dp", "run": "r"},
                                    memory=memory))
    return reg


def test_series_one_per_card_and_kind_in_bytes():
    nv, cards = _node(used=[int(64.9 * G), int(4.8 * G)],
                      processes=[[FakeProcess(ME, int(14.6 * G), "python"), FakeProcess(TENANT, 50 * G, "python3")],
                                 [FakeProcess(ME, int(4.5 * G), "python")]])
    layout = FakeLayout(["cuda:0", "cuda:1"], [{"parameters": [G], "gradients": [G], "optimizer_state": [G, G]}, {}])
    m = _memory(layout, nv, cards, {0: (5 * G, 14 * G, 12 * G), 1: (G // 2, 4 * G, 3 * G)}, caps={1: 30 * G})
    reg = _registry(m)
    labels = {"rank": "0", "local_rank": "0", "strategy": "dp", "run": "r"}

    def value(name, uuid, **extra):
        return reg.get_sample_value(name, {**labels, "uuid": uuid, **extra})

    a, b = cards[0].uuid, cards[1].uuid
    live = {k: value("trainjob_memory_breakdown_bytes", a, kind=k) for k in KINDS}
    assert live["optimizer_state"] == 2 * G and live["activations"] == 1 * G  # now: 5 GB allocated - 4 GB tensors
    assert live["allocator_cache"] == 9 * G and live["other_processes"] == 50 * G
    assert sum(live.values()) == pytest.approx(TOTAL, abs=2)
    assert value("trainjob_memory_breakdown_bytes", b, kind="parameters") == 0
    assert value("trainjob_memory_other_process_bytes", a, pid=str(TENANT), process="python3") == 50 * G
    assert value("trainjob_memory_cap_bytes", b) == 30 * G and value("trainjob_memory_cap_bytes", a) is None
    # NVML gone: the kinds it gives are left out, not reported as 0
    nv.cards[0].fail = {"nvmlDeviceGetMemoryInfo"}
    reg = _registry(_memory(layout, nv, cards, {0: (5 * G, 14 * G, 12 * G), 1: (G // 2, 4 * G, 3 * G)}))
    assert value("trainjob_memory_breakdown_bytes", a, kind="free") is None
    assert value("trainjob_memory_breakdown_bytes", a, kind="parameters") == G


def test_a_failing_source_drops_the_series_not_the_scrape():
    from prometheus_client import generate_latest

    class Broken:
        def live(self):
            raise RuntimeError("dictionary changed size during iteration")

    assert b"trainjob_memory_breakdown_bytes" not in generate_latest(_registry(Broken()))


def test_a_scrape_serves_what_the_training_thread_measured_after_it_asked():
    """live() (the scrape's thread) never reads a tensor: it returns the rows of the last refresh() (the thread
    that trains, between steps), which measures only when a scrape asked since, and keeps the last rows when a
    measurement fails."""
    nv, cards = _node(used=[int(6 * G)], processes=[[FakeProcess(ME, int(5.5 * G))]])
    layout = FakeLayout(["cuda:0"], [{"parameters": [G], "gradients": [], "optimizer_state": []}])
    m = _memory(layout, nv, cards, {0: (2 * G, 4 * G, 3 * G)})
    assert m.live() == []  # nothing measured yet
    m.refresh()
    first = m.live()
    assert first[0]["kinds"]["gradients"] == 0
    layout.tensors[0]["gradients"] = [FakeTensor(G, device="cuda:0")]  # backward made gradients
    m.refresh()  # the scrape above asked: measured again, in this thread
    assert m.live()[0]["kinds"]["gradients"] == G
    calls = []
    m.measure = lambda peak: calls.append(peak) or first
    m.refresh()  # the scrape above asked once
    m.refresh()  # and no scrape since: nothing measured
    assert calls == [False]
    m.live()

    def broken(peak):
        raise RuntimeError("a source failed")

    m.measure = broken
    m.refresh()  # a failure keeps the last rows, never raises into the loop
    assert m.live() is first


def test_per_card_table_says_its_headroom_is_against_the_cap():
    from job import report

    row = {"rank": 0, "device": "cuda:0", "name": "NVIDIA H200", "uuid": "GPU-00000000-aaaa", "pci_bus_id": "",
           "allocated_bytes": 0, "peak_allocated_bytes": 8 * G, "peak_reserved_bytes": 10 * G,
           "nvml_used_bytes": 61 * G, "nvml_total_bytes": TOTAL, "planned_samples": 8, "predicted_peak_bytes": None,
           "headroom_bytes": breakdown.cap_headroom(cap=30 * G, peak_reserved=10 * G, card_headroom=129 * G),
           "cap_bytes": 30 * G}
    lines = report.table([row], throughput=1.0, unit="tok", title="t").splitlines()
    assert f"{20 * G / 2**20:,.0f} (cap)" in lines[3]  # MB = MiB in this table
    assert "(cap): headroom within memory.cap_gb (cuda:0 30 GB), not the card's free memory" in lines
    uncapped = report.table([{**row, "headroom_bytes": 129 * G, "cap_bytes": None}], throughput=1.0, unit="tok",
                            title="t")
    assert "(cap)" not in uncapped and f"{129 * G / 2**20:,.0f}" in uncapped
