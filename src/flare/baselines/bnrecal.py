"""BatchNorm recalibration on the server's public slice: `bnrecal`. Each client's BatchNorm statistics were gathered
on its own skewed data, a large part of the one-shot gap; this server re-estimates them on copies of the client
models over the unlabeled public slice (`dataset.public_size`), then fuses the K recalibrated models with a rule that
needs no noise pass. The measurement that motivates it, the merge and the rules: docs/baselines.md, `bnrecal`.
"""
from __future__ import annotations

import copy

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import Tensor, nn

from flare.baselines.kd import BN, Cost, public_slice, require_public
from flare.errors import FlareError
from flare.registry import STRATEGIES
from flare.server.fusion import client_outputs
from flare.server.rounds import head_primary
from flare.server.rules import ClientRule, OutputRule, RulePredictor
from flare.server.strategy import ModelPredictor, ServerContext, Strategy

class BNRecalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rule: str = Field(
        "auto", description="fusion of the recalibrated models: a rule over the client outputs that needs no noise "
                            "pass (feature, for prototype heads; output), or auto (the head's primary)")
    batch_size: int = Field(256, ge=2, description="public images per train-mode pass (the test batch size of the "
                                                   "per-batch-statistics measurement)")

    @field_validator("rule")
    @classmethod
    def _one_pass_rule(cls, v: str) -> str:  # a rule the recalibrated models' one pass serves
        if v != "auto" and v not in (fits := [n for n in STRATEGIES.names() if issubclass(
                c := STRATEGIES.get(n), ClientRule) and not c.needs_noise]):
            raise ValueError(f"rule {v!r} is none of auto, {', '.join(fits)}")
        return v


class _Moments:
    """Per-channel count, mean and sum of squared deviations of a BatchNorm layer's inputs, merged across batches."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, None, None

    def __call__(self, module: nn.Module, inputs: tuple) -> None:
        x = inputs[0].detach().double()
        dims = [0, *range(2, x.dim())]
        nb = x.numel() // x.shape[1]
        mb = x.mean(dims)
        m2b = ((x - mb.view(1, -1, *([1] * (x.dim() - 2)))) ** 2).sum(dims)
        if self.mean is None:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        n = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / n)
        self.m2 = self.m2 + m2b + delta ** 2 * (self.n * nb / n)
        self.n = n


@torch.no_grad()
def recalibrate(model: nn.Module, x: Tensor, normalize, batch_size: int = 256) -> nn.Module:
    """A deep copy of `model` whose BatchNorm running statistics are the mean and unbiased variance of each layer's
    inputs over the uint8 images `x` (normalised per batch by `normalize`); eval mode."""
    m = copy.deepcopy(model).eval()
    bns = [b for b in m.modules() if isinstance(b, BN) and b.track_running_stats]
    moments = [_Moments() for _ in bns]
    hooks = [b.register_forward_pre_hook(mo) for b, mo in zip(bns, moments)]
    try:
        for b in bns:
            b.train()
        starts = range(0, x.shape[0], batch_size)
        for s in starts:
            m(normalize(x[s:s + batch_size]))
    finally:
        for h in hooks:
            h.remove()
        m.eval()
    for b, mo in zip(bns, moments):
        if mo.mean is None:
            continue
        b.running_mean.copy_(mo.mean.to(b.running_mean.dtype))
        b.running_var.copy_((mo.m2 / max(1, mo.n - 1)).to(b.running_var.dtype))
        if b.num_batches_tracked is not None:
            b.num_batches_tracked.fill_(len(starts))
    return m


class RecalibratedPredictor(ModelPredictor):
    """Scores a batch with a built-in rule over the K recalibrated models' outputs. `model` holds them as one
    ModuleList (so a Flower run, which saves one model of the run's architecture, declines to save it)."""

    def __init__(self, models: list[nn.Module], rule: RulePredictor, logs: dict[str, float]):
        super().__init__(nn.ModuleList(models), logs)
        self.models, self.rule = models, rule

    def scores(self, x: Tensor) -> Tensor:
        return self.rule.scores(client_outputs(self.models, x))


@STRATEGIES.register("bnrecal", options=BNRecalOptions)
class BNRecal(Strategy):
    """The clients' BatchNorm statistics re-estimated on the public slice, then the feature or output rule."""

    mixed_architectures = True  # each client model is recalibrated on its own

    @classmethod
    def check(cls, cfg) -> None:  # at config validation: before any client trains
        require_public(cfg, "bnrecal")

    def __init__(self, facts, options: BNRecalOptions | None = None):
        super().__init__(facts, options)
        self.rule = head_primary(facts.head) if self.options.rule == "auto" else self.options.rule
        if STRATEGIES.get(self.rule).needs_prototypes and facts.head != "prototype":
            raise FlareError(f"bnrecal with rule={self.rule} matches features to prototypes, which loss.objective="
                             f"{facts.objective} (a {facts.head} head) has not.", key="server.strategies.bnrecal.rule",
                             fix="use rule=auto, or a rule that reads no prototypes.")

    def predictor(self, ctx: ServerContext) -> RecalibratedPredictor:
        cost = Cost(ctx.device)
        pub = public_slice(ctx, "bnrecal")
        models = [recalibrate(m, pub, ctx.normalize, self.options.batch_size) for m in ctx.models]
        size = sum(t.numel() * t.element_size() for m in models for t in [*m.parameters(), *m.buffers()])
        logs = {**cost.logs(), "public": float(pub.shape[0]), "copies_mb": size / 2 ** 20}
        rule = RulePredictor(STRATEGIES.get(self.rule), ctx.weights, ctx.G, self.options_of(OutputRule).ensemble)
        return RecalibratedPredictor(models, rule, logs)
