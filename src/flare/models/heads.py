"""Classifier heads on top of the encoder feature f(x) (docs/method.md#model).

* `PrototypeHead` — learnable prototypes P ∈ R^{C×d}, initialised N(0, 1) and never normalised;
  `logits = normalize(f(x)) @ Pᵀ`. This is what FAFI / FLARE clients train and upload.
* `LinearHead` — a plain `nn.Linear(d, C)` for the baselines that train ordinary classifiers
  (`fedavg`, `ensemble`).
* `ETFHead` — FedETF's fixed classifier (as the official FAFI code builds it): a linear projection d → C, L2
  normalised, times a fixed C×C simplex ETF (a buffer, never trained); the `fedetf` preset.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flare.registry import ANCHORS

__all__ = ["PrototypeHead", "LinearHead", "ETFHead"]


class PrototypeHead(nn.Module):
    """Cosine-to-prototype logits: `normalize(feat, dim=1) @ prototypes.T` (prototypes are NOT normalised)."""

    kind = "prototype"

    def __init__(self, num_classes: int, d: int):
        super().__init__()
        self.num_classes = int(num_classes)
        self.feature_dim = int(d)
        self.prototypes = nn.Parameter(torch.empty(self.num_classes, self.feature_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.prototypes, mean=0.0, std=1.0)

    def forward(self, feat: Tensor) -> Tensor:
        z = F.normalize(feat, dim=1)
        return z @ self.prototypes.to(z.dtype).t()

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, d={self.feature_dim}"


class LinearHead(nn.Module):
    """Ordinary linear classifier on the raw (un-normalised) feature."""

    kind = "linear"

    def __init__(self, num_classes: int, d: int):
        super().__init__()
        self.num_classes = int(num_classes)
        self.feature_dim = int(d)
        self.fc = nn.Linear(self.feature_dim, self.num_classes)

    def forward(self, feat: Tensor) -> Tensor:
        return self.fc(feat)


class ETFHead(nn.Module):
    """`normalize(proj(feat)) @ etfᵀ`: a learned projection onto C dimensions and a fixed simplex-ETF classifier
    (rows: unit norm, pairwise cosine −1/(C−1)), drawn from the global RNG at construction — the run's seeded init,
    so every client starts from (and keeps) the same ETF. Unscaled logits, as the FAFI code's FedETF."""

    kind = "etf"

    def __init__(self, num_classes: int, d: int):
        super().__init__()
        self.num_classes = int(num_classes)
        self.feature_dim = int(d)
        self.proj = nn.Linear(self.feature_dim, self.num_classes)
        self.register_buffer("etf", ANCHORS.get("etf")(self.num_classes, self.num_classes, None))

    def forward(self, feat: Tensor) -> Tensor:
        z = F.normalize(self.proj(feat), dim=1)
        return z @ self.etf.to(z.dtype).t()
