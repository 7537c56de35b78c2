"""Everything a run is built from — the one place where the in-process runner, the Flower apps, `flare fuse` and the
LR probe build a run: the data and its split, the seeded inits, the anchors, the augmentation, the server's public
bank and the clients' training context.

A run has two sides, each built by one function: `ServerSetup.build` (its `evaluate` scores a round) and
`client_context`. The engines differ only in where the sides run: `RunSetup.build` composes both in one process; the
Flower server builds the server side, a Flower node the client side (from what `ServerSetup.initial_message`
sends); `flare fuse` and the LR probe build the server side and take the clients' samples from its data.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from flare.backend import Backend, backend, settle_speed
from flare.client.terms.align import AnchorFacts
from flare.client.terms.banks import bank_facts, build_public_bank
from flare.client.trainer import Client, TrainContext
from flare.config import Config
from flare.config.architectures import Architecture, server_architecture
from flare.data.augment import TwoViewAugment, normalize
from flare.data.datasets import ImageData
from flare.data.features import FeatureViews, first_view
from flare.data.partition import Partition
from flare.data.prepare import DataMeta, describe_partition, prepare_data, split
from flare.data.scaling import InputScaling, input_scaling
from flare.errors import FlareError
from flare.metrics import g_protos_std, inter_client_proto_std, model_variance_mean
from flare.models import FlareNet, check_input_fits, create_architecture
from flare.registry import ANCHORS, CONTRAST
from flare.rng import derived_seed
from flare.schedules import LRSchedule
from flare.server.evaluator import check_predictor, evaluate_predictors
from flare.server.exchange import Transport, hold_rounds
from flare.server.extras import own_extras
from flare.server.fusion import aggregation_weights
from flare.server.protos import ServerPrototypes
from flare.server.rounds import Evaluation, accuracy_on_test, primary_rule, rule_costs, rules_for
from flare.server.strategy import InitContext, ServerContext, ServerProtocol, Strategy, make_strategies, sent_init
from flare.server.upload import Upload

# ----------------------------------------------------------------------------------------------
# model, anchors, augmentation, training context


def init_models(cfg: Config, meta: DataMeta, device: torch.device, channels_last: bool = False,
                checkpoints: bool = True) -> tuple[FlareNet, dict[Architecture, FlareNet]]:
    """The seeded inits: the server architecture's (`template`) and one per client architecture. Each is drawn from
    torch's generator seeded with `seed`, the server's last, so what follows draws as after a run of that one
    architecture (a run of one architecture builds exactly one model). Every architecture must end in one d.
    `checkpoints=False`: the seeded inits alone, without reading the architectures' checkpoint files."""
    def build(arch: Architecture) -> FlareNet:
        torch.manual_seed(cfg.seed)
        model = create_architecture(arch, meta.in_channels, meta.num_classes, cfg.head, cfg.model.feature_dim,
                                    checkpoint=checkpoints)
        check_input_fits(model, meta.in_channels, meta.image_size, arch.label, arch.key)
        model = model.to(device)
        return model.to(memory_format=torch.channels_last) if channels_last else model

    archs, own = cfg.client_architectures(), server_architecture(cfg)
    inits = {a: build(a) for a in dict.fromkeys(archs) if a != own}
    template = build(own)
    if own in archs:
        inits[own] = template
    dims = {a.label: m.feature_dim for a, m in [*inits.items(), (own, template)]}
    if len(set(dims.values())) > 1:
        raise FlareError("the run's architectures end in different feature dimensions ("
                         + ", ".join(f"{n}: d = {d}" for n, d in dims.items()) + "), so prototypes, anchors and "
                         "features would not be comparable across clients.", key="model.feature_dim",
                         fix=f"set model.feature_dim (e.g. model.feature_dim={min(dims.values())}): every client then "
                             "projects its encoder's feature to that shared d.")
    return template, inits


def anchor_seed(cfg: Config) -> int:
    """The shared seed the anchors A are drawn from (the server fixes it, and `Strategy.initialize` sends it)."""
    return cfg.seed + 7


def init_keys(archs: list[Architecture]) -> list[str]:
    """Client i's key for its init in what `Strategy.initialize` sends (`init`, `init-J` for the J-th other client
    architecture): a Flower node's id is known only from its first reply, so every client gets every init."""
    order = list(dict.fromkeys(archs))
    return [f"init-{order.index(a)}" if a != order[0] else "init" for a in archs]


def run_anchors(cfg: Config, num_classes: int, feature_dim: int, device: torch.device,
                seed: int | None = None) -> Tensor | None:
    """The fixed anchors A (C×d) on `device`, or None without alignment."""
    facts = AnchorFacts(num_classes, feature_dim, anchor_seed(cfg) if seed is None else seed)
    a = ANCHORS.create(cfg.align.anchors, facts)
    return a.to(device) if a is not None else None


def scaling(cfg: Config, meta: DataMeta) -> InputScaling:
    """The run's input scaling (`augment.input_scaling`, see `flare.data.scaling`)."""
    return input_scaling(cfg.augment.input_scaling, cfg.dataset.name, meta.mean, meta.std)


def make_augment(cfg: Config, meta: DataMeta, device: torch.device) -> TwoViewAugment | FeatureViews:
    """The two training views: the SupCon policy on images; on cached features, two of each sample's stored copies."""
    if meta.kind == "features":
        return FeatureViews()
    sc = scaling(cfg, meta)
    pre = sc.pre or (None, None)
    return TwoViewAugment(meta.image_size, meta.in_channels, *sc.post, per_image=cfg.augment.per_image,
                          pre_mean=pre[0], pre_std=pre[1], crop=cfg.augment.crop).to(device)


def normalizer(cfg: Config, meta: DataMeta) -> Callable[[Tensor], Tensor]:
    """uint8 batch → the model's input (the evaluation transform, and the un-augmented training view); on cached
    features, the plain image's feature."""
    if meta.kind == "features":
        return first_view
    mean, std = scaling(cfg, meta).test
    return lambda x: normalize(x, mean, std)


def make_train_context(cfg: Config, train_x: Tensor, train_y: Tensor, augment, anchors: Tensor | None,
                       device: torch.device, amp_dtype, channels_last: bool, bank: Tensor | None,
                       plain: Callable[[Tensor], Tensor] | None = None) -> TrainContext:
    """What a client's local loop reads: its data on the device, augmentation, anchors, the LR schedule, the
    contrast extension and the un-augmented view `plain` (the evaluation transform)."""
    ls = cfg.lr_schedule
    return TrainContext(cfg=cfg, train_x=train_x, train_y=train_y, augment=augment, anchors=anchors,
                        device=device, amp_dtype=amp_dtype,
                        lr_schedule=LRSchedule(ls.kind, cfg.base_lr, cfg.total_epochs,
                                               decay_per_round=ls.decay_per_round, min_lr=ls.min_lr, t0=ls.t0,
                                               t_mult=ls.t_mult, cycle_decay=ls.cycle_decay),
                        channels_last=channels_last, plain=plain,
                        extension_factory=CONTRAST.create(cfg.loss.contrast, bank_facts(cfg.loss, bank, device)))


# ----------------------------------------------------------------------------------------------
# the two sides of a run: what the server holds, what a client trains with


@dataclass
class ServerSetup:
    """The server's side of a run, built by `build` alone and scored by `evaluate` alone, on every engine."""

    cfg: Config
    backend: Backend
    meta: DataMeta
    norm: Callable[[Tensor], Tensor]
    template: FlareNet                 # the server architecture's seeded init (every client's, in one-model runs)
    inits: dict[Architecture, FlareNet]  # each client architecture's seeded init
    architectures: list[Architecture]    # client i's is architectures[i] (`cfg.client_architectures()`, resolved once)
    anchors: Tensor | None
    augment: TwoViewAugment
    bank: Tensor | None                # the public bank the clients contrast against (public-bank / two-stage)
    test_x: Tensor | None              # on the device; None on a Flower server without the dataset
    test_y: Tensor | None
    public_x: Tensor | None            # the server's unlabeled public slice (dataset.public_size), on the device
    data: ImageData | None             # the prepared dataset on the host, until a caller `take_data`s it
    warnings: list[str]                # the backend's, and why a Flower server evaluates nothing
    strategies: dict[str, Strategy] = field(default_factory=dict)  # name → the run's instance, built once
    strategy_state: dict = field(default_factory=dict)  # each server strategy's own state across rounds
    prototypes: ServerPrototypes | None = None  # Plan B's global prototypes across rounds
    carried: dict[str, Tensor] = field(default_factory=dict)  # what the server's protocols keep across rounds

    @classmethod
    def build(cls, cfg: Config, dataset_meta: str | None = None, bank: bool = True,
              checkpoints: bool = True, strategies: tuple[str, ...] | None = None) -> "ServerSetup":
        """Every server piece, in a fixed order (the seeded init resets torch's generator; what follows draws from
        it). `dataset_meta`: a DataMeta JSON file a Flower server without the dataset falls back to (it then
        evaluates nothing). `bank=False` leaves the public bank out, for callers that send clients nothing.
        `checkpoints`: see `init_models`. `strategies`: the ones to build, else every one the run scores."""
        be = backend(cfg)  # first: it pins the CPU kernels, and fails on a bad device before anything is loaded
        device, warnings = be.device, list(be.warnings)
        built = make_strategies(cfg, strategies if strategies is not None else rules_for(cfg))
        data, public = None, None
        try:
            data, public = prepare_data(cfg)
            meta = DataMeta.from_data(data)
        except FlareError as e:
            if not dataset_meta:
                raise
            meta = DataMeta.from_json(Path(dataset_meta).read_text())
            warnings.append(f"the server has no dataset ({e.message}); it evaluates nothing and uses the dataset "
                            f"facts in {dataset_meta}.")
        n_before = len(be.warnings)
        settle_speed(be, cfg, (meta.in_channels, meta.image_size, meta.image_size), meta.num_classes,
                     train_size=len(data.train_y) if data is not None else None)
        warnings += be.warnings[n_before:]
        norm = normalizer(cfg, meta)
        model, inits = init_models(cfg, meta, device, channels_last=be.channels_last, checkpoints=checkpoints)
        augment = make_augment(cfg, meta, device)
        pb = build_public_bank(cfg, public, model, augment, norm, device) if bank else None
        test = (data.test_x.to(device), data.test_y.to(device)) if data is not None else (None, None)
        s = cls(cfg, be, meta, norm, model, inits, cfg.client_architectures(), None, augment, pb, *test,
                public[0].to(device) if public is not None else None, data, warnings, built)
        s.prototypes = ServerPrototypes(cfg.server)
        # the anchors the clients draw from the seed the primary strategy sends (their own generator: the order of
        # the draws above does not matter), so the server scores against the same A; fuse may not build the
        # primary, and then the config's seed is the one the clients were sent by default
        sent = s.initial_message()["anchor_seed"] if primary_rule(cfg) in built else anchor_seed(cfg)
        s.anchors = run_anchors(cfg, meta.num_classes, model.feature_dim, device, seed=int(sent))
        s.load_server_state({k: v for p in s.protocols() for k, v in p.initial_state(s.anchors).items()})
        return s

    def client_init(self, i: int) -> FlareNet:
        """Client i's seeded init (its architecture's; not a copy)."""
        return self.inits[self.architectures[i]]

    def client_models(self, uploads: list[Upload]) -> list[FlareNet]:
        """Each upload's weights in a copy of its client's init (clients not in this process: a federation's, fuse's)."""
        models = [copy.deepcopy(self.client_init(u.client)) for u in uploads]
        for m, u in zip(models, uploads):
            m.load_state_dict(u.state)
        return models

    def take_data(self) -> ImageData:
        """The prepared dataset, handed over once (the host copy is not kept beside the device copies)."""
        data, self.data = self.data, None
        return data

    # -- what the server carries across rounds, and what it sends: its protocols -----------------------------------
    def server_state(self) -> dict:
        """What the server carries from one round to the next (saved in checkpoints; kept by `carry`)."""
        return {k: v.detach().cpu() for k, v in self.carried.items()}

    def load_server_state(self, state: dict | None) -> None:
        self.carried = {k: v.detach().float().to(self.backend.device) for k, v in (state or {}).items()}

    def carry(self, ev: Evaluation) -> None:
        if ev.kept is not None:
            self.load_server_state(ev.kept)

    def protocols(self) -> list[ServerProtocol]:
        """Plan B's global prototypes, then the primary strategy (if built): their messages merge in this order."""
        primary = self.strategies.get(primary_rule(self.cfg))
        return [self.prototypes] + ([primary] if primary is not None else [])

    def initial_message(self) -> dict[str, Tensor]:
        """What every client receives once before it trains: the protocols' `initialize`."""
        inits = {k: self.client_init(i) for i, k in enumerate(init_keys(self.architectures))}
        ctx = InitContext(inits, self.bank, anchor_seed(self.cfg))
        return {k: v for p in self.protocols() for k, v in p.initialize(ctx).items()}

    def train_message(self, r: int) -> dict[str, Tensor]:
        """What every client receives before it trains round r: the protocols' `configure_train`."""
        return {k: v for p in self.protocols() for k, v in p.configure_train(r, self.carried).items()}

    def scored(self, r: int) -> dict[str, Strategy]:
        """The run's strategies round r scores (`rules_for`), the instances built with the run."""
        return {n: self.strategies[n] for n in rules_for(self.cfg, r)}

    def evaluate(self, r: int, uploads: list[Upload], models: list[torch.nn.Module],
                 rules: tuple[str, ...] | None = None, clients: Transport | None = None,
                 scratch: Path | None = None) -> Evaluation:
        """One evaluation checkpoint from the uploads alone (`models[i]` holds `uploads[i].state`): the protocols' fold,
        every strategy's predictor scored in one test pass (none without a test set), diagnostics. `rules`: else the
        round's own. `clients`: the transport for the rounds a strategy holds after the upload (None: unreachable).
        The caller decides whether to `carry` what it kept."""
        cfg, be, anchors, test_x, test_y, norm = self.cfg, self.backend, self.anchors, self.test_x, self.test_y, self.norm
        t0 = time.perf_counter()
        weights = aggregation_weights([u.num_samples for u in uploads], cfg.server.weights)
        protos = [u.prototypes for u in uploads if u.prototypes is not None]
        prim = primary_rule(cfg)
        rec: dict = {"kind": "round", "round": r, "method": cfg.method, "primary": prim}
        read, kept, kept_next = {}, self.carried, None
        for protocol in self.protocols():
            state, keeps, logs = protocol.fold(r, uploads, anchors, kept)
            read = read | state
            if keeps is not None:  # what it keeps replaces its own keys; the other protocols' stay
                kept_next = (kept_next if kept_next is not None else dict(kept)) | keeps
            rec.update(logs)
        G = read.get("G")
        t_agg = time.perf_counter() - t0
        t1 = time.perf_counter()
        for m in models:  # as ServerContext promises (the runner's live client models come in train mode)
            m.eval()
        shape = tuple(int(s) for s in test_x.shape[1:]) if test_x is not None else None
        # without a test set only the primary is built: it is what a Flower server saves as the run's predictor
        names = rules if rules is not None else rules_for(cfg, r)
        if test_x is None:
            names = tuple(n for n in names if n == prim)
        score = None if test_x is None else (lambda model: accuracy_on_test(
            model, test_x, test_y, norm, batch_size=cfg.test_batch_size, amp_dtype=be.amp_dtype,
            channels_last=be.channels_last))
        preds, built = {}, {}
        for n in names:
            t, strategy = time.perf_counter(), self.strategies[n]
            ctx = ServerContext(r, uploads, models, weights, G, anchors, self.strategy_state.setdefault(n, {}),
                                own_extras(uploads, n, strategy), self.public_x, norm, shape, score,
                                scratch and scratch / n)
            talk = hold_rounds(n, strategy, ctx, clients)
            preds[n] = strategy.predictor(ctx)
            if talk:  # the extra rounds' cost beside what the strategy logs itself
                preds[n].logs = {**talk, **preds[n].logs}
            built[n] = time.perf_counter() - t
        for n, p in preds.items():
            check_predictor(n, p, r)
        if test_x is not None:
            # eval.bn=batch draws a new seeded test order every round (the reference's shuffled test loader)
            shuffle_seed = derived_seed(abs(cfg.eval.noise_seed), r, 5) if cfg.eval.bn == "batch" else 0
            rec.update(evaluate_predictors(models, preds, test_x, test_y, norm, batch_size=cfg.test_batch_size,
                                           noise_seed=cfg.eval.noise_seed, amp_dtype=be.amp_dtype,
                                           channels_last=be.channels_last, bn=cfg.eval.bn, shuffle_seed=shuffle_seed,
                                           round_idx=r))
            rec.update({f"{n}.{k}": v for n, p in preds.items() for k, v in p.logs.items()})
            if "seconds_eval_parts" in rec:  # a rule's own part includes building its predictor (FedAvg: averaging)
                parts = rec["seconds_eval_parts"]
                parts.update({n: round(parts.get(n, 0.0) + t, 4) for n, t in built.items()})
                rec["seconds_eval_rules"] = rule_costs(parts, preds)
        rec["seconds_eval"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        rec["model_variance_mean"] = model_variance_mean(models)
        if protos:
            rec["g_protos_std"] = g_protos_std(G)
            rec["inter_client_proto_std"] = inter_client_proto_std(protos)
        rec["seconds_aggregate"] = t_agg + time.perf_counter() - t2
        rec["acc"] = rec.get(f"acc_{prim}")
        return Evaluation(rec, weights, G, kept_next, preds)


def client_context(cfg: Config, meta: DataMeta, be: Backend, feature_dim: int, train_x: Tensor, train_y: Tensor,
                   first: dict[str, Tensor]) -> TrainContext:
    """A client's side of a run: the training context over its samples, with the anchor seed and public bank the
    server sent first (`first`). In `flare run` one context over the whole training set that every client indexes."""
    if cfg.loss.contrast in ("public-bank", "two-stage") and first.get("bank") is None:
        raise FlareError(f"loss.contrast={cfg.loss.contrast} needs the server's public bank, which did not arrive "
                         "with the task.")
    dev = be.device
    anchors = run_anchors(cfg, meta.num_classes, feature_dim, dev, seed=int(first["anchor_seed"]))
    return make_train_context(cfg, train_x.to(dev), train_y.to(dev), make_augment(cfg, meta, dev), anchors, dev,
                              be.amp_dtype, be.channels_last, first.get("bank"), plain=normalizer(cfg, meta))


def check_buildable(cfg: Config) -> None:
    """Refuse here what `flare run` refuses before it writes a file, for a caller that hands the run to other
    processes (`flare federate`). The public bank's teacher is not trained (nothing the config could get wrong)."""
    checked_split(ServerSetup.build(cfg, bank=False))


def checked_split(server: ServerSetup) -> tuple[ImageData, Partition]:
    """The run's data, taken from `server`, and its split, once every strategy the server built has passed
    `check_data`."""
    data = server.take_data()
    part = split(server.cfg, data.train_y, data.num_classes)
    histogram = part.histogram()
    for strategy in server.strategies.values():
        strategy.check_data(histogram, data)
    return data, part


# ----------------------------------------------------------------------------------------------
# the whole run, in one process


@dataclass
class RunSetup:
    """One in-process run: the server's side, the split, the clients' shared training context, and `first`."""

    server: ServerSetup
    partition: Partition
    partition_report: dict
    ctx: TrainContext
    first: dict[str, Tensor]  # what the server sent before training (`ServerSetup.initial_message`)

    @classmethod
    def build(cls, cfg: Config) -> "RunSetup":
        server = ServerSetup.build(cfg)
        data, part = checked_split(server)
        first = server.initial_message()
        ctx = client_context(cfg, server.meta, server.backend, server.template.feature_dim, data.train_x,
                             data.train_y, first)
        return cls(server, part, describe_partition(cfg, part, data.classes), ctx, first)

    def make_clients(self, warn: Callable[[str], None], note: Callable[[str], None]) -> list[Client]:
        """Every client from the init `first` sent for its architecture; clients without samples are warned about
        (kept: checkpoints keep one per client)."""
        out, keys, cfg = [], init_keys(self.server.architectures), self.server.cfg
        for i, ix in enumerate(self.partition.client_indices):
            if len(ix) == 0:
                warn(f"client {i} received no samples under this partition; it is skipped (weight 0).")
            elif len(ix) < cfg.batch_size and cfg.drop_last:
                warn(f"client {i} holds {len(ix)} samples, fewer than batch_size={cfg.batch_size}; with "
                     "drop_last=true it trains no step and keeps the initial model (the reference crashed here).")
            elif len(ix) < cfg.batch_size:
                note(f"note: client {i} holds {len(ix)} samples, fewer than batch_size={cfg.batch_size}; "
                     "it trains on one smaller batch per epoch.")
            ent = self.partition_report["clients"][i]["normalized_entropy"]
            model = copy.deepcopy(self.server.client_init(i))
            model.load_state_dict(sent_init(self.first, keys[i]))
            out.append(Client(i, torch.as_tensor(ix, device=self.server.backend.device), model, self.ctx, ent))
        return out
