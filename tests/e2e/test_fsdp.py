"""`fsdp` (FSDP2 fully_shard) through the real entry point: 2 gloo ranks on the CPU against one process,
checkpoints that move between fsdp, ddp and one process, refusals; on 2 GPUs, the per-card memory it saves."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch
from _train_helpers import SMALL, assert_same_weights, final_model, train, wait_for_step
from conftest import ROOT, job_cmd, requires_gpus

# A small decoder LM: tied embedding/head, transformer blocks as sharding units, AdamW (the lm preset).
LM = ["workload=lm", "workload.layers=2", "workload.d_model=32", "workload.heads=2", "workload.vocab=128",
      "workload.seq_len=16", "train.lr=1e-3"]


def run(tmp, run_id, *args):
    p = train(tmp, run_id, *args)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def assert_same_optimizer(a: dict, b: dict) -> None:
    """Same shape as one process's optimizer.state_dict(): integer ids, same groups, close values."""
    assert sorted(a["state"]) == sorted(b["state"]) == list(range(len(a["state"])))
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]]
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys(), i
        for k in a["state"][i]:
            torch.testing.assert_close(a["state"][i][k], b["state"][i][k], atol=1e-5, rtol=1e-4, msg=f"{i}.{k}")


@pytest.mark.parametrize("case", [
    # SGD with momentum, accumulation over 2 micro-steps, clipping far below the gradient's norm (a norm
    # taken over one rank's shards only would clip differently).
    ["workload=tiny", "train.accum_steps=2", "train.grad_clip=0.01"],
    # The LM: tied weights in the root unit, blocks under activation checkpointing, uneven explicit shares.
    [*LM, "train.activation_checkpointing=true", "strategy.split=3,5", "train.grad_clip=0.05"],
], ids=["tiny-accum2-clip", "lm-ac-uneven-clip"])
def test_fsdp_two_ranks_equal_one_process(tmp_path, case):
    common = ["train.steps=5", "train.batch_size=8", "train.checkpoint_every=0", *case]
    one_args = [a for a in common if not a.startswith("strategy.split")]
    run(tmp_path, "one", "strategy=dp", *one_args)
    p = run(tmp_path, "two", "strategy=fsdp", "strategy.nprocs=2", *common)
    assert "fsdp: started 2 ranks" in p.stderr and "sharding units + the root over 2 ranks" in p.stderr
    one, two = final_model(tmp_path, "one"), final_model(tmp_path, "two")
    assert two["world_size"] == 2 and all(not getattr(t, "is_meta", False) for t in two["model"].values())
    assert_same_weights(one["model"], two["model"], exact=False)
    assert_same_optimizer(one["optimizer"], two["optimizer"])
    if "strategy.split=3,5" in case:
        assert "memory plan (explicit): samples per micro-batch [3, 5] of 8" in p.stderr


def test_bf16_through_fsdps_policy_follows_one_process_autocast(tmp_path):
    """bf16 weights in compute (FSDP's policy), float32 master state: the losses follow one process under bf16
    autocast, and the checkpoint holds float32 weights, as one process's does."""
    common = [*LM, "train.steps=6", "train.batch_size=8", "train.amp=bf16", "train.log_every=2"]
    run(tmp_path, "one", "strategy=dp", *common)
    p = run(tmp_path, "two", "strategy=fsdp", "strategy.nprocs=2", *common)
    assert "all-gathered in bf16, gradients reduced in float32" in p.stderr

    def losses(run_id):
        return [json.loads(x)["loss"] for x in (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("two")) == 3
    torch.testing.assert_close(losses("two"), losses("one"), rtol=2e-3, atol=0)
    weights = final_model(tmp_path, "two")["model"]
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert weights.keys() == final_model(tmp_path, "one")["model"].keys()


def test_built_in_blocks_are_the_sharding_units_and_recompute_keeps_the_keys():
    import torch

    from job import config, recompute

    for name, count in (("tiny", 3), ("resnet50", 4), ("lm", 6)):
        cfg = config.load([f"workload={name}"])
        spec, settings = config.workload_of(cfg).workload, config.workload_settings(cfg)
        with torch.device("meta"):
            model = spec.model(settings)
        keys = list(model.state_dict())
        units = spec.blocks(model)
        assert len(units) == count, name
        assert recompute.checkpoint_blocks(units) == count
        # Recomputed blocks change class, not the module tree: checkpoints are the same with and without.
        assert all(type(u).__name__.startswith("Recomputed") for u in spec.blocks(model)), name
        assert list(model.state_dict()) == keys, name


def test_checkpoints_move_between_fsdp_ddp_and_one_process(tmp_path):
    """fsdp -> ddp -> fsdp -> one process, resuming each time, equals one process trained straight through."""
    common = [*LM, "train.batch_size=8", "train.checkpoint_every=0"]
    run(tmp_path, "straight", "strategy=dp", *common, "train.steps=8")
    chain = [("fsdp", 2), ("ddp", 4), ("fsdp", 6), ("dp", 8)]
    for strategy, steps in chain:
        procs = ["strategy.nprocs=2"] if strategy != "dp" else []
        p = run(tmp_path, "chain", f"strategy={strategy}", *procs, *common, f"train.steps={steps}")
        if steps > 2:
            assert f"resumed from {tmp_path / 'chain' / 'checkpoints'}" in p.stderr, p.stderr
        saved = final_model(tmp_path, "chain")
        assert saved["step"] == steps
    straight = final_model(tmp_path, "straight")
    assert_same_weights(straight["model"], saved["model"], exact=False)
    assert_same_optimizer(straight["optimizer"], saved["optimizer"])


def test_stopped_fsdp_run_checkpoints_and_resumes_to_the_same_weights(tmp_path):
    """SIGTERM: every rank finishes its step, the gathered checkpoint is written, exit 75; the same command
    resumes and ends where an uninterrupted run ends."""
    args = ["strategy=fsdp", "strategy.nprocs=2", "train.steps=40", "train.checkpoint_every=0", "train.batch_size=16"]
    run(tmp_path, "full", *args)
    cmd = job_cmd("train", *SMALL, f"train.run_dir={tmp_path}", "train.run_id=cut", *args)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(tmp_path / "cut" / "metrics.jsonl", 10, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    assert 10 <= final_model(tmp_path, "cut")["step"] < 40
    p = run(tmp_path, "cut", *args)
    assert "resumed from" in p.stderr
    assert_same_weights(final_model(tmp_path, "full")["model"], final_model(tmp_path, "cut")["model"], exact=False)


@pytest.mark.parametrize("args,words", [
    (["strategy.nprocs=1"], "fsdp shards the model over several processes"),
    (["strategy.nprocs=2", "strategy.gpu0_batch=3"], "strategy.gpu0_batch=3 is for balanced/ddp"),
    (["strategy.nprocs=2", "train.amp=fp16"], "fsdp does not support train.amp=fp16"),
    (["strategy.nprocs=2", "train.batch_size=1"], "cannot give each of 2 ranks a sample"),
], ids=["one-process", "gpu0_batch", "fp16", "batch-too-small"])
def test_bad_combinations_are_refused(tmp_path, args, words):
    p = train(tmp_path, "bad", "strategy=fsdp", "train.steps=2", *args, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], p.stderr
    assert not (tmp_path / "bad").exists()  # nothing touched


# -- GPU ---------------------------------------------------------------------------------------------

def _gpu_train(tmp_path, run_id, *args, env=None):
    p = subprocess.run(job_cmd("train", f"train.run_dir={tmp_path}", f"train.run_id={run_id}", *args), cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-4000:]
    return p, json.loads((tmp_path / run_id / "summary.json").read_text())


@pytest.mark.gpu
@requires_gpus(2)
def test_fsdp_per_card_peak_is_at_most_six_tenths_of_ddp(tmp_path):
    """~0.7B-parameter LM (12 x 2048), AdamW, bf16, one sample of 256 tokens per card: weights, gradients and
    optimizer state dominate the peak, and fsdp keeps half of them per card."""
    model = ["workload=lm", "workload.layers=12", "workload.d_model=2048", "workload.heads=16",
             "workload.seq_len=256", "train.batch_size=2", "train.amp=bf16", "train.steps=5",
             "train.timing_warmup=2", "train.checkpoint_every=0"]
    peaks = {}
    for strategy in ("ddp", "fsdp"):
        _, summary = _gpu_train(tmp_path, strategy, f"strategy={strategy}", *model)
        assert summary["world_size"] == 2 and len(summary["cards"]) == 2
        peaks[strategy] = max(c["peak_allocated_bytes"] for c in summary["cards"])
    print({k: f"{v / 1e9:.2f} GB" for k, v in peaks.items()}, f"ratio {peaks['fsdp'] / peaks['ddp']:.3f}")
    assert peaks["fsdp"] <= 0.6 * peaks["ddp"], peaks


@pytest.mark.gpu
@requires_gpus(2)
def test_fsdp_on_two_cards_matches_one_card_and_resumes_under_ddp(tmp_path):
    common = ["workload=tiny", "train.batch_size=32", "train.amp=bf16", "train.cudnn_benchmark=false",
              "train.grad_clip=0.5"]
    _gpu_train(tmp_path, "one", "strategy=dp", *common, "train.steps=8", env={"CUDA_VISIBLE_DEVICES": "0"})
    p, two = _gpu_train(tmp_path, "two", "strategy=fsdp", *common, "train.steps=8")
    assert {c["device"] for c in two["cards"]} == {"cuda:0", "cuda:1"} and "per-card memory: fsdp" in p.stdout
    a, b = final_model(tmp_path, "one")["model"], final_model(tmp_path, "two")["model"]
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), atol=5e-2, rtol=5e-2, msg=k)
    p, _ = _gpu_train(tmp_path, "two", "strategy=ddp", *common, "train.steps=10")
    assert "resumed from" in p.stderr and final_model(tmp_path, "two")["step"] == 10
