"""job.torchrun: real torchrun (torch.distributed.run) on CPU, 2 gloo ranks, ending with the project's codes.

Plain torchrun exits 1 (a SignalException traceback) after the ranks checkpointed on SIGTERM, and dies of
SIGUSR2 (Slurm's signal before a time limit). The SIGTERM case through the multi-node manifest's own command
line is tests/infra/test_k8s_contract.py::test_multinode_sigterm_under_torchrun.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from _ports import free_port
from conftest import ROOT

from job import torchrun

TINY = ["workload=tiny", "workload.width=8", "workload.image_size=16", "train.batch_size=8", "train.log_every=1",
        "strategy=ddp", "train.device=cpu"]


def launcher(tmp_path, *train_args: str) -> list[str]:
    return [sys.executable, "-m", "job.torchrun", "--nproc-per-node=2", "--nnodes=1", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "job", "train", *TINY, f"train.run_dir={tmp_path}/runs",
            "train.run_id=tr", *train_args]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize(("codes", "world", "all_needed", "want"), [
    ({0: 75, 1: 75}, 2, True, 75),
    ({0: 75, 1: 0}, 2, True, 75),      # one rank had just finished its last step
    ({0: 75}, 2, True, 143),            # rank 1 never said: killed after the shutdown timeout, maybe mid-write
    ({0: 2, 1: 2}, 2, False, 2),        # a config error on every rank
    ({0: 2}, 2, False, 2),              # rank 0 refused; torchrun then stopped rank 1
    ({0: 1, 1: 75}, 2, False, 1),       # a crash stays a crash
    ({}, None, False, 1),
])
def test_outcome(codes, world, all_needed, want):
    fallback = 143 if all_needed else 1
    assert torchrun.outcome(codes, world, fallback=fallback, all_needed=all_needed) == want


def test_workers_torchrun_ended_itself_say_nothing():
    """Rank 0 refused (exit 2) while rank 1 was still loading its config: torchrun's SIGTERM killed rank 1
    (-15, its handlers not installed yet). The launcher's 2 comes from rank 0 alone."""
    assert torchrun.consequences_dropped({0: 2, 1: -15}) == {0: 2}
    assert torchrun.consequences_dropped({0: 1, 1: -9}) == {0: 1}
    assert torchrun.consequences_dropped({0: -9, 1: -15}) == {0: -9, 1: -15}  # nobody exited by itself
    assert torchrun.outcome(torchrun.consequences_dropped({0: 2, 1: -15}), None, fallback=1, all_needed=False) == 2


def test_signals_are_added_before_the_entry_point_only():
    assert torchrun._with_signals(["--nproc-per-node=2", "-m", "job", "train"])[0] == \
        f"--signals-to-handle={torchrun.SIGNALS}"
    mine = ["--signals-to-handle=SIGTERM", "-m", "job", "train"]
    assert torchrun._with_signals(mine) == mine
    # an option of the trainer's named like torchrun's is the trainer's business
    assert torchrun._with_signals(["-m", "job", "train", "--signals-to-handle=x"])[0].startswith("--signals-to")


@pytest.mark.slow
def test_sigusr2_checkpoints_and_exits_75(tmp_path):
    """SIGUSR2 to the launcher (what Slurm's --signal=USR2@... sends before the time limit): torchrun forwards
    it, both ranks stop at the same step, rank 0 checkpoints, the launcher exits 75 with one line of its own
    (no traceback). Resuming from that checkpoint is every other resume test's path."""
    log = tmp_path / "first.log"
    with log.open("w") as out:
        proc = subprocess.Popen(launcher(tmp_path, "train.steps=100000"), stdout=out, stderr=subprocess.STDOUT,
                                env=ENV, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while not re.search(r"^step [2-9]\d*/", log.read_text(), re.M):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR2)
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert rc == 75, text[-3000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    m = re.search(r"^stopped at step (\d+); checkpoint written; exit 75$", text, re.M)
    assert m and "[rank1] stopped at step" in text, text[-3000:]
    assert text.rstrip().endswith(": exit 75 (stopped after a checkpoint)"), text[-1000:]
    assert (tmp_path / "runs" / "tr" / "checkpoints" / f"step_{int(m.group(1)):08d}.pt").is_file()


@pytest.mark.slow
def test_bad_input_on_every_rank_exits_2(tmp_path):
    """Every rank refuses the same config: plain torchrun says 1 (a crash); the launcher says 2."""
    r = subprocess.run(launcher(tmp_path, "train.steps=3", "train.bogus=1"), capture_output=True, text=True,
                       env=ENV, cwd=tmp_path, timeout=180)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text[-3000:]
    assert "error: unknown key `train.bogus`" in text and text.rstrip().endswith(": exit 2 (bad input)"), text[-2000:]
