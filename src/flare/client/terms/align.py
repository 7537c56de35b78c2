"""Global alignment (docs/method.md#anchors): fixed anchors shared by every client and L_align = MSE(P, target).

The server fixes the anchors before training from a shared seed; clients only ever read them.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from flare.errors import FlareError
from flare.registry import ANCHORS


class AnchorFn(Protocol):
    """What `ANCHORS` holds: C×d anchors (the entry `none` is None: no anchors, no alignment term)."""
    def __call__(self, num_classes: int, dim: int, generator: torch.Generator | None) -> Tensor: ...


def simplex_etf(num_classes: int, dim: int, generator: torch.Generator | None = None) -> Tensor:
    """Rows of a simplex equiangular tight frame: unit norm, pairwise cosine −1/(C−1).

    d ≥ C: A = sqrt(C/(C−1)) (I − 11ᵀ/C) Uᵀ with U (d×C) random orthonormal columns.
    d = C−1: the same rows written in an orthonormal basis of the subspace ⟂ 1.
    """
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


def random_anchors(num_classes: int, dim: int, generator: torch.Generator) -> Tensor:
    """Unit-norm Gaussian rows."""
    return F.normalize(torch.randn(num_classes, dim, generator=generator), dim=1)


ANCHORS.register("none", None, description="no anchors (no alignment term)")
ANCHORS.register("random", random_anchors, description="unit-norm Gaussian rows")
ANCHORS.register("etf", simplex_etf, description="simplex equiangular tight frame")


def make_anchors(kind: str, num_classes: int, dim: int, seed: int) -> Tensor | None:
    """The fixed anchor matrix A (C×d), identical for every client (seeded), or None. `kind` names a builder
    `fn(num_classes, dim, generator) -> C×d` in `flare.registry.ANCHORS` (`none`: no anchors)."""
    build = ANCHORS.get(kind)
    if build is None:
        return None
    return build(num_classes, dim, torch.Generator().manual_seed(seed))


def align_target(anchors: Tensor, target: str, p: float, initial_prototypes: Tensor | None) -> Tensor:
    """fixed: A. progressive (V8): (1 − p)·P⁰ + p·A, P⁰ the client's prototypes at initialisation."""
    if target == "fixed":
        return anchors
    if target == "progressive":
        assert initial_prototypes is not None
        return (1.0 - p) * initial_prototypes + p * anchors
    raise FlareError(f"unknown align target '{target}'.", key="align.target", fix="use fixed or progressive.")


def align_loss(prototypes: Tensor, target: Tensor) -> Tensor:
    """L_align = MSE(P, target), mean over all entries."""
    return F.mse_loss(prototypes.float(), target)
