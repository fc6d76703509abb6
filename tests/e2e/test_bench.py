"""`python -m job bench`: the whole path on CPU through the real entry point and the real trainer.

The tests run the trainer in fresh processes exactly as on GPUs (baseline, dp, ddp over gloo, repeats in
rotated order, the telemetry on/off pair with a real exporter scraped over loopback, imagefolder and token
rows on generated files, a maxbatch search that ends on a real out-of-memory error, the dp profile) and check
the printed table, bench.json against RESULT_SCHEMA (every key, every type), and bench.png. The rules they
rely on are tested on their own in tests/unit/test_bench_rules.py; the same runs on 2 GPUs in
tests/gpu/test_bench_gpu.py.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _bench_helpers import assert_png, runs_by_name, validate
from conftest import ROOT, job_cmd

from job import bench
from job.bench.environment import code_fingerprint
from job.config import load

# Small and quick on 2 cores; the code paths are those of the real workloads.
SMALL = ["workload=tiny", "workload.width=8", "workload.image_size=16", "train.batch_size=16",
         "train.device=cpu"]


def run_bench(out: Path, *args: str, timeout: int = 300, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(job_cmd("bench", *SMALL, f"bench.out={out}", *args), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})})


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
        assert r["card_idle"] is None and r["card_power_capped"] is None  # nor a card's idle or power-capped time
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


def test_a_workload_preset_is_its_own_table(tmp_path):
    """`workload=lm-24x384` (a preset of the lm model): the table, bench.json and the run ids name the preset,
    every run starts from it, and what the command line changes on top of it is all that is passed on."""
    from job.__main__ import main

    out = tmp_path / "b"
    args = ["workload=lm-24x384", "workload.layers=1", "workload.seq_len=16", "train.device=cpu",
            "strategies=[ddp]", "bench.baseline=none", "bench.repeats=1", "bench.warmup=1", "bench.steps=2"]
    b = bench.Bench(load(args), "lm-24x384")
    assert (b.workloads, b.workload_names) == (["lm-24x384"], {"lm-24x384": "lm"})
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


def test_imagefolder_dir_naming_a_folder_of_yours_is_refused_and_left_alone(tmp_path):
    mine = tmp_path / "pets"
    (mine / "cat").mkdir(parents=True)
    (mine / "cat" / "0001.jpg").write_bytes(b"my photo")
    p = run_bench(tmp_path / "o", "bench.repeats=1", "bench.baseline=none", "strategies=[dp]", "bench.imagefolder=true",
                  f"bench.imagefolder_dir={mine}")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and lines[-1].startswith(f"error: {mine} holds files the bench did not generate"), p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "o" / "bench.json").exists()
    assert (mine / "cat" / "0001.jpg").read_bytes() == b"my photo" and sorted(mine.rglob("*")) == [mine / "cat", mine / "cat" / "0001.jpg"]


def test_imagefolder_rows_end_to_end(tmp_path):
    out, images = tmp_path / "i", tmp_path / "images"
    # With the telemetry on/off pair (the real exporter, scraped over loopback) in the same bench.
    # 40 timed steps: long enough for the 0.05 s scraper to catch the telemetry run serving on a fast CPU.
    p = run_bench(out, "bench.warmup=1", "bench.steps=40", "bench.repeats=1", "bench.baseline=none",
                  "strategies=[dp]", "train.batch_size=8", "bench.imagefolder=true", "bench.imagefolder_images=20",
                  f"bench.imagefolder_dir={images}", "bench.telemetry_overhead=true", "bench.telemetry_strategy=dp",
                  "bench.scrape_interval_s=0.05", "bench.reference=true",
                  'bench.imagefolder_variants=["data.workers=2 data.worker_nice=0"]')
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    w = doc["workloads"][0]
    assert w["imagefolder"]["images"] == 20 and len(list(images.rglob("*.jpg"))) == 20
    runs = runs_by_name(doc)
    syn, img = runs["dp"], runs["dp+imagefolder"]
    assert (syn["data"], img["data"], img["kind"]) == ("synthetic", "imagefolder", "imagefolder")
    assert img["status"] == "ok" and img["samples_per_s"] > 0 and img["world_size"] == 1
    # A real-data row's rate is the lower of what it trained and what its workers made in the same window; the
    # synthetic row has no workers to count.
    assert img["input_samples_per_s"] > 0 and syn["input_samples_per_s"] is None
    assert img["samples_per_s"] == min(img["trained_samples_per_s"], img["input_samples_per_s"])
    assert syn["samples_per_s"] == syn["trained_samples_per_s"]
    assert re.search(r"\n  dp\+imagefolder: the timed steps trained [\d,]+ img/s, its workers made [\d,]+ img/s in "
                     r"them on [\d.]+ cores \([\d,]+ img/s a busy core\)", p.stdout), p.stdout
    # The one worker's CPU seconds over the window's, from /proc (at nice 10 beside the loop on a busy 2-core
    # machine it may get well under a core, never more than one); the synthetic row has no workers.
    assert 0.02 < img["input_worker_cores"] <= 1.05 and syn["input_worker_cores"] is None
    for arg in ("data.kind=imagefolder", f"data.path={images}", "data.prefetch=true", "data.workers=1"):
        assert arg in img["command"], img["command"]
    assert "kind: imagefolder" in (Path(img["run_dir"]) / "config.yaml").read_text()
    # One worker decodes 8 JPEGs of about 500 x 375 a step for a model of 16 x 16 pixels: the loop waits for
    # data most of the time, and says so; on the resident synthetic pool it does not (medians: a busy machine
    # can stall any one step).
    def waits(run: dict) -> list[float]:
        lines = (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["data_wait"] for x in lines if x.strip()][1:]  # after the first window (start-up)
    assert statistics.median(waits(img)) > 0.3 > 0.1 > statistics.median(waits(syn)), (waits(img), waits(syn))
    assert re.search(r"^step \d+/\d+ .* img/s  waited for data \d+%, its 1 worker busy on [\d.]+ of \d+ cores$",
                     Path(img["log"]).read_text(), re.M)
    cpu = [json.loads(x)["data_cpu_s"] for x in (Path(img["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert cpu == sorted(cpu) and cpu[-1] > cpu[0] > 0, cpu  # the worker's CPU seconds so far, growing
    # The run ends by saying what held its input up, over the timed steps; summary.json has the figures.
    assert re.search(r"^input: the loop waited for data \d+% of the timed steps \(taking batches from the workers "
                     r"\d+%, moving them to the device \d+%; the prefetch thread busy \d+%\); its 1 worker kept "
                     r"[\d.]+ cores busy and the training process [\d.]+, of \d+: ", Path(img["log"]).read_text(), re.M)
    done = {r["name"]: json.loads((Path(r["run_dir"]) / "summary.json").read_text()) for r in (img, syn)}
    assert done["dp+imagefolder"]["data_wait"] > 0.3 and 0.02 < done["dp+imagefolder"]["data_worker_cores"] <= 1.05
    # where the wait went: mostly taking the one worker's batches (it decodes them), each share of the window
    s = done["dp+imagefolder"]
    assert 0 <= s["data_move_wait"] < s["data_take"] <= 1.0 and 0 <= s["data_move_busy"] <= 1.0, s
    # The synthetic run's whole-window share is below half the real-data run's (one stall of a busy 2-core CI
    # machine inside a take put a plain 0.1 bound at 0.145 once; the windows' medians above are the tight check).
    assert done["dp"]["data_worker_cores"] is None
    assert done["dp"]["data_wait"] < done["dp+imagefolder"]["data_wait"] / 2, (done["dp"], done["dp+imagefolder"])
    assert "input: " not in Path(syn["log"]).read_text()
    # The variant: the same files with its own data settings (its workers, not the default 1), a row of its
    # own, compared with the synthetic row and with the plain imagefolder row.
    var = runs["dp+imagefolder[workers=2 worker_nice=0]"]
    assert (var["kind"], var["status"], var["data"]) == ("imagefolder", "ok", "imagefolder"), var
    assert "data.workers=2" in var["command"] and "data.workers=1" not in var["command"], var["command"]
    assert "data.worker_nice=0" in var["command"] and var["input_samples_per_s"] > 0
    assert doc["settings"]["imagefolder_variants"] == ["data.workers=2 data.worker_nice=0"]
    assert {c["b"] for c in w["comparisons"] if c["a"] == var["name"]} == {"dp", "dp+imagefolder"}
    (c,) = [c for c in w["comparisons"] if c["a"] == "dp+imagefolder"]
    assert c["b"] == "dp" and c["verdict"] == "one run each: no claim"
    assert c["ratio"] == pytest.approx(img["units_per_s"] / syn["units_per_s"])
    assert c["paired"]["n"] == 1 and c["paired"]["median"] == pytest.approx(c["ratio"])  # one repeat: one pair
    table = p.stdout[p.stdout.index("== bench tiny"):]
    assert re.search(r"\ndp\+imagefolder +dp +imagefolder ", table), table
    assert f"  dp+imagefolder / dp: img/s {c['ratio']:.2f}x: one run each: no claim" in table
    assert re.search(r"\ndp\+imagefolder\[workers=2 worker_nice=0\] +dp +imagefolder ", table), table
    assert re.search(r"\n  dp\+imagefolder\[workers=2 worker_nice=0\] / dp\+imagefolder: img/s [\d.]+x: one run each", table)
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
    (port,) = [int(a.split("=")[1]) for a in on["command"] if a.startswith("telemetry.port=")]
    # drawn below the kernel's ephemeral range, where no other process's connection takes it first
    assert 1024 <= port < int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]), port
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
    assert prof["phases_timed"] is True and prof["card"] is None  # no card: no streams
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


def test_profile_mode_without_phase_syncs(tmp_path):
    """bench.profile_phases=false: the steps are profiled as they train (no phase table, no syncs inside); ddp
    in one process (one card, here strategy.nprocs=1) is profiled as any one-process strategy."""
    out = tmp_path / "p"
    p = run_bench(out, "bench.mode=profile", "strategies=[ddp]", "strategy.nprocs=1", "bench.warmup=2",
                  "bench.profile_steps=3", "bench.profile_phases=false")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "3 steps profiled after 2 (phases not timed)" in p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    (prof,) = doc["workloads"][0]["profiles"]
    assert prof["strategy"] == "ddp" and prof["phases_timed"] is False and prof["phases"] == []
    assert prof["step_ms"] > 0
    assert "(bench.profile_phases=false: no phase is timed" in prof["summary"] and "ms/step" not in prof["summary"]
    assert any("conv" in o["name"] for o in prof["top_ops"])
