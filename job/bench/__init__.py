"""`python -m job bench`: the strategies side by side, each in a fresh process through the real trainer.

Three modes (bench.mode):

- **compare** (the default). For every workload (bench.workloads, or the config's one), `bench.repeats`
  times, the order rotated by one each repeat so no strategy always runs first or last:
    1. the 1-card baseline: bench.baseline on the first visible card (CUDA_VISIBLE_DEVICES), global
       batch divided by the card count, so the per-card batch is the same as in the multi-card runs;
    2. every strategy of bench.strategies on all visible cards;
    3. with bench.imagefolder (image workloads): every strategy again on JPEG files generated on disk,
       decoded by DataLoader workers into pinned memory, copied with data.prefetch;
  then, once, with bench.telemetry_overhead, bench.telemetry_strategy with telemetry.port off and on
  (scraped), bench.telemetry_repeats times; the strategy's first run in 2. is the first "off" run.
  The table shows, per row, the median and the range (min-max) of the repeats; a ratio between two
  rows is called a claim only when their ranges do not overlap.
- **maxbatch**: per strategy, the largest global batch that trains: trials of bench.maxbatch_steps real
  steps, each in a fresh `python -m job train`, the batch doubled from bench.maxbatch_start until one
  does not fit, then bisected (search_max_batch). A trial that runs out of memory, or that the memory
  plan refuses ("does not fit", exit 2), is too big; any other failure stops that strategy's search.
  With bench.maxbatch_key=workload.layers the same search runs over the lm's depth at the configured
  width and batch: the largest model each strategy trains (its parameter count in the table).
- **profile**: where a single-process strategy's step time goes: a few steps under torch.profiler in
  a fresh process (`python -m job.bench`, profile_main), the phases timed between device syncs, the top
  operators by CUDA time (CPU time without a GPU); written to profile-<workload>-<strategy>.txt/.json.

Every trainer run gets the user's overrides (what the command line and --config changed against the
workload's preset) through overrides.yaml, plus the bench's own keys: steps, warm-up, no checkpoint (periodic or
final), run directory. An unknown strategy is refused before anything runs (exit 2); a run that
fails (OOM, crash, timeout) is reported with its error line and the others still run. With
bench.tenant_gb, a child process holds that much memory on card 0 for the whole bench (the shared-card
case), and is killed on every way out.

Throughput comes from the run's metrics.jsonl: the trainer synchronises the devices and logs at step
`warmup` and at the last step (train.log_every = warm-up), so the timed window is exactly the steps
after warm-up. Per-card memory (torch peak allocated/reserved, NVML used at the end) comes from
summary.json; the trainer resets the peak counters when its clock starts, so every strategy's peaks
cover the same window, the timed steps (summary.json's peak_window; checked here).

Without a GPU: `cards` are processes. ddp runs bench.cpu_procs processes over gloo, the baseline
one process with the global batch divided by bench.cpu_procs; dp runs one process (DataParallel on
a CPU is the plain module), so it has no scaling figure. Numbers measured this way say nothing
about GPUs; the CPU run exists so CI exercises the whole path (table, JSON, chart).

Writes to the output folder: bench.json (every number and the environment; RESULT_SCHEMA in results.py),
bench.png (compare: per-card memory and throughput with their ranges; maxbatch: the largest batch and
the per-card peaks at it), overrides.yaml, logs/<run>.log and runs/<run>/ (the trainer's run
directories, checkpoints removed). Prints one table per workload last.
Exit code: 0 if every run that was started succeeded (maxbatch: every search ended without an error),
1 if one failed, 2 on bad input, 75 if the benchmark itself was interrupted (results are still written).

Where the code is:
- runner.py       Bench: the whole benchmark (settings, signals, bench.json, the tables)
- child.py        Runs and RunSpec: one run in a fresh process, the seam every mode uses
- compare.py      bench.mode=compare, and the median/range/claim rule over the repeats
- maxbatch.py     bench.mode=maxbatch: the search for the largest batch that trains
- profiling.py    bench.mode=profile: the bench's side and the profiled child (`python -m job.bench`)
- settings.py     bench.* checked before anything runs; the user's overrides every run gets
- results.py      bench.json: RESULT_SCHEMA, a run's record, a workload's result
- environment.py  the machine, versions and commit a result came from
- table.py        the printed tables; chart.py  bench.png
- imagefolder.py  the generated JPEG files; tenant.py  the process holding memory on card 0
- process.py      child processes: a plain environment, the error line, stopping one
"""

from __future__ import annotations

from job.bench.chart import write_chart
from job.bench.child import Runs, RunSpec, input_cores, input_throughput, timed_throughput
from job.bench.compare import (
    compare,
    comparisons,
    paired,
    paired_step_ms,
    rotated,
    spread,
    summarize,
    summary_scaling,
)
from job.bench.imagefolder import image_folder
from job.bench.maxbatch import batch_rule, classify_trial, search_max_batch
from job.bench.profiling import profile_main
from job.bench.results import RESULT_SCHEMA, SCHEMA_ID
from job.bench.runner import Bench
from job.bench.settings import user_overrides
from job.bench.table import table
from job.bench.tenant import Tenant


def run(cfg, workload: str | None = None) -> int:
    """`python -m job bench`: returns 0 (all runs ok), 1 (a run failed), 75 (interrupted). `workload` is the
    workload preset the command line picked (`workload=lm-24x384`), the default when bench.workloads is empty."""
    return Bench(cfg, workload).run()


__all__ = ["RESULT_SCHEMA", "SCHEMA_ID", "Bench", "RunSpec", "Runs", "Tenant", "batch_rule", "classify_trial", "compare", "comparisons", "paired", "paired_step_ms",
           "image_folder", "profile_main", "rotated", "run", "search_max_batch", "spread", "summarize",
           "summary_scaling", "table", "timed_throughput", "input_throughput", "input_cores", "user_overrides", "write_chart"]
