"""Readers for real data that any workload can return from its `dataset` (job.workload): a token file and an
image folder. Each is a map-style torch Dataset of (x, y) samples; the job picks their indices by global
sample id (job.data), so resume and re-splits see the same samples.

Bad data is bad input: one line naming the file and the fix (UsageError), raised when the dataset is built
(before the run writes anything) or, for a file that only fails when it is read, by the batch that reads it.

Random augmentation stays exact under resume and re-splits: a sample's crop and flip are drawn from a seed
made of the run's seed and the sample's global id (`SampleIndex.sample_id`), not from a worker's RNG.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from job.errors import UsageError

TOKEN_DTYPES = ("uint16", "uint32")


class SampleIndex(int):
    """A dataset index that also carries the global sample id it was drawn for (and the run's seed): a
    dataset may seed its random augmentation from it; to any other dataset it is a plain int."""

    sample_id: int
    seed: int

    def __new__(cls, index: int, sample_id: int, seed: int = 0):
        obj = super().__new__(cls, index)
        obj.sample_id, obj.seed = sample_id, seed
        return obj

    def __reduce__(self):  # DataLoader workers receive indices pickled
        return SampleIndex, (int(self), self.sample_id, self.seed)


def sample_seed(index) -> int | None:
    """A seed for this sample's augmentation (None for a plain index)."""
    if isinstance(index, SampleIndex):
        return (index.seed * 1_000_003 + index.sample_id * 7_919 + 17) % (2**63)
    return None


# -- tokens -----------------------------------------------------------------------------------------
class TokenFile:
    """A flat binary file of token ids (uint16 or uint32, native byte order: nanoGPT's train.bin), memory-mapped.

    Sample k is the window of seq_len + 1 tokens starting at token k x seq_len: x its first seq_len tokens,
    y the same shifted by one. The file is checked when opened: its size is a whole number of tokens, it
    holds at least one window, and no id reaches `vocab` (read in chunks: a few seconds per GB)."""

    def __init__(self, path: str | os.PathLike, *, seq_len: int, vocab: int, dtype: str = "uint16"):
        import numpy as np

        if dtype not in TOKEN_DTYPES:
            raise UsageError(f"data.token_dtype={dtype} is not a token type; use one of {', '.join(TOKEN_DTYPES)}")
        self.path, self.seq_len = str(path), int(seq_len)
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"data.path {path} is not a file; point data.path at a token file (e.g. train.bin, "
                             f"token ids as {dtype})")
        size = p.stat().st_size
        item = np.dtype(dtype).itemsize
        if size == 0:
            raise UsageError(f"token file {path} is empty; write token ids into it ({dtype}, e.g. "
                             "numpy.array(ids, dtype=numpy.uint16).tofile(path))")
        if size % item:
            raise UsageError(f"token file {path} has {size:,} bytes, not a whole number of {dtype} tokens "
                             f"({item} bytes each); check data.token_dtype or the file is truncated")
        n = size // item
        if n < self.seq_len + 1:
            raise UsageError(f"token file {path} holds {n:,} tokens, fewer than one sample of workload.seq_len="
                             f"{self.seq_len} + 1; use more data or a smaller workload.seq_len")
        self.tokens = np.memmap(p, dtype=dtype, mode="r")
        top = _max_token(self.tokens)
        if top >= vocab:
            raise UsageError(f"token file {path} holds token id {top:,}, and workload.vocab={vocab:,} has ids 0-"
                             f"{vocab - 1:,}; set workload.vocab={top + 1} or more (or re-tokenize)")
        self.windows = (n - 1) // self.seq_len

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index):
        import numpy as np
        import torch

        k = int(index)
        if not 0 <= k < self.windows:
            raise IndexError(index)
        start = k * self.seq_len
        chunk = torch.from_numpy(np.array(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


def _max_token(tokens, chunk: int = 1 << 26) -> int:
    top = 0
    for start in range(0, len(tokens), chunk):
        top = max(top, int(tokens[start:start + chunk].max()))
    return top


# -- image folders ----------------------------------------------------------------------------------
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class BadImage(UsageError):
    """A data file that does not decode; one line naming it.

    Raised in a DataLoader worker, it reaches the main process rebuilt from a message holding the
    worker's traceback; the constructor keeps only the line that names the file.
    """

    def __init__(self, message: str):
        text = str(message)
        if "Original Traceback" in text:
            found = re.findall(r"BadImage: (.+)", text)
            text = found[-1].strip() if found else text.strip().splitlines()[-1]
        super().__init__(text)


def load_image(path: str):
    """torchvision's default loader, with a decode failure turned into one line naming the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except UnidentifiedImageError:
        reason = "not an image format PIL knows, or a damaged header"
        raise BadImage(f"cannot read image {path} ({reason}); fix or remove the file") from None
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BadImage(f"cannot read image {path} ({reason}); fix or remove the file") from None


def check_imagefolder(path: str, *, num_classes: int) -> None:
    """An ImageFolder root with a class folder per class, each with at least one image: else UsageError.

    Cheap on big datasets: it stops at the first image of each class. (Whether every file decodes is
    found when it is read.)"""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    root = Path(path)
    try:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    except OSError as e:
        raise UsageError(f"cannot read data.path {root} ({e.strerror}); point data.path at an ImageFolder "
                         "root (one sub-folder per class)") from None
    if not classes:
        raise UsageError(f"data.path {root} holds no class folders; an ImageFolder root has one sub-folder "
                         f"per class with the images inside (e.g. {root / 'cat' / '0001.jpg'})")
    empty = [c for c in classes if not _has_image(root / c, IMG_EXTENSIONS)]
    if empty:
        shown = ", ".join(str(root / c) for c in empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
        raise UsageError(f"data.path: class folder {shown} holds no images ({' '.join(IMG_EXTENSIONS)}); add "
                         "images or remove the folder (every sub-folder of data.path is a class)")
    if len(classes) > num_classes:
        raise UsageError(f"data.path {root} has {len(classes)} class folders but workload.num_classes="
                         f"{num_classes}; set workload.num_classes={len(classes)}")


def _has_image(folder: Path, extensions: tuple[str, ...]) -> bool:
    for _dirpath, _dirs, files in os.walk(folder, followlinks=True):
        if any(f.lower().endswith(extensions) for f in files):
            return True
    return False


class ImageFolder:
    """torchvision's ImageFolder (one sub-folder per class), decoded to `image_size` x `image_size` and
    normalised with ImageNet's statistics.

    augment=False (evaluation, and training without augmentation): resize the short side, centre crop.
    augment=True: RandomResizedCrop(scale 0.08-1) and a horizontal flip, drawn from the sample's own seed
    (`sample_seed`), so the same sample id gets the same crop in every run, split and worker."""

    def __init__(self, path: str | os.PathLike, *, image_size: int, num_classes: int, augment: bool = False):
        from torchvision import datasets, transforms

        check_imagefolder(str(path), num_classes=num_classes)
        self.augment, size = augment, image_size
        self.normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        self.eval_tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size)])
        self.crop = transforms.RandomResizedCrop(size, antialias=True)
        try:
            self.folder = datasets.ImageFolder(str(path), loader=load_image)
        except FileNotFoundError as e:  # the folder changed since the check
            raise UsageError(f"data.path {path}: {e}") from None

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index):
        image, label = self.folder[int(index)]
        if not self.augment:
            return self.normalize(self.eval_tf(image)), label
        import torch
        from torchvision.transforms import functional as TF

        seed = sample_seed(index)
        with torch.random.fork_rng(devices=[]):  # the process's own RNG (the trainer's, with 0 workers) untouched
            if seed is not None:
                torch.manual_seed(seed)
            top, left, h, w = self.crop.get_params(image, self.crop.scale, self.crop.ratio)
            flip = bool(torch.rand(()) < 0.5)
        image = TF.resized_crop(image, top, left, h, w, self.crop.size, antialias=True)
        if flip:
            image = TF.hflip(image)
        return self.normalize(image), label
