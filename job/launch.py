"""Processes for multi-process strategies: start them, or join the group someone else started.

- Launched by torchrun, Slurm/submitit or a Kubernetes Indexed Job: RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR and MASTER_PORT are set; `init_group` joins.
- Run as a plain command: `spawn` re-runs `python -m job train` once per rank with those variables set
  (the resolved config passed as a file, so every rank sees the same run id), forwards SIGTERM/SIGINT/
  SIGUSR1/SIGUSR2 to the ranks and returns 0, 75, or the code of the rank that failed first.

Exposure (docs/security.md): the rendezvous store (c10d's TCPStore, unauthenticated: whoever reaches it can
make the ranks run code) of a job whose MASTER_ADDR is a loopback address listens on that address only, not
on every interface: `spawn` binds it on 127.0.0.1 itself (no window between picking a free port and binding
it) and hands the listening socket to rank 0; gloo is kept on the loopback interface too. The resolved
config reaches the ranks through an anonymous in-memory file (nothing left in the temp folder by a launcher
that is killed).

Failure (docs/failures.md): the ranks of a spawned job run in their own session (a terminal's Ctrl-C reaches
the launcher once, which forwards it once) and die with the launcher (PR_SET_PDEATHSIG, plus each rank
watching its parent); when one rank fails the launcher gives the others a few seconds to leave on their own,
then kills them. A rank's error path never runs a collective: `abort_group` tears the group down locally.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from job.devices import usable_cores
from job.errors import EXIT_INTERRUPTED, EXIT_OK, UsageError

log = logging.getLogger("job")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
# After one rank fails: how long the others get to notice and leave by themselves (their own line, their own
# exit code) before the launcher kills them. A rank that lost a peer leaves in well under a second on gloo.
FAIL_GRACE_S = 5.0
# How long MASTER_ADDR may take to resolve before the launch is refused.
RESOLVE_TIMEOUT_S = 10.0


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
        local = _local_rank(environ, rank, world)
    except ValueError:
        raise UsageError("RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE must be integers (set by torchrun or "
                         "Slurm)") from None
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside WORLD_SIZE={world}")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if world > 1 and key not in environ:
            raise UsageError(f"{key} is not set; a multi-process launch needs MASTER_ADDR and MASTER_PORT")
    return DistEnv(rank, world, local)


def _local_rank(environ, rank: int, world: int) -> int:
    """LOCAL_RANK, or what it must be; never RANK on a launch that may span nodes (wrong card, or a card
    shared by two ranks on the second node)."""
    if "LOCAL_RANK" in environ:
        return int(environ["LOCAL_RANK"])
    if world == 1:
        return 0
    if "SLURM_LOCALID" in environ and environ.get("SLURM_PROCID") == str(rank):
        return int(environ["SLURM_LOCALID"])
    local_world = environ.get("LOCAL_WORLD_SIZE")
    if local_world is not None and int(local_world) == world:  # every rank on this node: local = global
        return rank
    why = (f"WORLD_SIZE={world} spans more than one node (LOCAL_WORLD_SIZE={local_world})" if local_world
           else f"nothing says how many of the WORLD_SIZE={world} ranks share this node (no LOCAL_WORLD_SIZE)")
    raise UsageError(f"LOCAL_RANK is not set and {why}; set LOCAL_RANK for each process (torchrun and "
                     "slurm/train.sbatch do), or LOCAL_WORLD_SIZE=WORLD_SIZE on a single node")


def check_master(environ=os.environ, *, timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
    """MASTER_PORT is a port and MASTER_ADDR resolves, within `timeout_s` (a bad name must not hang a rank)."""
    port, addr = environ.get("MASTER_PORT", ""), environ.get("MASTER_ADDR", "")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"MASTER_PORT={port!r} is not a TCP port; use a free port in 1-65535")
    result: list = []

    def resolve():
        try:
            socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)
            result.append(None)
        except (OSError, UnicodeError) as e:
            result.append(e)

    t = threading.Thread(target=resolve, daemon=True, name="resolve-master")
    t.start()
    t.join(timeout_s)
    if not result:
        raise UsageError(f"MASTER_ADDR={addr!r} did not resolve within {timeout_s:.0f} s; give rank 0's host "
                         "name or IP address")
    if result[0] is not None:
        reason = getattr(result[0], "strerror", None) or result[0]
        raise UsageError(f"MASTER_ADDR={addr!r} does not resolve ({reason}); give rank 0's host name or IP "
                         "address")


def nprocs_for(cfg, cuda_count: int) -> int:
    """How many ranks a plain `ddp` command starts."""
    if cfg.strategy.nprocs:
        return cfg.strategy.nprocs
    return cuda_count if cuda_count and cfg.train.device != "cpu" else 1


GB = 1e9


def raise_open_file_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit, as every process of the job starts: the soft default (often
    256 or 1024) is what a process gets without asking, not what the system allows, and a job's sockets,
    data workers and checkpoint writes share it (docs/security.md)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def cuda_count(cfg) -> int:
    """CUDA cards the ranks of a plain command would use (0 on the CPU)."""
    if cfg.train.device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _rss_bytes() -> int | None:
    """This process's resident memory (the launcher has imported torch, as every rank will)."""
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def check_host(nprocs: int, *, cuda_count: int, backend: str, available: int | None = None,
               per_rank: int | None = None) -> None:
    """Before a plain command starts `nprocs` ranks: refuse, with the arithmetic, what they cannot do here
    (UsageError): nccl without a card, more ranks than cards, more ranks than the host's memory holds (the
    kernel would kill them all minutes later without a line)."""
    if backend == "nccl" and cuda_count == 0:
        raise UsageError("strategy.backend=nccl needs a CUDA card per rank and this run has none (no card "
                         "visible, or train.device=cpu); use strategy.backend=auto or gloo")
    if cuda_count > 1 and nprocs > cuda_count:
        raise UsageError(f"strategy.nprocs={nprocs} starts one rank per card but {cuda_count} CUDA cards are "
                         f"visible; use strategy.nprocs={cuda_count} or fewer (0: one per card)")
    if available is None:
        from job.memplan import available_host_bytes

        available = available_host_bytes()
    per_rank = _rss_bytes() if per_rank is None else per_rank
    if available is None or not per_rank or nprocs * per_rank <= available:
        return
    fit = max(1, int(available // per_rank))
    raise UsageError(
        f"strategy.nprocs={nprocs} ranks need at least {nprocs} x {per_rank / GB:.2f} GB = "
        f"{nprocs * per_rank / GB:.1f} GB of host memory (each rank is a Python process with torch, as this "
        f"launcher is, before its model and data) but {available / GB:.1f} GB is available; use "
        f"strategy.nprocs={fit} or fewer")


class RendezvousError(Exception):
    """The ranks did not meet (one line, exit 1): a rank missing, or MASTER_ADDR/MASTER_PORT wrong."""


def init_group(env: DistEnv, *, backend: str, device, timeout_s: float) -> None:
    """Join the group; `timeout_s` bounds the rendezvous and every collective (strategy.timeout_s)."""
    import torch.distributed as dist

    if env.world_size == 1 or dist.is_initialized():
        return
    check_master()
    if backend == "nccl" and getattr(device, "type", None) != "cuda":
        raise UsageError(f"strategy.backend=nccl needs a CUDA card per rank, and rank {env.rank} runs on the CPU; "
                         "use strategy.backend=auto or gloo")
    kw = {"device_id": device} if backend == "nccl" else {}
    # c10d prints a C++ stack for every failed connection attempt: held back, and shown only if the
    # rendezvous succeeds (then it is a warning worth seeing); a failure is the one line below.
    with _stderr_held() as held:
        try:
            store = _loopback_store(env, timeout_s)
            if store is not None:
                kw["store"] = store
            dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                                    timeout=timedelta(seconds=timeout_s), **kw)
        except (RuntimeError, ValueError, OSError) as e:
            held.drop()
            text = getattr(e, "strerror", None) or str(e).strip()
            reason = text.splitlines()[0].rstrip(".") if text else type(e).__name__
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise RendezvousError(
                f"the {env.world_size} ranks did not meet at {where} within strategy.timeout_s={timeout_s:g} s "
                f"({reason}); check that every rank started and that MASTER_ADDR/MASTER_PORT name rank 0's host "
                "and a free port"
            ) from None


STORE_FD_VAR = "TRAINJOB_STORE_FD"  # spawn -> rank 0: the listening socket of the rendezvous store


def _is_loopback(addr: str) -> bool:
    """MASTER_ADDR names this host's loopback (an address in 127.0.0.0/8 or ::1, or a name resolving only to
    such addresses)."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def _loopback_store(env: DistEnv, timeout_s: float):
    """The job's TCPStore, bound to MASTER_ADDR's loopback address only; None where torch's own rendezvous
    stays in charge (ranks on several hosts, a MASTER_ADDR that is not loopback, or torchrun's agent store).

    torch's env:// rendezvous binds the store on every interface whatever MASTER_ADDR says; a job whose ranks
    all meet on loopback needs none of them."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0"))
    # Every rank on this host (LOCAL_WORLD_SIZE = WORLD_SIZE): only then is loopback enough. A name that
    # resolves to loopback on rank 0's node alone (Debian maps the host name to 127.0.1.1) is reached by other
    # nodes at its real address: torch's rendezvous then binds as it always did.
    one_host = os.environ.get("LOCAL_WORLD_SIZE") == str(env.world_size)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not one_host or not _is_loopback(addr):
        return None
    timeout = timedelta(seconds=timeout_s)
    if env.rank != 0:
        return dist.TCPStore(addr, port, env.world_size, False, timeout)
    fd_text = os.environ.pop(STORE_FD_VAR, "")
    if fd_text.isdigit():  # spawn bound it already
        listener = socket.socket(fileno=int(fd_text))
    else:
        family = socket.AF_INET6 if ":" in socket.getaddrinfo(addr, None)[0][4][0] else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, port))
        listener.listen(max(128, env.world_size))
    store = dist.TCPStore(addr, port, env.world_size, True, timeout, wait_for_workers=False,
                          master_listen_fd=listener.fileno())
    _LISTENERS.append(listener)  # the store serves from this descriptor for as long as the process lives
    return store


_LISTENERS: list[socket.socket] = []


def loopback_interface() -> str | None:
    """The loopback interface's name (lo on Linux, lo0 on macOS), for GLOO_SOCKET_IFNAME."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


class _stderr_held(contextlib.AbstractContextManager):
    """File descriptor 2 goes to a temporary file inside the block; written out at the end unless dropped."""

    def __enter__(self):
        self.keep = True
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def drop(self) -> None:
        self.keep = False

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        if self.keep:
            self.file.seek(0)
            held = self.file.read()
            if held:
                sys.stderr.write(held.decode(errors="replace"))
                sys.stderr.flush()
        self.file.close()
        return False


def destroy_group() -> None:
    """The clean exit: every rank is here, so a barrier is safe (and needed to exit cleanly)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def abort_group() -> None:
    """The error path: tear this rank's groups down without a collective (a barrier here would wait for a
    peer that is itself waiting in the gradient all-reduce). Peers see their pending collective fail."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # destroy_process_group() would shut NCCL down gracefully, waiting for pending work; the abort does not.
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group()


def die_with_launcher(environ=os.environ) -> None:
    """Rank side of "no orphans": a rank started by `spawn` ends when its launcher goes away.

    PR_SET_PDEATHSIG covers the launcher's death (even kill -9) on Linux; a watcher thread covers the rest
    (a launcher that died before this ran, or a platform without prctl). torchrun and Slurm watch their
    own workers.
    """
    launcher = environ.pop(LAUNCHER_VAR, None)  # popped: this rank's own children are not ranks
    if launcher is None or not launcher.isdigit():
        return
    parent = int(launcher)
    if os.getppid() != parent:
        try:
            os.kill(parent, 0)
            return  # alive, but not our parent: a variable left in the environment, not our launcher
        except ProcessLookupError:
            os._exit(1)  # the launcher died before this rank got here
        except PermissionError:
            return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # died between the check and prctl
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch-launcher").start()


def _listener() -> socket.socket:
    """The rendezvous store's listening socket: bound on loopback, port chosen by the kernel, kept open."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def _config_fd(text: str) -> tuple[int, str | None]:
    """The resolved config for the ranks: an anonymous in-memory file (gone with the last process holding it,
    even after kill -9), else a private temporary file removed after the ranks end. (fd, path to unlink)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("job-ranks-config", 0)  # no MFD_CLOEXEC: passed on to the ranks
        os.write(fd, text.encode())
        return fd, None
    fd, path = tempfile.mkstemp(prefix="job-ranks-", suffix=".yaml")  # 0600
    os.write(fd, text.encode())
    return fd, path


def rank_threads(nprocs: int) -> int:
    """OMP threads for each of `nprocs` ranks sharing this host, as torchrun sets: the CPUs this job may use
    (its affinity) shared out, at least 1 (CPU ranks each starting a thread per core ran 6x slower)."""
    return max(1, usable_cores() // nprocs)


def spawn(cfg, nprocs: int) -> int:
    """Run the resolved config as `nprocs` local ranks; return 0, 75 if interrupted, else the worst code."""
    from omegaconf import OmegaConf

    check_host(nprocs, cuda_count=cuda_count(cfg), backend=cfg.strategy.backend)
    cfg_fd, cfg_tmp = _config_fd(OmegaConf.to_yaml(cfg))
    # Linux: each rank opens /proc/self/fd/N afresh (its own offset); elsewhere the private file.
    cfg_path = f"/proc/self/fd/{cfg_fd}" if cfg_tmp is None else cfg_tmp
    listener = _listener()
    port = listener.getsockname()[1]
    lo = loopback_interface()
    # The ranks' telemetry registrations: a private folder nobody else can predict or create first.
    peer_dir = tempfile.mkdtemp(prefix="trainjob-telemetry-") if cfg.telemetry.port and not cfg.telemetry.peer_dir \
        else None
    procs = []
    try:
        for rank in range(nprocs):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env[LAUNCHER_VAR] = str(os.getpid())
            if lo:  # gloo's sockets on loopback too, whatever the host name resolves to
                env["GLOO_SOCKET_IFNAME"] = lo
            if peer_dir:
                env["TRAINJOB_PEER_DIR"] = peer_dir
            fds = (cfg_fd, listener.fileno()) if rank == 0 else (cfg_fd,)
            if rank == 0:
                env[STORE_FD_VAR] = str(listener.fileno())
            env.setdefault("OMP_NUM_THREADS", str(rank_threads(nprocs)))  # an explicit one wins
            cmd = [sys.executable, "-m", "job", "train", "--config", cfg_path]
            # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards it once (else each
            # rank would see it twice and take it for the second, immediate one).
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, pass_fds=fds))
            if rank == 0:
                listener.close()  # rank 0 holds it now
        log.info("%s: started %d ranks (pids %s)", cfg.strategy.name, nprocs, " ".join(str(p.pid) for p in procs))

        def forward(signum, _frame):
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in FORWARDED}
        try:
            codes, first = _wait_all(procs)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        listener.close()
        os.close(cfg_fd)
        if peer_dir:
            shutil.rmtree(peer_dir, ignore_errors=True)
        if cfg_tmp is not None:
            os.unlink(cfg_tmp)
    if all(c == EXIT_OK for c in codes):
        return EXIT_OK
    if all(c in (EXIT_OK, EXIT_INTERRUPTED) for c in codes):
        return EXIT_INTERRUPTED
    if first is None:
        first = next(r for r, c in enumerate(codes) if c not in (EXIT_OK, EXIT_INTERRUPTED))
    log.error("%s: the job stopped; rank exit codes %s", cfg.strategy.name, ", ".join(_code_text(c) for c in codes))
    # The code of the rank that failed first (the cause, not a peer that left because of it); killed by
    # signal N: 128 + N, as a shell reports it.
    return codes[first] if codes[first] > 0 else 128 - codes[first]


LAUNCHER_VAR = "TRAINJOB_LAUNCHER_PID"


def _code_text(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else str(code)


def _wait_all(procs: list[subprocess.Popen]) -> tuple[list[int], int | None]:
    """Wait for every rank; once one fails, the others get FAIL_GRACE_S to leave, then are killed.
    Returns the exit codes and the rank seen failing first (None if none failed while others ran)."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes, None
        failed = [r for r, c in enumerate(codes) if c not in (None, EXIT_OK, EXIT_INTERRUPTED)]
        if failed:
            deadline = time.monotonic() + FAIL_GRACE_S
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.1)
            for p in procs:
                if p.poll() is None:
                    p.kill()  # SIGKILL also ends a stopped (SIGSTOP) rank
            return [p.wait() for p in procs], failed[0]
        time.sleep(0.1)
