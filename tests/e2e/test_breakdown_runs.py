"""The memory breakdown through the trainer: a CPU run's summary counts its tensors and says it has no card;
fsdp's ranks each report their own shards.
"""

from __future__ import annotations

import json

from _breakdown_helpers import built, nbytes
from _train_helpers import final_model, train

from job import breakdown

# -- through the trainer --------------------------------------------------------------------------------

def test_cpu_run_reports_its_tensors_and_says_it_has_no_card(tmp_path):
    p = train(tmp_path, "r", "strategy=dp", "train.steps=2", "train.log_every=1")
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    (row,) = summary["memory_breakdown"]
    state = final_model(tmp_path, "r")
    weights = sum(t.numel() * t.element_size() for t in state["model"].values())  # parameters and buffers
    momentum = sum(s["momentum_buffer"].numel() * 4 for s in state["optimizer"]["state"].values())  # SGD: one each
    assert row["kinds"]["parameters"] == weights and row["kinds"]["gradients"] == momentum
    assert row["kinds"]["optimizer_state"] == momentum and row["kinds"]["activations"] is None
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["memory_breakdown"][0]["kinds"]["parameters"] for r in records] == [weights, weights]
    out = p.stdout[p.stdout.index("memory by kind"):].splitlines()
    assert out[0] == "memory by kind, GB (10^9 bytes), at the peak of steps 2-2 (docs/memory-breakdown.md)"
    assert out[1].split() == ["rank", "device", "params", "grads", "optimizer"] and out[3].split()[:2] == ["0", "cpu"]
    assert breakdown.NO_CARD in out


def test_fsdp_ranks_each_report_their_shards(tmp_path):
    """Two gloo ranks: each holds about half of every parameter, gradient and AdamW state, and one process's
    run holds all of it."""
    lm = ["workload=lm", "workload.layers=2", "workload.d_model=32", "workload.heads=2", "workload.vocab=128",
          "workload.seq_len=16", "train.steps=1", "train.batch_size=4", "train.optimizer=adamw"]
    p = train(tmp_path, "fsdp", "strategy=fsdp", "strategy.nprocs=2", *lm)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "fsdp" / "summary.json").read_text())["memory_breakdown"]
    assert [r["rank"] for r in rows] == [0, 1]
    model, _ = built("workload=lm", "workload.layers=2", "workload.d_model=32", "workload.heads=2",
                      "workload.vocab=128", "workload.seq_len=16")
    weights = nbytes(model.parameters()) + nbytes(model.buffers())  # parameters() gives the tied embedding once
    params = [r["kinds"]["parameters"] for r in rows]
    grads = [r["kinds"]["gradients"] for r in rows]
    assert weights <= sum(params) <= 1.05 * weights and max(params) < 0.6 * weights  # shards, padded
    assert max(grads) < 0.6 * weights and sum(grads) >= 0.9 * weights
    for r in rows:
        assert 1.9 * r["kinds"]["gradients"] <= r["kinds"]["optimizer_state"] <= 2.1 * r["kinds"]["gradients"] + 1000
