"""The local objective's base terms, chosen once from `loss.objective`, plus the registered extra terms of `loss.terms`.

Local training, the server's public-bank teacher and the LR probe all compute the same base loss; they call
`base_terms` so the choice of objective lives here only. An objective is registered in `flare.registry.OBJECTIVES` as
an `Objective`: its terms function and the head it trains (a prototype head carries the prototypes that alignment and
the feature rules need; a linear head is a plain classifier).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from torch import Tensor

from flare.client.terms.fafi import ce_terms, fafi_terms
from flare.config import Config, LossCfg
from flare.errors import FlareError
from flare.registry import OBJECTIVES


class ObjectiveEntry(Protocol):
    """What `OBJECTIVES` holds (`Objective` below): the base terms and the head they train."""
    terms: Callable[..., dict[str, Tensor]]
    head: str

TermsFn = Callable[..., dict[str, Tensor]]  # (loss cfg, feat, logits, y, prototypes, bank) -> named terms


@dataclass(frozen=True)
class Objective:
    terms: TermsFn
    head: str = "prototype"  # "prototype", "linear" or "etf" (flare.models.HEADS)

    def check(self, cfg: Config) -> None:
        """Alignment and Plan B's trainable prototypes act on the prototype head's prototypes: an objective that
        trains another head refuses them (the registry runs this for every registered Objective)."""
        if self.head != "prototype" and (cfg.align.anchors != "none" or cfg.server.protos == "trainable"):
            raise FlareError("alignment and trainable global prototypes need the prototype head, not "
                             f"loss.objective={cfg.loss.objective}'s {self.head} head.", key="loss.objective",
                             fix="use a prototype-head objective (e.g. loss.objective=fafi), or set "
                                 "align.anchors=none and server.protos=mean.")


def _fafi(loss: LossCfg, feat, logits, y, prototypes, bank):
    return fafi_terms(feat, logits, y, prototypes, tau_con=loss.tau_con, base_tau=loss.base_tau,
                      tau_pf=loss.tau_pf, tau_pp=loss.tau_pp, bank=bank, bank_tau=loss.bank_tau)


OBJECTIVES.register("fafi", Objective(_fafi, "prototype"), description="FAFI: L_cls + L_con + L_pp + L_pf, "
                                                                       "prototype head")
OBJECTIVES.register("ce", Objective(lambda loss, feat, logits, y, prototypes, bank: ce_terms(logits, y), "linear"),
                    description="plain cross-entropy classifier (FedAvg/Ensemble baselines)")


def base_terms(loss: LossCfg, feat: Tensor, logits: Tensor, y: Tensor, prototypes: Tensor | None,
               bank: tuple[Tensor, Tensor] | None = None) -> dict[str, Tensor]:
    """Named loss terms for a batch laid out as [view1; view2] (2B rows, labels repeated); `bank` adds memory-
    bank contrast entries to FAFI's SupCon term (the memory-bank variant)."""
    return OBJECTIVES.get(loss.objective).terms(loss, feat, logits, y, prototypes, bank)
