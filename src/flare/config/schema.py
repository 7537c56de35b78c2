"""The configuration schema: one pydantic model, every key with its type, range and meaning, and every
cross-key check (so a bad combination fails before any data is loaded).

A key that names a *part* (the `part(...)` types below: the reference protocol's progress and scaling are parts too)
is a string of a field type built from the part's registry (config/sections.py; `flare.registry`, so plugins can add
parts); a part that declares options reads them from its section's `options` mapping (`loss.terms.<name>` for loss
terms, `server.strategies.<name>` for server strategies), validated by the part's options model. What a part needs of
the rest of the config is its own `check(cfg)`, which `_compatible_parts` runs for every chosen part; the checks here
are the framework's own. Keys that choose between fixed behaviours of the framework itself stay closed `Literal`s:
protocol, amp, client_engine, dataset.format (a built-in dataset's file reader; a plugin dataset brings its own
loader), partition.rng, lr_schedule.kind (the LR schedule with SGDR's restarts and momentum reset, which the engines
implement), loss.ce_input, align.target, align.target_progress, align.lambda_rule (λ0's formula, an input of every λ
provider), the server's prototype and aggregation settings, and eval.bn."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from flare.config.architectures import architecture_table, client_architectures
from flare.config.sections import (OPTIONS_DESCRIPTION, AugmentCfg, DatasetCfg, LRScheduleCfg, ModelCfg,
                                   OptimCfg, PartitionCfg, Strict, architecture, part, part_options, part_table)
from flare.errors import FlareError, KeyedValueError
from flare.registry import (ANCHORS, CLIENT_ENGINES, CONTRAST, DATASETS, LAM_PROVIDERS, LOSS_TERMS, MODELS, OBJECTIVES,
                            PARTITIONS, PROGRESS, REFERENCE_PARTITIONS, SCHEDULES, STRATEGIES, SURGERY, Registry, Seed,
                            load_plugins)

# Renamed keys: an old one in a config given is refused naming the new key (and the value that stands for the old
# one); a recorded run's config is a record, not input, and is read with it moved to the new key (`load.migrate`).
RENAMED = {"lam.lambda_max": "lam.valve_threshold", "loss.alignment_epochs": "loss.public_stage_epochs",
           "concurrent_clients": "client_engine", "server.ensemble": "server.strategies.output.ensemble",
           "server.fedavg_buffers": "server.strategies.fedavg.buffers"}
RENAMED_VALUES = {"concurrent_clients": {True: "threads", False: "sequential"}}

# The keys that name a part or hold its options: checked against the part's registry (config/sections.py).
ObjectiveName = part(OBJECTIVES)
ContrastName = part(CONTRAST)
LossTerms = part_table(LOSS_TERMS, "loss.terms")
AnchorKind = part(ANCHORS)
ScheduleName = part(SCHEDULES)
SurgeryName = part(SURGERY)
LamLearnerName = part(LAM_PROVIDERS)
AnnealName = part(SCHEDULES, "lam.anneal")
ProgressName = part(PROGRESS)
LamOptions = part_options(LAM_PROVIDERS, "learner")
PrimaryName = part(STRATEGIES, also=("auto",))
StrategyTable = part_table(STRATEGIES, "server.strategies")
EvalRule = part(STRATEGIES, "eval.rules", also=("primary",))
ServerModel = architecture("server.model")

ClientEngine = Literal["sequential", "threads", "batched"]
MAX_BANK_SIZE = 1 << 20  # features a memory bank keeps (bank_size × d floats per client, allocated as it stands)
MAX_CLIENTS = 1 << 20  # K: one architecture, one partition slot and one model per client are made as it stands

# `speed=fast`: the CPU speed switches at once, each also its own key (a key the config sets itself wins). Never a
# default: it changes digits (native kernels, maybe bf16) and what is evaluated (docs/performance.md). Precision
# and layout are not filled: amp=auto and cpu_channels_last=auto leave them to the measured probe (flare/speed.py).
SPEED_FAST = {"cpu_isa": "native", "cpu_channels_last": "auto", "eval": {"every": 5, "rules": ["primary"]}}


def fill_speed(data):
    """The raw mapping with every item of `speed=fast` that it leaves unset filled in (`exact` fills nothing)."""
    if not isinstance(data, dict) or data.get("speed", "exact") != "fast":
        return data
    out = dict(data)
    for key, value in SPEED_FAST.items():
        if isinstance(value, dict) and isinstance(out.get(key) or {}, dict):
            out[key] = {**value, **(out.get(key) or {})}
        else:
            out.setdefault(key, value)
    return out


class LossCfg(Strict):
    objective: ObjectiveName = Field("fafi", description="fafi (prototype head), ce (plain classifier: "
                                                         "fedavg/ensemble baselines) or a plugin's")
    tau_con: float = Field(0.07, gt=0, description="SupCon temperature τ")
    base_tau: float = Field(0.07, gt=0, description="SupCon base temperature")
    tau_pf: float = Field(1.0, gt=0, description="prototype–feature temperature")
    tau_pp: float = Field(1.0, gt=0, description="prototype–prototype temperature")
    contrast: ContrastName = Field("none", description="contrast-set extension: none, memory-bank, public-bank, "
                                                       "two-stage or a plugin's")
    bank_size: int = Field(4096, ge=1, le=MAX_BANK_SIZE, description="memory bank FIFO size")
    bank_tau: float = Field(0.5, gt=0, description="temperature of the bank terms")
    public_stage_epochs: int = Field(1, ge=0, description="two-stage: the first local epochs, which use the "
                                                          "public-bank term alone")
    teacher_epochs: int = Field(3, ge=1, description="public bank: epochs the server trains its teacher")
    ce_input: Literal["augmented", "plain"] = Field(
        "augmented", description="objective=ce (FedAvg/Ensemble): two augmented views, or one un-augmented view "
                                 "(the evaluation transform), as the reference trained its baselines")
    terms: LossTerms = Field(
        {}, description="extra registered loss terms added to the local objective, name: {weight: w, options…} "
                        "(plugins; `flare parts`)")


class AlignCfg(Strict):
    anchors: AnchorKind = Field("none", description="fixed anchors A: none, random, etf or a plugin's")
    target: Literal["fixed", "progressive"] = Field("fixed", description="fixed (A) or progressive ((1−p)P⁰ + pA, V8)")
    lambda0: float = Field(1.0, ge=0, description="λ0 for lambda_rule=fixed")
    lambda_rule: Literal["fixed", "entropy"] = Field("fixed", description="fixed (λ0) or entropy "
                                                                          "(V9: λ_min + H/log2C·(λ_max − λ_min))")
    lambda_min: float = Field(0.1, ge=0, description="entropy rule λ_min")
    lambda_max: float = Field(10.0, ge=0, description="entropy rule λ_max")
    schedule: ScheduleName = Field("constant", description="annealing a(p) of λ: constant, linear, cosine or a "
                                                           "plugin's")
    surgery: SurgeryName = Field("none", description="gradient surgery: none, pcgrad (Plan C) or a plugin's")
    target_progress: Literal["global", "round-reset"] = Field(
        "global", description="progress of V8's target: global (the run's `progress`) or round-reset (j/E, j the "
                              "epoch within the round, as the reference: with E = 1 the target stays at P⁰)")

    @model_validator(mode="after")
    def _range(self) -> "AlignCfg":
        if self.lambda_min > self.lambda_max:
            raise ValueError(f"align.lambda_min ({self.lambda_min}) > align.lambda_max ({self.lambda_max}); "
                             "the entropy rule needs lambda_min <= lambda_max")
        return self


class LamCfg(Strict):
    """The λ learner (V10–V14; docs/method.md#learned-λ-v10v14)."""

    learner: LamLearnerName = Field("none", description="λ provider (docs/method.md#alignment-strength-λ): none, uw "
                                                        "(V10), uw-rescaled (V10r/V11), decoupled (V12–V14) or a "
                                                        "plugin's")
    sigma_lr: float = Field(0.005, gt=0, description="SGD lr of the log-variances s_l, s_a")
    anneal: AnnealName = Field("constant", description="V11: external a(p) on L_align; V12+: meta s(p) (a schedule)")
    gamma_reg: float = Field(0.0, ge=0, description="V13 stability anchor γ_reg·e^{-s_a}")
    beta: float = Field(0.0, ge=0, description="V14 ceiling β·s_l²")
    gamma_lambda: float = Field(0.0, ge=0, description="V14 safety valve γ_λ·ReLU(λ_raw − valve_threshold)")
    valve_threshold: float = Field(50.0, gt=0, description="V14: λ_raw above this opens the safety valve "
                                                           "(the notes' λ_max = 50)")
    options: LamOptions = Field({}, description=OPTIONS_DESCRIPTION)


class ServerCfg(Strict):
    weights: Literal["size", "uniform"] = Field("size", description="aggregation weights: size (n_i/Σn) or "
                                                                    "uniform (1/K)")
    protos: Literal["mean", "trainable"] = Field("mean", description="global prototypes: mean or trainable (Plan B)")
    protos_init: Literal["mean", "anchors"] = Field("mean", description="Plan B init: mean of client prototypes "
                                                                        "or the anchors")
    server_epochs: int = Field(20, ge=1, description="Plan B server epochs")
    server_lr: float = Field(1e-3, gt=0, description="Plan B Adam lr")
    gamma_etf: float = Field(0.1, ge=0, description="Plan B weight of MSE(G, A)")
    protos_flow: Literal["spec", "reference"] = Field(
        "spec", description="Plan B (protos=trainable). spec: G trained afresh every round from protos_init, "
                            "predictions with G, clients align to the anchors; reference (OneshotOursV9): G starts "
                            "at the anchors and is kept across rounds (a fresh Adam each round), clients align to "
                            "the previous round's G, predictions use the mean of the client prototypes")
    primary: PrimaryName = Field(
        "auto", description="the server strategy whose accuracy is 'the' accuracy: feature, iffi, iffi_reference, "
                            "output, fedavg or a plugin's (auto: feature for prototype heads, output otherwise)")
    strategies: StrategyTable = Field(
        {}, description="options of registered server strategies, name: {option: value} (docs/extending.md)")
    model: ServerModel = Field(
        None, description="the architecture a server that trains its own model builds (FedDF, DENSE, Co-Boosting, "
                          "the public bank's teacher): a model name or {name, width, options, checkpoint} (null: "
                          "the most common client architecture; docs/heterogeneous.md)")


class EvalCfg(Strict):
    every: int = Field(1, ge=1, description="evaluate every N-th round (the last round always); reports show the "
                                            "evaluated rounds")
    rules: list[EvalRule] | None = Field(None, description="the fusion rules to evaluate (null: every rule that "
                                                           "applies; `primary` names the method's own): skipping iffi "
                                                           "saves its noise pass, skipping fedavg a model pass")
    final_rounds: int = Field(1, ge=1, le=100_000, description="a run's final accuracy is the mean over its last N "
                                                               "evaluated rounds (1: the last round alone). One "
                                                               "round's value is one sample of a noisy curve; the "
                                                               "notes read theirs as the mean of rounds 43–47")
    noise_seed: Seed = Field(0, description="seed of IFFI's noise inputs (and of the test order with bn=batch)")
    bn: Literal["running", "batch"] = Field(
        "running", description="BatchNorm of the feature/IFFI rules at evaluation: running statistics, or the "
                               "statistics of each shuffled test batch (the reference's train-mode BN; output, "
                               "FedAvg and per-client accuracies keep running statistics, as there)")


class LoggingCfg(Strict):
    tensorboard: bool = Field(False, description="also write TensorBoard scalars to <run>/tensorboard")


class Config(Strict):
    protocol: Literal["clean", "reference"] = Field(
        "clean", description="clean (ours) or reference: the reference code's value of every protocol item the "
                             "preset, file and overrides do not set (flare/protocols/reference.yaml; "
                             "docs/reproduction.md)")
    plugins: list[str] = Field([], description="modules imported before the rest of the config is validated, so "
                                               "their parts and options validate (module names on PYTHONPATH; "
                                               "docs/extending.md)")
    preset: str | None = Field(None, description="method preset applied under the file and overrides (`flare presets`)")
    method: str = Field("fafi", description="display name of the method (defaults to the preset's name)")
    description: str = Field("", description="one-line description (set by presets)")
    notes_name: str = Field("", description="the research notes' name for this method, e.g. V7")
    seed: Seed = Field(1, description="seeds the partition, the global init, the anchors and every client's "
                                     "random streams")
    device: str = Field("auto", description="auto (the GPU when there is one), cpu, cuda, cuda:N")
    num_clients: int = Field(5, ge=1, le=MAX_CLIENTS, description="K, the number of clients")
    rounds: int = Field(50, ge=1, description="R, evaluation checkpoints (rounds) of local training")
    local_epochs: int = Field(1, ge=1, description="E, local epochs per round (R·E epochs in total per client)")
    batch_size: int = Field(512, ge=1, description="B, local batch size (two views each: 2B images per step)")
    test_batch_size: int = Field(256, ge=1, description="evaluation batch size")
    lr: float = Field(0.05, gt=0, description="SGD learning rate")
    progress: ProgressName = Field(
        "epoch", description="progress p of λ annealing and s(p): epoch (e/(R·E), e completed epochs), step (per "
                             "step), round-reset (j/E, j the epoch within the round: the reference's first batch, "
                             "λ constant when E = 1) or epoch-end ((e+1)/(R·E): V12's logged s(p) = 1 − (r+1)/R)")
    drop_last: bool = Field(False, description="clients drop their last incomplete batch every epoch (the official "
                                               "FAFI loader); a client with fewer than batch_size samples then "
                                               "trains no step")
    train_mode_epochs: int | None = Field(
        None, ge=0, description="how many of a client's local epochs (counted over its whole training) run with the "
                                "model in train mode; the later ones run in eval mode: BatchNorm normalises with the "
                                "running statistics it had then and stops updating them, dropout is off. null: every "
                                "epoch in train mode. 1 is DENSE's client loop, whose per-epoch test leaves the model "
                                "in eval mode (docs/papers.md)")
    amp: Literal["auto", "off", "bf16"] = Field("auto", description="bf16 autocast: auto (on GPUs that support "
                                                                    "it; on CPU under speed=fast where the probe "
                                                                    "measures it faster), off, bf16")
    channels_last: bool = Field(True, description="NHWC layout on CUDA (ignored on CPU: see cpu_channels_last)")
    cpu_channels_last: bool | Literal["auto"] = Field(
        False, description="NHWC layout on CPU too (other digits): true, false, or auto (speed=fast's: NHWC where "
                           "the probe measures it faster; false under speed=exact)")
    cpu_isa: Literal["avx2", "avx512", "default", "native"] = Field(
        "avx2", description="the instruction set torch's CPU kernels are pinned to (the digits follow it): avx2 "
                            "(every x86-64 machine here), avx512, default, or native (the CPU's best: faster, other "
                            "digits); flare/cpu.py")
    speed: Literal["exact", "fast"] = Field(
        "exact", description="fast: cpu_isa=native, precision (fp32/bf16) and layout (NCHW/NHWC) chosen on CPU by "
                             "a measured probe of the run's step (flare/speed.py), eval.every=5, "
                             "eval.rules=[primary] — each item the config does not set itself")
    compile: bool = Field(False, description="torch.compile the client models (client_engine=batched: its "
                                             "batched step)")
    client_engine: ClientEngine = Field(
        "sequential", description="how a round's clients train: sequential, threads (one thread and CUDA stream "
                                  "each) or batched (all clients as one vmapped program; docs/performance.md)")
    dataset: DatasetCfg = DatasetCfg()
    partition: PartitionCfg = PartitionCfg()
    model: ModelCfg = ModelCfg()
    optim: OptimCfg = OptimCfg()
    lr_schedule: LRScheduleCfg = LRScheduleCfg()
    augment: AugmentCfg = AugmentCfg()
    loss: LossCfg = LossCfg()
    align: AlignCfg = AlignCfg()
    lam: LamCfg = LamCfg()
    server: ServerCfg = ServerCfg()
    eval: EvalCfg = EvalCfg()
    logging: LoggingCfg = LoggingCfg()

    @model_validator(mode="before")
    @classmethod
    def _plugins_and_speed(cls, data):
        """Import the `plugins` first (so their parts validate), then speed=fast fills its items."""
        if isinstance(data, dict):
            load_plugins(data.get("plugins"))
        return fill_speed(data)

    @field_validator("amp", mode="before")
    @classmethod
    def _amp_off(cls, v):
        """YAML 1.1 reads a bare `off` (`amp=off`, `amp: off`) as false: it means the documented value."""
        return "off" if v is False else v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda", "mps") and not v.startswith("cuda:"):
            raise ValueError("device must be auto, cpu, cuda, cuda:N or mps")
        return v

    @model_validator(mode="after")
    def _compatible_parts(self) -> "Config":
        """Cross-key checks, so a bad combination fails before any data is loaded: the framework's own settings
        here, and every chosen part's own requirements through its registry (`check(cfg)`, which lives with the
        part: docs/extending.md)."""
        for key, value in (("protos_init", "anchors"), ("protos_flow", "reference")):  # Plan B's G starts at A
            if self.server.protos == "trainable" and getattr(self.server, key) == value:
                self.require_anchors(f"server.{key}={value}")
        self._check_architectures()
        for registry, name in self.chosen_parts():
            registry.check(name, self)
        for name in self.named_strategies():
            self.check_reads(name, "server.primary" if name == self.server.primary else "eval.rules")
        kind = self.partition.kind
        if self.partition.rng == "legacy" and kind not in REFERENCE_PARTITIONS:  # the draw data.prepare.split would use
            raise FlareError(f"partition.rng=legacy draws a kind as the reference code did, and kind={kind} has no "
                             f"such draw (those that have: {', '.join(REFERENCE_PARTITIONS.names())}).",
                             key="partition.rng", fix="set partition.rng=generator.")
        for rule in self.eval.rules or []:
            if self.head != "prototype" and rule != "primary" and STRATEGIES.get(rule).needs_prototypes:
                raise KeyedValueError("eval.rules", f"rule {rule!r} reads prototypes, which "
                                      f"loss.objective={self.loss.objective} has not; use output, fedavg or primary")
        if self.eval.every > 1 and self.server.protos == "trainable" and self.server.protos_flow == "reference":
            by_speed = (" (speed=fast sets eval.every=5 unless the config sets eval.every itself)"
                        if self.speed == "fast" else "")
            raise KeyedValueError("eval.every", f"eval.every={self.eval.every}{by_speed}: with server.protos_flow="
                                  "reference the server trains the clients' next target G at every evaluation, so "
                                  "skipping evaluations would change training; set eval.every=1"
                                  + (" next to speed=fast, or drop speed=fast" if by_speed else ""))
        evaluated = sum(map(self.evaluates, range(self.rounds)))
        if self.eval.final_rounds > evaluated:  # the mean would silently cover fewer rounds than asked
            raise KeyedValueError("eval.final_rounds", f"eval.final_rounds={self.eval.final_rounds} averages the last "
                                  f"{self.eval.final_rounds} evaluated rounds, and rounds={self.rounds} with eval.every="
                                  f"{self.eval.every} evaluates {evaluated}; set eval.final_rounds ≤ {evaluated}")
        CLIENT_ENGINES.get(self.client_engine).check(self)  # what the engine cannot run, stated beside its code
        return self

    def _check_architectures(self) -> None:
        """`model.clients` / `model.mix` must name one architecture per client, and every strategy the config names
        must fuse them (config/architectures.py)."""
        m, k = self.model, self.num_clients
        if m.clients is not None and m.mix is not None:
            raise KeyedValueError("model.mix", "model.clients and model.mix both say which client runs what; set one")
        if isinstance(m.clients, list) and len(m.clients) != k:
            raise KeyedValueError("model.clients", f"model.clients lists {len(m.clients)} architectures for "
                                  f"num_clients={k}; give one entry per client (or a mapping client index → entry)")
        if isinstance(m.clients, dict) and (bad := sorted(i for i in m.clients if not 0 <= i < k)):
            raise KeyedValueError("model.clients", f"model.clients names client {bad[0]}, but the clients are "
                                  f"0 … {k - 1} (num_clients={k})")
        if m.mix is not None and sum(m.mix.values()) != k:  # each count is an integer ≥ 0 already (sections.py)
            raise KeyedValueError("model.mix", f"model.mix deals {sum(m.mix.values())} clients "
                                  f"({', '.join(f'{n}: {c}' for n, c in m.mix.items())}), num_clients={k}; the "
                                  "counts must sum to num_clients")
        for name in self.named_strategies():  # each refused only when the clients are mixed
            self.check_fuses_mixed(name, "eval.rules" if name != self.server.primary else "server.primary")

    def evaluates(self, r: int) -> bool:
        """`eval.every`: round index r (0-based) is evaluated every N-th round, and the last round always."""
        return (r + 1) % self.eval.every == 0 or r == self.rounds - 1

    @property
    def data_kind(self) -> str:
        """What the dataset's samples are (`DatasetInfo.kind`: images, or a frozen encoder's features)."""
        return getattr(DATASETS.get(self.dataset.name), "kind", "images")

    def check_reads(self, name: str, key: str) -> None:
        """Refuse strategy `name` when it cannot read this run's kind of data (`Strategy.inputs`), naming the key to
        change: one place for `flare run`, `flare fuse` and Flower, so no server starts on data it cannot read."""
        reads = STRATEGIES.get(name, key).inputs
        if self.data_kind not in reads:
            want = ("dataset.name=features (docs/frozen-encoder.md)" if "features" in reads else
                    "an image dataset (dataset.name=fmnist, cifar10, …)")
            raise FlareError(f"server strategy '{name}' reads {' or '.join(reads)}; dataset.name={self.dataset.name} "
                             f"holds {self.data_kind}.", key=key, fix=f"use {want}, or drop {name} from {key}.")

    def check_fuses_mixed(self, name: str, key: str) -> None:
        """Refuse strategy `name` when the clients run different architectures and it cannot fuse them."""
        cls = STRATEGIES.get(name, key)
        if self.mixed_architectures and not getattr(cls, "mixed_architectures", False):
            why = getattr(cls, "one_architecture_why", "") or "it does not declare mixed_architectures = True"
            raise FlareError(f"server strategy '{name}' cannot fuse clients of different architectures "
                             f"({architecture_table(self)}): {why}.", key=key,
                             fix="drop it from eval.rules / server.primary / --strategies, or give every client one "
                                 "architecture; strategies that fuse mixed clients: " + ", ".join(
                                     n for n in STRATEGIES.names() if getattr(STRATEGIES.get(n),
                                                                               "mixed_architectures", False)) + ".")

    @property
    def mixed_architectures(self) -> bool:
        """Whether the clients run more than one layout (`model.clients` / `model.mix`; whatever checkpoints they
        start from)."""
        return len({a.layout for a in client_architectures(self)}) > 1

    def client_architectures(self):
        """One `config.architectures.Architecture` per client."""
        return client_architectures(self)

    def named_strategies(self) -> list[str]:
        """The strategies this config names itself (eval.rules, server.primary), each once."""
        return sorted({n for n in (self.eval.rules or []) if n != "primary"} | {self.server.primary} - {"auto"})

    def chosen_parts(self) -> list[tuple[Registry, str]]:
        """(registry, name) of every part this config chooses, each once: the parts whose `check` it must pass."""
        server_model = [] if self.server.model is None else [(MODELS, self.server.model.name)]
        chosen = [(MODELS, self.model.name), *((MODELS, a.name) for a in self.client_architectures()), *server_model,
                  (DATASETS, self.dataset.name), (PARTITIONS, self.partition.kind),
                  (OBJECTIVES, self.loss.objective), (CONTRAST, self.loss.contrast),
                  *((LOSS_TERMS, t) for t in self.loss.terms), (ANCHORS, self.align.anchors),
                  (SCHEDULES, self.align.schedule), (SURGERY, self.align.surgery), (LAM_PROVIDERS, self.lam.learner),
                  (SCHEDULES, self.lam.anneal), *((STRATEGIES, n) for n in self.named_strategies())]
        return list(dict.fromkeys(chosen))

    def require_anchors(self, setting: str) -> None:
        """Refuse `setting` (e.g. `align.surgery=pcgrad`) when the config has no anchors to align to."""
        if self.align.anchors == "none":
            raise FlareError(f"{setting} needs anchors to align to, but align.anchors=none.", key="align.anchors",
                             fix="set align.anchors=etf (or random).")

    @property
    def head(self) -> str:
        """The head the objective trains: prototype or linear (`Objective.head` in its registry)."""
        return OBJECTIVES.get(self.loss.objective).head

    @property
    def total_epochs(self) -> int:
        return self.rounds * self.local_epochs

    def schedule_dependencies(self) -> list[str]:
        """The settings of this config that follow the progress p = e/(R·E), i.e. change with `rounds`."""
        deps = []
        global_p = PROGRESS.get(self.progress).spans_the_run  # a per-round reset does not depend on R
        if self.align.anchors != "none" and self.align.schedule != "constant" and global_p:
            deps.append(f"align.schedule={self.align.schedule}")
        if (self.align.anchors != "none" and self.align.target == "progressive" and global_p
                and self.align.target_progress == "global"):
            deps.append("align.target=progressive")
        if self.lam.learner != "none" and self.lam.anneal != "constant" and global_p:
            deps.append(f"lam.anneal={self.lam.anneal}")
        if self.lr_schedule.kind == "cosine":
            deps.append("lr_schedule.kind=cosine")
        return deps

    @property
    def base_lr(self) -> float:
        """The peak local lr: `lr`, times batch_size/512 with `optim.linear_scaling`."""
        return self.lr * (self.batch_size / 512 if self.optim.linear_scaling else 1.0)
