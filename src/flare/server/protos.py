"""Global prototypes G (docs/method.md#global-prototypes, where the arithmetic is written out): the plain mean of the
clients' P, or Plan B's G, trained by Adam on loss_i(G) = CE(P_i Gᵀ, [0..C−1]) + γ_etf · MSE(G, A), one step per
client in upload order. `ServerPrototypes`, a server protocol, is the flow across rounds. The procedure is
deterministic (fixed client order, deterministic Adam): it draws nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flare.config import ServerCfg
from flare.metrics import g_protos_std
from flare.server.strategy import ServerProtocol
from flare.server.upload import Upload


def mean_prototypes(protos: list[Tensor]) -> Tensor:
    """G = mean_i P_i (unweighted)."""
    return torch.stack([p.float() for p in protos]).mean(0)


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
                            init: Tensor | None = None) -> tuple[Tensor, dict]:
    """Returns the trained G (C×d, detached, float32) and {"server_loss_first", "server_loss_last"}. `init`: the
    G to continue from (protos_flow=reference), instead of `server.protos_init`."""
    P = [p.detach().float() for p in protos]
    A = anchors.detach().float().to(P[0].device) if anchors is not None else None
    if init is not None:
        G0 = init.detach().float().to(P[0].device)
    elif cfg.protos_init == "anchors":  # the config refuses it without anchors (`Config.require_anchors`)
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


class ServerPrototypes(ServerProtocol):
    """G across rounds, the one part that tells the flows (module docstring) apart: what the server keeps of G
    (`initial_state`, then each `fold`'s), sends before a round (`configure_train`), hands the scorers (`fold`)."""

    def __init__(self, cfg: ServerCfg):
        self.cfg = cfg
        self.carries = cfg.protos == "trainable" and cfg.protos_flow == "reference"

    def initial_state(self, anchors: Tensor | None) -> dict[str, Tensor]:
        return {"G": anchors} if self.carries else {}  # the reference flow's round-0 G: the anchors

    def configure_train(self, rnd: int, carried: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"align_target": carried["G"]} if carried.get("G") is not None else {}

    def fold(self, r: int, uploads: list[Upload], anchors: Tensor | None,
             kept: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor] | None, dict]:
        protos = [u.prototypes for u in uploads if u.prototypes is not None]
        if not protos:
            return {}, None, {}
        if self.carries:
            new_G, logs = train_global_prototypes(protos, self.cfg, anchors, init=kept.get("G"))
            return {"G": mean_prototypes(protos)}, {"G": new_G}, {**logs, "server_g_std": g_protos_std(new_G)}
        if self.cfg.protos == "mean":
            return {"G": mean_prototypes(protos)}, None, {}
        G, logs = train_global_prototypes(protos, self.cfg, anchors)
        return {"G": G}, None, logs
