"""The diagnostics of docs/method.md#metrics, computed every round from what the clients uploaded."""
from __future__ import annotations

import torch
from torch import Tensor

from flare.models import layout


def model_variance_mean(models: list[torch.nn.Module]) -> float:
    """Stack the clients' flattened *parameters* (no buffers), unbiased std over clients per
    coordinate, mean over coordinates. Clients of different architectures have no common coordinates: then the
    mean of this number over the architectures that two or more clients run (NaN when none does)."""
    flats = [torch.cat([p.detach().float().reshape(-1) for p in m.parameters()]) for m in models]
    layouts: dict[tuple, list[Tensor]] = {}
    for m, f in zip(models, flats):
        layouts.setdefault(layout(m), []).append(f)
    if len(layouts) == 1:
        return float(torch.stack(flats).std(dim=0, unbiased=True).mean()) if len(models) >= 2 else 0.0
    per = [float(torch.stack(g).std(dim=0, unbiased=True).mean()) for g in layouts.values() if len(g) >= 2]
    return sum(per) / len(per) if per else float("nan")


def g_protos_std(G: Tensor) -> float:
    """Unbiased std of all entries of the global prototypes."""
    return float(G.float().std(unbiased=True))


def inter_client_proto_std(protos: list[Tensor]) -> float:
    """Per entry (c, j), the unbiased std over clients of P_i[c, j]; then the mean."""
    return 0.0 if len(protos) < 2 else float(torch.stack([p.float() for p in protos]).std(dim=0, unbiased=True).mean())
