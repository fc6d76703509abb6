"""The memory plan: its arithmetic for 1-8 cards with mixed sizes and tenants, its refusals, the exactness of
uneven ddp splits on CPU, and (on 2 GPUs) training where the even split cannot: a tenant, a capped card."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, job_cmd, requires_gpus
from hypothesis import given, settings
from hypothesis import strategies as st

from job import memplan
from job.errors import UsageError

GB = 10**9


# -- arithmetic ---------------------------------------------------------------------------------------

@given(total=st.integers(0, 600), caps=st.lists(st.integers(0, 300), min_size=1, max_size=8),
       minimum=st.integers(0, 1))
@settings(max_examples=400, deadline=None)
def test_fill_split_properties(total, caps, minimum):
    sizes = memplan.fill_split(total, caps, minimum=minimum)
    feasible = sum(caps) >= total and min(caps) >= minimum and total >= minimum * len(caps)
    if not feasible:
        assert sizes is None
        return
    assert sizes is not None and len(sizes) == len(caps)
    assert sum(sizes) == total
    assert all(minimum <= s <= c for s, c in zip(sizes, caps))
    assert sizes == memplan.fill_split(total, caps, minimum=minimum)  # deterministic
    if len(caps) <= 3 and total <= 12:  # the largest share is as small as any feasible split's
        best = min(max(combo) for combo in itertools.product(*(range(minimum, c + 1) for c in caps))
                   if sum(combo) == total)
        assert max(sizes) == best


@given(total=st.integers(1, 4000), n=st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_identical_cards_with_room_get_the_even_split(total, n):
    sizes = memplan.fill_split(total, [total] * n, minimum=0)
    assert max(sizes) - min(sizes) <= 1
    assert sorted(sizes) == sorted(memplan.even_split(total, n))


@st.composite
def cards(draw):
    """1-8 cards of 16-144 GB, a tenant using part of some, one job whose cost is linear in samples."""
    n = draw(st.integers(1, 8))
    fixed = draw(st.floats(0.5, 8)) * GB
    per_sample = draw(st.floats(0.01, 2)) * GB
    out = []
    for k in range(n):
        total = draw(st.sampled_from([16, 24, 32, 48, 80, 141, 144])) * GB
        tenant = draw(st.floats(0, 0.9)) * total
        card = memplan.CardPlan(label=f"cuda:{k}", total=int(total), free=int(total - tenant), held=0)
        card.room = memplan.room_for(free=card.free, held=0, total=card.total, cap=None, margin=1.5 * GB)
        card.fixed = card.alloc_fixed = fixed + (draw(st.floats(0, 1)) * GB if k == 0 else 0)
        card.per_sample = card.alloc_per_sample = per_sample
        card.capacity = memplan.capacity(card.room, card.fixed, per_sample, limit=10**6)
        out.append(card)
    return out


@given(cs=cards(), micro=st.integers(1, 2000), minimum=st.integers(0, 1))
@settings(max_examples=300, deadline=None)
def test_a_plan_never_exceeds_a_card(cs, micro, minimum):
    plan = memplan.Plan(mode="auto", micro_batch=micro, cards=cs)
    try:
        memplan.choose(plan, minimum=minimum, accum_steps=1, options="opts")
    except UsageError as e:
        assert "does not fit" in str(e)
        assert (sum(c.capacity for c in cs) < micro or any(c.capacity < minimum for c in cs)
                or micro < minimum * len(cs) or any(c.fixed > c.room for c in cs))
        assert "\n" not in str(e)
        return
    assert sum(plan.sizes) == micro
    for c in plan.cards:
        assert minimum <= c.samples <= c.capacity
        assert c.predicted_reserved <= c.room + 1e-3  # room = free - margin: the plan stays inside the card


def test_tenant_on_card_0_moves_samples_to_card_1():
    """The issue's case on 2 x 143 GB: 80 GB held on card 0; 0.7 GB per sample, 3 GB fixed."""
    cs = []
    for k, tenant in enumerate([80, 0]):
        c = memplan.CardPlan(label=f"cuda:{k}", total=143 * GB, free=(143 - tenant) * GB, held=0)
        c.room = memplan.room_for(free=c.free, held=0, total=c.total, cap=None, margin=1.5 * GB)
        c.fixed = c.alloc_fixed = 3 * GB
        c.per_sample = c.alloc_per_sample = 0.7 * GB
        c.capacity = memplan.capacity(c.room, c.fixed, c.per_sample, limit=224)
        cs.append(c)
    plan = memplan.Plan(mode="auto", micro_batch=224, cards=cs)
    memplan.choose(plan, minimum=1, accum_steps=1, options="opts")
    assert plan.sizes == [83, 141] and cs[0].capacity == 83  # even (112 each) would not fit card 0
    plan = memplan.Plan(mode="auto", micro_batch=300, cards=cs)
    with pytest.raises(UsageError) as e:
        memplan.choose(plan, minimum=1, accum_steps=2, options="lower train.batch_size")
    msg = str(e.value)
    assert msg.startswith("global batch 600 does not fit: the largest that fits is 560 (280 per micro-step x 2")
    assert "cuda:0 63.0 GB free of 143.0 GB, fits 83" in msg and msg.endswith("lower train.batch_size")


def test_capacity_and_room():
    assert memplan.capacity(10.0, 4.0, 2.0, limit=100) == 3
    assert memplan.capacity(10.0, 11.0, 2.0, limit=100) == 0
    assert memplan.capacity(10.0, 4.0, 0.0, limit=7) == 7
    assert memplan.room_for(free=50, held=10, total=100, cap=None, margin=5) == 55
    assert memplan.room_for(free=50, held=10, total=100, cap=30, margin=5) == 25
    assert memplan.room_for(free=1, held=0, total=100, cap=None, margin=5) == 0


def test_fit_line_uses_the_two_largest_probes():
    assert memplan.fit_line([(1, 10.0), (2, 12.0), (4, 20.0)]) == (4.0, 4.0)
    assert memplan.fit_line([(1, 10.0)]) == (10.0, 0.0)
    assert memplan.fit_line([(1, 10.0), (2, 9.0)]) == (9.0, 0.0)  # never a negative cost per sample


@pytest.mark.parametrize("text,expected", [("auto", "auto"), ("EVEN", "even"), ("5,11", [5, 11]),
                                           ("[5, 11]", [5, 11]), ("0,16", [0, 16])])
def test_parse_split(text, expected):
    assert memplan.parse_split(text, 2, 16, minimum=0) == expected


@pytest.mark.parametrize("text,minimum,msg", [
    ("5,10", 0, "sums to 15, but each micro-batch has 16 samples"),
    ("4,4,8", 0, "gives 3 shares for 2 cards"),
    ("0,16", 1, "each be at least 1"),
    ("many", 0, "is not valid; give auto, even, or samples per card"),
])
def test_parse_split_refusals(text, minimum, msg):
    with pytest.raises(UsageError, match=msg):
        memplan.parse_split(text, 2, 16, minimum=minimum)


def test_cache_is_reused_only_for_the_same_cards_with_room(tmp_path):
    def card(free):
        return memplan.CardPlan(label="cuda:0", uuid="GPU-a", total=100, free=free, held=0, room=free - 5)

    plan = memplan.Plan(mode="auto", micro_batch=8, cards=[card(90)], key={"k": 1})
    plan.cards[0].fixed, plan.cards[0].per_sample = 10.0, 5.0
    plan.cards[0].alloc_fixed, plan.cards[0].alloc_per_sample = 9.0, 5.0
    memplan.apply_fixed(plan, [8])
    memplan.write_cache(tmp_path, plan)
    assert memplan.read_cache(tmp_path, {"k": 1}, [card(80)]).sizes == [8]
    assert memplan.read_cache(tmp_path, {"k": 2}, [card(80)]) is None  # another setup
    assert memplan.read_cache(tmp_path, {"k": 1}, [card(40)]) is None  # needs 50, has 35 now
    other = card(80)
    other.uuid = "GPU-b"
    assert memplan.read_cache(tmp_path, {"k": 1}, [other]) is None  # another card


# -- uneven ddp on CPU: exact --------------------------------------------------------------------------

SMALL = ["workload=tiny", "workload.width=8", "workload.image_size=16", "train.device=cpu", "train.log_every=3",
         "train.optimizer=sgd", "train.momentum=0.9", "train.batch_size=16"]


def _train(tmp: Path, run_id: str, *args: str) -> subprocess.CompletedProcess:
    p = subprocess.run(job_cmd("train", *SMALL, f"train.run_dir={tmp}", f"train.run_id={run_id}", *args), cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _weights(tmp: Path, run_id: str) -> dict:
    last = sorted((tmp / run_id / "checkpoints").glob("step_*.pt"))[-1]
    return torch.load(last, map_location="cpu", weights_only=False)["model"]


def _same(a: dict, b: dict) -> None:
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)


def test_uneven_ddp_equals_one_process_and_resumes_under_another_split(tmp_path):
    """3 + 3 steps: 2 ranks at 5/11 with accumulation, resumed at 9/7 without it — the same weights as one
    process on the whole batch, because samples are chosen by global id and the loss is weighted by count."""
    _train(tmp_path, "one", "strategy=dp", "train.steps=6")
    p = _train(tmp_path, "two", "strategy=ddp", "strategy.nprocs=2", "strategy.split=3,5", "train.accum_steps=2",
               "train.steps=3")
    assert "samples per micro-batch [3, 5] of 8" in p.stderr, p.stderr[-2000:]
    p = _train(tmp_path, "two", "strategy=ddp", "strategy.nprocs=2", "strategy.split=9,7", "train.steps=6")
    assert "resumed from" in p.stderr and "samples per micro-batch [9, 7] of 16" in p.stderr, p.stderr[-2000:]
    _same(_weights(tmp_path, "one"), _weights(tmp_path, "two"))


def test_split_refusals_through_the_cli(tmp_path):
    for args, msg in [(["strategy=ddp", "strategy.nprocs=2", "strategy.split=4,4"], "sums to 8, but each micro-batch"),
                      (["strategy=ddp", "strategy.nprocs=2", "strategy.gpu0_batch=0"], "fewer than 1 sample"),
                      (["strategy=balanced", "strategy.split=16", "strategy.gpu0_batch=2"], "set one of them"),
                      (["memory.margin_gb=-1"], "memory.margin_gb=-1.0` must be between 0 and 10000")]:
        p = subprocess.run(job_cmd("train", *SMALL, f"train.run_dir={tmp_path}", *args), cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, (args, p.stderr[-2000:])
        lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and msg in lines[0], (args, p.stderr[-2000:])
        assert "Traceback" not in p.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was written


# -- on real GPUs (2xH200): a tenant, a capped card ---------------------------------------------------

TENANT = """
import sys, time, torch
free, _ = torch.cuda.mem_get_info(0)
hold = torch.empty(int(free - float(sys.argv[1]) * 1e9), dtype=torch.uint8, device="cuda:0")
print("holding", hold.numel(), flush=True)
time.sleep(3600)
"""


def _tenant(leave_gb: float) -> subprocess.Popen:
    """Another process on card 0 that leaves `leave_gb` free (the seed post's situation)."""
    p = subprocess.Popen([sys.executable, "-c", TENANT, str(leave_gb)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith("holding"), "tenant did not start"
    return p


def _plan_and_summary(tmp: Path, run_id: str) -> tuple[dict, dict]:
    return (json.loads((tmp / run_id / "memory_plan.json").read_text()),
            json.loads((tmp / run_id / "summary.json").read_text()))


def _check_prediction(plan: dict) -> None:
    for c in plan["cards"]:
        assert c["measured_peak"] is not None and c["predicted_peak"]
        assert abs(c["measured_peak"] / c["predicted_peak"] - 1) <= 0.10, c


LM = ["workload=lm", "train.amp=bf16", "train.batch_size=96", "train.steps=5", "train.log_every=5"]


@requires_gpus(2)
@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ddp", "balanced"])
def test_tenant_on_card_0_trains_where_the_even_split_cannot(tmp_path, strategy):
    tenant = _tenant(leave_gb=30)
    try:
        t0 = time.monotonic()
        p = subprocess.run(job_cmd("train", f"strategy={strategy}", *LM, f"train.run_dir={tmp_path}",
                                   "train.run_id=t"), cwd=ROOT, capture_output=True, text=True, timeout=600)
        print(p.stderr[-4000:], f"\n{time.monotonic() - t0:.1f} s")
        assert p.returncode == 0, p.stderr[-3000:]
        assert "out of memory" not in p.stderr.lower()  # not even a caught one while probing
    finally:
        tenant.kill()
        tenant.wait()
    plan, summary = _plan_and_summary(tmp_path, "t")
    card0, card1 = plan["cards"]
    assert card0["capacity"] < 48 <= card1["capacity"], plan  # the even split (48 + 48) does not fit card 0
    assert card0["samples"] < card1["samples"] and sum(plan["sizes"]) == 96
    _check_prediction(plan)
    print(json.dumps(summary["cards"], indent=1))


@requires_gpus(2)
@pytest.mark.gpu
def test_a_capped_card_gets_fewer_samples(tmp_path):
    p = subprocess.run(job_cmd("train", "strategy=ddp", *LM, "memory.cap_gb=[140,30]", f"train.run_dir={tmp_path}",
                               "train.run_id=c"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    print(p.stderr[-4000:])
    assert p.returncode == 0, p.stderr[-3000:]
    plan, summary = _plan_and_summary(tmp_path, "c")
    assert plan["cards"][1]["capacity"] < 48 and plan["sizes"][1] < plan["sizes"][0], plan
    assert max(r["peak_reserved_bytes"] for r in summary["cards"] if r["rank"] == 1) <= 30e9
    _check_prediction(plan)


@requires_gpus(2)
@pytest.mark.gpu
def test_a_batch_no_split_fits_is_refused_before_training(tmp_path):
    tenant = _tenant(leave_gb=30)
    try:
        p = subprocess.run(job_cmd("train", "strategy=ddp", "workload=lm", "train.amp=bf16", "train.batch_size=2048",
                                   "train.steps=3", f"train.run_dir={tmp_path}", "train.run_id=x"), cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    finally:
        tenant.kill()
        tenant.wait()
    print(p.stderr[-3000:])
    assert p.returncode == 2, p.stderr[-3000:]
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "does not fit: the largest that fits is" in errors[0], p.stderr[-3000:]
    assert not (tmp_path / "x" / "checkpoints").exists()


def test_probes_leave_weights_buffers_and_gradients_untouched():
    """A probe is forward + backward only: BatchNorm statistics, weights and gradients are as before."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.LazyLinear(5))
    model(torch.randn(2, 3, 8, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = memplan.Context(micro_batch=4, accum_steps=1, margin_gb=0, cap_gb=[],
                          make_batch=lambda b, d: (torch.randn(b, 3, 8, 8), torch.randint(0, 5, (b,))),
                          loss_fn=lambda out, y, reduction: torch.nn.functional.cross_entropy(out, y, reduction=reduction))
    ctx.probe_step(model, torch.device("cpu"))(3)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_the_batches_data_prefetch_holds_ahead_count_in_each_sample_of_a_cards_share(monkeypatch):
    """The probes hold one batch; with data.prefetch its thread holds more (data.prefetch_depth): their bytes a
    sample are added to the fitted line, so a card fits fewer samples and the prediction covers them."""
    monkeypatch.setattr(memplan, "_measure", lambda device, step, b: (100 + 10 * b, 200 + 10 * b))
    plain, ahead = (memplan.CardPlan(label="cuda:0", total=1000, free=1000, held=0, room=300) for _ in range(2))
    memplan.probe(plain, None, None, upto=64, limit=64, extra=20)
    memplan.probe(ahead, None, None, upto=64, limit=64, extra=20, extra_per_sample=5)
    assert (plain.fixed, plain.per_sample, plain.alloc_fixed, plain.alloc_per_sample) == (220, 10, 120, 10)
    assert (ahead.fixed, ahead.per_sample, ahead.alloc_fixed, ahead.alloc_per_sample) == (220, 15, 120, 15)
    assert (plain.capacity, ahead.capacity) == (8, 5)
    assert max(p[0] for p in ahead.probes) == 5  # not probed past what fits with the batches ahead
    ahead.predict(5)
    assert ahead.predicted_peak == 120 + 15 * 5


@pytest.mark.parametrize("kind,overrides,want", [("imagefolder", ["data.prefetch_depth=3"], 3),
                                                 ("imagefolder", [], 1),  # data.prefetch=true by default
                                                 ("imagefolder", ["data.prefetch=false"], 0),
                                                 ("synthetic", ["data.prefetch=true", "data.prefetch_depth=2"], 0)])
def test_the_plan_knows_how_many_batches_data_prefetch_holds_ahead(tmp_path, kind, overrides, want):
    """What the trainer gives the plan, and what a cached plan must match (a plan made at another depth is
    probed again)."""
    from job import config, train

    (tmp_path / "c0").mkdir()
    path = [f"data.path={tmp_path}"] if kind != "synthetic" else []
    cfg = config.load(["workload=tiny", f"data.kind={kind}", *path, *overrides])
    assert train._batches_ahead(cfg) == want
    assert train._plan_key(cfg, 1, 8)["batches_ahead"] == want
