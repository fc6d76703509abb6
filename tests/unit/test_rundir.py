"""job.rundir on its own: one writer per run directory, writes that are atomic or undone, nothing left by a
refused start, and run directories another user could tamper with refused."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat

import pytest

from job import rundir
from job.errors import UsageError


def _records(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    rundir.write_atomic(path, "one")
    assert path.read_text() == "one" and stat.S_IMODE(path.stat().st_mode) == 0o600

    def fail(src, dst):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(rundir.os, "replace", fail)
    with pytest.raises(OSError, match="quota"):
        rundir.write_atomic(path, "two")
    assert path.read_text() == "one" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_an_append_that_fails_halfway_is_cut_back(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    rundir.append_line(path, '{"step": 1}')
    real_write = os.write

    def half(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "write", half)
    with pytest.raises(OSError):
        rundir.append_line(path, '{"step": 2, "loss": 0.5}')
    assert path.read_text() == '{"step": 1}\n'  # no torn line for a reader


def test_records_after_the_resumed_step_are_dropped_in_place(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_records(5, 10, 15, 20))
    assert rundir.truncate_records(path, 10) == 2
    assert path.read_text() == _records(5, 10)
    path.write_text(_records(5, 10) + '{"step": 1')  # a line torn by a kill ends the kept part
    assert rundir.truncate_records(path, 10) == 1 and path.read_text() == _records(5, 10)
    assert rundir.truncate_records(path, 99) == 0 and rundir.truncate_records(tmp_path / "none", 1) == 0


def test_one_writer_per_run_directory(tmp_path):
    first = rundir.RunDir(tmp_path / "run")
    first.acquire()
    assert first.locked and first.created
    second = rundir.RunDir(tmp_path / "run")
    with pytest.raises(UsageError, match=r"run .*run is in use by another run .*pick another train.run_id"):
        second.acquire()
    first.start_writing(resumed_step=None)
    first.release()  # the lock goes with the process or the release, never left stuck
    second.acquire()
    assert second.locked and not second.created
    second.release()


def test_a_refused_start_leaves_no_trace(tmp_path):
    fresh = rundir.RunDir(tmp_path / "new")
    fresh.acquire()
    fresh.refused()
    assert not (tmp_path / "new").exists()  # created by this start, so removed
    existing = tmp_path / "old"
    existing.mkdir(mode=0o700)
    (existing / "config.yaml").write_text("a: 1\n")
    before = sorted(p.name for p in existing.iterdir())
    run = rundir.RunDir(existing)
    run.acquire()
    run.end()  # never wrote: an existing run keeps everything (the lock file aside)
    assert sorted(p.name for p in existing.iterdir() if p.name != rundir.LOCK_NAME) == before


def test_start_writing_clears_dead_writers_and_an_overwritten_run(tmp_path, caplog):
    path = tmp_path / "run"
    (path / "checkpoints").mkdir(parents=True, mode=0o700)
    path.chmod(0o700)
    (path / "checkpoints" / "step_00000004.pt").write_bytes(b"old")
    (path / "checkpoints" / ".step_00000008.pt.tmp.4242").write_bytes(b"half")
    (path / ".summary.json.tmp.4242").write_text("{")
    (path / "summary.json").write_text("{}")
    (path / "metrics.jsonl").write_text(_records(2, 4, 6))
    run = rundir.RunDir(path)
    run.acquire()
    with caplog.at_level(logging.INFO, logger="job"):
        run.start_writing(resumed_step=None)  # train.resume=overwrite: a fresh start in an old run
    left = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert left == [rundir.LOCK_NAME, "metrics.jsonl"] and (path / "metrics.jsonl").read_text() == ""
    assert "left by a run that died while writing it" in caplog.text
    assert "pid " in (path / rundir.LOCK_NAME).read_text()  # who holds it, for the next refusal's message
    run.release()


def test_a_failing_write_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    run = rundir.RunDir(tmp_path / "run")
    run.acquire()
    run.start_writing(resumed_step=None)

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir, "write_atomic", full)
    with caplog.at_level(logging.WARNING, logger="job"):
        assert run.write_text("summary.json", "{}") is False
        assert run.write_text("summary.json", "{}") is False
    warnings = [r for r in caplog.records if "summary.json (No space left on device" in r.getMessage()]
    assert len(warnings) == 1 and "training goes on without it" in warnings[0].getMessage()
    run.release()


def test_a_run_directory_others_could_tamper_with_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    os.symlink(target, tmp_path / "linked")
    with pytest.raises(UsageError, match="symlink"):
        rundir.RunDir(tmp_path / "linked").acquire()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UsageError, match=r"is writable by everyone \(mode 777\)"):
        rundir.RunDir(shared).acquire()
