"""The real-data rows' files, generated on disk once and reused: bench.imagefolder's JPEG files (so the
imagefolder rows decode real files like ImageNet's) and bench.tokens's token file (the tokens rows)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from job.devices import usable_cores
from job.errors import UsageError

log = logging.getLogger("job")
IMAGE_CLASSES = 10
SHORT_SIDES = (64, 2048)  # bench.imagefolder_short_side's range, besides 0 (the ImageNet-like files)


def images_dir_name(short_side: int) -> str:
    """The generated files' folder under train.run_dir: bench-images, or bench-images-s<N> for files of a short
    side of N px (bench.imagefolder_short_side), so that each kind keeps its own."""
    return f"bench-images-s{int(short_side)}" if short_side else "bench-images"


def _make_images(args: tuple[str, list[tuple[int, int]], int, int]) -> int:
    """Write JPEGs [(index, class)] under root: smooth random colour fields with grain, ImageNet's typical
    500 x 333-375 (one in four portrait), quality 95, so that their size (about 115 kB) and decode cost are
    like ImageNet's; with `short_side`, each such image resized (bicubic) to that short side before it is
    saved, as a folder resized once. Returns the bytes written."""
    import numpy as np
    from PIL import Image

    from job.shrink import target_size, write_image

    root, items, seed, short_side = args
    total = 0
    for i, cls in items:
        rng = np.random.default_rng(seed * 1_000_003 + i)
        w, h = 500, int(rng.integers(333, 376))
        if rng.random() < 0.25:
            w, h = h, w
        small = rng.integers(0, 256, size=(int(rng.integers(6, 24)), int(rng.integers(6, 24)), 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.int16)
        img = img + rng.normal(0, 12, size=(h, w, 3)).astype(np.int16)
        path = Path(root) / f"class_{cls:02d}" / f"img_{i:06d}.jpg"
        image = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
        if short_side:
            image = image.resize(target_size(w, h, short_side), Image.BICUBIC)
        total += write_image(image, path, "JPEG", quality=95)  # a full disk raises, never a truncated file
    return total


def image_folder(root: Path, images: int, *, seed: int = 0, short_side: int = 0) -> dict[str, Any]:
    """An ImageFolder root of `images` generated JPEGs in IMAGE_CLASSES classes (resized to `short_side` px
    where it is not 0), reused when its MANIFEST.json says it holds the same; returns the manifest (path,
    images, classes, short_side, bytes, generated_s)."""
    manifest = root / "MANIFEST.json"
    want = {"images": images, "classes": IMAGE_CLASSES, "seed": seed, "format": 2}
    resized = {"short_side": short_side} if short_side else {}  # absent: the ImageNet-like files' manifests stay valid
    doc = None
    if manifest.is_file():
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(manifest.read_text())
    if isinstance(doc, dict) and {k: doc.get(k) for k in want} == want and doc.get("short_side", 0) == short_side:
        log.info("bench: reusing %d generated JPEG files in %s", images, root)
        return {"path": str(root), "images": images, "classes": IMAGE_CLASSES, "short_side": short_side,
                "bytes": int(doc["bytes"]), "generated_s": None}
    if not (isinstance(doc, dict) and "format" in doc) and _holds_files(root):  # never replace a folder of yours
        raise UsageError(f"{root} holds files the bench did not generate (no MANIFEST.json of its own), and it "
                         "writes its generated JPEG files there, replacing what is in it: give a new or empty folder "
                         "(bench.imagefolder_dir, or --dir; to time your own files, train on them: data.path)")
    shutil.rmtree(root, ignore_errors=True)
    for c in range(IMAGE_CLASSES):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"format": want["format"], "generating": True}) + "\n")  # ours, if stopped midway
    log.info("bench: generating %d JPEG files in %s (once; later benches reuse them)", images, root)
    t = time.monotonic()
    items = [(i, i % IMAGE_CLASSES) for i in range(images)]
    procs = max(1, min(usable_cores(), 16, images // 100))
    chunks = [(str(root), items[j::procs], seed, short_side) for j in range(procs)]
    if procs == 1:
        total = _make_images(chunks[0])
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(procs) as pool:
            total = sum(pool.map(_make_images, chunks))
    took = round(time.monotonic() - t, 2)
    doc = {**want, **resized, "bytes": total, "generated_s": took}
    tmp = manifest.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(manifest)  # written last: a half-generated folder is regenerated next time
    return {"path": str(root), "images": images, "classes": IMAGE_CLASSES, "short_side": short_side, "bytes": total,
            "generated_s": took}


def _holds_files(root: Path) -> bool:
    """Whether `root` is something other than a missing or empty folder."""
    if not root.exists():
        return False
    if not root.is_dir():
        return True
    with os.scandir(root) as entries:
        return next(entries, None) is not None


def token_file(root: Path, *, tokens: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """A flat file of `tokens` random token ids below `vocab` (uint16 when they fit, else uint32), reused
    when it exists with that name (the name holds all four); returns path, tokens, dtype, bytes, generated_s."""
    import numpy as np

    dtype = "uint16" if vocab <= 2**16 else "uint32"
    path = root / f"tokens-{vocab}-{tokens}-{seed}.{dtype}.bin"
    item = np.dtype(dtype).itemsize
    took = None
    if not (path.is_file() and path.stat().st_size == tokens * item):
        root.mkdir(parents=True, exist_ok=True)
        log.info("bench: generating a token file of %d tokens in %s (once; later benches reuse it)", tokens, path)
        t = time.monotonic()
        rng = np.random.default_rng(seed)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for start in range(0, tokens, 1 << 24):
                rng.integers(0, vocab, size=min(1 << 24, tokens - start), dtype=np.dtype(dtype)).tofile(f)
        tmp.replace(path)  # renamed last: a half-written file is written again next time
        took = round(time.monotonic() - t, 2)
    else:
        log.info("bench: reusing the token file %s", path)
    return {"path": str(path), "tokens": tokens, "dtype": dtype, "bytes": tokens * item, "generated_s": took}
