"""python3 .gpu/hostcmp.py {train|loop} ARGS...: with a device sync after every optimizer step of steps 40-139,
the host's time to dispatch a step (from the last step's sync to this step's optimizer step returning:
everything the program does between two steps, the trainer's bookkeeping included) and the card's tail after it
(sync wait). Same hook for the trainer and the bench's loop. Prints medians and quartiles."""
import statistics as st, sys, time
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

which, args = sys.argv[1], sys.argv[2:]
A, B = 40, 140
marks, n = [], [0]
def hook(opt, a, k):
    n[0] += 1
    if A <= n[0] < B:
        t = time.perf_counter(); torch.cuda.is_available() and torch.cuda.synchronize(); marks.append((t, time.perf_counter()))
register_optimizer_step_post_hook(hook)
if which == "loop":
    from job.bench.reference import main
    rc = main(args)
else:
    from job.__main__ import main
    rc = main(["train"] + args)
if len(marks) < 3:
    print(f"HOSTCMP {which}: {len(marks)} marks"); sys.exit(rc or 0)
host = [1e3 * (b[0] - a[1]) for a, b in zip(marks, marks[1:])]
tail = [1e3 * (b - a) for a, b in marks[1:]]
q = lambda xs: f"median {st.median(xs):.2f} ms (quartiles {st.quantiles(xs, n=4)[0]:.2f}-{st.quantiles(xs, n=4)[2]:.2f})"
print(f"HOSTCMP {which}: host dispatch {q(host)}; card tail after it {q(tail)}; synced step {q([h + t for h, t in zip(host, tail)])}")
sys.exit(rc or 0)
