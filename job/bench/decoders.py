"""`python -m job.bench.decoders [--images N] [--batch B] [--size S] [--dir D] [--short-side N] [--procs P,...]`: how fast each
image decoder turns this machine's JPEG files into training samples, to choose data.decode and data.workers by
measurement.

It generates (or reuses) bench.imagefolder's JPEG files in D and times, for N of them, ImageFolder's
training sample (random resized crop to S x S and a flip) three ways:
- `pil`: PIL decode and torchvision's PIL transforms to a normalised float tensor (the classic DataLoader
  worker, and this job's before data.decode existed), one process;
- `cpu`: data.decode=cpu, a worker's work: torchvision.io decode (libjpeg-turbo), crop and resize on
  uint8, one process;
- `gpu`: data.decode=gpu, the training process's work: one batched nvJPEG call per B files and the crops
  on the GPU (the files' bytes read beforehand, as workers would).
Per-process rates are one process alone; the GPU rate is the whole card's. `--procs 8,15` also times `cpu` in
8, then 15 processes at once, as that many DataLoader workers: their rate together, which is what a run's
workers can feed, and which grows less than the per-process rate times P where processes share a core's
hyper-threads, memory bandwidth or a lower all-core clock.

It also times the hand-over from one DataLoader worker, for `cpu` (decoded pixels), `auto` (data.decode=auto's
batches while none of their JPEGs is on the GPU: decoded pixels through its own collate) and `gpu` (the files'
bytes and crops): the training process's own CPU time to receive a batch of B (time spent in the process
whose thread launches the model's kernels), and the worker's CPU time to make it (its samples, the collate and
its side of the hand-over: what a run's workers must make B times a step, read from /proc where there is one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def _rate(fn, n: int, repeats: int = 3) -> tuple[float, float, float]:
    """Images/s of fn() (which handles n images): median, min and max over `repeats` timed calls after one warm-up."""
    fn()
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        rates.append(n / (time.perf_counter() - t))
    return statistics.median(rates), min(rates), max(rates)


def _together(fn, n: int, procs: int) -> tuple[float, float]:
    """Images/s of `procs` forked processes each calling fn() (n images) at once, after a warm-up call each and
    a common start: (all together, the slowest process's own), the first over the span from the first start
    to the last end (perf_counter is the system's monotonic clock, the same in every process). A process that
    fails (a file that does not decode, killed for memory) ends it with one line."""
    import multiprocessing as mp
    import queue
    import threading

    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(procs), ctx.Queue()

    def work():
        import torch

        torch.set_num_threads(1)  # as in a DataLoader worker
        try:
            fn()
            start.wait()
            t = time.perf_counter()
            fn()
            out.put((t, time.perf_counter(), None))
        except threading.BrokenBarrierError:
            out.put((None, None, None))  # another process failed first and says why
        except Exception as e:  # one line for the parent; the others stop waiting at the start
            start.abort()
            out.put((None, None, f"{type(e).__name__}: {e}"))

    children = [ctx.Process(target=work, daemon=True) for _ in range(procs)]
    for c in children:
        c.start()
    results = []
    while len(results) < procs:
        try:
            results.append(out.get(timeout=1.0))
        except queue.Empty:  # a process killed outright says nothing: stop waiting for it
            dead = [c for c in children if c.exitcode not in (None, 0)]
            if dead:
                start.abort()
                raise RuntimeError(f"the cpu decoder in {procs} processes at once: process {dead[0].pid} ended "
                                   f"with exit code {dead[0].exitcode} (killed for memory?)") from None
    for c in children:
        c.join()
    errors = [e for *_, e in results if e]
    if errors or any(t is None for t, *_ in results):
        raise RuntimeError(f"the cpu decoder in {procs} processes at once: {errors[0] if errors else 'a process failed'}")
    total = max(end for _, end, _ in results) - min(t for t, _, _ in results)
    return procs * n / max(total, 1e-9), n / max(max(end - t for t, end, _ in results), 1e-9)


def _handover_ms(ds, ids: list, batch: int) -> tuple[float, float | None] | None:
    """(the training process's CPU ms, the worker's CPU ms) per batch of `batch` read from one DataLoader worker
    through the training stream's hand-over (job.handover's slots where the batch is an (x, y) pair), copied
    out of the slot (into pinned memory on a GPU) and, on a GPU, queued for its copy to the card. The first:
    the process's own threads' user and system time (the pinning thread's too; waiting for the worker costs
    none), over every batch after the first (which includes the worker's start). The second: the worker's
    whole CPU time over all its batches, read once it has made the last (None without /proc)."""
    import resource

    import torch
    from torch.utils.data import DataLoader

    from job.data import PREFETCH_FACTOR, _through_slots, process_cpu_s

    batches = [ids[j:j + batch] for j in range(0, len(ids) - batch + 1, batch)]
    if len(batches) < 2:
        return None
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    def copy(b):  # the training stream's copy of a decoded batch (an encoded one is decoded later)
        if device.type == "cuda" and isinstance(b, (tuple, list)) and all(torch.is_tensor(t) for t in b):
            return tuple(t.to(device, non_blocking=True) for t in b)
        return b

    torch.multiprocessing.set_sharing_strategy("file_system")  # as job.data's loader
    collate, move = _through_slots(ds.collate, copy)
    it = iter(DataLoader(ds, batch_sampler=batches, num_workers=1, collate_fn=collate, pin_memory=device.type == "cuda",
                         prefetch_factor=PREFETCH_FACTOR))
    move(next(it))

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    start = cpu_s()
    for _ in range(len(batches) - 1):
        move(next(it))
    main_ms = (cpu_s() - start) / (len(batches) - 1) * 1e3
    worker = process_cpu_s(it._workers[0].pid)  # alive until the loader is done with
    return main_ms, (worker / len(batches) * 1e3 if worker is not None else None)


def main(argv: list[str] | None = None) -> int:
    import torch
    from torchvision import transforms

    from job.bench.imagefolder import SHORT_SIDES, image_folder, images_dir_name
    from job.datasets import MEAN, STD, EncodedBatch, GpuSplit, ImageFolder, SampleIndex, load_image

    p = argparse.ArgumentParser(prog="python -m job.bench.decoders", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--dir", default="", help="where the files are generated and reused (default: runs/bench-images, "
                                             "or runs/bench-images-s<N> with --short-side N); a folder of "
                                             "files it did not generate is refused, never replaced")
    p.add_argument("--files", type=int, default=5000, help="JPEG files generated in --dir (bench.imagefolder's)")
    p.add_argument("--short-side", type=int, default=0,
                   help="N: the files resized to a short side of N px (bench.imagefolder_short_side's); 0: ImageNet-like")
    p.add_argument("--procs", default="", help="comma-separated process counts to time `cpu` in at once, e.g. 8,15")
    a = p.parse_args(argv)
    try:
        procs = [int(v) for v in a.procs.split(",") if v.strip()]
        if any(v < 1 for v in procs):
            raise ValueError
    except ValueError:
        p.error(f"--procs {a.procs}: give process counts of 1 or more, comma-separated (e.g. --procs 8,15)")
    if a.short_side and not SHORT_SIDES[0] <= a.short_side <= SHORT_SIDES[1]:
        p.error(f"--short-side {a.short_side}: give 0 (ImageNet-like files) or a side from {SHORT_SIDES[0]} to "
                f"{SHORT_SIDES[1]} px")
    folder = image_folder(Path(a.dir or Path("runs") / images_dir_name(a.short_side)),
                          a.files, short_side=a.short_side)
    torch.set_num_threads(1)  # one worker's view: rates are per process
    ds = {d: ImageFolder(folder["path"], image_size=a.size, num_classes=10, augment=True, decode=d)
          for d in ("cpu", "gpu")}
    auto = ImageFolder(folder["path"], image_size=a.size, num_classes=10, augment=True, gpu_split=GpuSplit())
    ids = [SampleIndex(i, i, 0) for i in range(min(a.images, len(ds["cpu"])))]
    n = len(ids)
    classic = transforms.Compose([transforms.RandomResizedCrop(a.size, antialias=True), transforms.RandomHorizontalFlip(),
                                  transforms.ToTensor(), transforms.Normalize(MEAN, STD)])

    def pil():
        for i in ids:
            classic(load_image(ds["cpu"].samples[int(i)][0]))

    def cpu():
        for i in ids:
            ds["cpu"][i]

    rows = [("pil", "PIL + torchvision transforms, float32 out", _rate(pil, n)),
            ("cpu", "torchvision.io (libjpeg-turbo), uint8 crop+resize", _rate(cpu, n))]
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        items = [ds["gpu"][i][0] for i in ids]  # what the workers hand over: bytes and crops
        batches = [EncodedBatch(items[j:j + a.batch]).pin_memory() for j in range(0, n, a.batch)]

        def gpu():
            for b in batches:
                b.decode(device, a.size)
            torch.cuda.synchronize()

        rows.append(("gpu", f"nvJPEG batches of {a.batch} + crops on {torch.cuda.get_device_name(0)}", _rate(gpu, n)))
    together = [(k, *_together(cpu, n, k)) for k in procs]
    handover = {d: _handover_ms(d_ds, ids, a.batch) for d, d_ds in (("cpu", ds["cpu"]), ("auto", auto), ("gpu", ds["gpu"]))}
    side = f", a short side of {a.short_side} px" if a.short_side else ""
    print(f"decoders: {n} of {folder['images']} generated JPEG files ({folder['bytes'] / folder['images'] / 1e3:.0f} kB "
          f"on average{side}) -> {a.size}x{a.size} training samples; img/s, median (min-max) of 3")
    for name, what, (med, lo, hi) in rows:
        per = "per process" if name != "gpu" else "the card"
        print(f"  {name:<4} {med:9,.0f} ({lo:,.0f}-{hi:,.0f}) img/s {per:<11}  {what}")
    for k, rate, slowest in together:
        print(f"  cpu x {k:<3} {rate:9,.0f} img/s together ({rate / k:,.0f} a process; the slowest {slowest:,.0f}), "
              f"{k} process{'es' if k > 1 else ''} at once, as data.workers={k}")
    if None not in handover.values():
        print(f"hand-over, the training process's CPU per batch of {a.batch} from a worker: "
              + ", ".join(f"{d} {main_ms:.1f} ms" for d, (main_ms, _) in handover.items()))
        if all(w is not None for _, w in handover.values()):
            print(f"the worker's CPU per batch of {a.batch} (its samples, collate and hand-over): "
                  + ", ".join(f"{d} {w:.1f} ms ({w / a.batch * 1e3:.0f} us an image)" for d, (_, w) in handover.items()))
    return 0


def _cli() -> int:
    from job.datasets import BadImage
    from job.errors import UsageError

    try:
        return main()
    except (BadImage, RuntimeError) as e:  # a file that does not decode, a process that failed: one line
        print(f"error: {e}", file=sys.stderr)
        return 1
    except UsageError as e:  # --dir a folder the bench did not generate
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(_cli())
