"""job.checkpoint on its own: what a save leaves on disk when it works and when it fails, what a load refuses,
and which checkpoint train.resume picks."""

from __future__ import annotations

import errno
import os
import pickle
import stat

import pytest
import torch

from job import checkpoint as ckpt
from job.errors import UsageError
from job.rundir import temp_path


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((2,), float(step))}, "optimizer": {}, "step": step, "data_position": step,
            "sample_position": 8 * step}


def test_a_save_is_private_and_keeps_the_newest(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        path = ckpt.save(folder, step, _state(step), keep=2)
    assert path == ckpt.path_for(folder, 15) and path.name == "step_00000015.pt"
    assert ckpt.list_checkpoints(folder) == [ckpt.path_for(folder, 10), path]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    state = ckpt.load(path)
    assert state["format"] == ckpt.FORMAT_VERSION and state["step"] == 15 and torch.equal(state["model"]["w"],
                                                                                             torch.full((2,), 15.0))
    assert ckpt.step_of(path) == 15 and ckpt.step_of(tmp_path / "notes.txt") is None


def test_a_failed_write_leaves_the_checkpoints_as_they_were(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    kept = ckpt.save(folder, 5, _state(5), keep=1)
    before = kept.read_bytes()

    def full_disk(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(ckpt.WriteFailed, match=r"checkpoint .*step_00000010.pt was not written \(No space left on "
                                                r"device; .* free there\)"):
        ckpt.save(folder, 10, _state(10), keep=1)
    assert sorted(p.name for p in folder.iterdir()) == [kept.name]  # no temporary file, the old one not deleted
    assert kept.read_bytes() == before


def test_a_stop_at_once_during_a_save_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """A second Ctrl-C mid-write leaves through job.failure.stop_now, which calls discard_partial: the file being
    written goes, the checkpoints written before stay."""
    folder = tmp_path / "checkpoints"
    kept = ckpt.save(folder, 5, _state(5), keep=3)
    seen = []

    def interrupted(obj, f):
        f.write(b"half a checkpoint")
        seen.append(sorted(p.name for p in folder.iterdir()))
        ckpt.discard_partial()  # what stop_now does before os._exit, in the middle of the write
        seen.append(sorted(p.name for p in folder.iterdir()))
        raise OSError(errno.EINTR, "stopped")

    monkeypatch.setattr(ckpt.torch, "save", interrupted)
    with pytest.raises(ckpt.WriteFailed):
        ckpt.save(folder, 10, _state(10), keep=3)
    assert seen == [[temp_path(ckpt.path_for(folder, 10)).name, kept.name], [kept.name]]
    ckpt.discard_partial()  # nothing in flight: nothing happens
    assert [p.name for p in folder.iterdir()] == [kept.name] and ckpt.load(kept)["step"] == 5


def test_a_save_never_writes_through_a_planted_link(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, temp_path(ckpt.path_for(folder, 3)))
    with pytest.raises(ckpt.WriteFailed):
        ckpt.save(folder, 3, _state(3), keep=1)
    assert victim.read_text() == "precious" and not ckpt.list_checkpoints(folder)


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    (b"not a zip file", "is corrupt or not a checkpoint"),
    ("object", "holds Python objects other than tensors and plain data"),
    ({"model": {}, "step": 1, "data_position": 1}, "is not a format-"),
    ({"format": ckpt.FORMAT_VERSION, "model": {}, "step": -1, "data_position": 0}, "has no valid `step` (found -1)"),
    ({"format": ckpt.FORMAT_VERSION, "model": {}, "step": True, "data_position": 0}, "has no valid `step`"),
    ({"format": ckpt.FORMAT_VERSION, "model": {}, "step": 2, "data_position": 2, "sample_position": "x"},
     "has a corrupt `sample_position`"),
])
def test_a_checkpoint_that_is_not_ours_is_refused_in_one_line(tmp_path, content, message):
    path = tmp_path / "step_00000001.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "object":
        torch.save({"format": ckpt.FORMAT_VERSION, "model": {}, "step": 1, "data_position": 1,
                    "payload": pickle.PickleError()}, path)  # any class: unpickling it could run code
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(UsageError) as e:
        ckpt.load(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_resume_picks_the_newest_and_never_refuses_to_replace_a_run(tmp_path):
    run = tmp_path / "run"
    folder = run / "checkpoints"
    assert ckpt.find_resume("auto", folder) is None and ckpt.find_resume("never", folder) is None
    for step in (2, 4):
        ckpt.save(folder, step, _state(step), keep=5)
    (folder / ".step_00000006.pt.tmp.99").write_bytes(b"a writer died here")  # not a complete checkpoint
    assert ckpt.find_resume("auto", folder) == ckpt.path_for(folder, 4)
    assert ckpt.find_resume("overwrite", folder) is None
    assert ckpt.find_resume(str(folder / "step_00000002.pt"), folder) == ckpt.path_for(folder, 2)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UsageError, match=r"train.resume=never but .* already holds a run \(2 checkpoints, "
                                         r"metrics.jsonl\)"):
        ckpt.find_resume("never", folder)


def test_a_model_that_does_not_fit_the_checkpoint_names_the_differences():
    model = {"a": torch.zeros(2), "b": torch.zeros(3, 3), "c": torch.zeros(1)}
    saved = {"a": torch.zeros(2), "b": torch.zeros(3, 4), "d": torch.zeros(1)}
    assert ckpt.mismatch(model, saved) == ("1 missing from the checkpoint: c; 1 not in this model: d; "
                                           "1 of another shape (saved vs now): b (3, 4) vs (3, 3)")
    many = {f"k{i}": torch.zeros(1) for i in range(5)}
    assert ckpt.mismatch(many, {}).startswith("5 missing from the checkpoint: k0, k1, k2 and 2 more")
