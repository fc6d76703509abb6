"""Helpers the image data tests share (tests/unit/test_data_images.py, tests/gpu/test_gpu_data.py): a small
folder of JPEGs and PNGs, and a batch of its samples as the trainer gets it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from job.datasets import ImageFolder, SampleIndex

CPU = torch.device("cpu")


def make_folder(root: Path, per_class: int = 5, classes: int = 2, png_every: int = 4) -> Path:
    """JPEGs of several shapes (some portrait, some smaller than the crop), one PNG in every `png_every`."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            h, w = [(120, 160), (160, 120), (40, 50), (97, 131)][i % 4]
            small = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
            img = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC))
            ext = "png" if (c * per_class + i) % png_every == png_every - 1 else "jpg"
            Image.fromarray(img).save(root / f"c{c}" / f"{i}.{ext}")
    return root


def batch(ds: ImageFolder, ids: list[SampleIndex], device=CPU):
    """The samples `ids` of `ds`, collated and moved as the trainer does."""
    return ds.to_device(ds.collate([ds[i] for i in ids]), device)


def claim_size(path: Path, height: int, width: int) -> None:
    """Rewrite the JPEG at `path` so that its frame header claims `height` x `width` pixels (its data unchanged):
    a file of a few KB that would decode to gigabytes."""
    data = bytearray(path.read_bytes())
    i = 2
    while data[i + 1] not in (0xC0, 0xC1, 0xC2):  # to the frame header (SOF0-2), segment by segment
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    data[i + 5:i + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    path.write_bytes(bytes(data))
