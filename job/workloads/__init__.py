"""The built-in workloads, written against the public interface (job.workload) like any user's: `tiny`,
`resnet50` and `lm`. Nothing in the job treats them specially; `job.workload.BUILTIN` only gives them short
names. Their models live in job.models, imported when a model or a batch is built (loading a config imports
no torch)."""

from __future__ import annotations

import math


def check_ranges(settings, ranges: dict[str, tuple[float, float]]) -> None:
    """ValueError naming the first setting outside its range (a typo: an extra zero, a sign)."""
    for key, (low, high) in ranges.items():
        value = getattr(settings, key)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"workload.{key}={value} is not a finite number; use {low:g} to {high:g}")
        if not low <= value <= high:
            raise ValueError(f"`workload.{key}={value}` is out of range; use {low:,} to {high:,}")


def classification_loss(out, target, reduction: str = "mean"):
    import torch.nn.functional as F

    return F.cross_entropy(out.float(), target, reduction=reduction)


def classification_accuracy(out, target):
    """(correct predictions, samples) of a batch."""
    return (out.argmax(dim=-1) == target).sum(), target.numel()


def random_images(settings, n: int, generator):
    import torch

    size = settings.image_size
    x = torch.randn((n, 3, size, size), generator=generator, device=generator.device)
    y = torch.randint(0, settings.num_classes, (n,), generator=generator, device=generator.device)
    return x, y


def image_folder(settings, request):
    from job.datasets import ImageFolder

    return ImageFolder(request.path, image_size=settings.image_size, num_classes=settings.num_classes,
                       augment=settings.augment and request.split == "train", decode=request.decode,
                       gpu_share=request.gpu_share, gpu_split=request.gpu_split, max_pixels=request.max_pixels)
