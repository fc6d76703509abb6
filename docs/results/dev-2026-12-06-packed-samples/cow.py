"""Private memory a forked worker (as a DataLoader worker is) ends with after reading every entry of an
ImageNet-sized sample list (1,281,167 ImageNet-like (path, class) pairs): `list` (torchvision's list of tuples,
what ImageFolder.samples was) against `packed` (job.datasets.Samples). PYTHONPATH=. python cow.py list|packed"""
import gc, os, sys, time
import numpy as np
N = 1_281_167
def private_kb(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        d = {l.split(":")[0]: int(l.split()[1]) for l in f if l.split()[-1] == "kB"}
    return d["Private_Dirty"] + d["Private_Clean"], d["Rss"]
paths = [f"/data/imagenet/train/n{c:08d}/n{c:08d}_{i}.JPEG" for i, c in ((i, i % 1000) for i in range(N))]
labels = [i % 1000 for i in range(N)]
mode = sys.argv[1]
if mode == "list":
    samples = list(zip(paths, labels))
    def get(i): return samples[i]
else:
    from job.datasets import Samples
    samples = Samples(list(zip(paths, labels)))
    def get(i): return samples[i]
del paths, labels; gc.collect(); gc.freeze()
print(mode, "parent private/RSS MB", [v // 1024 for v in private_kb(os.getpid())])
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    t0 = time.perf_counter()
    for i in range(N): p, c = get(i)
    os.write(w, f"{time.perf_counter() - t0:.2f}".encode()); time.sleep(3); os._exit(0)
secs = os.read(r, 100).decode(); time.sleep(0.5)
print(mode, f"worker after touching every entry ({secs} s): private/RSS MB", [v // 1024 for v in private_kb(pid)])
os.waitpid(pid, 0)
