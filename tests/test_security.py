"""Nobody in, nothing lost (docs/security.md): what a job exposes on the network, what another local user can
plant or block, and what reaches a script, a file name or a label. Real processes on CPU, real sockets on
loopback, a real second user (useradd, setpriv)."""

from __future__ import annotations

import ipaddress
import os
import resource
import socket
import subprocess
import time
from pathlib import Path

from _telemetry_helpers import free_port, get
from conftest import ROOT, job_cmd

SMALL = ["workload=tiny", "workload.width=8", "workload.image_size=16", "train.device=cpu", "train.log_every=5",
         "train.batch_size=16"]


def env(**extra) -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "JOB_FAULT")
    out = {k: v for k, v in os.environ.items() if k not in drop}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**out, **extra}


def metric_lines(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def wait_until(predicate, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"exited {proc.returncode} before {what}: {proc.communicate()[1]}"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"not reached within {timeout} s: {what}")


# -- listening sockets --------------------------------------------------------------------------------------
def family_tree(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc/*/stat's parent field)."""
    parents = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        cur = todo.pop()
        out.append(cur)
        todo += [c for c, parent in parents.items() if parent == cur]
    return out


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s local address (groups of 4 bytes in host order) as text."""
    raw = bytes.fromhex(hex_addr)
    fixed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(fixed))


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state held by one of `pids`."""
    owner = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in owner:  # 0A: LISTEN
                addr, port = f[1].rsplit(":", 1)
                out.append((owner[f[9]], _address(addr), int(port, 16)))
    return out


def test_a_two_rank_job_listens_on_loopback_only(tmp_path):
    """The rendezvous store, gloo, the metrics servers of both ranks: nothing of a plain-command ddp job
    listens beyond loopback (the store listened on every interface: anyone reaching it can make the ranks
    run code)."""
    port = free_port()
    proc = subprocess.Popen(job_cmd("train", *SMALL, "strategy=ddp", "strategy.nprocs=2", "train.steps=100000",
                                    f"train.run_dir={tmp_path}", "train.run_id=net", f"telemetry.port={port}"),
                            cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: metric_lines(tmp_path / "net") >= 1, proc, "the first logged step")
        pids = family_tree(proc.pid)
        socks = listening_sockets(pids)
    finally:
        proc.terminate()
        proc.communicate(timeout=120)
    assert len(pids) == 3, pids  # the launcher and two ranks
    ports = {p for _, _, p in socks}
    assert port in ports and len(socks) >= 4, socks  # metrics x2, store, gloo
    wide = [s for s in socks if not ipaddress.ip_address(s[1]).is_loopback]
    assert not wide, f"listening beyond loopback: {wide} (all: {socks})"


# -- the metrics port ---------------------------------------------------------------------------------------
def _limit_nofile(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open_files_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-file limit in /proc/PID/limits")


def test_slow_clients_and_a_connection_flood_do_not_hurt_the_run(tmp_path):
    """600 clients trickling a request in (each read within the per-read timeout) plus a flood of short
    connections, against a run whose hard open-file limit is 512 and soft one 256: the run raises its soft
    limit, serves at most MAX_CONNECTIONS at once, writes every checkpoint and metrics line, exits 0 (it
    ran out of file descriptors and died at a checkpoint write)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # this test's own clients
    port = free_port()
    run = tmp_path / "flood"
    proc = subprocess.Popen(job_cmd("train", *SMALL, "strategy=dp", "train.steps=3000", "train.log_every=50",
                                    "train.checkpoint_every=100", f"train.run_dir={tmp_path}", "train.run_id=flood",
                                    f"telemetry.port={port}"),
                            cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_limit_nofile(256, 512))
    slow: list[socket.socket] = []
    try:
        wait_until(lambda: metric_lines(run) >= 1, proc, "the first logged step")
        assert _open_files_limit(proc.pid) == 512  # soft raised to hard at start
        for _ in range(600):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            slow.append(s)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            for s in list(slow):  # one header line each half second: no read waits long enough to time out
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    slow.remove(s)
                    s.close()
            for _ in range(100):  # and a flood of connections that come and go
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                except OSError:
                    pass
            time.sleep(0.5)
        assert proc.poll() is None, "the run ended before the flood did: make it longer"
        assert len(slow) <= 32, f"{len(slow)} slow connections are still served"
    finally:
        for s in slow:
            s.close()
    if proc.poll() is None:
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "Too many open files" not in err and "cannot write" not in err, err
    assert metric_lines(run) == 3000 // 50
    assert (run / "checkpoints" / "step_00003000.pt").is_file()
