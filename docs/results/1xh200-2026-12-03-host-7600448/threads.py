"""python3 .gpu/threads.py {train|loop} ARGS...: hostcmp.py's synced host-dispatch figures, then every thread of
this process with its CPU time (user+system, from /proc/self/task) over the whole run, and the process's."""
import os, runpy, sys
sys.argv = [os.path.join(os.path.dirname(__file__), "hostcmp.py")] + sys.argv[1:]
tick = os.sysconf("SC_CLK_TCK")
def dump():
    rows = []
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            rows.append((int(f[11]) + int(f[12]), comm, tid, f[36]))  # utime+stime, name, tid, last cpu
        except OSError:
            pass
    rows.sort(reverse=True)
    tot = sum(r[0] for r in rows)
    print(f"THREADS {len(rows)} threads, {tot / tick:.2f} s CPU in live threads; " + ", ".join(
        f"{c}:{t / tick:.2f}s(cpu{cpu})" for t, c, tid, cpu in rows[:12]), flush=True)
    ru = __import__("resource").getrusage(0)
    print(f"THREADS process: user {ru.ru_utime:.2f} s sys {ru.ru_stime:.2f} s, vol ctx {ru.ru_nvcsw} invol {ru.ru_nivcsw}", flush=True)
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    dump()
