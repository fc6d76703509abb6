"""job.shrink: a smaller copy of an image folder that trains on the same samples (same relative paths, classes
and order, so the same sample ids), each image at the short side asked for; a stopped or failed copy keeps
what it finished and the same command continues it; bad arguments, broken files and a write that fails are one
line each."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT
from PIL import Image

from job.bench.imagefolder import image_folder
from job.datasets import ImageFolder
from job.shrink import MANIFEST, PART, image_files, main, target_size


def _noise(w: int, h: int, mode: str = "RGB", seed: int = 0, grain: float = 0.0) -> Image.Image:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(9, 12, 3), dtype=np.uint8)
    pixels = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.float32)
    pixels += rng.normal(0, grain, size=pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).convert(mode)


def _folder(root: Path) -> Path:
    """Two classes: landscape and portrait JPEGs larger than 256, a small one, a grey one, an RGBA PNG in a
    nested folder, and a file that is not an image."""
    (root / "cat" / "deep").mkdir(parents=True)
    (root / "dog").mkdir()
    _noise(500, 375, seed=1).save(root / "cat" / "a.jpg", quality=95)
    _noise(333, 500, seed=2).save(root / "cat" / "b.JPEG", quality=95)
    _noise(200, 150, seed=3).save(root / "cat" / "small.jpg", quality=95)
    _noise(640, 480, "L", seed=4).save(root / "dog" / "grey.jpg", quality=95)
    _noise(600, 300, "RGBA", seed=5).save(root / "cat" / "deep" / "c.png")
    (root / "dog" / "notes.txt").write_text("not an image\n")
    return root


def _shrink(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "job.shrink", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, **kw)


def test_target_size_keeps_the_aspect_ratio():
    assert target_size(500, 375, 256) == (341, 256)
    assert target_size(375, 500, 256) == (256, 341)
    assert target_size(256, 256, 64) == (64, 64)
    assert target_size(4000, 10, 64) == (25600, 64)


def test_the_copy_holds_the_same_samples_smaller(tmp_path, capsys):
    src = _folder(tmp_path / "src")
    dst = tmp_path / "dst"
    assert main([str(src), str(dst), "--short-side", "256", "--procs", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert "5 images written" in line and "4 resized to a short side of 256 px, 1 copied" in line, line
    # the same samples in the same order, so the same ids and classes
    rel = [(str(Path(p).relative_to(src)), c) for p, c in ImageFolder(src, image_size=32, num_classes=2).samples]
    assert [(str(Path(p).relative_to(dst)), c) for p, c in ImageFolder(dst, image_size=32, num_classes=2).samples] == rel
    assert not (dst / "dog" / "notes.txt").exists()
    assert (dst / MANIFEST).is_file()
    with Image.open(dst / "cat" / "a.jpg") as im:
        assert (im.size, im.format, im.mode) == ((341, 256), "JPEG", "RGB")
        got = np.asarray(im, dtype=np.float32)
    with Image.open(src / "cat" / "a.jpg") as im:
        want = np.asarray(im.resize((341, 256), Image.BICUBIC), dtype=np.float32)
    assert np.abs(got - want).mean() < 3.0  # the same picture (JPEG at quality 90, DCT scaling), not noise
    with Image.open(dst / "cat" / "b.JPEG") as im:
        assert im.size == (256, 384)
    with Image.open(dst / "dog" / "grey.jpg") as im:
        assert (im.size, im.mode) == ((341, 256), "L")
    with Image.open(dst / "cat" / "deep" / "c.png") as im:
        assert (im.size, im.format) == ((512, 256), "PNG")
    assert (dst / "cat" / "small.jpg").read_bytes() == (src / "cat" / "small.jpg").read_bytes()
    assert not list(dst.rglob(f"*{PART}"))


def test_the_same_command_continues_a_copy_and_other_settings_are_refused(tmp_path, capsys):
    src = _folder(tmp_path / "src")
    dst = tmp_path / "dst"
    assert main([str(src), str(dst), "--procs", "1"]) == 0
    (dst / "cat" / "a.jpg").unlink()
    (dst / "cat" / "a.jpg.part").write_bytes(b"half a file")  # what a killed run leaves
    before = (dst / "dog" / "grey.jpg").stat().st_mtime_ns
    capsys.readouterr()
    assert main([str(src), str(dst), "--procs", "1"]) == 0
    line = capsys.readouterr().out
    assert "1 images written" in line and "4 there before" in line, line
    assert (dst / "dog" / "grey.jpg").stat().st_mtime_ns == before  # not rewritten
    with Image.open(dst / "cat" / "a.jpg") as im:
        assert im.size == (341, 256)
    assert not (dst / "cat" / "a.jpg.part").exists()
    r = _shrink(src, dst, "--short-side", "128")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: {dst} was made with --short-side 256 --quality 90; give the same settings to continue it, or a new DST"]


@pytest.mark.parametrize("args, says", [
    (["{src}", "{dst}", "--short-side", "32"], "--short-side 32 is out of range; give 64 to 2048 px"),
    (["{src}", "{dst}", "--quality", "10"], "--quality 10 is out of range; give 50 to 100"),
    (["{src}", "{dst}", "--procs", "0"], "--procs 0: give 1 or more processes"),
    (["{src}", "{src}/copy"], "overlap; give a DST outside SRC"),
    (["{tmp}/nosuch", "{dst}"], "nosuch is not a folder; give SRC"),
    (["{tmp}/empty", "{dst}"], "holds no images"),
    (["{src}"], "the following arguments are required: dst; see python -m job.shrink --help"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, says):
    src = _folder(tmp_path / "src")
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    r = _shrink(*[a.format(src=src, dst=tmp_path / "dst", tmp=tmp_path) for a in args])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr
    assert not (tmp_path / "dst").exists() and not (src / "copy").exists()


def test_a_file_that_does_not_decode_is_named_and_the_rest_is_written(tmp_path):
    src = _folder(tmp_path / "src")
    good = (src / "cat" / "a.jpg").read_bytes()
    (src / "dog" / "cut.jpg").write_bytes(good[: len(good) // 3])  # truncated
    (src / "dog" / "text.png").write_text("not a png\n")
    dst = tmp_path / "dst"
    r = _shrink(src, dst, "--procs", "2")
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {src / 'dog' / 'cut.jpg'} does not decode (") and "and 1 more" in last, r.stderr
    assert f"not written: {src / 'dog' / 'text.png'}" in r.stderr
    assert "Traceback" not in r.stderr
    assert "5 images written" in r.stdout
    assert not (dst / "dog" / "cut.jpg").exists() and not (dst / "dog" / "text.png").exists()
    (src / "dog" / "cut.jpg").write_bytes(good)
    (src / "dog" / "text.png").unlink()
    r = _shrink(src, dst, "--procs", "2")
    assert r.returncode == 0 and "1 images written" in r.stdout and "5 there before" in r.stdout, r.stdout + r.stderr


def _file_limit(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_write_that_fails_stops_the_copy_in_one_line_and_keeps_the_files_written(tmp_path):
    """A real failing write: the process may not write files over 30 kB (RLIMIT_FSIZE), as a full disk refuses
    one (the small image, 7 kB, fits; a resized one does not). The copy stops with one line naming the file,
    leaves no partial file, and the same command without the limit finishes it."""
    src = _folder(tmp_path / "src")
    (src / "cat" / "deep" / "c.png").unlink()  # the first file over the limit is a JPEG: Pillow's encoder writes it
    for i in range(3):
        _noise(800, 600, seed=10 + i, grain=40).save(src / "dog" / f"big{i}.jpg", quality=95)  # ~45 kB at 256
    dst = tmp_path / "dst"
    r = _shrink(src, dst, "--procs", "1", preexec_fn=_file_limit(30_000), env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    assert lines[-1].startswith(f"error: cannot write {dst}/") and "(File too large)" in lines[-1], r.stderr
    assert "of 7 images are in DST and kept" in lines[-1]
    assert "the same command continues from there" in lines[-1] and "Traceback" not in r.stderr
    assert not list(dst.rglob(f"*{PART}"))
    for rel in image_files(dst):  # whole files only (Pillow, left to write a file itself, truncates silently)
        with Image.open(dst / rel) as im:
            im.load()
    r = _shrink(src, dst, "--procs", "1")
    assert r.returncode == 0 and "there before" in r.stdout, r.stdout + r.stderr
    assert len(image_files(dst)) == 7


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("many") / "src"
    image_folder(root, 600)
    return root


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize("how, procs, code, name", [
    ("SIGTERM to the process group", 2, 75, "SIGTERM"),  # as Slurm sends it: the workers get it too
    ("SIGINT", 1, 130, "Ctrl-C"),
    ("SIGKILL to a worker", 2, 1, "a worker process was killed"),  # the kernel's OOM killer
])
def test_a_stopped_copy_keeps_what_it_finished_and_continues(many, tmp_path, how, procs, code, name):
    dst = tmp_path / "dst"
    p = subprocess.Popen([sys.executable, "-m", "job.shrink", str(many), str(dst), "--procs", str(procs)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(dst.glob("class_0*/*.jpg")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.02)
    if how == "SIGTERM to the process group":
        os.killpg(p.pid, signal.SIGTERM)
    elif how == "SIGINT":
        p.send_signal(signal.SIGINT)
    else:
        os.kill(_children(p.pid)[-1], signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    assert p.returncode == code, out + err
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(rf"error: stopped \({re.escape(name)}\); ([\d,]+) of 600 images are in DST and kept: the same command "
                         "continues from there", last)
    assert found, err
    assert "Traceback" not in err
    kept = int(found[1].replace(",", ""))
    assert 0 < kept < 600 and len(list(dst.rglob("*.jpg"))) == kept
    assert not list(dst.rglob(f"*{PART}"))
    r = _shrink(many, dst, "--procs", "2")
    assert r.returncode == 0 and f"{kept:,} there before" in r.stdout, r.stdout + r.stderr
    assert len(list(dst.rglob("*.jpg"))) == 600


def test_a_jpeg_larger_than_pillow_decodes_whole_is_shrunk_at_a_fraction_and_others_are_named(tmp_path, monkeypatch):
    """What data.max_pixels refuses to train on, the copy shrinks: Pillow refuses a file from its header alone
    (more than twice Image.MAX_IMAGE_PIXELS), but a JPEG decodes at a fraction of its size (draft), within the
    limit. Other formats decode whole, so they are refused, with the size. (The limit is lowered here: an image
    past the real one is 179 megapixels.)"""
    from job.shrink import shrink_one

    _noise(100, 80).save(tmp_path / "big.jpg", quality=90)
    _noise(100, 80).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow refuses more than 2,000 pixels
    kind, size = shrink_one(tmp_path / "big.jpg", tmp_path / "out" / "big.jpg", 32, 90)
    assert kind == "resized" and (tmp_path / "out" / "big.jpg").stat().st_size == size
    with Image.open(tmp_path / "out" / "big.jpg") as im:
        assert im.size == (40, 32)
    with pytest.raises(ValueError, match=r"100 x 80 pixels to decode, more than Pillow's limit of 2,000"):
        shrink_one(tmp_path / "big.png", tmp_path / "out" / "big.png", 32, 90)
    assert Image.MAX_IMAGE_PIXELS == 1000  # put back after each open
