"""Nobody in, nothing lost (docs/security.md): what a job exposes on the network, what another local user can
plant or block, and what reaches a script, a file name or a label. Real processes on CPU, real sockets on
loopback, a real second user (useradd, setpriv)."""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import pickle
import pwd
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _telemetry_helpers import free_port, get
from conftest import IN_CI, ROOT, job_cmd

from job import config, failure, rundir
from job.errors import UsageError

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
    # Whoever creates the telemetry peer folder's name first must not block the job: planted, open to all
    # (the name was predictable: trainjob-telemetry-<run>-<port>, and such a folder made the job refuse).
    planted = [Path(tempfile.gettempdir()) / f"trainjob-telemetry-{who}net-{port}" for who in ("", f"{os.geteuid()}-")]
    for folder in planted:
        folder.mkdir()
        folder.chmod(0o777)
    proc = subprocess.Popen(job_cmd("train", *SMALL, "strategy=ddp", "strategy.nprocs=2", "train.steps=100000",
                                    f"train.run_dir={tmp_path}", "train.run_id=net", f"telemetry.port={port}"),
                            cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: metric_lines(tmp_path / "net") >= 1, proc, "the first logged step")
        pids = family_tree(proc.pid)
        socks = listening_sockets(pids)
        argvs = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in pids[1:]]
        scrape = get(f"http://127.0.0.1:{port}/metrics")[1]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=120)
        for folder in planted:
            folder.rmdir()
    assert proc.returncode == 75, err
    assert 'trainjob_telemetry_peer_up{local_rank="1"} 1.0' in scrape, scrape[-2000:]
    # The config reached the ranks in memory, not as a file a killed launcher leaves in the temp folder.
    configs = [argv[argv.index(b"--config") + 1].decode() for argv in argvs]
    assert all(c.startswith("/proc/self/fd/") for c in configs), configs
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
    limit, serves at most MAX_CONNECTIONS at once, is served again once the flood is gone, and on SIGTERM writes
    its checkpoint and every metrics line up to it (it ran out of file descriptors and died at a checkpoint
    write). The run is far longer than the test, so it cannot end before /health is asked again."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # this test's own clients
    port = free_port()
    run = tmp_path / "flood"
    proc = subprocess.Popen(job_cmd("train", *SMALL, "strategy=dp", "train.steps=1000000", "train.log_every=50",
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
        deadline = time.monotonic() + 2.5
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
    # Served again once the flood's connections are gone: each is cut 10 s after it was accepted at the latest
    # (on a loaded machine the server may still be closing them when the first request comes).
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"exited {proc.returncode} during the flood: {proc.communicate()[1]}"
        try:
            assert get(f"http://127.0.0.1:{port}/health")[0] == 200
            break
        except (OSError, http.client.HTTPException):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err
    assert "Too many open files" not in err and "cannot write" not in err, err
    steps = sorted(int(p.stem.split("_")[1]) for p in (run / "checkpoints").glob("step_*.pt"))
    assert steps and steps[-1] >= 100, steps
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in logged if s % 50 == 0] == list(range(50, steps[-1] + 1, 50)), (logged, steps)


# -- strings that reach a script, a file name or a label ----------------------------------------------------
def string_keys(lists: bool = False) -> list[str]:
    """Every key of the schema whose value is a string or a list of strings (lists=True: the lists only)."""
    from omegaconf import OmegaConf

    base = OmegaConf.to_container(OmegaConf.structured(config.Config))
    out = []
    for key in config.all_keys():
        value = base
        for part in key.split("."):
            value = value[part]
        if (isinstance(value, str) and not lists) or (isinstance(value, list) and key.startswith("bench.")):
            out.append(key)
    return out


INJECTED = "x\n#SBATCH --account=evil\ntouch /tmp/injected"


def test_every_string_key_refuses_control_characters(capsys):
    """A newline in submit.folder wrote an `#SBATCH --account` line and a shell command into the script: no
    string key takes a line break, carriage return or NUL, and nothing is printed or submitted."""
    from job import submit

    keys, lists = string_keys(), set(string_keys(lists=True))
    assert {"submit.folder", "submit.partition", "train.run_id", "train.run_dir", "telemetry.peer_dir",
            "data.path", "bench.strategies"} <= set(keys), keys
    assert {"bench.strategies", "bench.workloads", "bench.imagefolder_variants"} <= lists, lists
    for key in keys:
        for bad in (INJECTED, "a\rb", "a\0b"):
            value = f"[{json.dumps(bad)}]" if key in lists else bad
            with pytest.raises(UsageError) as e:
                submit.main(["submit.dry_run=true", "submit.executor=slurm", f"{key}={value}"])
            line = str(e.value)
            assert f"`{key}` holds a control character" in line and "\n" not in line, (key, line)
    assert capsys.readouterr().out == ""  # no sbatch text
    # The check is the config's, so it also holds for a --config file and for what comes from elsewhere.
    with pytest.raises(UsageError, match="the sbatch script's python holds a control character"):
        submit.sbatch_text(config.load(["submit.executor=slurm"]), python="/opt/py\nrm -rf ~")


def test_an_injected_submit_folder_through_the_cli(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(json.dumps({"submit": {"folder": INJECTED}}))
    for args in ([f"submit.folder={INJECTED}"], ["--config", str(yaml_file)]):
        p = subprocess.run(job_cmd("submit", "submit.dry_run=true", *args), cwd=tmp_path, env=env(),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
        assert p.stderr.count("\n") == 1 and "`submit.folder` holds a control character" in p.stderr, p.stderr


def test_make_reads_its_settings_from_the_command_line_only():
    """`TIME='%E real' make submit` passed submit.timeout_min=%E real: GNU time's TIME (and any other
    environment variable of one of the Makefile's short names) is not a setting."""
    make = shutil.which("make")
    if make is None:
        if IN_CI:
            pytest.fail("make is missing in CI")
        pytest.skip("make not installed")
    leaked = {"TIME": "%E real", "NODES": "7", "GPUS": "9", "ARGS": "train.steps=1", "STRATEGY": "fsdp",
              "JOB": "1", "QOS": "x", "ACCOUNT": "a", "PARTITION": "p", "EXECUTOR": "local"}
    # A make that runs this test (`make test ARGS=...`) hands its own command-line variables down through
    # MAKEFLAGS: this test's make is a fresh one from a shell.
    base = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    dry = subprocess.run([make, "-n", "submit"], cwd=ROOT, env={**base, **leaked}, capture_output=True,
                         text=True, timeout=60).stdout
    line = next(ln for ln in dry.splitlines() if "-m job submit" in ln)
    assert line.split("-m job submit")[1].strip() == "", line
    asked = subprocess.run([make, "-n", "submit", "TIME=30", "NODES=2", "STRATEGY=ddp"], cwd=ROOT,
                           env={**base, **leaked}, capture_output=True, text=True, timeout=60).stdout
    line = next(ln for ln in asked.splitlines() if "-m job submit" in ln)
    assert line.split("-m job submit")[1].split() == ["strategy=ddp", "submit.nodes=2", "submit.timeout_min=30"]


# -- another user on the machine ------------------------------------------------------------------------------
OTHER = "trainjob-other"


def other_user() -> pwd.struct_passwd:
    """A second, unprivileged user (created once with useradd); needs root."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root: a second user is made with useradd")
        pytest.skip("needs root to add a second user (useradd) and act as it (setpriv)")
    try:
        return pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER],
                       capture_output=True, timeout=60)  # a concurrent test may have made it: look again
        return pwd.getpwnam(OTHER)


def as_other(*cmd: str, **kw) -> subprocess.CompletedProcess:
    pw = other_user()
    return subprocess.run(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--", *cmd],
                          capture_output=True, text=True, timeout=240, **kw)


@pytest.fixture
def shared():
    """A folder every user can create things in (sticky, like /tmp): where a shared train.run_dir lives."""
    path = Path(tempfile.mkdtemp(prefix="trainjob-shared-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def train(run_dir: Path, run_id: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(job_cmd("train", *SMALL, "strategy=dp", f"train.run_dir={run_dir}",
                                  f"train.run_id={run_id}", *args),
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def one_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_a_run_directory_another_user_made_is_refused(tmp_path, shared):
    """Another user makes the run directory in a shared run_dir first, with a checkpoint of their own and a
    `.lock` symlink to one of our files: the run refuses in one line, resumes nothing, overwrites nothing (it
    resumed the planted checkpoint and wrote its lock record through the link)."""
    assert train(tmp_path, "src", "train.steps=4").returncode == 0
    planted = shared / "planted.pt"
    shutil.copy(sorted((tmp_path / "src" / "checkpoints").glob("step_*.pt"))[-1], planted)
    planted.chmod(0o644)
    victim = shared / "victim.txt"
    victim.write_text("precious\n")
    runs = shared / "runs"
    runs.mkdir()
    runs.chmod(0o1777)
    run = runs / "r"
    for cmd in (["mkdir", "-p", str(run / "checkpoints")], ["cp", str(planted), str(run / "checkpoints" / "step_00000004.pt")],
                ["ln", "-s", str(victim), str(run / ".lock")]):
        r = as_other(*cmd)
        assert r.returncode == 0, r.stderr
    p = train(runs, "r", "train.steps=8")
    assert p.returncode == 2, p.stderr
    line = one_error(p.stderr)
    assert f"run directory {run} belongs to {OTHER}" in line and "train.run_dir of your own" in line, line
    assert "resumed from" not in p.stderr
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in run.rglob("*")) == [".lock", "checkpoints", "step_00000004.pt"]


def test_a_run_directory_others_can_write_is_refused_by_either_user(shared):
    """A run directory of root's that everyone may write: refused by root's run as writable by everyone, and
    by the other user's process (setpriv) as not theirs."""
    run = shared / "r"
    run.mkdir()
    run.chmod(0o777)
    p = train(shared, "r", "train.steps=2")
    assert p.returncode == 2 and "is writable by everyone (mode 777)" in one_error(p.stderr), p.stderr
    # The other user's own process, through the same code (job.rundir needs nothing but the standard library:
    # the system's Python, as the project's interpreter may sit in root's home).
    code = f"from job.rundir import RunDir\nRunDir({str(run)!r}).acquire()"
    system_python = "/usr/bin/python3"
    if not os.access(system_python, os.X_OK):
        pytest.fail(f"{system_python} is missing (Debian's python3, which the Makefile's setup uses too)")
    r = as_other("env", "PYTHONDONTWRITEBYTECODE=1", f"PYTHONPATH={ROOT}", system_python, "-c", code, cwd=shared)
    assert r.returncode == 1 and f"UsageError: run directory {run} belongs to root (uid 0), not to this user " \
        f"({OTHER}" in r.stderr, r.stderr
    assert list(run.iterdir()) == []


def test_run_files_are_private_and_never_followed(tmp_path):
    """A run's directory is 0700 and its files 0600; a run file that is a symlink (here metrics.jsonl and a
    checkpoint, to files elsewhere) is refused, and the files it points to are untouched."""
    assert train(tmp_path, "p", "train.steps=4").returncode == 0
    run = tmp_path / "p"
    assert (run.stat().st_mode & 0o777) == 0o700 and ((run / "checkpoints").stat().st_mode & 0o777) == 0o700
    files = [f for f in run.rglob("*") if f.is_file()]
    assert {f.name for f in files} >= {"config.yaml", "metrics.jsonl", "summary.json", ".lock", "step_00000004.pt"}
    assert all((f.stat().st_mode & 0o777) == 0o600 for f in files), {f.name: oct(f.stat().st_mode) for f in files}
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in ("metrics.jsonl", "checkpoints/step_00000004.pt"):
        real = run / name
        real.rename(tmp_path / "moved")
        real.symlink_to(victim if name == "metrics.jsonl" else tmp_path / "moved")
        p = train(tmp_path, "p", "train.steps=8")
        assert p.returncode == 2, p.stderr
        assert f"{real} is a symlink" in one_error(p.stderr) and "resumed from" not in p.stderr
        assert victim.read_text() == "precious\n"
        real.unlink()
        (tmp_path / "moved").rename(real)


def test_a_crash_traceback_is_private(tmp_path, monkeypatch):
    """A one-process crash's traceback goes into its run directory, 0600 (it went to /tmp/job-rank0-error-<pid>
    .txt, through symlinks, 0644); with no run directory, into a new private folder."""
    p = subprocess.run(
        job_cmd("train", *SMALL, "strategy=dp", f"train.run_dir={tmp_path}", "train.run_id=c", "train.steps=6"),
        cwd=ROOT, env=env(JOB_FAULT="0:3:raise"), capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, p.stderr
    line = one_error(p.stderr)
    path = tmp_path / "c" / "rank0-error.txt"
    assert line.endswith(f"; traceback: {path}"), line
    assert (path.stat().st_mode & 0o777) == 0o600 and "injected fault" in path.read_text()
    monkeypatch.setattr(rundir, "_HELD", [])
    where = failure.write_traceback("Traceback: boom\n", rank=3, log_dir=None)
    try:
        assert where.name == "rank3-error.txt" and where.read_text() == "Traceback: boom\n"
        assert (where.stat().st_mode & 0o777) == 0o600 and (where.parent.stat().st_mode & 0o777) == 0o700
        assert where.parent.parent == Path(tempfile.gettempdir()) and where.parent.name.startswith("job-rank3-error-")
    finally:
        shutil.rmtree(where.parent)


# -- python -m job status and submitit's result files --------------------------------------------------------
class _Plant:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _job_folder(root: Path, job_id: str) -> Path:
    folder = root / job_id
    folder.mkdir(parents=True)
    (folder / "trainjob.json").write_text(json.dumps({"job_id": job_id, "executor": "local", "tasks": 1,
                                                      "run_id": f"local-{job_id}", "run_dir": str(root / "run")}))
    return folder


def test_status_does_not_run_a_planted_result_pickle(tmp_path, shared):
    """`python -m job status` unpickled submitit's result files: one that calls code is not run, and one
    another user could have written is not believed."""
    marker = tmp_path / "marker"
    folder = _job_folder(tmp_path / "sub", "999999991")
    (folder / "999999991_0_result.pkl").write_bytes(pickle.dumps(("success", _Plant(marker))))
    p = subprocess.run(job_cmd("status", "999999991", f"submit.folder={tmp_path}/sub/%j"), cwd=tmp_path, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert not marker.exists(), "status ran the planted pickle"
    assert p.returncode == 0 and "COMPLETED" not in p.stdout, p.stdout + p.stderr
    # Plain data, but in a folder anyone can write, by another user: not the job's outcome.
    other = _job_folder(shared / "sub", "999999992")
    other.chmod(0o1777)
    plain = pickle.dumps(("success", {"run_id": "local-999999992", "exit_code": 0}))
    r = as_other(sys.executable, "-c", f"open({str(other / '999999992_0_result.pkl')!r}, 'wb').write({plain!r})")
    assert r.returncode == 0, r.stderr
    p = subprocess.run(job_cmd("status", "999999992", f"submit.folder={shared}/sub/%j"), cwd=tmp_path, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "COMPLETED" not in p.stdout, p.stdout + p.stderr
    from job import status

    job = status.locate("999999992", config.load([f"submit.folder={shared}/sub/%j"]))
    assert status._results(job)[0][1].endswith(f"was not read: it belongs to uid {other_user().pw_uid}, not to "
                                               "this user")


# -- telemetry peers -----------------------------------------------------------------------------------------
def test_a_peer_registration_is_followed_only_to_a_loopback_url(tmp_path):
    """`http://127.0.0.1:1@example.invalid/` passed a prefix test: the URL is parsed."""
    from job.telemetry.peers import _Merged, _write_private

    folder = tmp_path / "peers"
    folder.mkdir(mode=0o700)
    urls = {1: "http://127.0.0.1:1@example.invalid/", 2: "http://127.0.0.1:8/metrics?x", 3: "http://127.0.0.1:8/",
            4: "http://127.0.0.1.example.invalid:8/metrics", 5: "http://127.0.0.1:9401/metrics"}
    for rank, url in urls.items():
        _write_private(folder / f"local_rank-{rank}.json",
                       json.dumps({"url": url, "pid": os.getpid(), "run": "r", "local_rank": rank}))
    assert [p["url"] for p in _Merged(None, folder, "r").peers()] == [urls[5]]
