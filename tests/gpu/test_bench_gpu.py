"""`python -m job bench` on real GPUs: compare, maxbatch with a tenant, the dp profile on 2; on 1, what the
card runs beside the model (marked, skipped without the cards).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _bench_helpers import assert_png, runs_by_name, validate
from conftest import ROOT, job_cmd, requires_gpus


def visible(cards: str) -> dict[str, str]:
    """This environment with CUDA_VISIBLE_DEVICES, `cards` where it is unset."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", cards)}


def bench(args: list[str], *, cards: str = "0,1", timeout: int = 900) -> subprocess.CompletedProcess:
    """`python -m job bench ARGS` on the cards of CUDA_VISIBLE_DEVICES (default `cards`); it must succeed."""
    p = subprocess.run(job_cmd("bench", *args), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env=visible(cards))
    assert p.returncode == 0, p.stdout + p.stderr
    return p


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
    bench(args)
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
    p = bench(args, timeout=3000)
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
                          capture_output=True, text=True, env=visible("0,1"), check=True,
                          timeout=120).stdout
    assert int(free) > tenant * 1e9
    assert_png(out / "bench.png")


@pytest.mark.gpu
@pytest.mark.slow
@requires_gpus(2)
def test_profile_dp_on_two_gpus(tmp_path):
    out = tmp_path / "pg"
    args = ["bench.mode=profile", "strategies=[dp]", "workload=lm", "workload.layers=2", "train.amp=bf16",
            "bench.warmup=3", "bench.profile_steps=3", f"bench.out={out}"]
    bench(args)
    (prof,) = json.loads((out / "bench.json").read_text())["workloads"][0]["profiles"]
    phases = {ph["name"]: ph for ph in prof["phases"]}
    for name in ("scatter", "replicate", "parallel_apply", "gather", "loss", "backward", "optimizer"):
        assert phases[name]["calls"] == 3 and phases[name]["ms_per_step"] > 0, name
    assert prof["sort_by"] == "self_cuda_ms" and prof["top_ops"][0]["self_cuda_ms"] > 0
    assert "replicate" in (out / "profile-lm-dp.txt").read_text()


@pytest.mark.gpu
@pytest.mark.slow
@requires_gpus(1)
def test_profile_says_what_the_card_runs_beside_the_model(tmp_path):
    """One card, ddp (one process), JPEGs decoded there on data.prefetch's thread, no phase syncs: the card
    figures hold the model's stream and at least one more (the prefetch thread's copies and crops, nvJPEG's),
    the busy union between the busiest stream and the sum of them all, and within the step."""
    from job.bench.imagefolder import image_folder

    folder = image_folder(tmp_path / "imgs", 300)
    out = tmp_path / "pc"
    args = ["bench.mode=profile", "strategies=[ddp]", "workload=resnet50", "train.amp=bf16",
            "train.batch_size=64", "data.kind=imagefolder", f"data.path={folder['path']}", "data.workers=2",
            "data.decode=gpu", "data.prefetch=true", "bench.warmup=5", "bench.profile_steps=5",
            "bench.profile_phases=false", f"bench.out={out}"]
    bench(args, cards="0")
    doc = json.loads((out / "bench.json").read_text())
    validate(doc, required=False)
    (prof,) = doc["workloads"][0]["profiles"]
    card = prof["card"]
    assert prof["phases_timed"] is False and prof["phases"] == [] and card is not None
    streams = card["streams"]
    assert len(streams) >= 2, streams
    total = sum(s["ms_per_step"] for s in streams)
    assert streams[0]["ms_per_step"] <= card["busy_ms"] <= total + 1e-6
    assert card["busy_ms"] <= prof["step_ms"] * 1.02 and card["main_beside_ms"] <= streams[0]["ms_per_step"]
    assert "the busiest stream" in (out / "profile-resnet50-ddp.txt").read_text()
