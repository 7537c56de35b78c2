"""The local objective's base terms, chosen once from `loss.objective`.

Local training, the server's public-bank teacher and the LR probe all compute the same base loss; they
call `base_terms` so the choice between FAFI's four terms and the baselines' plain CE lives here only.
"""
from __future__ import annotations

from torch import Tensor

from flare.client.terms.fafi import ce_terms, fafi_terms
from flare.config import LossCfg


def base_terms(loss: LossCfg, feat: Tensor, logits: Tensor, y: Tensor, prototypes: Tensor | None,
               bank: tuple[Tensor, Tensor] | None = None) -> dict[str, Tensor]:
    """Named loss terms for a batch laid out as [view1; view2] (2B rows, labels repeated); `bank` adds memory-
    bank contrast entries to FAFI's SupCon term (the memory-bank variant)."""
    if loss.objective == "fafi":
        return fafi_terms(feat, logits, y, prototypes, tau_con=loss.tau_con, base_tau=loss.base_tau,
                          tau_pf=loss.tau_pf, tau_pp=loss.tau_pp, bank=bank, bank_tau=loss.bank_tau)
    return ce_terms(logits, y)
