"""A one-process run pays for nothing it does not use: `ddp` with one rank joins no process group, wraps the
model in no DistributedDataParallel (nor compiles such a wrapper, whose graph breaks at bucket boundaries), and
its collectives are the identity, so the step is the plain model's, eager or compiled."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from job.config import StrategyCfg
from job.strategies.ddp import DDPStrategy


def _loss(out, y, reduction="mean"):
    return nn.functional.cross_entropy(out, y, reduction=reduction)


@pytest.mark.parametrize("compile", [False, True])
def test_ddp_as_one_process_runs_the_plain_model(compile):
    model = nn.Linear(4, 3)
    s = DDPStrategy(OmegaConf.structured(StrategyCfg(name="ddp")), devices=[torch.device("cpu")])
    s.check(micro_batch=8)
    s.setup(model, _loss, compile=compile)
    with s.backward_sync(True):  # wraps the model, as the first step does
        pass
    assert not dist.is_initialized() and not s.distributed and s.ctrl is None and s.ddp is None
    plain = getattr(s.forward, "_orig_mod", s.forward)
    assert plain is model and not isinstance(s.forward, nn.parallel.DistributedDataParallel)
    assert isinstance(s.forward, torch._dynamo.eval_frame.OptimizedModule) == compile
    if compile:  # compiling a step on the CPU takes a minute; what runs is the compiled plain model
        return
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with s.backward_sync(True):
        loss = s.loss(x, y)
        loss.backward()
    # The loss is the plain model's mean over the micro-batch, and so is its gradient.
    ref = nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    ref.zero_grad()
    want = _loss(ref(x), y)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(model.weight.grad, ref.weight.grad)
    # Collectives are the identity: nothing to synchronise.
    assert s.all_gather_object({"a": 1}) == [{"a": 1}] and s.mean(2.5) == 2.5 and s.any(True) and not s.any(False)
    s.barrier()


def test_a_run_walks_its_tensors_for_the_memory_breakdown_once_however_often_it_logs(tmp_path, monkeypatch):
    """Each logged step's memory breakdown (and the summary's) counts the parameters, gradients and optimizer
    state; their sizes are fixed once the first step made the state, so the trainer walks them once."""
    import json

    from job import config, train

    walks = []
    walk = DDPStrategy.memory_tensors

    def counted(self, optimizer):
        walks.append(1)
        return walk(self, optimizer)

    monkeypatch.setattr(DDPStrategy, "memory_tensors", counted)
    cfg = config.load(["workload=tiny", "workload.width=8", "workload.image_size=16", "train.batch_size=8",
                       "strategy=ddp", "train.device=cpu", "train.steps=12", "train.log_every=1",
                       f"train.run_dir={tmp_path}", "train.run_id=r", "train.final_checkpoint=false"])
    assert train.run(cfg) == 0
    logged = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 12 and len(walks) == 1
    held = {tuple(r["memory_breakdown"][0]["kinds"][k] for k in ("parameters", "gradients", "optimizer_state"))
            for r in logged}
    (end,) = json.loads((tmp_path / "r" / "summary.json").read_text())["memory_breakdown"]
    params = held.pop()
    assert not held and params[1] == params[0] > 0 and params[2] >= params[0]  # SGD momentum, or AdamW: 2x
    assert params == tuple(end["kinds"][k] for k in ("parameters", "gradients", "optimizer_state"))


@pytest.mark.parametrize("strategy", ["ddp", "dp", "balanced"])
def test_the_training_loop_reads_no_omegaconf_attribute_at_a_step_that_does_not_log(tmp_path, monkeypatch, strategy):
    """An OmegaConf attribute read costs ~12 µs on a slow host; the loop made 17.5 a step before it read a plain
    copy of the train section: 20 more steps (2 of them logged) add fewer than 20 reads, all at the log steps."""
    import threading
    from collections import Counter

    from omegaconf import DictConfig

    from job import config, train

    reads = []
    read = DictConfig.__getattr__
    loop = threading.get_ident()

    def counted(self, key):
        if threading.get_ident() == loop:  # not a thread an earlier test in this process left running
            reads.append(key)
        return read(self, key)

    def run(steps: int) -> Counter:
        cfg = config.load(["workload=tiny", "workload.width=8", "workload.image_size=16", "train.batch_size=8",
                           f"strategy={strategy}", "train.device=cpu", f"train.steps={steps}", "train.log_every=10",
                           f"train.run_dir={tmp_path}", f"train.run_id=r{steps}", "train.final_checkpoint=false"])
        monkeypatch.setattr(DictConfig, "__getattr__", counted)
        try:
            del reads[:]
            assert train.run(cfg) == 0
            return Counter(reads)
        finally:
            monkeypatch.setattr(DictConfig, "__getattr__", read)

    short, long = run(10), run(30)
    more = long - short
    # Fewer than one read a step: the two more log steps read a few each (a slow one also data.kind, for its
    # input line); before the plain copy, 370 more.
    assert sum(more.values()) < 20, more


def test_a_log_step_gathers_the_cards_rows_and_the_memory_breakdown_in_one_collective(tmp_path, monkeypatch):
    """Every rank's per-card rows and memory by kind travel together: one all_gather_object a log step (it was
    two), and the rows logged are every rank's, in rank order."""
    import json

    from job import config, train

    gathers = []
    gather = DDPStrategy.all_gather_object

    def counted(self, obj):
        gathers.append(obj)
        return gather(self, obj)

    monkeypatch.setattr(DDPStrategy, "all_gather_object", counted)

    def run(steps: int) -> int:
        cfg = config.load(["workload=tiny", "workload.width=8", "workload.image_size=16", "train.batch_size=8",
                           "strategy=ddp", "train.device=cpu", f"train.steps={steps}", "train.log_every=1",
                           f"train.run_dir={tmp_path}", f"train.run_id=r{steps}", "train.final_checkpoint=false"])
        del gathers[:]
        assert train.run(cfg) == 0
        return len(gathers)

    assert run(12) - run(2) == 10
    logged = [json.loads(x) for x in (tmp_path / "r12" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 12 and all([r["rank"] for r in rec["memory_breakdown"]] == [0] for rec in logged)
