"""Additional loss terms (`loss.terms`): registered terms a plugin adds to the local objective.

    loss:
      terms:
        feature_norm: {weight: 0.01}

A term is `fn(batch: TermBatch, options) -> scalar tensor`, registered in `flare.registry.LOSS_TERMS` with an
options model that subclasses `TermOptions` (so every term has a `weight`; a term without options gets
`TermOptions`, the registry's default options model). The trainer adds `weight · fn(batch, options)` to the base loss and logs it as `term_<name>`
in every engine and the LR probe (client/step.py `local_loss`; under client_engine=batched the term is vmapped, so it
must not read values back to the host).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from flare.config import LossCfg
from flare.registry import LOSS_TERMS, TermOptions

__all__ = ["TermBatch", "TermOptions", "extra_terms"]


@dataclass(frozen=True)
class TermBatch:
    """What a loss term sees of a step: both views' features and logits, their labels, the head's prototypes."""

    feat: Tensor               # 2B×d, un-normalised
    logits: Tensor             # 2B×C
    y: Tensor                  # 2B labels
    prototypes: Tensor | None  # C×d (prototype head), else None


def extra_terms(loss: LossCfg, feat: Tensor, logits: Tensor, y: Tensor,
                prototypes: Tensor | None) -> dict[str, Tensor]:
    """`term_<name>: weight · fn(batch, options)` for every term of `loss.terms` (empty without any)."""
    if not loss.terms:
        return {}
    batch = TermBatch(feat, logits, y, prototypes)
    out = {}
    for name, mapping in loss.terms.items():
        opts = LOSS_TERMS.options(name, mapping, f"loss.terms.{name}")
        out[f"term_{name}"] = getattr(opts, "weight", 1.0) * LOSS_TERMS.get(name)(batch, opts)
    return out
