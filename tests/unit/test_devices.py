"""Device identity: CUDA_VISIBLE_DEVICES validation and torch device <-> NVML card mapping.

There is no GPU or NVML driver on CI machines, so NVML and torch.cuda are the pynvml-shaped
`FakeNvml` and `FakeCuda` from job/fakes.py; `test_fake_nvml_matches_pynvml` pins the fake's
methods to the real pynvml's signatures, and the no-driver tests use the real pynvml.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys

import pynvml
import pytest
from conftest import ROOT, requires_gpus
from hypothesis import given
from hypothesis import strategies as st

from job import devices
from job.errors import UsageError
from job.fakes import FakeCard, FakeCuda, FakeNvml


def _nvml(cards: list[FakeCard]) -> FakeNvml:
    nv = FakeNvml(cards)
    nv.nvmlInit()
    return nv


A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"
C = "GPU-abcdef01-0000-0000-0000-000000000003"
MIG = "MIG-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def scrambled() -> FakeNvml:
    """NVML index order differs from PCI order: NVML 0 is bus 0x3B, NVML 1 is 0x18, NVML 2 is 0x5D."""
    return _nvml([FakeCard(A, "00000000:3B:00.0"), FakeCard(B, "00000000:18:00.0"),
                  FakeCard(C, "00000000:5D:00.0", migs=[FakeCard(MIG, "00000000:5D:00.0", name="MIG 1g.18gb")])])


# -- syntax (what can be checked without a driver) ----------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("0", ["0"]), ("1,0", ["1", "0"]), (" 2 , 3 ", ["2", "3"]), ("", []), ("-1", []), ("NoDevFiles", []),
    (A, [A]), ("GPU-aaaa", ["GPU-aaaa"]), (f"{MIG},0", [MIG, "0"]),
    ("MIG-GPU-aaaaaaaa-0000-0000-0000-000000000001/1/0", ["MIG-GPU-aaaaaaaa-0000-0000-0000-000000000001/1/0"]),
])
def test_parse_visible_accepts(value, expected):
    assert devices.parse_visible(value) == expected


@pytest.mark.parametrize("value, needle", [
    ("0,,1", "empty entry"), ("0,", "empty entry"), ("gpu0", "`gpu0` is not a card index"),
    ("GPU-", "`GPU-` is not"), ("GPU-xyz", "`GPU-xyz` is not"), ("1.5", "`1.5` is not"), ("-2", "`-2` is not"),
    ("0,1,0", "twice (`0` and `0`)"), ("1,01", "twice (`1` and `01`)"), (f"{A},GPU-{A[4:].upper()}", "twice"), ("gpu-aaaa", "is not a card index"),
])
def test_parse_visible_rejects(value, needle):
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES") as e:
        devices.parse_visible(value)
    assert needle in str(e.value) and "\n" not in str(e.value)


@given(st.lists(st.integers(0, 63), min_size=1, max_size=16))
def test_parse_visible_indices_property(indices):
    value = ",".join(map(str, indices))
    if len(set(indices)) == len(indices):
        assert devices.parse_visible(value) == [str(i) for i in indices]
    else:
        with pytest.raises(UsageError, match="twice"):
            devices.parse_visible(value)


# -- resolution against NVML --------------------------------------------------------------------


def test_indices_count_in_pci_order_not_nvml_order(scrambled):
    # CUDA_DEVICE_ORDER=PCI_BUS_ID: index 0 is the lowest bus (0x18), which NVML calls card 1
    assert devices.resolve_visible("0", scrambled) == [B]
    assert devices.resolve_visible("1,0", scrambled) == [A, B]
    assert devices.resolve_visible("2,0,1", scrambled) == [C, B, A]


def test_uuids_full_prefix_and_mig(scrambled):
    assert devices.resolve_visible(f"{A},{B}", scrambled) == [A, B]
    assert devices.resolve_visible("GPU-bb", scrambled) == [B]
    assert devices.resolve_visible("GPU-BBBB", scrambled) == [B]  # hex digits in either case
    assert devices.resolve_visible(f"{MIG},0", scrambled) == [MIG, B]
    legacy = f"MIG-{C}/1/0"  # pre-R470 drivers: the card is checked, the instance numbers are not
    assert devices.resolve_visible(legacy, scrambled) == [legacy]
    with pytest.raises(UsageError, match="names card GPU-ffffffff-0000-0000-0000-000000000009, which is not here"):
        devices.resolve_visible("MIG-GPU-ffffffff-0000-0000-0000-000000000009/1/0", scrambled)


@pytest.mark.parametrize("value, needle", [
    ("3", "entry `3` is out of range: this machine has 3 card(s): 0=GPU-bbbbbbbb"),
    ("0,7", "entry `7` is out of range"),
    ("GPU-ffff", "entry `GPU-ffff` matches no card; valid cards: 0=GPU-bbbbbbbb"),
    ("GPU-a", "`GPU-a` is an ambiguous prefix of GPU-aaaaaaaa"),
    ("MIG-99999999-2222-3333-4444-555555555555", f"matches no MIG instance; MIG ids here: {MIG}"),
    (f"0,{B}", f"names card {B} twice (`0` and `{B}`)"),
    ("GPU-bb,1,GPU-bbbb", "twice (`GPU-bb` and `GPU-bbbb`)"),
])
def test_resolve_rejects(scrambled, value, needle):
    with pytest.raises(UsageError) as e:
        devices.resolve_visible(value, scrambled)
    assert needle in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_prepare_environment_sets_pci_order_and_validates(scrambled, caplog):
    env = {}
    devices.prepare_environment(env, nvml=scrambled)
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}

    env = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST", "CUDA_VISIBLE_DEVICES": "1,0"}
    with caplog.at_level(logging.WARNING, logger="job.devices"):
        devices.prepare_environment(env, nvml=scrambled)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "CUDA_DEVICE_ORDER=FASTEST_FIRST replaced by PCI_BUS_ID" in caplog.text

    with pytest.raises(UsageError, match="entry `5` is out of range"):
        devices.prepare_environment({"CUDA_VISIBLE_DEVICES": "0,5"}, nvml=scrambled)


def test_prepare_environment_without_driver_checks_syntax_only():
    """Real pynvml on a machine without a driver: ranges cannot be known, syntax still is."""
    if devices.default_nvml() is not None:
        pytest.skip("NVML works here; this test is for machines without a driver")
    env = {"CUDA_VISIBLE_DEVICES": "7,GPU-ffff"}
    devices.prepare_environment(env)  # unknowable without NVML: accepted
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    with pytest.raises(UsageError, match="twice"):
        devices.prepare_environment({"CUDA_VISIBLE_DEVICES": "1,1"})
    with pytest.raises(UsageError, match="not a card index"):
        devices.prepare_environment({"CUDA_VISIBLE_DEVICES": "first"})


def test_prepare_environment_gives_the_card_32_hardware_queues_unless_the_user_chose():
    """CUDA_DEVICE_MAX_CONNECTIONS: 32 where unset (nvJPEG's streams and ours then wait behind none of the model's
    queued kernels), the user's own value kept, a value CUDA does not take refused in one line."""
    env = {}
    devices.prepare_environment(env)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    devices.prepare_environment(env)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    for bad in ("0", "33", "eight", ""):
        with pytest.raises(UsageError) as e:
            devices.prepare_environment({"CUDA_DEVICE_MAX_CONNECTIONS": bad})
        assert str(e.value) == (f"CUDA_DEVICE_MAX_CONNECTIONS={bad!r}: CUDA takes a whole number from 1 to 32 "
                                "(hardware queues a card; unset, the job uses 32)")


def test_cli_reports_bad_visible_devices_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,0"}
    p = subprocess.run([sys.executable, "-m", "job", "train", "train.steps=1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: CUDA_VISIBLE_DEVICES='0,0' names a card twice")
    assert "Traceback" not in p.stderr


def test_assert_cuda_env_unchanged_is_quiet_before_cuda(monkeypatch):
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # restored afterwards
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    devices.prepare_environment(nvml=_nvml([FakeCard(A, "00000000:18:00.0")]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert not torch.cuda.is_initialized()
    devices.assert_cuda_env_unchanged()  # CUDA has not read it yet: changing it is still fine


# -- torch devices <-> cards --------------------------------------------------------------------


def test_visible_cards_map_by_uuid_not_index(scrambled):
    # CUDA_VISIBLE_DEVICES=1 under PCI order is card A (bus 0x3B), which NVML numbers 0
    cards = devices.visible_cards(nvml=scrambled, cuda=FakeCuda.seeing(scrambled, [A]))
    assert cards == [devices.Card(0, A, "00000000:3B:00.0", 0, "NVIDIA H200")]
    # reordered: torch 0 -> C (NVML 2), torch 1 -> B (NVML 1)
    cards = devices.visible_cards(nvml=scrambled, cuda=FakeCuda.seeing(scrambled, [C, B]))
    assert [(c.torch_index, c.uuid, c.nvml_index, c.pci_bus_id) for c in cards] == [
        (0, C, 2, "00000000:5D:00.0"), (1, B, 1, "00000000:18:00.0")]


def test_visible_cards_mig_instance(scrambled):
    (card,) = devices.visible_cards(nvml=scrambled, cuda=FakeCuda.seeing(scrambled, [MIG]))
    assert (card.uuid, card.nvml_index, card.pci_bus_id, card.name) == (MIG, 2, "00000000:5D:00.0", "MIG 1g.18gb")


def test_visible_cards_without_nvml_use_torch_identity(scrambled):
    cuda = FakeCuda.seeing(scrambled, [B])
    broken = FakeNvml(scrambled.cards)  # never initialised: every call raises
    (card,) = devices.visible_cards(nvml=broken, cuda=cuda)
    assert (card.uuid, card.pci_bus_id, card.nvml_index) == (B, "00000000:18:00.0", None)


def test_visible_cards_cpu_only():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert devices.visible_cards() == []
    assert not torch.cuda.is_initialized()


def test_card_memory(scrambled):
    scrambled.cards[1].used = 123
    card = devices.Card(0, B, "00000000:18:00.0", 1, "NVIDIA H200")
    assert devices.card_memory(card, nvml=scrambled) == (123, scrambled.cards[1].total)
    scrambled.cards[1].fail.add("nvmlDeviceGetMemoryInfo")
    assert devices.card_memory(card, nvml=scrambled) is None
    ghost = devices.Card(0, "GPU-00000000-dead-beef-0000-000000000000", "00000000:99:00.0", None, "x")
    assert devices.card_memory(ghost, nvml=scrambled) is None
    if devices.default_nvml() is None:
        assert devices.card_memory(card) is None  # real pynvml, no driver: None, not an exception


def test_card_power_capped_seconds(scrambled):
    """NVML's violation time for the power policy (nanoseconds, a running count) in seconds; None where the card
    or driver does not keep it, for a card NVML does not know, and without a driver."""
    scrambled.cards[1].power_capped_ns = 2_500_000_000
    card = devices.Card(0, B, "00000000:18:00.0", 1, "NVIDIA H200")
    assert devices.card_power_capped_s(card, nvml=scrambled) == 2.5
    scrambled.cards[1].fail.add("nvmlDeviceGetViolationStatus")  # NVML_ERROR_NOT_SUPPORTED on such a card
    assert devices.card_power_capped_s(card, nvml=scrambled) is None
    assert devices.card_memory(card, nvml=scrambled) is not None  # the memory still answers
    ghost = devices.Card(0, "GPU-00000000-dead-beef-0000-000000000000", "00000000:99:00.0", None, "x")
    assert devices.card_power_capped_s(ghost, nvml=scrambled) is None
    if devices.default_nvml() is None:
        assert devices.card_power_capped_s(card) is None


def test_fake_nvml_matches_pynvml():
    """Every NVML call the fake answers exists in the real pynvml with the same parameters."""
    names = [n for n in vars(FakeNvml) if n.startswith("nvml")]
    assert len(names) >= 12
    for name in names:
        real = getattr(pynvml, name)
        fake = getattr(FakeNvml, name)
        real_params = list(inspect.signature(real).parameters)
        fake_params = list(inspect.signature(fake).parameters)[1:]  # drop self
        assert fake_params == real_params, name
    assert issubclass(pynvml.NVMLError, Exception)
    # the attribute names the code reads from NVML's structs
    assert {"busId"} <= {f[0] for f in pynvml.nvmlPciInfo_t._fields_}
    assert {"used", "total", "free"} <= {f[0] for f in pynvml.c_nvmlMemory_t._fields_}
    assert {"gpu"} <= {f[0] for f in pynvml.c_nvmlUtilization_t._fields_}
    assert {"violationTime"} <= {f[0] for f in pynvml.c_nvmlViolationTime_t._fields_}
    assert FakeNvml.NVML_PERF_POLICY_POWER == pynvml.NVML_PERF_POLICY_POWER
    # job.breakdown reads the running-process list's entries (FakeProcess has the same attributes)
    assert {"pid", "usedGpuMemory"} <= {f[0] for f in pynvml.c_nvmlProcessInfo_t._fields_}


def test_devices_import_is_side_effect_free():
    code = ("import sys, job.devices, job.telemetry; "
            "bad = [m for m in ('torch', 'pynvml', 'prometheus_client') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


# -- GPU (2xH200) -------------------------------------------------------------------------------


@requires_gpus(2)
@pytest.mark.gpu
@pytest.mark.parametrize("form", ["index", "uuid"])
def test_gpu_visible_card_1_is_card_1(form):
    """Under CUDA_VISIBLE_DEVICES=1 (or card 1's UUID) torch's device 0 is NVML's card 1."""
    pynvml.nvmlInit()
    cards = sorted(devices.nvml_inventory(pynvml), key=lambda c: devices.pci_key(c.pci_bus_id))
    want = cards[1]
    value = "1" if form == "index" else want.uuid
    code = ("from job import devices; devices.prepare_environment(); "
            "c = devices.visible_cards(); print(len(c), c[0].uuid, c[0].pci_bus_id, c[0].nvml_index)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": value}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", want.uuid, want.pci_bus_id, str(want.nvml_index)]


@requires_gpus(1)
@pytest.mark.gpu
def test_gpu_changing_visible_devices_after_cuda_start_is_an_error():
    code = ("import os, torch; from job import devices; from job.errors import UsageError\n"
            "devices.prepare_environment(); torch.zeros(1, device='cuda')\n"
            "devices.assert_cuda_env_unchanged()\n"
            "os.environ['CUDA_VISIBLE_DEVICES'] = '1'\n"
            "try:\n    devices.assert_cuda_env_unchanged()\nexcept UsageError as e:\n    print('raised', e)\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "raised CUDA_VISIBLE_DEVICES changed from '0' to '1' after CUDA started" in p.stdout


def test_the_cores_a_process_may_use_are_its_affinity_not_the_machines():
    """A process held to one CPU (taskset, a Slurm cpuset) may use one: the bench's default workers, the
    launcher's OMP_NUM_THREADS and a CPU run's threads are sized from this, not from os.cpu_count()."""
    cpu = max(os.sched_getaffinity(0))
    code = (f"import json, os; os.sched_setaffinity(0, {{{cpu}}}); from job.devices import usable_cores, usable_cpus; "
            "print(json.dumps([usable_cores(), usable_cpus()]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [1, [cpu]], p.stdout


def test_the_benchs_default_workers_come_from_the_cpus_it_may_use(monkeypatch):
    """8 CPUs of a 32-CPU machine: 7 workers for a one-process row (one CPU left for it), not 16."""
    from types import SimpleNamespace

    from job.bench.compare import _file_args

    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    bench = SimpleNamespace(overrides={}, cards=1)
    assert "data.workers=7" in _file_args(bench, "ddp", "imagefolder", "/x")
    bench = SimpleNamespace(overrides={}, cards=2)  # two processes share the 8: 3 workers each
    assert "data.workers=3" in _file_args(bench, "ddp", "imagefolder", "/x")
    assert "data.workers=7" in _file_args(bench, "balanced", "imagefolder", "/x")  # one process feeds both cards
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    assert "data.workers=16" in _file_args(SimpleNamespace(overrides={}, cards=1), "ddp", "imagefolder", "/x")


def test_the_launchers_ranks_share_the_cpus_the_job_may_use(monkeypatch):
    from job.launch import rank_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert [rank_threads(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
