"""The server's one extension point: a `Strategy` turns the clients' uploads into a *predictor*, an
object that scores test batches. Like Flower's Strategy it is the only thing a server method implements; unlike
it, FLARE is one-shot, so a strategy builds a predictor instead of the next round's global parameters.

Two kinds of predictor keep ONE test pass for every strategy of an evaluation (server/evaluator.py):

* `ClientPredictor` reads the K client models' outputs on the batch (features, logits, IFFI's noise features),
  which the evaluator computes once and hands to every such predictor — the ensemble-style rules;
* `ModelPredictor` owns a model built from the uploads (FedAvg, OTFusion, FedLPA, FedDF …) and scores
  the normalised batch itself.

A strategy is registered in `flare.registry.STRATEGIES` (a plugin registers its own the same way), chosen by
`server.primary` and `eval.rules`, built once per run by `STRATEGIES.create(name, StrategyFacts, options)` from the
run facts a server method reads (never the Config), and its options model is validated from
`server.strategies.<name>`. The
built-in rules are strategies written exactly so, in server/rules.py; `ClientOutputs` (the tensors a
`ClientPredictor` reads) comes from server/fusion.py, which computes them.
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
    """What a strategy is built from besides its options: the run facts a server method reads — the seed of its
    private streams, the head, `server.primary` (the key its errors name), `server.strategies` (another rule's
    options: `Strategy.options_of`) and what a server building its own model needs."""
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
    """What `STRATEGIES` holds: a `Strategy` subclass (below), built once per run by `STRATEGIES.create` and asked
    for a predictor per evaluation."""
    def __call__(self, facts: StrategyFacts, options: BaseModel | None) -> Strategy: ...


@dataclass
class ServerContext:
    """What a strategy sees at one evaluation: the uploads, the models holding their states (eval mode, on the
    evaluation device), the aggregation weights (`server.weights`), the global prototypes G and the anchors of this
    round, and `state`, the strategy's own dict kept across the rounds of one process (not in checkpoints).
    `extras[i]`: the statistics this strategy asked client i for (`Strategy.client_extras`), without the prefix.
    `public_x`: the server's unlabeled public slice (uint8 images, `dataset.public_size`; None without one) and
    `normalize`, the run's uint8 → model-input map — for servers that distil or recalibrate on data. `score`: the
    test accuracy of an intermediate model, for the record only. `scratch`: a folder of this strategy's own where a
    build of hours may keep its progress, so that an interrupted one resumes (`flare fuse` gives one; None: none)."""

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
    # the test accuracy of a model the strategy is still building, for a record of how it progressed (a curve of
    # accuracy against the server's budget); a strategy must never choose with it. None without a test set.
    score: Callable[[nn.Module], float] | None = None
    scratch: Path | None = None

    @property
    def device(self) -> torch.device:
        return self.weights.device if not self.models else next(self.models[0].parameters()).device


@dataclass
class InitContext:
    """What the server holds before any client trains, for `Strategy.initialize`: each client architecture's init
    by its key (`setup.init_keys`; on the server's device), the public bank (or None) and the anchors' seed."""
    inits: dict[str, nn.Module]
    bank: Tensor | None
    anchor_seed: int


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
    when `eval.rules` is unset; the built-in rules are, a plugin's strategy only when named), `mixed_architectures`
    (it fuses clients of different architectures — a run whose clients differ refuses it otherwise, with
    `one_architecture_why`), `primary_for` (the heads, `Objective.head`, whose runs take it as "the" accuracy under
    server.primary=auto; "*": every head no strategy claims by name — so core code names no strategy).

    A strategy that needs client statistics beyond the weights overrides `extras_shapes` and `client_extras`
    (server/extras.py): the clients compute them after training, the gate checks them against the declaration,
    and `predictor` reads them from `ctx.extras`; strategies that read the same statistics give them one name,
    `shares_extras`, and a run uploads them once. A strategy that talks with the clients after their upload (FENS
    trains an aggregator with them) overrides `extra_rounds`, `configure_round`, `client_round` and
    `aggregate_round`: server/exchange.py holds those rounds, counts their bytes, then calls `predictor`."""

    needs_prototypes = False
    every_round = True
    default = False
    mixed_architectures = False  # it fuses clients of different architectures (docs/heterogeneous.md)
    one_architecture_why = ""    # why not, for the refusal (empty: it does not declare that it does)
    primary_for: tuple[str, ...] = ()
    # the kinds of data its server can read (a dataset's `DatasetInfo.kind`): a server that synthesises images
    # cannot run over a frozen encoder's features, and one that reads those features has no images to read
    inputs: tuple[str, ...] = ("images", "features")
    shares_extras = ""  # the name of statistics other strategies read too ("": its own)

    def __init__(self, facts: StrategyFacts, options: BaseModel | None = None):
        self.facts, self.options = facts, options if options is not None else self.options_from(facts.strategies)

    @classmethod
    def options_in(cls, cfg: Config) -> BaseModel | None:
        """Its options as `cfg` sets them (`server.strategies.<name>`, defaults filled in): read by code applying its
        arithmetic unbuilt (a saved predictor), which names no rule, and by checks of the config."""
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
        ImageData) leaves this strategy nothing to build from: called after the split and before the first client
        trains, so options whose validity depends on the data (more mixture components than any class holds, a
        Gram matrix of fewer samples than features) are refused while nothing is written."""

    def predictor(self, ctx: ServerContext) -> Predictor:
        raise NotImplementedError

    def extras_shapes(self, template: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name → (shape, dtype) of each statistic a client uploads for this strategy (none by default), from the
        run's model `template`."""
        return {}

    def client_extras(self, data) -> dict[str, Tensor]:
        """The statistics of one client (`data`: a server.extras.ClientData), computed where its data lives."""
        return {}

    # -- the sending direction (the primary strategy's): what every client receives before training (`initialize`)
    # and each round (`configure_train`); after the upload, rounds held with the clients in Flower's shape
    # (configure_fit → the clients' fit → aggregate_fit), driven by server/exchange.py before `predictor`.

    def initialize(self, ctx: InitContext) -> dict[str, Tensor]:
        """What every client receives once, before its first round (Flower's initialize_parameters), on every
        engine: each architecture's init (`<key>/<tensor>`, read back with `sent_init`), `anchor_seed` and the public
        `bank`. The clients take these from here alone, so a strategy may send another init or seed."""
        sent = {f"{key}/{name}": t for key, m in ctx.inits.items() for name, t in m.state_dict().items()}
        return sent | {"anchor_seed": torch.tensor(ctx.anchor_seed)} | ({} if ctx.bank is None else {"bank": ctx.bank})

    def configure_train(self, rnd: int, carried: dict[str, Tensor]) -> dict[str, Tensor]:
        """What every client receives with round `rnd`'s training message, beside what `initialize` sent and the G
        the server keeps (server/protos.py); the same tensors for every client and every engine. `carried`: what the
        server keeps across rounds and checkpoints (`ServerSetup.server_state`). The default sends nothing."""
        return {}

    def extra_rounds(self) -> int:
        """How many rounds this strategy holds with the clients after their upload (0: it builds from the uploads
        alone, as every one-shot method does)."""
        return 0

    def configure_round(self, rnd: int, ctx: ServerContext) -> dict[str, Tensor]:
        """What every client receives in extra round `rnd` (0-based); its bytes are counted."""
        return {}

    def client_round(self, rnd: int, received: dict[str, Tensor], data, memory: dict) -> dict[str, Tensor]:
        """What one client sends back in round `rnd`, computed where its data lives (`data`: a
        server.extras.ClientData); `memory`: that client's own dict of tensors, kept across this strategy's rounds
        (a Flower node keeps it in its state between messages)."""
        return {}

    def aggregate_round(self, rnd: int, replies: list[dict[str, Tensor]], ctx: ServerContext) -> None:
        """Fold the clients' replies (in upload order) into what the strategy keeps (`ctx.state`)."""


def sent_init(sent: dict[str, Tensor], key: str) -> dict[str, Tensor]:
    """The state dict of the init `Strategy.initialize` sent under `key` (empty: none)."""
    return {k[len(key) + 1:]: t for k, t in sent.items() if k.startswith(key + "/")}


def make_strategy(cfg: Config, name: str, key: str = "server.primary") -> Strategy:
    """The registered strategy `name` built from the run's facts and its options from `server.strategies.<name>`."""
    return STRATEGIES.create(name, strategy_facts(cfg), cfg.server.strategies.get(name), key=key,
                             where=f"server.strategies.{name}")


def make_strategies(cfg: Config, names, key: str = "eval.rules") -> dict[str, Strategy]:
    """name → strategy, each built once. A run builds every strategy it may score when the run is built
    (`setup.ServerSetup.build`) and hands these instances to every round, every client's statistics and every
    gate, so a strategy's constructor runs once per run, however many rounds and clients there are; what a
    strategy keeps across rounds belongs in `ServerContext.state`, which checkpoints can see."""
    return {n: make_strategy(cfg, n, key) for n in dict.fromkeys(names)}
