"""job.precision: train.amp as the one object the trainer, the strategies, the evaluator and the probes share."""

from __future__ import annotations

import pytest
import torch

from job.precision import Precision


def _matmul_dtype(ctx) -> torch.dtype:
    a = torch.randn(4, 4)
    with ctx:
        return (a @ a).dtype


def test_bf16_autocasts_and_off_turns_an_outer_autocast_off():
    assert _matmul_dtype(Precision("bf16", "cpu").autocast()) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # a replica's thread or a probe under `off` computes in float32 whatever its caller does
        assert _matmul_dtype(Precision("off", "cpu").autocast()) == torch.float32
    p = Precision("bf16", "cpu")
    assert (p.enabled, p.dtype, p.key()) == (True, torch.bfloat16, (True, torch.bfloat16))
    assert Precision().key() == (False, None)


def test_only_fp16_has_a_scaler_and_checkpoints_it():
    assert Precision("bf16", "cpu").state_dict() is None and Precision("off", "cpu").state_dict() is None
    p = Precision("fp16", "cpu")
    state = p.state_dict()
    assert state is not None and state["scale"] > 1
    q = Precision("fp16", "cpu")
    q.load_state_dict({**state, "scale": 8.0})
    assert q.state_dict()["scale"] == 8.0
    q.load_state_dict(None)  # a checkpoint written without fp16: nothing to restore
    assert q.state_dict()["scale"] == 8.0


def _one_step(p: Precision, grad_value: float) -> torch.Tensor:
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    p.backward((w * grad_value).sum())
    p.unscale(opt)
    p.step(opt)
    return w.detach()


def test_steps_are_plain_without_a_scaler_and_skipped_on_overflow_with_one():
    assert torch.equal(_one_step(Precision("off", "cpu"), 1.0), torch.zeros(2))
    assert torch.equal(_one_step(Precision("bf16", "cpu"), 1.0), torch.zeros(2))
    p = Precision("fp16", "cpu")
    assert torch.equal(_one_step(p, 1.0), torch.zeros(2))  # unscaled before the step: the true gradient
    scale = p.state_dict()["scale"]
    assert torch.equal(_one_step(p, float("inf")), torch.ones(2))  # overflow: step skipped
    assert p.state_dict()["scale"] == scale / 2  # and the scale backed off


def test_fsdp_policy_follows_the_mode():
    bf16 = Precision("bf16", "cpu").fsdp_policy()
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    off = Precision("off", "cpu").fsdp_policy()
    assert (off.param_dtype, off.reduce_dtype) == (None, None)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="fp8"):
        Precision("fp8", "cpu")
