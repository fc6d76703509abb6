"""The GPU JPEG decoder on a real card (one is enough; skipped without CUDA): data.decode=gpu gives the samples
of data.decode=cpu (the same crop of the same sample id; pixels within the decoders' rounding), names a damaged
file in one line, and trains under ddp (one process) and balanced with workers and data.prefetch. Speed is the
benchmark's to check (bench.imagefolder), not a test's."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch
from _images_helpers import batch, make_folder
from conftest import ROOT, job_cmd, requires_gpus

from job import devices
from job.bench.imagefolder import image_folder
from job.datasets import STD, BadImage, ImageFolder, SampleIndex

pytestmark = pytest.mark.gpu
# nvJPEG against libjpeg-turbo on the same file: IDCT and chroma upsampling round differently. Measured on an
# H200 (torchvision 0.26) over 64 generated files: mean 1.00 / 1.50 levels of 255, 99.9th percentile 6 / 11,
# max 14 / 25 (centre crop / random resized crop; docs/benchmarks.md). The bounds leave room above those.
MEAN_LEVELS, P999_LEVELS = 2.5, 16


@requires_gpus(1)
@pytest.mark.parametrize("augment,share", [(False, 1.0), (True, 1.0), (True, 0.5)])
def test_gpu_decoded_samples_match_the_cpu_decoded_ones(tmp_path, augment, share):
    folder = image_folder(tmp_path / "imgs", 64, seed=1)
    cpu = ImageFolder(folder["path"], image_size=224, num_classes=10, augment=augment, decode="cpu")
    gpu = ImageFolder(folder["path"], image_size=224, num_classes=10, augment=augment, decode="gpu", gpu_share=share)
    ids = [SampleIndex(i, 1000 + i, 3) for i in range(64)]
    cuda = torch.device("cuda", 0)
    xa, ya = batch(cpu, ids, cuda)
    xb, yb = batch(gpu, ids, cuda)
    assert xb.device.type == "cuda" and xa.shape == xb.shape == (64, 3, 224, 224) and torch.equal(ya, yb)
    std = torch.tensor(STD, device=cuda).view(1, 3, 1, 1) * 255
    levels = ((xa - xb).abs() * std).flatten()  # back to levels of 255
    mean, p999 = float(levels.mean()), float(levels.kthvalue(int(levels.numel() * 0.999)).values)
    print(f"augment={augment} gpu_share={share}: |gpu - cpu| mean {mean:.3f}, 99.9th percentile {p999:.2f}, max {float(levels.max()):.1f}"
          " levels of 255")
    assert mean < MEAN_LEVELS and p999 <= P999_LEVELS


@requires_gpus(1)
def test_the_one_launch_crops_match_the_image_by_image_crops_on_a_card(tmp_path):
    """job.gpucrops (the batch's crops in one kernel) against datasets.crops_resized (torch's antialiased
    resize, image by image) on nvJPEG's own output: the same pixels up to float rounding."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from job import gpucrops
    from job.datasets import crops_resized, image_size_of

    folder = image_folder(tmp_path / "imgs", 64, seed=3)
    ds = ImageFolder(folder["path"], image_size=224, num_classes=10, augment=True, decode="gpu")
    files, crops = [], []
    for i in range(64):
        raw = open(ds.samples[i][0], "rb").read()
        files.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        crops.append(ds.crop_of(SampleIndex(i, 500 + i, 1), *image_size_of(raw, ds.samples[i][0])))
    images = decode_jpeg(files, mode=ImageReadMode.RGB, device="cuda")
    out = torch.zeros((65, 3, 224, 224), dtype=torch.uint8, device="cuda")
    gpucrops.crops_into(out, list(range(1, 65)), images, crops, 224)
    diff = (out[1:].int() - crops_resized(images, crops, 224).int()).abs()
    assert int(diff.max()) <= 1 and float((diff == 0).float().mean()) > 0.999 and not out[0].any()


@requires_gpus(1)
def test_a_batch_decoded_in_calls_within_the_budget_is_the_batch_of_one_call_on_a_card(tmp_path, monkeypatch):
    """data.decode=gpu with its decoded-pixel budget lowered to a few images (camera photos' case): the batch
    is decoded in several nvJPEG calls and is the one call's batch exactly."""
    import job.datasets as datasets

    folder = image_folder(tmp_path / "imgs", 32, seed=5)
    gpu = ImageFolder(folder["path"], image_size=224, num_classes=10, augment=True, decode="gpu")
    ids = [SampleIndex(i, 300 + i, 2) for i in range(32)]
    raw, _ = gpu.collate([gpu[i] for i in ids])
    cuda = torch.device("cuda", 0)
    whole = raw.pin_memory().decode(cuda, 224)
    monkeypatch.setattr(datasets, "GPU_DECODE_BYTES", 3 * 500 * 375 * 3)
    assert len(datasets.decode_spans(raw.decoded, datasets.GPU_DECODE_BYTES)) >= 10
    assert torch.equal(raw.decode(cuda, 224), whole)


@requires_gpus(1)
def test_decoded_images_are_not_overwritten_before_their_crops_read_them(tmp_path):
    """torchvision allocates nvJPEG's output on the calling stream and writes it on a stream of its own that
    does not wait for the calling one. Batch A's crops queued behind a long kernel, its images freed, batch B
    decoded at once from same-sized files: B's images must not land in A's memory before A's crops read it
    (EncodedBatch._decode waits for them), so A is what it is decoded alone."""
    folder = image_folder(tmp_path / "imgs", 32, seed=6)
    gpu = ImageFolder(folder["path"], image_size=224, num_classes=10, augment=False, decode="gpu")
    cuda = torch.device("cuda", 0)
    a_ids, b_ids = [SampleIndex(i, i, 0) for i in range(16)], [SampleIndex(i, i, 0) for i in range(16, 32)]
    raw_a = gpu.collate([gpu[i] for i in a_ids])[0].pin_memory()
    raw_b = gpu.collate([gpu[i] for i in b_ids])[0].pin_memory()
    want = raw_a.decode(cuda, 224).clone()
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device=cuda)
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # about a second of the side stream: A's crops wait behind it
        got = raw_a.decode(cuda, 224)
        raw_b.decode(cuda, 224)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@requires_gpus(1)
def test_memory_a_queued_kernel_still_writes_is_not_given_to_nvjpeg(tmp_path, monkeypatch):
    """The model's own memory: blocks freed on the calling stream while a kernel queued there still writes them
    must not take nvJPEG's output, which nvJPEG writes at once on a stream of its own. Blocks the size of each
    decoded image are freed behind a long kernel and a fill of 255; then a decode. Its images are in none of
    those blocks, and the batch is what it is decoded alone. (Written for a compiled ResNet-50 that trained to
    NaN within 20 steps with data.prefetch=false. On an H100, the code before that fix put all 16 images in the
    freed blocks, yet the pixels matched: at CUDA's default of 8 hardware queues nvJPEG's work waited behind the
    fills; the pointers are what tells the two apart.)"""
    import torchvision.io

    folder = image_folder(tmp_path / "imgs", 16, seed=7)
    gpu = ImageFolder(folder["path"], image_size=224, num_classes=10, augment=False, decode="gpu")
    cuda = torch.device("cuda", 0)
    raw = gpu.collate([gpu[SampleIndex(i, i, 0)] for i in range(16)])[0].pin_memory()
    want = raw.decode(cuda, 224).clone()
    torch.cuda.synchronize()
    decoded, decode_jpeg = [], torchvision.io.decode_jpeg

    def spy(*args, **kwargs):  # job.datasets imports decode_jpeg from torchvision.io at each call
        images = decode_jpeg(*args, **kwargs)
        decoded.extend((x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()) for x in images)
        return images

    monkeypatch.setattr(torchvision.io, "decode_jpeg", spy)
    torch.cuda._sleep(2_000_000_000)  # about a second of the calling stream: the fills wait behind it
    held = [torch.empty(n, dtype=torch.uint8, device=cuda) for n in raw.decoded]
    freed = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in held]
    for t in held:
        t.fill_(255)
    del held, t  # freed with their fills still queued
    got = raw.decode(cuda, 224)
    torch.cuda.synchronize()
    assert len(decoded) == 16
    inside = [(a, b) for a, b in decoded if any(a < d and c < b for c, d in freed)]
    assert not inside, f"{len(inside)} of 16 decoded images in memory freed behind a queued kernel"
    assert torch.equal(got, want)


@requires_gpus(1)
def test_a_damaged_jpeg_on_the_gpu_is_one_line(tmp_path):
    root = make_folder(tmp_path / "imgs")
    bad = root / "c1" / "0.jpg"
    bad.write_bytes(bad.read_bytes()[:200])
    ds = ImageFolder(root, image_size=16, num_classes=2, decode="gpu")
    with pytest.raises(BadImage) as e:
        batch(ds, [SampleIndex(j, j, 0) for j in range(len(ds))], torch.device("cuda", 0))
    assert str(e.value).startswith(f"cannot read image {bad} (")


@requires_gpus(1)
@pytest.mark.parametrize("strategy,decode,share", [("ddp", "gpu", 1.0), ("balanced", "auto", 1.0), ("ddp", "gpu", 0.5)])
def test_training_from_jpeg_files_decoded_on_the_gpu(tmp_path, strategy, decode, share):
    folder = image_folder(tmp_path / "imgs", 200, seed=2)
    p = subprocess.run(job_cmd("train", "workload=resnet50", f"strategy={strategy}", "strategy.nprocs=1",
                               "workload.num_classes=10", "workload.augment=true", "train.batch_size=32",
                               "train.steps=12", "train.amp=bf16", "train.channels_last=true",
                               "data.kind=imagefolder", f"data.path={folder['path']}", "data.val_fraction=0.1",
                               "data.workers=4", "data.prefetch=true", f"data.decode={decode}", f"data.gpu_share={share}",
                               f"train.run_dir={tmp_path}",
                               "train.run_id=r"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["validation"]["val_samples"] == 20
    config = (tmp_path / "r" / "config.yaml").read_text()
    assert f"decode: {decode}" in config
    where = ("cpu, a share moving to the gpu if the workers cannot keep up and it trains faster" if decode == "auto"
             else "gpu" if share == 1 else
             f"gpu ({share:.0%} of the JPEGs; the workers decode the rest)")
    assert f"decoded on the {where} (data.decode={decode})" in p.stderr, p.stderr[-3000:]
    print(f"{strategy}: {s['img_per_s']:,.0f} img/s")


@requires_gpus(1)
def test_data_decode_auto_moves_jpegs_to_the_card_when_one_worker_cannot_keep_up(tmp_path):
    """One worker cannot decode for ResNet-50 on an H200: data.decode=auto tries every JPEG on the card (and a mix
    of the two decoders where that still waits), keeps a share only where it trained faster, says each step in
    one line, and the run ends well with the share it kept in summary.json. Its steps: the most choosing can
    take at batches of 10 ms or more (an H200 trained ResNet-50's batch of 32 in 20-27 ms with JPEGs on the card,
    67 ms with the worker alone: its windows, 40 batches and 2 s at least, were 40-100 batches), and 20 more."""
    from job.data import SplitTuner, tuner_lookahead

    steps = SplitTuner.longest(tuner_lookahead(1), step_s=0.01) + 20
    folder = image_folder(tmp_path / "imgs", 200, seed=3)
    p = subprocess.run(job_cmd("train", "workload=resnet50", "strategy=ddp", "strategy.nprocs=1",
                               "workload.num_classes=10", "workload.augment=true", "train.batch_size=32",
                               f"train.steps={steps}", "train.log_every=50", "train.amp=bf16", "train.channels_last=true",
                               "data.kind=imagefolder", f"data.path={folder['path']}", "data.workers=1",
                               f"train.run_dir={tmp_path}", "train.run_id=r"),
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [ln.split("data.decode=auto: ", 1)[1] for ln in p.stderr.splitlines() if "data.decode=auto: " in ln]
    print("\n".join(lines))
    assert lines and lines[0].startswith("the loop waited for data") and "trying every JPEG on the GPU" in lines[0]
    assert "keeping it" in lines[-1] or "back to" in lines[-1]
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    kept = s["data_gpu_share"]
    assert kept is not None and 0 <= kept <= 1
    assert (kept == 0) == ("back to the workers" in lines[-1]), (kept, lines[-1])
    # every step after this one trained with the choice: after the trials began, within the run (its trials changed the share)
    assert 0 < s["data_auto_settled_step"] <= steps, s["data_auto_settled_step"]


@requires_gpus(1)
def test_the_bench_times_an_auto_row_after_data_decode_auto_has_chosen(tmp_path):
    """bench.auto_settle: the imagefolder row with data.decode=auto (one worker, which cannot keep up) trains
    SplitTuner.longest steps before its warm-up and timed steps, and so does the synthetic row; bench.json records
    the step the choice held from, and the row's line says it chose before the timed steps exactly when it did."""
    from _bench_helpers import runs_by_name, validate

    from job.bench.compare import AUTO_SHORTEST_STEP_S
    from job.data import SplitTuner, tuner_lookahead

    out = tmp_path / "b"
    p = subprocess.run(job_cmd("bench", "bench.workloads=[resnet50]", "workload.num_classes=10", "train.batch_size=32",
                               "train.amp=bf16", "train.channels_last=true", "bench.strategies=[ddp]",
                               "bench.baseline=none", "bench.imagefolder=true", "bench.imagefolder_images=200",
                               "bench.repeats=1", "bench.warmup=10", "bench.steps=20", "data.workers=1",
                               f"train.run_dir={tmp_path}", f"bench.out={out}"),
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "bench.json").read_text())
    validate(doc, required=False)
    run = runs_by_name(doc)["ddp+imagefolder"]
    first = 10 + SplitTuner.longest(tuner_lookahead(1), step_s=AUTO_SHORTEST_STEP_S)
    assert run["peak_window"] == [first, first + 20] and run["timed_steps"] == 20
    # the synthetic row is timed over the same steps
    assert runs_by_name(doc)["ddp"]["peak_window"] == [first, first + 20]
    assert run["input_gpu_share"] is not None
    settled = run["input_auto_settled_step"]
    line = next(x for x in p.stdout.splitlines() if x.startswith("  ddp+imagefolder: "))
    if settled is not None and settled <= first:
        assert "before the timed steps" in line or "data.decode=auto" not in line, line
    else:
        assert "its trials are in the timed steps of 1 of 1" in line, line


@requires_gpus(1)
@pytest.mark.parametrize("prefetch", [False, True])
def test_the_training_streams_pinned_slots_give_the_default_hand_overs_batches(tmp_path, monkeypatch, prefetch):
    """On a card the DataLoader's pinning thread copies each batch out of its slot into pinned memory and hands
    the slot back; a slot handed back too early would show another batch's pixels. 40 batches from 2 workers
    (4 slots each), all kept on the card, against the same batches through the default hand-over."""
    from job.data import _loader
    from job.handover import HostSlots

    seen: list = []
    take = HostSlots.take

    def spy(self, b, **kw):
        seen.append((self, kw))
        return take(self, b, **kw)

    monkeypatch.setattr(HostSlots, "take", spy)
    folder = image_folder(tmp_path / "imgs", 64, seed=3)
    ds = ImageFolder(folder["path"], image_size=224, num_classes=10, augment=True, decode="cpu")
    order = [[SampleIndex(k % 64, 16 * b + k, 5) for k in range(16 * b, 16 * b + 16)] for b in range(40)]
    cuda = torch.device("cuda", 0)
    kw = dict(workers=2, device=cuda, channels_last=True, prefetch=prefetch)
    slots = list(_loader("t", ds, order, persistent=True, **kw))
    plain = list(_loader("t", ds, order, persistent=False, **kw))
    # every batch through a slot, copied out into pinned memory by the pinning thread; each ring mapped once
    assert len(seen) == 40 and all(kw == {"pinned": True} for _, kw in seen) and len(seen[0][0]._rings) == 2 * 3
    for (xa, ya), (xb, yb) in zip(slots, plain):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@requires_gpus(1)
def test_the_card_idles_between_steps_where_the_input_is_late_and_not_where_it_keeps_up(tmp_path):
    """CardGaps on a card: ResNet-50 from JPEGs that the training thread decodes itself (data.workers=0) leaves
    the card idle between steps most of the time, about as much as the loop waited; on synthetic data the host
    runs ahead of the card, which hardly idles. The input line says which. Every logged step's card row carries
    the card's running count of seconds held below its clocks by its power limit, where NVML keeps one."""
    folder = image_folder(tmp_path / "imgs", 200, seed=4)
    common = ("workload=resnet50", "strategy=ddp", "strategy.nprocs=1", "workload.num_classes=10",
              "train.batch_size=128", "train.steps=40", "train.timing_warmup=10", "train.log_every=10",
              "train.amp=bf16", "train.channels_last=true", f"train.run_dir={tmp_path}")
    runs = {"synthetic": ("data.kind=synthetic",),
            "files": ("data.kind=imagefolder", f"data.path={folder['path']}", "data.workers=0", "data.decode=cpu")}
    s = {}
    for name, extra in runs.items():
        p = subprocess.run(job_cmd("train", *common, *extra, f"train.run_id={name}"), cwd=ROOT, capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        s[name] = json.loads((tmp_path / name / "summary.json").read_text())
        s[name]["stderr"] = p.stderr
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert all(r["card_gaps"] <= r["step"] for r in lines)
        # each card's seconds held below its clocks by its power limit, as NVML answers this process after the run
        after = devices.card_power_capped_s(devices.visible_cards()[0])
        capped = [r["cards"][0]["power_capped_s"] for r in lines]
        if after is None:  # a card or driver that does not keep the count: no figure pretends one
            assert capped == [None] * len(lines), capped
        else:
            assert all(c is not None and 0 <= c <= after for c in capped) and capped == sorted(capped), (capped, after)
        print(f"{name}: loop waited {s[name]['data_wait']:.1%}, card idle between steps "
              f"{s[name]['card_idle_between_steps']:.1%}")
    files, synthetic = s["files"], s["synthetic"]
    assert 0.5 < files["card_idle_between_steps"] <= files["data_wait"] + 0.05
    assert "and the card had nothing to run between steps" in files["stderr"]
    assert re.search(r"waited for data \d+% \(the card idle between steps \d+%\)", files["stderr"]), files["stderr"][-3000:]
    assert synthetic["card_idle_between_steps"] < 0.05
