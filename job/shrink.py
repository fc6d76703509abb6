"""`python -m job.shrink SRC DST [--short-side 256] [--quality 90] [--procs N]`: a copy of an image folder whose
images are resized to a short side of N px, for hosts whose cores cannot decode the originals as fast as the
GPU trains (libjpeg-turbo decodes ImageNet-sized JPEGs resized to 256 px about 2-3 times as fast).

Every file under SRC that ImageFolder reads (torchvision's IMG_EXTENSIONS) is written to the same relative path
under DST, so class folders, file names, the samples' order and so their ids stay the same: an image whose
short side is larger than N is resized to N (the aspect ratio kept, bicubic, after a JPEG's DCT scaling) and
saved in its own format (JPEG and WebP at --quality); one already at N or smaller is copied byte for byte.
Metadata (EXIF, ICC profiles) is not kept; the training decoders ignore it (EXIF orientation included), so a
sample's pixels are those of its original, only smaller. Other files are left out.

Each file is written under a temporary name and renamed, so a stopped run (Ctrl-C, SIGTERM, a full disk) keeps
every file it finished and the same command continues where it stopped; DST's SHRINK.json records the settings,
and a DST made with others is refused. A file that does not decode is named and left out, and the command exits 1
after the others are written. Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import shutil
import signal
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from job.devices import usable_cores
from job.errors import EXIT_INTERRUPTED, EXIT_USAGE, UsageError

SIDES = (64, 2048)  # --short-side's range
QUALITIES = (50, 100)  # --quality's range (JPEG and WebP)
MANIFEST = "SHRINK.json"
PART = ".part"  # a file being written: not an image extension, so ImageFolder never reads one
CHUNK = 32  # files a task: small, so that a stop waits for little


class Stop(Exception):
    """SIGTERM (or SIGHUP) while the copy runs: stop after the files being written, keep the rest for a re-run."""


def _extensions() -> tuple[str, ...]:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    return tuple(IMG_EXTENSIONS)


def image_files(src: Path) -> list[str]:
    """The files ImageFolder would read under `src`, relative and sorted (symbolic links followed, as it does)."""
    exts, found = _extensions(), []
    for dirpath, dirs, files in os.walk(src, followlinks=True):
        dirs.sort()
        rel = Path(dirpath).relative_to(src)
        found.extend(str(rel / f) for f in sorted(files) if f.lower().endswith(exts))
    return found


def target_size(w: int, h: int, short_side: int) -> tuple[int, int]:
    """(width, height) with the short side `short_side` and the aspect ratio kept (to the pixel)."""
    scale = short_side / min(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


def write_image(image, path: Path, fmt: str, **options) -> int:
    """Save a PIL image to `path` in `fmt`; returns the bytes written. Encoded in memory and written by Python,
    which raises on a short write: Pillow saving to a path writes to the file descriptor itself and ignores a
    short write (a full disk, a file size limit), leaving a truncated image and no error."""
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    Path(path).write_bytes(buf.getbuffer())
    return buf.getbuffer().nbytes


def _open_large(src: Path):
    """Image.open without Pillow's decompression-bomb refusal, which it makes from the header alone: a JPEG
    too large to decode whole (what data.max_pixels refuses to train on) decodes at a fraction of its size
    here (draft), so the check is made on what will be decoded (_check_decode)."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        return Image.open(src)
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def _check_decode(im) -> None:
    """ValueError where `im` would decode to more pixels than Pillow's limit allows (twice MAX_IMAGE_PIXELS,
    where Image.open refuses a file)."""
    from PIL import Image

    w, h = im.size
    if Image.MAX_IMAGE_PIXELS and w * h > 2 * Image.MAX_IMAGE_PIXELS:
        raise ValueError(f"{w:,} x {h:,} pixels to decode, more than Pillow's limit of "
                         f"{2 * Image.MAX_IMAGE_PIXELS:,} (only a JPEG decodes at a fraction of its size)")


def shrink_one(src: Path, dst: Path, short_side: int, quality: int) -> tuple[str, int]:
    """Write `src` (an image) to `dst` resized to `short_side`, or copied where it is no larger: ("resized" or
    "copied", bytes written). A file PIL cannot decode raises ValueError (its reason); a write that fails,
    OSError (the partial file removed)."""
    from PIL import Image

    try:
        with _open_large(src) as im:
            w, h = im.size
            fmt = "JPEG" if im.format == "MPO" else im.format  # MPO: a camera's JPEG with a second frame
            if min(w, h) > short_side:
                size = target_size(w, h, short_side)
                if fmt == "JPEG":
                    im.draft(im.mode, size)  # DCT scaling to no less than `size`: a fraction of the decode
                _check_decode(im)
                im.load()
                out = im if im.mode in ("RGB", "L") else im.convert("RGB")
                out = out.resize(size, Image.BICUBIC)
            else:
                out = None
    except OSError as e:  # PIL's "cannot identify image file", truncated data, unreadable file
        if isinstance(e, (PermissionError, FileNotFoundError)):
            raise ValueError(e.strerror or str(e)) from None
        raise ValueError(str(e).split("\n")[0] or type(e).__name__) from None
    except (ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(str(e).split("\n")[0] or type(e).__name__) from None
    part = dst.with_name(dst.name + PART)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if out is None:
            shutil.copyfile(src, part)
            kind, size = "copied", src.stat().st_size
        else:
            kind = "resized"
            size = write_image(out, part, fmt or "JPEG", **({"quality": quality} if fmt in ("JPEG", "WEBP") else {}))
        if part.stat().st_size != size:
            raise OSError(errno.EIO, f"wrote {part.stat().st_size} of {size} bytes")
        os.replace(part, dst)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return kind, size


def _task(args: tuple[str, str, list[str], int, int]) -> list[tuple]:
    """A worker's chunk: (relative path, "resized" | "copied" | "bad" | "write", bytes read, bytes written or
    the reason). It stops at the first write that fails (the disk is full, DST is not writable): the rest of
    the chunk is for the next run."""
    src, dst, rels, short_side, quality = args
    out = []
    for rel in rels:
        s, d = Path(src) / rel, Path(dst) / rel
        try:
            size_in = s.stat().st_size
            kind, size_out = shrink_one(s, d, short_side, quality)
            out.append((rel, kind, size_in, size_out))
        except ValueError as e:
            out.append((rel, "bad", 0, str(e)))
        except OSError as e:
            out.append((rel, "write", 0, e.strerror or str(e)))
            break
    return out


def _worker_init() -> None:
    # The parent stops the copy (a signal to the whole process group, as Ctrl-C or Slurm's SIGTERM send, reaches
    # the workers too): a worker finishes its chunk, and the parent's shutdown cancels the rest.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)


def _check_manifest(dst: Path, settings: dict) -> None:
    path = dst / MANIFEST
    if not path.is_file():
        return
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        raise UsageError(f"{path} is not readable JSON; remove it (and DST's files if they are not this copy's) "
                    "and run again") from None
    if {k: doc.get(k) for k in settings} != settings:
        was = " ".join(f"--{k.replace('_', '-')} {doc.get(k)}" for k in settings)
        raise UsageError(f"{dst} was made with {was}; give the same settings to continue it, or a new DST")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def run(src: Path, dst: Path, *, short_side: int, quality: int, procs: int, out=None, err=None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    src, dst = src.resolve(), dst.resolve()
    if not src.is_dir():
        raise UsageError(f"{src} is not a folder; give SRC, an image folder (one sub-folder per class)")
    if dst == src or src in dst.parents or dst in src.parents:
        raise UsageError(f"DST {dst} and SRC {src} overlap; give a DST outside SRC (the copy never writes into SRC)")
    settings = {"short_side": short_side, "quality": quality}
    _check_manifest(dst, settings)
    files = image_files(src)
    if not files:
        raise UsageError(f"{src} holds no images ({' '.join(_extensions())}); give the ImageFolder root as SRC")
    todo = [f for f in files if not (dst / f).is_file()]
    done_before = len(files) - len(todo)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / MANIFEST).write_text(json.dumps({**settings, "source": str(src)}, indent=2) + "\n")
    print(f"shrink: {len(files):,} images in {src} -> {dst}, a short side of {short_side} px"
          f"{f' ({done_before:,} there from an earlier run)' if done_before else ''}", file=err, flush=True)
    counts = {"resized": 0, "copied": 0}
    size_in = size_out = 0
    bad: list[tuple[str, str]] = []
    failed: tuple[str, str] | None = None
    stopped: str | None = None
    t0 = last = time.monotonic()
    chunks = [todo[i:i + CHUNK] for i in range(0, len(todo), CHUNK)]
    pool = None
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def on_signal(signum, _frame):
        raise Stop(signal.Signals(signum).name)

    for s in previous:
        signal.signal(s, on_signal)
    try:
        if procs > 1 and len(chunks) > 1:
            from concurrent.futures import ProcessPoolExecutor

            pool = ProcessPoolExecutor(min(procs, len(chunks)), initializer=_worker_init)
            results = pool.map(_task, [(str(src), str(dst), c, short_side, quality) for c in chunks])
        else:
            results = (_task((str(src), str(dst), c, short_side, quality)) for c in chunks)
        n = 0
        for result in results:
            for rel, kind, read, written in result:
                if kind == "bad":
                    bad.append((rel, written))
                elif kind == "write":
                    failed = failed or (rel, written)
                else:
                    counts[kind] += 1
                    size_in += read
                    size_out += written
                n += 1
            if failed:
                break
            now = time.monotonic()
            if now - last >= 10:
                last = now
                print(f"shrink: {n + done_before:,} of {len(files):,} images ({(n + done_before) / len(files):.0%}), "
                      f"{n / (now - t0):,.0f} a second", file=err, flush=True)
    except KeyboardInterrupt:
        stopped = "Ctrl-C"
    except Stop as e:
        stopped = str(e)
    except BrokenProcessPool:  # a worker killed (the kernel's OOM killer, kill -9)
        stopped = "a worker process was killed"
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    written = counts["resized"] + counts["copied"]
    if stopped or failed:  # a killed worker's file being written (a worker that stopped cleanly removed its own)
        for f in todo:
            (dst / f).with_name(Path(f).name + PART).unlink(missing_ok=True)
    have = sum((dst / f).is_file() for f in files) if stopped or failed else written + done_before
    keep = f"{have:,} of {len(files):,} images are in DST and kept: the same command continues from there"
    if stopped:
        print(f"error: stopped ({stopped}); {keep}", file=err)
        return {"Ctrl-C": 130, "SIGTERM": EXIT_INTERRUPTED, "SIGHUP": EXIT_INTERRUPTED}.get(stopped, 1)
    if failed:
        print(f"error: cannot write {dst / failed[0]} ({failed[1]}); free space on {dst}'s disk or give another "
              f"DST, then run again: {keep}", file=err)
        return 1
    took = time.monotonic() - t0
    ratio = f" ({size_out / size_in:.2f}×)" if size_in else ""
    print(f"shrink: {written:,} images written to {dst} in {took:.1f} s on {procs} process{'es' if procs > 1 else ''}: "
          f"{counts['resized']:,} resized to a short side of {short_side} px, {counts['copied']:,} copied "
          f"(already that small){f', {done_before:,} there before' if done_before else ''}; "
          f"{_mb(size_in)} read, {_mb(size_out)} written{ratio}", file=out)
    if bad:
        first, reason = bad[0]
        more = f" (and {len(bad) - 1:,} more; each is listed above)" if len(bad) > 1 else ""
        for rel, why in bad[1:]:
            print(f"  not written: {src / rel} ({why})", file=err)
        print(f"error: {src / first} does not decode ({reason}){more}; it is left out of DST: fix or remove it "
              "in SRC and run again (class folders must keep an image each)", file=err)
        return 1
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints the usage block first)
        raise UsageError(f"{message}; see python -m job.shrink --help")


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m job.shrink", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="the image folder to copy (ImageFolder's root: a sub-folder per class)")
    p.add_argument("dst", type=Path, help="where the smaller copy goes (created; outside SRC)")
    p.add_argument("--short-side", type=int, default=256, help=f"px, {SIDES[0]}-{SIDES[1]} (default 256)")
    p.add_argument("--quality", type=int, default=90,
                   help=f"JPEG and WebP quality, {QUALITIES[0]}-{QUALITIES[1]} (default 90)")
    p.add_argument("--procs", type=int, default=usable_cores(), help="processes (default: every CPU it may use)")
    try:
        a = p.parse_args(argv)
        if not SIDES[0] <= a.short_side <= SIDES[1]:
            raise UsageError(f"--short-side {a.short_side} is out of range; give {SIDES[0]} to {SIDES[1]} px (e.g. 256)")
        if not QUALITIES[0] <= a.quality <= QUALITIES[1]:
            raise UsageError(f"--quality {a.quality} is out of range; give {QUALITIES[0]} to {QUALITIES[1]} (e.g. 90)")
        if a.procs < 1:
            raise UsageError(f"--procs {a.procs}: give 1 or more processes")
        return run(a.src, a.dst, short_side=a.short_side, quality=a.quality, procs=a.procs)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # DST not creatable, SRC unreadable while listing
        print(f"error: {e.filename or ''}: {e.strerror or e}; check the folder and its permissions", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
