"""One-shot FedAvg: average every floating tensor of the uploaded state dicts (parameters *and*
BatchNorm statistics) with the aggregation weights; integer buffers (num_batches_tracked) come from
the first upload. With `only` (a set of keys, e.g. the parameter names) the other entries come from the
first upload too — the reference's `parameter_averaging` (parameters only; client 0's BN buffers)."""
from __future__ import annotations

import torch
from torch import Tensor


def average_state_dicts(states: list[dict[str, Tensor]], weights: Tensor,
                        only: set[str] | None = None) -> dict[str, Tensor]:
    out = {}
    for k, v0 in states[0].items():
        if torch.is_floating_point(v0) and (only is None or k in only):
            stacked = torch.stack([s[k].float() for s in states])
            w = weights.to(stacked.device, torch.float32).view(-1, *([1] * v0.dim()))
            out[k] = (w * stacked).sum(0).to(v0.dtype)
        else:
            out[k] = v0.clone()
    return out
