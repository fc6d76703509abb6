"""A torchvision model (ResNet-18) on a folder of images, with training augmentation.

    python examples/vision/make_images.py /tmp/shapes        # 3 classes x 40 PNGs, one sub-folder each
    PYTHONPATH=examples/vision python -m job train workload=task:workload \
        data.kind=imagefolder data.path=/tmp/shapes data.val_fraction=0.2 eval.every=20 data.workers=2

job.datasets.ImageFolder reads the folder (random resized crop and flip for training, seeded per sample so a
resumed run sees the same crops; resize and centre crop for validation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from job.datasets import ImageFolder
from job.workload import Workload


@dataclass
class Settings:
    image_size: int = 32
    """Square input side in pixels."""
    classes: int = 3
    """Class folders."""
    augment: bool = True
    """Random resized crop and flip while training."""


def model(s: Settings):
    from torchvision.models import resnet18

    return resnet18(num_classes=s.classes)


def loss(out, y, reduction="mean"):
    return F.cross_entropy(out.float(), y, reduction=reduction)


def accuracy(out, y):
    return (out.argmax(-1) == y).sum(), y.numel()


def example_batch(s: Settings, n: int, generator: torch.Generator):
    x = torch.randn(n, 3, s.image_size, s.image_size, generator=generator, device=generator.device)
    return x, torch.randint(0, s.classes, (n,), generator=generator, device=generator.device)


def images(s: Settings, request):
    return ImageFolder(request.path, image_size=s.image_size, num_classes=s.classes,
                       augment=s.augment and request.split == "train", decode=request.decode,
                       max_pixels=request.max_pixels)


workload = Workload(
    model=model, loss=loss, settings=Settings, example_batch=example_batch, dataset=images,
    data_kinds=("imagefolder",), blocks=lambda m: [m.layer1, m.layer2, m.layer3, m.layer4], accuracy=accuracy,
    unit="img",
)
