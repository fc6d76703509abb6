"""Processes for multi-process strategies: start them, or join the group someone else started.

- Launched by torchrun, Slurm/submitit or a Kubernetes Indexed Job: RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR and MASTER_PORT are set; `init_group` joins.
- Run as a plain command: `spawn` re-runs `python -m job train` once per rank with those variables set
  (the resolved config passed as a file, so every rank sees the same run id), forwards SIGTERM/SIGINT/
  SIGUSR1/SIGUSR2 to the ranks and returns the worst exit code.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta

from job.errors import EXIT_INTERRUPTED, EXIT_OK, UsageError

log = logging.getLogger("job")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int


def dist_env(environ=os.environ) -> DistEnv | None:
    """The group this process was launched into, or None for a plain command."""
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise UsageError("RANK/WORLD_SIZE/LOCAL_RANK must be integers (set by torchrun or Slurm)") from None
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside WORLD_SIZE={world}")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if world > 1 and key not in environ:
            raise UsageError(f"{key} is not set; a multi-process launch needs MASTER_ADDR and MASTER_PORT")
    return DistEnv(rank, world, local)


def nprocs_for(cfg, cuda_count: int) -> int:
    """How many ranks a plain `ddp` command starts."""
    if cfg.strategy.nprocs:
        return cfg.strategy.nprocs
    return cuda_count if cuda_count and cfg.train.device != "cpu" else 1


def init_group(env: DistEnv, *, backend: str, device) -> None:
    import torch.distributed as dist

    if env.world_size == 1 or dist.is_initialized():
        return
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(minutes=10), **kw)


def destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cfg, nprocs: int) -> int:
    """Run the resolved config as `nprocs` local ranks; return 0, 75 if interrupted, else the worst code."""
    from omegaconf import OmegaConf

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="job-ranks-", delete=False) as f:
        f.write(OmegaConf.to_yaml(cfg))
        cfg_path = f.name
    port = _free_port()
    procs = []
    try:
        for rank in range(nprocs):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            # As torchrun does: ranks sharing a host must not each start a thread per core (CPU ranks
            # ran 6x slower oversubscribed); an explicit OMP_NUM_THREADS wins.
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
            cmd = [sys.executable, "-m", "job", "train", "--config", cfg_path]
            procs.append(subprocess.Popen(cmd, env=env))
        log.info("ddp: started %d ranks (pids %s)", nprocs, " ".join(str(p.pid) for p in procs))

        def forward(signum, _frame):
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in FORWARDED}
        try:
            codes = _wait_all(procs)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        os.unlink(cfg_path)
    if all(c == EXIT_OK for c in codes):
        return EXIT_OK
    if all(c in (EXIT_OK, EXIT_INTERRUPTED) for c in codes):
        return EXIT_INTERRUPTED
    bad = [c for c in codes if c not in (EXIT_OK, EXIT_INTERRUPTED)]
    log.error("ddp: rank exit codes %s", codes)
    return bad[0] if bad[0] > 0 else 1


def _wait_all(procs: list[subprocess.Popen]) -> list[int]:
    """Wait for every rank; if one fails, give the others a moment, then stop them (no hung group)."""
    import time

    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        failed = [c for c in codes if c not in (None, EXIT_OK, EXIT_INTERRUPTED)]
        if failed:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.2)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            return [p.wait() for p in procs]
        time.sleep(0.1)
