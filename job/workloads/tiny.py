"""`tiny`: a small CNN on 32x32 images (GroupNorm, so any batch split gives the same gradient); trains a few
hundred steps in seconds on a laptop CPU."""

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
    image_size: int = 32
    """Square input side in pixels."""
    num_classes: int = 10
    """Classifier outputs."""
    width: int = 32
    """Channels of the first conv layer (doubled twice)."""
    augment: bool = False
    """data.kind=imagefolder: random resized crop and flip for training (evaluation: resize and centre crop)."""


def build(s: Settings):
    from job.models import TinyCNN

    return TinyCNN(width=s.width, num_classes=s.num_classes)


def check(s: Settings) -> None:
    check_ranges(s, {"image_size": (8, 8192), "num_classes": (1, 2**24), "width": (1, 4096)})


workload = Workload(
    model=build, loss=classification_loss, settings=Settings, example_batch=random_images,
    dataset=image_folder, data_kinds=("imagefolder",), blocks=lambda model: list(model.features),
    accuracy=classification_accuracy, unit="img", check=check,
)
