"""The FAFI local objective (the notes' V4; docs/method.md#local-objective-fafi): base = L_cls + L_con + L_pp + L_pf."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def supcon_loss(anchor: Tensor, anchor_y: Tensor, contrast: Tensor | None = None,
                contrast_y: Tensor | None = None, tau: float = 0.07, base_tau: float = 0.07) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020), contrast mode "all".

    `anchor` (N×d, L2-normalised) holds every view of the batch; each row contrasts against all other
    rows plus the optional extra `contrast` entries (memory/public banks, never anchors themselves).
    Positives share the label. An anchor with no positive contributes zero (not NaN); the loss is the
    mean over all anchors, scaled by τ/base_τ as in the reference implementation.
    """
    n = anchor.shape[0]
    keys, key_y = anchor, anchor_y
    if contrast is not None and contrast.shape[0] > 0:
        keys = torch.cat([anchor, contrast.to(anchor.dtype)])
        key_y = torch.cat([anchor_y, contrast_y])
    logits = anchor @ keys.T / tau
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    self_mask = torch.zeros_like(logits, dtype=torch.bool)
    self_mask[:, :n] = torch.eye(n, dtype=torch.bool, device=anchor.device)
    pos = (anchor_y[:, None] == key_y[None, :]) & ~self_mask
    logits = logits.masked_fill(self_mask, float("-inf"))
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    log_prob = log_prob.masked_fill(self_mask, 0.0)
    pos_f = pos.to(log_prob.dtype)
    mean_log_prob_pos = (pos_f * log_prob).sum(1) / pos_f.sum(1).clamp(min=1.0)
    return -(tau / base_tau) * mean_log_prob_pos.mean()


def proto_feature_loss(z: Tensor, prototypes: Tensor, y: Tensor, tau: float = 1.0) -> Tensor:
    """L_pf = CE(z Pᵀ / τ_pf, y) — with τ_pf = 1 it equals L_cls, as in the seeds' code."""
    return F.cross_entropy(z @ prototypes.T / tau, y)


def proto_proto_loss(prototypes: Tensor, tau: float = 1.0) -> Tensor:
    """L_pp = CE(P Pᵀ / τ_pp, [0..C−1]): prototypes repel each other."""
    target = torch.arange(prototypes.shape[0], device=prototypes.device)
    return F.cross_entropy(prototypes @ prototypes.T / tau, target)


def fafi_terms(feat: Tensor, logits: Tensor, y: Tensor, prototypes: Tensor, *, tau_con: float = 0.07,
               base_tau: float = 0.07, tau_pf: float = 1.0, tau_pp: float = 1.0,
               bank: tuple[Tensor, Tensor] | None = None, bank_tau: float | None = None) -> dict[str, Tensor]:
    """The four FAFI terms for a batch laid out as [view1; view2] (2B rows, labels repeated).

    `bank` (features, labels) adds detached contrast entries to L_con (the memory-bank variant, which
    then uses `bank_tau`)."""
    z = F.normalize(feat.float(), dim=1)
    if bank is not None:
        con = supcon_loss(z, y, bank[0], bank[1], tau=bank_tau or tau_con, base_tau=bank_tau or base_tau)
    else:
        con = supcon_loss(z, y, tau=tau_con, base_tau=base_tau)
    return {"loss_cls": F.cross_entropy(logits.float(), y), "loss_con": con,
            "loss_pf": proto_feature_loss(z, prototypes.float(), y, tau_pf),
            "loss_pp": proto_proto_loss(prototypes.float(), tau_pp)}


def ce_terms(logits: Tensor, y: Tensor) -> dict[str, Tensor]:
    """The plain-classifier objective of the `fedavg` / `ensemble` baselines: CE over both views."""
    return {"loss_cls": F.cross_entropy(logits.float(), y)}
