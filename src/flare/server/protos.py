"""Global prototypes G: the plain mean of the clients' P (SPEC §4), or Plan B's trainable G."""
from __future__ import annotations

import torch
from torch import Tensor

from flare.config import ServerCfg


def mean_prototypes(protos: list[Tensor]) -> Tensor:
    """G = mean_i P_i (unweighted)."""
    return torch.stack([p.float() for p in protos]).mean(0)


def global_prototypes(protos: list[Tensor], cfg: ServerCfg, anchors: Tensor | None = None,
                      seed: int = 0) -> tuple[Tensor, dict]:
    """Returns G and a dict of diagnostics to log (e.g. Plan B's server loss)."""
    if cfg.protos == "mean":
        return mean_prototypes(protos), {}
    from flare.server.trainable_protos import train_global_prototypes  # Plan B

    return train_global_prototypes(protos, cfg, anchors, seed)
