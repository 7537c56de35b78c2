"""The server's one extension point: a `Strategy` turns the clients' uploads into a *predictor*, an
object that scores test batches. Like Flower's Strategy it is the only thing a server method implements; unlike
it, FLARE is one-shot, so a strategy builds a predictor instead of the next round's global parameters.

Two kinds of predictor keep ONE test pass for every strategy of an evaluation (server/evaluator.py):

* `ClientPredictor` reads the K client models' outputs on the batch (features, logits, IFFI's noise features),
  which the evaluator computes once and hands to every such predictor — the ensemble-style rules;
* `ModelPredictor` owns a model built from the uploads (FedAvg here; the weight-fusion, distillation and
  BN-recalibration baselines in src/flare/baselines) and scores the normalised batch itself.

A strategy is registered in `flare.registry.STRATEGIES` (a plugin registers its own the same way), chosen by
`server.primary` and `eval.rules`, and its options model is validated from `server.strategies.<name>`. The
built-in rules (docs/method.md#built-in-rules) are registered here; their arithmetic stays in server/fusion.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from pydantic import BaseModel
from torch import Tensor, nn

from flare.config import Config
from flare.registry import STRATEGIES
from flare.server.fusion import FEATURE_RULES, fedavg_model, rule_scores
from flare.server.upload import Upload


@dataclass
class ServerContext:
    """What a strategy sees at one evaluation: the uploads, the models holding their states (eval mode, on the
    evaluation device), the aggregation weights (`server.weights`), the global prototypes G and the anchors of this
    round, and `state`, the strategy's own dict kept across the rounds of one process (not in checkpoints).
    `extras[i]`: the statistics this strategy asked client i for (`Strategy.client_extras`), without the prefix.
    `public_x`: the server's unlabeled public slice (uint8 images, `dataset.public_size`; None without one) and
    `normalize`, the run's uint8 → model-input map — for servers that distil or recalibrate on data."""

    cfg: Config
    round: int
    uploads: list[Upload]
    models: list[nn.Module]
    weights: Tensor
    G: Tensor | None
    anchors: Tensor | None
    state: dict = field(default_factory=dict)
    extras: list[dict[str, Tensor]] = field(default_factory=list)
    public_x: Tensor | None = None
    normalize: Callable[[Tensor], Tensor] | None = None
    input_shape: tuple[int, int, int] | None = None  # C×H×W of one input image (synthetic-data servers)

    @property
    def device(self) -> torch.device:
        return self.weights.device if not self.models else next(self.models[0].parameters()).device


@dataclass
class ClientOutputs:
    """The K client models' outputs on one test batch: features K×B×d, logits K×B×C and, when a predictor asked
    for them, the features of the IFFI noise input K×B×d (under eval.bn=batch `feats` is the train-mode pass)."""

    feats: Tensor
    logits: Tensor
    noise_feats: Tensor | None = None


class ClientPredictor:
    """Scores a batch from the client models' outputs. `needs_noise`: the evaluator also computes the noise
    features; `batch_bn`: eval.bn=batch gives this predictor the train-mode (batch-statistics) features. `logs`
    (either predictor kind): numbers about how it was built, written into the round record as `<strategy>.<key>`."""

    needs_noise = False
    batch_bn = False
    logs: dict[str, float] = {}

    def scores(self, out: ClientOutputs) -> Tensor:
        """B×C scores; the prediction is their argmax."""
        raise NotImplementedError


class ModelPredictor:
    """Scores the normalised batch with its own model (called under the run's autocast); the default reads the
    model's logits, the second output of a FLARE model."""

    logs: dict[str, float] = {}

    def __init__(self, model: nn.Module, logs: dict[str, float] | None = None):
        self.model = model.eval()
        self.logs = dict(logs or {})

    def scores(self, x: Tensor) -> Tensor:
        return self.model(x)[1].float()


Predictor = ClientPredictor | ModelPredictor


class Strategy:
    """Builds the predictor of one server method from the uploads. Class attributes: `needs_prototypes` (only for
    prototype heads), `every_round` (False: an expensive method runs at the last round only), `default` (evaluated
    when `eval.rules` is unset; the built-in rules are, a plugin's strategy only when named).

    A strategy that needs client statistics beyond the weights overrides `extras_shapes` and `client_extras`
    (server/extras.py): the clients compute them after training, the gate checks them against the declaration,
    and `predictor` reads them from `ctx.extras`."""

    needs_prototypes = False
    every_round = True
    default = False

    def __init__(self, cfg: Config, options: BaseModel | None = None):
        self.cfg, self.options = cfg, options

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Raise a FlareError when `cfg` cannot serve this strategy (e.g. it trains on a public slice the config
        does not carve out). Called when the config is validated, so a run fails before any client trains."""

    def predictor(self, ctx: ServerContext) -> Predictor:
        raise NotImplementedError

    def extras_shapes(self, template: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name → (shape, dtype) of each statistic a client uploads for this strategy (none by default), from the
        run's model `template`."""
        return {}

    def client_extras(self, data) -> dict[str, Tensor]:
        """The statistics of one client (`data`: a server.extras.ClientData), computed where its data lives."""
        return {}


def make_strategy(cfg: Config, name: str, key: str = "server.primary") -> Strategy:
    """The registered strategy `name` with its options from `server.strategies.<name>`."""
    cls = STRATEGIES.get(name, key)
    opts = STRATEGIES.options(name, cfg.server.strategies.get(name), f"server.strategies.{name}")
    return cls(cfg, opts)


# ----------------------------------------------------------------------------------------------
# the built-in rules (docs/method.md#built-in-rules)


class RulePredictor(ClientPredictor):
    """One of fusion.py's rules over the client outputs, with the weights and G moved to the batch's device."""

    def __init__(self, rule: str, weights: Tensor, G: Tensor | None, ensemble: str = "softmax"):
        self.rule, self.weights, self.G, self.ensemble = rule, weights, G, ensemble
        self.needs_noise = rule in ("iffi", "iffi_reference")
        self.batch_bn = rule in FEATURE_RULES

    def scores(self, out: ClientOutputs) -> Tensor:
        w = self.weights.to(out.logits.device)
        return rule_scores(self.rule, out.feats, out.logits, w, self.G, out.noise_feats, self.ensemble)


def rule_predictor(rule: str, models: list[nn.Module], weights: Tensor, G: Tensor | None, ensemble: str = "softmax",
                   fedavg_buffers: str = "average") -> Predictor:
    """The predictor of a built-in rule (also used by `evaluator.evaluate`, which takes rule names)."""
    if rule == "fedavg":
        return ModelPredictor(fedavg_model(models, weights, fedavg_buffers))
    if rule not in ("feature", "iffi", "iffi_reference", "output"):
        raise ValueError(f"unknown server rule {rule!r}")
    return RulePredictor(rule, weights, G, ensemble)


class _Rule(Strategy):
    rule = ""
    default = True

    def predictor(self, ctx: ServerContext) -> Predictor:
        s = self.cfg.server
        return rule_predictor(self.rule, ctx.models, ctx.weights, ctx.G, s.ensemble, s.fedavg_buffers)


def _register(name: str, needs_prototypes: bool, doc: str) -> None:
    cls = type(f"{name.title().replace('_', '')}Strategy", (_Rule,),
               {"rule": name, "needs_prototypes": needs_prototypes, "__doc__": doc})
    STRATEGIES.register(name, cls)


_register("feature", True, "Σ_i w_i f_i(x) matched to the global prototypes G (FAFI's server).")
_register("iffi", True, "Features weighted per sample by their informativeness against a noise input.")
_register("iffi_reference", True, "The seeds' IFFI code: exactly uniform feature fusion (reproduces their numbers).")
_register("output", False, "Σ_i w_i softmax(logits_i) (or raw logits: server.ensemble) — the output ensemble.")
_register("fedavg", False, "One-shot FedAvg: the weighted average of the uploaded models (server.fedavg_buffers).")
