import statistics, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from job.bench.imagefolder import image_folder
from job.datasets import ImageFolder, SampleIndex
root = Path("/tmp/runs/gi-images"); image_folder(root, 300, seed=0)
for decode in ("cpu", "gpu"):
    ds = ImageFolder(root, image_size=224, num_classes=10, augment=True, decode=decode)
    ids = [SampleIndex(i, i, 0) for i in range(len(ds))]
    for i in ids[:20]: ds[i]
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in ids: ds[i]
        runs.append((time.perf_counter() - t0) / len(ids) * 1e6)
    print(sys.argv[1], decode, f"median {statistics.median(runs):.1f} us a sample ({min(runs):.1f}-{max(runs):.1f})")
