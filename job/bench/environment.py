"""Where a result came from: the machine, the software versions and the commit (bench.json's environment)."""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: job/bench/ is two folders below it


def _git_commit() -> tuple[str | None, bool | None]:
    if os.environ.get("GIT_COMMIT"):  # named by whoever copied the tree (its .git may be missing or stale)
        return os.environ["GIT_COMMIT"], None
    git = shutil.which("git")
    if git and (ROOT / ".git").exists():
        try:
            head = subprocess.run([git, "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
            dirty = subprocess.run([git, "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10, check=True).stdout.strip()
            return head, bool(dirty)
        except (subprocess.SubprocessError, OSError):
            pass
    return None, None


def code_fingerprint(root: Path = ROOT) -> str:
    """The first 12 hex digits of a sha256 over the package's source (every .py and .yaml under job/, by
    relative path and content): it names the code a result came from even where git cannot (a copy of the
    tree whose .git is stale or missing). A checkout's own: `python -c "from job.bench.environment import
    code_fingerprint; print(code_fingerprint())"`."""
    import hashlib

    digest = hashlib.sha256()
    files = sorted(p for p in (root / "job").rglob("*") if p.suffix in (".py", ".yaml") and p.is_file()
                   and "__pycache__" not in p.parts)
    for p in files:
        digest.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _driver() -> tuple[str | None, str | None]:
    """(driver version, CUDA version the driver supports), from NVML, else nvidia-smi."""
    from job.devices import default_nvml, nvml_text

    nv = default_nvml()
    if nv is not None:
        try:
            drv = nvml_text(nv.nvmlSystemGetDriverVersion())
            cuda = None
            with contextlib.suppress(Exception):
                v = int(nv.nvmlSystemGetCudaDriverVersion_v2())
                cuda = f"{v // 1000}.{v % 1000 // 10}"
            return drv, cuda
        except Exception:
            pass
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(subprocess.SubprocessError, OSError, IndexError):
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20, check=True).stdout
            return out.splitlines()[0].strip(), None
    return None, None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def physical_cores(root: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """Physical cores under the CPUs this process may use (distinct package and core ids in sysfs): fewer than
    the CPUs where they are hyper-threads, whose siblings share a core's time. None where sysfs does not say."""
    from job.devices import usable_cpus

    cores = set()
    for cpu in usable_cpus():
        topology = root / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            return None
    return len(cores) or None


def cpu_list(cpus: list[int]) -> str:
    """CPU numbers in the kernel's list format (`0-7,12`), as taskset -c and /proc's Cpus_allowed_list write them."""
    spans: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _nccl_version() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    with contextlib.suppress(Exception):
        v = torch.cuda.nccl.version()
        return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    return None


def _torchvision_version() -> str | None:
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        return version("torchvision")
    return None


def environment(results: list[dict]) -> dict[str, Any]:
    import torch

    from job import devices
    from job.devices import usable_cpus

    cmd = sys.argv[1:] if sys.argv and sys.argv[0].endswith("__main__.py") else None
    command = shlex.join(["python", "-m", "job", *cmd]) if cmd is not None else shlex.join(sys.argv)
    gpus: dict[str, dict] = {}
    for w in results:
        for r in w["runs"]:
            for c in r["cards"]:
                gpus.setdefault(c["uuid"], {"name": c["name"], "uuid": c["uuid"], "pci_bus_id": c["pci_bus_id"],
                                            "memory_total_bytes": c["nvml_total_bytes"]})
    gpu_list = sorted(gpus.values(), key=lambda g: g["pci_bus_id"])
    driver, cuda_driver = _driver() if gpu_list or torch.cuda.is_available() else (None, None)
    commit, dirty = _git_commit()
    cudnn = None
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            cudnn = torch.backends.cudnn.version()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(), "command": command,
        "python": platform.python_version(), "platform": platform.platform(), "cpu": _cpu_model(),
        "cpu_count": os.cpu_count() or 0, "cpus": cpu_list(usable_cpus()), "cpu_cores": physical_cores(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cudnn": cudnn, "nccl": _nccl_version(), "torchvision": _torchvision_version(),
        "driver": driver, "cuda_driver": cuda_driver,
        "gpu_model": ", ".join(sorted({g["name"] for g in gpu_list})) or None, "gpus": gpu_list,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_max_connections": os.environ.get(devices.CONNECTIONS_VAR),  # the runs' (job.devices)
        "commit": commit, "commit_dirty": dirty,
        "code": code_fingerprint(),
    }


def versions(env: dict) -> str:
    """`torch 2.14.1, CUDA 12.8, cuDNN 91000, NCCL 2.21.5, driver 580.1; 32 CPUs on 16 cores; commit 0123456789ab`;
    a bench held to some of the host's CPUs (taskset, a Slurm or container limit) says which:
    `32 CPUs, this bench on 0-7 (4 cores)`."""
    parts = [f"torch {env['torch']}"]
    for key, label in (("torch_cuda", "CUDA"), ("cudnn", "cuDNN"), ("nccl", "NCCL")):
        if env.get(key):
            parts.append(f"{label} {env[key]}")
    parts.append(f"driver {env['driver']}" if env.get("driver") else "no GPU driver")
    cores = env.get("cpu_cores")
    allowed = env.get("cpus")
    if allowed and allowed != cpu_list(list(range(env["cpu_count"]))):
        host = f"; {env['cpu_count']} CPUs, this bench on {allowed}" + (
            f" ({cores} core{'s' if cores != 1 else ''})" if cores else "")
    else:
        host = f"; {env['cpu_count']} CPUs" + (f" on {cores} cores" if cores else "")
    commit = env["commit"][:12] if env.get("commit") else "unknown commit (no .git; set GIT_COMMIT)"
    if env.get("commit_dirty"):
        commit += " + uncommitted changes"
    code = f", code {env['code']}" if env.get("code") else ""
    return ", ".join(parts) + f"{host}; commit {commit}{code}"
