"""Real CPU training runs serving /metrics: one process (dp) and two ranks (ddp) in one scrape, promtool's
check, /health, SIGTERM on the way out; and scrapes without pause that must not crash the run.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
from _telemetry_helpers import free_port, get, has_samples, named, samples, stop, wait_for
from conftest import ROOT, job_cmd, need_binary

SMALL = ["workload=tiny", "workload.width=8", "workload.image_size=16", "train.device=cpu",
         "train.batch_size=8", "train.log_every=5", "train.checkpoint_every=0"]


# -- real CPU training runs ---------------------------------------------------------------------


def _start_training(tmp_path: Path, port: int, *args: str) -> subprocess.Popen:
    cmd = job_cmd("train", *SMALL, f"train.run_dir={tmp_path}", "train.run_id=tel", "train.steps=100000",
                  f"telemetry.port={port}", f"telemetry.peer_dir={tmp_path / 'peers'}", *args)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("strategy, ranks", [("dp", {"0"}), ("ddp", {"0", "1"})])
def test_cpu_training_run_serves_metrics(tmp_path, strategy, ranks):
    promtool = need_binary("promtool", "apt-get install prometheus")
    port = free_port()
    extra = ["strategy.nprocs=2"] if strategy == "ddp" else []
    proc = _start_training(tmp_path, port, f"strategy={strategy}", *extra)
    try:
        text = wait_for(f"http://127.0.0.1:{port}/metrics", has_samples(ranks), proc)
        for lab in named(text, "trainjob_samples_total"):
            assert lab | {"strategy": strategy, "run": "tel", "uuid": ""} == lab
        infos = named(text, "trainjob_info")
        assert {d["rank"] for d in infos} == ranks
        assert all(d["workload"] == "tiny" and d["batch_size"] == "8" for d in infos)
        assert named(text, "trainjob_step_seconds_count")
        # The memory plan per card/rank: dp's one process holds the batch of 8; ddp's two ranks 4 each.
        plan = {dict(lab)["rank"]: v for (n, lab), v in samples(text).items() if n == "trainjob_plan_samples"}
        assert plan == ({"0": 8.0} if strategy == "dp" else {"0": 4.0, "1": 4.0}), plan
        assert {d["uuid"] for d in named(text, "trainjob_plan_samples")} == {"cpu"}  # legends name the card
        code, health = get(f"http://127.0.0.1:{port}/health")  # default telemetry.stall_s: healthy while training
        assert code == 200 and json.loads(health)["status"] == "ok" and json.loads(health)["stall_s"] == 1800
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        rc = stop(proc)
    assert rc == 75, proc.stdout.read()  # SIGTERM: checkpoint, exit 75
    assert not list((tmp_path / "peers").rglob("*.json"))  # ranks unregistered on the way out
    assert not list((tmp_path / "peers").iterdir())  # and the job's folder removed


def test_scrapes_without_pause_while_training_do_not_crash_the_run(tmp_path):
    """Three clients scraping a CPU run back to back: the memory breakdown read the gradients from the scrape's
    thread while backward assigned them, and the run died of SIGSEGV within seconds. Now the thread that trains
    measures it: the run keeps training, every scrape has the breakdown, SIGTERM still checkpoints."""
    port = free_port()
    proc = _start_training(tmp_path, port, "strategy=dp", "train.log_every=1000")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_for(url, has_samples({"0"}), proc)
        counts, errors = [0, 0, 0], []
        deadline = time.monotonic() + 15

        def scrape(k: int) -> None:
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    code, text = get(url)
                except OSError as e:
                    errors.append(repr(e))
                    return
                if code != 200 or "trainjob_memory_breakdown_bytes{" not in text:
                    errors.append(f"{code}: {text[:200]}")
                    return
                counts[k] += 1

        threads = [threading.Thread(target=scrape, args=(k,)) for k in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert proc.poll() is None, f"the run died (exit {proc.returncode}) after {sum(counts)} scrapes"
        assert not errors and min(counts) > 0, (errors, counts)
    finally:
        rc = stop(proc)
    assert rc == 75, proc.stdout.read()
