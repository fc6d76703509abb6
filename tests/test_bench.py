"""`python -m job bench`: the whole path on CPU through the real entry point and the real trainer.

The end-to-end tests run the trainer in fresh processes exactly as on GPUs (baseline, dp, ddp over
gloo, the telemetry on/off pair with a real exporter scraped over loopback) and check the printed
table, bench.json against RESULT_SCHEMA (every key, every type), and bench.png. A GPU-shaped result
document (there is no GPU here) checks the per-card columns and the chart's memory bars offline;
the GPU test at the bottom runs the real thing on 2 cards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, job_cmd, requires_gpus

try:  # a test dependency (pyproject [test]); the GPU machine may run the GPU test without it
    import jsonschema
except ImportError:  # pragma: no cover
    jsonschema = None

from job import bench
from job.config import load

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
    p = run_bench(out, "bench.warmup=2", "bench.steps=8", "strategies=[dp,ddp,nosuch]", "train.lr=0.01",
                  "bench.telemetry_overhead=true", "bench.telemetry_strategy=dp", "bench.scrape_interval_s=0.05")
    assert p.returncode == 0, p.stdout + p.stderr

    # The table is printed last, one row per run, in order.
    table = p.stdout[p.stdout.index("== bench tiny"):].split("\n\n")[0]
    rows = [line.split()[0] for line in table.splitlines()[3:] if not line.startswith(("(", "telemetry overhead"))]
    assert rows == ["1proc", "dp", "ddp", "nosuch", "telemetry-on-1"], table
    assert "results:" in p.stdout.splitlines()[-1]
    assert "global batch 16, CPU, 2 ddp processes, 2 warm-up + 8 timed steps" in table
    assert "skipped: strategy `nosuch` is not registered" in table
    assert "telemetry overhead (dp, 1 pair(s), scraped every 0.05 s" in table

    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    assert doc["device"] == "cpu" and doc["cards"] == 2 and doc["failed"] == 0
    assert doc["settings"]["overrides"] == {
        "workload": {"width": 8, "image_size": 16}, "train": {"batch_size": 16, "device": "cpu", "lr": 0.01}}
    env = doc["environment"]
    assert env["torch"] and env["command"].startswith("python -m job bench ") and env["gpus"] == []
    assert env["commit"] is None or len(env["commit"]) == 40
    w = doc["workloads"][0]
    assert (w["workload"], w["unit"], w["global_batch"], w["cards"]) == ("tiny", "img", 16, 2)

    runs = runs_by_name(doc)
    base, dp, ddp = runs["1proc"], runs["dp"], runs["ddp"]
    for r in (base, dp, ddp, runs["telemetry-on-1"]):
        assert r["status"] == "ok" and r["exit_code"] == 0, r
        assert r["samples_per_s"] > 0 and r["trainer_samples_per_s"] > 0 and r["timed_steps"] == 8
        assert abs(r["step_s"] * r["samples_per_s"] - r["batch_size"]) < 1e-6
        assert r["cards"] == [] and r["imbalance"] is None  # CPU: no per-card memory
        # Each run is the real trainer in its own process, with the bench's keys and the user's overrides.
        cmd = r["command"]
        assert cmd[:4] == ["python", "-m", "job", "train"]
        for key in ("train.steps=10", "train.timing_warmup=2", "train.log_every=2", "train.checkpoint_every=0"):
            assert key in cmd, (key, cmd)
        run_dir = Path(r["run_dir"])
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 10
        assert not (run_dir / "checkpoints").exists()  # removed: a bench needs none
        assert Path(r["log"]).read_text()
    # The baseline: one process, same per-card batch; ddp: 2 processes of 8 samples each.
    assert (base["kind"], base["world_size"], base["units"], base["batch_size"]) == ("baseline", 1, 1, 8)
    assert "strategy.nprocs=1" in base["command"] and base["scaling_vs_1"] is None
    assert (ddp["world_size"], ddp["units"], ddp["batch_size"]) == (2, 2, 16)
    assert ddp["scaling_vs_1"] == pytest.approx(ddp["samples_per_s"] / (2 * base["samples_per_s"]))
    # dp on a CPU is one process: no scaling figure, and the table says why.
    assert dp["world_size"] == 1 and dp["scaling_vs_1"] is None and "1 of 2" in dp["scaling_note"]
    nosuch = runs["nosuch"]
    assert nosuch["status"] == "skipped" and "REGISTRY has:" in nosuch["reason"] and nosuch["command"] == []

    o = w["telemetry_overhead"]
    on = runs["telemetry-on-1"]
    assert any(a.startswith("telemetry.port=") and a != "telemetry.port=0" for a in on["command"])
    # dp's own run (telemetry off, the same command otherwise) is the "off" side of the pair.
    assert (o["off_runs"], o["on_runs"]) == (["dp"], ["telemetry-on-1"])
    assert [a for a in on["command"] if not a.startswith(("telemetry.", "train.run_id="))] == \
        [a for a in dp["command"] if not a.startswith("train.run_id=")]
    assert o["off_step_s"] == [dp["step_s"]] and o["on_step_s"] == [on["step_s"]]
    assert on["scrapes_ok"] >= 1, on  # the exporter really served /metrics while it trained
    assert o["scrapes_ok"] == on["scrapes_ok"] and o["note"] is None
    assert o["overhead"] == pytest.approx(o["on_median_step_s"] / o["off_median_step_s"] - 1)

    assert doc["chart"] == str(out / "bench.png")
    assert_png(out / "bench.png")
    assert (out / "overrides.yaml").read_text().count("batch_size: 16") == 1


def test_a_failing_run_is_reported_and_the_others_still_run(tmp_path):
    # 3 ddp processes cannot split a batch of 16: that run fails with the trainer's error line, the
    # baseline (16 / 3 cards) is skipped with the arithmetic, dp still runs; exit code 1.
    # Started as rank 1 of a torchrun-like group: the runs must not inherit that (dp as rank 1 of 2
    # would write no summary), each starts as a plain command.
    out = tmp_path / "f"
    group = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    p = run_bench(out, "bench.warmup=1", "bench.steps=2", "bench.cpu_procs=3", "strategies=[ddp,dp]", env=group)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT are set but ignored" in p.stderr
    doc = json.loads((out / "bench.json").read_text())
    validate(doc)
    assert doc["failed"] == 1
    runs = runs_by_name(doc)
    assert runs["ddp"]["status"] == "failed" and runs["ddp"]["exit_code"] == 2
    assert "micro-batch 16" in runs["ddp"]["reason"] and "3 ranks" in runs["ddp"]["reason"]
    assert runs["1proc"]["status"] == "skipped" and "16 is not a multiple of 3" in runs["1proc"]["reason"]
    assert runs["dp"]["status"] == "ok" and runs["dp"]["scaling_note"] == "baseline skipped"
    assert "failed: ddp: micro-batch 16" in p.stdout
    assert_png(out / "bench.png")


def test_sigterm_stops_the_current_run_and_writes_what_was_measured(tmp_path):
    out = tmp_path / "s"
    cmd = job_cmd("bench", *SMALL, f"bench.out={out}", "bench.warmup=2", "bench.steps=100000", "strategies=[dp]")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    try:
        log = out / "logs" / "tiny-1proc.log"
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
    # The run got SIGTERM from the bench, checkpointed and exited 75; dp never started.
    assert runs["1proc"]["status"] == "interrupted" and runs["1proc"]["exit_code"] == 75
    assert runs["dp"]["status"] == "skipped" and "interrupted before" in runs["dp"]["reason"]
    assert "== bench tiny" in stdout


@pytest.mark.parametrize("args, message", [
    (["bench.warmup=0"], "bench.warmup=0 must be at least 1"),
    (["bench.steps=0"], "bench.steps=0 must be at least 1"),
    (["strategies=[]"], "bench.strategies is empty"),
    (["bench.workloads=[tiny,gpt5]"], "unknown workload `gpt5` in bench.workloads"),
    (["bench.scrape_interval_s=0"], "bench.scrape_interval_s=0.0 must be positive"),
    (["bench.stepz=3"], "did you mean `bench.steps`?"),
])
def test_bad_bench_input_is_one_line_exit_2(capsys, tmp_path, args, message):
    from job.__main__ import main

    assert main(["bench", f"bench.out={tmp_path / 'x'}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "x").exists()  # nothing started


def test_overrides_are_what_the_user_changed_against_the_workload_preset():
    cfg = load(["workload=lm", "strategy=dp", "train.amp=bf16", "workload.layers=2", "train.steps=7",
                "train.run_id=x", "bench.steps=3", "strategies=[dp]", "train.batch_size=16"])
    # train.batch_size=16 is lm's preset value: not an override. Bench keys and picks are not passed on.
    assert bench.user_overrides(cfg) == {"train.amp": "bf16", "workload.layers": 2}
    assert bench.user_overrides(load(["workload=resnet50"])) == {}


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
    assert bench._error_line(log) == line


def _gpu_doc() -> dict:
    """A 2-GPU result document shaped exactly like a real run's (no GPU here to make one)."""
    gb = 1024**3

    def card(rank, i, peak, reserved, used):
        return {"rank": rank, "device": f"cuda:{i}", "name": "NVIDIA H200", "uuid": f"GPU-{i:08d}-aaaa",
                "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0", "peak_allocated_bytes": int(peak * gb),
                "peak_reserved_bytes": int(reserved * gb), "nvml_used_bytes": int(used * gb),
                "nvml_total_bytes": 150 * gb}

    def run(name, kind, strategy, cards, world, sps, scaling=None, status="ok", reason=None):
        r = {"name": name, "kind": kind, "strategy": strategy, "status": status, "reason": reason,
             "exit_code": 0 if status == "ok" else 1, "command": ["python", "-m", "job", "train"], "env": {},
             "run_dir": "/x", "log": "/x.log", "wall_s": 30.0, "batch_size": 16, "world_size": world,
             "units": len(cards), "timed_steps": 50, "samples_per_s": sps, "units_per_s": sps * 1024,
             "step_s": 16 / sps, "trainer_samples_per_s": sps, "imbalance": None, "scaling_vs_1": scaling,
             "scaling_note": None, "cards": cards, "scrapes_ok": None, "scrapes_failed": None}
        if len(cards) > 1:
            peaks = [c["peak_allocated_bytes"] for c in cards]
            r["imbalance"] = max(peaks) / min(peaks)
        return r

    runs = [run("1gpu", "baseline", "ddp", [card(0, 0, 8.6, 9.0, 10.1)], 1, 330.0),
            run("dp", "strategy", "dp", [card(0, 0, 14.1, 15.0, 16.2), card(0, 1, 3.0, 3.5, 4.1)], 1, 96.0, 0.145),
            run("ddp", "strategy", "ddp", [card(0, 0, 8.3, 9.0, 10.0), card(1, 1, 8.3, 9.0, 10.0)], 2, 545.0, 0.826),
            run("balanced", "strategy", "balanced", [], 1, 1.0, status="failed",
                reason="torch.OutOfMemoryError: CUDA out of memory")]
    runs[-1].update(samples_per_s=None, units_per_s=None, step_s=None, trainer_samples_per_s=None)
    env = {"date": "2026-11-30T00:00:00+00:00", "hostname": "h", "command": "python -m job bench", "python": "3.11",
           "platform": "Linux", "cpu": "x", "cpu_count": 32, "torch": "2.11.0", "torch_cuda": "12.8", "cudnn": 91000,
           "driver": "570.1", "cuda_driver": "12.8", "gpu_model": "NVIDIA H200",
           "gpus": [{"name": "NVIDIA H200", "uuid": "GPU-1", "pci_bus_id": "00000000:18:00.0",
                     "memory_total_bytes": 150 * gb}], "cuda_visible_devices": None, "commit": "0" * 40,
           "commit_dirty": False}
    return {"schema": bench.SCHEMA_ID, "device": "cuda", "cards": 2,
            "settings": {"steps": 50, "warmup": 10, "strategies": ["dp", "ddp", "balanced"], "workloads": ["lm"],
                         "baseline": "ddp", "cpu_procs": 2, "overrides": {}, "out": "/x"},
            "environment": env, "workloads": [{"workload": "lm", "unit": "tok", "units_per_sample": 1024,
                                               "global_batch": 16, "cards": 2, "runs": runs,
                                               "telemetry_overhead": None}],
            "chart": None, "failed": 1}


def test_gpu_shaped_results_table_and_chart(tmp_path):
    doc = _gpu_doc()
    validate(doc)
    text = bench.table(doc, doc["workloads"][0])
    lines = text.splitlines()
    assert lines[0] == "== bench lm: global batch 16, 2 GPU(s), 10 warm-up + 50 timed steps"
    dp = next(x for x in lines if x.startswith("dp "))
    # per-card peak allocated / reserved / NVML used in MB, the busiest/least ratio, tok/s, scaling
    for cell in ("14,438 / 3,072", "15,360 / 3,584", "16,589 / 4,198", "4.70x", "98,304", "14.5%", "1/2"):
        assert cell in dp, (cell, dp)
    assert "2/2" in next(x for x in lines if x.startswith("ddp ")) and "82.6%" in text
    assert "baseline" in next(x for x in lines if x.startswith("1gpu "))
    assert "failed: torch.OutOfMemoryError: CUDA out of memory" in text
    bench.write_chart(doc, tmp_path / "c.png")
    assert_png(tmp_path / "c.png")


def test_schema_rejects_a_missing_or_mistyped_key():
    doc = _gpu_doc()
    del doc["workloads"][0]["runs"][0]["cards"][0]["peak_reserved_bytes"]
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)
    doc = _gpu_doc()
    doc["workloads"][0]["runs"][1]["samples_per_s"] = "96"
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


@pytest.mark.gpu
@pytest.mark.slow
@requires_gpus(2)
def test_bench_on_two_gpus(tmp_path):
    """The real thing, small: lm with 2 layers on the first 2 cards: dp piles up on card 0, ddp does not."""
    out = tmp_path / "g"
    args = ["workload=lm", "workload.layers=2", "train.amp=bf16", "bench.warmup=5", "bench.steps=10",
            f"bench.out={out}", "strategies=[dp,ddp]", "bench.telemetry_overhead=true"]
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
