"""python3 forward.py spy-eager-loop.txt spy-eager-train.txt STEPS: py-spy raw stacks of the loop and of the
trainer (300 steps each); the samples inside the model's forward (DecoderLM.forward) of a training step (the
trainer's inside Trainer._loop: not the memory plan's probe), per step, by the function
at the top of the stack: loop, trainer, trainer/loop."""
import collections, re, sys

def load(path, inside):
    c, tot = collections.Counter(), 0
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        if not n.isdigit() or not any(f.startswith("DecoderLM.forward") for f in frames) \
                or not any(f.startswith(inside) for f in frames):
            continue
        c[re.sub(r":\d+\)$", ")", frames[-1])] += int(n); tot += int(n)
    return c, tot

(L, lt), (T, tt), steps = load(sys.argv[1], "main (job/bench/reference.py"), load(sys.argv[2], "Trainer._loop"), int(sys.argv[3])
print(f"forward samples a step (500 Hz): loop {lt / steps:.2f}, trainer {tt / steps:.2f} ({tt / lt:.3f}x)")
for k in sorted(set(L) | set(T), key=lambda k: -(T[k] + L[k]))[:20]:
    print(f"{L[k] / steps:6.2f} {T[k] / steps:6.2f} {T[k] / max(L[k], 1):5.2f}  {k[:110]}")
