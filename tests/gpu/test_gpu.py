"""Trainer behaviour on real cards (run on the lent 2xH200 machine; skipped without CUDA)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from conftest import ROOT, job_cmd, requires_gpus

pytestmark = pytest.mark.gpu


def _train(tmp_path, run_id, *args, timeout=600, env=None):
    p = subprocess.run(job_cmd("train", f"train.run_dir={tmp_path}", f"train.run_id={run_id}", *args),
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-4000:]
    return p, json.loads((tmp_path / run_id / "summary.json").read_text())


@requires_gpus(2)
def test_dp_avoids_the_cudnn_trap_and_shows_the_pile_up(tmp_path):
    p, summary = _train(tmp_path, "dp", "strategy=dp", "workload=lm", "workload.layers=2", "train.steps=6",
                        "train.amp=bf16")
    assert "turned cudnn.benchmark off" in p.stderr
    assert len(summary["cards"]) == 2 and "per-card memory: dp" in p.stdout
    # Stock DataParallel gathers the logits on GPU 0: it must be the busiest card by far.
    peaks = [c["peak_allocated_bytes"] for c in summary["cards"]]
    assert peaks[0] > 1.5 * peaks[1], peaks
    print(p.stdout)


@requires_gpus(2)
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_ddp_two_cards_matches_single_card(tmp_path, amp):
    common = ["workload=tiny", "train.steps=8", "train.batch_size=32", f"train.amp={amp}", "train.cudnn_benchmark=false"]
    _train(tmp_path, "one", "strategy=dp", *common, env={"CUDA_VISIBLE_DEVICES": "0"})
    p, two = _train(tmp_path, "two", "strategy=ddp", *common)
    assert two["world_size"] == 2 and {c["device"] for c in two["cards"]} == {"cuda:0", "cuda:1"}
    a = torch.load(sorted((tmp_path / "one" / "checkpoints").glob("*.pt"))[-1], weights_only=False)["model"]
    b = torch.load(sorted((tmp_path / "two" / "checkpoints").glob("*.pt"))[-1], weights_only=False)["model"]
    tol = 2e-2 if amp == "fp16" else 5e-2
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), atol=tol, rtol=tol, msg=k)


@requires_gpus(1)
def test_switches_compose_on_gpu(tmp_path):
    _, s = _train(tmp_path, "sw", "strategy=balanced", "workload=resnet50", "workload.image_size=64",
                  "train.batch_size=32", "train.steps=4", "train.amp=bf16", "train.channels_last=true",
                  "train.activation_checkpointing=true", "train.accum_steps=2")
    assert s["steps"] == 4


@requires_gpus(1)
def test_a_loss_that_turns_nan_between_log_steps_says_where_it_was_last_finite(tmp_path):
    """A GPU run reads its loss at log steps only: a NaN at step 5 is seen at step 8, and the one line says
    the loss was last seen finite at step 4 and why it was not seen earlier; nothing is written over."""
    p = subprocess.run(job_cmd("train", f"train.run_dir={tmp_path}", "train.run_id=nan", "workload=tiny",
                               "train.steps=12", "train.log_every=4", "train.checkpoint_every=0"),
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "JOB_FAULT": "0:5:nan"})
    assert p.returncode == 1, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr[-3000:]
    assert ("no longer finite at step 8 (rank 0; last seen finite at step 4: a GPU run reads the loss every "
            "train.log_every=4 steps)") in errors[0], errors[0]
    assert not (tmp_path / "nan" / "checkpoints").exists() or not any((tmp_path / "nan" / "checkpoints").iterdir())


@requires_gpus(2)
@pytest.mark.parametrize("amp,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dp_replicas_run_in_the_autocast_dtype(amp, dtype):
    """Stock DataParallel ran a bf16 autocast's replicas in fp16; dp runs them in the run's precision."""
    from omegaconf import OmegaConf

    from job.config import StrategyCfg
    from job.precision import Precision
    from job.strategies.dp import DataParallelStrategy

    model = torch.nn.Linear(16, 8).cuda(0)
    s = DataParallelStrategy(OmegaConf.structured(StrategyCfg(name="dp")),
                             devices=[torch.device("cuda", 0), torch.device("cuda", 1)],
                             precision=Precision(amp, "cuda"))
    s.check(micro_batch=8)
    s.setup(model, lambda out, y, reduction="mean": out.float().mean())
    seen = []
    model.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    with torch.autocast("cuda", dtype=dtype):
        out = s.forward(torch.randn(8, 16, device="cuda:0"))
    assert out.dtype == dtype and seen == [dtype, dtype], (out.dtype, seen)


@requires_gpus(2)
def test_balanced_batchnorm_and_clipping_on_two_cards(tmp_path):
    """resnet50 (BatchNorm) with card 0 training nothing: statistics kept, clipping on, replicas checked."""
    _, s = _train(tmp_path, "bn", "strategy=balanced", "workload=resnet50", "workload.image_size=64",
                  "train.batch_size=16", "train.steps=4", "strategy.gpu0_batch=0", "train.grad_clip=1.0",
                  "strategy.check_replicas_every=2")
    state = torch.load(sorted((tmp_path / "bn" / "checkpoints").glob("*.pt"))[-1], weights_only=False)["model"]
    assert int(state["bn1.num_batches_tracked"]) == 4 and state["bn1.running_mean"].abs().sum() > 0
