"""`resnet50`: torchvision's ResNet-50 (BatchNorm and all) on ImageNet shapes, the seed post's benchmark."""

from __future__ import annotations

from dataclasses import dataclass

from job.workload import Workload
from job.workloads import (
    check_ranges,
    classification_accuracy,
    classification_loss,
    image_folder,
    random_images,
)


@dataclass
class Settings:
    image_size: int = 224
    """Square input side in pixels."""
    num_classes: int = 1000
    """Classifier outputs."""
    augment: bool = False
    """data.kind=imagefolder: random resized crop and flip for training (evaluation: resize and centre crop)."""


def build(s: Settings):
    from torchvision.models import resnet50

    return resnet50(num_classes=s.num_classes)


def stages(model):
    """layer1-4: the sharding units of fsdp and the recomputed blocks of activation checkpointing."""
    return [model.layer1, model.layer2, model.layer3, model.layer4]


def check(s: Settings) -> None:
    check_ranges(s, {"image_size": (8, 8192), "num_classes": (1, 2**24)})


workload = Workload(
    model=build, loss=classification_loss, settings=Settings, example_batch=random_images,
    dataset=image_folder, data_kinds=("imagefolder",), blocks=stages, accuracy=classification_accuracy,
    unit="img", check=check,
)
