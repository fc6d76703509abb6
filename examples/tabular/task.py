"""A tabular classifier on a CSV file, read by a plain torch Dataset of your own.

    python examples/tabular/make_data.py /tmp/tab.csv      # 2,000 rows: 8 features and a label
    PYTHONPATH=examples/tabular python -m job train workload=task:workload \
        data.kind=csv data.path=/tmp/tab.csv data.val_fraction=0.1 eval.every=50 workload.hidden=128

No example_batch: the memory plan's probes take the dataset's first rows, and there is no synthetic data.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from job.workload import Workload


@dataclass
class Settings:
    features: int = 8
    """Feature columns (every column but the label)."""
    classes: int = 3
    """Label values 0 .. classes-1."""
    hidden: int = 64
    """Width of the hidden layers."""
    depth: int = 2
    """Hidden layers."""
    label: str = "label"
    """Name of the label column."""


class CSVRows(Dataset):
    """Every row of the file as (features as float32, label as int64), read once into memory."""

    def __init__(self, path: str, s: Settings):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or s.label not in rows[0]:
            raise ValueError(f"{path} has no column `{s.label}`; set workload.label to the label column")
        names = [k for k in rows[0] if k != s.label]
        if len(names) != s.features:
            raise ValueError(f"{path} has {len(names)} feature columns and workload.features={s.features}; set "
                             f"workload.features={len(names)}")
        self.x = torch.tensor([[float(r[k]) for k in names] for r in rows], dtype=torch.float32)
        self.y = torch.tensor([int(r[s.label]) for r in rows], dtype=torch.int64)
        if int(self.y.max()) >= s.classes:
            raise ValueError(f"{path} has label {int(self.y.max())}, and workload.classes={s.classes}")

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class MLP(nn.Module):
    def __init__(self, s: Settings):
        super().__init__()
        self.inp = nn.Linear(s.features, s.hidden)
        self.hidden = nn.ModuleList(nn.Sequential(nn.ReLU(), nn.Linear(s.hidden, s.hidden)) for _ in range(s.depth))
        self.out = nn.Sequential(nn.ReLU(), nn.Linear(s.hidden, s.classes))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.hidden:
            x = layer(x)
        return self.out(x)


def loss(out, y, reduction="mean"):
    return F.cross_entropy(out, y, reduction=reduction)


def accuracy(out, y):
    return (out.argmax(-1) == y).sum(), y.numel()


workload = Workload(
    model=MLP, loss=loss, settings=Settings, dataset=lambda s, request: CSVRows(request.path, s),
    data_kinds=("csv",), blocks=lambda model: list(model.hidden), accuracy=accuracy, unit="row",
)
