"""`dp`: stock torch.nn.DataParallel, the baseline.

Scatter from GPU 0, replicate every step, gather all outputs onto GPU 0, compute the loss there.
This is the behaviour whose GPU-0 pile-up the project measures; the only departure from the stock
recipe is that cuDNN autotuning is turned off (see base.disable_cudnn_autotune).
"""

from __future__ import annotations

from torch import nn

from job.strategies.base import Strategy, check_at_least_one_per_card, disable_cudnn_autotune


class DataParallelStrategy(Strategy):
    name = "dp"

    def check(self, *, micro_batch: int) -> None:
        check_at_least_one_per_card(self.name, micro_batch, len(self.devices))

    def setup(self, model: nn.Module, loss_fn, *, compile: bool = False) -> None:
        super().setup(model, loss_fn, compile=compile)
        if self.device.type == "cuda" and len(self.devices) > 1:
            disable_cudnn_autotune(self.name, self.devices)
            # Outputs are gathered on GPU 0 and the loss is computed there (base.loss): the stock recipe.
            self.forward = nn.DataParallel(self.forward, device_ids=[d.index for d in self.devices],
                                           output_device=self.devices[0].index)

    def even_sizes(self, micro_batch: int) -> list[int]:
        """What DataParallel's scatter gives each card: torch.chunk's sizes (ceil; later cards may get less)."""
        n = len(self.devices)
        size = -(-micro_batch // n)
        return [max(0, min(size, micro_batch - k * size)) for k in range(n)]
