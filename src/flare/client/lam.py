"""λ providers: how strongly a client pulls its prototypes towards the anchors.

A provider turns the step's `base` loss and raw `L_align` into the pieces the trainer backpropagates: `local`
and `align` (the weights' loss is local + align) plus an optional `sigma` loss for its own parameters. Keeping
the two weight parts apart is what lets gradient surgery (PCGrad) see them separately. Providers own their state
(e.g. the log-variances of V10–V14 and their optimizer), which travels in client checkpoints. One hierarchy:
`LamProvider` (no alignment, or λ0·a(p) with λ0 fixed or from the entropy rule) and its subclass `LamLearner`,
the learned alignment strength of docs/method.md#learned-λ-v10v14 (the notes' V10–V14; V14 is FLARE).

The learner's scalars `s_l = log σ²_local`, `s_a = log σ²_align`, their warm start and optimizer: that section; each
mode's losses: its table.

Gradient routing: `local`/`align` hold σ only through detached factors and `sigma` holds the weights' losses only
detached, so the trainer's single `(local + align + sigma).backward()` gives the weights and σ exactly the
gradients of their own losses, and gradient surgery over `local` and `align` never touches σ's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
from pydantic import BaseModel
from torch import Tensor

from flare.config import Config
from flare.errors import FlareError
from flare.registry import LAM_PROVIDERS, SCHEDULES, NoFacts


@dataclass(frozen=True)
class LamFacts:
    """What a λ provider is built from besides `lam.options`: the client's starting strength (align.lambda0, or the
    entropy rule), align.schedule's a(p), the device of its own parameters, and the built-in learners' `lam` keys."""
    lambda_init: float
    schedule: str
    device: torch.device
    sigma_lr: float
    anneal: str
    gamma_reg: float
    beta: float
    gamma_lambda: float
    valve_threshold: float


def lam_facts(cfg: Config, normalized_entropy: float, device: torch.device) -> LamFacts:
    """A client's λ-provider facts: its entropy-rule strength, and the run's `align.schedule` and `lam` keys."""
    lm = cfg.lam
    return LamFacts(initial_lambda(cfg, normalized_entropy), cfg.align.schedule, device, lm.sigma_lr, lm.anneal,
                    lm.gamma_reg, lm.beta, lm.gamma_lambda, lm.valve_threshold)


class LamProviderBuilder(Protocol):
    """What `LAM_PROVIDERS` holds: the λ provider a client asks for λ each step, built by `LAM_PROVIDERS.create`
    once per client (options: `lam.options`)."""
    def __call__(self, facts: LamFacts, options: BaseModel | None) -> LamProvider: ...


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
    return entropy_lambda(normalized_entropy, a.lambda_min, a.lambda_max) if a.lambda_rule == "entropy" else a.lambda0


class LamProvider:
    """No alignment, or a fixed λ0 (hand-set or from the entropy rule) times the schedule a(p)."""

    def __init__(self, lambda0: float, schedule: str = "constant"):
        self.lambda0 = lambda0
        self.schedule = SCHEDULES.create(schedule, NoFacts(), key="align.schedule")

    def __call__(self, base: Tensor, align: Tensor | None, p: float) -> LamStep:
        return self.weigh(base, align, self.strength(p))

    def strength(self, p: float) -> float:
        """The step's alignment strength at progress p: λ0·a(p) (the learner's: its annealing factor)."""
        return self.lambda0 * self.schedule(p)

    def weigh(self, base: Tensor, align: Tensor | None, strength: float | Tensor, state=None) -> LamStep:
        """The step's LamStep from `strength(p)` — a float, or (batched clients, under vmap) a tensor — and, for
        the learner, its σ state `(s_l, s_a)` (None: its own). One home for the arithmetic of both engines."""
        if align is None:
            return LamStep(base, None)
        # the log is made on the loss's device (a fill kernel): a CPU tensor would cost a blocking copy per step
        lam = strength if isinstance(strength, Tensor) else torch.full((), strength, device=align.device)
        return LamStep(base, strength * align, logs={"lambda": lam})

    def sigma_state(self) -> tuple[Tensor, ...]:
        """The provider's own trainable scalars (none for a fixed λ; the learner's s_l, s_a)."""
        return ()

    def step(self) -> None:
        """Update the provider's own parameters after backward (nothing to do for a fixed λ)."""

    def state_logs(self) -> dict[str, float]:
        """Values logged once per round (the learner's σ); none for a fixed λ."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def probe_loss(self, base: Tensor, align: Tensor | None) -> Tensor:
        """The weights' loss at p = 0, as the LR probe sees it (no σ step)."""
        st = self(base, align, 0.0)
        return st.local + st.align if st.align is not None else st.local


class LamLearner(LamProvider):
    """A λ provider with learnable log-variances (see the module docstring for the objectives)."""

    def __init__(self, mode: str, lambda_init: float, *, sigma_lr: float = 0.005, anneal: str = "constant",
                 gamma_reg: float = 0.0, beta: float = 0.0, gamma_lambda: float = 0.0, valve_threshold: float = 50.0,
                 device: torch.device | str = "cpu"):
        self.mode, self.lambda_init = mode, float(lambda_init)
        self.schedule = SCHEDULES.create(anneal, NoFacts(), key="lam.anneal")
        self.gamma_reg, self.beta = float(gamma_reg), float(beta)
        self.gamma_lambda, self.valve_threshold = float(gamma_lambda), float(valve_threshold)
        self.device = torch.device(device)
        self.s_l = torch.zeros((), device=self.device, requires_grad=True)
        self.s_a = torch.full((), -math.log(lambda_init), device=self.device, requires_grad=True)
        # The notes give σ its own learning rate (0.01 × the weights' lr first, then 0.005) and no other
        # optimizer setting: plain SGD, no momentum, no weight decay, never clipped with the weights.
        self.optimizer = torch.optim.SGD([self.s_l, self.s_a], lr=sigma_lr, momentum=0.0)

    # -- the LamProvider interface ---------------------------------------------------------------
    def strength(self, p: float) -> float:
        return float(self.schedule(p))         # V11's a(p), V12's meta-annealing s(p)

    def sigma_state(self) -> tuple[Tensor, ...]:
        return self.s_l, self.s_a

    def weigh(self, base: Tensor, align: Tensor | None, strength: float | Tensor, state=None) -> LamStep:
        if align is None:  # nothing to weigh: σ stay where they are
            return LamStep(base, None)
        s_l, s_a = state if state is not None else (self.s_l, self.s_a)
        a = strength
        b, la = base.detach().float(), align.detach().float()  # sg(base), sg(L_align)
        lam_raw = torch.exp(s_l - s_a)         # carries gradient to both σ (used by the valve)
        lam_raw_sg = lam_raw.detach()
        # ½e^{−s_l}·sg(base) + c·½e^{−s_a}·sg(L_align) + ½(s_l + s_a): the V10 objective as a function of σ
        uw_sigma = 0.5 * torch.exp(-s_l) * b + a * 0.5 * torch.exp(-s_a) * la + 0.5 * (s_l + s_a)
        logs: dict[str, Tensor] = {"lambda_raw": lam_raw_sg}
        lam_eff = a * lam_raw_sg                               # λ_eff = sg(s(p)·λ_raw)
        local, sigma = base, uw_sigma
        if self.mode == "uw":
            scale = 0.5 * torch.exp(-s_l).detach()             # the hidden learning-rate factor of V10
            local, align_w = scale * base, (0.5 * torch.exp(-s_a).detach() * a) * align
            logs["loss_scale"] = scale
        else:
            align_w = lam_eff * align
        if self.mode == "uw-rescaled":
            # L' = 2·sg(e^{s_l})·L: the weights see base + a·λ_raw·L_align (e^{s_l}·e^{−s_l} = 1 written
            # exactly), σ the gradient of 2·sg(e^{s_l}) times the V10 objective.
            sigma = 2.0 * torch.exp(s_l).detach() * uw_sigma
        elif self.mode == "decoupled":  # V12, + γ_reg (V13), + β and γ_λ (V14 = FLARE)
            if self.gamma_reg:
                sigma = sigma + self.gamma_reg * torch.exp(-s_a)                         # stability anchor
            if self.beta:
                sigma = sigma + self.beta * s_l.square()                                  # ceiling on s_l
            if self.gamma_lambda:
                sigma = sigma + self.gamma_lambda * torch.relu(lam_raw - self.valve_threshold)  # safety valve
        logs["lambda_eff"] = lam_eff
        logs["s_p"] = a if isinstance(a, Tensor) else torch.full((), a, device=self.device)  # no blocking copy
        return LamStep(local, align_w, sigma, logs)

    def probe_loss(self, base: Tensor, align: Tensor | None) -> Tensor:
        """At p = 0 the weights see base + λ_init·L_align (V10: all of it scaled by ½e^{−s_l} = ½)."""
        total = base + self.lambda_init * align if align is not None and self.lambda_init else base
        return (0.5 if self.mode == "uw" else 1.0) * total

    def step(self) -> None:
        """One σ step with the gradient the trainer's single backward left on s_l, s_a; then clear it."""
        sigma_sgd(self.sigma_state(), self.optimizer.param_groups[0]["lr"])

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


def sigma_sgd(sigma: tuple[Tensor, ...], lr: float, mask: Tensor | None = None) -> None:
    """σ ← σ − lr·∇σ, then clear the gradient: the σ step of both client engines (one client's (s_l, s_a), or the
    batched engine's stacks, where only the clients in `mask`, all when None, took part), with the arithmetic of the
    learner's `torch.optim.SGD` (`param.add_(grad, alpha=-lr)`). A σ without a gradient stays where it is."""
    with torch.no_grad():
        for s in sigma:
            if s.grad is None:
                continue
            new = s.add(s.grad, alpha=-lr)
            s.copy_(new if mask is None else torch.where(mask.view((-1,) + (1,) * (s.dim() - 1)), new, s))
            s.grad = None


def _safe_exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _learner(mode: str):
    def build(f: LamFacts, options: None) -> LamProvider:
        return LamLearner(mode, f.lambda_init, sigma_lr=f.sigma_lr, anneal=f.anneal, gamma_reg=f.gamma_reg,
                          beta=f.beta, gamma_lambda=f.gamma_lambda, valve_threshold=f.valve_threshold, device=f.device)
    return build


def _learner_check(mode: str):
    """What a learner needs of the config: anchors, its own annealing (lam.anneal), the decoupled σ objective's
    coefficients only for `decoupled`, and a positive finite λ_init (s_a = −log λ_init)."""
    def check(cfg: Config) -> None:
        cfg.require_anchors(f"lam.learner={mode}")
        a, lm = cfg.align, cfg.lam
        if a.schedule != "constant":
            raise FlareError(f"lam.learner={mode} anneals with lam.anneal, so align.schedule={a.schedule} would not "
                             "be applied.", key="align.schedule",
                             fix="set align.schedule=constant and choose lam.anneal instead.")
        if mode != "decoupled" and (lm.gamma_reg or lm.beta or lm.gamma_lambda):
            raise FlareError(f"lam.gamma_reg, lam.beta and lam.gamma_lambda act on the decoupled σ objective "
                             f"(V13/V14), not on lam.learner={mode}.", key="lam.learner",
                             fix="use lam.learner=decoupled, or set those coefficients to 0.")
        bounds = ("align.lambda_min", "align.lambda_max") if a.lambda_rule == "entropy" else ("align.lambda0",)
        for key in bounds:
            value = getattr(a, key.split(".")[1])
            if not (math.isfinite(value) and value > 0):
                raise FlareError(f"the λ learner starts from λ_init = exp(s_l − s_a), positive and finite, so "
                                 f"{key} must be a positive finite number (got {value}).", key=key,
                                 fix=f"set {key} to a finite number > 0.")
    return check


LAM_PROVIDERS.register("none", lambda facts, options: LamProvider(facts.lambda_init, facts.schedule),
                       description="no learner: λ0 (align.lambda_rule) times align.schedule's a(p)")
for _mode, _what in (("uw", "V10: uncertainty weighting, one objective"),
                     ("uw-rescaled", "V10r/V11: uw rescaled by sg(e^{s_l})"),
                     ("decoupled", "V12–V14 (FLARE): decoupled σ objective")):
    LAM_PROVIDERS.register(_mode, _learner(_mode), description=_what, check=_learner_check(_mode))


def runaway_warnings(cfg: Config, client_records: list[dict]) -> list[str]:
    """The notes' failure mode made visible: λ_raw running past 100 × the valve threshold, or non-finite."""
    limit = 100 * cfg.lam.valve_threshold
    out = []
    for rec in client_records:
        v = rec.get("lambda_raw")
        if v is not None and (not math.isfinite(v) or v > limit):
            out.append(f"client {rec['client']}, round {rec['round'] + 1}: lambda_raw = {v:.4g} exceeds 100 x "
                       f"lam.valve_threshold ({limit:g}) — the learned alignment strength is running away.")
    return out
