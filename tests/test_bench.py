"""`python -m job bench`: the whole path on CPU through the real entry point and the real trainer.

The end-to-end tests run the trainer in fresh processes exactly as on GPUs (baseline, dp, ddp over
gloo, repeats in rotated order, the telemetry on/off pair with a real exporter scraped over loopback,
imagefolder rows on generated JPEG files, a maxbatch search that ends on a real out-of-memory error,
the dp profile) and check the printed table, bench.json against RESULT_SCHEMA (every key, every type),
and bench.png. Pure unit tests cover the median/range/claim rule, the same-window rule, the search
against a fake trial, the tenant's lifecycle and the image generation. A GPU-shaped result document
(there is no GPU here) checks the per-card columns and the chart offline; the GPU tests at the bottom
run the real thing on 2 cards.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, job_cmd, requires_gpus

from job.bench.environment import code_fingerprint

try:  # a test dependency (pyproject [test]); the GPU machine may run the GPU test without it
    import jsonschema
except ImportError:  # pragma: no cover
    jsonschema = None

from job import bench
from job.bench.process import error_line
from job.config import load
from job.errors import UsageError

# Small and quick on 2 cores; the code paths are those of the real workloads.
SMALL = ["workload=tiny", "workload.width=8", "workload.image_size=16", "train.batch_size=16",
         "train.device=cpu"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_bench(out: Path, *args: str, timeout: int = 300, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(job_cmd("bench", *SMALL, f"bench.out={out}", *args), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})})


def validate(doc: dict, *, required: bool = True) -> None:
    if jsonschema is None:
        if required:
            pytest.fail("jsonschema is missing: pip install -e '.[test]'")
        return
    jsonschema.Draft202012Validator.check_schema(bench.RESULT_SCHEMA)
    jsonschema.Draft202012Validator(bench.RESULT_SCHEMA).validate(doc)


def assert_png(path: Path) -> None:
    from matplotlib import image

    assert path.stat().st_size > 10_000, path.stat().st_size  # a real chart, not an empty canvas
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 600
    assert pixels.std() > 0.01  # something is drawn on it


def runs_by_name(doc: dict) -> dict[str, dict]:
    return {r["name"]: r for r in doc["workloads"][0]["runs"]}


def test_bench_tiny_end_to_end(tmp_path):
    out = tmp_path / "b"
    p = run_bench(out, "bench.warmup=2", "bench.steps=6", "bench.repeats=2", "strategies=[ddp]", "train.lr=0.01")
    assert p.returncode == 0, p.stdout + p.stderr

    # The table is printed last: one row per compared run name (median and range of the repeats).
    table = p.stdout[p.stdout.index("== bench tiny"):].split("\n\n")[0]
    lines = table.splitlines()
    assert lines[0] == ("== bench tiny: global batch 16, CPU, 2 ddp processes, 2 warm-up + 6 timed steps, "
                        "2 repeat(s) (order rotated each repeat)")
    assert lines[1].startswith("per-card peaks over the timed steps 3-8 (each run resets its peak counters")
    assert lines[2].startswith("torch ") and "; commit " in lines[2]  # versions and commit in every table
    rows = [line.split()[0] for line in lines[5:7]]
    assert rows == ["1proc", "ddp"], table
    assert "results:" in p.stdout.splitlines()[-1]

    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    assert doc["mode"] == "compare" and doc["device"] == "cpu" and doc["cards"] == 2 and doc["failed"] == 0
    assert doc["tenant"] is None and doc["settings"]["repeats"] == 2
    assert doc["settings"]["overrides"] == {
        "workload": {"width": 8, "image_size": 16}, "train": {"batch_size": 16, "device": "cpu", "lr": 0.01}}
    env = doc["environment"]
    assert env["torch"] and env["command"].startswith("python -m job bench ") and env["gpus"] == []
    assert env["commit"] is None or len(env["commit"]) == 40
    assert env["code"] == code_fingerprint(ROOT) and f"code {env['code']}" in lines[2]
    assert "torchvision" in env and "nccl" in env
    w = doc["workloads"][0]
    assert (w["workload"], w["unit"], w["global_batch"], w["cards"]) == ("tiny", "img", 16, 2)

    runs = w["runs"]
    # Two repeats, the order rotated by one: no row always runs first.
    assert [(r["name"], r["repeat"]) for r in runs] == [("1proc", 1), ("ddp", 1), ("ddp", 2), ("1proc", 2)]
    assert w["telemetry_overhead"] is None and w["imagefolder"] is None and w["comparisons"] == []
    for r in runs:
        assert r["status"] == "ok" and r["exit_code"] == 0, r
        assert r["samples_per_s"] > 0 and r["trainer_samples_per_s"] > 0 and r["timed_steps"] == 6
        assert abs(r["step_s"] * r["samples_per_s"] - r["batch_size"]) < 1e-6
        assert r["cards"] == [] and r["imbalance"] is None  # CPU: no per-card memory
        # The same window for every strategy: peaks were reset when the clock started (after warm-up).
        assert r["peak_window"] == [2, 8] and r["window_note"] is None, r
        cmd = r["command"]
        assert cmd[:4] == ["python", "-m", "job", "train"]
        for key in ("train.steps=8", "train.timing_warmup=2", "train.log_every=2", "train.checkpoint_every=0",
                    f"train.run_id=tiny-{r['name']}-r{r['repeat']}"):
            assert key in cmd, (key, cmd)
        run_dir = Path(r["run_dir"])
        assert json.loads((run_dir / "summary.json").read_text())["peak_window"] == [2, 8]
        assert not (run_dir / "checkpoints").exists()  # removed: a bench needs none
        assert Path(r["log"]).read_text()

    by = {r["name"]: r for r in w["summary"]}
    assert list(by) == ["1proc", "ddp"]
    for name, row in by.items():
        values = [r["units_per_s"] for r in runs if r["name"] == name]
        assert row["runs"] == row["ok"] == 2 and row["status"] == "ok" and row["same_window"]
        assert row["units_per_s"] == {"median": pytest.approx(sum(values) / 2), "min": min(values),
                                      "max": max(values), "n": 2}
    base, ddp = by["1proc"], by["ddp"]
    # The baseline: one process, the same per-card batch; ddp: 2 processes of 8 samples each.
    assert (base["world_size"], base["units"]) == (1, 1) and (ddp["world_size"], ddp["units"]) == (2, 2)
    assert "strategy.nprocs=1" in runs[0]["command"] and runs[0]["batch_size"] == 8
    assert ddp["scaling_vs_1"] == pytest.approx(ddp["units_per_s"]["median"] / (2 * base["units_per_s"]["median"]))
    assert f"{ddp['scaling_vs_1']:.1%}" in next(x for x in lines if x.startswith("ddp "))
    # Per run too, against the same repeat's baseline.
    assert runs[2]["scaling_vs_1"] == pytest.approx(runs[2]["samples_per_s"] / (2 * runs[3]["samples_per_s"]))

    assert doc["chart"] == str(out / "bench.png")
    assert_png(out / "bench.png")
    assert (out / "overrides.yaml").read_text().count("batch_size: 16") == 1


def test_a_failing_run_is_reported_and_the_others_still_run(tmp_path):
    # An explicit split of 2 shares cannot serve 3 ddp processes: that run fails with the trainer's error
    # line (dp ignores strategy.split), the baseline (16 / 3 cards) is skipped with the arithmetic, dp still
    # runs; exit code 1.
    # Started as rank 1 of a torchrun-like group: the runs must not inherit that (dp as rank 1 of 2
    # would write no summary), each starts as a plain command.
    out = tmp_path / "f"
    group = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    p = run_bench(out, "bench.warmup=1", "bench.steps=2", "bench.cpu_procs=3", "strategies=[ddp,dp]", "bench.repeats=1",
                  "strategy.split=8,8", env=group)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT are set but ignored" in p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    assert doc["failed"] == 1
    runs = runs_by_name(doc)
    assert runs["ddp"]["status"] == "failed" and runs["ddp"]["exit_code"] == 2
    assert "strategy.split=8,8 gives 2 shares for 3 cards" in runs["ddp"]["reason"], runs["ddp"]["reason"]
    assert runs["1proc"]["status"] == "skipped" and "16 is not a multiple of 3" in runs["1proc"]["reason"]
    assert runs["dp"]["status"] == "ok" and runs["dp"]["scaling_note"] == "baseline skipped"
    assert "failed: strategy.split=8,8 gives 2 shares" in p.stdout
    assert_png(out / "bench.png")


def test_sigterm_stops_the_current_run_and_writes_what_was_measured(tmp_path):
    out = tmp_path / "s"
    cmd = job_cmd("bench", *SMALL, f"bench.out={out}", "bench.warmup=2", "bench.steps=100000", "strategies=[dp]",
                  "bench.repeats=2")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    try:
        log = out / "logs" / "tiny-1proc-r1.log"
        deadline = time.monotonic() + 120
        while not (log.exists() and "step 2/" in log.read_text()):  # the trainer is in its loop
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 75, stdout + stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    runs = runs_by_name(doc)
    # The run got SIGTERM from the bench, checkpointed and exited 75; dp never started, nor repeat 2.
    assert runs["1proc"]["status"] == "interrupted" and runs["1proc"]["exit_code"] == 75
    assert runs["dp"]["status"] == "skipped" and "interrupted before" in runs["dp"]["reason"]
    assert len(doc["workloads"][0]["runs"]) == 2
    assert "== bench tiny" in stdout


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


def test_overrides_are_what_the_user_changed_against_the_workload_preset():
    cfg = load(["workload=lm", "strategy=dp", "train.amp=bf16", "workload.layers=2", "train.steps=7",
                "train.run_id=x", "bench.steps=3", "strategies=[dp]", "train.batch_size=16"])
    # train.batch_size=16 is lm's preset value: not an override. Bench keys and picks are not passed on.
    assert bench.user_overrides(cfg) == {"train.amp": "bf16", "workload.layers": 2}
    assert bench.user_overrides(load(["workload=resnet50"])) == {}
    # Against the preset the command line picked, not the lm preset every lm shape shares a name with.
    assert bench.user_overrides(load(["workload=lm-24x384", "workload.seq_len=64"]), "lm-24x384") == {
        "workload.seq_len": 64}


def test_a_workload_preset_is_its_own_table(tmp_path):
    """`workload=lm-24x384` (a preset of the lm model): the table, bench.json and the run ids name the preset,
    every run starts from it, and what the command line changes on top of it is all that is passed on."""
    from job.__main__ import main

    out = tmp_path / "b"
    args = ["workload=lm-24x384", "workload.layers=1", "workload.seq_len=16", "train.device=cpu",
            "strategies=[ddp]", "bench.baseline=none", "bench.repeats=1", "bench.warmup=1", "bench.steps=2"]
    b = bench.Bench(load(args), "lm-24x384")
    assert (b.workloads, b.kinds) == (["lm-24x384"], {"lm-24x384": "lm"})
    assert b.overrides == {"workload.layers": 1, "workload.seq_len": 16, "train.device": "cpu"}
    assert main(["bench", *args, f"bench.out={out}"]) == 0
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    (w,) = doc["workloads"]
    assert (w["workload"], w["unit"], w["global_batch"], w["units_per_sample"]) == ("lm-24x384", "tok", 32, 16)
    (run,) = w["runs"]
    assert run["status"] == "ok" and "workload=lm-24x384" in run["command"], run
    assert Path(run["run_dir"]).name == "lm-24x384-ddp-r1"
    config_yaml = (Path(run["run_dir"]) / "config.yaml").read_text()
    for line in ("layers: 1", "d_model: 384", "vocab: 8192", "seq_len: 16", "batch_size: 32"):
        assert line in config_yaml, line


def test_timed_throughput_uses_the_logged_window():
    recs = [{"step": 2, "time": 100.0}, {"step": 4, "time": 101.0}, {"step": 10, "time": 104.0}]
    assert bench.timed_throughput(recs, warmup=2, total=10, batch=32) == pytest.approx(8 * 32 / 4.0)
    assert bench.timed_throughput(recs, warmup=3, total=10, batch=32) is None  # no record at step 3
    assert bench.timed_throughput(recs, warmup=2, total=12, batch=32) is None


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
         "step_s": 16 / sps if sps else None, "trainer_samples_per_s": sps, "imbalance": None, "scaling_vs_1": None,
         "scaling_note": None, "peak_window": list(window) if status == "ok" else None, "window_note": None,
         "cards": cards, "scrapes_ok": None, "scrapes_failed": None, "params": None}
    if len(cards) > 1:
        peaks = [c["peak_allocated_bytes"] for c in cards]
        r["imbalance"] = max(peaks) / min(peaks)
    return r


def _env() -> dict:
    return {"date": "2026-11-30T00:00:00+00:00", "hostname": "h", "command": "python -m job bench", "python": "3.11",
            "platform": "Linux", "cpu": "x", "cpu_count": 32, "torch": "2.14.1", "torch_cuda": "12.8", "cudnn": 91000,
            "nccl": "2.27.3", "torchvision": "0.29.1", "driver": "570.1", "cuda_driver": "12.8",
            "gpu_model": "NVIDIA H200", "gpus": [{"name": "NVIDIA H200", "uuid": "GPU-1", "pci_bus_id": "00000000:18:00.0",
                                                   "memory_total_bytes": 150 * 1024**3}],
            "cuda_visible_devices": None, "commit": "0" * 40, "commit_dirty": False, "code": "0123456789ab"}


def _settings(**kw) -> dict:
    return {"steps": 50, "warmup": 10, "repeats": 2, "strategies": ["dp", "ddp", "balanced"], "workloads": ["lm"],
            "baseline": "ddp", "cpu_procs": 2, "overrides": {}, "out": "/x", "imagefolder": False, "tokens": False, "reference": False,
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
    summary = bench.summarize(runs, ["1gpu", "dp", "ddp", "balanced"], window=[10, 60])
    bench.summary_scaling(summary, 2)
    w = {"workload": "lm", "unit": "tok", "units_per_sample": 1024, "global_batch": 16, "cards": 2, "runs": runs,
         "summary": summary, "comparisons": bench.comparisons(summary), "telemetry_overhead": None,
         "imagefolder": None, "tokens": None, "maxbatch": None, "profiles": None}
    return {"schema": bench.SCHEMA_ID, "mode": "compare", "device": "cuda", "cards": 2, "settings": _settings(),
            "tenant": {"gb": 80.0, "device": "cuda:0", "pid": 1234}, "environment": _env(), "workloads": [w],
            "chart": None, "failed": 2}


def test_gpu_shaped_results_table_and_chart(tmp_path):
    doc = _gpu_doc()
    validate(doc)
    text = bench.table(doc, doc["workloads"][0])
    lines = text.splitlines()
    assert lines[0] == ("== bench lm: global batch 16, 2 GPU(s), 10 warm-up + 50 timed steps, 2 repeat(s) "
                        "(order rotated each repeat)")
    assert lines[1].startswith("per-card peaks over the timed steps 11-60")
    assert lines[2] == ("torch 2.14.1, CUDA 12.8, cuDNN 91000, NCCL 2.27.3, driver 570.1; commit 000000000000, "
                        "code 0123456789ab")
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
    assert "  dp / ddp: tok/s 0.18x: ranges do not overlap" in lines
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
    w["summary"] = bench.summarize(w["runs"], ["1gpu", "dp", "ddp", "balanced"], window=[10, 60])
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


def _vm_peak_with_torch() -> int:
    """VmPeak of a fresh Python that imported torch (what every trial process starts from)."""
    code = ("import torch\nfor l in open('/proc/self/status'):\n"
            "    print(l.split()[1]) if l.startswith('VmPeak') else None")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[0]) * 1024


def _bench_with_memory_limit(*args: str) -> subprocess.CompletedProcess:
    """`python -m job bench ARGS` on the CPU under an address-space limit 0.6 GiB above what torch alone
    takes, inherited by every trial process: a trial past it really runs out of memory."""
    limit = _vm_peak_with_torch() + int(0.6 * 1024**3)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    return subprocess.run(job_cmd("bench", *args), cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
                          preexec_fn=cap)


def test_maxbatch_end_to_end_on_a_real_out_of_memory(tmp_path):
    """Real trial processes under an address-space limit: the large batch really runs out of memory (the
    CPU allocator's error), the search stops between a batch that trains and one that does not."""
    out = tmp_path / "m"
    p = _bench_with_memory_limit("bench.mode=maxbatch", "workload=tiny", "workload.width=8", "workload.image_size=64",
                                 "train.device=cpu", "train.lr=0.01", "strategies=[dp]", f"bench.out={out}",
                                 "bench.maxbatch_start=256", "bench.maxbatch_precision=0.5", "bench.maxbatch_trials=5")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    assert doc["mode"] == "maxbatch" and doc["failed"] == 0
    (w,) = doc["workloads"]
    (r,) = w["maxbatch"]
    outcomes = {t["batch"]: t["outcome"] for t in r["trials"]}
    assert r["strategy"] == "dp" and (r["granularity"], r["minimum"]) == (1, 1)
    assert r["largest"] and outcomes[r["largest"]] == "fits", r
    assert r["smallest_too_big"] and outcomes[r["smallest_too_big"]] == "too_big", r
    assert r["largest"] < r["smallest_too_big"] <= 1.5 * r["largest"] or r["stopped"], r
    too_big = next(t for t in r["trials"] if t["outcome"] == "too_big")
    assert "can't allocate memory" in too_big["reason"]
    assert r["run"] == f"dp@{r['largest']}" and r["units_per_s"] > 0
    # Every trial got the user's overrides and its own batch, in a fresh trainer process.
    trials = {t["name"]: t for t in w["runs"]}
    assert set(trials) == {f"dp@{b}" for b in outcomes}
    for t in trials.values():
        assert t["kind"] == "maxbatch_trial" and "train.steps=3" in t["command"]
        cfg = (Path(t["run_dir"]) / "config.yaml").read_text()
        assert "lr: 0.01" in cfg and "width: 8" in cfg and "image_size: 64" in cfg
        assert f"batch_size: {t['name'].split('@')[1]}" in cfg
    table = p.stdout[p.stdout.index("== bench maxbatch tiny"):]
    row = next(x for x in table.splitlines() if x.startswith("dp "))
    assert row.split()[1:3] == [str(r["largest"]), str(r["smallest_too_big"])]
    assert "  dp trials: 256 " in table
    assert_png(out / "bench.png")


def test_maxbatch_finds_the_deepest_lm_on_a_real_out_of_memory(tmp_path):
    """bench.maxbatch_key=workload.layers: the same search over the lm's depth, under an address-space limit
    that a few hundred MB of AdamW state per ~12 layers exceeds; the table names layers and parameters."""
    out = tmp_path / "m"
    p = _bench_with_memory_limit("bench.mode=maxbatch", "bench.maxbatch_key=workload.layers", "workload=lm",
                                 "workload.d_model=512", "workload.heads=4", "workload.vocab=64", "workload.seq_len=8",
                                 "train.batch_size=2", "train.device=cpu", "strategies=[dp]", f"bench.out={out}",
                                 "bench.maxbatch_start=4", "bench.maxbatch_precision=0.5", "bench.maxbatch_trials=6")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    assert doc["settings"]["maxbatch"]["key"] == "workload.layers"
    (r,) = doc["workloads"][0]["maxbatch"]
    outcomes = {t["batch"]: t["outcome"] for t in r["trials"]}
    assert (r["granularity"], r["minimum"], r["start"]) == (1, 1, 4)
    assert r["largest"] and outcomes[r["largest"]] == "fits", r
    assert r["smallest_too_big"] and outcomes[r["smallest_too_big"]] == "too_big", r
    # 12 x 512^2 weights per block (attention + MLP) and the embeddings: the count the trainer reports.
    assert 12 * 512**2 * r["largest"] < r["params"] < 13 * 512**2 * r["largest"] + 4 * 64 * 512 + 16 * 512, r
    for t in doc["workloads"][0]["runs"]:
        layers = t["name"].split("@")[1]
        assert f"layers: {layers}" in (Path(t["run_dir"]) / "config.yaml").read_text()
        assert "batch_size: 2" in (Path(t["run_dir"]) / "config.yaml").read_text()
    table = p.stdout[p.stdout.index("== bench maxbatch lm: the largest lm depth (layers)"):]
    row = next(x for x in table.splitlines() if x.startswith("dp "))
    assert row.split()[1:3] == [str(r["largest"]), str(r["smallest_too_big"])]
    assert f"{r['params'] / 1e9:.2f}B" in row


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
    deadline = time.monotonic() + 60
    while _alive(pid):
        assert time.monotonic() < deadline, f"tenant {pid} outlived the bench"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


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


def test_imagefolder_rows_end_to_end(tmp_path):
    out, images = tmp_path / "i", tmp_path / "images"
    # With the telemetry on/off pair (the real exporter, scraped over loopback) in the same bench.
    # 40 timed steps: long enough for the 0.05 s scraper to catch the telemetry run serving on a fast CPU.
    p = run_bench(out, "bench.warmup=1", "bench.steps=40", "bench.repeats=1", "bench.baseline=none",
                  "strategies=[dp]", "train.batch_size=8", "bench.imagefolder=true", "bench.imagefolder_images=20",
                  f"bench.imagefolder_dir={images}", "bench.telemetry_overhead=true", "bench.telemetry_strategy=dp",
                  "bench.scrape_interval_s=0.05", "bench.reference=true")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    w = doc["workloads"][0]
    assert w["imagefolder"]["images"] == 20 and len(list(images.rglob("*.jpg"))) == 20
    runs = runs_by_name(doc)
    syn, img = runs["dp"], runs["dp+imagefolder"]
    assert (syn["data"], img["data"], img["kind"]) == ("synthetic", "imagefolder", "imagefolder")
    assert img["status"] == "ok" and img["samples_per_s"] > 0 and img["world_size"] == 1
    for arg in ("data.kind=imagefolder", f"data.path={images}", "data.prefetch=true", "data.workers=1"):
        assert arg in img["command"], img["command"]
    assert "kind: imagefolder" in (Path(img["run_dir"]) / "config.yaml").read_text()
    (c,) = [c for c in w["comparisons"] if c["a"] == "dp+imagefolder"]
    assert c["b"] == "dp" and c["verdict"] == "one run each: no claim"
    assert c["ratio"] == pytest.approx(img["units_per_s"] / syn["units_per_s"])
    table = p.stdout[p.stdout.index("== bench tiny"):]
    assert re.search(r"\ndp\+imagefolder +dp +imagefolder ", table), table
    assert f"  dp+imagefolder / dp: img/s {c['ratio']:.2f}x: one run each: no claim" in table
    # dp on a CPU is one process: no scaling figure, and the JSON says why.
    assert syn["scaling_vs_1"] is None and syn["scaling_note"] == "no baseline"
    assert "imagefolder: 20 generated JPEG files" in table
    # The hand-written loop: the same model, optimizer and batch, timed over the same steps; dp (one card) / loop.
    loop = runs["loop"]
    assert (loop["kind"], loop["status"], loop["data"]) == ("reference", "ok", "synthetic"), loop
    assert loop["command"][:3] == ["python", "-m", "job.bench.reference"] and loop["batch_size"] == 8
    (c,) = [c for c in w["comparisons"] if c["b"] == "loop"]
    assert c["a"] == "dp" and c["ratio"] == pytest.approx(syn["units_per_s"] / loop["units_per_s"])
    assert re.search(r"\nloop +none \(plain loop\) +synthetic ", table) and "  dp / loop: img/s" in table
    assert "telemetry overhead (dp, 1 pair(s), scraped every 0.05 s" in table
    o = w["telemetry_overhead"]
    on = next(r for r in w["runs"] if r["name"] == "telemetry-on-1")
    dp1 = runs["dp"]
    assert any(a.startswith("telemetry.port=") and a != "telemetry.port=0" for a in on["command"])
    # dp's first run (telemetry off, the same command otherwise) is the "off" side of the pair.
    assert (o["off_runs"], o["on_runs"]) == (["dp (repeat 1)"], ["telemetry-on-1"])
    assert [a for a in on["command"] if not a.startswith(("telemetry.", "train.run_id="))] == \
        [a for a in dp1["command"] if not a.startswith("train.run_id=")]
    assert o["off_step_s"] == [dp1["step_s"]] and o["on_step_s"] == [on["step_s"]]
    assert on["scrapes_ok"] >= 1, on  # the exporter really served /metrics while it trained
    assert o["scrapes_ok"] == on["scrapes_ok"] and o["note"] is None


def test_tokens_rows_end_to_end(tmp_path):
    """bench.tokens: a token file generated once (enough windows for every timed step), and each strategy on
    it next to its synthetic row, with the ratio."""
    out = tmp_path / "t"
    lm = ["workload=lm", "workload.layers=1", "workload.d_model=32", "workload.heads=2", "workload.vocab=300",
          "workload.seq_len=16", "train.batch_size=8", "train.device=cpu"]
    p = subprocess.run(job_cmd("bench", *lm, f"bench.out={out}", f"train.run_dir={tmp_path}", "bench.warmup=1",
                               "bench.steps=2", "bench.repeats=1", "bench.baseline=none", "strategies=[dp]",
                               "bench.tokens=true"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    w = doc["workloads"][0]
    t = w["tokens"]
    assert t["dtype"] == "uint16" and t["tokens"] == (1 + 2 + 1) * 8 * 16 + 1 and Path(t["path"]).stat().st_size == 2 * t["tokens"]
    runs = runs_by_name(doc)
    tok = runs["dp+tokens"]
    assert (tok["kind"], tok["data"], tok["status"]) == ("tokens", "tokens", "ok"), tok
    for arg in ("data.kind=tokens", f"data.path={t['path']}", "data.token_dtype=uint16"):
        assert arg in tok["command"], tok["command"]
    (c,) = [c for c in w["comparisons"] if c["a"] == "dp+tokens"]
    assert c["b"] == "dp" and c["ratio"] == pytest.approx(tok["units_per_s"] / runs["dp"]["units_per_s"])
    assert f"tokens: a generated file of {t['tokens']:,} random uint16 token ids" in p.stdout
    # bench.tokens with a workload that reads no token file: one line, exit 2, nothing run.
    p = subprocess.run(job_cmd("bench", "workload=tiny", "train.device=cpu", f"train.run_dir={tmp_path}",
                               "bench.tokens=true"), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "bench.tokens=true needs a workload that reads data.kind=tokens" in p.stderr, p.stderr


# -- profile ------------------------------------------------------------------------------------


def test_profile_mode_on_cpu(tmp_path):
    out = tmp_path / "p"
    p = run_bench(out, "bench.mode=profile", "strategies=[dp]", "bench.warmup=2", "bench.profile_steps=3")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    (prof,) = doc["workloads"][0]["profiles"]
    assert (prof["strategy"], prof["device"], prof["steps"], prof["warmup"]) == ("dp", "cpu", 3, 2)
    phases = {ph["name"]: ph for ph in prof["phases"]}
    for name in ("data", "forward+loss", "forward", "loss", "backward", "optimizer"):
        assert phases[name]["calls"] == 3 and phases[name]["ms_per_step"] > 0, name
    top = [ph for ph in prof["phases"] if ph["depth"] == 0]
    assert sum(ph["ms_per_step"] for ph in top) == pytest.approx(prof["step_ms"])
    assert prof["sort_by"] == "self_cpu_ms" and any("conv" in o["name"] for o in prof["top_ops"])
    text = (out / "profile-tiny-dp.txt").read_text()
    assert text.startswith("profile dp, tiny, global batch 16, CPU: 3 steps after 2 warm-up") and "backward" in text
    assert prof["summary"] in p.stdout
    with gzip.open(prof["trace"]) as f:
        assert "traceEvents" in json.load(f)


@pytest.mark.gpu
@pytest.mark.slow
@requires_gpus(2)
def test_bench_on_two_gpus(tmp_path):
    """The real thing, small: lm with 2 layers on the first 2 cards: dp piles up on card 0, ddp does not."""
    out = tmp_path / "g"
    # A 2-layer lm trains 15 steps in well under a second on an H200: the scraper polls every 50 ms and the
    # runs train 40 timed steps, or the telemetry run may end before its first scrape.
    args = ["workload=lm", "workload.layers=2", "train.amp=bf16", "bench.warmup=5", "bench.steps=40",
            f"bench.out={out}", "strategies=[dp,ddp]", "bench.telemetry_overhead=true", "bench.repeats=1",
            "bench.scrape_interval_s=0.05"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")}
    p = subprocess.run(job_cmd("bench", *args), cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc, required=False)
    assert doc["device"] == "cuda" and doc["environment"]["driver"] and doc["environment"]["gpu_model"]
    runs = runs_by_name(doc)
    base, dp, ddp = runs["1gpu"], runs["dp"], runs["ddp"]
    assert base["env"]["CUDA_VISIBLE_DEVICES"] and len(base["cards"]) == 1
    for r in (dp, ddp):
        assert len(r["cards"]) == doc["cards"] and r["scaling_vs_1"] > 0
        assert all(c["peak_allocated_bytes"] > 0 and c["nvml_used_bytes"] for c in r["cards"])
        assert len({c["uuid"] for c in r["cards"]}) == doc["cards"]
    assert dp["cards"][0]["peak_allocated_bytes"] > 1.5 * dp["cards"][1]["peak_allocated_bytes"]
    assert ddp["imbalance"] < 1.1
    assert doc["workloads"][0]["telemetry_overhead"]["scrapes_ok"] > 0
    assert_png(out / "bench.png")


@pytest.mark.gpu
@pytest.mark.slow
@requires_gpus(2)
def test_maxbatch_with_a_tenant_on_two_gpus(tmp_path):
    """The shared-card case for real: a tenant holds half of card 0; dp and ddp searched on lm."""
    import torch

    out = tmp_path / "mb"
    tenant = round(torch.cuda.get_device_properties(0).total_memory * 0.5 / 1e9)
    args = ["bench.mode=maxbatch", "workload=lm", "workload.layers=2", "train.amp=bf16", "strategies=[dp,ddp]",
            f"bench.tenant_gb={tenant}", "bench.maxbatch_start=16", "bench.maxbatch_trials=8",
            "bench.maxbatch_precision=0.25", f"bench.out={out}"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")}
    p = subprocess.run(job_cmd("bench", *args), cwd=ROOT, capture_output=True, text=True, timeout=3000, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc, required=False)
    assert doc["tenant"]["gb"] == tenant and f"held {tenant} GB on cuda:0 during every run" in p.stdout
    for r in doc["workloads"][0]["maxbatch"]:
        assert r["largest"] and r["smallest_too_big"] and not r["error"], r
        assert len(r["cards"]) == 2 and all(c["peak_allocated_bytes"] > 0 for c in r["cards"])
        card0 = min(r["cards"], key=lambda c: c["device"])
        assert card0["nvml_used_bytes"] > tenant * 1e9  # NVML sees the tenant's memory on card 0
    # The tenant is gone when the bench is.
    free = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info(0)[0])"],
                          capture_output=True, text=True, env=env, check=True, timeout=120).stdout
    assert int(free) > tenant * 1e9
    assert_png(out / "bench.png")


@pytest.mark.gpu
@pytest.mark.slow
@requires_gpus(2)
def test_profile_dp_on_two_gpus(tmp_path):
    out = tmp_path / "pg"
    args = ["bench.mode=profile", "strategies=[dp]", "workload=lm", "workload.layers=2", "train.amp=bf16",
            "bench.warmup=3", "bench.profile_steps=3", f"bench.out={out}"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")}
    p = subprocess.run(job_cmd("bench", *args), cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    (prof,) = json.loads((out / "bench.json").read_text())["workloads"][0]["profiles"]
    phases = {ph["name"]: ph for ph in prof["phases"]}
    for name in ("scatter", "replicate", "parallel_apply", "gather", "loss", "backward", "optimizer"):
        assert phases[name]["calls"] == 3 and phases[name]["ms_per_step"] > 0, name
    assert prof["sort_by"] == "self_cuda_ms" and prof["top_ops"][0]["self_cuda_ms"] > 0
    assert "replicate" in (out / "profile-lm-dp.txt").read_text()


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
