"""The bench's read of the workers' rate, on a model of its pipeline: 16 DataLoader workers (prefetch 2, job.data's
CountingCollate counting what they make) taking T seconds a batch (argv[1], a sleep: no core needed), a loop taking
one batch every 48 ms (20.8 a second) after a 5 s pause for its first step (a compile). Workers keep up while
16 / T > 20.8, i.e. T < 0.77 s. Prints made / taken over the bench's timed window (steps 10-160), over its later
half (85-160) and its first half, and the batches ready (made, not taken; 4 samples a batch) at steps 10, 85, 160."""
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from job.data import PREFETCH_FACTOR, CountingCollate

T_BATCH, STEP, W, B = float(sys.argv[1]), 0.048, 16, 4

class Slow(Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, i):
        time.sleep(T_BATCH / B)
        return torch.zeros(1)

if __name__ == "__main__":
    made = torch.zeros(W, dtype=torch.int64).share_memory_()
    it = iter(DataLoader(Slow(), batch_size=B, num_workers=W, prefetch_factor=PREFETCH_FACTOR,
                         collate_fn=CountingCollate(torch.utils.data.default_collate, made)))
    next(it); time.sleep(5.0)  # the first step compiles
    rec = {}; taken = B
    t0 = time.perf_counter()
    for step in range(1, 161):
        x = next(it); taken += B
        time.sleep(STEP)
        rec[step] = (time.perf_counter(), int(made.sum()), taken)
    def ratio(a, b):
        return (rec[b][1] - rec[a][1]) / (rec[b][2] - rec[a][2])
    print(f"T_BATCH {T_BATCH}: made/taken steps 10-160 {ratio(10, 160):.3f}, 85-160 {ratio(85, 160):.3f}, 10-85 {ratio(10, 85):.3f};"
          f" backlog at 10 {rec[10][1]-rec[10][2]}, 85 {rec[85][1]-rec[85][2]}, 160 {rec[160][1]-rec[160][2]} samples")
