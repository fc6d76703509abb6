"""The balanced strategy: split arithmetic, loss/gradient equivalence, optimizer state, GPU behaviour."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from conftest import ROOT, job_cmd, requires_gpus
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from job import config
from job.config import StrategyCfg
from job.errors import UsageError
from job.strategies.balanced import BalancedStrategy, parse_gpu0, split_sizes


@given(total=st.integers(0, 5000), n=st.integers(1, 8), data=st.data())
@settings(max_examples=300, deadline=None)
def test_split_sizes_properties(total, n, data):
    gpu0 = data.draw(st.one_of(st.none(), st.integers(0, total)))
    sizes = split_sizes(total, n, gpu0)
    assert len(sizes) == n and sum(sizes) == total and min(sizes) >= 0
    assert sizes == split_sizes(total, n, gpu0)  # deterministic
    if n > 1:
        if gpu0 is not None:
            assert sizes[0] == gpu0
        rest = sizes[1:] if gpu0 is not None else sizes
        assert max(rest) - min(rest) <= 1
        assert rest == sorted(rest, reverse=True)  # remainders go to the lowest indices


def test_split_examples():
    assert split_sizes(16, 2) == [8, 8]
    assert split_sizes(10, 3) == [4, 3, 3]
    assert split_sizes(16, 3, 0) == [0, 8, 8]
    assert split_sizes(17, 4, 2) == [2, 5, 5, 5]
    assert split_sizes(256, 8, 4) == [4, 36, 36, 36, 36, 36, 36, 36]


@pytest.mark.parametrize("value,expected", [("auto", None), ("0", 0), ("4", 4), ("0.25", 4), ("0.5", 8), (" AUTO ", None)])
def test_parse_gpu0(value, expected):
    assert parse_gpu0(value, 16) == expected


@pytest.mark.parametrize("value,msg", [("17", "outside the micro-batch of 16"), ("-1", "outside"),
                                       ("1.5", "not valid"), ("lots", "not valid"), ("0.0", "not valid")])
def test_parse_gpu0_rejects(value, msg):
    with pytest.raises(UsageError, match=msg):
        parse_gpu0(value, 16)


def _strategy(n: int, gpu0: str, micro: int, threads: bool = False) -> BalancedStrategy:
    s = BalancedStrategy(OmegaConf.structured(StrategyCfg(name="balanced", gpu0_batch=gpu0, replica_threads=threads)),
                         devices=[torch.device("cpu")] * n)
    s.check(micro_batch=micro)
    return s


def _models(workload: str):
    small = {"tiny": ["workload.width=8", "workload.image_size=16"],
             "lm": ["workload.layers=2", "workload.d_model=32", "workload.heads=4", "workload.vocab=97",
                    "workload.seq_len=12"]}[workload]
    cfg = config.load([f"workload={workload}", *small])
    spec, settings = config.workload_of(cfg).workload, config.workload_settings(cfg)
    torch.manual_seed(0)
    ref = spec.model(settings)
    torch.manual_seed(0)
    model = spec.model(settings)
    x, y = spec.example_batch(settings, 12, torch.Generator().manual_seed(1))
    return spec, ref, model, x, y


@pytest.mark.parametrize("workload", ["tiny", "lm"])
@pytest.mark.parametrize("n,gpu0,threads", [(2, "auto", False), (3, "0", True), (3, "1", False), (2, "0.25", True),
                                            (4, "5", False)])
def test_loss_inside_replicas_equals_full_batch(workload, n, gpu0, threads):
    spec, ref, model, x, y = _models(workload)
    ref_loss = spec.loss(ref(x), y)
    ref_loss.backward()

    s = _strategy(n, gpu0, micro=12, threads=threads)
    s.setup(model, spec.loss)
    assert len(s.workers) == (n - 1 if threads else 0)
    try:
        with s.backward_sync(True):
            loss = s.loss(x, y)
            loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for replica in s.replicas:  # every replica holds the full-batch gradient after the reduce
            for (name, p), q in zip(replica.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        s.teardown()


def test_accumulation_skips_the_reduce_until_the_last_micro_step():
    spec, ref, model, x, y = _models("tiny")
    (spec.loss(ref(x[:6]), y[:6]) / 2 + spec.loss(ref(x[6:]), y[6:]) / 2).backward()
    s = _strategy(2, "auto", micro=6)
    s.setup(model, spec.loss)
    try:
        with s.backward_sync(False):
            (s.loss(x[:6], y[:6]) / 2).backward()
        g1 = [p.grad.clone() for p in s.replicas[1].parameters()]
        with s.backward_sync(True):
            (s.loss(x[6:], y[6:]) / 2).backward()
        for p, q in zip(s.replicas[0].parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        assert any(not torch.equal(a, b.grad) for a, b in zip(g1, s.replicas[1].parameters()))
    finally:
        s.teardown()


def test_optimizer_state_is_strategy_independent():
    spec, ref, model, x, y = _models("tiny")
    s = _strategy(3, "auto", micro=12)
    s.setup(model, spec.loss)
    try:
        opt = s.build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3))
        with s.backward_sync(True):
            s.loss(x, y).backward()
        opt.step()
        for a, b in zip(s.replicas[0].parameters(), s.replicas[2].parameters()):
            assert torch.equal(a, b)  # replicas stay identical without any broadcast
        sd = s.optimizer_state_dict(opt)
        plain = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        plain.load_state_dict(sd)  # loads into a single-model optimizer as is
        assert len(sd["param_groups"]) == 1 and len(sd["state"]) == len(list(ref.parameters()))
        opt2 = s.build_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3))
        s.load_optimizer_state_dict(opt2, plain.state_dict())
        assert len(opt2.state_dict()["state"]) == 3 * len(sd["state"])
    finally:
        s.teardown()


@pytest.mark.parametrize("arg,line", [("strategy.gpu0_batch=many", "strategy.gpu0_batch=`many` is not valid"),
                                      ("strategy.bucket_mb=0", "`strategy.bucket_mb=0` must be a size in MiB")])
def test_bad_strategy_keys_through_the_cli(tmp_path, arg, line):
    p = subprocess.run(job_cmd("train", "strategy=balanced", arg, "train.device=cpu", f"train.run_dir={tmp_path}"),
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and line in p.stderr, p.stderr
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_balanced_trains_on_cpu(tmp_path):
    p = subprocess.run(job_cmd("train", "strategy=balanced", "train.device=cpu", "train.steps=6", "workload.width=8",
                               f"train.run_dir={tmp_path}", "train.run_id=b"), cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "per-card memory: balanced" in p.stdout


# -- on real GPUs (2xH200) ------------------------------------------------------------------------

@requires_gpus(2)
@pytest.mark.gpu
@pytest.mark.parametrize("workload", ["tiny", "lm"])
def test_equivalence_on_two_cards(workload):
    spec, ref, model, x, y = _models(workload)
    ref, model = ref.cuda(0).double(), model.cuda(0).double()
    x = x.cuda(0).double() if x.is_floating_point() else x.cuda(0)
    y = y.cuda(0)
    ref_loss = spec.loss(ref(x), y)
    ref_loss.backward()
    s = BalancedStrategy(OmegaConf.structured(StrategyCfg(name="balanced", gpu0_batch="3")),
                         devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
    s.check(micro_batch=12)
    s.setup(model, lambda out, t, reduction="mean": spec.loss(out.double(), t, reduction))
    try:
        with s.backward_sync(True):
            loss = s.loss(x, y)
            loss.backward()
        # The losses cast logits to float32, so float32 rounding is the bar.
        torch.testing.assert_close(loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-7)
        for p, q in zip(s.replicas[1].parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.cuda(0), q.grad, rtol=1e-5, atol=1e-7)
    finally:
        s.teardown()


@requires_gpus(2)
@pytest.mark.gpu
def test_lm_auto_split_evens_the_cards(tmp_path):
    """No tenant, identical cards: the plan is the even split, the cards' peaks stay within 10 %, and a
    resumed run reuses the cached plan."""
    p = subprocess.run(job_cmd("train", "strategy=balanced", "workload=lm", "train.amp=bf16", "train.steps=14",
                               f"train.run_dir={tmp_path}", "train.run_id=lm", "train.log_every=7"),
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "memory plan (auto)" in p.stderr and "memory plan check" in p.stderr, p.stderr[-3000:]
    summary = json.loads((tmp_path / "lm" / "summary.json").read_text())
    print(p.stdout)
    assert summary["imbalance"] <= 1.10, summary
    plan = json.loads((tmp_path / "lm" / "memory_plan.json").read_text())
    assert plan["sizes"] == [8, 8], plan["sizes"]
    p = subprocess.run(job_cmd("train", "strategy=balanced", "workload=lm", "train.amp=bf16", "train.steps=16",
                               f"train.run_dir={tmp_path}", "train.run_id=lm"), cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and "memory plan (reused from" in p.stderr, p.stderr[-3000:]


# -- correct in every case (BatchNorm, unused parameters, clipping, drift) ----------------------------

class _BNNet(torch.nn.Module):
    """Conv + BatchNorm, plus a head that never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.BatchNorm2d(6), torch.nn.ReLU(),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(6, 4))
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.body(x)


def _ce(out, y, reduction="mean"):
    return torch.nn.functional.cross_entropy(out, y, reduction=reduction)


@pytest.mark.parametrize("gpu0", ["0", "1", "auto"])
def test_batchnorm_statistics_survive_any_split(gpu0):
    """Replica 0 (what checkpoints save) ends with the running mean one process computes on the whole
    batch, and counts every step, even when it trains no samples (gpu0_batch=0)."""
    torch.manual_seed(0)
    ref, model = _BNNet(), _BNNet()
    model.load_state_dict(ref.state_dict())
    s = _strategy(3, gpu0, micro=12)
    s.setup(model, _ce)
    opt = s.build_optimizer(lambda p: torch.optim.SGD(p, lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    try:
        for step in range(5):
            x, y = torch.randn(12, 3, 8, 8, generator=gen), torch.randint(0, 4, (12,), generator=gen)
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            with s.backward_sync(True):
                s.loss(x, y).backward()
            _ce(ref(x), y).backward()
            opt.step()
            ref_opt.step()
            bn, ref_bn = model.body[1], ref.body[1]
            if step == 0:  # same weights so far: the running mean is exactly one process's
                torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=1e-5, atol=1e-7)
        assert int(bn.num_batches_tracked) == 5
        # Later, each replica normalises by its own samples' statistics (as DDP without SyncBatchNorm), so
        # the weights and statistics stay close to, not equal to, one process's.
        torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=0.05, atol=1e-3)
        torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=0.05, atol=1e-3)
        for replica in s.replicas[1:]:
            torch.testing.assert_close(replica.body[1].running_mean, bn.running_mean)
        # A parameter that never gets a gradient keeps none on every replica (AdamW would decay zeros).
        assert all(r.unused.weight.grad is None for r in s.replicas)
    finally:
        s.teardown()


def test_gradient_clipping_equals_one_process():
    torch.manual_seed(0)
    ref, model = _BNNet(), _BNNet()
    model.load_state_dict(ref.state_dict())
    ref.eval()
    model.eval()
    s = _strategy(3, "2", micro=12)
    s.setup(model, _ce)
    x, y = torch.randn(12, 3, 8, 8), torch.randint(0, 4, (12,))
    try:
        with s.backward_sync(True):
            s.loss(x, y).backward()
        _ce(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        norm = s.clip_grad_norm(0.01)
        torch.testing.assert_close(norm, ref_norm)
        assert ref_norm > 0.01  # the clip did something
        for replica in s.replicas:
            for p, q in zip(replica.parameters(), ref.parameters()):
                if q.grad is not None:
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7)
    finally:
        s.teardown()


def test_drifting_replicas_fail_loudly():
    spec, _, model, _, _ = _models("tiny")
    s = _strategy(2, "auto", micro=8)
    s.setup(model, spec.loss)
    try:
        s.check_replicas(1)  # identical after setup
        with torch.no_grad():
            next(s.replicas[1].parameters()).add_(1e-3)
        with pytest.raises(RuntimeError, match="replica 1 .* drifted from replica 0 by up to 0.001 at step 2"):
            s.check_replicas(2)
    finally:
        s.teardown()


def test_grad_clip_through_the_cli_ddp_equals_one_process(tmp_path):
    common = ["workload=tiny", "workload.width=8", "workload.image_size=16", "train.device=cpu", "train.steps=4",
              "train.batch_size=8", "train.grad_clip=0.05", f"train.run_dir={tmp_path}", "train.log_every=2"]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    for run_id, args in [("one", ["strategy=dp"]), ("two", ["strategy=ddp", "strategy.nprocs=2", "strategy.split=3,5"])]:
        p = subprocess.run(job_cmd("train", *common, f"train.run_id={run_id}", *args), cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
    a, b = (torch.load(sorted((tmp_path / r / "checkpoints").glob("*.pt"))[-1], weights_only=False)["model"]
            for r in ("one", "two"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=k)


# -- gradient buckets summed during the backward ------------------------------------------------------

class _Skip(torch.nn.Module):
    """An LM-ish stack with a branch used only while `use_odd` is set: a parameter that gets a gradient in
    some micro-steps and not others."""

    use_odd = False

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.odd = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        if self.use_odd:
            h = self.odd(h)
        return self.head(h)


from job.workloads.lm import loss as _seq_ce  # noqa: E402


def _train_like_one_process(devices, gpu0: str, dtype=torch.float32, cuda_graphs: bool = False):
    """3 steps x 2 micro-steps of AdamW through balanced (buckets of ~1 parameter each, so every bucket
    is summed on its own) against one process; the parameters must match after every step."""
    torch.manual_seed(0)
    ref = _Skip().to(devices[0], dtype)
    model = _Skip().to(devices[0], dtype)
    model.load_state_dict(ref.state_dict())
    s = BalancedStrategy(OmegaConf.structured(StrategyCfg(name="balanced", gpu0_batch=gpu0, bucket_mb=0.001,
                                                          cuda_graphs=cuda_graphs)), devices=devices)
    s.check(micro_batch=5)
    s.setup(model, _seq_ce)
    assert len(s._params[0]) > 8
    opt = s.build_optimizer(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(5)
    try:
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            # micro-steps of 5 then 4 samples: the odd branch trains in the first only (its gradient must
            # still be summed, after the backward of the last)
            for micro, n in enumerate((5, 4)):
                x = torch.randint(0, 50, (n, 6), generator=gen).to(devices[0])
                y = torch.randint(0, 50, (n, 6), generator=gen).to(devices[0])
                for m in (ref, *s.replicas):
                    m.use_odd = micro == 0
                with s.backward_sync(micro == 1):
                    (s.loss(x, y) / 2).backward()
                (_seq_ce(ref(x), y) / 2).backward()
                if step == 0 and micro == 0:  # each step's first micro-step: the buckets are the gradients
                    i = [name for name, _ in model.named_parameters()].index("head.weight")
                    assert s.replicas[0].head.weight.grad is s.reducer.homes[0].views[i]
            opt.step()
            ref_opt.step()
            for replica in s.replicas:
                for (name, p), q in zip(replica.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(p.detach().to(q.device), q.detach(), rtol=1e-5, atol=1e-6,
                                               msg=f"step {step + 1}: {name}")
        assert s.reducer.launched and (devices[0].type == "cpu" or len(devices) == 1 or any(s.reducer.launched)), \
            "no bucket was summed during the backward"
        if cuda_graphs:  # the 5-sample micro-steps replayed graphs; the 4-sample ones ran eagerly
            assert sorted(s.graphs) == [k for k, n in enumerate(s.sizes) if n] and sum(s.sizes) == 5, s.sizes
    finally:
        s.teardown()


@pytest.mark.parametrize("gpu0", ["auto", "0"])
def test_buckets_train_like_one_process_on_cpu(gpu0):
    _train_like_one_process([torch.device("cpu")] * 3, gpu0)


def test_unused_parameter_keeps_no_gradient_with_buckets():
    torch.manual_seed(0)
    model = _Skip()
    s = BalancedStrategy(OmegaConf.structured(StrategyCfg(name="balanced", bucket_mb=0.001)),
                         devices=[torch.device("cpu")] * 2)
    s.check(micro_batch=4)
    s.setup(model, _seq_ce)
    try:
        x = torch.randint(0, 50, (4, 6))
        with s.backward_sync(True):
            s.loss(x, x).backward()
        assert all(r.odd.weight.grad is None and r.odd.bias.grad is None for r in s.replicas)
        assert all(r.head.weight.grad is not None for r in s.replicas)
    finally:
        s.teardown()


@requires_gpus(2)
@pytest.mark.gpu
@pytest.mark.parametrize("gpu0", ["auto", "0"])
def test_buckets_overlap_the_backward_and_train_like_one_process_on_two_cards(gpu0):
    """On 2 cards the buckets are summed by NCCL on side streams from the autograd threads."""
    _train_like_one_process([torch.device("cuda", 0), torch.device("cuda", 1)], gpu0, torch.float64)


def test_buffers_that_are_not_statistics_stay_exact():
    """Only normalisation statistics are averaged: a constant table (a mask, rotary angles) must not drift by
    a rounding step after every uneven micro-step."""
    torch.manual_seed(0)
    model = _BNNet()
    table = torch.randn(7) * 1e3
    model.register_buffer("table", table.clone())
    s = _strategy(3, "1", micro=12)
    s.setup(model, _ce)
    try:
        for _ in range(3):
            x, y = torch.randn(12, 3, 8, 8), torch.randint(0, 4, (12,))
            with s.backward_sync(True):
                s.loss(x, y).backward()
        assert all(torch.equal(r.table, table) for r in s.replicas)
        assert len(s._stats[0].views) == 3  # running mean, var, batches tracked of the one BatchNorm
    finally:
        s.teardown()


# -- CUDA graphs (strategy.cuda_graphs) ----------------------------------------------------------------

@pytest.mark.parametrize("args,line", [
    (["strategy=balanced-graphs"], "strategy.cuda_graphs=true needs CUDA cards, and no GPU is visible"),
    (["strategy=ddp", "strategy.cuda_graphs=true"], "strategy.cuda_graphs=true is balanced's"),
    (["strategy=balanced-graphs", "train.compile=true"], "strategy.cuda_graphs=true and train.compile=true"),
    (["strategy=balanced-graphs", "train.device=cpu"], "strategy.cuda_graphs=true needs CUDA cards, and train.device=cpu"),
])
def test_cuda_graphs_refusals(tmp_path, args, line):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(job_cmd("train", *args, "train.steps=1", f"train.run_dir={tmp_path}"), cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and line in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not any(tmp_path.iterdir())


def test_a_failed_capture_is_one_line_and_out_of_memory_stays_out_of_memory():
    from job import failure
    from job.strategies.graphs import capture_error

    err = capture_error(1, RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore"))
    line, code = failure.describe(err)
    assert line.startswith("RuntimeError: balanced: card 1's replica could not be captured as a CUDA graph "
                           "(CUDA error: operation not permitted when stream is capturing); run it with "
                           "strategy.cuda_graphs=false"), line
    assert code == 1
    try:  # the aborted capture's error arrives last, with the out-of-memory error as its context
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")  # noqa: B904
    except RuntimeError as e:
        masked = e
    line, _ = failure.describe(capture_error(0, masked))
    assert line.startswith("CUDA out of memory. Tried to allocate 2.00 GiB while capturing card 0's step as CUDA "
                           "graphs (they keep one micro-step's activations reserved: strategy.cuda_graphs=false "
                           "needs less); lower train.batch_size"), line


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("cards", [1, 2])
def test_cuda_graphs_train_like_one_process(cards):
    """Replayed graphs (5-sample micro-steps) and eager fallbacks (4-sample ones) share the weights and the
    buckets; float64 AdamW over 3 steps equals one process."""
    if torch.cuda.device_count() < cards:
        pytest.skip(f"needs {cards} GPUs")
    _train_like_one_process([torch.device("cuda", k) for k in range(cards)], "auto", torch.float64, cuda_graphs=True)


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("cards", [1, 2])
def test_cuda_graphs_keep_batchnorm_statistics(cards):
    """The capture's warm-up steps do not count: statistics and weights after 5 steps equal the eager
    strategy's, and every step is counted once."""
    if torch.cuda.device_count() < cards:
        pytest.skip(f"needs {cards} GPUs")
    devices = [torch.device("cuda", k) for k in range(cards)]
    torch.manual_seed(0)
    models = [_BNNet().cuda(), _BNNet().cuda()]
    models[1].load_state_dict(models[0].state_dict())
    runs = []
    for model, graphed in zip(models, (False, True)):
        s = BalancedStrategy(OmegaConf.structured(StrategyCfg(name="balanced", cuda_graphs=graphed)), devices=devices)
        s.check(micro_batch=12)
        s.setup(model, _ce)
        opt = s.build_optimizer(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
        gen = torch.Generator().manual_seed(3)
        try:
            for _ in range(5):
                x, y = torch.randn(12, 3, 8, 8, generator=gen).cuda(), torch.randint(0, 4, (12,), generator=gen).cuda()
                opt.zero_grad(set_to_none=True)
                with s.backward_sync(True):
                    s.loss(x, y).backward()
                opt.step()
            assert bool(s.graphs) == graphed
        finally:
            s.teardown()
        runs.append(model)
    eager, graphed = runs
    assert int(graphed.body[1].num_batches_tracked) == 5
    for (name, a), b in zip(eager.state_dict().items(), graphed.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


@requires_gpus(1)
@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["train.activation_checkpointing=true"]])
def test_cuda_graphs_through_the_cli(tmp_path, extra):
    """A small bf16 LM trained with and without graphs: the same losses, and the capture is logged."""
    common = ["workload=lm", "workload.layers=4", "workload.d_model=256", "workload.heads=4", "workload.vocab=1024",
              "workload.seq_len=128", "train.batch_size=8", "train.amp=bf16", "train.steps=8", "train.log_every=4",
              "strategy.split=even", f"train.run_dir={tmp_path}", *extra]
    losses, peaks = {}, {}
    for name in ("balanced", "balanced-graphs"):
        p = subprocess.run(job_cmd("train", f"strategy={name}", f"train.run_id={name}", *common), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert ("captured as CUDA graphs" in p.stderr) == (name == "balanced-graphs"), p.stderr[-3000:]
        losses[name] = [json.loads(line)["loss"] for line in
                        (tmp_path / name / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        peaks[name] = max(card["peak_allocated_bytes"] for card in summary["cards"])
    assert len(losses["balanced"]) >= 2, losses
    # A replay allocates nothing: without the graphs' pools added, the graphed run showed 15 % of the eager peak.
    assert 0.8 < peaks["balanced-graphs"] / peaks["balanced"] < 1.5, peaks
    torch.testing.assert_close(torch.tensor(losses["balanced-graphs"]), torch.tensor(losses["balanced"]),
                               rtol=2e-2, atol=1e-3)
