"""The local objective's base terms, chosen once from `loss.objective`, plus the registered extra terms of `loss.terms`.

Local training, the server's public-bank teacher and the LR probe all compute the same base loss; they call
`base_terms` so the choice of objective lives here only. An `Objective` is its terms function and the head it trains (a
prototype head carries the prototypes that alignment and the feature rules need; a linear head is a plain classifier).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

from torch import Tensor

from flare.client.terms.fafi import ce_terms, fafi_terms
from flare.config import Config, LossCfg
from flare.errors import FlareError
from flare.registry import OBJECTIVES


@dataclass(frozen=True)
class ObjectiveFacts:
    """What an objective is built from: the loss section's temperatures."""
    tau_con: float
    base_tau: float
    tau_pf: float
    tau_pp: float
    bank_tau: float


TermsFn = Callable[..., dict[str, Tensor]]  # (feat, logits, y, prototypes, bank) -> named terms


class ObjectiveFn(Protocol):
    """What `OBJECTIVES` holds (`Objective` below): builds the base terms from the facts; `head` is the head they
    train (read when the config is validated)."""
    head: str

    def __call__(self, facts: ObjectiveFacts, options: None) -> TermsFn: ...


@dataclass(frozen=True)
class Objective:
    build: Callable[[ObjectiveFacts], TermsFn]
    head: str = "prototype"  # "prototype", "linear" or "etf" (flare.models.HEADS)

    def __call__(self, facts: ObjectiveFacts, options: None) -> TermsFn:
        return self.build(facts)

    def check(self, cfg: Config) -> None:
        """Alignment and Plan B's trainable prototypes act on the prototype head's prototypes: an objective that
        trains another head refuses them (the registry runs this for every registered Objective)."""
        if self.head != "prototype" and (cfg.align.anchors != "none" or cfg.server.protos == "trainable"):
            raise FlareError("alignment and trainable global prototypes need the prototype head, not "
                             f"loss.objective={cfg.loss.objective}'s {self.head} head.", key="loss.objective",
                             fix="use a prototype-head objective (e.g. loss.objective=fafi), or set "
                                 "align.anchors=none and server.protos=mean.")


def _fafi(f: ObjectiveFacts) -> TermsFn:
    return lambda feat, logits, y, prototypes, bank: fafi_terms(
        feat, logits, y, prototypes, tau_con=f.tau_con, base_tau=f.base_tau, tau_pf=f.tau_pf, tau_pp=f.tau_pp,
        bank=bank, bank_tau=f.bank_tau)


OBJECTIVES.register("fafi", Objective(_fafi, "prototype"), description="FAFI: L_cls + L_con + L_pp + L_pf, "
                                                                       "prototype head")
OBJECTIVES.register("ce", Objective(lambda f: lambda feat, logits, y, prototypes, bank: ce_terms(logits, y), "linear"),
                    description="plain cross-entropy classifier (FedAvg/Ensemble baselines)")


@functools.lru_cache(maxsize=64)
def _built(name: str, facts: ObjectiveFacts) -> TermsFn:
    return OBJECTIVES.create(name, facts)


def base_terms(loss: LossCfg, feat: Tensor, logits: Tensor, y: Tensor, prototypes: Tensor | None,
               bank: tuple[Tensor, Tensor] | None = None) -> dict[str, Tensor]:
    """Named loss terms for a batch laid out as [view1; view2] (2B rows, labels repeated); `bank` adds memory-
    bank contrast entries to FAFI's SupCon term (the memory-bank variant). The objective is built once per distinct
    (name, facts) — once per run — not at every step."""
    facts = ObjectiveFacts(loss.tau_con, loss.base_tau, loss.tau_pf, loss.tau_pp, loss.bank_tau)
    return _built(loss.objective, facts)(feat, logits, y, prototypes, bank)
