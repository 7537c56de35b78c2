"""Global alignment (docs/method.md#anchors): fixed anchors shared by every client and L_align = MSE(P, target).

The server fixes the anchors before training from a shared seed; clients only ever read them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import Tensor

from flare.models.heads import simplex_etf
from flare.registry import ANCHORS


@dataclass(frozen=True)
class AnchorFacts:
    """What anchors are drawn from: C classes, the feature dimension d, the seed every client shares."""
    num_classes: int
    dim: int
    seed: int

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


class AnchorFn(Protocol):
    """What `ANCHORS` holds: C×d anchors, built by `ANCHORS.create` (the entry `none` is None: no alignment)."""
    def __call__(self, facts: AnchorFacts, options: BaseModel | None) -> Tensor: ...


ANCHORS.register("none", None, description="no anchors (no alignment term)")
ANCHORS.register("random", lambda f, _: F.normalize(torch.randn(f.num_classes, f.dim, generator=f.generator()), dim=1),
                 description="unit-norm Gaussian rows")
ANCHORS.register("etf", lambda f, _: simplex_etf(f.num_classes, f.dim, f.generator()),
                 description="simplex equiangular tight frame")


def align_target(anchors: Tensor, target: str, p: float, initial_prototypes: Tensor | None) -> Tensor:
    """fixed: A. progressive (V8): (1 − p)·P⁰ + p·A, P⁰ the client's prototypes at initialisation."""
    if target == "fixed":  # else progressive: the config allows only the two
        return anchors
    assert initial_prototypes is not None
    return (1.0 - p) * initial_prototypes + p * anchors


def align_loss(prototypes: Tensor, target: Tensor) -> Tensor:
    """L_align = MSE(P, target), mean over all entries."""
    return F.mse_loss(prototypes.float(), target)
