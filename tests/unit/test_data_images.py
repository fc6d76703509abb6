"""The image data path (job.datasets.ImageFolder, job.data): the same sample ids give the same samples whichever
decoder, worker count or split reads them; the GPU decoder's batch logic runs on the CPU here (the batched
decode and the crops are the same code on either device), and on a card in tests/gpu/test_gpu_data.py; broken
files are one line; data.decode is checked against the device."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _images_helpers import CPU, batch, claim_size, make_folder
from conftest import ROOT, job_cmd

from job import config
from job.data import Data
from job.datasets import (
    BadImage,
    CropDraws,
    EncodedBatch,
    ImageFolder,
    SampleIndex,
    Samples,
    crop_resize,
    crops_resized,
    image_size_of,
    jpeg_size,
    on_gpu,
    random_resized_crop,
    read_file,
    sample_seed,
)


@pytest.mark.parametrize("augment", [False, True])
def test_the_gpu_decoders_batch_gives_the_cpu_decoders_samples(tmp_path, augment):
    """decode=gpu's path (bytes from the workers, one batched decode, crops after it) run on the CPU gives
    decode=cpu's samples exactly: the same decoder (libjpeg-turbo) and the same crop of the same sample id."""
    root = make_folder(tmp_path / "imgs")
    cpu = ImageFolder(root, image_size=32, num_classes=2, augment=augment, decode="cpu")
    gpu = ImageFolder(root, image_size=32, num_classes=2, augment=augment, decode="gpu")
    ids = [SampleIndex(i, 100 + i, 5) for i in range(len(cpu))]
    xa, ya = batch(cpu, ids)
    raw, _ = gpu.collate([gpu[i] for i in ids])
    assert isinstance(raw, EncodedBatch) and len(raw.jpegs) == 8 and raw.pixels.shape[0] == 2  # 8 JPEGs, 2 PNGs
    xb, yb = batch(gpu, ids)
    assert xa.shape == (10, 3, 32, 32) and xa.dtype == torch.float32
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # Normalised with ImageNet's statistics: a mid-grey pixel is near 0.
    assert -2.2 < float(xa.min()) and float(xa.max()) < 2.7


def test_to_device_normalises_as_torchvisions_to_tensor_and_normalize(tmp_path):
    """to_device's normalisation (one multiply-add from the uint8 batch) is torchvision's ToTensor then
    Normalize(ImageNet's mean and std) within 5e-7 (values within -2.2 to 2.7; both are that close to the exact
    value), float32, in the layout asked for; every level of every channel checked."""
    from torchvision.transforms import v2

    from job.datasets import MEAN, STD

    ds = ImageFolder(make_folder(tmp_path / "imgs"), image_size=32, num_classes=2, decode="cpu")
    levels = torch.arange(256, dtype=torch.uint8).repeat(2 * 3 * 8 * 16 // 256).view(2, 3, 8, 16)
    want = v2.Normalize(MEAN, STD)(levels.float() / 255)
    got, y = ds.to_device((levels.contiguous(memory_format=torch.channels_last), torch.tensor([0, 1])), CPU,
                          torch.channels_last)
    assert got.dtype == torch.float32 and got.is_contiguous(memory_format=torch.channels_last)
    assert float((got - want).abs().max()) <= 5e-7
    assert torch.equal(y, torch.tensor([0, 1]))


@pytest.mark.parametrize("share", [0.0, 0.3, 0.5, 1.0])
def test_data_gpu_share_splits_the_jpegs_between_the_decoders_with_the_same_samples(tmp_path, share):
    """data.gpu_share: that fraction of the JPEG sample ids goes to the GPU decoder, the workers decode the rest;
    the batch is decode=cpu's exactly (the GPU path run on the CPU: the same libjpeg-turbo, the same crops)."""
    root = make_folder(tmp_path / "imgs", per_class=10)
    cpu = ImageFolder(root, image_size=32, num_classes=2, augment=True, decode="cpu")
    mixed = ImageFolder(root, image_size=32, num_classes=2, augment=True, decode="gpu", gpu_share=share)
    ids = [SampleIndex(i, 40 + i, 5) for i in range(len(cpu))]
    raw, _ = mixed.collate([mixed[i] for i in ids])
    jpegs = [i for i in ids if mixed.samples[int(i)][0].endswith(".jpg")]
    if share == 0:  # nothing for the GPU: a plain batch of pixels, which the workers' slots can hold
        assert torch.is_tensor(raw) and raw.shape == (len(ids), 3, 32, 32)
    else:
        assert len(raw.jpegs) == sum(on_gpu(i, share) for i in jpegs) and len(raw.jpegs) + raw.pixels.shape[0] == len(ids)
        if share < 1:  # the workers' pixels stacked as decoded and cropped (channels-last): a copy each, no transpose
            assert raw.pixels.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(batch(cpu, ids)[0], batch(mixed, ids)[0])


def test_the_gpu_share_is_fixed_by_sample_id_and_spread_over_every_window():
    for share in (0.1, 0.37, 0.5, 0.9):
        picked = [on_gpu(SampleIndex(0, i, 0), share) for i in range(2000)]
        for n in (7, 32, 256):  # any n consecutive ids (a batch, a rank's share of it) hold n x share, +-1
            for start in range(0, 2000 - n, 61):
                assert abs(sum(picked[start:start + n]) - n * share) <= 1
        assert picked == [on_gpu(SampleIndex(5, i, 9), share) for i in range(2000)]  # the id decides, nothing else
    assert all(on_gpu(SampleIndex(0, i, 0), 1.0) for i in range(50)) and not any(on_gpu(i, 0.0) for i in range(50))
    with pytest.raises(config.UsageError, match="data.gpu_share=1.5 is not a fraction"):
        ImageFolder("/nonexistent", image_size=8, num_classes=2, decode="gpu", gpu_share=1.5)


def test_data_decode_auto_is_the_workers_with_workers_and_the_gpu_without():
    def resolved(device: str, *keys: str):
        cfg = config.load(["workload=tiny", "train.device=cpu", *keys])
        return Data(config.workload_of(cfg), config.workload_settings(cfg), cfg.data, seed=0,
                    device=torch.device(device)).decode

    assert resolved("cuda") == "gpu" and resolved("cuda", "data.workers=15") == "cpu"
    assert resolved("cpu") == "cpu" and resolved("cuda", "data.workers=15", "data.decode=gpu") == "gpu"


def test_a_sample_id_gets_its_crop_in_every_epoch_run_and_process(tmp_path):
    root = make_folder(tmp_path / "imgs")
    ds = ImageFolder(root, image_size=24, num_classes=2, augment=True)
    a, b = ds[SampleIndex(3, 7, 1)][0], ds[SampleIndex(3, 7, 1)][0]
    later = ds[SampleIndex(3, 7 + len(ds), 1)][0]  # the same file, another epoch: another crop
    other_seed = ds[SampleIndex(3, 7, 2)][0]
    assert a.dtype == torch.uint8 and torch.equal(a, b) and not torch.equal(a, later) and not torch.equal(a, other_seed)
    plain = ImageFolder(root, image_size=24, num_classes=2, augment=False)
    assert torch.equal(plain[3][0], plain[SampleIndex(3, 9, 0)][0])  # no augmentation: no seed involved
    before = torch.random.get_rng_state()
    ds[SampleIndex(2, 5, 1)]
    assert torch.equal(before, torch.random.get_rng_state())  # the trainer's RNG is not moved


def test_the_crops_are_torchvisions_random_resized_crop_draw_for_draw():
    """crop_of draws from a generator of its own (re-seeding the global RNG per sample cost a fifth of a JPEG's
    decode), and gets torchvision's RandomResizedCrop.get_params and flip under the same seed: every size,
    the fallback crops of very thin images included."""
    import random

    from torchvision.transforms import RandomResizedCrop

    rng, g, draws = random.Random(25), torch.Generator(), CropDraws()
    shapes = [(rng.randint(1, 700), rng.randint(1, 700)) for _ in range(2000)] + [(1, 600), (600, 1), (3, 3)]
    fallbacks = 0
    for h, w in shapes:
        seed = sample_seed(SampleIndex(0, rng.randrange(10**9), rng.randrange(100)))
        torch.manual_seed(seed)
        theirs = RandomResizedCrop.get_params(torch.empty((3, h, w), device="meta"), [0.08, 1.0], [3 / 4, 4 / 3])
        their_flip = bool(torch.rand(()) < 0.5)
        ours = random_resized_crop(g.manual_seed(seed), h, w)
        assert (ours, bool(torch.rand((), generator=g) < 0.5)) == (tuple(theirs), their_flip), (h, w, seed)
        # crop_of's way: the draws land in tensors kept from sample to sample
        assert (random_resized_crop(g.manual_seed(seed), h, w, draws=draws), draws.flip(g)) == (ours, their_flip)
        fallbacks += ours[0] == (h - ours[2]) // 2 and ours[1] == (w - ours[3]) // 2 and (h < 4 or w < 4)
    assert fallbacks >= 3  # the thin shapes took the fallback path


def test_the_cpu_crops_are_torchvisions_resized_crop_pixel_for_pixel():
    """crop_resize (the workers' crop, resized as one channels-last image: the CPU's vectorised uint8 kernel)
    gives torchvision's resized_crop and flip exactly, for images laid out as the JPEG decoder writes them
    (H x W x 3 underneath) and as PIL's are (contiguous), every size, crops already the output's size too."""
    import random

    from torchvision.transforms.v2 import functional as F

    rng = random.Random(11)
    for k in range(60):
        H, W = rng.randint(8, 400), rng.randint(8, 400)
        hwc = torch.randint(0, 256, (H, W, 3), dtype=torch.uint8)
        image = hwc.permute(2, 0, 1) if k % 2 else hwc.permute(2, 0, 1).contiguous()
        h, w = (min(H, 24), min(W, 24)) if k < 6 else (rng.randint(1, H), rng.randint(1, W))
        top, left, flip = rng.randint(0, H - h), rng.randint(0, W - w), k % 3 == 0
        want = F.resized_crop(image, top, left, h, w, [24, 24], antialias=True)
        want = F.horizontal_flip(want) if flip else want
        got = crop_resize(image, (top, left, h, w, flip), 24)
        assert got.shape == (3, 24, 24) and torch.equal(got, want), (k, H, W, h, w)


def test_the_gpu_decoders_batched_crops_are_torchvisions_resized_crop_off_the_cpu():
    """crops_resized (the GPU decoder's crops, a few kernels a batch) gives torchvision's resized_crop as it
    runs on a GPU (float32, antialiased, rounded) and the flip, image by image, whatever the sizes: here on
    CPU tensors, where the same ATen kernels' CPU versions run."""
    import random

    from torchvision.transforms.v2 import functional as F

    rng, images, crops = random.Random(7), [], []
    for k in range(40):
        H, W = rng.randint(8, 300), rng.randint(8, 300)
        images.append(torch.randint(0, 256, (3, H, W), dtype=torch.uint8))
        h, w = (min(H, 24), min(W, 24)) if k < 4 else (rng.randint(1, H), rng.randint(1, W))  # some already 24 x 24
        crops.append((rng.randint(0, H - h), rng.randint(0, W - w), h, w, k % 3 == 0))
    out = crops_resized(images, crops, 24)
    assert out.shape == (40, 3, 24, 24) and out.dtype == torch.uint8
    for k, (image, (top, left, h, w, flip)) in enumerate(zip(images, crops)):
        want = F.resized_crop(image.float(), top, left, h, w, [24, 24], antialias=True).round().to(torch.uint8)
        assert torch.equal(out[k], F.horizontal_flip(want) if flip else want), k


ONE_LAUNCH_CHECK = """
import json, random, torch
from job.datasets import crops_resized
torch.manual_seed(1)
from job.gpucrops import crops_into
rng, images, crops = random.Random(3), [], []
for k in range(10):
    H, W = rng.randint(6, 48), rng.randint(6, 48)
    images.append(torch.randint(0, 256, (3, H, W), dtype=torch.uint8))
    h, w = (min(H, 8), min(W, 8)) if k < 2 else (rng.randint(1, H), rng.randint(1, W))
    crops.append((rng.randint(0, H - h), rng.randint(0, W - w), h, w, k % 3 == 0))
out = torch.zeros((12, 3, 8, 8), dtype=torch.uint8)
rows = [11, 0, 3, 4, 5, 6, 7, 8, 9, 10]
crops_into(out, rows, images, crops, 8)
diff = (out[rows].int() - crops_resized(images, crops, 8).int()).abs()
print(json.dumps({"max": int(diff.max()), "exact": float((diff == 0).float().mean()),
                  "untouched": not bool(out[[1, 2]].any())}))
"""


def test_the_one_launch_crops_are_the_image_by_image_crops():
    """job.gpucrops' kernel (data.decode=gpu's crops on a card, one launch a batch), run by Triton's interpreter
    on the CPU (in a process of its own: Triton reads TRITON_INTERPRET when it is imported): each crop, shrunk
    up to 6x, enlarged or copied, flipped or not, lands in its own row with the pixels of crops_resized
    (torch's antialiased resize); rows it is not given stay untouched."""
    import json
    import os

    from job import gpucrops

    if not gpucrops.available():
        pytest.skip("Triton is not installed (it comes with torch's CUDA builds)")
    p = subprocess.run([sys.executable, "-c", ONE_LAUNCH_CHECK], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    # torch's CPU kernel sums the same weights in another order: a level apart on a few pixels (0.4 % here)
    assert got["max"] <= 1 and got["exact"] > 0.99 and got["untouched"], got


def test_the_one_launch_crops_step_aside_once_where_their_kernel_cannot_be_built(monkeypatch, caplog):
    """Where Triton cannot build the kernel (a runtime-only image without a C compiler), crops_into writes
    nothing and returns False, so EncodedBatch.decode crops image by image; the reason is logged once, and
    the kernel is not tried again for the rest of the run."""
    from job import gpucrops

    tries = []

    class Unbuildable:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tries.append(grid)
                raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable")
            return launch

    monkeypatch.setattr(gpucrops, "available", lambda: True)
    monkeypatch.setattr(gpucrops, "_kernel", lambda: Unbuildable())
    monkeypatch.setattr(gpucrops, "_failed", [])
    out = torch.zeros((2, 3, 8, 8), dtype=torch.uint8)
    images = [torch.full((3, 10, 12), 200, dtype=torch.uint8)] * 2
    with caplog.at_level("WARNING", logger="job"):
        for _ in range(3):
            assert gpucrops.crops_into(out, [0, 1], images, [(0, 0, 10, 12, False)] * 2, 8) is False
    assert len(tries) == 1 and not out.any()
    lines = [r.getMessage() for r in caplog.records if "one Triton kernel" in r.getMessage()]
    assert len(lines) == 1 and "Failed to find C compiler" in lines[0] and "image by image" in lines[0]


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_an_encoded_batch_puts_each_decoded_image_in_its_row(tmp_path, monkeypatch, share):
    """decode=gpu's batch as the card assembles it (the packed JPEG bytes split, decoded, cropped by
    crops_resized and copied to their rows; the workers' pixels to theirs), run on the CPU: each row holds
    its own sample, against the samples decoded one by one; only two tensors of bytes cross from a worker."""
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2 import functional as F

    import job.datasets as datasets

    root = make_folder(tmp_path / "imgs", per_class=6)
    gpu = ImageFolder(root, image_size=20, num_classes=2, augment=True, decode="gpu", gpu_share=share)
    ids = [SampleIndex(i, 40 + i, 3) for i in reversed(range(len(gpu)))]
    raw, _ = gpu.collate([gpu[i] for i in ids])
    assert raw.data.dim() == 1 and sum(raw.sizes) == raw.data.numel() and len(raw.sizes) == len(raw.jpegs) > 0
    monkeypatch.setattr(datasets, "NATIVE_CPU_RESIZE", False)
    out = raw.decode(torch.device("cpu"), 20)
    jpeg_rows = set(raw.jpeg_rows.tolist())
    assert raw.rows.tolist() == [r for r in range(len(ids)) if r not in jpeg_rows]
    for row, i in enumerate(ids):
        item = gpu[i][0]
        if row in jpeg_rows:  # decoded here as the card would: float crop, antialiased, rounded
            top, left, h, w, flip = item.crop
            want = F.resized_crop(decode_jpeg(item.data).float(), top, left, h, w, [20, 20], antialias=True)
            want = want.round().to(torch.uint8)
            want = F.horizontal_flip(want) if flip else want
        else:
            want = item
        assert torch.equal(out[row], want), row


def test_decode_spans_hold_at_most_the_budget_and_a_larger_image_alone():
    from job.datasets import decode_spans

    assert decode_spans([], 10) == []
    assert decode_spans([4, 4, 4, 4], 10) == [range(0, 2), range(2, 4)]
    assert decode_spans([4, 30, 4, 4, 2], 10) == [range(0, 1), range(1, 2), range(2, 5)]  # 30 alone
    assert decode_spans([3] * 5, 100) == [range(0, 5)]


def test_a_gpu_batch_of_large_images_is_decoded_in_calls_within_the_budget_with_the_same_samples(tmp_path,
                                                                                                monkeypatch):
    """data.decode=gpu's batch (its path run on the CPU): with the decoded-pixel budget lowered to two of these
    images, it is decoded in calls of at most that many pixels, and gives the very batch of one call."""
    import job.datasets as datasets

    root = make_folder(tmp_path / "imgs", per_class=8, png_every=100)  # JPEGs only
    gpu = ImageFolder(root, image_size=24, num_classes=2, augment=True, decode="gpu")
    ids = [SampleIndex(i, 70 + i, 2) for i in range(len(gpu))]
    raw, _ = gpu.collate([gpu[i] for i in ids])
    assert raw.decoded == [3 * h * w for h, w in (gpu[i][0].hw for i in ids)]
    whole = raw.decode(CPU, 24)
    calls: list[int] = []
    decode_jpeg = datasets.EncodedBatch._decode

    def counting(self, files, paths, device):
        calls.append(len(files))
        return decode_jpeg(self, files, paths, device)

    monkeypatch.setattr(datasets.EncodedBatch, "_decode", counting)
    monkeypatch.setattr(datasets, "GPU_DECODE_BYTES", 2 * 3 * 160 * 120)
    assert torch.equal(raw.decode(CPU, 24), whole)
    spans = datasets.decode_spans(raw.decoded, datasets.GPU_DECODE_BYTES)
    assert calls == [len(s) for s in spans] and len(calls) > 4
    assert all(sum(raw.decoded[i] for i in s) <= datasets.GPU_DECODE_BYTES or len(s) == 1 for s in spans)


def test_data_decode_autos_batches_of_pixels_cross_in_the_workers_slots(tmp_path, monkeypatch):
    """data.decode=auto before (or without) any JPEG on the card: each batch of pixels is stacked straight into
    its worker's slot (channels-last, as the crops are), and reaches the model as decode=cpu's batch from no
    worker; once JPEGs go to the card, the mixed batch (JPEG bytes, pixels, rows, labels) crosses in the
    worker's byte slots, the same samples."""
    from job.data import _loader
    from job.datasets import GpuSplit
    from job.handover import HostSlots

    taken = []
    take = HostSlots.take
    monkeypatch.setattr(HostSlots, "take", lambda self, b, **kw: taken.append(b.j) or take(self, b, **kw))
    root = make_folder(tmp_path / "imgs", per_class=12)
    cpu = ImageFolder(root, image_size=16, num_classes=2, augment=True, decode="cpu")
    split = GpuSplit()
    auto = ImageFolder(root, image_size=16, num_classes=2, augment=True, decode="cpu", gpu_split=split)
    order = [[SampleIndex(i % 24, 6 * k + i, 3) for i in range(6 * k, 6 * k + 6)] for k in range(8)]
    got = list(_loader("t", auto, order, workers=2, device=CPU, channels_last=False, prefetch=False, persistent=True))
    assert len(taken) == 8
    for (x, y), ids in zip(got, order):
        want_x, want_y = batch(cpu, ids)
        assert torch.equal(x, want_x) and torch.equal(y, want_y) and x.is_contiguous()
    taken.clear()
    split.set(0, 0.5)  # half the JPEGs to the GPU path (run on the CPU here): EncodedBatches, in byte slots
    got = list(_loader("t", auto, order, workers=2, device=CPU, channels_last=True, prefetch=False, persistent=True))
    assert len(taken) == 8
    for (x, _), ids in zip(got, order):
        assert torch.equal(x, batch(cpu, ids)[0]) and x.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_batches_are_the_same_with_workers_under_any_split(tmp_path, decode):
    """job.data's stream on image files: 2 DataLoader workers give the samples of 0 workers, and a split of
    each micro-batch into two shares (two ddp ranks) concatenates to the whole, with data.prefetch's
    background thread (one batch ahead, or three: data.prefetch_depth) or without it."""
    root = make_folder(tmp_path / "imgs", per_class=6)
    cfg = config.load(["workload=tiny", "workload.image_size=16", "workload.augment=true", "data.kind=imagefolder",
                       f"data.path={root}", f"data.decode={decode}", "train.device=cpu"])
    if decode == "gpu":  # on a CPU device data.decode=gpu is refused; the dataset's GPU path still runs on the CPU
        cfg.data.decode = "cpu"

    def stream(workers: int, offset: int, count: int, prefetch: bool = False, depth: int = 1):
        cfg.data.workers, cfg.data.prefetch_depth = workers, depth
        d = Data(config.workload_of(cfg), config.workload_settings(cfg), cfg.data, seed=4, device=CPU)
        if decode == "gpu":
            ds, _ = d.train_set()
            ds.decode = "gpu"
        return d.batches(micro_batch=6, start=6, offset=offset, count=count, device=CPU, channels_last=False,
                         prefetch=prefetch)

    whole, a, b = stream(0, 0, 6), stream(2, 0, 2, prefetch=True, depth=3), stream(0, 2, 4, prefetch=True)
    for _ in range(3):  # past the end of the first epoch (12 files)
        x, y = next(whole)
        xa, ya = next(a)
        xb, yb = next(b)
        assert x.shape == (6, 3, 16, 16)
        assert torch.equal(x, torch.cat([xa, xb])) and torch.equal(y, torch.cat([ya, yb]))


def test_a_damaged_jpeg_is_one_line_naming_it_with_either_decoder(tmp_path):
    root = make_folder(tmp_path / "imgs")
    bad = root / "c1" / "0.jpg"
    bad.write_bytes(bad.read_bytes()[:200])  # the header survives: only the decode fails
    for decode in ("cpu", "gpu"):
        ds = ImageFolder(root, image_size=16, num_classes=2, decode=decode)
        index = next(i for i, (p, _) in enumerate(ds.samples) if p == str(bad))
        with pytest.raises(BadImage) as e:
            batch(ds, [SampleIndex(j, j, 0) for j in range(len(ds))] if decode == "gpu" else [SampleIndex(index, 0, 0)])
        assert str(e.value).startswith(f"cannot read image {bad} (") and str(e.value).endswith("fix or remove the file")
    garbage = root / "c0" / "1.jpg"
    garbage.write_bytes(b"not an image at all")
    ds = ImageFolder(root, image_size=16, num_classes=2, decode="gpu")
    index = next(i for i, (p, _) in enumerate(ds.samples) if p == str(garbage))
    with pytest.raises(BadImage, match=f"cannot read image {garbage}"):
        ds[index]


def test_the_workers_read_each_file_whole_and_name_one_they_cannot(tmp_path):
    """read_file (into a buffer of the file's size, which the sample's tensor then shares) gives the file's
    bytes; an empty file and one removed after the folder was listed are one line naming the file."""
    root = make_folder(tmp_path / "imgs")
    files = sorted(root.rglob("*.*"))
    for f in files:
        assert read_file(str(f)) == f.read_bytes()
    ds = ImageFolder(root, image_size=16, num_classes=2, decode="gpu")
    empty, gone = (Path(p) for p, _ in ds.samples[:2])
    empty.write_bytes(b"")
    gone.unlink()
    with pytest.raises(BadImage, match=f"cannot read image {empty} "):
        ds[0]
    with pytest.raises(BadImage) as e:
        ds[1]
    assert str(e.value) == f"cannot read image {gone} (No such file or directory); fix or remove the file"


def test_image_size_of_reads_the_size_pillow_reads_from_the_header(tmp_path):
    """The header's (height, width), which the workers read before decoding (data.max_pixels): JPEGs walked
    marker by marker (baseline, progressive, grey, CMYK, an APP1 segment whose bytes look like a frame
    header), PNG's IHDR, Pillow for the rest; a file that names no size is one line naming it."""
    import io

    from PIL import Image

    def jpeg(mode="RGB", **kw):
        buf = io.BytesIO()
        Image.new(mode, (131, 97)).save(buf, "JPEG", **kw)
        return buf.getvalue()

    fake_sof = b"\xff\xe1\x00\x09\xff\xc0\x00\x11\x08\x00\x10"  # APP1 holding the bytes of a 16-row SOF0
    plain = jpeg()
    files = {"baseline": plain, "progressive": jpeg(progressive=True), "grey": jpeg("L"), "cmyk": jpeg("CMYK"),
             "app1": plain[:2] + fake_sof + plain[2:], "fill": plain[:2] + b"\xff\xff" + plain[2:]}
    for fmt in ("PNG", "BMP", "WEBP", "GIF"):
        buf = io.BytesIO()
        Image.new("RGB", (131, 97)).save(buf, fmt)
        files[fmt] = buf.getvalue()
    for name, data in files.items():
        with Image.open(io.BytesIO(data)) as im:
            assert im.size == (131, 97), name
        assert image_size_of(data, name) == (97, 131), name
        if name not in ("PNG", "BMP", "WEBP", "GIF"):  # the JPEGs: from the marker walk, not Pillow's fallback
            assert jpeg_size(data) == (97, 131), name
    with pytest.raises(BadImage, match="cannot read image cut.jpg"):
        image_size_of(plain[:20], "cut.jpg")


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_an_image_claiming_more_pixels_than_data_max_pixels_is_one_line_naming_it(tmp_path, decode):
    """A JPEG of a few KB whose header claims 60,000 x 60,000 pixels (10 GB decoded) is refused from its header,
    before any decoder allocates it, by the worker that reads it (either decoder); so is any image above a
    lower data.max_pixels, and 0 lifts the limit."""
    root = make_folder(tmp_path / "imgs")
    bomb = root / "c0" / "0.jpg"
    claim_size(bomb, 60_000, 60_000)
    ds = ImageFolder(root, image_size=16, num_classes=2, decode=decode)
    index = next(i for i, (p, _) in enumerate(ds.samples) if p == str(bomb))
    with pytest.raises(BadImage) as e:
        ds[SampleIndex(index, index, 0)]
    assert str(e.value) == (f"cannot read image {bomb} (60,000 x 60,000 pixels, 10,300 MB decoded: more than "
                            "data.max_pixels=178,956,970); shrink it (python -m job.shrink), remove it, or raise "
                            "data.max_pixels")
    png = next(p for p, _ in ds.samples if p.endswith(".png"))  # 120 x 160 or another of make_folder's shapes
    small = ImageFolder(root, image_size=16, num_classes=2, decode=decode, max_pixels=1000)
    with pytest.raises(BadImage, match=r" pixels, [0-9.]+ MB decoded: more than data.max_pixels=1,000\)"):
        small[SampleIndex(next(i for i, (p, _) in enumerate(small.samples) if p == png), 0, 0)]
    free = ImageFolder(root, image_size=16, num_classes=2, decode=decode, max_pixels=0)
    ok = [i for i, (p, _) in enumerate(free.samples) if p != str(bomb)]
    x, y = batch(free, [SampleIndex(i, i, 0) for i in ok])
    assert x.shape == (len(ok), 3, 16, 16)


def test_the_samples_are_torchvisions_pairs_packed(tmp_path):
    """ImageFolder.samples holds torchvision's (file, class) pairs, in its order, packed (Samples): indexing,
    negative indices, slices, iteration, a pickled copy (a spawned worker's), names that are not UTF-8."""
    import pickle

    from torchvision import datasets

    root = make_folder(tmp_path / "imgs")
    want = datasets.ImageFolder(str(root), loader=str).samples
    ds = ImageFolder(root, image_size=16, num_classes=2)
    assert isinstance(ds.samples, Samples) and list(ds.samples) == want and len(ds.samples) == len(want)
    assert ds.samples[-1] == want[-1] and ds.samples[2:5] == want[2:5] and list(pickle.loads(pickle.dumps(ds.samples))) == want
    with pytest.raises(IndexError):
        ds.samples[len(want)]
    odd = [("/data/caf\udce9/1.jpg", 7), ("/data/b.png", 0)]  # a Latin-1 name, as os.listdir returns it
    assert list(Samples(odd)) == odd and list(Samples([])) == []


def _private_mb_after_reading(samples) -> float:
    """MB of its own (not shared with this process) that a forked child holds after reading every entry of
    `samples`, as a DataLoader worker forked from the training process does over an epoch."""
    import gc
    import os

    def private_kb(pid: int) -> int:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.rstrip().endswith("kB")}
        return fields["Private_Dirty"] + fields["Private_Clean"]

    gc.collect()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: read every entry, report how much of its memory is its own, leave
        before = private_kb(os.getpid())
        for i in range(len(samples)):
            path, label = samples[i]  # as ImageFolder.__getitem__ does
        os.write(w, str(private_kb(os.getpid()) - before).encode())
        os._exit(0)
    os.close(w)
    grew = int(os.read(r, 64).decode())
    os.waitpid(pid, 0)
    return grew / 1024


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc/<pid>/smaps_rollup")
def test_a_forked_worker_reading_every_sample_shares_the_packed_list():
    """200,000 ImageNet-like names: a forked child that reads every entry of torchvision's list of tuples copies
    the pages their reference counts live on (tens of MB of its own); of the packed Samples, almost nothing."""
    pairs = [(f"/data/imagenet/train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG", i % 1000) for i in range(200_000)]
    packed = Samples(pairs)
    as_list = _private_mb_after_reading(pairs)
    assert as_list > 20, as_list  # the measurement sees the copies
    assert _private_mb_after_reading(packed) < 3


def test_data_decode_gpu_on_a_cpu_run_is_refused(tmp_path):
    root = make_folder(tmp_path / "imgs")
    p = subprocess.run(job_cmd("train", "workload=tiny", "data.kind=imagefolder", f"data.path={root}",
                               "data.decode=gpu", "train.device=cpu", "train.steps=1", f"train.run_dir={tmp_path}"),
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == ("error: data.decode=gpu decodes images on the training GPU, and "
                                                 "this run trains on the CPU; use data.decode=auto or data.decode=cpu")
    assert not (tmp_path / "tiny").exists() or not any((tmp_path).rglob("*.pt"))
    p = subprocess.run(job_cmd("train", "workload=tiny", "data.decode=jpeg", "train.device=cpu"), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "data.decode" in p.stderr.strip().splitlines()[-1], p.stderr


def test_the_decoders_bench_together_ends_with_one_line_when_a_process_fails():
    """--procs: a process whose decoding raises, or that is killed outright, ends the measurement with one line
    (the caller prints it, exit 1) instead of leaving the others, or the bench, waiting."""
    import os
    import signal

    from job.bench.decoders import _together
    from job.datasets import BadImage

    def broken():
        raise BadImage("cannot read image /data/x.jpg (damaged); fix or remove the file")

    with pytest.raises(RuntimeError, match=r"in 3 processes at once: BadImage: cannot read image /data/x.jpg"):
        _together(broken, 4, 3)
    calls = []

    def killed_when_timed():
        calls.append(1)
        if len(calls) == 2:  # the timed call, after the common start
            os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(RuntimeError, match=r"in 2 processes at once: process \d+ ended with exit code -9"):
        _together(killed_when_timed, 4, 2)
    assert _together(lambda: None, 4, 2)[0] > 0


def test_the_decoders_bench_refuses_a_process_count_that_is_not_one(tmp_path):
    p = subprocess.run([sys.executable, "-m", "job.bench.decoders", "--dir", str(tmp_path), "--procs", "8,0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "--procs 8,0" in last and "--procs 8,15" in last, p.stderr


def test_the_decoders_bench_refuses_an_absurd_short_side(tmp_path):
    p = subprocess.run([sys.executable, "-m", "job.bench.decoders", "--dir", str(tmp_path), "--short-side", "9"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "--short-side 9: give 0 (ImageNet-like files) or a side from 64 to 2048 px" in last, p.stderr


def test_the_decoders_bench_refuses_a_folder_it_did_not_generate(tmp_path):
    (tmp_path / "mine" / "cat").mkdir(parents=True)
    (tmp_path / "mine" / "cat" / "0001.jpg").write_bytes(b"my photo")
    p = subprocess.run([sys.executable, "-m", "job.bench.decoders", "--dir", str(tmp_path / "mine"), "--files", "12"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "mine holds files the bench did not generate" in lines[0], p.stderr
    assert (tmp_path / "mine" / "cat" / "0001.jpg").read_bytes() == b"my photo"


def test_the_decoders_bench_times_each_cpu_decoder_and_the_hand_over(tmp_path, capsys):
    """python -m job.bench.decoders on a CPU machine: the two CPU decoders' rates, the cpu decoder's in 2
    processes at once, and the CPU per batch handed over by a worker, the training process's and the
    worker's, for decoded pixels (data.decode=cpu and auto) and for the GPU decoder's packed bytes."""
    import re

    from job.bench import decoders

    assert decoders.main(["--dir", str(tmp_path / "imgs"), "--files", "12", "--images", "12", "--batch", "4",
                          "--size", "32", "--procs", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"decoders: 12 of 12 generated JPEG files \(\d+ kB on average\) -> 32x32", out), out
    for name in ("pil", "cpu"):
        assert re.search(rf"\n  {name} +[\d,]+ \([\d,]+-[\d,]+\) img/s per process", out), out
    assert "gpu " not in out.split("hand-over")[0]  # no card, no GPU row
    m = re.search(r"\n  cpu x 2 +([\d,]+) img/s together \(([\d,]+) a process; the slowest ([\d,]+)\), 2 processes "
                  r"at once, as data.workers=2\n", out)
    assert m and int(m[1].replace(",", "")) > 0 and int(m[3].replace(",", "")) > 0, out
    m = re.search(r"hand-over, the training process's CPU per batch of 4 from a worker: cpu ([\d.]+) ms, "
                  r"auto ([\d.]+) ms, gpu ([\d.]+) ms", out)
    assert m and all(float(v) >= 0 for v in m.groups()), out
    m = re.search(r"the worker's CPU per batch of 4 \(its samples, collate and hand-over\): cpu ([\d.]+) ms "
                  r"\(\d+ us an image\), auto ([\d.]+) ms \(\d+ us an image\), gpu ([\d.]+) ms", out)
    assert m and float(m[1]) > 0 and float(m[2]) > 0, out  # decoding 32 px crops takes a worker some CPU


def test_the_held_out_set_is_built_once_and_each_split_says_its_samples(tmp_path, caplog):
    """Every evaluation reads the same held-out set: the folder is listed once a run (it used to be listed again
    at every evaluation), and the log's line counts the training samples, not the whole folder."""
    import logging

    root = make_folder(tmp_path / "imgs", per_class=5)
    cfg = config.load(["workload=tiny", "workload.image_size=16", "data.kind=imagefolder", f"data.path={root}",
                       "data.val_fraction=0.2", "train.device=cpu"])
    d = Data(config.workload_of(cfg), config.workload_settings(cfg), cfg.data, seed=0, device=CPU)
    built = []
    dataset = d.workload.dataset
    d.workload = dataclasses.replace(d.workload, dataset=lambda *a: built.append(a[1].split) or dataset(*a))
    with caplog.at_level(logging.INFO, logger="job"):
        d.check()
        for _ in range(3):  # three evaluations
            assert sum(n for *_, n in d.val_batches(batch=4, limit=0, rank=0, world=1, device=CPU,
                                                    channels_last=False)) == 2
    d.close()
    assert built == ["train", "val"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert lines == [f"data: imagefolder {root}: 8 training samples (2 more held out: data.val_fraction=0.2), "
                     "decoded on the cpu (data.decode=auto)"], lines
