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

Another user must not be able to plant or redirect anything here (docs/security.md): a run directory is
created 0700 and its files 0600; one that is a symlink, that another user owns, or that others can write is
refused in one line, and so is a run file that is a symlink; run files are opened without following links.

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
import stat
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
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# The names the trainer writes in a run directory (and checkpoints/step_*.pt): none may be a link.
RUN_FILES = (LOCK_NAME, "config.yaml", "metrics.jsonl", "summary.json", "memory_plan.json")


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
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
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
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | _NOFOLLOW, 0o600)
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
    cut_at = None
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | _NOFOLLOW)
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
        cut_at = _cut(data, step)
        if cut_at is not None:
            os.ftruncate(fd, cut_at[0])
    finally:
        os.close(fd)
    return 0 if cut_at is None else cut_at[1]


def _cut(data: bytes, step: int) -> tuple[int, int] | None:
    """(offset of the first record after `step`, records from there on), or None if none is."""
    offset, cut_at, dropped = 0, None, 0
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
    return None if cut_at is None else (cut_at, dropped)


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
        self.created = not os.path.lexists(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.mkdir(mode=0o700, exist_ok=True)
        except FileExistsError:
            pass  # a symlink or a file: refused below, in one line
        except OSError as e:
            raise UsageError(
                f"cannot create the run directory {self.path} ({e.strerror}); set train.run_dir to a writable "
                "folder with free space"
            ) from None
        check_private(self.path)
        try:
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | _NOFOLLOW, 0o600)
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
        _HELD[:] = [self.path]
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
        if resumed_step is None:  # a fresh start: train.resume=overwrite, or a run with no checkpoint yet
            self._start_over()
        try:
            dropped = truncate_records(self.path / "metrics.jsonl", resumed_step or 0)
        except OSError as e:
            self._warn("metrics.jsonl", e)
        else:
            if dropped:
                log.info("metrics.jsonl: dropped %d record(s) after step %d (they are trained again)",
                         dropped, resumed_step or 0)

    def _start_over(self) -> None:
        """A run starting from step 0 in a directory that holds an earlier one (only with
        train.resume=overwrite: `never` refuses an existing run): its checkpoints and summary go, so that
        none of them is taken for this run's."""
        gone = [p for p in _steps(self.path / "checkpoints") if p.is_file()]
        gone += [p for p in (self.path / "summary.json",) if p.is_file()]
        for p in gone:
            p.unlink(missing_ok=True)
        if gone:
            log.info("starting over in %s: removed the earlier run's %s", self.path, ", ".join(p.name for p in gone))

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


_HELD: list[Path] = []  # the run directory this process locked last (where a crash's traceback goes)


def held_dir() -> Path | None:
    """The run directory this process holds (or held last), if it still exists."""
    return _HELD[0] if _HELD and _HELD[0].is_dir() else None


def check_private(path: Path) -> None:
    """Refuse (UsageError, one line) a run directory another user could plant files in or redirect: a
    symlink, a folder another user owns or that others can write, a checkpoints/ folder likewise, or a run
    file that is a symlink."""
    for folder in (path, path / "checkpoints"):
        try:
            st = folder.lstat()
        except FileNotFoundError:
            continue
        problem = _dir_problem(st)
        if problem:
            raise UsageError(f"run directory {folder} {problem}: another user could plant files in it or redirect "
                             "the run's writes; use a train.run_dir of your own (mode 700), or another train.run_id")
    links = [p for p in [*(path / n for n in RUN_FILES), *_steps(path / "checkpoints")] if p.is_symlink()]
    if links:
        raise UsageError(f"{links[0]} is a symlink{f' ({len(links)} run files are)' if len(links) > 1 else ''}: a "
                         "run's files are never written or read through links; remove it, or use another "
                         "train.run_id")


def _steps(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.name.startswith("step_")] if folder.is_dir() else []
    except OSError:
        return []


def _dir_problem(st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return f"belongs to {_user(st.st_uid)}, not to this user ({_user(os.geteuid())})"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o002 or (mode & 0o020 and st.st_gid != os.getegid()):
        return f"is writable by {'everyone' if mode & 0o002 else 'its group'} (mode {mode:o})"
    return None


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


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
