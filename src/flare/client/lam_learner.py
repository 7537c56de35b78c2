"""The learned alignment strength of SPEC §7 (the notes' V10–V14; V14 is FLARE).

Each client owns two scalars, `s_l = log σ²_local` and `s_a = log σ²_align`, and their own optimizer
(plain SGD, `lam.sigma_lr`), kept across rounds and in the client's checkpoints. Warm start from the
entropy rule of V9: `s_l = 0`, `s_a = −log λ_init`, so that `λ_raw = exp(s_l − s_a)` starts at `λ_init`.

Modes (`lam.learner`):

* `uw` (V10), one objective for weights and σ (Kendall et al. 2018):
  `L = ½e^{−s_l}·base + ½e^{−s_a}·a(p)·L_align + ½(s_l + s_a)`.
* `uw-rescaled` (V10-rescaled; V11 with `lam.anneal` linear/cosine): `L' = 2·sg(e^{s_l})·L`; the weights
  see `base + a(p)·λ_raw·L_align`, σ follow `L'`.
* `decoupled` (V12; V13 with `gamma_reg`; V14 = FLARE with `beta`, `gamma_lambda`):
  weights `L_w = base + λ_eff·L_align`, `λ_eff = sg(s(p)·λ_raw)`;
  σ `L_σ = ½e^{−s_l}·sg(base) + s(p)·½e^{−s_a}·sg(L_align) + ½(s_l + s_a)
         + γ_reg·e^{−s_a} + β·s_l² + γ_λ·ReLU(exp(s_l − s_a) − λ_max)`.

Gradient routing. In every mode the trainer's single `(local + align + sigma).backward()` gives the weights
exactly the gradient of their loss and σ exactly the gradient of theirs: `local`/`align` hold σ only
through detached factors, and `sigma` holds the weights' losses only detached. For `uw`/`uw-rescaled`
this split reproduces the gradients of the single objective `L` (resp. `L'`) term by term; keeping σ's
objective in `sigma` in every mode also means gradient surgery (PCGrad), which looks at `local` and `align`
over the weights only, never drops or distorts σ's gradient. No second forward, no second backward.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from flare.client.lam import LamStep
from flare.config import Config
from flare.errors import FlareError
from flare.schedules import get_schedule

MODES = ("uw", "uw-rescaled", "decoupled")


class LamLearner:
    """A λ provider with learnable log-variances (see the module docstring for the objectives)."""

    def __init__(self, mode: str, lambda_init: float, *, sigma_lr: float = 0.005, anneal: str = "constant",
                 gamma_reg: float = 0.0, beta: float = 0.0, gamma_lambda: float = 0.0, lambda_max: float = 50.0,
                 device: torch.device | str = "cpu"):
        if mode not in MODES:
            raise FlareError(f"unknown λ learner '{mode}'.", key="lam.learner",
                             fix=f"use none or one of: {', '.join(MODES)}.")
        if not (math.isfinite(lambda_init) and lambda_init > 0):
            raise FlareError(f"the λ learner needs a positive initial λ (s_a = −log λ_init), got {lambda_init}.",
                             key="align.lambda_min",
                             fix="set align.lambda_min > 0 (entropy rule) or align.lambda0 > 0 (fixed rule).")
        if mode != "decoupled" and (gamma_reg or beta or gamma_lambda):
            raise FlareError(f"lam.gamma_reg, lam.beta and lam.gamma_lambda act on the decoupled σ objective "
                             f"(V13/V14), not on lam.learner={mode}.", key="lam.learner",
                             fix="use lam.learner=decoupled, or set those coefficients to 0.")
        self.mode = mode
        self.lambda_init = float(lambda_init)
        self.schedule = get_schedule(anneal, "lam.anneal")
        self.gamma_reg, self.beta = float(gamma_reg), float(beta)
        self.gamma_lambda, self.lambda_max = float(gamma_lambda), float(lambda_max)
        self.device = torch.device(device)
        self.s_l = torch.zeros((), device=self.device, requires_grad=True)
        self.s_a = torch.full((), -math.log(lambda_init), device=self.device, requires_grad=True)
        # The notes give σ its own learning rate (0.01 × the weights' lr first, then 0.005) and no other
        # optimizer setting: plain SGD, no momentum, no weight decay, never clipped with the weights.
        self.optimizer = torch.optim.SGD([self.s_l, self.s_a], lr=sigma_lr, momentum=0.0)

    # -- the LamProvider interface ---------------------------------------------------------------
    def parameters(self) -> list[Tensor]:
        return [self.s_l, self.s_a]

    def lambda_raw(self) -> float:
        return math.exp(self.s_l.item() - self.s_a.item())

    def __call__(self, base: Tensor, align: Tensor | None, p: float) -> LamStep:
        if align is None:  # nothing to weigh: σ stay where they are
            return LamStep(base, None)
        s_l, s_a = self.s_l, self.s_a
        a = float(self.schedule(p))            # V11's a(p), V12's meta-annealing s(p)
        b = base.detach().float()              # sg(base)
        la = align.detach().float()            # sg(L_align)
        lam_raw = torch.exp(s_l - s_a)         # carries gradient to both σ (used by the valve)
        lam_raw_sg = lam_raw.detach()
        # ½e^{−s_l}·sg(base) + c·½e^{−s_a}·sg(L_align) + ½(s_l + s_a): the V10 objective as a function of σ
        uw_sigma = 0.5 * torch.exp(-s_l) * b + a * 0.5 * torch.exp(-s_a) * la + 0.5 * (s_l + s_a)
        logs: dict[str, Tensor] = {"lambda_raw": lam_raw_sg}
        if self.mode == "uw":
            scale = 0.5 * torch.exp(-s_l).detach()             # the hidden learning-rate factor of V10
            local = scale * base
            align_w = (0.5 * torch.exp(-s_a).detach() * a) * align
            sigma = uw_sigma
            lam_eff = a * lam_raw_sg
            logs["loss_scale"] = scale
        elif self.mode == "uw-rescaled":
            # L' = 2·sg(e^{s_l})·L: the weights see base + a·λ_raw·L_align (e^{s_l}·e^{−s_l} = 1 written
            # exactly), σ the gradient of 2·sg(e^{s_l}) times the V10 objective.
            lam_eff = a * lam_raw_sg
            local = base
            align_w = lam_eff * align
            sigma = 2.0 * torch.exp(s_l).detach() * uw_sigma
        else:  # decoupled: V12, + γ_reg (V13), + β and γ_λ (V14 = FLARE)
            lam_eff = a * lam_raw_sg                            # λ_eff = sg(s(p)·λ_raw)
            local = base
            align_w = lam_eff * align
            sigma = uw_sigma
            if self.gamma_reg:
                sigma = sigma + self.gamma_reg * torch.exp(-s_a)                         # stability anchor
            if self.beta:
                sigma = sigma + self.beta * s_l.square()                                  # ceiling on s_l
            if self.gamma_lambda:
                sigma = sigma + self.gamma_lambda * torch.relu(lam_raw - self.lambda_max)  # safety valve
        logs["lambda_eff"] = lam_eff
        logs["s_p"] = torch.tensor(a, device=self.device)
        return LamStep(local, align_w, sigma, logs)

    def step(self) -> None:
        """One σ step with the gradient the trainer's single backward left on s_l, s_a; then clear it."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_logs(self) -> dict[str, float]:
        s_l, s_a = self.s_l.item(), self.s_a.item()
        return {"s_l": s_l, "s_a": s_a, "lambda_raw_end": _safe_exp(s_l - s_a)}

    # -- checkpoints (tensors and plain numbers only: torch.load(weights_only=True) reads them) -----
    def state_dict(self) -> dict:
        return {"mode": self.mode, "s_l": self.s_l.detach().clone(), "s_a": self.s_a.detach().clone(),
                "lambda_init": self.lambda_init, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode", self.mode) != self.mode:
            raise FlareError(f"checkpoint holds a '{state['mode']}' λ learner, this run uses '{self.mode}'.",
                             key="lam.learner", fix="resume with the configuration the run was started with.")
        with torch.no_grad():
            self.s_l.copy_(torch.as_tensor(state["s_l"]).to(self.device))
            self.s_a.copy_(torch.as_tensor(state["s_a"]).to(self.device))
        self.lambda_init = float(state.get("lambda_init", self.lambda_init))
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])


def _safe_exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def make_learner(cfg: Config, lam0: float, device: torch.device) -> LamLearner:
    """The λ learner `cfg.lam` describes, warm-started at `lam0` (the entropy rule's λ_init)."""
    if cfg.align.anchors == "none":
        raise FlareError(f"lam.learner={cfg.lam.learner} learns the strength of the alignment term, but "
                         "align.anchors=none gives no alignment term.", key="align.anchors",
                         fix="set align.anchors=etf (or random), or lam.learner=none.")
    if cfg.align.schedule != "constant":
        raise FlareError(f"lam.learner={cfg.lam.learner} anneals with lam.anneal; align.schedule="
                         f"{cfg.align.schedule} would not be applied.", key="align.schedule",
                         fix="set align.schedule=constant and choose lam.anneal instead.")
    lm = cfg.lam
    return LamLearner(lm.learner, lam0, sigma_lr=lm.sigma_lr, anneal=lm.anneal, gamma_reg=lm.gamma_reg,
                      beta=lm.beta, gamma_lambda=lm.gamma_lambda, lambda_max=lm.lambda_max, device=device)
