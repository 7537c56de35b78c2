"""Classifier heads on top of the encoder feature f(x) (docs/method.md#model): `prototype` (what FAFI / FLARE clients
train and upload), `linear` (the baselines' ordinary classifier) and `etf` (FedETF's fixed classifier, as the
official FAFI code builds it; the `fedetf` preset)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flare.errors import FlareError


def simplex_etf(num_classes: int, dim: int, generator: torch.Generator | None = None) -> Tensor:
    """Rows of a simplex equiangular tight frame: unit norm, pairwise cosine −1/(C−1).

    d ≥ C: A = sqrt(C/(C−1)) (I − 11ᵀ/C) Uᵀ with U (d×C) random orthonormal columns.
    d = C−1: the same rows written in an orthonormal basis of the subspace ⟂ 1."""
    C, d = num_classes, dim
    if C < 2:
        raise FlareError("an ETF needs at least 2 classes.", key="align.anchors")
    if d < C - 1:
        raise FlareError(f"a simplex ETF of {C} classes needs feature dimension d >= C-1 = {C - 1}, "
                         f"but the model has d = {d}.", key="align.anchors",
                         fix="use align.anchors=random, or a wider model (model.width) so that d >= C-1.")
    M = math.sqrt(C / (C - 1)) * (torch.eye(C) - torch.ones(C, C) / C)  # C×C, rank C−1
    if d >= C:
        g = torch.randn(d, C, generator=generator, dtype=torch.float64)
        U, _ = torch.linalg.qr(g)  # d×C orthonormal columns
        return (M.double() @ U.T).float()
    # d == C−1: orthonormal basis of 1^⟂ from the SVD of the centring matrix
    basis = torch.linalg.svd(M.double()).U[:, : C - 1]  # C×(C−1), columns span 1^⟂
    return (M.double() @ basis).float()


class PrototypeHead(nn.Module):
    """Cosine-to-prototype logits: `normalize(feat, dim=1) @ prototypes.T` (prototypes are NOT normalised)."""

    kind = "prototype"

    def __init__(self, num_classes: int, d: int):
        super().__init__()
        self.num_classes = int(num_classes)
        self.feature_dim = int(d)
        self.prototypes = nn.Parameter(nn.init.normal_(torch.empty(self.num_classes, self.feature_dim)))

    def forward(self, feat: Tensor) -> Tensor:
        z = F.normalize(feat, dim=1)
        return z @ self.prototypes.to(z.dtype).t()


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
        self.register_buffer("etf", simplex_etf(self.num_classes, self.num_classes))

    def forward(self, feat: Tensor) -> Tensor:
        z = F.normalize(self.proj(feat), dim=1)
        return z @ self.etf.to(z.dtype).t()
