"""Additional loss terms (`loss.terms`; docs/extending.md): registered terms a plugin adds to the local objective.
The trainer adds `weight · term(batch)` to the base loss and logs it as `term_<name>` in every engine and the LR probe
(client/step.py `local_loss`); under client_engine=batched the term is vmapped, so it must not read values back to the
host.

A term that regularises the weights themselves (FedProx's) declares `uses_params = True` on its options model: the
sequential engines and the LR probe then pass the model's trainable parameters by name (`TermBatch.params`) and the
model the client started from (`TermBatch.start`: in one-shot FL the global model the server sent, the shared init).
The batched engine holds no such per-client copy and refuses those terms.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

import torch
from pydantic import Field
from torch import Tensor

from flare.config import Config, LossCfg
from flare.errors import FlareError
from flare.registry import LOSS_TERMS, NoFacts, TermOptions


Term = Callable[["TermBatch"], Tensor]


class LossTermFn(Protocol):
    """What `LOSS_TERMS` holds: builds the term whose scalar is added to the local loss as `weight · term(batch)`."""
    def __call__(self, facts: NoFacts, options: TermOptions) -> Term: ...

__all__ = ["TermBatch", "TermOptions", "extra_terms", "uses_params", "ProxOptions"]


@dataclass(frozen=True)
class TermBatch:
    """What a loss term sees of a step: both views' features and logits, their labels, the head's prototypes, and
    (for a term that asks, `uses_params`) the model's trainable parameters and the model it started from."""

    feat: Tensor               # 2B×d, un-normalised
    logits: Tensor             # 2B×C
    y: Tensor                  # 2B labels
    prototypes: Tensor | None  # C×d (prototype head), else None
    params: dict[str, Tensor] | None = None  # name → trainable parameter (terms with uses_params)
    start: dict[str, Tensor] | None = None   # name → the same parameter at the start of local training


def loss_terms(loss: LossCfg) -> tuple[tuple[str, Term, TermOptions], ...]:
    """(name, built term, validated options) of every term of `loss.terms`, in the order the step sums them, built
    once per distinct table rather than at every step (the table is plain JSON data: its text is the cache's key)."""
    return _built_terms(json.dumps(loss.terms))


@functools.lru_cache(maxsize=64)
def _built_terms(table: str) -> tuple[tuple[str, Term, TermOptions], ...]:
    built = []
    for name, mapping in json.loads(table).items():
        opts = LOSS_TERMS.options(name, mapping, f"loss.terms.{name}")
        built.append((name, LOSS_TERMS.create(name, NoFacts(), opts), opts))
    return tuple(built)


def uses_params(loss: LossCfg) -> bool:
    """Whether any term of `loss.terms` reads the model's parameters (the engine must then pass them)."""
    return any(getattr(opts, "uses_params", False) for _, _, opts in loss_terms(loss))


def extra_terms(loss: LossCfg, feat: Tensor, logits: Tensor, y: Tensor,
                prototypes: Tensor | None, params: dict[str, Tensor] | None = None,
                start: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """`term_<name>: weight · term(batch)` for every term of `loss.terms` (empty without any)."""
    if not loss.terms:
        return {}
    batch = TermBatch(feat, logits, y, prototypes, params, start)
    return {f"term_{name}": getattr(opts, "weight", 1.0) * term(batch) for name, term, opts in loss_terms(loss)}


# ---------------------------------------------------------------------------------------------- FedProx's term
class ProxOptions(TermOptions):
    """FedProx (Li et al., MLSys 2020): (μ/2)·Σ‖w − w_global‖² over every trainable parameter, exactly as
    NIID-Bench's `train_net_fedprox` adds it to the CE loss (its gradient is μ(w − w_global)). `weight` stays 1; μ
    is the term's own option so a config reads like the reference's `--mu`."""

    uses_params: ClassVar[bool] = True
    mu: float = Field(0.01, ge=0, description="proximal strength μ: the term is (μ/2)·‖w − w_global‖²")


def _prox_check(cfg: Config) -> None:
    """The proximal term needs each client's start weights beside its parameters; the batched engine's vmapped
    step holds neither as named tensors."""
    if "fedprox" in cfg.loss.terms and cfg.client_engine == "batched":
        raise FlareError("loss.terms.fedprox reads each client's parameters and start weights, which "
                         "client_engine=batched does not hold per client.", key="client_engine",
                         fix="use client_engine=sequential (or threads) with the fedprox term.")


@LOSS_TERMS.register("fedprox", options=ProxOptions, check=_prox_check,
                     description="FedProx's proximal term (μ/2)·‖w − w_global‖² (w_global: the model the client "
                                 "started from)")
def fedprox(facts: NoFacts, options: ProxOptions) -> Term:
    """(μ/2)·Σ_params ‖w − w_start‖²."""
    def term(batch: TermBatch) -> Tensor:  # the engines pass params and start (`uses_params`; `_prox_check`)
        total = sum(((w - batch.start[name]).pow(2).sum() for name, w in batch.params.items()),
                    torch.zeros((), device=batch.logits.device))
        return 0.5 * options.mu * total
    return term
