"""Plan B — trainable global prototypes (SPEC §4; FedTGP-inspired, notes part 2 "B").

The server reads only the uploaded prototypes P_i (C×d each). It initialises G from mean_i P_i (or from
the anchors A with `server.protos_init=anchors`) and runs `server.server_epochs` epochs of
Adam(lr=`server.server_lr`); in every epoch it visits the clients in upload order and takes one step on

    loss_i(G) = CE(P_i Gᵀ, [0..C−1]) + γ_etf · MSE(G, A)        (the MSE term only when anchors exist)

i.e. row c of P_i must score its own class c highest against the global prototypes, while G is held
near the ETF. The procedure is deterministic (fixed client order, deterministic Adam), so `seed` is
accepted for the interface of `global_prototypes` but not needed.

Logged: `server_loss_first` / `server_loss_last` — the mean over clients of loss_i at the initial and at
the trained G (the same function evaluated at both ends, so the two numbers are comparable).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flare.config import ServerCfg
from flare.errors import FlareError


def _client_loss(P: Tensor, G: Tensor, anchors: Tensor | None, gamma: float) -> Tensor:
    target = torch.arange(P.shape[0], device=P.device)
    loss = F.cross_entropy(P @ G.T, target)
    if anchors is not None:
        loss = loss + gamma * F.mse_loss(G, anchors)
    return loss


def _mean_loss(protos: list[Tensor], G: Tensor, anchors: Tensor | None, gamma: float) -> float:
    with torch.no_grad():
        return float(torch.stack([_client_loss(P, G, anchors, gamma) for P in protos]).mean())


def train_global_prototypes(protos: list[Tensor], cfg: ServerCfg, anchors: Tensor | None,
                            seed: int = 0) -> tuple[Tensor, dict]:
    """Returns the trained G (C×d, detached, float32) and {"server_loss_first", "server_loss_last"}."""
    if not protos:
        raise ValueError("train_global_prototypes needs at least one client's prototypes")
    P = [p.detach().float() for p in protos]
    A = anchors.detach().float().to(P[0].device) if anchors is not None else None
    if cfg.protos_init == "anchors":
        if A is None:
            raise FlareError("server.protos_init=anchors needs anchors, but align.anchors=none.",
                             key="server.protos_init", fix="set align.anchors=etf (or random), or "
                             "server.protos_init=mean.")
        G0 = A.clone()
    else:
        G0 = torch.stack(P).mean(0)
    gamma = cfg.gamma_etf
    with torch.enable_grad():
        G = torch.nn.Parameter(G0.clone())
        opt = torch.optim.Adam([G], lr=cfg.server_lr)
        first = _mean_loss(P, G, A, gamma)
        for _ in range(cfg.server_epochs):
            for Pi in P:
                opt.zero_grad(set_to_none=True)
                _client_loss(Pi, G, A, gamma).backward()
                opt.step()
    G = G.detach()
    return G, {"server_loss_first": first, "server_loss_last": _mean_loss(P, G, A, gamma)}
