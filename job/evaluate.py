"""Validation: the held-out data evaluated every `eval.every` steps and at the end, under every strategy.

The trainer asks `due(step)` and, when it is, `run(step)`: every rank runs the same number of forwards over
its share of each held-out batch (fsdp needs every rank in every forward; a rank whose share is empty runs
one sample and counts none), sums the workload's loss (reduction="sum") and its accuracy pair, and the sums
are gathered. An evaluation leaves training as it was: the model goes back to train mode, no gradient is
made, normalisation statistics do not move (eval mode), and the RNG state is restored (tested: the same
weights with and without validation). A held-out batch that cannot be made (a file that does not decode)
raises job.data.BatchFailed on every rank together (take_or_stop), and the trainer stops at the step just trained, with a
checkpoint of it.
"""

from __future__ import annotations

import torch

from job import workload as wl
from job.data import take_or_stop


class Evaluator:
    def __init__(self, data, resolved: wl.Resolved, ecfg, *, strategy, device: torch.device, micro_batch: int,
                 channels_last: bool, precision, steps: int):
        self.data, self.resolved, self.strategy, self.device = data, resolved, strategy, device
        self.every, self.limit, self.steps = ecfg.every, ecfg.samples, steps
        self.batch = ecfg.batch_size or micro_batch
        self.channels_last, self.precision = channels_last, precision
        self.enabled = data.has_val(ecfg.every)
        self.last: dict | None = None

    def due(self, step: int) -> bool:
        """Whether the held-out data is evaluated after this step: every eval.every steps and at the last."""
        return self.enabled and ((self.every > 0 and step % self.every == 0) or step == self.steps)

    def run(self, step: int) -> dict:
        """Evaluate now; every rank gets the same result: {step, val_loss, val_accuracy, val_samples}."""
        w = self.resolved.workload
        rng = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        counted, samples = 0.0, 0
        self.strategy.set_training(False)
        batches = self.data.val_batches(batch=self.batch, limit=self.limit, rank=self.strategy.rank,
                                        world=self.strategy.world_size, device=self.device,
                                        channels_last=self.channels_last)
        try:
            with torch.no_grad(), self.precision.autocast():
                for x, y, n in _voted(batches, self.strategy):
                    out = self.strategy.eval_output(x)
                    if n == 0:  # this rank only took part in the forward
                        continue
                    y = y.to(out.device) if torch.is_tensor(out) else y
                    loss_sum += w.loss(out, y, reduction="sum").double().to(self.device)
                    if w.accuracy is not None:
                        good, total = w.accuracy(out, y)
                        correct += torch.as_tensor(good, dtype=torch.float64).to(self.device)
                        counted += float(total)
                    samples += n
        finally:
            self.strategy.set_training(True)
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state_all(rng[1])
        parts = self.strategy.all_gather_object((loss_sum.item(), correct.item(), counted, samples))
        total_loss, total_correct, total_counted, total_samples = (sum(p[i] for p in parts) for i in range(4))
        self.last = {
            "step": step,
            "val_loss": total_loss / total_samples if total_samples else float("nan"),
            "val_accuracy": total_correct / total_counted if w.accuracy is not None and total_counted else None,
            "val_samples": total_samples,
        }
        return self.last

    @staticmethod
    def line(val: dict) -> str:
        acc = f"  accuracy {val['val_accuracy'] * 100:.2f} %" if val.get("val_accuracy") is not None else ""
        return f"step {val['step']}  validation: loss {val['val_loss']:.4f}{acc}  ({val['val_samples']:,} held-out samples)"


def _voted(batches, strategy):
    """The held-out batches; one that cannot be made raises BatchFailed. Under several ranks (which all take
    the same number of batches) the ranks vote after each batch, so all stop together, before a forward that
    fsdp's collectives would make the others wait in."""
    while True:
        try:
            yield take_or_stop(lambda: next(batches), strategy, vote=True)
        except StopIteration:
            return
