"""python3 .gpu/fold.py spy-X-loop.txt spy-X-train.txt: py-spy raw stacks (frame;frame;... count) of the loop
and of the trainer; keeps the samples inside each program's step loop and prints, per function, the share of
those samples it is on the stack (inclusive) and at the top (self), loop against trainer."""
import collections, sys

import re

def nolines(f):
    return re.sub(r":\d+\)$", ")", f)

def load(path, inside):
    incl, self_, total = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        i = next((i for i, f in enumerate(frames) if inside(f)), None)
        if not n.isdigit() or i is None:
            continue
        n = int(n); total += n
        inner = frames[i:]
        for f in {nolines(f) for f in inner}:
            incl[f] += n
        self_[nolines(inner[-1])] += n
    return incl, self_, total

src = open("job/bench/reference.py").read().splitlines()
first = next(i for i, l in enumerate(src, 1) if l.strip().startswith("for step in range("))
last = next(i for i, l in enumerate(src, 1) if "records.append(" in l)

def in_loop(f):
    m = re.fullmatch(r"main \(job/bench/reference.py:(\d+)\)", f)
    return bool(m) and first < int(m.group(1)) <= last

L = load(sys.argv[1], in_loop)
T = load(sys.argv[2], lambda f: f.startswith("Trainer._loop (job/train.py"))
print(f"samples in the step loop: loop {L[2]}, trainer {T[2]}")
for name, k in (("inclusive", 0), ("self", 1)):
    keys = set(L[k]) | set(T[k])
    rows = sorted(keys, key=lambda f: -(T[k][f] / max(T[2], 1) - L[k][f] / max(L[2], 1)))
    print(f"-- {name}: trainer share - loop share (top 25 each way)")
    for f in rows[:25] + ["..."] + rows[-10:]:
        if f == "...":
            print("   ..."); continue
        print(f"{100 * T[k][f] / max(T[2], 1):6.2f}% {100 * L[k][f] / max(L[2], 1):6.2f}%  {f[:150]}")
