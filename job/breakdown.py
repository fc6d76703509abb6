"""Why a card is full: each card's memory by kind, from the tensors, torch's allocator and NVML.

Per card this job uses (docs/memory-breakdown.md explains each kind):

- parameters: the storages of the parameters and buffers on the card (the strategy names them);
- gradients: the storages of their gradients (gradient buckets counted whole);
- optimizer_state: the storages of the optimizer's state tensors for those parameters;
- activations: peak allocated (live: allocated) minus the three above: activations and temporaries;
- allocator_cache: torch's reserved minus allocated: freed blocks the caching allocator keeps;
- cuda_context: NVML's memory of this job's processes on the card minus torch's reserved: the CUDA context,
  libraries' workspaces outside the allocator, NCCL buffers;
- other_processes: NVML's memory of every other process on the card (their pids and names are listed);
- unattributed: NVML's used minus every process it lists: the driver's own reservation;
- free: NVML's free.

Tensors are counted by storage: a storage several tensors view (gradient buckets, flat buffers, a sharded
parameter's padded shard) once, under the first kind that holds it. `split` is the arithmetic alone (tested
with job.fakes); `Memory` reads the sources for the cards of one process: the strategy's tensors
(`Strategy.memory_tensors`), torch's allocator (`job.telemetry.allocator.TorchAllocator`, or a stand-in),
NVML (`pynvml`, or `job.fakes.FakeNvml`), the card map (job.devices). At the end of a run and at every logged
step the trainer asks for `measure(peak=True)` (the same window as the per-card table) and gathers every
rank's rows with its per-card rows; the telemetry exporter asks for `live()` at each scrape. On a CPU the
three tensor kinds are all there is: the row says so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

log = logging.getLogger("job")
GB = 1e9
KINDS = ("parameters", "gradients", "optimizer_state", "activations", "allocator_cache", "cuda_context",
         "other_processes", "unattributed", "free")
TENSOR_KINDS = KINDS[:3]
# Column heads of the printed table (at most 11 characters, so a row fits in about 120 columns).
HEADS = {"parameters": "params", "gradients": "grads", "optimizer_state": "optimizer", "activations": "activations",
         "allocator_cache": "cache", "cuda_context": "context", "other_processes": "other procs",
         "unattributed": "unattrib.", "free": "free"}
NO_CARD = ("no CUDA card: this run trained on the CPU; parameters, gradients and optimizer state are counted "
           "from the tensors, and there is no allocator cache, CUDA context or card to split")


# -- tensors ------------------------------------------------------------------------------------------

def tensor_bytes(groups: dict[str, Iterable], seen: set | None = None) -> dict[str, int]:
    """Bytes of each kind's distinct storages; a storage already in `seen` (or in an earlier kind) is not counted
    again. Tensors on the meta device hold nothing."""
    seen = set() if seen is None else seen
    out = {}
    for kind in TENSOR_KINDS:
        total = 0
        for t in groups.get(kind, ()):
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[kind] = total
    return out


# -- processes ----------------------------------------------------------------------------------------

@dataclass
class Process:
    pid: int
    name: str | None
    bytes: int | None  # None: NVML does not say (MIG without privileges, some containers)


def nvml_processes(nvml, handle) -> list[Process] | None:
    """Every process NVML lists on the card (compute and graphics, each pid once); None if it cannot list them."""
    from job.devices import nvml_text

    found: dict[int, int | None] = {}
    try:
        listed = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except Exception as e:
        log.debug("NVML cannot list the card's processes: %s", e)
        return None
    try:
        listed += list(nvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
    except Exception:  # compute processes are what matters here
        pass
    for p in listed:
        used = p.usedGpuMemory
        pid = int(p.pid)
        if pid in found and found[pid] is not None and used is not None:
            used = max(used, found[pid])  # a process in both lists is one process
        found[pid] = None if used is None else int(used)
    out = []
    for pid, used in sorted(found.items()):
        try:
            name = nvml_text(nvml.nvmlSystemGetProcessName(pid)) or None
        except Exception:  # another container's process, or one that just ended
            name = None
        out.append(Process(pid, name, used))
    return out


def parent_pid(pid: int) -> int | None:
    """The parent of `pid` in this pid namespace (Linux /proc); None if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("PPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def ours_by_ancestry(job_pids: set[int], *, depth: int = 4) -> Callable[[int], bool]:
    """A test for "this process is the job's": one of its pids, or a child of one (a DataLoader worker)."""
    def ours(pid: int) -> bool:
        for _ in range(depth):
            if pid in job_pids:
                return True
            parent = parent_pid(pid)
            if not parent or parent == pid:
                return False
            pid = parent
        return pid in job_pids
    return ours


# -- the arithmetic -----------------------------------------------------------------------------------

def split(*, tensors: dict[str, int], allocated: int, reserved: int, used: int | None, total: int | None,
          free: int | None, processes: list[Process] | None,
          ours: Callable[[int], bool]) -> tuple[dict[str, int | None], list[Process], list[str]]:
    """One card's kinds (bytes; None where a source cannot say) from what its sources read, the other
    processes, and notes on anything that did not add up.

    `allocated` is the peak (end of run, logged steps) or current (live) allocated bytes, `reserved` the current
    reserved bytes, `used`/`total`/`free` NVML's for the card, `processes` NVML's list (None: not available)."""
    notes = []
    kinds: dict[str, int | None] = dict.fromkeys(KINDS)
    kinds.update({k: int(tensors.get(k, 0)) for k in TENSOR_KINDS})
    held = sum(kinds[k] for k in TENSOR_KINDS)
    if allocated < held:
        notes.append(f"the tensors counted ({held / GB:.2f} GB) exceed the allocator's allocated bytes "
                     f"({allocated / GB:.2f} GB): some live outside torch's caching allocator")
    kinds["activations"] = max(0, allocated - held)
    kinds["allocator_cache"] = max(0, reserved - allocated)
    kinds["free"] = free
    others: list[Process] = []
    if used is None:
        notes.append("NVML cannot read this card: context, other processes and free are unknown")
        return kinds, others, notes
    is_ours = {p.pid: ours(p.pid) for p in processes or []}
    mine = [p for p in processes or [] if is_ours[p.pid]]
    others = [p for p in processes or [] if not is_ours[p.pid]]
    if processes is None or any(p.bytes is None for p in mine) or (reserved > 0 and not mine):
        why = ("NVML cannot list the card's processes" if processes is None else
               "NVML does not give this job's processes' memory" if mine else
               "NVML lists no process of this job on the card (its pids are another pid namespace's: a container?)")
        notes.append(f"{why}: the context and other processes are counted as unattributed")
        kinds["unattributed"] = max(0, used - reserved)
        return kinds, others, notes
    job_nvml = sum(p.bytes for p in mine)
    kinds["cuda_context"] = max(0, job_nvml - reserved)
    kinds["other_processes"] = sum(p.bytes for p in others if p.bytes is not None)
    silent = [str(p.pid) for p in others if p.bytes is None]
    if silent:
        notes.append(f"NVML does not give the memory of pid {', '.join(silent)}: it is counted as unattributed")
    kinds["unattributed"] = max(0, used - job_nvml - kinds["other_processes"])
    if job_nvml < reserved:
        notes.append(f"NVML gives this job's processes {job_nvml / GB:.2f} GB on the card, less than torch's reserved "
                     f"{reserved / GB:.2f} GB (read at different moments)")
    return kinds, others, notes


def known_sum(kinds: dict[str, int | None]) -> int:
    return sum(v for v in kinds.values() if v is not None)


def cap_headroom(*, cap: int | None, peak_reserved: int, card_headroom: int | None) -> int | None:
    """Headroom at the peak: what the card had for the job minus its peak reserved, and with memory.cap_gb at
    most what the cap leaves (the allocator refuses to grow past it)."""
    if cap is None:
        return card_headroom
    left = cap - peak_reserved
    return left if card_headroom is None else min(card_headroom, left)


def cap_of(index: int) -> int | None:
    """This process's allocator cap on device `index` (memory.cap_gb, via set_per_process_memory_fraction, a
    fraction of torch's total memory of the card); None when uncapped or before CUDA starts."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    fraction = torch.cuda.get_per_process_memory_fraction(index)
    return int(fraction * torch.cuda.get_device_properties(index).total_memory) if fraction < 1.0 else None


# -- one process's cards ------------------------------------------------------------------------------

class Memory:
    """The memory by kind of the cards one process drives.

    `strategy` and `optimizer` give the tensors; `job_pids` are every rank's pid (gathered here, a collective,
    when not given); `nvml`, `cuda`, `allocator` and `caps` ({torch index: bytes}) are injectable sources (the
    defaults: pynvml, torch.cuda, the caching allocator, the per-process memory fraction)."""

    def __init__(self, strategy, optimizer, *, rank: int, job_pids: Iterable[int] | None = None, nvml=None,
                 cuda=None, cards=None, allocator=None, caps: dict[int, int] | None = None):
        self.strategy, self.optimizer, self.rank = strategy, optimizer, int(rank)
        self.devices = list(strategy.devices)
        pids = job_pids if job_pids is not None else strategy.all_gather_object(os.getpid())
        self.job_pids = {int(p) for p in pids}
        self.ours = ours_by_ancestry(self.job_pids)
        self._nvml, self._cuda, self._cards, self._caps = nvml, cuda, cards, caps
        self._allocator = allocator
        self._handles: dict[str, object] = {}
        self._live: list[dict] = []  # the last `refresh`'s rows, what a scrape serves
        self._wanted = True  # a scrape has asked since the last refresh
        self._held: tuple[tuple, list[dict[str, int]]] | None = None  # (_held_key, the tensors' bytes per card)

    def _card_map(self) -> dict:
        if self._cards is None:
            from job import devices

            on_cuda = any(d.type == "cuda" for d in self.devices)
            self._cards = devices.visible_cards(nvml=self._nvml, cuda=self._cuda) if on_cuda else []
        return {c.torch_index: c for c in self._cards}

    def _source(self):
        if self._allocator is None:
            from job.telemetry.allocator import TorchAllocator

            self._allocator = TorchAllocator()
        return self._allocator

    def _nvml_card(self, uuid: str):
        """(used, total, free, processes) of the card from NVML; None when NVML cannot answer."""
        from job import devices

        nv = devices.nvml_or_default(self._nvml)
        if nv is None:
            return None
        try:
            h = self._handles.get(uuid)
            if h is None:
                h = self._handles[uuid] = nv.nvmlDeviceGetHandleByUUID(uuid)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
        except Exception as e:
            log.debug("NVML memory info for %s failed: %s", uuid, e)
            return None
        return int(mem.used), int(mem.total), int(mem.free), nvml_processes(nv, h)

    def _held_key(self) -> tuple | None:
        """What can change the tensors' bytes between two steps of a run: the first optimizer step creates the
        optimizer's state, and zero_grad(set_to_none=True) drops the gradients. The tensors' sizes are fixed
        for a run. None (count every time) without a torch optimizer."""
        groups = getattr(self.optimizer, "param_groups", None)
        if groups is None:
            return None
        return len(self.optimizer.state), sum(p.grad is not None for g in groups for p in g["params"])

    def _tensor_bytes(self) -> list[dict[str, int]]:
        """The parameters', gradients' and optimizer state's bytes per card, counted from the tensors again only
        when `_held_key` changed: counting 1,500 tensors took 3-4 ms of a host core, each logged step."""
        import torch

        key = self._held_key()
        if key is None or self._held is None or self._held[0] != key:
            with torch.no_grad():  # DTensor.to_local records nothing for autograd
                per_card = self.strategy.memory_tensors(self.optimizer)
            seen: set = set()
            self._held = key, [tensor_bytes(groups, seen) for groups in per_card]
        return self._held[1]

    def measure(self, *, peak: bool) -> list[dict]:
        """One dict per card this process drives: at the peak (since the last peak reset) or now."""
        tensors = self._tensor_bytes()
        cards = self._card_map() if any(d.type == "cuda" for d in self.devices) else {}
        rows = []
        for device, held in zip(self.devices, tensors, strict=True):
            if device.type != "cuda":
                kinds = dict.fromkeys(KINDS)
                kinds.update(held)
                rows.append(_row(self.rank, str(device), "cpu", "cpu", "peak" if peak else "now", kinds, None,
                                 [], None, None, [NO_CARD]))
                continue
            index = device.index or 0
            card = cards.get(index)
            allocated, reserved, peak_allocated = self._source().read(index)
            nv = self._nvml_card(card.uuid) if card is not None else None
            used, total, free, procs = nv if nv is not None else (None, None, None, None)
            kinds, others, notes = split(tensors=held, allocated=peak_allocated if peak else allocated,
                                         reserved=reserved, used=used, total=total, free=free, processes=procs,
                                         ours=self.ours)
            cap = self._caps.get(index) if self._caps is not None else cap_of(index)
            cap_free = None
            if cap is not None:
                cap_free = max(0, cap - reserved) if free is None else max(0, min(cap - reserved, free))
            rows.append(_row(self.rank, str(device), card.uuid if card else "", card.name if card else "",
                             "peak" if peak else "now", kinds, total, others, cap, cap_free, notes))
        return rows

    def now(self) -> list[dict]:
        """This process's cards now; in the thread that trains (see `live`)."""
        return self.measure(peak=False)

    def live(self) -> list[dict]:
        """This process's cards as of the last `refresh`, for the exporter's scrape (any thread; [] before the
        first). The tensors are read only by the thread that trains: read from the scrape's thread while
        backward assigned gradients, `untyped_storage()` crashed the process with SIGSEGV (a CPU run scraped
        three times at once, within seconds)."""
        self._wanted = True
        return self._live

    def refresh(self) -> None:
        """In the thread that trains, between steps: measure now if a scrape asked since the last time. A
        failure keeps the previous rows (the breakdown never stops the run)."""
        if not self._wanted:
            return
        self._wanted = False
        try:
            self._live = self.now()
        except Exception as e:
            log.debug("memory breakdown failed: %s", e)


def _row(rank, device, uuid, name, at, kinds, total, others, cap, cap_free, notes) -> dict:
    rest = total - known_sum(kinds) if total is not None else None
    return {"rank": rank, "device": device, "uuid": uuid, "name": name, "at": at, "kinds": kinds,
            "total_bytes": total, "rest_bytes": rest, "other_processes": [asdict(p) for p in others],
            "cap_bytes": cap, "cap_free_bytes": cap_free, "notes": notes}


# -- the printed table --------------------------------------------------------------------------------

def table(rows: list[dict], *, title: str) -> str:
    """The per-card breakdown under the per-card table: GB (10^9 bytes) per kind, one row per card."""
    if not rows:
        return ""
    lines = [title]
    cards = [r for r in rows if r["total_bytes"] is not None or r["uuid"] != "cpu"]
    shown = [k for k in KINDS if any(r["kinds"][k] is not None for r in rows)]
    head = ["rank", "device", *(HEADS[k] for k in shown)] + (["total"] if cards else [])
    body = []
    for r in sorted(rows, key=lambda r: (r["rank"], r["device"])):
        cells = [str(r["rank"]), r["device"]]
        cells += [_gb(r["kinds"][k]) for k in shown]
        if cards:
            cells.append(f"{r['total_bytes'] / GB:.2f}" if r["total_bytes"] is not None else "n/a")
        body.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines += [fmt.format(*head).rstrip(), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*b).rstrip() for b in body]
    for r in sorted(rows, key=lambda r: (r["rank"], r["device"])):
        where = f"{r['device']} (rank {r['rank']})" if len({x['rank'] for x in rows}) > 1 else r["device"]
        if r["total_bytes"] is not None:
            rest = r["rest_bytes"]
            lines.append(f"{where}: the kinds add up to {known_sum(r['kinds']) / GB:.2f} GB of the card's "
                         f"{r['total_bytes'] / GB:.2f} GB (NVML total; rest {rest / GB:+.2f} GB)")
        if r["other_processes"]:
            lines.append(f"{where}: other processes: " + ", ".join(
                f"pid {p['pid']}" + (f" {p['name']}" if p["name"] else "")
                + (f" {p['bytes'] / GB:.2f} GB" if p["bytes"] is not None else "") for p in r["other_processes"]))
        if r["cap_bytes"] is not None:
            lines.append(f"{where}: memory.cap_gb caps this job at {r['cap_bytes'] / GB:.2f} GB: "
                         f"{r['cap_free_bytes'] / GB:.2f} GB of it is free (the card's free is "
                         + (f"{r['kinds']['free'] / GB:.2f} GB)" if r["kinds"]["free"] is not None else "unknown)"))
        for note in r["notes"]:
            if note != NO_CARD:
                lines.append(f"{where}: {note}")
    if any(NO_CARD in r["notes"] for r in rows):
        lines.append(NO_CARD)
    return "\n".join(lines)


def _gb(value: int | None) -> str:
    """GB with two decimals; a small non-zero amount with two significant digits (a CPU test model's 0.00031)."""
    if value is None:
        return "n/a"
    gb = value / GB
    return f"{gb:.2g}" if 0 < gb < 0.005 else f"{gb:.2f}"
