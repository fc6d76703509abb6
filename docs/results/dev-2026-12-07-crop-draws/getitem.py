"""A worker's sample, CPU time (one thread): `PYTHONPATH=. python getitem.py LABEL FOLDER` over the generated
JPEGs of `python -m job.bench.decoders --dir FOLDER` (5,000 files, ~108 kB); medians of 3 passes (min-max)
after a warm pass, 2,000 samples handed undecoded (data.decode=gpu) and 300 decoded (data.decode=cpu)."""
import sys
import time

import torch

from job.datasets import ImageFolder, SampleIndex

torch.set_num_threads(1)
out = []
for decode, n in (("gpu", 2000), ("cpu", 300)):
    ds = ImageFolder(sys.argv[2], image_size=224, num_classes=10, augment=True, decode=decode)
    ids = [SampleIndex(i, i, 0) for i in range(n)]
    [ds[i] for i in ids]  # the files into the page cache, the imports done
    r = []
    for _ in range(3):
        t = time.process_time()
        [ds[i] for i in ids]
        r.append((time.process_time() - t) / n * 1e6)
    r.sort()
    out.append(f"{decode} {r[1]:.0f} ({r[0]:.0f}-{r[2]:.0f}) us")
print(sys.argv[1], *out)
