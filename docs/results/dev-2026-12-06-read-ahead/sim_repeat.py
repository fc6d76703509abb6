"""sim.py's pipeline again (16 workers taking T s a batch, a loop of 48 ms a step after a 5 s first step), read
three ways over the bench's window (steps 10-160, records every 10 steps): made / taken over the whole window,
over its later half from step 90 (the endpoints), and the later half's read-ahead as a least-squares slope.
python3 sim_repeat.py T; out_repeat.txt: 4 runs each of T = 0.5 and 0.7 on the development machine."""
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from job.data import PREFETCH_FACTOR, CountingCollate

T_BATCH, STEP, W, B = float(sys.argv[1]), 0.048, 16, 4
class Slow(Dataset):
    def __len__(self): return 10**6
    def __getitem__(self, i):
        time.sleep(T_BATCH / B); return torch.zeros(1)
def slope(pts):
    n = len(pts); tm = sum(t for t, _ in pts) / n; bm = sum(b for _, b in pts) / n
    return sum((t - tm) * (b - bm) for t, b in pts) / sum((t - tm) ** 2 for t, _ in pts)
if __name__ == "__main__":
    made = torch.zeros(W, dtype=torch.int64).share_memory_()
    it = iter(DataLoader(Slow(), batch_size=B, num_workers=W, prefetch_factor=PREFETCH_FACTOR,
                         collate_fn=CountingCollate(torch.utils.data.default_collate, made)))
    next(it); time.sleep(5.0)
    rec = {}; taken = B
    for step in range(1, 161):
        x = next(it); taken += B; time.sleep(STEP)
        if step % 10 == 0: rec[step] = (time.perf_counter(), int(made.sum()), taken)
    a, b = rec[90], rec[160]
    ends = (b[1] - a[1]) / (b[2] - a[2])
    pts = [(rec[s][0], rec[s][1] - rec[s][2]) for s in range(90, 161, 10)]
    taken_rate = (b[2] - a[2]) / (b[0] - a[0])
    reg = (taken_rate + slope(pts)) / taken_rate
    whole = (rec[160][1] - rec[10][1]) / (rec[160][2] - rec[10][2])
    print(f"{T_BATCH} whole {whole:.3f} ends {ends:.3f} regression {reg:.3f}")
