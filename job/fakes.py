"""Stand-ins for what cannot run on a machine without a GPU: a pynvml-shaped NVML (`FakeNvml`), torch.cuda's
device properties (`FakeCuda`), the caching allocator's counters (`FakeAllocator`), and the tensors a strategy
says each card holds (`FakeLayout` of `FakeTensor`s, for job.breakdown), and NVML's process list (`FakeProcess`).

The tests inject them (job.devices and job.telemetry take the source as an argument), and so does the
telemetry scrape benchmark (`python -m job.telemetry --bench-scrape`), the one place the product uses
them on purpose. Nothing else imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from job.devices import bare_uuid, nvml_text, pci_key


class FakeNvmlError(Exception):
    """Stands in for pynvml.NVMLError."""


@dataclass
class FakeProcess:
    """One entry of NVML's running-process list (pynvml's friendly object has the same attributes)."""

    pid: int
    usedGpuMemory: int | None  # noqa: N815 (pynvml's name); None: NVML_VALUE_NOT_AVAILABLE
    name: str | None = None
    """What nvmlSystemGetProcessName answers; None: it fails (another container's process)."""


@dataclass
class FakeCard:
    uuid: str
    pci_bus_id: str
    name: str = "NVIDIA H200"
    total: int = 150_754_820_096
    used: int = 0
    util_percent: int = 0
    migs: list[FakeCard] = field(default_factory=list)
    processes: list[FakeProcess] = field(default_factory=list)
    """What nvmlDeviceGetComputeRunningProcesses lists on the card."""
    fail: set[str] = field(default_factory=set)
    """Names of NVML calls that fail for this card, e.g. {"nvmlDeviceGetMemoryInfo"}."""
    power_capped_ns: int = 0
    """NVML's violation time for the power policy: how long the card ran below its clocks for its power limit."""


@dataclass
class _Struct:
    busId: str = ""
    used: int = 0
    total: int = 0
    free: int = 0
    gpu: int = 0
    memory: int = 0
    referenceTime: int = 0
    violationTime: int = 0


class FakeNvml:
    """The subset of pynvml this project calls, over a list of FakeCards in NVML index order.

    A test pins that every method here exists in the real pynvml with the same parameters.
    """

    NVMLError = FakeNvmlError
    NVML_PERF_POLICY_POWER = 0

    def __init__(self, cards: list[FakeCard], *, init_error: bool = False):
        self.cards = cards
        self.init_error = init_error
        self.initialised = 0
        self.calls = 0

    @staticmethod
    def h200s(n: int, *, used: int = 0) -> FakeNvml:
        """n H200-like cards on buses 0x18, 0x2A, ... (NVML order = PCI order)."""
        buses = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB, 0x1B, 0x2B, 0x3B, 0x4B, 0x5B, 0x6B, 0x7B, 0x8B]
        return FakeNvml([FakeCard(f"GPU-{i:08x}-1111-2222-3333-{i:012x}", f"00000000:{buses[i]:02X}:00.0",
                                  used=used, util_percent=10 * i % 100) for i in range(n)])

    def _check(self, name: str, card: FakeCard | None = None):
        self.calls += 1
        if self.initialised <= 0:
            raise FakeNvmlError("Uninitialized")
        if card is not None and name in card.fail:
            raise FakeNvmlError(f"{name} failed (fake)")

    def nvmlInit(self):
        if self.init_error:
            raise FakeNvmlError("Driver Not Loaded")
        self.initialised += 1

    def nvmlShutdown(self):
        self._check("nvmlShutdown")
        self.initialised -= 1

    def nvmlDeviceGetCount(self):
        self._check("nvmlDeviceGetCount")
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.cards):
            raise FakeNvmlError("Invalid Argument")
        card = self.cards[index]
        self._check("nvmlDeviceGetHandleByIndex", card)
        return card

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self._check("nvmlDeviceGetHandleByUUID")
        for c in self.cards:
            for h in (c, *c.migs):
                if h.uuid == nvml_text(uuid):
                    return h
        raise FakeNvmlError("Not Found")

    def nvmlDeviceGetUUID(self, handle):
        self._check("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlDeviceGetPciInfo(self, handle):
        self._check("nvmlDeviceGetPciInfo", handle)
        return _Struct(busId=handle.pci_bus_id)

    def nvmlDeviceGetName(self, handle):
        self._check("nvmlDeviceGetName", handle)
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self._check("nvmlDeviceGetMemoryInfo", handle)
        return _Struct(used=handle.used, total=handle.total, free=handle.total - handle.used)

    def nvmlDeviceGetViolationStatus(self, device, perfPolicyType):
        self._check("nvmlDeviceGetViolationStatus", device)
        if perfPolicyType != self.NVML_PERF_POLICY_POWER:
            raise FakeNvmlError("NVML_ERROR_NOT_SUPPORTED")
        return _Struct(violationTime=device.power_capped_ns)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._check("nvmlDeviceGetComputeRunningProcesses", handle)
        return list(handle.processes)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        self._check("nvmlDeviceGetGraphicsRunningProcesses", handle)
        return []

    def nvmlSystemGetProcessName(self, pid):
        self._check("nvmlSystemGetProcessName")
        for c in self.cards:
            for h in (c, *c.migs):
                for p in h.processes:
                    if p.pid == pid and p.name is not None:
                        return p.name.encode()  # bytes, as the real call returns them
        raise FakeNvmlError("Not Found")

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._check("nvmlDeviceGetUtilizationRates", handle)
        return _Struct(gpu=handle.util_percent, memory=0)

    def nvmlDeviceGetMigMode(self, device):
        self._check("nvmlDeviceGetMigMode", device)
        return (1, 1) if device.migs else (0, 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, device):
        self._check("nvmlDeviceGetMaxMigDeviceCount", device)
        return 7 if device.migs else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index):
        self._check("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if index >= len(device.migs):
            raise FakeNvmlError("Not Found")
        return device.migs[index]


@dataclass
class FakeCudaProps:
    uuid: str
    """Bare UUID, as str(torch.cuda.get_device_properties(i).uuid) prints it."""
    pci_domain_id: int
    pci_bus_id: int
    pci_device_id: int
    name: str = "NVIDIA H200"


class FakeCuda:
    """The three torch.cuda calls visible_cards makes, over FakeCudaProps in torch order."""

    def __init__(self, props: list[FakeCudaProps]):
        self.props = props

    def is_available(self):
        return bool(self.props)

    def device_count(self):
        return len(self.props)

    def get_device_properties(self, i):
        return self.props[i]

    @staticmethod
    def seeing(nvml: FakeNvml, uuids: list[str]) -> FakeCuda:
        """What torch would see when CUDA exposes these cards (by uuid), in this order."""
        cards = {h.uuid: (c, h) for c in nvml.cards for h in (c, *c.migs)}
        out = []
        for u in uuids:
            parent, h = cards[u]
            dom, bus, dev, _fn = pci_key(parent.pci_bus_id)
            out.append(FakeCudaProps(bare_uuid(h.uuid), dom, bus, dev, h.name))
        return FakeCuda(out)


class FakeAllocator:
    """Allocator stand-in for tests and the benchmark: {torch index: (allocated, reserved, peak)}."""

    def __init__(self, stats: dict[int, tuple[int, int, int]]):
        self.stats = stats

    def read(self, index: int) -> tuple[int, int, int]:
        return self.stats.get(index, (0, 0, 0))


class FakeStorage:
    """A storage of `nbytes` with an address of its own and no memory behind it."""

    _next = 1 << 40

    def __init__(self, nbytes: int):
        self._nbytes = int(nbytes)
        self._ptr = FakeStorage._next
        FakeStorage._next += max(1, self._nbytes)

    def nbytes(self) -> int:
        return self._nbytes

    def data_ptr(self) -> int:
        return self._ptr


class FakeTensor:
    """What job.breakdown reads of a tensor (its device, its storage), for 80 GB layouts on a machine without
    cards: `FakeTensor(2 << 30)`, or a view of another's storage: `FakeTensor(storage=bucket.untyped_storage())`."""

    def __init__(self, nbytes: int = 0, *, device: str = "cuda:0", storage: FakeStorage | None = None):
        import torch

        self.device = torch.device(device)
        self._storage = storage if storage is not None else FakeStorage(nbytes)

    def untyped_storage(self) -> FakeStorage:
        return self._storage


class FakeLayout:
    """A strategy stand-in for job.breakdown.Memory: its cards (`devices`) and what `memory_tensors` says each
    holds, given in bytes per card and kind: [{"parameters": [2 << 30], "optimizer_state": [2 << 30, ...]}, ...]."""

    def __init__(self, devices: list[str], per_card: list[dict[str, list[int]]]):
        import torch

        self.devices = [torch.device(d) for d in devices]
        self.tensors = [{kind: [FakeTensor(n, device=d) for n in sizes] for kind, sizes in card.items()}
                        for d, card in zip(devices, per_card, strict=True)]

    def memory_tensors(self, optimizer):
        return self.tensors

    def all_gather_object(self, obj) -> list:
        return [obj]
