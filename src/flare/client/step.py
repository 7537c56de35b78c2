"""The local loss of one step, written once: the sequential and threads engines (`Client._step`), the batched engine
(`BatchedClients`, vmapped over the clients) and the LR probe all call `local_loss`, so a registered loss term or λ
provider means the same thing under every engine. The forward pass and the optimiser step stay with each engine: the
batched one runs a functional call over stacked client states and a functional SGD (client/batched.py: why)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from flare.client.lam import LamStep
from flare.client.objective import base_terms
from flare.client.terms.align import align_loss
from flare.client.terms.extra import extra_terms
from flare.config import Config


@dataclass
class StepLoss:
    terms: dict[str, Tensor]  # the named base and extra terms, as logged
    base: Tensor              # their sum: the weights' local loss before λ
    align: Tensor | None      # raw L_align, None without anchors
    lam: LamStep              # what the λ provider made of them

    def total(self) -> Tensor:
        """The weights' loss plus the provider's own (σ) loss, summed from the first part present, never from 0:
        inductor (torch 2.14) drops a `+ 0`, then lost the gradient of FedAvg's total, whose log holds it detached."""
        return sum((p for p in (self.lam.align, self.lam.sigma) if p is not None), self.lam.local)

    def logs(self) -> dict[str, Tensor]:
        """The step's logged numbers (detached tensors on the loss's device; no host sync)."""
        out = {k: v.detach() for k, v in self.terms.items()}
        out["base_loss"] = self.base.detach()
        if self.align is not None:
            out["align_loss"] = self.align.detach()
        out.update({k: v.detach() if isinstance(v, Tensor) else torch.as_tensor(v, device=self.base.device)
                    for k, v in self.lam.logs.items()})
        return out


def local_loss(cfg: Config, feat: Tensor, logits: Tensor, y: Tensor, prototypes: Tensor | None, *,
               target: Tensor | None, weigh: Callable[[Tensor, Tensor | None], LamStep], extension=None,
               epoch: int = 0, params: dict[str, Tensor] | None = None,
               start: dict[str, Tensor] | None = None) -> StepLoss:
    """The step's loss from a batch laid out as [view1; view2] (or one plain view): `target` is what the prototypes
    align to (None: no alignment), `weigh(base, align)` the λ provider at this step, `extension` a client's contrast
    extension (its bank joins FAFI's SupCon term; `adjust_terms` may rewrite the terms at `epoch`); `params` and
    `start` the model's trainable parameters and their start values, for the terms that read weights
    (`terms.extra.uses_params`)."""
    bank = extension.contrast_bank() if extension is not None else None
    terms = base_terms(cfg.loss, feat, logits, y, prototypes, bank)
    if extension is not None:
        terms = extension.adjust_terms(terms, feat, y, epoch)
    terms.update(extra_terms(cfg.loss, feat, logits, y, prototypes, params, start))  # loss.terms (plugins)
    first, *rest = terms.values()
    base = sum(rest, first)  # from the first term, not 0 + it (StepLoss.total)
    align = align_loss(prototypes, target) if target is not None else None
    return StepLoss(terms, base, align, weigh(base, align))
