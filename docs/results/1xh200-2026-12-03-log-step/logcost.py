import sys, time, functools
import job.train as T
import job.breakdown as B
import job.report as R
times = {}
def wrap(obj, name, key):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            times.setdefault(key, []).append(time.perf_counter() - t0)
    setattr(obj, name, g)
wrap(T.Trainer, "_log_step", "log_step")
wrap(T.Trainer, "_rows", "rows")
wrap(B.Memory, "rows", "memory.rows")
wrap(B, "tensor_bytes", "tensor_bytes")
import job.devices as D
wrap(D, "visible_cards", "visible_cards")
wrap(D, "card_memory", "card_memory")
wrap(B, "nvml_processes", "nvml_processes")
wrap(B.Memory, "_card_map", "memory._card_map")
wrap(B.Memory, "_nvml_card", "memory._nvml_card")
wrap(T.Trainer, "_sync", "sync")
wrap(T.Trainer, "_step", "step")
if hasattr(T.Trainer, "_memory_rows"): wrap(T.Trainer, "_memory_rows", "memory_rows (before the sync)")
from job.__main__ import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
for k, v in times.items():
    v = sorted(v)
    print(f"TIME {k}: n={len(v)} median {v[len(v)//2]*1e3:.2f} ms max {v[-1]*1e3:.2f} ms")
sys.exit(rc)
