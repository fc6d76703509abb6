"""Readers for real data that any workload can return from its `dataset` (job.workload): a token file and an
image folder. Each is a map-style torch Dataset of (x, y) samples; the job picks their indices by global
sample id (job.data), so resume and re-splits see the same samples.

Bad data is bad input: one line naming the file and the fix (UsageError), raised when the dataset is built
(before the run writes anything) or, for a file that only fails when it is read, by the batch that reads it.

Random augmentation stays exact under resume and re-splits: a sample's crop and flip are drawn from a seed
made of the run's seed and the sample's global id (`SampleIndex.sample_id`), not from a worker's RNG.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Sequence
from pathlib import Path

from job import gpucrops
from job.errors import UsageError
from job.workload import MAX_PIXELS

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
    holds at least one window, and no id reaches `vocab` (read in chunks: 0.04-0.07 s a GB from the page cache on
    the 2-core development machine; a file not in memory at the disk's speed)."""

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
        # The descriptor the map is made from stays open: _check_size asks it, so both see the same file even if
        # another is renamed over the path meanwhile.
        self._file = open(p, "rb")  # noqa: SIM115 (closed with the dataset)
        self.tokens = np.memmap(self._file, dtype=dtype, mode="r")
        self.size = size
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
        self._check_size()
        chunk = torch.from_numpy(np.array(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]

    def _check_size(self) -> None:
        """The file must still hold what was mapped: reading a mapped page past the end of a file that shrank
        (rewritten in place: opened for writing, so truncated, then filled again) kills the process with SIGBUS,
        no line and no checkpoint. One fstat a sample (about a microsecond) turns that into one line, which
        stops the run with a checkpoint of its last whole step (job.train); only a shrink within the
        microseconds between the two still ends it. (Forked DataLoader workers share the descriptor.)"""
        now = os.fstat(self._file.fileno()).st_size
        if now < self.size:
            raise UsageError(f"token file {self.path} shrank from {self.size:,} to {now:,} bytes while the run read "
                             "it (rewritten in place?); write new data to another file and point data.path at it, "
                             "or put the old file back")


def _max_token(tokens, chunk: int = 1 << 26) -> int:
    top = 0
    for start in range(0, len(tokens), chunk):
        top = max(top, int(tokens[start:start + chunk].max()))
    return top


# -- image folders ----------------------------------------------------------------------------------
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
DECODERS = ("cpu", "gpu")
JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class BadImage(UsageError):
    """A data file that does not decode; one line naming it (also from a DataLoader worker: UsageError)."""


def _bad(path: str, e: BaseException | str) -> BadImage:
    reason = e if isinstance(e, str) else (str(e).strip().splitlines() or [type(e).__name__])[0]
    return BadImage(f"cannot read image {path} ({reason}); fix or remove the file")


@contextlib.contextmanager
def _reading(path: str):
    """PIL's failures to open `path` as one line naming the file (BadImage)."""
    from PIL import UnidentifiedImageError

    try:
        yield
    except UnidentifiedImageError:
        raise _bad(path, "not an image format PIL knows, or a damaged header") from None
    except Exception as e:
        raise _bad(path, e) from None


def load_image(path: str):
    """A PIL image in RGB (torchvision's default loader), with a decode failure turned into one line naming the
    file. ImageFolder reads JPEG, PNG, GIF and WebP with torchvision.io; PIL reads the other formats."""
    from PIL import Image

    with _reading(path), open(path, "rb") as f:
        return Image.open(f).convert("RGB")


def decode_pixels(data, path: str):
    """The file's bytes (a uint8 tensor) -> a 3 x H x W uint8 RGB tensor, decoded on the CPU: torchvision.io
    (libjpeg-turbo, libpng...) where it reads the format, PIL otherwise; one line naming the file if neither can."""
    import torch
    from torchvision.io import ImageReadMode, decode_image

    try:
        return decode_image(data, mode=ImageReadMode.RGB)
    except RuntimeError as e:
        if bytes(data[:3].tolist()) == JPEG_MAGIC:  # a JPEG torchvision cannot decode is a damaged JPEG
            raise _bad(path, e) from None
    import numpy as np

    image = load_image(path)  # BMP, TIFF, PPM...: PIL
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()


# The JPEG markers whose segment holds the frame's height and width (SOF0-SOF15 but DHT, JPG and DAC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from a JPEG's frame header, walking its markers (about 1 µs: Pillow's open takes 24 on
    the 2-core development machine); None where the bytes end or break before one."""
    i, n = 2, len(data)
    while i + 9 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill bytes before a marker
            i += 1
        elif marker in _SOF:
            return (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8]
        elif marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # markers without a segment
            i += 2
        else:
            i += 2 + ((data[i + 2] << 8) | data[i + 3])
    return None


def image_size_of(data: bytes, path: str) -> tuple[int, int]:
    """(height, width) from the file's header, without decoding it: a JPEG's or PNG's own, Pillow's otherwise
    (one line naming the file where it cannot tell)."""
    if data[:3] == JPEG_MAGIC:
        size = jpeg_size(data)
        if size is not None:
            return size
    elif data[:8] == PNG_MAGIC and data[12:16] == b"IHDR":
        return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")
    import io

    from PIL import Image

    with _reading(path), Image.open(io.BytesIO(data)) as im:
        w, h = im.size
    return h, w


def check_pixels(hw: tuple[int, int], path: str, limit: int) -> None:
    """BadImage where an image of `hw` (height, width) has more than `limit` pixels (0: no limit)."""
    h, w = hw
    if limit and h * w > limit:
        mb = 3 * h * w / 2**20
        raise BadImage(f"cannot read image {path} ({w:,} x {h:,} pixels, {mb:,.{0 if mb >= 10 else 1}f} MB decoded: more "
                       f"than data.max_pixels={limit:,}); shrink it (python -m job.shrink), remove it, or raise "
                       "data.max_pixels")


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


class Samples(Sequence):
    """(file, class) pairs, packed: the files' names in one bytes array and their ends and classes in two int64
    arrays. A list of tuples of str and int is ~190 bytes an image, and a DataLoader worker forked from the
    training process copies every page of it whose objects it reads (reading one changes its reference count):
    with ImageNet's 1,281,167 files a worker held 246 MB of its own once it had read every entry, 16 workers
    3.9 GB, each rank's again; packed, a worker held 1 MB of its own (the 2-core development machine,
    docs/benchmarks.md). An entry costs ~1 µs to unpack, against a decode's ~1 ms."""

    def __init__(self, pairs):
        import numpy as np

        names = [os.fsencode(p) for p, _ in pairs]
        self._names = np.frombuffer(b"".join(names), dtype=np.uint8) if names else np.zeros(0, dtype=np.uint8)
        self._ends = np.cumsum([len(n) for n in names], dtype=np.int64)
        self._classes = np.fromiter((c for _, c in pairs), dtype=np.int64, count=len(names))

    def __len__(self) -> int:
        return len(self._classes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        start = int(self._ends[i - 1]) if i else 0
        return os.fsdecode(self._names[start:int(self._ends[i])].tobytes()), int(self._classes[i])


class ImageFolder:
    """torchvision's ImageFolder layout (one sub-folder per class), decoded to `image_size` x `image_size`
    and normalised with ImageNet's statistics on the training device.

    augment=False (evaluation, and training without augmentation): the centred square of the short side,
    resized. augment=True: RandomResizedCrop(scale 0.08-1, ratio 3/4-4/3) and a horizontal flip, drawn from
    the sample's own seed (`sample_seed`), so the same sample id gets the same crop in every run, split,
    worker and decoder.

    decode="cpu": DataLoader workers decode (torchvision.io: libjpeg-turbo), crop and resize; a batch
    crosses to the device as uint8 (a quarter of float32's bytes) and is normalised there (`to_device`).
    decode="gpu": workers read the files' bytes and draw the crops; `to_device` decodes a batch's JPEGs on
    the GPU in batched nvJPEG calls (one for ImageNet-sized files; GPU_DECODE_BYTES bounds each) and crops and
    resizes there. Files that are not JPEG are decoded by
    the workers either way. `gpu_share` < 1 splits the JPEGs between the two: that fraction of the sample
    ids (spread evenly, so every batch and every rank's share of it gets its part) goes to the GPU, the
    rest is decoded by the workers, so both decoders work at once. Both decoders give the same crop of the
    same image: the pixels differ only by the decoders' rounding (nvJPEG against libjpeg-turbo, a few
    levels of 255), and which decoder a sample id gets is fixed by the id, so a resumed run decodes it the
    same way. `gpu_split` (with decode="cpu": data.decode=auto on a GPU) makes that share a GpuSplit, a
    schedule by sample id that the training process changes while the workers run (job.data.SplitTuner)."""

    def __init__(self, path: str | os.PathLike, *, image_size: int, num_classes: int, augment: bool = False,
                 decode: str = "cpu", gpu_share: float = 1.0, gpu_split: GpuSplit | None = None,
                 max_pixels: int = MAX_PIXELS):
        from torchvision import datasets

        if decode not in DECODERS:
            raise UsageError(f"data.decode={decode} is not a decoder; use one of auto, {', '.join(DECODERS)}")
        if not 0.0 <= gpu_share <= 1.0:
            raise UsageError(f"data.gpu_share={gpu_share} is not a fraction; use a value from 0 to 1")
        check_imagefolder(str(path), num_classes=num_classes)
        self.augment, self.size, self.decode, self.max_pixels = augment, int(image_size), decode, int(max_pixels)
        self.gpu_share = float(gpu_share) if decode == "gpu" else 0.0
        self.gpu_split = gpu_split if decode == "cpu" else None  # data.decode=auto's changing share (GpuSplit)
        self._norm: dict = {}
        self._rng = None  # crop_of's generator and CropDraws, made in the process that draws (a worker)
        if decode == "cpu" and gpu_split is None:  # decoded pixels: torch's own collate, which the workers' hand-over stacks into its slots
            from torch.utils.data import default_collate

            self.collate = default_collate
        try:
            self.samples = Samples(datasets.ImageFolder(str(path), loader=str).samples)  # (file, class) pairs
        except FileNotFoundError as e:  # the folder changed since the check
            raise UsageError(f"data.path {path}: {e}") from None

    def __len__(self) -> int:
        return len(self.samples)

    def __getstate__(self):  # to spawned workers: without the generator, which each process makes itself
        return {**self.__dict__, "_rng": None}

    def crop_of(self, index, h: int, w: int) -> tuple[int, int, int, int, bool]:
        """(top, left, height, width, flip) of sample `index` in an h x w image."""
        if not self.augment:
            side = min(h, w)
            return (h - side) // 2, (w - side) // 2, side, side, False
        import torch

        if self._rng is None:  # the one-element tensors the draws land in, and a generator of this process's own
            self._rng = torch.Generator(), CropDraws()
        own, draws = self._rng
        seed = sample_seed(index)
        # A plain index: torchvision's behaviour, the process's RNG; else the own generator, re-seeded per
        # sample (the process's RNG untouched).
        g = torch.default_generator if seed is None else own.manual_seed(seed)
        return (*random_resized_crop(g, h, w, draws=draws), draws.flip(g))

    def __getitem__(self, index):
        import torch

        path, label = self.samples[int(index)]
        raw = read_file(path)
        hw = image_size_of(raw, path)  # before decoding: a file may claim more pixels than the memory holds
        check_pixels(hw, path, self.max_pixels)
        data = torch.frombuffer(raw, dtype=torch.uint8)
        if raw[:3] == JPEG_MAGIC and self._on_gpu(index):
            return Encoded(data, self.crop_of(index, *hw), path, hw), label
        image = decode_pixels(data, path)
        return crop_resize(image, self.crop_of(index, image.shape[1], image.shape[2]), self.size), label

    def _on_gpu(self, index) -> bool:
        """Whether this sample's JPEG is decoded on the GPU (given undecoded to `to_device`)."""
        if self.gpu_split is not None:
            return on_gpu(index, self.gpu_split.share_for(getattr(index, "sample_id", int(index))))
        return self.decode == "gpu" and on_gpu(index, self.gpu_share)

    def collate(self, items):
        """A batch holding JPEGs for the GPU: (an EncodedBatch, labels); one without: (uint8 pixels, labels),
        torch's default_collate, which the workers' hand-over stacks into its slots. decode="cpu" without a
        GpuSplit replaces this with default_collate itself in __init__."""
        import torch
        from torch.utils.data import default_collate

        if not any(isinstance(x, Encoded) for x, _ in items):
            return default_collate(items)
        return EncodedBatch([x for x, _ in items]), torch.tensor([y for _, y in items])

    collate.default_collate_for_tensors = True  # a batch of pixels only: job.handover stacks it into its slot

    def to_device(self, batch, device, memory_format=None):
        """The collated batch on `device`, decoded (decode="gpu") and normalised: (float32 x, labels), in
        `memory_format` (train.channels_last's layout) where given: the workers' batches cross channels-last,
        and turning the uint8 batch is a quarter of turning the float one."""
        import torch

        x, y = batch
        if isinstance(x, EncodedBatch):
            x = x.decode(device, self.size)
        else:
            x = x.to(device, non_blocking=True)
        if memory_format is not None:
            x = x.contiguous(memory_format=memory_format)
        key = str(device)
        if key not in self._norm:  # made once per device: a small copy from pageable memory waits for the GPU
            mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in (MEAN, STD))
            self._norm[key] = ((-mean / std).float().to(device), (1 / (std * 255)).float().to(device))
        shift, scale = self._norm[key]
        # (x / 255 - mean) / std as x * scale + shift: one kernel reading the uint8 batch on a GPU (three, as
        # x.float(), then - and /); within 5e-7 of torchvision's ToTensor + Normalize
        return torch.addcmul(shift, x, scale), y.to(device, non_blocking=True)


class GpuSplit:
    """The share of a run's JPEGs decoded on the GPU, changed while its DataLoader workers run
    (data.decode=auto, job.data.SplitTuner): a schedule of (first sample id, share) rows in shared memory,
    which the training process appends to and each worker reads for every sample. It starts with no JPEG on
    the GPU. A change applies from a sample id the workers have not reached, so each sample id is decoded
    one way, whichever worker makes it."""

    ROWS = 8

    def __init__(self):
        import torch

        self.table = torch.full((self.ROWS, 2), math.inf, dtype=torch.float64).share_memory_()
        self.table[0, 0], self.table[0, 1] = 0.0, 0.0
        self.rows = 1  # kept by the training process, which alone appends

    def share_for(self, sample_id: int) -> float:
        share = 0.0
        for first, s in self.table.tolist():
            if first > sample_id:  # later rows start later (and unused rows at infinity)
                break
            share = s
        return share

    def set(self, first: int, share: float) -> bool:
        """From sample id `first` on, `share` of the JPEGs on the GPU; False when the schedule is full."""
        if self.rows >= self.ROWS:
            return False
        if first < self.table[self.rows - 1, 0]:
            raise ValueError(f"GpuSplit: sample {first} is before the last change's ({int(self.table[self.rows - 1, 0])})")
        self.table[self.rows, 1] = float(share)  # the share first: a reader sees the row once its id is set
        self.table[self.rows, 0] = float(first)
        self.rows += 1
        return True


def on_gpu(index, share: float) -> bool:
    """Whether sample `index` (a SampleIndex: its sample id) is one of the `share` decoded on the GPU: sample id
    i is when floor((i + 1) x share) > floor(i x share), which spreads them evenly (any n consecutive ids hold
    n x share of them, give or take one)."""
    if share >= 1.0:
        return True
    i = getattr(index, "sample_id", int(index))
    return math.floor((i + 1) * share) > math.floor(i * share)


def read_file(path: str) -> bytearray:
    """The file's bytes, read into a buffer of its size (a tensor can share it: no copy of what `read`
    returns, ~10 us of a JPEG's ~35 on the 2-core development machine); one line naming the file if it cannot
    be read."""
    try:
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            got = 0
            with memoryview(buf) as view:
                while got < len(buf) and (n := f.readinto(view[got:])):
                    got += n
    except OSError as e:
        raise _bad(path, e.strerror or e) from None
    if got < len(buf):  # the file shrank since its size was read
        del buf[got:]
    return buf


class CropDraws:
    """The one-element tensors random_resized_crop and the flip draw into, made once a process: a fresh
    torch.empty(1) a draw, and torch.exp's and torch.randint's new tensors, were half of a crop's 36 us
    (2-core development machine; 15-16 us with these). The values are the same: randint is random_ on an
    empty int64 tensor, rand is uniform_ on a float32 one."""

    def __init__(self):
        import torch

        self.f = torch.empty(1)
        self.i = torch.empty(1, dtype=torch.long)

    def flip(self, g) -> bool:
        """torch.rand((), generator=g) < 0.5."""
        return self.f.uniform_(generator=g).item() < 0.5


def random_resized_crop(g, h: int, w: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), *,
                        draws: CropDraws | None = None) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params for an h x w image, drawn from generator `g`: the same draws
    in the same order, so a generator seeded like torch.manual_seed gives the same crop. `draws`: tensors to
    draw into (a CropDraws kept by the caller), else made for this call.

    Why not get_params itself: it draws from the global RNG, and re-seeding that (torch.manual_seed) also
    queues a seed for every lazily initialised accelerator, formatting a stack trace each time: 0.4-0.8 ms
    a sample in a DataLoader worker, a fifth of what decoding the JPEG costs."""
    d = draws or CropDraws()
    area = h * w
    log_lo, log_hi = _log_ratio(tuple(ratio))
    for _ in range(10):
        target = area * d.f.uniform_(scale[0], scale[1], generator=g).item()
        aspect = d.f.uniform_(log_lo, log_hi, generator=g).exp_().item()  # float32, as theirs
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(d.i.random_(0, h - ch + 1, generator=g).item())
            left = int(d.i.random_(0, w - cw + 1, generator=g).item())
            return top, left, ch, cw
    in_ratio = w / h  # fallback: the central crop of the nearest allowed aspect ratio
    if in_ratio < min(ratio):
        cw, ch = w, int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        ch, cw = h, int(round(h * max(ratio)))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


@functools.lru_cache(maxsize=8)
def _log_ratio(ratio: tuple[float, float]) -> tuple[float, float]:
    """log(ratio) in float32, as torchvision computes it (once per ratio: 4 us a sample otherwise)."""
    import torch

    return tuple(float(v) for v in torch.log(torch.tensor(ratio)))


def crop_resize(image, crop: tuple[int, int, int, int, bool], size: int):
    """The crop of a 3 x H x W uint8 image, resized to size x size (bilinear, antialiased) and flipped if asked:
    torchvision's resized_crop and horizontal_flip, pixel for pixel (a test checks it), in less time.

    The crop is resized as one channels-last (H x W x 3) image, the layout the JPEG decoder writes, which
    takes the CPU's vectorised uint8 kernel: 0.30 ms an image of 500 x 375 against resized_crop's 0.68 ms
    (2-core development machine, one thread), where decoding it takes 2.3 ms. The result is channels-last too;
    the batch's stack makes it contiguous."""
    import torch

    top, left, h, w, flip = crop
    x = image[None, :, top:top + h, left:left + w].contiguous(memory_format=torch.channels_last)
    if (h, w) != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True,
                                            align_corners=False)
    return (x.flip(-1) if flip else x)[0]


# EncodedBatch.decode on CPU tensors resizes with the CPU's native uint8 kernel, as the workers do (decode=cpu's
# very pixels); the tests turn it off to run the GPU's float path on the CPU.
NATIVE_CPU_RESIZE = True

_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    import logging

    if message not in _WARNED:
        _WARNED.add(message)
        logging.getLogger("job").warning("%s", message)


class Encoded:
    """One undecoded image: its file's bytes, its crop (ImageFolder.crop_of), its path (for the error) and its
    (height, width) from the header."""

    def __init__(self, data, crop, path: str, hw: tuple[int, int]):
        self.data, self.crop, self.path, self.hw = data, crop, path, hw


# The decoded pixels (before their crops) EncodedBatch.decode holds on the card at once: its JPEGs are decoded in
# batched calls of at most this much each (one for a batch of ImageNet-sized files: 256 of them are 144 MB), so
# a folder of camera photos (36 MB each decoded at 12 megapixels) keeps the card's memory within the memory
# plan's margin (memory.margin_gb, 1.5 GB by default) instead of decoding a whole batch at once (9 GB for 256).
GPU_DECODE_BYTES = 256 << 20
# A calling CUDA stream -> the stream its decoded images are allocated on, and an event after the last reads queued
# on the calling stream (their crops) of the images allocated there: memory freed on a stream goes to that
# stream's next allocations (EncodedBatch._decode). One each a calling stream (the model's, data.prefetch's),
# so two threads decoding at once do not hand each other's images to each other.
_DECODE_STREAM: dict[int, object] = {}
_READ: dict[int, object] = {}


def decode_spans(decoded: list[int], budget: int) -> list[range]:
    """Consecutive runs of images whose decoded bytes add up to at most `budget` each; an image larger than
    the budget alone in its run."""
    spans, start, held = [], 0, 0
    for i, b in enumerate(decoded):
        if i > start and held + b > budget:
            spans.append(range(start, i))
            start, held = i, 0
        held += b
    if decoded:
        spans.append(range(start, len(decoded)))
    return spans


class EncodedBatch:
    """A batch of images still to decode: its JPEGs' bytes, packed into one tensor, and the pixels the workers
    decoded (files that are not JPEG, and the JPEGs that data.gpu_share leaves to the workers), stacked into
    another. Built by the collate function, in the worker, so a few tensors cross to the training process
    whatever the batch size. One tensor a file (a shared-memory file, its unpickling and its pinned copy
    each) cost the training process 128-148 ms of CPU a batch of 128, packed 3.6-5.3 ms (the hand-over
    `python -m job.bench.decoders` times, on the 2-core development machine).

    `pin_memory` is what a DataLoader with pin_memory=True calls on it. From a worker, its HANDOVER_TENSORS
    cross in the worker's reusable slots (job.handover), not in fresh shared-memory files."""

    HANDOVER_TENSORS = ("data", "pixels", "rows", "jpeg_rows")

    def __init__(self, items: list):
        import torch

        from job.handover import batch_like

        self.n = len(items)
        encoded = [(i, it) for i, it in enumerate(items) if isinstance(it, Encoded)]
        self.jpegs = [(it.crop, it.path) for _, it in encoded]  # in the order of their rows, jpeg_rows
        self.sizes = [int(it.data.numel()) for _, it in encoded]
        self.decoded = [3 * it.hw[0] * it.hw[1] for _, it in encoded]  # each JPEG's bytes once decoded (RGB)
        self.data = torch.cat([it.data for _, it in encoded]) if encoded else None
        done = [(i, it) for i, it in enumerate(items) if not isinstance(it, Encoded)]
        # The workers' images stacked as they are laid out (channels-last, as decoded and cropped): a plain copy
        # each, where torch.stack's contiguous batch would transpose every one.
        images = [it for _, it in done]
        self.pixels = torch.stack(images, out=batch_like(images[0], len(images), device="cpu")) if images else None
        # Where each part goes in the batch, as tensors, so they are pinned and copied with the rest.
        self.rows = torch.tensor([i for i, _ in done], dtype=torch.long)
        self.jpeg_rows = torch.tensor([i for i, _ in encoded], dtype=torch.long)

    def pin_memory(self):
        for name in ("data", "pixels", "rows", "jpeg_rows"):
            t = getattr(self, name)
            if t is not None and t.numel():  # an empty index (no JPEG, or none left to the workers) stays as it is
                setattr(self, name, t.pin_memory())
        return self

    def __len__(self) -> int:
        return self.n

    def decode(self, device, size: int):
        """n x 3 x size x size uint8 on `device`: the JPEGs in batched nvJPEG calls of at most GPU_DECODE_BYTES
        of decoded pixels each (one for ImageNet-sized files), each call's crops resized into their rows in one
        kernel (job.gpucrops; image by image where Triton is missing)."""
        import torch

        files = list(torch.split(self.data, self.sizes)) if self.jpegs else []  # views of the packed bytes
        out = torch.empty((self.n, 3, size, size), dtype=torch.uint8, device=device)
        if self.pixels is not None:  # one copy for every image the workers decoded
            out.index_copy_(0, self.rows.to(device, non_blocking=True), self.pixels.to(device, non_blocking=True))
        for span in decode_spans(self.decoded, GPU_DECODE_BYTES):  # none without JPEGs
            images = self._decode([files[i] for i in span], [self.jpegs[i][1] for i in span], out.device)
            self._crop(out, span, images, size)
            if out.device.type == "cuda":  # their last reads queued: see _decode
                stream = torch.cuda.current_stream(out.device)
                _READ[stream.cuda_stream] = event = torch.cuda.Event()
                event.record(stream)
        return out

    def _decode(self, files: list, paths: list[str], device) -> list:
        """The JPEGs `files` decoded on `device` in one batched call, ready for the calling stream.

        torchvision allocates the decoded images on the current CUDA stream but nvJPEG writes them on a stream
        of its own, which does not wait for the current one. Memory freed on the calling stream while kernels
        queued there still use it (the model's own tensors, without data.prefetch: a compiled ResNet-50 trained
        to NaN within 20 steps; the workers' pixels just copied in) would be written under them. So the images
        are allocated on a stream of their own (one a calling stream), whose memory holds nothing but earlier
        decoded images; and the call first waits (on the host) for the last reads of those, their crops queued
        on the calling stream: with data.prefetch they were queued a step ago and are done; without it, on the
        model's stream, the wait lets the card reach them."""
        if device.type != "cuda":
            return self._decoded(files, paths, device)
        import torch

        caller = torch.cuda.current_stream(device)
        read = _READ.get(caller.cuda_stream)
        if read is not None:
            read.synchronize()
        own = _DECODE_STREAM.get(caller.cuda_stream)
        if own is None:
            # High priority: a pool of streams apart from the default priority's, which data.prefetch, the
            # gradient buckets' and the CUDA graphs' side streams take, so this stream is none of theirs.
            own = _DECODE_STREAM[caller.cuda_stream] = torch.cuda.Stream(device=caller.device, priority=-1)
        with torch.cuda.stream(own):  # torchvision makes this stream wait for nvJPEG's
            images = self._decoded(files, paths, device)
        caller.wait_stream(own)
        return images

    def _decoded(self, files: list, paths: list[str], device) -> list:
        """decode_jpeg's images, or the CPU's where nvJPEG fails the call."""
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            return decode_jpeg(files, mode=ImageReadMode.RGB, device=device)
        except RuntimeError as e:
            # One file nvJPEG cannot read fails the whole call: decode those one at a time on the CPU, which
            # names a damaged file (and reads the odd JPEG nvJPEG does not support).
            images = [decode_pixels(f.cpu(), path).to(device, non_blocking=True) for f, path in zip(files, paths)]
            _warn_once(f"data.decode=gpu: nvJPEG could not decode a batch ({str(e).strip().splitlines()[0]}); "
                       "it was decoded on the CPU, as every such batch will be (slower: data.decode=cpu "
                       "with data.workers decodes in parallel)")
            return images

    def _crop(self, out, span: range, images: list, size: int) -> None:
        """Each of `images` (the JPEGs `span` of this batch) cropped and resized into its row of `out`."""
        rows = self.jpeg_rows[span.start:span.stop]
        crops = [self.jpegs[i][0] for i in span]
        if out.device.type == "cpu" and NATIVE_CPU_RESIZE:  # decode=cpu's very pixels
            for i, crop, image in zip(rows.tolist(), crops, images):
                out[i] = crop_resize(image, crop, size)
        elif not (out.device.type == "cuda" and gpucrops.crops_into(out, rows.tolist(), images, crops, size)):
            out.index_copy_(0, rows.to(out.device, non_blocking=True), crops_resized(images, crops, size))


def crops_resized(images: list, crops: list, size: int):
    """len(images) x 3 x size x size uint8: crop_resize of each image, as torchvision computes it off the CPU
    (the crop in float32, bilinear antialiased, rounded), in two kernels an image and three for the batch:
    the GPU decoder's crops where Triton is missing (job.gpucrops does them in one launch), and its reference.

    torchvision's resized_crop on each image costs ~6 kernels and its dispatch's Python, run beside the
    thread that launches the model's kernels (with data.prefetch) or on it."""
    import torch

    out = torch.empty((len(images), 3, size, size), dtype=torch.float32, device=images[0].device)
    for k, (image, (top, left, h, w, _)) in enumerate(zip(images, crops)):
        crop = image[None, :, top:top + h, left:left + w].float()
        if (h, w) == (size, size):
            out[k] = crop[0]
        else:
            torch._C._nn._upsample_bilinear2d_aa(crop, [size, size], False, None, None, out=out[k:k + 1])
    flips = [k for k, c in enumerate(crops) if c[4]]
    if flips:
        out[flips] = out[flips].flip(-1)
    return out.round_().to(torch.uint8)
