"""The configuration schema: one pydantic model, every key with its type, range and meaning, and every
cross-key check (so a bad combination fails before any data is loaded).

Keys that name a *part* (model.name, dataset.name, partition.kind, loss.objective, loss.contrast, loss.terms,
align.anchors, align.schedule, align.surgery, lam.learner, lam.anneal, server.primary, eval.rules) are strings
checked against the part's registry (`flare.registry`, so plugins can add parts); a part that declares options reads
them from its section's `options` mapping (`loss.terms.<name>` for loss terms, `server.strategies.<name>` for
server strategies), validated by the part's options model. Keys that choose
between fixed behaviours of the framework itself stay closed `Literal`s: protocol, progress, amp, client_engine,
dataset.format (a built-in dataset's file reader; a plugin dataset brings its own loader), partition.rng,
lr_schedule.kind (the LR schedule with SGDR's restarts and momentum reset, which the engines implement),
augment.input_scaling, loss.ce_input, align.target, align.target_progress, align.lambda_rule (λ0's formula,
an input of every λ provider), the server's prototype and aggregation settings, and eval.bn.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from flare.config.protocol import fill_protocol
from flare.config.sections import (OPTIONS_DESCRIPTION, AugmentCfg, DatasetCfg, LRScheduleCfg, ModelCfg, OptimCfg,
                                   PartitionCfg, Strict, part_name, part_options)
from flare.errors import KeyedValueError
from flare.registry import (ANCHORS, CLIENT_ENGINES, CONTRAST, LAM_PROVIDERS, LOSS_TERMS, OBJECTIVES, SCHEDULES,
                            STRATEGIES, SURGERY, TermOptions, load_plugins)

__all__ = ["KeyedValueError", "DatasetCfg", "PartitionCfg", "ModelCfg", "OptimCfg", "LRScheduleCfg", "AugmentCfg",
           "LossCfg", "AlignCfg", "LamCfg", "ServerCfg", "EvalCfg", "LoggingCfg", "Config", "RENAMED", "RENAMED_VALUES"]

# Keys that were renamed: an old name is refused with a message that names the new one (and, where the values
# changed with it, the new value that stands for the old one).
RENAMED = {
    "lam.lambda_max": "lam.valve_threshold",
    "loss.alignment_epochs": "loss.public_stage_epochs",
    "concurrent_clients": "client_engine",
}
RENAMED_VALUES = {
    "concurrent_clients": {True: "threads", False: "sequential"},
}

ClientEngine = Literal["sequential", "threads", "batched"]

# `speed=fast`: the CPU speed switches at once, each also its own key (a key the config sets itself wins). Never a
# default: it changes digits (native kernels, bf16) and what is evaluated (README, "Performance").
SPEED_FAST = {"cpu_isa": "native", "amp": "bf16", "cpu_channels_last": True,
              "eval": {"every": 5, "rules": ["primary"]}}


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
    objective: str = Field("fafi", description="fafi (prototype head), ce (plain classifier: fedavg/ensemble "
                                               "baselines) or a plugin's")
    tau_con: float = Field(0.07, gt=0, description="SupCon temperature τ")
    base_tau: float = Field(0.07, gt=0, description="SupCon base temperature")
    tau_pf: float = Field(1.0, gt=0, description="prototype–feature temperature")
    tau_pp: float = Field(1.0, gt=0, description="prototype–prototype temperature")
    contrast: str = Field("none", description="contrast-set extension: none, memory-bank, public-bank, two-stage "
                                              "or a plugin's")
    bank_size: int = Field(4096, ge=1, description="memory bank FIFO size")
    bank_tau: float = Field(0.5, gt=0, description="temperature of the bank terms")
    public_stage_epochs: int = Field(1, ge=0, description="two-stage: the first local epochs, which use the "
                                                          "public-bank term alone")
    teacher_epochs: int = Field(3, ge=1, description="public bank: epochs the server trains its teacher")
    ce_input: Literal["augmented", "plain"] = Field(
        "augmented", description="objective=ce (FedAvg/Ensemble): two augmented views, or one un-augmented view "
                                 "(the evaluation transform), as the reference trained its baselines")
    terms: dict[str, dict[str, Any]] = Field(
        {}, description="extra registered loss terms added to the local objective, name: {weight: w, options…} "
                        "(plugins; `flare parts`)")

    @field_validator("objective")
    @classmethod
    def _objective(cls, v: str) -> str:
        return part_name(OBJECTIVES, v, "loss.objective")

    @field_validator("contrast")
    @classmethod
    def _contrast(cls, v: str) -> str:
        return part_name(CONTRAST, v, "loss.contrast")

    @field_validator("terms", mode="before")
    @classmethod
    def _terms(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            raise KeyedValueError("loss.terms", f"loss.terms must be a mapping of term: {{weight: w}}, got {v!r}")
        out = {}
        for name, opts in v.items():
            key = f"loss.terms.{name}"
            part_name(LOSS_TERMS, name, key)
            out[name] = LOSS_TERMS.options(name, opts, key, default=TermOptions).model_dump(mode="json")
        return out


class AlignCfg(Strict):
    anchors: str = Field("none", description="fixed anchors A: none, random, etf or a plugin's")
    target: Literal["fixed", "progressive"] = Field("fixed", description="fixed (A) or progressive "
                                                                         "((1−p)P⁰ + pA, V8)")
    lambda0: float = Field(1.0, ge=0, description="λ0 for lambda_rule=fixed")
    lambda_rule: Literal["fixed", "entropy"] = Field("fixed", description="fixed (λ0) or entropy "
                                                                          "(V9: λ_min + H/log2C·(λ_max − λ_min))")
    lambda_min: float = Field(0.1, ge=0, description="entropy rule λ_min")
    lambda_max: float = Field(10.0, ge=0, description="entropy rule λ_max")
    schedule: str = Field("constant", description="annealing a(p) of λ: constant, linear, cosine or a plugin's")
    surgery: str = Field("none", description="gradient surgery: none, pcgrad (Plan C) or a plugin's")
    target_progress: Literal["global", "round-reset"] = Field(
        "global", description="progress of V8's target: global (the run's `progress`) or round-reset (j/E, j the "
                              "epoch within the round, as the reference: with E = 1 the target stays at P⁰)")

    @field_validator("anchors")
    @classmethod
    def _anchors(cls, v: str) -> str:
        return part_name(ANCHORS, v, "align.anchors")

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, v: str) -> str:
        return part_name(SCHEDULES, v, "align.schedule")

    @field_validator("surgery")
    @classmethod
    def _surgery(cls, v: str) -> str:
        return part_name(SURGERY, v, "align.surgery")

    @model_validator(mode="after")
    def _range(self) -> "AlignCfg":
        if self.lambda_min > self.lambda_max:
            raise ValueError(
                f"align.lambda_min ({self.lambda_min}) > align.lambda_max ({self.lambda_max}); "
                "the entropy rule needs lambda_min <= lambda_max"
            )
        return self


class LamCfg(Strict):
    """The λ learner of SPEC §7 (V10–V14)."""

    learner: str = Field("none", description="λ provider (SPEC §7): none, uw (V10), uw-rescaled (V10r/V11), "
                                             "decoupled (V12–V14) or a plugin's")
    sigma_lr: float = Field(0.005, gt=0, description="SGD lr of the log-variances s_l, s_a")
    anneal: str = Field("constant", description="V11: external a(p) on L_align; V12+: meta s(p) (a schedule)")
    gamma_reg: float = Field(0.0, ge=0, description="V13 stability anchor γ_reg·e^{-s_a}")
    beta: float = Field(0.0, ge=0, description="V14 ceiling β·s_l²")
    gamma_lambda: float = Field(0.0, ge=0, description="V14 safety valve γ_λ·ReLU(λ_raw − valve_threshold)")
    valve_threshold: float = Field(50.0, gt=0, description="V14: λ_raw above this opens the safety valve "
                                                           "(the notes' λ_max = 50)")
    options: dict[str, Any] = Field({}, description=OPTIONS_DESCRIPTION)

    @field_validator("learner")
    @classmethod
    def _learner(cls, v: str) -> str:
        return part_name(LAM_PROVIDERS, v, "lam.learner")

    @field_validator("anneal")
    @classmethod
    def _anneal(cls, v: str) -> str:
        return part_name(SCHEDULES, v, "lam.anneal")

    @field_validator("options")
    @classmethod
    def _opts(cls, v: dict, info: ValidationInfo) -> dict:
        return part_options(LAM_PROVIDERS, info.data.get("learner"), v, "lam.options")


class ServerCfg(Strict):
    weights: Literal["size", "uniform"] = Field("size", description="aggregation weights: size (n_i/Σn) or "
                                                                    "uniform (1/K)")
    protos: Literal["mean", "trainable"] = Field("mean", description="global prototypes: mean or trainable "
                                                                     "(Plan B)")
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
    ensemble: Literal["softmax", "logits"] = Field(
        "softmax", description="the output rule: Σ w_i softmax(logits_i), or Σ w_i logits_i (raw logits, the "
                               "reference's Ensemble baseline)")
    fedavg_buffers: Literal["average", "first"] = Field(
        "average", description="one-shot FedAvg: average parameters and BN buffers, or average parameters only "
                               "and keep the first client's buffers (the reference's parameter_averaging)")
    primary: str = Field(
        "auto", description="the server strategy whose accuracy is 'the' accuracy: feature, iffi, iffi_reference, "
                            "output, fedavg or a plugin's (auto: feature for prototype heads, output otherwise)")
    strategies: dict[str, dict[str, Any]] = Field(
        {}, description="options of registered server strategies, name: {option: value} (docs/extending.md)")

    @field_validator("primary")
    @classmethod
    def _primary(cls, v: str) -> str:
        return v if v == "auto" else part_name(STRATEGIES, v, "server.primary")

    @field_validator("strategies", mode="before")
    @classmethod
    def _strategies(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            raise KeyedValueError("server.strategies", f"server.strategies must be a mapping of strategy: "
                                  f"{{option: value}}, got {v!r}")
        out = {}
        for name, opts in v.items():
            key = f"server.strategies.{name}"
            part_name(STRATEGIES, name, key)
            o = STRATEGIES.options(name, opts, key)
            out[name] = o.model_dump(mode="json") if o is not None else {}
        return out


class EvalCfg(Strict):
    every: int = Field(1, ge=1, description="evaluate every N-th round (the last round always); reports show the "
                                            "evaluated rounds")
    rules: list[str] | None = Field(None, description="the fusion rules to evaluate (null: every rule that applies; "
                                                      "`primary` names the method's own): skipping iffi saves its "
                                                      "noise pass, skipping fedavg a model pass")
    noise_seed: int = Field(0, description="seed of IFFI's noise inputs (and of the test order with bn=batch)")
    bn: Literal["running", "batch"] = Field(
        "running", description="BatchNorm of the feature/IFFI rules at evaluation: running statistics, or the "
                               "statistics of each shuffled test batch (the reference's train-mode BN; output, "
                               "FedAvg and per-client accuracies keep running statistics, as there)")


class LoggingCfg(Strict):
    tensorboard: bool = Field(False, description="also write TensorBoard scalars to <run>/tensorboard")


class Config(Strict):
    protocol: Literal["clean", "reference"] = Field(
        "clean", description="clean (ours) or reference: sets every protocol item the config does not set itself "
                             "to the reference code's behaviour (docs/reproduction.md lists the items)")
    plugins: list[str] = Field([], description="modules imported before the rest of the config is validated, so "
                                               "their parts and options validate (module names on PYTHONPATH; "
                                               "docs/extending.md)")
    preset: str | None = Field(None, description="method preset applied under the file and overrides "
                                                 "(`flare presets`)")
    method: str = Field("fafi", description="display name of the method (defaults to the preset's name)")
    description: str = Field("", description="one-line description (set by presets)")
    notes_name: str = Field("", description="the research notes' name for this method, e.g. V7")
    seed: int = Field(1, description="seeds the partition, the global init, the anchors and every client's "
                                     "random streams")
    device: str = Field("auto", description="auto (the GPU when there is one), cpu, cuda, cuda:N")
    num_clients: int = Field(5, ge=1, description="K, the number of clients")
    rounds: int = Field(50, ge=1, description="R, evaluation checkpoints (rounds) of local training")
    local_epochs: int = Field(1, ge=1, description="E, local epochs per round (R·E epochs in total per client)")
    batch_size: int = Field(512, ge=1, description="B, local batch size (two views each: 2B images per step)")
    test_batch_size: int = Field(256, ge=1, description="evaluation batch size")
    lr: float = Field(0.05, gt=0, description="SGD learning rate")
    progress: Literal["epoch", "step", "round-reset", "epoch-end"] = Field(
        "epoch", description="progress p of λ annealing and s(p): epoch (e/(R·E), e completed epochs), step (per "
                             "step), round-reset (j/E, j the epoch within the round: the reference's first batch, "
                             "λ constant when E = 1) or epoch-end ((e+1)/(R·E): V12's logged s(p) = 1 − (r+1)/R)")
    drop_last: bool = Field(False, description="clients drop their last incomplete batch every epoch (the official "
                                               "FAFI loader); a client with fewer than batch_size samples then "
                                               "trains no step")
    amp: Literal["auto", "off", "bf16"] = Field("auto", description="bf16 autocast: auto (on GPUs that support "
                                                                    "it), off, bf16")
    channels_last: bool = Field(True, description="NHWC layout on CUDA (ignored on CPU: see cpu_channels_last)")
    cpu_channels_last: bool = Field(False, description="NHWC layout on CPU too (faster with oneDNN; other digits)")
    cpu_isa: Literal["avx2", "avx512", "default", "native"] = Field(
        "avx2", description="the instruction set torch's CPU kernels are pinned to (the digits follow it): avx2 "
                            "(every x86-64 machine here), avx512, default, or native (the CPU's best: faster, other "
                            "digits); flare/cpu.py")
    speed: Literal["exact", "fast"] = Field(
        "exact", description="fast: cpu_isa=native, amp=bf16 (where the CPU has bf16), cpu_channels_last, "
                             "eval.every=5, eval.rules=[primary] — each item the config does not set itself")
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
    def _protocol_defaults(cls, data):
        """Import the `plugins` first (so their parts validate), then protocol=reference fills every protocol item
        the mapping leaves unset (config/protocol.py), then speed=fast its items."""
        if isinstance(data, dict):
            load_plugins(data.get("plugins"))
        return fill_speed(fill_protocol(data))

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda", "mps") and not v.startswith("cuda:"):
            raise ValueError("device must be auto, cpu, cuda, cuda:N or mps")
        return v

    @model_validator(mode="after")
    def _compatible_parts(self) -> "Config":
        """Cross-key checks, so a bad combination fails before any data is loaded."""
        needs_anchors = []
        if self.align.surgery != "none":
            needs_anchors.append(f"align.surgery={self.align.surgery}")
        if self.lam.learner != "none":
            needs_anchors.append(f"lam.learner={self.lam.learner}")
        if self.server.protos == "trainable" and self.server.protos_init == "anchors":
            needs_anchors.append("server.protos_init=anchors")
        if self.server.protos == "trainable" and self.server.protos_flow == "reference":
            needs_anchors.append("server.protos_flow=reference")
        if needs_anchors and self.align.anchors == "none":
            raise KeyedValueError("align.anchors", f"{', '.join(needs_anchors)} needs anchors to align to, but "
                                  "align.anchors=none; set align.anchors=etf (or random)")
        if self.head != "prototype" and (self.align.anchors != "none" or self.server.protos == "trainable"):
            raise KeyedValueError("loss.objective", "alignment and trainable global prototypes need the "
                                  f"prototype head (e.g. loss.objective=fafi), not loss.objective="
                                  f"{self.loss.objective}'s plain classifier")
        if self.loss.contrast in ("public-bank", "two-stage") and self.dataset.public_size == 0:
            raise KeyedValueError("dataset.public_size", f"loss.contrast={self.loss.contrast} needs a public "
                                  "slice held out by the server; set dataset.public_size (e.g. 1000)")
        if self.partition.rng == "legacy" and self.partition.kind == "shards":
            raise KeyedValueError("partition.rng", "partition.rng=legacy draws the reference's dirichlet and iid "
                                  "partitions; kind=shards has no reference counterpart; set "
                                  "partition.rng=generator")
        lam = self.lam
        if lam.learner != "none":
            if self.align.schedule != "constant":
                raise KeyedValueError("align.schedule", f"lam.learner={lam.learner} anneals with lam.anneal, so "
                                      f"align.schedule={self.align.schedule} would not be applied; set "
                                      "align.schedule=constant and choose lam.anneal instead")
            if lam.learner != "decoupled" and (lam.gamma_reg or lam.beta or lam.gamma_lambda):
                raise KeyedValueError("lam.learner", "lam.gamma_reg, lam.beta and lam.gamma_lambda act on the "
                                      f"decoupled σ objective (V13/V14), not on lam.learner={lam.learner}; use "
                                      "lam.learner=decoupled or set them to 0")
            first = self.align.lambda_min if self.align.lambda_rule == "entropy" else self.align.lambda0
            if first <= 0:
                key = "align.lambda_min" if self.align.lambda_rule == "entropy" else "align.lambda0"
                raise KeyedValueError(key, f"the λ learner starts from λ_init = exp(s_l − s_a) > 0, so {key} "
                                      f"must be > 0 (got {first})")
        for rule in self.eval.rules or []:
            if rule != "primary" and rule not in STRATEGIES:
                raise KeyedValueError("eval.rules", f"unknown rule {rule!r}; the rules are primary or a registered "
                                      f"server strategy: {', '.join(STRATEGIES.names())}")
            if self.head != "prototype" and rule != "primary" and STRATEGIES.get(rule).needs_prototypes:
                raise KeyedValueError("eval.rules", f"rule {rule!r} reads prototypes, which "
                                      f"loss.objective={self.loss.objective} has not; use output, fedavg or primary")
        for name in sorted({n for n in (self.eval.rules or []) if n != "primary"} | {self.server.primary} - {"auto"}):
            STRATEGIES.get(name).check(self)  # a strategy's own requirements (e.g. a public slice), before training
        if self.eval.every > 1 and self.server.protos == "trainable" and self.server.protos_flow == "reference":
            raise KeyedValueError("eval.every", "with server.protos_flow=reference the server trains the clients' "
                                  "next target G at every evaluation, so skipping evaluations would change training; "
                                  "set eval.every=1")
        CLIENT_ENGINES.get(self.client_engine).check(self)  # what the engine cannot run, stated beside its code
        return self

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
        global_p = self.progress != "round-reset"  # a per-round reset does not depend on R
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
