"""The trainer end to end on CPU, through the real entry point: equivalences, interruption, bad state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from _train_helpers import SMALL, assert_same_weights, final_model, train, wait_for_step
from conftest import ROOT, job_cmd


def test_run_writes_run_dir_and_table(tmp_path):
    p = train(tmp_path, "r", "strategy=dp", "train.steps=10")
    assert p.returncode == 0, p.stderr
    assert "no CUDA cards visible" in p.stdout and "throughput:" in p.stdout
    run = tmp_path / "r"
    assert (run / "config.yaml").read_text().count("batch_size") >= 1
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [5, 10]
    assert all(x["loss"] > 0 and x["samples_per_s"] > 0 for x in lines)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["samples_per_s"] > 0
    assert final_model(tmp_path, "r")["step"] == 10


@pytest.mark.parametrize("steps,warmup,window,timed", [
    (1, -1, [0, 1], False),  # the default warm-up of a 1-step run is that step: peaks of it, no throughput
    (3, 5, [1, 3], False),   # all warm-up: peaks after the first step (the plan's check), no throughput
    (3, 0, [0, 3], True),    # no warm-up: peaks and throughput of every step
    (12, -1, [1, 12], True),  # the default: one warm-up step in 12
])
def test_peak_window_and_throughput_of_short_runs(tmp_path, steps, warmup, window, timed):
    """The per-card peaks cover the steps the table says (summary.json's peak_window), never a window that
    starts after the last step; a run that was all warm-up says it has no throughput instead of 0."""
    p = train(tmp_path, "r", "strategy=dp", f"train.steps={steps}", f"train.timing_warmup={warmup}")
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["peak_window"] == window
    assert f"; peaks over steps {window[0] + 1}-{window[1]}\n" in p.stdout, p.stdout
    line = next(x for x in p.stdout.splitlines() if x.startswith("throughput: "))
    if timed:
        assert summary["samples_per_s"] > 0 and line.endswith(" img/s"), line
    else:
        assert summary["samples_per_s"] is None and summary["img_per_s"] is None
        assert line == ("throughput: n/a (every step of this run was warm-up, which the throughput leaves out: "
                        "run more steps, or lower train.timing_warmup)")


def test_cpu_runs_are_bit_reproducible(tmp_path):
    for rid in ("a", "b"):
        assert train(tmp_path, rid, "strategy=dp", "train.steps=8").returncode == 0
    assert_same_weights(final_model(tmp_path, "a")["model"], final_model(tmp_path, "b")["model"], exact=True)


def test_accumulation_equals_one_big_batch(tmp_path):
    """4 micro-batches of 8 == one batch of 32: same samples, same mean loss, same update."""
    common = ["strategy=dp", "train.steps=6", "train.batch_size=32", "train.optimizer=sgd", "train.momentum=0"]
    assert train(tmp_path, "big", *common, "train.accum_steps=1").returncode == 0
    p = train(tmp_path, "acc", *common, "train.accum_steps=4")
    assert p.returncode == 0, p.stderr
    assert_same_weights(final_model(tmp_path, "big")["model"], final_model(tmp_path, "acc")["model"], exact=False)


@pytest.mark.parametrize("accum", [1, 2], ids=["plain", "accum2"])
def test_ddp_two_processes_equal_one_process(tmp_path, accum):
    common = ["train.steps=6", "train.batch_size=16", f"train.accum_steps={accum}"]
    assert train(tmp_path, "one", "strategy=dp", *common).returncode == 0
    p = train(tmp_path, "two", "strategy=ddp", "strategy.nprocs=2", *common)
    assert p.returncode == 0, p.stderr
    assert "ddp: started 2 ranks" in p.stderr
    assert_same_weights(final_model(tmp_path, "one")["model"], final_model(tmp_path, "two")["model"], exact=False)



@pytest.mark.parametrize("strategy,sig", [("dp", signal.SIGTERM), ("ddp", signal.SIGUSR1)], ids=["dp-term", "ddp-usr1"])
def test_interrupt_resume_equals_uninterrupted(tmp_path, strategy, sig):
    args = [f"strategy={strategy}", "train.steps=60", "train.checkpoint_every=0", "train.batch_size=16"]
    if strategy == "ddp":
        args.append("strategy.nprocs=2")
    assert train(tmp_path, "full", *args).returncode == 0

    cmd = job_cmd("train", *SMALL, f"train.run_dir={tmp_path}", "train.run_id=cut", *args)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(tmp_path / "cut" / "metrics.jsonl", 10, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    stopped = final_model(tmp_path, "cut")
    assert 10 <= stopped["step"] < 60, stopped["step"]
    assert stopped["data_position"] == stopped["step"]

    p = train(tmp_path, "cut", *args)  # the same command again resumes (train.resume=auto)
    assert p.returncode == 0, p.stderr
    assert f"resumed from {tmp_path / 'cut' / 'checkpoints'}" in p.stderr
    steps = [json.loads(x)["step"] for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)), "a step was logged twice"
    assert_same_weights(final_model(tmp_path, "full")["model"], final_model(tmp_path, "cut")["model"],
                        exact=strategy == "dp")


def test_corrupt_checkpoint_is_refused_and_kept(tmp_path):
    assert train(tmp_path, "c", "strategy=dp", "train.steps=4").returncode == 0
    ck = sorted((tmp_path / "c" / "checkpoints").glob("step_*.pt"))[-1]
    ck.write_bytes(b"not a checkpoint")
    p = train(tmp_path, "c", "strategy=dp", "train.steps=8")
    assert p.returncode == 2
    assert "is corrupt or not a checkpoint" in p.stderr and "Traceback" not in p.stderr
    assert ck.read_bytes() == b"not a checkpoint"
    assert sorted((tmp_path / "c" / "checkpoints").glob("step_*.pt")) == [ck]


def test_incompatible_checkpoint_is_refused(tmp_path):
    assert train(tmp_path, "w", "strategy=dp", "train.steps=4").returncode == 0
    before = final_model(tmp_path, "w")
    p = train(tmp_path, "w", "strategy=dp", "train.steps=8", "workload.width=16")
    assert p.returncode == 2 and "does not fit this model" in p.stderr, p.stderr
    assert_same_weights(before["model"], final_model(tmp_path, "w")["model"], exact=True)


def test_resume_is_strategy_independent(tmp_path):
    """A checkpoint written by ddp (2 ranks) resumes under dp: the state is unwrapped."""
    assert train(tmp_path, "x", "strategy=ddp", "strategy.nprocs=2", "train.steps=4", "train.batch_size=16").returncode == 0
    p = train(tmp_path, "x", "strategy=dp", "train.steps=6", "train.batch_size=16")
    assert p.returncode == 0, p.stderr
    assert "resumed from" in p.stderr and final_model(tmp_path, "x")["step"] == 6


def test_missing_data_path_and_bad_visible_devices(tmp_path):
    p = train(tmp_path, "d", "data.kind=imagefolder", f"data.path={tmp_path / 'none'}")
    assert p.returncode == 2 and "does not exist" in p.stderr
    p = train(tmp_path, "d", env={"CUDA_VISIBLE_DEVICES": "0,0"})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr


def test_imagefolder_data(tmp_path):
    from PIL import Image

    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (20, 20), (i * 40, 100 if cls == "cat" else 0, 50)).save(tmp_path / "imgs" / cls / f"{i}.png")
    p = train(tmp_path, "img", "strategy=dp", "train.steps=5", "train.batch_size=4", "data.kind=imagefolder",
              f"data.path={tmp_path / 'imgs'}", "workload.num_classes=2", "data.workers=1")
    assert p.returncode == 0, p.stderr


def test_amp_and_activation_checkpointing_on_cpu(tmp_path):
    p = train(tmp_path, "amp", "strategy=dp", "train.steps=4", "train.amp=bf16", "train.activation_checkpointing=true")
    assert p.returncode == 0, p.stderr
    p = train(tmp_path, "ac", "strategy=dp", "train.steps=4", "train.activation_checkpointing=false")
    assert p.returncode == 0, p.stderr


def test_make_run_prints_the_table():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    p = subprocess.run(["make", "run", "ARGS=train.run_dir=" + str(ROOT / "runs" / "test-make-run"),
                        f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "per-card memory" in p.stdout and "throughput:" in p.stdout


@pytest.mark.parametrize("cores,load,threads", [(2, 0.3, 2), (2, 1.5, 1), (2, 6.0, 1), (16, 0.0, 4), (8, 6.5, 2)])
def test_cpu_runs_use_the_cores_that_are_not_busy(monkeypatch, cores, load, threads):
    from job import train as train_mod

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert train_mod._cpu_threads() == threads


@pytest.mark.parametrize("allowed,machine,load,threads", [(2, 64, 0.0, 2), (2, 64, 40.0, 2), (8, 64, 6.5, 4),
                                                          (2, 4, 3.5, 1), (1, 64, 0.0, 1)])
def test_cpu_runs_use_no_more_threads_than_the_cpus_they_may_use(monkeypatch, allowed, machine, load, threads):
    """Held to `allowed` of a machine's CPUs (taskset, a Slurm cpuset): never more threads than those; the load
    average is the machine's, so it counts against the machine's cores, not against the cpuset's."""
    from job import train as train_mod

    monkeypatch.setattr(os, "cpu_count", lambda: machine)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(allowed)))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert train_mod._cpu_threads() == threads


def test_final_checkpoint_off_writes_none_but_finishes(tmp_path):
    p = train(tmp_path, "nock", "strategy=dp", "train.steps=4", "train.checkpoint_every=0", "train.final_checkpoint=false")
    assert p.returncode == 0, p.stderr
    assert not list((tmp_path / "nock").glob("checkpoints/step_*.pt"))
    assert json.loads((tmp_path / "nock" / "summary.json").read_text())["steps"] == 4


def test_a_training_thread_that_waits_for_a_core_is_said_in_one_line_and_summary_json(tmp_path):
    """A run sharing its one core with a busy process: its training thread is ready to run but waits for the
    core much of the time, which summary.json and metrics.jsonl record (the kernel's scheduler statistics) and
    the run's last lines say, naming what to change; the same run alone says nothing of it."""
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("no scheduler statistics (/proc/thread-self/schedstat) on this kernel")
    core = min(os.sched_getaffinity(0))
    pin = lambda: os.sched_setaffinity(0, {core})  # noqa: E731
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    try:
        cmd = job_cmd("train", *SMALL, f"train.run_dir={tmp_path}", "train.run_id=r", "train.steps=60",
                      "train.log_every=20")
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, preexec_fn=pin)
    finally:
        hog.kill()
        hog.wait()
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    waited, ran = summary["train_thread_waited_for_core"], summary["train_thread_on_core"]
    assert 0.2 <= waited <= 1.0 and 0.0 < ran <= 1.0 and waited + ran <= 1.05, summary
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    seconds = [x["train_thread_s"] for x in lines]
    assert all(len(s) == 2 for s in seconds) and all(b[0] >= a[0] and b[1] >= a[1] for a, b in zip(seconds, seconds[1:]))
    # no card: no idle time between steps to measure (tests/gpu measures a card's), and no field pretending one
    assert summary["card_idle_between_steps"] is None and not any("card_gaps" in x for x in lines)
    said = [x for x in (p.stdout + p.stderr).splitlines() if "host: the training thread waited for a free core" in x]
    assert len(said) == 1 and f"{waited:.0%} of the timed steps" in said[0], p.stdout + p.stderr
    assert "on the 1 core it may use" in said[0] and "give the run cores of its own" in said[0]
