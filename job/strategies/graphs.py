"""CUDA graphs for `balanced`'s replicas (`strategy.cuda_graphs=true`).

One Python process launches every card's kernels. On short steps (deep, narrow LMs) launching them, not
the GPUs, sets the pace, and threads cannot share that work (one interpreter lock). Captured once as CUDA
graphs, a replica's forward-with-loss and its backward are one launch each.

What is captured, per card: the replica and the sum of its samples' losses at that card's share of the
micro-batch, under the run's autocast, forward and backward. What stays eager: a micro-batch of another
size (a partial last one), evaluation and no-grad calls, the optimizer, the gradient sums and the
statistics averaging. The backward graph hands its gradients to autograd, which adds them to the
gradient buckets and runs their hooks: every bucket is summed across the cards after a replica's
backward, not during it (no overlap; a Python-bound step gains more than it loses).

Capture runs the step three times on a side stream first (cuDNN tuning and lazy start-up must not land
in a graph); the replica's buffers (BatchNorm statistics) are put back afterwards, so training is the
eager step's. The graphs keep one micro-step's activations per card in a pool of their own, reserved
between steps. Anything in the model that needs the CPU mid-step (`.item()`, data-dependent shapes)
cannot be captured: the run ends with one line saying so.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.autograd.function import once_differentiable

WARMUP = 3  # eager steps before capture
_held: dict[int, int] = {}  # card index -> bytes its graphs' pools hold beyond live tensors


def held_bytes(index: int | None) -> int:
    """Memory on card `index` that captured graphs keep in their own pools for activations. torch's
    allocated counters do not see it (a replay allocates nothing): wherever this project reports allocated
    or peak allocated memory, it adds this, so a graphed run is not shown using less than it holds."""
    return _held.get(index or 0, 0)


class _Replay(torch.autograd.Function):
    """Autograd's view of a captured step: the forward graph, then the backward graph for its gradient."""

    @staticmethod
    def forward(ctx, graph: StepGraph, x, y, *params):
        graph.x.copy_(x)
        graph.y.copy_(y)
        graph.fwd.replay()
        ctx.graph = graph
        return graph.loss.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        g = ctx.graph
        g.grad_out.copy_(grad)
        g.bwd.replay()
        return (None, None, None, *(t.detach() if t is not None else None for t in g.grads))


class StepGraph:
    """One replica's captured step at one input shape: `run(x, y)` is `loss_fn(replica(x), y, "sum")`."""

    def __init__(self, replica: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, *,
                 amp: tuple[bool, torch.dtype]):
        self.replica, self.amp = replica, amp
        self.params = [p for p in replica.parameters() if p.requires_grad]
        self.x, self.y = x.clone(), y.clone()
        dev = x.device
        enabled, dtype = amp

        def step():
            with torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
                return loss_fn(replica(self.x), self.y, reduction="sum")

        saved = [b.detach().clone() for b in replica.buffers()]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                torch.autograd.grad(step(), self.params, allow_unused=True)
        torch.cuda.synchronize(dev)
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        # thread_local: other threads (telemetry, DataLoader's pinning thread) may keep using CUDA meanwhile.
        with torch.cuda.graph(self.fwd, pool=pool, stream=side, capture_error_mode="thread_local"):
            self.loss = step()
        self.grad_out = torch.empty_like(self.loss)
        with torch.cuda.graph(self.bwd, pool=pool, stream=side, capture_error_mode="thread_local"):
            self.grads = torch.autograd.grad(self.loss, self.params, self.grad_out, allow_unused=True)
        # The captured autograd graph must go: it holds the parameters' gradient accumulators made on the
        # side stream, and replays would then hand every gradient across streams (a sync each).
        self.loss = self.loss.detach()
        with torch.no_grad():
            for b, s in zip(replica.buffers(), saved):
                b.copy_(s)
        torch.cuda.current_stream(dev).wait_stream(side)
        segments = [seg for seg in torch.cuda.memory_snapshot()
                    if tuple(seg.get("segment_pool_id", ())) == tuple(pool) and seg.get("device") == dev.index]
        self.held = sum(seg["total_size"] - seg["allocated_size"] for seg in segments)
        _held[dev.index] = _held.get(dev.index, 0) + self.held

    def matches(self, x: torch.Tensor, y: torch.Tensor, amp: tuple[bool, torch.dtype]) -> bool:
        return (x.shape == self.x.shape and y.shape == self.y.shape and x.dtype == self.x.dtype
                and y.dtype == self.y.dtype and amp == self.amp)

    def run(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _Replay.apply(self, x, y, *self.params)


def capture(k: int, replica: nn.Module, loss_fn, x, y, *, amp) -> StepGraph:
    """Replica k's step captured at x/y's shapes; a model that cannot be captured ends the run in one line."""
    try:
        with torch.cuda.device(x.device), torch.autocast("cuda", enabled=False), warnings.catch_warnings():
            # Warm-up and capture run on a side stream: gradients meet accumulators made on the card's main
            # stream (autograd warns once); replays run on the main stream.
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
            return StepGraph(replica, loss_fn, x, y, amp=amp)
    except RuntimeError as e:
        err = capture_error(k, e)
        if isinstance(err, torch.OutOfMemoryError):
            raise err from None
        raise err from e


def capture_error(k: int, e: RuntimeError) -> BaseException:
    """What a failed capture of card k's step ends the run with: out of memory stays out of memory (the
    trainer's line and advice), even when the aborted capture's own error came last; anything else is
    one line naming the card and the switch."""
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, torch.OutOfMemoryError):
            cause.job_context = (f"while capturing card {k}'s step as CUDA graphs (they keep one micro-step's "
                                 "activations reserved: strategy.cuda_graphs=false needs less)")
            return cause
        cause = cause.__context__
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return RuntimeError(f"balanced: card {k}'s replica could not be captured as a CUDA graph ({first}); "
                        "run it with strategy.cuda_graphs=false")
