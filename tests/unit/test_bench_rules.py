"""The bench's rules on their own: bad bench input, the user's overrides, the timed window, the error line,
the median/range/claim rule, the same-window rule, the result schema, the maxbatch search against a fake
trial, the tenant's lifecycle, the generated image folder and the code fingerprint; a GPU-shaped result
document (there is no GPU here) checks the per-card columns and the chart offline.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from job.bench.environment import code_fingerprint

try:  # a test dependency (pyproject [test]); the GPU machine may run the GPU test without it
    import jsonschema
except ImportError:  # pragma: no cover
    jsonschema = None

from _bench_helpers import assert_png, validate
from _train_helpers import wait_gone

from job import bench
from job.bench.process import error_line
from job.config import load
from job.errors import UsageError


@pytest.mark.parametrize("args, message", [
    (["bench.warmup=0"], "bench.warmup=0 must be at least 1"),
    (["bench.steps=0"], "bench.steps=0 must be at least 1"),
    (["strategies=[]"], "bench.strategies is empty"),
    (["bench.workloads=[tiny,gpt5]"], "unknown workload `gpt5` in bench.workloads"),
    (["bench.scrape_interval_s=0"], "bench.scrape_interval_s=0.0 must be positive"),
    (["bench.stepz=3"], "did you mean `bench.steps`?"),
    (["strategies=[dp,nosuch]"], "unknown strategy `nosuch` in bench.strategies; choose from: accum, balanced, balanced-graphs, ddp, dp, fsdp"),
    (["bench.baseline=nosuch"], "unknown strategy `nosuch` in bench.baseline"),
    (["bench.repeats=0"], "bench.repeats=0 must be at least 1"),
    (["bench.mode=fastest"], "`bench.mode=fastest` is not valid; choose one of: compare, maxbatch, profile"),
    (["bench.mode=profile", "strategies=[dp,ddp]"], "bench.mode=profile profiles one process; ddp runs one"),
    (["bench.mode=maxbatch", "bench.maxbatch_steps=1"], "bench.maxbatch_steps=1 must be at least 2"),
    (["bench.maxbatch_precision=1.5"], "bench.maxbatch_precision=1.5 must be in [0, 1)"),
    (["train.device=cpu", "bench.tenant_gb=2"], "bench.tenant_gb=2 holds memory on a CUDA card, and none is visible"),
    (["workload=lm", "bench.imagefolder=true"], "bench.imagefolder=true needs a workload that reads data.kind=imagefolder"),
    (['bench.imagefolder_variants=["data.workers=1"]'], "bench.imagefolder_variants adds rows to bench.imagefolder's: "
     "set bench.imagefolder=true"),
    (["bench.imagefolder=true", 'bench.imagefolder_variants=["data.decode=gpu train.lr=1"]'],
     "bench.imagefolder_variants: `train.lr=1` is not a setting a variant may change; use data.KEY=VALUE with KEY "
     "one of decode, gpu_share, workers, worker_nice, prefetch"),
    (["bench.imagefolder=true", 'bench.imagefolder_variants=["data.decode=fast"]'],
     'bench.imagefolder_variants entry "data.decode=fast": `data.decode=fast` is not valid; choose one of: auto, cpu, gpu'),
    (["bench.imagefolder=true", 'bench.imagefolder_variants=["data.gpu_share=2"]'],
     'bench.imagefolder_variants entry "data.gpu_share=2"'),
    (["bench.imagefolder=true", 'bench.imagefolder_variants=["data.workers=1", "data.workers=1"]'],
     "bench.imagefolder_variants lists the same settings twice"),
    (["bench.imagefolder=true", 'bench.imagefolder_variants=[" "]'], "bench.imagefolder_variants has an empty entry"),
    (["bench.imagefolder=true", 'bench.imagefolder_variants=["data.prefetch=true"]'],
     'bench.imagefolder_variants entry "data.prefetch=true" changes none of the plain imagefolder row\'s data '
     "settings (every row that reads files has data.prefetch=true): its row would time that one again"),
    (["bench.imagefolder=true", "data.workers=3", 'bench.imagefolder_variants=["data.decode=cpu", "data.workers=3"]'],
     'bench.imagefolder_variants entry "data.workers=3" changes none of the plain imagefolder row\'s data settings'),
    (["bench.imagefolder=true", "bench.imagefolder_short_side=32"],
     "bench.imagefolder_short_side=32 must be 0 (ImageNet-like files) or a side from 64 to 2048 px"),
    (["strategies=[balanced-graphs]", "train.device=cpu"], "no strategy in bench.strategies can run with these "
     "settings (balanced-graphs: strategy.cuda_graphs=true needs CUDA cards, and train.device=cpu"),
    (["bench.mode=maxbatch", "bench.maxbatch_key=train.lr"],
     "bench.maxbatch_key=train.lr cannot be searched; choose one of: train.batch_size, workload.layers"),
    (["bench.mode=maxbatch", "bench.maxbatch_key=workload.layers", "workload=tiny"],
     "bench.maxbatch_key=workload.layers searches a workload's depth (its workload.layers setting), and tiny "
     "has none"),
])
def test_bad_bench_input_is_one_line_exit_2(capsys, tmp_path, args, message):
    from job.__main__ import main

    assert main(["bench", f"bench.out={tmp_path / 'x'}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "x").exists()  # refused before anything is written
    assert not (tmp_path / "x").exists()  # nothing started


def test_a_variant_is_checked_as_its_row_runs_with_the_settings_the_bench_gives_every_file_row(tmp_path):
    """data.prefetch_depth needs data.prefetch=true, which every row that reads files has: a variant setting only
    the depth is a row of its own, not a refusal (as the trainer's defaults alone would say)."""
    from job.bench.runner import Bench

    (tmp_path / "overrides.yaml").write_text("{}\n")
    cfg = load(["bench.imagefolder=true", 'bench.imagefolder_variants=["data.prefetch_depth=2", "data.prefetch=false"]',
                f"bench.out={tmp_path / 'x'}"])
    Bench(cfg)._check_variants(tmp_path / "overrides.yaml")  # no UsageError
    with pytest.raises(UsageError, match="data.prefetch_depth=2 is how far"):
        Bench(load(["bench.imagefolder=true", 'bench.imagefolder_variants=["data.prefetch=false data.prefetch_depth=2"]',
                    f"bench.out={tmp_path / 'x'}"]))._check_variants(tmp_path / "overrides.yaml")


def test_the_reference_loop_refuses_a_bad_argument_in_one_line(capsys, tmp_path):
    """python -m job.bench.reference (the bench's child, also run by hand to check a figure) says what is wrong
    and exits 2, as `job train` does, not a traceback."""
    from job.bench.reference import _cli

    assert _cli(["workload=tiny", "train.device=cpu", "train.amp=none", f"train.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: `train.amp=none` is not valid; choose one of: off, bf16, fp16"
    assert not any(tmp_path.iterdir())


def test_overrides_are_what_the_user_changed_against_the_workload_preset():
    cfg = load(["workload=lm", "strategy=dp", "train.amp=bf16", "workload.layers=2", "train.steps=7",
                "train.run_id=x", "bench.steps=3", "strategies=[dp]", "train.batch_size=16"])
    # train.batch_size=16 is lm's preset value: not an override. Bench keys and picks are not passed on.
    assert bench.user_overrides(cfg) == {"train.amp": "bf16", "workload.layers": 2}
    assert bench.user_overrides(load(["workload=resnet50"])) == {}
    # Against the preset the command line picked, not the lm preset every lm shape shares a name with.
    assert bench.user_overrides(load(["workload=lm-24x384", "workload.seq_len=64"]), "lm-24x384") == {
        "workload.seq_len": 64}


def test_timed_throughput_uses_the_logged_window():
    recs = [{"step": 2, "time": 100.0}, {"step": 4, "time": 101.0}, {"step": 10, "time": 104.0}]
    assert bench.timed_throughput(recs, warmup=2, total=10, batch=32) == pytest.approx(8 * 32 / 4.0)
    assert bench.timed_throughput(recs, warmup=3, total=10, batch=32) is None  # no record at step 3
    assert bench.timed_throughput(recs, warmup=2, total=12, batch=32) is None


def test_input_throughput_is_what_the_workers_made_in_the_window():
    """The loop took 8 batches of 32 in the window while the workers made 6 (it drew 2 from the read-ahead):
    the input pipeline made 3/4 of the timed rate. Without the workers' counts there is no figure."""
    recs = [{"step": 2, "time": 100.0, "data_made": 640, "data_taken": 64},
            {"step": 10, "time": 104.0, "data_made": 832, "data_taken": 320}]
    trained = bench.timed_throughput(recs, warmup=2, total=10, batch=32)
    assert bench.input_throughput(recs, warmup=2, total=10, batch=32) == pytest.approx(trained * 192 / 256)
    filled = [dict(recs[0]), {**recs[1], "data_made": 1000}]  # the workers made more than was taken: a refill
    assert bench.input_throughput(filled, warmup=2, total=10, batch=32) > trained
    synthetic = [{**r, "data_made": None, "data_taken": None} for r in recs]
    assert bench.input_throughput(synthetic, warmup=2, total=10, batch=32) is None
    assert bench.input_throughput([{"step": 2, "time": 1.0}, recs[1]], warmup=2, total=10, batch=32) is None


def _records(ready: list[int], *, batch: int = 32, every: int = 10, step_s: float = 0.05) -> list[dict]:
    """Log records every `every` steps of a loop taking one batch a step at `step_s` a step, with `ready`
    batches made and not yet taken at each record (the read-ahead)."""
    return [{"step": i * every, "time": 100.0 + i * every * step_s, "data_taken": i * every * batch,
             "data_made": (i * every + n) * batch} for i, n in enumerate(ready)]


def test_input_throughput_reads_the_later_half_where_the_read_ahead_settles():
    """Workers that keep up still draw the read-ahead down after the first step, until the batches asked for
    since come back (here 22 ready at step 10, 18 from step 30 on, as in a loop of 16 workers at 0.7 s a
    batch, prefetch 2, against 48 ms a step): read over the whole window that is 4 batches short, 2.7 %; over
    its later half nothing is, so the row shows the trained rate. Workers that do not keep up draw it down
    in the later half too (1 batch every 10 steps) and still read short."""
    keep_up = _records([30, 22, 20, 18] + [18] * 13)  # steps 0-160
    trained = bench.timed_throughput(keep_up, warmup=10, total=160, batch=32)
    assert bench.input_throughput(keep_up, warmup=10, total=160, batch=32) == pytest.approx(trained)
    behind = _records([30, 22, 20, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5])
    made = bench.input_throughput(behind, warmup=10, total=160, batch=32)
    assert made == pytest.approx(trained * 63 / 70)  # from step 90, the first record past 85: 70 taken, 63 made


def test_input_throughput_is_never_zero_where_the_workers_had_made_every_batch():
    """A file holding just the run's samples: the workers made the last batch before the later half began (a
    CI run of the token rows divided by the 0 it read there). That half is read whole instead; a window in
    which they made nothing at all has no figure, and the row then shows what it trained."""
    recs = [{"step": 1, "time": 100.0, "data_made": 24, "data_taken": 8},
            {"step": 2, "time": 100.1, "data_made": 32, "data_taken": 16},
            {"step": 3, "time": 100.2, "data_made": 32, "data_taken": 24}]
    trained = bench.timed_throughput(recs, warmup=1, total=3, batch=8)
    assert bench.input_throughput(recs, warmup=1, total=3, batch=8) == pytest.approx(trained * 8 / 16)
    done = [{**r, "data_made": 32} for r in recs]
    assert bench.input_throughput(done, warmup=1, total=3, batch=8) is None


def test_input_cores_are_the_workers_cpu_seconds_over_the_window():
    """The workers used 30 CPU seconds in a 4-second window: 7.5 cores busy. Without their CPU times (synthetic
    data, no /proc) there is no figure."""
    recs = [{"step": 2, "time": 100.0, "data_cpu_s": 12.0}, {"step": 6, "time": 102.0, "data_cpu_s": 20.0},
            {"step": 10, "time": 104.0, "data_cpu_s": 42.0}]
    assert bench.input_cores(recs, warmup=2, total=10) == pytest.approx(30 / 4)
    assert bench.input_cores(recs, warmup=6, total=10) == pytest.approx(22 / 2)
    assert bench.input_cores([{**r, "data_cpu_s": None} for r in recs], warmup=2, total=10) is None
    assert bench.input_cores([{"step": 2, "time": 100.0}, recs[2]], warmup=2, total=10) is None
    assert bench.input_cores(recs, warmup=3, total=10) is None  # no record at step 3


def test_the_training_threads_shares_are_its_scheduler_seconds_over_the_window():
    """train_thread_s (seconds on a core, seconds waiting for one) at the window's edges: over 4 s it ran 3 and
    waited 0.4 s. Without the scheduler statistics there is no figure; the table lists a row that waited."""
    from job.bench.child import host_thread
    from job.bench.table import _host_lines

    recs = [{"step": 2, "time": 100.0, "train_thread_s": [10.0, 1.0]}, {"step": 10, "time": 104.0,
                                                                           "train_thread_s": [13.0, 1.4]}]
    assert host_thread(recs, warmup=2, total=10) == pytest.approx((0.75, 0.1))
    assert host_thread([{**r, "train_thread_s": None} for r in recs], warmup=2, total=10) == (None, None)
    assert host_thread([{"step": 2, "time": 100.0}, recs[1]], warmup=2, total=10) == (None, None)

    def run(name, waited, repeat):
        return {**_run(name, "strategy", "ddp", [], 1, 3000.0, repeat=repeat), "host_thread_on_core": 0.9,
                "host_thread_waited": waited}

    w = {"runs": [run("ddp", 0.001, 1), run("ddp", 0.004, 2), run("ddp+imagefolder", 0.08, 1),
                  run("ddp+imagefolder", 0.06, 2), run("ddp+imagefolder", 0.12, 3)]}
    head, line = _host_lines(w)
    assert head.startswith("the training thread waited for a free core") and line == (
        "  ddp+imagefolder: waited 8.0% (6.0%-12.0%), ran 90.0%")
    assert _host_lines({"runs": [run("ddp", 0.001, 1)]}) == []



def test_the_cards_idle_share_is_its_mean_gap_over_every_step_of_the_window():
    """card_idle_s and card_gaps (CardGaps' running figures) at the window's edges: 9 of 10 steps measured (a
    log step's sync voids its gap), 0.18 s idle among them, over 2 s: 20 ms a step for 10 steps, 10 %. The
    table lists every row's share once one row's card idled 2 % or more."""
    from job.bench.child import card_idle
    from job.bench.table import _card_lines

    recs = [{"step": 10, "time": 100.0, "card_idle_s": 0.5, "card_gaps": 9},
            {"step": 20, "time": 102.0, "card_idle_s": 0.68, "card_gaps": 18}]
    assert card_idle(recs, warmup=10, total=20) == pytest.approx(0.1)
    assert card_idle([{k: v for k, v in r.items() if not k.startswith("card")} for r in recs], warmup=10,
                     total=20) is None  # off a GPU
    assert card_idle(recs, warmup=12, total=20) is None  # no record at step 12

    def run(name, idle, repeat):
        return {**_run(name, "strategy", "ddp", [], 1, 3000.0, repeat=repeat), "card_idle": idle}

    w = {"runs": [run("ddp", 0.001, 1), run("ddp", 0.003, 2), run("ddp+imagefolder", 0.08, 1),
                  run("ddp+imagefolder", 0.05, 2), run("ddp+imagefolder", 0.12, 3), run("loop", None, 1)]}
    assert _card_lines(w) == ["the card had nothing to run between steps (CUDA events on the training stream), "
                              "medians over the timed steps:", "  ddp: 0.2% (0.1%-0.3%)",
                              "  ddp+imagefolder: 8.0% (5.0%-12.0%)"]
    assert _card_lines({"runs": w["runs"][:2]}) == []


def test_the_power_capped_share_is_the_most_capped_cards_count_over_the_window():
    """Each card's running count of seconds held below its clocks by its power limit (cards[].power_capped_s) at
    the window's edges, over 4 s: card 1 gained 0.6 s (15 %), card 0 0.2 s; the run's share is the most capped
    card's. A card without the count (or no card) gives None. The table lists every row's share once one run's
    card was capped 1 % or more, so a slow repeat shows beside its others."""
    from job.bench.child import card_power_capped
    from job.bench.table import _power_lines

    def rec(step, t, *capped):
        return {"step": step, "time": t,
                "cards": [{"rank": i, "device": f"cuda:{i}", "power_capped_s": c} for i, c in enumerate(capped)]}

    recs = [rec(10, 100.0, 3.0, 7.0), rec(20, 104.0, 3.2, 7.6)]
    assert card_power_capped(recs, warmup=10, total=20) == pytest.approx(0.15)
    assert card_power_capped([rec(10, 100.0, 3.0, None), rec(20, 104.0, 3.2, None)], warmup=10, total=20) is None
    assert card_power_capped([rec(10, 100.0), rec(20, 104.0)], warmup=10, total=20) is None  # the CPU: no cards
    assert card_power_capped(recs, warmup=12, total=20) is None  # no record at step 12

    def run(name, capped, repeat):
        return {**_run(name, "strategy", "ddp", [], 1, 3000.0, repeat=repeat), "card_power_capped": capped}

    w = {"runs": [run("ddp", 0.0, 1), run("ddp", 0.002, 2), run("ddp+imagefolder", 0.0, 1),
                  run("ddp+imagefolder", 0.09, 2), run("ddp+imagefolder", 0.001, 3), run("loop", None, 1)]}
    assert _power_lines(w) == ["the card ran below its clocks for its power limit (NVML's violation time; the most "
                               "capped card), medians over the timed steps:", "  ddp: 0.1% (0.0%-0.2%)",
                               "  ddp+imagefolder: 0.1% (0.0%-9.0%)"]
    assert _power_lines({"runs": w["runs"][:2]}) == []


@pytest.mark.parametrize("log, line", [
    ("step 1\nerror: ddp: micro-batch 15 is not a multiple of 2 ranks\n", "ddp: micro-batch 15 is not a multiple of 2 ranks"),
    ("Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried\n",
     "torch.OutOfMemoryError: CUDA out of memory. Tried"),
    ("Traceback (most recent call last):\nRuntimeError: NCCL error\n[rank1] exit 1\n", "RuntimeError: NCCL error"),
    ("", "no output"),
])
def test_error_line(log, line):
    assert error_line(log) == line


def _card(rank, i, peak, reserved, used, tensors=(0.5, 0.5, 1.0)):
    """A card as the bench reads it from summary.json; its kinds (job/breakdown.py) from the same figures: the
    parameters, gradients and optimizer state given (GiB), the rest of the peak activations, the cache up to the
    reserved, the context up to NVML's used."""
    gb = 1024**3
    params, grads, state = (int(t * gb) for t in tensors)
    kinds = {"parameters": params, "gradients": grads, "optimizer_state": state,
             "activations": int(peak * gb) - params - grads - state, "allocator_cache": int((reserved - peak) * gb),
             "cuda_context": int((used - reserved) * gb), "other_processes": 0, "unattributed": 0,
             "free": int((150 - used) * gb)}
    return {"rank": rank, "device": f"cuda:{i}", "name": "NVIDIA H200", "uuid": f"GPU-{i:08d}-aaaa",
            "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0", "peak_allocated_bytes": int(peak * gb),
            "peak_reserved_bytes": int(reserved * gb), "nvml_used_bytes": int(used * gb),
            "nvml_total_bytes": 150 * gb, "kinds": kinds}


def _run(name, kind, strategy, cards, world, sps, *, repeat=1, status="ok", reason=None, window=(10, 60)):
    """A run row shaped exactly like a real one."""
    r = {"name": name, "kind": kind, "strategy": strategy, "repeat": repeat, "data": "synthetic", "status": status,
         "reason": reason, "exit_code": 0 if status == "ok" else 1, "command": ["python", "-m", "job", "train"],
         "env": {}, "run_dir": "/x", "log": "/x.log", "wall_s": 30.0, "batch_size": 16, "world_size": world,
         "units": len(cards), "timed_steps": 50, "samples_per_s": sps, "units_per_s": sps * 1024 if sps else None,
         "step_s": 16 / sps if sps else None, "trainer_samples_per_s": sps, "trained_samples_per_s": sps,
         "input_samples_per_s": None, "input_worker_cores": None, "input_gpu_share": None,
         "input_auto_settled_step": None, "host_thread_on_core": None, "host_thread_waited": None, "card_idle": None,
         "card_power_capped": None,
         "imbalance": None, "scaling_vs_1": None,
         "scaling_note": None, "peak_window": list(window) if status == "ok" else None, "window_note": None,
         "cards": cards, "scrapes_ok": None, "scrapes_failed": None, "params": None}
    if len(cards) > 1:
        peaks = [c["peak_allocated_bytes"] for c in cards]
        r["imbalance"] = max(peaks) / min(peaks)
    return r


def _env() -> dict:
    return {"date": "2026-11-30T00:00:00+00:00", "hostname": "h", "command": "python -m job bench", "python": "3.11",
            "platform": "Linux", "cpu": "x", "cpu_count": 32, "cpus": "0-31", "cpu_cores": 16, "torch": "2.14.1", "torch_cuda": "12.8", "cudnn": 91000,
            "nccl": "2.27.3", "torchvision": "0.29.1", "driver": "570.1", "cuda_driver": "12.8",
            "gpu_model": "NVIDIA H200", "gpus": [{"name": "NVIDIA H200", "uuid": "GPU-1", "pci_bus_id": "00000000:18:00.0",
                                                   "memory_total_bytes": 150 * 1024**3}],
            "cuda_visible_devices": None, "cuda_device_max_connections": "32", "commit": "0" * 40, "commit_dirty": False, "code": "0123456789ab"}


def _settings(**kw) -> dict:
    return {"steps": 50, "warmup": 10, "repeats": 2, "strategies": ["dp", "ddp", "balanced"], "workloads": ["lm"],
            "baseline": "ddp", "cpu_procs": 2, "overrides": {}, "out": "/x", "imagefolder": False, "imagefolder_variants": [], "imagefolder_short_side": 0, "auto_settle": True, "tokens": False,
            "reference": False,
            "maxbatch": {"key": "train.batch_size", "start": 16, "steps": 3, "trials": 12, "minutes": 30.0,
                         "precision": 0.05}, **kw}


def _gpu_doc() -> dict:
    """A 2-GPU result document of 2 repeats, shaped exactly like a real run's (no GPU here to make one)."""
    runs = [_run("1gpu", "baseline", "ddp", [_card(0, 0, 8.6, 9.0, 10.1)], 1, 330.0),
            _run("dp", "strategy", "dp", [_card(0, 0, 14.1, 15.0, 16.2), _card(0, 1, 3.0, 3.5, 4.1, (0, 0, 0))], 1, 96.0),
            _run("ddp", "strategy", "ddp", [_card(0, 0, 8.3, 9.0, 10.0), _card(1, 1, 8.3, 9.0, 10.0)], 2, 545.0),
            _run("balanced", "strategy", "balanced", [], 1, None, status="failed",
                 reason="torch.OutOfMemoryError: CUDA out of memory"),
            _run("dp", "strategy", "dp", [_card(0, 0, 14.2, 15.0, 16.2), _card(0, 1, 3.1, 3.5, 4.1, (0, 0, 0))], 1, 98.0, repeat=2),
            _run("ddp", "strategy", "ddp", [_card(0, 0, 8.3, 9.0, 10.0), _card(1, 1, 8.3, 9.0, 10.0)], 2, 555.0,
                 repeat=2),
            _run("balanced", "strategy", "balanced", [], 1, None, repeat=2, status="failed",
                 reason="torch.OutOfMemoryError: CUDA out of memory"),
            _run("1gpu", "baseline", "ddp", [_card(0, 0, 8.6, 9.0, 10.1)], 1, 340.0, repeat=2)]
    summary = bench.summarize(runs, ["1gpu", "dp", "ddp", "balanced"])
    bench.summary_scaling(summary, 2)
    w = {"workload": "lm", "unit": "tok", "units_per_sample": 1024, "global_batch": 16, "cards": 2, "runs": runs,
         "summary": summary, "comparisons": bench.comparisons(summary, runs), "telemetry_overhead": None,
         "imagefolder": None, "tokens": None, "maxbatch": None, "profiles": None}
    return {"schema": bench.SCHEMA_ID, "mode": "compare", "device": "cuda", "cards": 2, "settings": _settings(),
            "tenant": {"gb": 80.0, "device": "cuda:0", "pid": 1234}, "environment": _env(), "workloads": [w],
            "chart": None, "failed": 2}


@pytest.mark.parametrize("side, said", [(0, "(108 kB each on average, 10 classes)"),
                                        (256, "(31 kB each on average, resized to a short side of 256 px, 10 classes)")])
def test_the_table_says_what_the_generated_image_files_are(side, said):
    doc = _gpu_doc()
    w = doc["workloads"][0]
    w["imagefolder"] = {"path": "/r/bench-images", "images": 5000, "classes": 10, "short_side": side,
                        "bytes": 5000 * (31_000 if side else 108_000), "generated_s": None}
    doc["settings"]["imagefolder_short_side"] = side
    validate(doc)
    assert f"\nimagefolder: 5000 generated JPEG files {said} in /r/bench-images\n" in bench.table(doc, w) + "\n"


@pytest.mark.parametrize("device, start, said", [
    ("cuda", 10, "the imagefolder rows' timed steps start 0.0 passes over the files in (a pass is 312.5 steps)"),
    ("cuda", 900, "the imagefolder rows' timed steps start 2.9 passes over the files in (a pass is 312.5 steps)"),
    ("cuda", 938, None),  # 3 passes of 312.5 steps before the timed ones
    ("cpu", 10, None)])
def test_the_table_says_when_the_files_rows_are_timed_in_their_first_passes(device, start, said):
    doc = _gpu_doc()
    doc["device"] = device
    w = doc["workloads"][0]
    w["imagefolder"] = {"path": "/r/bench-images", "images": 5000, "classes": 10, "short_side": 0,
                        "bytes": 5000 * 108_000, "generated_s": None}
    rows = [r for r in w["runs"] if r["status"] == "ok"]
    for r in rows:
        r["peak_window"] = [start, start + 50]
    rows[0]["data"] = "imagefolder"
    text = bench.table(doc, w)
    lines = [x for x in text.splitlines() if x.startswith("the imagefolder rows' timed steps")]
    if said is None:
        assert lines == [], lines
        return
    (line,) = lines
    assert line.startswith(said) and "docs/benchmarks.md" in line, line
    # The warm-up it names starts the timed steps at 938 = ceil(3 x 312.5), whatever bench.warmup was (10 here).
    assert line.endswith(f"bench.warmup={10 + 938 - start} or more starts them after 3 passes"), line


def test_gpu_shaped_results_table_and_chart(tmp_path):
    doc = _gpu_doc()
    validate(doc)
    text = bench.table(doc, doc["workloads"][0])
    lines = text.splitlines()
    assert lines[0] == ("== bench lm: global batch 16, 2 GPU(s), 10 warm-up + 50 timed steps, 2 repeat(s) "
                        "(order rotated each repeat)")
    assert lines[1].startswith("per-card peaks over the timed steps 11-60")
    assert lines[2] == ("torch 2.14.1, CUDA 12.8, cuDNN 91000, NCCL 2.27.3, driver 570.1; 32 CPUs on 16 cores; "
                        "commit 000000000000, code 0123456789ab")
    assert lines[3] == "tenant: another process (pid 1234) held 80 GB on cuda:0 during every run"
    dp = next(x for x in lines if x.startswith("dp "))
    # per card: median (min-max) of the 2 repeats in MB; equal values once; busiest/least; tok/s; scaling
    for cell in ("14,490 (14,438-14,541) / 3,123 (3,072-3,174)", "15,360 / 3,584", "16,589 / 4,198",
                 "4.64x (4.58-4.70)", "99,328 (98,304-100,352)", "14.5%", "1/2"):
        assert cell in dp, (cell, dp)
    ddp = next(x for x in lines if x.startswith("ddp "))
    assert "2/2" in ddp and "1.00x" in ddp and "82.1%" in ddp  # median 550 / (2 x 335) samples/s
    assert "baseline" in next(x for x in lines if x.startswith("1gpu "))
    assert "failed: torch.OutOfMemoryError: CUDA out of memory" in next(x for x in lines if x.startswith("balanced"))
    # dp's and ddp's ranges do not overlap: claims; balanced never ran.
    # and a step of dp less one of ddp in each repeat: 16 samples at 96 and 545/s, then 98 and 555/s
    assert ("  dp / ddp: tok/s 0.18x: ranges do not overlap; within each repeat 0.18x (0.18-0.18, 2 pairs), "
            "+135.87 ms a step (+134.44 to +137.31)") in lines
    assert "  dp / ddp: busiest card's peak allocated 1.70x: ranges do not overlap" in lines
    assert not any("balanced /" in x for x in lines)
    # memory by kind per card, GB (10^9 bytes), medians of the repeats: dp's optimizer state only on card 0
    start = lines.index("memory by kind at the peak, GB (10^9 bytes), median of the repeats (docs/memory-breakdown.md):")
    assert lines[start + 1].split()[:5] == ["run", "card", "params", "grads", "optimizer"]
    kinds = {tuple(x.split()[:2]): x.split()[2:] for x in lines[start + 3:start + 8]}
    gib = 1024**3 / 1e9
    assert kinds["dp", "cuda:0"][:4] == [f"{0.5 * gib:.2f}", f"{0.5 * gib:.2f}", f"{gib:.2f}", f"{12.15 * gib:.2f}"]
    assert kinds["dp", "cuda:1"][:4] == ["0.00", "0.00", "0.00", f"{3.05 * gib:.2f}"]
    assert set(kinds) == {("1gpu", "cuda:0"), ("dp", "cuda:0"), ("dp", "cuda:1"), ("ddp", "cuda:0"), ("ddp", "cuda:1")}
    assert by_name_cards(doc, "dp")[0]["kinds"]["optimizer_state"]["median"] == 1024**3
    bench.write_chart(doc, tmp_path / "c.png")
    assert_png(tmp_path / "c.png")


def by_name_cards(doc: dict, name: str) -> list[dict]:
    return next(r for r in doc["workloads"][0]["summary"] if r["name"] == name)["cards"]


def test_same_window_rule_flags_a_run_whose_peaks_cover_other_steps():
    doc = _gpu_doc()
    w = doc["workloads"][0]
    w["runs"][2]["peak_window"] = [12, 60]  # e.g. a strategy that reset its counters itself, after timing began
    w["summary"] = bench.summarize(w["runs"], ["1gpu", "dp", "ddp", "balanced"])
    validate(doc)
    by = {r["name"]: r for r in w["summary"]}
    assert not by["ddp"]["same_window"] and by["dp"]["same_window"]
    ddp = next(x for x in bench.table(doc, w).splitlines() if x.startswith("ddp "))
    assert ddp.endswith("ok (peaks over steps [12, 60]: not the timed steps)")


def test_spread_and_the_claim_rule():
    assert bench.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert bench.spread([None]) is None
    fast, slow = bench.spread([10, 11, 12]), bench.spread([5, 6, 7])
    c = bench.compare("a", "b", "units_per_s", fast, slow)
    assert (c["ratio"], c["claim"], c["verdict"]) == (11 / 6, True, "ranges do not overlap")
    touching = bench.compare("a", "b", "units_per_s", bench.spread([7, 9, 12]), slow)  # 7 is in both ranges
    assert (touching["claim"], touching["verdict"]) == (False, "overlapping")
    one = bench.compare("a", "b", "units_per_s", bench.spread([100]), slow)
    assert (one["claim"], one["verdict"]) == (False, "one run each: no claim")
    assert bench.rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert bench.rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert bench.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_paired_ratios_follow_each_repeat_through_a_drifting_machine():
    """The machine speeds up by half between repeats: the medians' ranges overlap, the pairs do not move."""
    runs = [_run(name, "strategy", name, [], 1, rate * speed, repeat=rep)
            for rep, speed in ((1, 1.0), (2, 1.5), (3, 1.2)) for name, rate in (("a", 90.0), ("b", 100.0))]
    runs.append(_run("a", "strategy", "a", [], 1, None, repeat=4, status="failed", reason="x"))
    runs.append(_run("b", "strategy", "b", [], 1, 100.0, repeat=4))  # its partner failed: no pair
    assert bench.paired(runs, "a", "b") == pytest.approx([0.9, 0.9, 0.9])
    rows = bench.summarize(runs, ["a", "b"])
    (c,) = bench.comparisons(rows, runs)
    assert c["verdict"] == "overlapping"
    assert c["paired"] == {"median": pytest.approx(0.9), "min": pytest.approx(0.9), "max": pytest.approx(0.9), "n": 3}
    # what a costs a step over b, per repeat: 16 samples at 90 x speed against 100 x speed a second
    ms = [16e3 / speed * (1 / 90 - 1 / 100) for speed in (1.0, 1.5, 1.2)]
    assert bench.paired_step_ms(runs, "a", "b") == pytest.approx(ms)
    assert c["paired_step_ms"] == {"median": pytest.approx(ms[2]), "min": pytest.approx(ms[1]),
                                   "max": pytest.approx(ms[0]), "n": 3}
    single = bench.compare("a", "b", "units_per_s", bench.spread([1.0]), bench.spread([2.0]))
    assert single["paired"] is None and single["paired_step_ms"] is None


def test_schema_rejects_a_missing_or_mistyped_key():
    doc = _gpu_doc()
    del doc["workloads"][0]["runs"][0]["cards"][0]["peak_reserved_bytes"]
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)
    doc = _gpu_doc()
    doc["workloads"][0]["runs"][1]["samples_per_s"] = "96"
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)
    doc = _gpu_doc()
    del doc["workloads"][0]["summary"][1]["units_per_s"]["max"]
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


# -- maxbatch -----------------------------------------------------------------------------------


def fake_trial(limit: int, calls: list, *, error_at: int | None = None, hint: bool = False):
    def trial(batch: int):
        calls.append(batch)
        if error_at is not None and batch >= error_at:
            return "error", "RuntimeError: NCCL error"
        if batch <= limit:
            return "fits", None
        reason = f"global batch {batch} does not fit: the largest that fits is {limit} (...)" if hint else "oom"
        return "too_big", reason
    return trial


@pytest.mark.parametrize("limit, start, g, minimum", [
    (100, 16, 1, 2), (100, 16, 4, 4), (7, 16, 2, 2), (1000, 1, 8, 8), (37, 37, 1, 1), (2, 16, 2, 2), (5, 3, 3, 6)])
def test_search_finds_the_largest_batch_that_fits(limit, start, g, minimum):
    calls: list[int] = []
    res = bench.search_max_batch(fake_trial(limit, calls), start=start, granularity=g, minimum=minimum,
                                 max_trials=50, deadline_s=1e9)
    valid = [b for b in range(minimum, 4 * max(limit, start) + 2 * g) if b % g == 0]
    want = max((b for b in valid if b <= limit), default=None)
    assert res["largest"] == want, (res, calls)
    assert res["smallest_too_big"] == min(b for b in valid if b > limit)
    assert res["exact"] and res["stopped"] is None and not res["error"]
    assert all(b % g == 0 and b >= minimum for b in calls)  # every trial is a batch the strategy accepts
    assert len(calls) == len(set(calls)) and len(calls) <= 2 * math.log2(4 * max(limit, start)) + 2
    assert [t["batch"] for t in res["trials"]] == calls


def test_search_bounds_errors_and_hints():
    calls: list[int] = []
    # Stops at max_trials: the answer so far is a lower bound, and says why.
    res = bench.search_max_batch(fake_trial(10_000, calls), start=1, granularity=1, minimum=1, max_trials=4,
                                 deadline_s=1e9)
    assert calls == [1, 2, 4, 8] and res["largest"] == 8 and res["smallest_too_big"] is None
    assert not res["exact"] and "4 trials (bench.maxbatch_trials)" in res["stopped"]
    # Any other failure stops the search with its error line.
    calls = []
    res = bench.search_max_batch(fake_trial(100, calls, error_at=64), start=16, granularity=1, minimum=1,
                                 max_trials=50, deadline_s=1e9)
    assert calls == [16, 32, 64] and res["largest"] == 32 and res["error"]
    assert res["stopped"] == "batch 64: RuntimeError: NCCL error"
    # The time bound (a fake clock: 10 s per trial).
    ticks = iter(range(0, 10_000, 10))
    res = bench.search_max_batch(fake_trial(1000, []), start=1, granularity=1, minimum=1, max_trials=50,
                                 deadline_s=25, clock=lambda: next(ticks))
    assert len(res["trials"]) == 2 and "min (bench.maxbatch_minutes)" in res["stopped"]
    # Precision: bisection stops once the gap is within 25 % of what fits.
    calls = []
    res = bench.search_max_batch(fake_trial(100, calls), start=16, granularity=1, minimum=1, max_trials=50,
                                 deadline_s=1e9, precision=0.25)
    assert res["largest"] <= 100 < res["smallest_too_big"] <= 1.25 * res["largest"] and len(calls) < 8
    # The memory plan's refusal names the largest that fits: that is the next trial.
    calls = []
    res = bench.search_max_batch(fake_trial(100, calls, hint=True), start=16, granularity=4, minimum=4,
                                 max_trials=50, deadline_s=1e9)
    assert calls[:4] == [16, 32, 64, 128] and calls[4] == 100 and res["largest"] == 100 and res["exact"]
    # Nothing fits.
    res = bench.search_max_batch(fake_trial(1, []), start=8, granularity=2, minimum=2, max_trials=50, deadline_s=1e9)
    assert res["largest"] is None and res["smallest_too_big"] == 2 and res["exact"]


def test_batch_rule_and_trial_classification():
    assert bench.batch_rule(multi_process=True, ranks=2, cards=2, accum=4, split=None) == (8, 8)
    assert bench.batch_rule(multi_process=True, ranks=2, cards=2, accum=4, split="even") == (8, 8)
    assert bench.batch_rule(multi_process=True, ranks=2, cards=2, accum=1, split="auto") == (1, 2)
    assert bench.batch_rule(multi_process=False, ranks=1, cards=2, accum=2, split="auto") == (2, 4)
    assert bench.batch_rule(multi_process=False, ranks=1, cards=0, accum=1, split=None) == (1, 1)
    # The trainer's and the memory plan's real wording.
    oom = "CUDA out of memory. Tried to allocate 2.00 GiB; lower train.batch_size, or try train.amp=bf16"
    plan = ("global batch 512 does not fit: the largest that fits is 320 (320 per micro-step x 1 accumulation "
            "steps); cuda:0 60.1 GB free of 150.0 GB, fits 96")
    cpu = "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory"
    assert bench.classify_trial(0, None) == "fits"
    assert bench.classify_trial(2, oom) == bench.classify_trial(1, oom) == "too_big"
    assert bench.classify_trial(2, plan) == bench.classify_trial(1, cpu) == "too_big"
    assert bench.classify_trial(1, plan) == "error"  # "does not fit" counts only as the plan's refusal (exit 2)
    assert bench.classify_trial(2, "ddp: micro-batch 15 is not a multiple of 2 ranks") == "error"
    assert bench.classify_trial(75, oom) == "error" and bench.classify_trial(None, oom) == "error"


def test_tenant_holds_memory_until_stopped():
    t = bench.Tenant(0.2, "cpu").start()  # on a CPU here; cuda:0 on the device
    try:
        rss = next(int(x.split()[1]) for x in Path(f"/proc/{t.pid}/status").read_text().splitlines()
                   if x.startswith("VmRSS")) * 1024
        assert rss > 0.2e9 and t.proc.poll() is None
    finally:
        t.stop()
    assert t.proc.poll() is not None
    with pytest.raises(UsageError, match=r"could not hold 1e\+06 GB on cpu .*lower bench.tenant_gb"):
        bench.Tenant(1e6, "cpu").start()
    # A bench that dies without stopping it (SIGKILL, os._exit): the tenant sees its pipe close and exits.
    code = "import os\nfrom job.bench import Tenant\nprint(Tenant(0.05, 'cpu').start().pid, flush=True)\nos._exit(9)"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    pid = int(p.stdout.split()[0])
    assert wait_gone([pid], 60) == [], f"tenant {pid} outlived the bench"


# -- imagefolder --------------------------------------------------------------------------------


def test_image_folder_is_generated_once_and_reused(tmp_path):
    from PIL import Image

    info = bench.image_folder(tmp_path / "img", 12, seed=3)
    files = sorted((tmp_path / "img").rglob("*.jpg"))
    assert len(files) == 12 and len({f.parent.name for f in files}) == 10 and info["generated_s"] is not None
    for f in files:
        with Image.open(f) as im:
            assert im.format == "JPEG" and max(im.size) == 500 and 333 <= min(im.size) <= 375  # ImageNet's shapes
    assert info["bytes"] == sum(f.stat().st_size for f in files)
    before = [f.stat().st_mtime_ns for f in files]
    again = bench.image_folder(tmp_path / "img", 12, seed=3)
    assert again["generated_s"] is None and [f.stat().st_mtime_ns for f in files] == before
    assert len(list((tmp_path / "img").rglob("*.jpg"))) == 12
    assert bench.image_folder(tmp_path / "img", 20, seed=3)["generated_s"] is not None  # other settings: remade
    assert len(list((tmp_path / "img").rglob("*.jpg"))) == 20


def test_the_image_generator_never_replaces_a_folder_it_did_not_make(tmp_path):
    """bench.imagefolder_dir (or the decoders' --dir) naming a folder of the user's: refused in one line, its
    files untouched; an empty folder, one it left half-generated and one an older version made are its own."""
    from job.errors import UsageError

    mine = tmp_path / "pets"
    (mine / "cat").mkdir(parents=True)
    (mine / "cat" / "0001.jpg").write_bytes(b"my photo")
    with pytest.raises(UsageError, match=r"pets holds files the bench did not generate .*: give a new or empty folder"):
        bench.image_folder(mine, 12)
    assert (mine / "cat" / "0001.jpg").read_bytes() == b"my photo"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match="did not generate"):
        bench.image_folder(tmp_path / "afile", 12)
    (tmp_path / "empty").mkdir()
    assert bench.image_folder(tmp_path / "empty", 12)["generated_s"] is not None
    half = tmp_path / "half"  # what a generation stopped midway leaves: its first manifest, some files
    (half / "class_00").mkdir(parents=True)
    (half / "MANIFEST.json").write_text('{"format": 2, "generating": true}\n')
    (half / "class_00" / "img_000000.jpg").write_bytes(b"half")
    assert bench.image_folder(half, 12)["generated_s"] is not None
    assert len(list(half.rglob("*.jpg"))) == 12


def test_smaller_image_files_are_the_same_images_resized_in_a_folder_of_their_own(tmp_path):
    """bench.imagefolder_short_side=N: each generated image resized to a short side of N px (the same quality),
    in bench-images-s<N>, its manifest saying so: the ImageNet-like folder and its manifest stay as they were."""
    from PIL import Image

    from job.bench.imagefolder import images_dir_name

    assert (images_dir_name(0), images_dir_name(128)) == ("bench-images", "bench-images-s128")
    full = bench.image_folder(tmp_path / images_dir_name(0), 12, seed=3)
    small = bench.image_folder(tmp_path / images_dir_name(128), 12, seed=3, short_side=128)
    assert (full["short_side"], small["short_side"]) == (0, 128) and small["generated_s"] is not None
    for f, g in zip(sorted((tmp_path / "bench-images").rglob("*.jpg")), sorted((tmp_path / "bench-images-s128").rglob("*.jpg"))):
        with Image.open(f) as a, Image.open(g) as b:
            assert min(b.size) == 128 and abs(b.size[0] / b.size[1] - a.size[0] / a.size[1]) < 0.02, (a.size, b.size)
            assert (b.size[0] > b.size[1]) == (a.size[0] > a.size[1])  # a portrait one stays portrait
    assert small["bytes"] < full["bytes"] / 3
    assert json.loads((tmp_path / "bench-images-s128" / "MANIFEST.json").read_text())["short_side"] == 128
    assert "short_side" not in json.loads((tmp_path / "bench-images" / "MANIFEST.json").read_text())
    assert bench.image_folder(tmp_path / "bench-images-s128", 12, seed=3, short_side=128)["generated_s"] is None
    # a folder of the other kind is not taken for this one: it is generated again
    assert bench.image_folder(tmp_path / "bench-images-s128", 12, seed=3)["generated_s"] is not None


def test_code_fingerprint_names_the_code_and_git_commit_names_a_copy(tmp_path, monkeypatch):
    """A copy whose .git is stale still names its code: the fingerprint follows every .py/.yaml under job/
    (not caches, not other files), and GIT_COMMIT, when set, is the commit the result records."""
    from job.bench import environment

    (tmp_path / "job" / "conf").mkdir(parents=True)
    (tmp_path / "job" / "a.py").write_text("x = 1\n")
    (tmp_path / "job" / "conf" / "base.yaml").write_text("train: {}\n")
    first = code_fingerprint(tmp_path)
    assert len(first) == 12 and first == code_fingerprint(tmp_path)
    (tmp_path / "job" / "__pycache__").mkdir()
    (tmp_path / "job" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "job" / "notes.txt").write_text("ignored")
    assert code_fingerprint(tmp_path) == first
    (tmp_path / "job" / "conf" / "base.yaml").write_text("train: {steps: 2}\n")
    assert code_fingerprint(tmp_path) != first
    monkeypatch.setenv("GIT_COMMIT", "a" * 40)
    assert environment._git_commit() == ("a" * 40, None)


def test_physical_cores_count_hyper_threads_once(tmp_path):
    """bench.json's cpu_cores: the physical cores under this process's CPUs, read from sysfs; two hyper-threads
    of one core count once, so a host of 16 CPUs on 8 cores shows as such beside its real-data rows."""
    import os

    from job.bench.environment import physical_cores

    cpus = sorted(os.sched_getaffinity(0))

    def tree(core_of) -> Path:
        root = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        for cpu in cpus:
            (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
            (root / f"cpu{cpu}" / "topology" / "physical_package_id").write_text("0\n")
            (root / f"cpu{cpu}" / "topology" / "core_id").write_text(f"{core_of(cpu)}\n")
        return root

    assert physical_cores(tree(lambda cpu: cpu)) == len(cpus)  # one thread a core
    assert physical_cores(tree(lambda cpu: cpu // 2)) == len({cpu // 2 for cpu in cpus})  # two threads a core
    assert physical_cores(tmp_path / "absent") is None
    real = physical_cores()
    assert real is None or 1 <= real <= len(cpus)


def test_a_bench_held_to_some_cpus_says_which():
    """bench.json's cpus: the CPUs the bench may use, in taskset's list format; the version line names them where
    they are not the whole host (a bench pinned with taskset, a Slurm or container limit), so a result measured
    on one core does not read as one measured on all of them."""
    import json
    import os

    from job.bench.environment import cpu_list, versions

    assert cpu_list([7, 0, 1, 2, 3, 9, 10]) == "0-3,7,9-10"
    assert cpu_list([3]) == "3"
    env = {**_env(), "cpus": "0-31"}
    assert "; 32 CPUs on 16 cores;" in versions(env)
    assert "; 32 CPUs, this bench on 0-7 (4 cores);" in versions({**env, "cpus": "0-7", "cpu_cores": 4})
    assert "; 32 CPUs, this bench on 5 (1 core);" in versions({**env, "cpus": "5", "cpu_cores": 1})
    # The real record, in a process held to one CPU (as `taskset -c N python -m job bench` is).
    cpu = max(os.sched_getaffinity(0))
    code = (f"import json, os; os.sched_setaffinity(0, {{{cpu}}}); from job.bench.environment import environment, "
            "versions; e = environment([]); print(json.dumps([e['cpus'], e['cpu_count'], versions(e)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    cpus, count, line = json.loads(out.stdout.splitlines()[-1])
    assert cpus == str(cpu)
    if count > 1:
        assert f"this bench on {cpu}" in line


def test_a_real_data_row_says_what_data_decode_auto_ended_with():
    """bench.json's input_gpu_share (the run's summary data_gpu_share): the real-data line counts each ending."""
    from job.bench.table import _input_lines

    def run(share, repeat, settled=None):
        r = _run("ddp+imagefolder", "imagefolder", "ddp", [], 1, 3000.0, repeat=repeat, window=(294, 444))
        r.update(data="imagefolder", input_samples_per_s=3000.0, input_worker_cores=6.0, input_gpu_share=share,
                 input_auto_settled_step=settled)
        return r

    w = {"units_per_sample": 1, "runs": [run(1.0, 1), run(1.0, 2), run(0.5, 3, settled=200)]}
    (line,) = _input_lines(w, "img/s")[1:]
    assert line.endswith("; data.decode=auto ended with half of the JPEGs on the GPU in 1 of 3, every JPEG on the "
                         "GPU in 2 of 3; its trials are in the timed steps of 2 of 3 (bench.auto_settle=true, or a "
                         "longer bench.warmup, times after them)"), line
    # chosen before the timed steps in every run (bench.auto_settle): the rate is the chosen decoders'
    w = {"units_per_sample": 1, "runs": [run(0.7, 1, 250), run(0.65, 2, 294), run(0.7, 3, 180)]}
    assert _input_lines(w, "img/s")[1].endswith("; data.decode=auto chose 65% of the JPEGs on the GPU in 1 of 3, "
                                                "70% of the JPEGs on the GPU in 2 of 3, before the timed steps "
                                                "(295-444)")
    # the table's header names the later window of such rows
    from job.bench.table import _later

    assert _later({"runs": [*w["runs"], _run("ddp", "strategy", "ddp", [], 1, 1.0)]}, 10, 150) == (
        "11-160 (imagefolder rows with data.decode=auto: after its choice, from step 295)")  # a bench.json before
    assert _later({"runs": [_run("ddp", "strategy", "ddp", [], 1, 1.0)]}, 10, 150) == "11-160"
    # every row timed over the same later steps (bench_workload's settle)
    assert _later({"runs": [*w["runs"], _run("ddp", "strategy", "ddp", [], 1, 1.0, window=(294, 444))]}, 10, 150) == (
        "295-444 (every row trains 284 steps first, in which data.decode=auto chooses where to decode, then the "
        "warm-up)")
    # chosen at step 295, one step into the timed window: its last change is in the timed steps
    w = {"units_per_sample": 1, "runs": [run(0.0, 1, 295)]}
    assert _input_lines(w, "img/s")[1].endswith("; data.decode=auto ended with the workers decoding every JPEG in 1 "
                                                "of 1; its trials are in the timed steps of 1 of 1 (bench.auto_settle"
                                                "=true, or a longer bench.warmup, times after them)")
    # Where JPEGs went to the GPU the workers only read those: no rate a busy core from what they handed over
    assert " on 6.0 cores;" in line and "a busy core" not in line
    w = {"units_per_sample": 1, "runs": [run(0.0, 1, 60), run(None, 2)]}  # stayed with the workers; no tuner
    line = _input_lines(w, "img/s")[1]
    assert "data.decode=auto" not in line and line.endswith(" on 6.0 cores (500 img/s a busy core)"), line


def test_imagefolder_rows_with_data_decode_auto_train_its_choice_before_their_timed_steps():
    """bench.auto_settle: on a GPU, a row whose data.decode is auto (with workers) first trains the longest choice
    data.decode=auto can take at steps of 25 ms or more; a row that fixes the decoder, a CPU bench, no workers
    or auto_settle=false time from bench.warmup as before."""
    from types import SimpleNamespace

    from job.bench.compare import AUTO_SHORTEST_STEP_S, _choosing
    from job.data import SplitTuner, tuner_lookahead

    def steps(extra, *, cuda=1, auto_settle=True, keys=()):
        runs = SimpleNamespace(cuda=cuda, settings=SimpleNamespace(auto_settle=auto_settle))
        return _choosing(runs, load(["workload=resnet50", *keys]), ["data.kind=imagefolder", *extra])

    longest = SplitTuner.longest(tuner_lookahead(15), step_s=AUTO_SHORTEST_STEP_S)
    assert longest == 15 * 2 + 4 + 10 + 80 + 2 * (34 + 5 + 80) + 80 + 34  # windows of 2 s at 25 ms: 80 batches
    assert steps(["data.workers=15"]) == longest
    assert steps(["data.workers=15"], keys=["data.decode=auto"]) == longest
    assert steps(["data.workers=15", "data.decode=cpu"]) == 0  # a variant that fixes the decoder
    assert steps(["data.workers=15"], keys=["data.decode=gpu"]) == 0  # the user's override
    assert steps(["data.workers=2"], keys=["data.workers=7"]) == SplitTuner.longest(8, step_s=AUTO_SHORTEST_STEP_S)
    assert steps([], keys=["data.workers=7"]) == SplitTuner.longest(18, step_s=AUTO_SHORTEST_STEP_S)
    assert steps(["data.workers=0"]) == 0
    # a deeper prefetch takes batches further ahead, so each change of share lands further on
    deeper = SplitTuner.longest(tuner_lookahead(15, 3), step_s=AUTO_SHORTEST_STEP_S)
    assert steps(["data.workers=15", "data.prefetch=true", "data.prefetch_depth=3"]) == deeper > longest
    assert steps(["data.workers=15", "data.prefetch_depth=3", "data.prefetch=false"]) == longest
    assert steps(["data.workers=15"], cuda=0) == 0
    assert steps(["data.workers=15"], auto_settle=False) == 0


def test_every_row_of_a_workload_is_timed_over_the_same_steps_as_its_auto_rows(monkeypatch, tmp_path):
    """Where an imagefolder row's data.decode=auto first trains its choice (bench.auto_settle, on a GPU), every
    other row of the workload (synthetic, a variant that fixes the decoder, the telemetry pair) trains as many
    steps before its warm-up: every row is timed over the same steps. Without such a row all start at
    bench.warmup."""
    import importlib
    from types import SimpleNamespace

    compare = importlib.import_module("job.bench.compare")  # job.bench.compare is also a function
    from job.bench.compare import AUTO_SHORTEST_STEP_S
    from job.bench.results import empty_run
    from job.data import SplitTuner, tuner_lookahead

    monkeypatch.setattr(compare, "image_folder", lambda *a, **k: {"path": str(tmp_path)})

    def plan(*, cuda, variants=("data.decode=gpu data.gpu_share=0.5",), decode="auto"):
        specs = []

        def run(spec):
            specs.append(spec)
            return empty_run(spec.name, spec.kind, spec.strategy, repeat=spec.repeat)

        settings = SimpleNamespace(baseline="none", reference=False, strategies=["ddp"], imagefolder=True,
                                   imagefolder_images=10, imagefolder_short_side=0, imagefolder_variants=list(variants),
                                   tokens=False, warmup=10, steps=150, repeats=2, telemetry_overhead=True,
                                   telemetry_strategy="ddp", telemetry_repeats=1, scrape_interval_s=1.0,
                                   auto_settle=True)
        fake = SimpleNamespace(settings=settings, cuda=cuda, cards=1, overrides={"data.workers": "4"}, images_dir=tmp_path,
                               interrupted=False, run=run, first_card=lambda: "0",
                               ref_cfg=lambda w: load([f"workload={w}", "data.workers=4", f"data.decode={decode}"]))
        compare.bench_workload(fake, "resnet50")
        return {(s.name, s.repeat): s.warmup for s in specs}

    settle = SplitTuner.longest(tuner_lookahead(4), step_s=AUTO_SHORTEST_STEP_S)
    got = plan(cuda=1)
    assert {"ddp", "ddp+imagefolder", "ddp+imagefolder[decode=gpu gpu_share=0.5]", "telemetry-on-1"} <= {
        name for name, _ in got}, got
    assert set(got.values()) == {10 + settle}, got
    assert set(plan(cuda=1, variants=()).values()) == {10 + settle}
    assert set(plan(cuda=0).values()) == {10}  # no card: nothing chooses
    assert set(plan(cuda=1, decode="cpu").values()) == {10}  # the decoder fixed: nothing chooses



def test_the_profile_says_what_the_card_ran_on_each_stream_and_beside_the_model():
    """card_streams on a hand-made trace of 2 steps: the model's stream (7, the busiest) and a decoder's (20)
    whose work partly runs beside it; CPU events, unfinished device events and another card's are not its."""
    from job.bench.profiling import card_lines, card_streams

    def ev(cat, name, stream, ts, dur=None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "args": {"stream": stream}}
        return e if dur is None else {**e, "dur": dur}

    events = [ev("kernel", "conv", 7, 0, 10), ev("kernel", "bn", 7, 20, 10), ev("kernel", "conv", 7, 100, 10),
              ev("kernel", "bn", 7, 120, 10), ev("kernel", "nvjpeg::decode", 20, 5, 10),
              ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 105, 20),
              ev("cpu_op", "aten::conv2d", 7, 0, 500), ev("kernel", "no end", 20, 140),
              {**ev("kernel", "card 1's", 7, 0, 900), "args": {"device": 1, "stream": 7}}]
    card = card_streams(events, steps=2)
    assert [s["stream"] for s in card["streams"]] == [7, 20] and card["main_stream"] == 7
    assert card["streams"][0]["ms_per_step"] == pytest.approx(0.020)  # 40 us over 2 steps
    assert card["streams"][1]["ms_per_step"] == pytest.approx(0.015)
    assert card["busy_ms"] == pytest.approx(0.0275)  # 0-15, 20-30, 100-130: 55 us
    assert card["main_beside_ms"] == pytest.approx(0.0075)  # 5-10, 105-110, 120-125: 15 us
    assert [(t["name"], t["calls"]) for t in card["streams"][0]["top"]] == [("conv", 2), ("bn", 2)]
    assert card["streams"][1]["events_per_step"] == 1.0
    text = "\n".join(card_lines(card, 0.05))
    assert ("card 0 (kernels, copies and sets of every CUDA stream, from the trace): busy 0.03 ms a step of 0.05; "
            "the busiest stream (7, the model's) 0.02 ms, 0.01 of it beside") in text
    assert "stream 20: 0.01 ms a step" in text and "nvjpeg::decode" in text
    assert card_streams([ev("cpu_op", "aten::mm", 0, 0, 5)], steps=1) is None  # a CPU run: no card
    assert card_streams(events, steps=2, device=1)["busy_ms"] == pytest.approx(0.45)
