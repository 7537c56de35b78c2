"""One-shot FedAvg: average every floating tensor of the uploaded state dicts (parameters *and*
BatchNorm statistics) with the aggregation weights; integer buffers (num_batches_tracked) come from
the first upload."""
from __future__ import annotations

import torch
from torch import Tensor


def average_state_dicts(states: list[dict[str, Tensor]], weights: Tensor) -> dict[str, Tensor]:
    if not states:
        raise ValueError("no state dicts to average")
    out = {}
    for k, v0 in states[0].items():
        if torch.is_floating_point(v0):
            stacked = torch.stack([s[k].float() for s in states])
            w = weights.to(stacked.device, torch.float32).view(-1, *([1] * v0.dim()))
            out[k] = (w * stacked).sum(0).to(v0.dtype)
        else:
            out[k] = v0.clone()
    return out
