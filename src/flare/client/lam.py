"""λ providers: how strongly a client pulls its prototypes towards the anchors.

A provider turns the step's `base` loss and raw `L_align` into the pieces the trainer backpropagates:
`local` and `align` (the weights' loss is local + align) plus an optional `sigma` loss for its own
parameters. Keeping the two weight parts apart is what lets gradient surgery (PCGrad) see them
separately. Providers own their state (e.g. the log-variances of V10–V14 and their optimizer), which
travels in client checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flare.config import Config
from flare.schedules import get_schedule


@dataclass
class LamStep:
    local: Tensor                 # the weights' local part (usually `base`)
    align: Tensor | None          # the weights' alignment part (λ·L_align), None without alignment
    sigma: Tensor | None = None   # loss for the provider's own parameters (V12–V14's L_σ)
    logs: dict[str, Tensor] = field(default_factory=dict)


def entropy_lambda(normalized_entropy: float, lambda_min: float, lambda_max: float) -> float:
    """V9 / Plan A: λ0_i = λ_min + (H_i / log2 C)·(λ_max − λ_min)."""
    return lambda_min + normalized_entropy * (lambda_max - lambda_min)


def initial_lambda(cfg: Config, normalized_entropy: float) -> float:
    a = cfg.align
    if a.lambda_rule == "entropy":
        return entropy_lambda(normalized_entropy, a.lambda_min, a.lambda_max)
    return a.lambda0


class LamProvider:
    """No alignment, or a fixed λ0 (hand-set or from the entropy rule) times the schedule a(p)."""

    def __init__(self, lambda0: float, schedule: str = "constant"):
        self.lambda0 = lambda0
        self.schedule = get_schedule(schedule, "align.schedule")

    def parameters(self) -> list[Tensor]:
        return []

    def __call__(self, base: Tensor, align: Tensor | None, p: float) -> LamStep:
        if align is None:
            return LamStep(base, None)
        lam = self.lambda0 * self.schedule(p)
        # the log is made on the loss's device (a fill kernel): a CPU tensor would cost a blocking copy per step
        return LamStep(base, lam * align, logs={"lambda": torch.full((), lam, device=align.device)})

    def step(self) -> None:
        """Update the provider's own parameters after backward (nothing to do for a fixed λ)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_lam_provider(cfg: Config, normalized_entropy: float, device: torch.device) -> LamProvider:
    lam0 = initial_lambda(cfg, normalized_entropy)
    if cfg.lam.learner == "none":
        return LamProvider(lam0, cfg.align.schedule)
    from flare.client.lam_learner import make_learner  # V10–V14 live in their own module

    return make_learner(cfg, lam0, device)
