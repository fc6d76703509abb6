"""Batches: deterministic by position, so a resumed or re-split run sees exactly the same samples.

A run consumes global sample ids 0, 1, 2, ... in micro-batches of B = train.batch_size / train.accum_steps. A process that trains a slice of it (a DDP
rank) takes its contiguous share of those ids, whatever the split (even or uneven, job.memplan), so a run
resumed under another split or accumulation sees the same samples. A checkpoint saves the number of
samples consumed (`sample_position`).

- synthetic: a pool of `data.synthetic_pool` random samples made once from the seed, kept on the
  device, and indexed by sample id; no host work per step, so it never limits GPU throughput.
- imagefolder: torchvision ImageFolder, a fresh seeded permutation per epoch, DataLoader workers.
  Broken data is bad input, reported in one line naming the folder or file: a root without class
  folders, a class folder without images, more classes than workload.num_classes (checked before the
  run starts), and a file that does not decode (when it is read: the first batch is read before the
  run writes anything; later ones stop the run).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from job.errors import UsageError
from job.models import Workload


def sample_ids(g: int, micro_batch: int, *, offset: int = 0, count: int | None = None, base: int = 0) -> range:
    """Global sample ids of this process's share of the g-th micro-batch after sample `base`: `count`
    samples from position `offset` (a ddp rank's share under any split, job.memplan); all by default."""
    start = base + g * micro_batch + offset
    return range(start, start + (micro_batch if count is None else count))


def probe_batch(spec: Workload, wcfg, n: int, *, device: torch.device, channels_last: bool):
    """n random samples shaped like the real ones, made on the device (the memory plan's probes)."""
    shape = spec.sample_shape(wcfg)
    if spec.is_image:
        x = _format(torch.randn((n, *shape), device=device), channels_last)
        y = torch.randint(0, wcfg.num_classes, (n,), device=device)
    else:
        x = torch.randint(0, wcfg.vocab, (n, wcfg.seq_len), device=device)
        y = torch.randint(0, wcfg.vocab, (n, wcfg.seq_len), device=device)
    return x, y


class SyntheticData:
    def __init__(self, spec: Workload, wcfg, *, pool: int, seed: int, device: torch.device):
        gen = torch.Generator().manual_seed(seed + 7919)
        shape = spec.sample_shape(wcfg)
        if spec.is_image:
            self.x = torch.randn((pool, *shape), generator=gen)
            self.y = torch.randint(0, wcfg.num_classes, (pool,), generator=gen)
        else:
            tokens = torch.randint(0, wcfg.vocab, (pool, wcfg.seq_len + 1), generator=gen)
            self.x, self.y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        self.x, self.y = self.x.to(device), self.y.to(device)
        self.pool = pool

    def batch(self, ids: range) -> tuple[torch.Tensor, torch.Tensor]:
        # Made on the device: a copy from pageable host memory would stall the CPU until the GPU
        # drained its queue, every micro-step.
        ids_t = torch.arange(ids.start, ids.stop, dtype=torch.int64, device=self.x.device)
        # A fixed scramble so consecutive batches differ even when the pool is small.
        idx = (ids_t * 40503 + ids_t // self.pool) % self.pool
        return self.x.index_select(0, idx), self.y.index_select(0, idx)


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


class ImageFolderData:
    def __init__(self, wcfg, *, path: str, seed: int):
        from torchvision import datasets, transforms

        size = wcfg.image_size
        tf = transforms.Compose([
            transforms.Resize(size),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ])
        try:
            self.dataset = datasets.ImageFolder(path, transform=tf, loader=load_image)
        except FileNotFoundError as e:  # checked on rank 0 at start; here if the folder changed since
            raise UsageError(f"data.path {path}: {e}") from None
        self.seed = seed

    def ids_to_indices(self, ids: range) -> list[int]:
        n = len(self.dataset)
        out, perm, epoch = [], None, -1
        for i in ids:
            e = i // n
            if e != epoch:
                epoch = e
                perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000003 + e))
            out.append(int(perm[i % n]))
        return out


class _BatchSampler:
    def __init__(self, data: ImageFolderData, *, start: int, micro_batch: int, offset: int, count: int):
        self.data, self.start, self.mb, self.offset, self.count = data, start, micro_batch, offset, count

    def __iter__(self):
        g = 0
        while True:
            yield self.data.ids_to_indices(sample_ids(g, self.mb, offset=self.offset, count=self.count,
                                                      base=self.start))
            g += 1


def batches(spec: Workload, wcfg, dcfg, *, micro_batch: int, start: int, offset: int, count: int,
            seed: int, device: torch.device, channels_last: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless iterator of this process's (x, y) micro-batches from global sample id `start` on:
    `count` samples from position `offset` of each."""
    if dcfg.kind == "synthetic":
        data = SyntheticData(spec, wcfg, pool=dcfg.synthetic_pool, seed=seed, device=device)

        def gen():
            g = 0
            while True:
                x, y = data.batch(sample_ids(g, micro_batch, offset=offset, count=count, base=start))
                yield _format(x, channels_last), y
                g += 1

        return gen()

    from torch.utils.data import DataLoader

    folder = ImageFolderData(wcfg, path=dcfg.path, seed=seed)
    loader = DataLoader(
        folder.dataset,
        batch_sampler=_BatchSampler(folder, start=start, micro_batch=micro_batch, offset=offset, count=count),
        num_workers=dcfg.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=dcfg.workers > 0,
    )
    it = iter(loader)
    # The first batch now, so a file that does not decode is refused before the run writes anything.
    it = itertools.chain([next(it)], it)
    if dcfg.prefetch and device.type == "cuda":
        return CudaPrefetcher(it, device, channels_last)
    return ((_format(x.to(device, non_blocking=True), channels_last), y.to(device, non_blocking=True))
            for x, y in it)


def _format(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x


class CudaPrefetcher:
    """Copies batch n+1 to the GPU on a side stream while batch n computes.

    The consumer's stream waits on the copy's event before use, and `record_stream` tells the caching
    allocator the tensors are used on the compute stream, so their memory is not reused too early.
    """

    def __init__(self, it, device: torch.device, channels_last: bool):
        self.it, self.device, self.channels_last = it, device, channels_last
        self.stream = torch.cuda.Stream(device=device)
        self.next = None
        self._preload()

    def _preload(self):
        try:
            x, y = next(self.it)
        except StopIteration:
            self.next = None
            return
        with torch.cuda.stream(self.stream):
            x = _format(x.to(self.device, non_blocking=True), self.channels_last)
            y = y.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.next = (x, y, event)

    def __iter__(self):
        return self

    def __next__(self):
        if self.next is None:
            raise StopIteration
        x, y, event = self.next
        torch.cuda.current_stream(self.device).wait_event(event)
        x.record_stream(torch.cuda.current_stream(self.device))
        y.record_stream(torch.cuda.current_stream(self.device))
        self._preload()
        return x, y
