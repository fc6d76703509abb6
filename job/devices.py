"""Which cards this process uses, and which physical card each torch device is.

- `prepare_environment()` runs before anything can start CUDA (job/__main__.py): it exports
  `CUDA_DEVICE_ORDER=PCI_BUS_ID` (so CUDA's indices follow the PCI bus, as NVML's do, and as
  `nvidia-smi` prints them) and validates `CUDA_VISIBLE_DEVICES`: indices, `GPU-` UUIDs (full or a
  unique prefix) and `MIG-` ids. Bad entries are a `UsageError` naming the entry and the valid cards.
  Without NVML (no driver) only the syntax and duplicates can be checked. It also exports
  `CUDA_DEVICE_MAX_CONNECTIONS=32` unless it is set (`CONNECTIONS`, below).
- `visible_cards()` maps every torch CUDA device to its card by UUID (torch's device properties <->
  `nvmlDeviceGetUUID`), never by assuming that torch index i is NVML index i: under
  `CUDA_VISIBLE_DEVICES=1` torch's device 0 is NVML's card 1.
- `card_memory()` reads one card's used/total bytes from NVML and never raises.

NVML is reached only through the `nvml` argument (a module shaped like `pynvml`, already
initialised) or, when that is None, through `pynvml` imported and initialised lazily once per
process. Nothing here touches CUDA or NVML at import time. `job.fakes.FakeNvml` is the
pynvml-shaped stand-in the tests and the scrape benchmark use (no GPU on CI machines).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from job.errors import UsageError

log = logging.getLogger("job.devices")

ORDER_VAR, VISIBLE_VAR = "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES"
# CUDA runs the streams of a process through this many hardware queues a card, 8 unless set: a stream that
# shares a queue with the model's stream waits behind the model's kernels queued there, though nothing orders
# the two. nvJPEG alone works through 14 streams (one host wait an image); data.prefetch, the decoded images
# and the gradient buckets have their own. 32, the most CUDA takes, gives each of them a queue of its own.
# Measured on one H100 with compiled ResNet-50 decoding every JPEG on the card: 5,084 img/s against 4,694 at
# 8, the card idle between steps 0.0 % against 7 %; synthetic data unchanged (docs/benchmarks.md). A value the
# user set is kept (Megatron-style tensor-parallel overlap sets 1 on purpose).
CONNECTIONS_VAR, CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS", "32"
# Values that mean "no GPU at all": empty, CUDA's customary -1, and what Slurm writes when a job
# got no GPU gres.
NO_DEVICES = ("", "-1", "NoDevFiles")
_INDEX = re.compile(r"^\d+$")
_GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F][0-9a-fA-F-]*$")
_MIG_ID = re.compile(r"^MIG-(?:[0-9a-fA-F][0-9a-fA-F-]*|GPU-[0-9a-fA-F-]+/\d+/\d+)$")

# CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER as prepare_environment left them; CUDA reads them once,
# when it initialises, so a later change is silently ignored unless someone compares.
_recorded: dict[str, str | None] | None = None


# -- NVML access --------------------------------------------------------------------------------

_nvml_lock = threading.Lock()
_nvml_state: dict[str, Any] = {"module": None, "failed_at": None}
_NVML_RETRY_S = 30.0


def default_nvml():
    """`pynvml`, initialised once per process; None when NVML cannot start (no driver, no library).

    A failure is remembered for 30 s so that a scrape on a GPU-less machine does not retry the
    library load every time.
    """
    with _nvml_lock:
        if _nvml_state["module"] is not None:
            return _nvml_state["module"]
        failed_at = _nvml_state["failed_at"]
        if failed_at is not None and time.monotonic() - failed_at < _NVML_RETRY_S:
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            if failed_at is None:
                log.debug("NVML unavailable: %s", e)
            _nvml_state["failed_at"] = time.monotonic()
            return None
        _nvml_state["module"] = pynvml
        return pynvml


def nvml_or_default(nvml):
    return default_nvml() if nvml is None else nvml


def nvml_text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class NvmlCard:
    """One physical card (or one MIG instance of it) as NVML enumerates it."""

    nvml_index: int
    uuid: str
    pci_bus_id: str
    name: str
    mig_uuids: tuple[str, ...] = ()


def nvml_inventory(nvml) -> list[NvmlCard]:
    """Every card NVML sees, in NVML's index order; MIG instances listed under their card.

    Raises whatever NVML raises for the device count; a card whose identity cannot be read is
    left out (logged), since nothing can be matched to it anyway.
    """
    cards = []
    for i in range(nvml.nvmlDeviceGetCount()):
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml_text(nvml.nvmlDeviceGetUUID(h))
            pci = nvml_text(nvml.nvmlDeviceGetPciInfo(h).busId)
            name = nvml_text(nvml.nvmlDeviceGetName(h))
        except Exception as e:
            log.warning("NVML cannot identify card %d (%s); it is left out", i, e)
            continue
        cards.append(NvmlCard(i, uuid, pci, name, mig_uuids(nvml, h)))
    return cards


def mig_uuids(nvml, handle) -> tuple[str, ...]:
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        if not current:
            return ()
        out = []
        for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                out.append(nvml_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j))))
            except Exception:  # empty slot: NVML_ERROR_NOT_FOUND
                continue
        return tuple(out)
    except Exception:  # NOT_SUPPORTED on cards without MIG
        return ()


def pci_key(bus_id: str) -> tuple[int, int, int, int]:
    """Sort key for "00000000:3B:00.0" (CUDA's PCI_BUS_ID order: domain, bus, device, function)."""
    m = re.match(r"^([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)$", bus_id.strip())
    if not m:
        return (1 << 32, 0, 0, 0)
    return tuple(int(g, 16) for g in m.groups())  # type: ignore[return-value]


def _describe(cards_in_cuda_order: list[NvmlCard]) -> str:
    return ", ".join(f"{i}={c.uuid} ({c.pci_bus_id})" for i, c in enumerate(cards_in_cuda_order))


# -- CUDA_VISIBLE_DEVICES -----------------------------------------------------------------------


def parse_visible(value: str) -> list[str]:
    """Split and syntax-check CUDA_VISIBLE_DEVICES; [] means no devices. Raises UsageError."""
    if value.strip() in NO_DEVICES:
        return []
    entries = [e.strip() for e in value.split(",")]
    seen: dict[str, str] = {}
    for e in entries:
        if not e:
            raise UsageError(f"{VISIBLE_VAR}={value!r} has an empty entry; write a comma-separated list "
                             "like 0,1 or GPU-<uuid>,GPU-<uuid>")
        if not (_INDEX.match(e) or _GPU_UUID.match(e) or _MIG_ID.match(e)):
            raise UsageError(f"{VISIBLE_VAR} entry `{e}` is not a card index, a GPU-<uuid> (or unique prefix) "
                             "or a MIG-<uuid>; fix the variable")
        key = str(int(e)) if _INDEX.match(e) else e.lower()
        if key in seen:
            raise UsageError(f"{VISIBLE_VAR}={value!r} names a card twice (`{seen[key]}` and `{e}`); "
                             "list each card once")
        seen[key] = e
    return entries


def resolve_visible(value: str, nvml) -> list[str]:
    """The UUIDs (GPU- or MIG-) that CUDA_VISIBLE_DEVICES selects, in CUDA order, checked against NVML.

    Indices count cards in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID), which is not necessarily
    NVML's enumeration order.
    """
    entries = parse_visible(value)
    cards = sorted(nvml_inventory(nvml), key=lambda c: pci_key(c.pci_bus_id))
    valid = _describe(cards) if cards else "none"
    migs = {m.lower(): m for c in cards for m in c.mig_uuids}
    chosen: list[str] = []
    origin: dict[str, str] = {}
    for e in entries:
        if _INDEX.match(e):
            i = int(e)
            if i >= len(cards):
                raise UsageError(f"{VISIBLE_VAR} entry `{e}` is out of range: this machine has {len(cards)} "
                                 f"card(s): {valid}")
            uuid = cards[i].uuid
        elif e.upper().startswith("GPU-"):
            hits = [c.uuid for c in cards if c.uuid.lower().startswith(e.lower())]
            if not hits:
                raise UsageError(f"{VISIBLE_VAR} entry `{e}` matches no card; valid cards: {valid}")
            if len(hits) > 1:
                raise UsageError(f"{VISIBLE_VAR} entry `{e}` is an ambiguous prefix of {', '.join(hits)}; "
                                 "give more of the UUID")
            uuid = hits[0]
        elif e.upper().startswith("MIG-GPU-"):  # pre-R470 form MIG-GPU-<uuid>/<gi>/<ci>: check the card
            parent = e[4:].split("/", 1)[0]
            if not any(c.uuid.lower() == parent.lower() for c in cards):
                raise UsageError(f"{VISIBLE_VAR} entry `{e}` names card {parent}, which is not here; "
                                 f"valid cards: {valid}")
            uuid = e
        else:
            uuid = migs.get(e.lower())
            if uuid is None:
                have = ", ".join(migs.values()) or "none (no card is in MIG mode)"
                raise UsageError(f"{VISIBLE_VAR} entry `{e}` matches no MIG instance; MIG ids here: {have}")
        if uuid in origin:
            raise UsageError(f"{VISIBLE_VAR}={value!r} names card {uuid} twice (`{origin[uuid]}` and `{e}`); "
                             "list each card once")
        origin[uuid] = e
        chosen.append(uuid)
    return chosen


def prepare_environment(environ: MutableMapping[str, str] = os.environ, *, nvml=None) -> None:
    """Fix the device order, validate CUDA_VISIBLE_DEVICES and give the card CUDA_DEVICE_MAX_CONNECTIONS hardware
    queues, before CUDA starts (UsageError if a value is bad)."""
    global _recorded
    connections = environ.setdefault(CONNECTIONS_VAR, CONNECTIONS)
    if not (connections.strip().isdigit() and 1 <= int(connections) <= 32):
        raise UsageError(f"{CONNECTIONS_VAR}={connections!r}: CUDA takes a whole number from 1 to 32 (hardware "
                         f"queues a card; unset, the job uses {CONNECTIONS})")
    order = environ.get(ORDER_VAR)
    if order != "PCI_BUS_ID":
        if order is not None:
            log.warning("%s=%s replaced by PCI_BUS_ID so that card indices match nvidia-smi and NVML",
                        ORDER_VAR, order)
        environ[ORDER_VAR] = "PCI_BUS_ID"
    value = environ.get(VISIBLE_VAR)
    if value is not None:
        nv = nvml_or_default(nvml)
        if nv is None:
            parse_visible(value)  # no driver: syntax and duplicates only
        else:
            try:
                nvml_inventory(nv)
            except Exception as e:  # NVML present but not answering: do what we can
                log.warning("NVML cannot list cards (%s); checking %s syntax only", e, VISIBLE_VAR)
                parse_visible(value)
            else:
                resolve_visible(value, nv)
    if environ is os.environ:
        _recorded = {var: environ.get(var) for var in (ORDER_VAR, VISIBLE_VAR, CONNECTIONS_VAR)}


def assert_cuda_env_unchanged() -> None:
    """UsageError if CUDA has started in this process and the variables it read have changed since."""
    if _recorded is None or "torch" not in sys.modules:
        return
    import torch

    if not torch.cuda.is_initialized():
        return
    for var in (VISIBLE_VAR, ORDER_VAR, CONNECTIONS_VAR):
        now = os.environ.get(var)
        if now != _recorded[var]:
            raise UsageError(
                f"{var} changed from {_recorded[var]!r} to {now!r} after CUDA started in this process; "
                "CUDA ignores the change: set it before the run starts (shell, job script or launcher)"
            )


# -- torch devices <-> cards --------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    """One torch CUDA device and the physical card (or MIG instance) behind it."""

    torch_index: int
    uuid: str
    """GPU-... (or MIG-...), as NVML and DCGM print it."""
    pci_bus_id: str
    """00000000:3B:00.0, NVML's format (DCGM's pci_bus_id label)."""
    nvml_index: int | None
    """NVML's index of the card (of the parent card for a MIG instance); None without NVML."""
    name: str


def _torch_pci(props) -> str:
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


def bare_uuid(uuid: str) -> str:
    """The bare UUID, so that torch's "8a4f..." matches NVML's "GPU-8a4f..." and "MIG-8a4f..."."""
    u = uuid.lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            return u[len(prefix):]
    return u


_cards_cache: list[Card] | None = None


def visible_cards(*, nvml=None, cuda=None) -> list[Card]:
    """One Card per torch CUDA device, in torch order, matched to NVML by UUID; [] without CUDA.

    `cuda` defaults to `torch.cuda` (tests pass a stand-in: CUDA cannot run on CI machines). With
    both defaults the answer is computed once per process: CUDA's device list cannot change after
    it has started (assert_cuda_env_unchanged), and the trainer asks at every logged step.
    """
    global _cards_cache
    if nvml is None and cuda is None:
        if _cards_cache is None:
            import torch

            cards = _visible_cards(None, torch.cuda)
            if not cards or torch.cuda.is_initialized():
                _cards_cache = cards
            return list(cards)
        return list(_cards_cache)
    if cuda is None:
        import torch

        cuda = torch.cuda
    return _visible_cards(nvml, cuda)


def _visible_cards(nvml, cuda) -> list[Card]:
    if not cuda.is_available():
        return []
    by_uuid: dict[str, tuple[NvmlCard, str]] = {}
    nv = nvml_or_default(nvml)
    if nv is not None:
        try:
            for c in nvml_inventory(nv):
                by_uuid[bare_uuid(c.uuid)] = (c, c.uuid)
                for m in c.mig_uuids:
                    by_uuid[bare_uuid(m)] = (c, m)
        except Exception as e:
            log.warning("NVML cannot list cards (%s); card identity comes from torch alone", e)
    cards = []
    for i in range(cuda.device_count()):
        props = cuda.get_device_properties(i)
        torch_uuid = bare_uuid(str(props.uuid))
        hit = by_uuid.get(torch_uuid)
        if hit is None:
            if by_uuid:
                log.warning("torch device %d (GPU-%s) is not among NVML's cards", i, torch_uuid)
            cards.append(Card(i, f"GPU-{torch_uuid}", _torch_pci(props), None, str(props.name)))
        else:
            nc, uuid = hit
            cards.append(Card(i, uuid, nc.pci_bus_id, nc.nvml_index, str(props.name)))
    return cards


_handles: dict[tuple[int, str], Any] = {}


def _handle(nv, card: Card):
    """NVML's handle of the card, looked up once per NVML module."""
    key = (id(nv), card.uuid)
    h = _handles.get(key)
    if h is None:
        h = _handles[key] = nv.nvmlDeviceGetHandleByUUID(card.uuid)
    return h


def card_memory(card: Card, *, nvml=None) -> tuple[int, int] | None:
    """(used, total) bytes of the card as NVML sees them (all processes); None if NVML cannot answer."""
    try:
        nv = nvml_or_default(nvml)
        if nv is None:
            return None
        mem = nv.nvmlDeviceGetMemoryInfo(_handle(nv, card))
        return int(mem.used), int(mem.total)
    except Exception:
        return None


def card_power_capped_s(card: Card, *, nvml=None) -> float | None:
    """Seconds, since the driver started counting, that the card ran below the clocks asked of it because of its
    power limit (NVML's violation time for the power policy: a running count, so the share of a window is its
    growth over the window's length); None where NVML cannot answer (no NVML, a MIG instance, a card or driver
    that does not keep the count)."""
    try:
        nv = nvml_or_default(nvml)
        if nv is None:
            return None
        return int(nv.nvmlDeviceGetViolationStatus(_handle(nv, card), nv.NVML_PERF_POLICY_POWER).violationTime) / 1e9
    except Exception:
        return None


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: a Slurm, container or taskset limit), else all the
    machine's. os.cpu_count() counts the machine's, which oversubscribes a process held to fewer."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many CPUs this process may run on (usable_cpus)."""
    return len(usable_cpus()) or 1
