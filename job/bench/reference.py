"""bench.reference: the hand-written PyTorch loop the trainer's one-card rows are measured against.

`python -m job.bench.reference <the run's arguments>` trains the same workload, model, optimizer, precision
(the TF32 and cuDNN settings too), memory format, torch.compile setting and batch as `python -m job train`
with the same arguments would, on one device, with nothing else: no strategy, memory plan, telemetry,
checkpoints or fault handling. Its batches are a pool of the workload's example_batch resident on the
device, as the trainer's synthetic data is, so the two differ only by what the trainer adds. It writes
metrics.jsonl (one line at each train.log_every step, the same "step" and "time" keys) and summary.json,
so the bench times both over the same steps (job.bench.runner.timed_throughput).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

AMP = {"bf16": "bfloat16", "fp16": "float16"}


def main(argv: list[str]) -> int:
    import torch

    from job import config as config_mod

    cfg = config_mod.load(argv)
    t = cfg.train
    resolved = config_mod.workload_of(cfg)
    w, s = resolved.workload, config_mod.workload_settings(cfg)
    cuda = t.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:  # the trainer's backend settings
        torch.backends.cudnn.benchmark = t.cudnn_benchmark
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        from job.train import _cpu_threads

        torch.set_num_threads(_cpu_threads())  # the trainer's CPU thread count
    torch.manual_seed(t.seed)

    model = w.model(s).to(device)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    forward = torch.compile(model) if t.compile else model
    if t.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, fused=cuda)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    amp = getattr(torch, AMP[t.amp]) if t.amp in AMP else None
    scaler = torch.amp.GradScaler(device.type, enabled=t.amp == "fp16")

    pool = int(cfg.data.synthetic_pool)
    x_pool, y_pool = w.example_batch(s, pool, torch.Generator().manual_seed(t.seed + 7919))
    x_pool, y_pool = x_pool.to(device), y_pool.to(device)
    batch = int(t.batch_size)
    offsets = torch.arange(batch, device=device)

    run = Path(t.run_dir) / t.run_id
    run.mkdir(parents=True, exist_ok=True)
    records = []
    for step in range(1, t.steps + 1):
        idx = (offsets + step * batch) % pool
        x, y = x_pool.index_select(0, idx), y_pool.index_select(0, idx)
        if t.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = w.loss(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step % t.log_every == 0 or step == t.steps:
            if cuda:
                torch.cuda.synchronize()
            records.append({"step": step, "loss": float(loss), "time": time.time()})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    warm = max(0, t.timing_warmup)
    start = next((r["time"] for r in records if r["step"] == warm), None)
    span = records[-1]["time"] - start if start is not None else 0.0
    rate = (t.steps - warm) * batch / span if span > 0 else None
    if rate is None:
        print(f"error: reference loop: no timed steps after step {warm} of {t.steps}", file=sys.stderr)
        return 1
    # No per-card rows: the loop measures speed only (the trainer's rows have the memory).
    summary = {"world_size": 1, "samples_per_s": rate, "cards": [], "imbalance": None,
               "peak_window": [warm, t.steps], "params": sum(p.numel() for p in model.parameters())}
    (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"reference loop: {resolved.name}, batch {batch}, {t.steps} steps, "
          f"{rate or 0:,.1f} samples/s after step {warm}", flush=True)
    return 0


def _cli(argv: list[str]) -> int:
    from job.errors import EXIT_USAGE, UsageError

    try:
        return main(argv)
    except UsageError as e:  # a bad argument: one line, as `python -m job train` says it
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
