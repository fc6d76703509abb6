"""train.amp as one object: the autocast a step runs under, the loss scaler, and what a strategy that casts
by itself needs.

The trainer builds one `Precision` and hands it to the strategy, the evaluator and the memory plan's probes;
nobody else reads train.amp. What each part does with it:

- the trainer: `autocast()` around each micro-step's forward and loss, `backward`, `unscale` before gradient
  clipping, `step` (the optimizer step and the scaler's update), `state_dict`/`load_state_dict` in checkpoints;
- the evaluator and the probes: `autocast()`;
- dp and balanced: `autocast(device_type)` inside the threads that run their replicas (autocast is per
  thread, and torch's DataParallel passes only `enabled` to its threads, so a bf16 run's replicas ran in
  fp16 without a scaler);
- fsdp: `fsdp_policy()` (FSDP casts parameters itself; the trainer's autocast is off inside its forward).

fp16 has a GradScaler (CUDA and CPU); bf16 and off have none (its methods then do plain backward and step).
"""

from __future__ import annotations

import torch

DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, mode: str = "off", device_type: str = "cpu"):
        if mode not in DTYPES:  # config.load refuses it first; this is for a Precision built by hand
            raise ValueError(f"train.amp={mode!r}; choose one of: {', '.join(DTYPES)}")
        self.mode, self.device_type = mode, device_type
        self.dtype: torch.dtype | None = DTYPES[mode]
        self.scaler = torch.amp.GradScaler(device_type, enabled=mode == "fp16")

    def __repr__(self) -> str:
        return f"Precision({self.mode!r}, {self.device_type!r})"

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def autocast(self, device_type: str | None = None):
        """The autocast of this precision on `device_type` (default: the run's); when off, autocast disabled."""
        return torch.autocast(device_type or self.device_type, dtype=self.dtype, enabled=self.enabled)

    def key(self) -> tuple[bool, torch.dtype | None]:
        """(enabled, dtype): what a captured CUDA graph was recorded under (job.strategies.graphs)."""
        return self.enabled, self.dtype

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer) -> None:
        """Gradients back to their true scale, before they are clipped."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> None:
        """The optimizer step (skipped by the scaler when fp16 gradients overflowed) and the scaler's update."""
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps: the scaler's state under fp16, else None."""
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.scaler.load_state_dict(state)

    def fsdp_policy(self):
        """FSDP's MixedPrecisionPolicy: bf16 all-gathered parameters and float32 gradient reduction under bf16,
        float32 otherwise (fsdp refuses fp16)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mode == "bf16":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()
