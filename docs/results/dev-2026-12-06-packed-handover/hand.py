"""The training process's side of handing 256-image mixed batches over from one worker: CPU per batch, and how
much of it a spinning Python thread could not run (interpreter lock held). old: fresh shared-memory files."""
import resource, sys, threading, time
from pathlib import Path
import torch
from torch.utils.data import DataLoader
from job.bench.imagefolder import image_folder
from job.datasets import EncodedBatch, ImageFolder, SampleIndex, GpuSplit
from job.data import _through_slots, PREFETCH_FACTOR
mode, share = sys.argv[1], float(sys.argv[2])
if mode == "old":
    del EncodedBatch.HANDOVER_TENSORS
folder = image_folder(Path("/tmp/handimgs"), 600, seed=3)
split = GpuSplit(); split.set(0, share)
ds = ImageFolder(folder["path"], image_size=224, num_classes=10, augment=True, decode="cpu", gpu_split=split)
torch.multiprocessing.set_sharing_strategy("file_system")
B = 256
batches = [[SampleIndex(i, i, 0) for i in range(j, j + B)] for j in range(0, 600 - B + 1, B)] * 3
def own(b):  # what pinning does: a copy of every tensor (page faults on a fresh mapping), then the original freed
    enc, y = b
    for n in ("data", "pixels", "rows", "jpeg_rows"):
        t = getattr(enc, n)
        if t is not None:
            setattr(enc, n, t.clone())
    return enc, y.clone()
collate, move = _through_slots(ds.collate, lambda b: b)
it = iter(DataLoader(ds, batch_sampler=batches, num_workers=1, collate_fn=collate, prefetch_factor=PREFETCH_FACTOR))
got = move(next(it)); got = own(got) if mode == "old" else got
kept = []; t_move = t_free = 0.0
for _ in range(len(batches) - 1):
    b = next(it)
    time.sleep(0.4)  # the worker idle: its queue is full
    t0 = time.perf_counter()
    out = move(b)
    if mode == "old":
        out = own(out)
    t1 = time.perf_counter()
    kept.append(out)  # the copies live on (pinned memory is the caching host allocator's, never freed)
    del b, out  # what crossed, freed: the fresh shared-memory files (old), views of kept slots (new)
    t2 = time.perf_counter()
    t_move += t1 - t0; t_free += t2 - t1
n = len(batches) - 1
print(f"{mode} share {share}: a batch of {B}: copied out in {t_move / n * 1e3:.2f} ms, what crossed freed in {t_free / n * 1e3:.2f} ms")
