"""The diagnostics of docs/method.md#metrics, computed every round from what the clients uploaded."""
from __future__ import annotations

import torch
from torch import Tensor


def model_variance_mean(models: list[torch.nn.Module]) -> float:
    """Stack the clients' flattened *parameters* (no buffers), unbiased std over clients per
    coordinate, mean over coordinates."""
    if len(models) < 2:
        return 0.0
    flat = torch.stack([torch.cat([p.detach().float().reshape(-1) for p in m.parameters()]) for m in models])
    return float(flat.std(dim=0, unbiased=True).mean())


def g_protos_std(G: Tensor) -> float:
    """Unbiased std of all entries of the global prototypes."""
    return float(G.float().std(unbiased=True))


def inter_client_proto_std(protos: list[Tensor]) -> float:
    """Per entry (c, j), the unbiased std over clients of P_i[c, j]; then the mean."""
    if len(protos) < 2:
        return 0.0
    return float(torch.stack([p.float() for p in protos]).std(dim=0, unbiased=True).mean())
