"""The server's one extension point, a `Strategy`, in two roles: a `ServerProtocol` (what every client receives,
what the server keeps and folds across rounds: Flower's configure / aggregate) and a `Scorer` (the uploads and that
state to a *predictor*, an object that scores test batches — FLARE is one-shot, so the last step builds a predictor,
not the next round's parameters). Two kinds of predictor keep ONE test pass for every strategy (server/evaluator.py):
`ClientPredictor` reads the K client models' outputs on the batch, computed once for all — the ensemble-style rules;
`ModelPredictor` owns a model built from the uploads (FedAvg, OTFusion, FedLPA, FedDF …) and scores the batch itself.
A strategy is registered in `flare.registry.STRATEGIES` and built once per run from `StrategyFacts` (never the
Config) and its options, `server.strategies.<name>`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch
from pydantic import BaseModel
from torch import Tensor, nn

from flare.config import Config
from flare.config.architectures import server_architecture
from flare.registry import STRATEGIES
from flare.server.fusion import ClientOutputs
from flare.server.upload import Upload


@dataclass(frozen=True)
class StrategyFacts:
    """The run facts a strategy is built from besides its options; `strategies`: every rule's options
    (`Strategy.options_of`)."""
    seed: int
    head: str
    objective: str
    primary: str
    strategies: Mapping[str, Any]
    server_architecture: Any  # flare.config.architectures.Architecture
    feature_dim: int | None
    server_model: bool
    server_checkpoint: bool
    mixed_architectures: bool


def strategy_facts(cfg: Config) -> StrategyFacts:
    """The run facts every strategy of `cfg` is built from (one place reads them from the config)."""
    own = cfg.server.model
    return StrategyFacts(cfg.seed, cfg.head, cfg.loss.objective, cfg.server.primary, cfg.server.strategies,
                         server_architecture(cfg), cfg.model.feature_dim, own is not None,
                         own is not None and own.checkpoint is not None, cfg.mixed_architectures)


class StrategyClass(Protocol):
    """What `STRATEGIES` holds: a `Strategy` subclass (below)."""
    def __call__(self, facts: StrategyFacts, options: BaseModel | None) -> Strategy: ...


@dataclass
class ServerContext:
    """What a strategy sees at one evaluation: the uploads, the models holding their states (eval mode, on the
    evaluation device), the aggregation weights, G and the anchors, and `state`, the strategy's own dict across the
    rounds of one process (not in checkpoints). `extras[i]`: the statistics it asked client i for, unprefixed.
    `public_x`: the server's unlabeled public slice (uint8; None without one). `score`: the test accuracy of a model
    it is still building, for the record only — a strategy must never choose with it (None without a test set).
    `scratch`: its own folder where a build of hours keeps its progress to resume (`flare fuse` gives one)."""

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
    score: Callable[[nn.Module], float] | None = None
    scratch: Path | None = None

    @property
    def device(self) -> torch.device:
        return self.weights.device if not self.models else next(self.models[0].parameters()).device


@dataclass
class InitContext:
    """For `Strategy.initialize`: each client architecture's init by its key (`setup.init_keys`), the public bank
    (or None) and the anchors' seed."""
    inits: dict[str, nn.Module]
    bank: Tensor | None
    anchor_seed: int


class ClientPredictor:
    """Scores a batch from the client models' outputs (`needs_noise`: and the noise input's; `batch_bn`: the
    train-mode features under eval.bn=batch). `logs` (either kind): written into the round record."""

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


class ServerProtocol:
    """The sending role: what every client receives once (`initialize`, Flower's initialize_parameters) and with each
    round (`configure_train`); what the server keeps across rounds (`initial_state`) and folds the uploads into
    (`fold`); the rounds it holds with the clients after their upload (`extra_rounds` → `configure_round` → each
    client's `client_round` → `aggregate_round`, server/exchange.py). Every default sends and keeps nothing."""

    def initial_state(self, anchors: Tensor | None) -> dict[str, Tensor]:
        """What the server keeps before round 0."""
        return {}

    def initialize(self, ctx: InitContext) -> dict[str, Tensor]:
        """What every client receives once, before its first round."""
        return {}

    def configure_train(self, rnd: int, carried: dict[str, Tensor]) -> dict[str, Tensor]:
        """What every client receives with round `rnd`'s training message; `carried`: what the protocols keep."""
        return {}

    def fold(self, r: int, uploads: list[Upload], anchors: Tensor | None,
             kept: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor] | None, dict]:
        """(what round `r`'s scorers read — `G` —, what it keeps next — None: unchanged —, the record's logs)."""
        return {}, None, {}

    def extra_rounds(self) -> int:
        """How many rounds it holds with the clients after their upload (0: none, as every one-shot method)."""
        return 0

    def configure_round(self, rnd: int, ctx: ServerContext) -> dict[str, Tensor]:
        """What every client receives in extra round `rnd` (0-based); its bytes are counted."""
        return {}

    def client_round(self, rnd: int, received: dict[str, Tensor], data, memory: dict) -> dict[str, Tensor]:
        """One client's reply, computed where its data lives (`data`: a server.extras.ClientData); `memory`: that
        client's dict of tensors across these rounds."""
        return {}

    def aggregate_round(self, rnd: int, replies: list[dict[str, Tensor]], ctx: ServerContext) -> None:
        """Fold the clients' replies (in upload order) into what the strategy keeps (`ctx.state`)."""


class Scorer:
    """The scoring role: from the uploads and the server's state (`ServerContext`) to a predictor. A scorer that
    needs client statistics beyond the weights overrides `extras_shapes` and `client_extras` (server/extras.py): the
    clients compute them after training, the gate checks them against the declaration, `predictor` reads them."""

    needs_prototypes = False     # it reads prototypes: prototype heads only
    every_round = True           # False: an expensive method runs at the last round only
    default = False              # scored when `eval.rules` is unset (the built-in rules; a plugin's only when named)
    mixed_architectures = False  # it fuses clients of different architectures (docs/heterogeneous.md)
    one_architecture_why = ""    # why not, for the refusal (empty: it does not declare that it does)
    # the heads whose runs take it as "the" accuracy under server.primary=auto ("*": every head no other claims)
    primary_for: tuple[str, ...] = ()
    # the kinds of data its server can read (`DatasetInfo.kind`): one that synthesises images cannot run on features
    inputs: tuple[str, ...] = ("images", "features")
    shares_extras = ""  # the name of statistics other strategies read too ("": its own)

    def __init__(self, facts: StrategyFacts, options: BaseModel | None = None):
        self.facts, self.options = facts, options if options is not None else self.options_from(facts.strategies)

    @classmethod
    def options_in(cls, cfg: Config) -> BaseModel | None:
        """Its options as `cfg` sets them, for code applying its arithmetic unbuilt (a saved predictor)."""
        return cls.options_from(cfg.server.strategies)

    @classmethod
    def options_from(cls, table: Mapping[str, Any]) -> BaseModel | None:
        """Its options as the table `server.strategies` sets them (defaults filled in; None: not registered)."""
        name = next((n for n in STRATEGIES.names() if STRATEGIES.get(n) is cls), None)
        return STRATEGIES.options(name, table.get(name), f"server.strategies.{name}") if name else None

    def options_of(self, other: type[Strategy]) -> BaseModel | None:
        """Another strategy's options as this run sets them, for a strategy that applies its arithmetic."""
        return other.options_from(self.facts.strategies)

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Raise a FlareError when `cfg` cannot serve this strategy (e.g. it trains on a public slice the config
        does not carve out). Called when the config is validated, so a run fails before any client trains."""

    def check_data(self, histogram, data) -> None:
        """Raise a FlareError when the drawn partition (`histogram`: K×C class counts) or the dataset (`data`, an
        ImageData) leaves this strategy nothing to build from: called after the split, before any client trains."""

    def predictor(self, ctx: ServerContext) -> Predictor:
        raise NotImplementedError

    def extras_shapes(self, template: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name → (shape, dtype) of each statistic a client uploads for this strategy, from the run's model."""
        return {}

    def client_extras(self, data) -> dict[str, Tensor]:
        """The statistics of one client (`data`: a server.extras.ClientData), computed where its data lives."""
        return {}


class Strategy(Scorer, ServerProtocol):
    """A server method (Flower's Strategy: it owns both directions): a scorer and, as the run's primary, the protocol
    the clients hear; it overrides the hooks of the roles it plays (FENS: the rounds after the upload)."""

    def initialize(self, ctx: InitContext) -> dict[str, Tensor]:
        """Each architecture's init (`<key>/<tensor>`, read back with `sent_init`), `anchor_seed` and the public
        `bank`: the clients take these from here alone, so a strategy may send another init or seed."""
        sent = {f"{key}/{name}": t for key, m in ctx.inits.items() for name, t in m.state_dict().items()}
        return sent | {"anchor_seed": torch.tensor(ctx.anchor_seed)} | ({} if ctx.bank is None else {"bank": ctx.bank})


def sent_init(sent: dict[str, Tensor], key: str) -> dict[str, Tensor]:
    """The state dict of the init `Strategy.initialize` sent under `key` (empty: none)."""
    return {k[len(key) + 1:]: t for k, t in sent.items() if k.startswith(key + "/")}


def make_strategy(cfg: Config, name: str, key: str = "server.primary") -> Strategy:
    """The registered strategy `name` built from the run's facts and its options from `server.strategies.<name>`."""
    return STRATEGIES.create(name, strategy_facts(cfg), cfg.server.strategies.get(name), key=key,
                             where=f"server.strategies.{name}")


def make_strategies(cfg: Config, names, key: str = "eval.rules") -> dict[str, Strategy]:
    """name → strategy, each built once per run (`setup.ServerSetup.build`)."""
    return {n: make_strategy(cfg, n, key) for n in dict.fromkeys(names)}
