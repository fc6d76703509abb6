"""The run directory: one writer at a time, no leftovers of a writer that died, no crash on a full disk.

`<train.run_dir>/<run id>/` holds config.yaml, metrics.jsonl, summary.json and checkpoints/. Two commands
started with the same run id would overwrite each other's checkpoints and interleave their metrics, so
the process that writes there (rank 0) holds an exclusive `flock` on `<run>/.lock` for as long as it
lives. The kernel drops that lock when the process ends, however it ends (kill -9 included), so a
crashed run never leaves it stuck, and a Slurm requeue of the same run id, which starts after the old
processes are gone, takes it again.

Nothing is written into the run directory until every start-up check has passed (`start_writing`):
a refused command leaves an existing run byte for byte as it was. Then, holding the lock, temporary
files found in the run belong to a writer that died mid-write and are removed.

Files are replaced atomically (temporary file in the same folder + rename); a write that fails (disk
full, quota, I/O error) leaves the previous version and no temporary file, and the trainer goes on with
one warning: losing a metrics line must not cost the run.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
import weakref
from pathlib import Path

from job.errors import UsageError

log = logging.getLogger("job")
LOCK_NAME = ".lock"
# `.<name>.tmp.<pid>` (this module and job.checkpoint) and `<name>.tmp` (older writers).
TEMP = re.compile(r"^\..+\.tmp\.\d+$|^.+\.tmp$")
# flock on a filesystem that does not support it (some network filesystems without their lock option).
_NO_LOCKS = {errno.ENOLCK, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}


def free_space(path: Path) -> str:
    """Free bytes on the filesystem holding `path`, for error messages ('?' if unknown)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return _human_bytes(shutil.disk_usage(p).free)
    except OSError:
        return "?"


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def temp_path(final: Path) -> Path:
    """Where `final` is written before the rename: hidden, never matching a final file's name."""
    return final.with_name(f".{final.name}.tmp.{os.getpid()}")


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` (temporary file, fsync, rename); on failure the old file and no
    temporary remain, and the OSError propagates."""
    tmp = temp_path(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink(missing_ok=True)


def append_line(path: Path, line: str) -> None:
    """Append one line; on failure cut the file back to where it was (a torn line would break readers)."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # the reader skips a torn last line (truncate_records)
            raise
    finally:
        os.close(fd)


def truncate_records(path: Path, step: int) -> int:
    """Drop the metrics records after `step` (a killed run logged steps that will be trained again).

    The file is cut in place (no copy: this works on a full disk). Records are in step order; an
    unreadable line (torn by a crash) ends the kept part too. Returns the number of records dropped.
    """
    if not path.is_file():
        return 0
    offset, cut_at, dropped = 0, None, 0
    with open(path, "rb") as f:
        data = f.read()
    for raw in data.split(b"\n"):
        if raw.strip():
            if cut_at is None:
                try:
                    over = int(json.loads(raw)["step"]) > step
                except (ValueError, KeyError, TypeError):
                    over = True
                if over:
                    cut_at = offset
            dropped += cut_at is not None
        offset += len(raw) + 1
    if cut_at is not None:
        os.truncate(path, cut_at)
    return dropped


class RunDir:
    """The run directory as its writer (rank 0) sees it: the lock, the first writes, the safe writes."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.created = False
        self.locked = False
        self._fd: int | None = None
        self._writing = False
        self._warned: set[str] = set()

    # -- owning it -------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the run's lock, or refuse with one line if another live process holds it."""
        self.created = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UsageError(
                f"cannot create the run directory {self.path} ({e.strerror}); set train.run_dir to a writable "
                "folder with free space"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd, self.path / LOCK_NAME)
            os.close(fd)
            raise UsageError(
                f"run {self.path} is in use by another run{f' ({holder})' if holder else ''}; wait for it to "
                "end or stop it, or pick another train.run_id"
            ) from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                os.close(fd)
                raise
            os.close(fd)
            log.warning("cannot lock %s (%s): the filesystem does not support flock, so a second run "
                        "started with the same run id would not be refused", self.path / LOCK_NAME, e.strerror)
            return
        self._fd, self.locked = fd, True
        if self.created:  # a start refused later (a busy port, a bad first batch) leaves no empty run behind
            atexit.register(_end, weakref.ref(self))  # weak: the lock goes with the trainer, not at exit

    def end(self) -> None:
        """Let go; a run directory this process created and never wrote to is removed again."""
        if self.created and not self._writing:
            self.refused()
        else:
            self.release()

    def refused(self) -> None:
        """Start-up was refused: let go, and leave no trace of a run directory this process created."""
        self.release()
        if self.created:
            self.created = False
            (self.path / LOCK_NAME).unlink(missing_ok=True)
            try:
                self.path.rmdir()  # only if empty
            except OSError:
                pass

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd, self.locked = None, False

    def __del__(self):
        try:
            self.end()
        except Exception:  # at interpreter shutdown
            pass

    # -- first writes ----------------------------------------------------------------------------
    def start_writing(self, *, resumed_step: int | None) -> None:
        """Every check passed: record who writes, remove dead writers' temporary files, and drop the
        metrics records a killed run logged after its last checkpoint."""
        self._writing = True
        if self._fd is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            text = f"pid {os.getpid()} on {socket.gethostname()}, started {stamp}\n".encode()
            try:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, text, 0)
            except OSError:
                pass  # only used in the refusal message of a second run
        if self.locked:  # only the lock holder writes here: every temporary file is a dead writer's
            for folder in (self.path, self.path / "checkpoints"):
                if not folder.is_dir():
                    continue
                for p in folder.iterdir():
                    if TEMP.match(p.name) and p.is_file():
                        p.unlink(missing_ok=True)
                        log.info("removed %s, left by a run that died while writing it", p)
        if resumed_step is not None:
            try:
                dropped = truncate_records(self.path / "metrics.jsonl", resumed_step)
            except OSError as e:
                self._warn("metrics.jsonl", e)
            else:
                if dropped:
                    log.info("metrics.jsonl: dropped %d record(s) after step %d (they are trained again)",
                             dropped, resumed_step)

    # -- writes that must not end the run ---------------------------------------------------------
    def write_text(self, name: str, text: str) -> bool:
        """Atomically replace `<run>/<name>`; on failure warn once per file and go on."""
        try:
            write_atomic(self.path / name, text)
            return True
        except OSError as e:
            self._warn(name, e)
            return False

    def append_line(self, name: str, line: str) -> bool:
        try:
            append_line(self.path / name, line)
            return True
        except OSError as e:
            self._warn(name, e)
            return False

    def _warn(self, name: str, e: OSError) -> None:
        if name in self._warned:
            return
        self._warned.add(name)
        log.warning("cannot write %s (%s; %s free there): training goes on without it; free space under %s",
                    self.path / name, e.strerror or e, free_space(self.path), self.path)


def _end(ref: weakref.ref) -> None:
    rd = ref()
    if rd is not None:
        rd.end()


def _holder(fd: int, path: Path) -> str:
    """Who holds the lock: what the holder recorded once it started writing, checked against the kernel's
    list of locks on this host (a holder still starting has not replaced the previous run's record)."""
    try:
        recorded = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        recorded = ""
    pids = _local_lock_pids(path)
    if not pids:  # held from another host (a shared filesystem), or /proc/locks unreadable
        return recorded
    if recorded.startswith(f"pid {pids[0]} "):
        return recorded
    return f"pid {pids[0]} on this host, still starting"


def _local_lock_pids(path: Path) -> list[int]:
    """Pids holding a flock on `path`, from /proc/locks (Linux; empty elsewhere)."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:  # "3: FLOCK  ADVISORY  WRITE 4242 00:2f:1234567 0 EOF"; waiters carry "->"
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK" or "->" in parts:
            continue
        try:
            major, minor, inode = parts[5].split(":")
            same = (int(inode) == st.st_ino and int(major, 16) == os.major(st.st_dev)
                    and int(minor, 16) == os.minor(st.st_dev))
            if same:
                pids.append(int(parts[4]))
        except ValueError:
            continue
    return pids
