"""The configuration schema: one pydantic model, every key with its type, range and meaning, and every
cross-key check (so a bad combination fails before any data is loaded)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flare.config.protocol import fill_protocol

ScheduleName = Literal["constant", "linear", "cosine"]

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
EVAL_RULES = ("primary", "feature", "iffi", "iffi_reference", "output", "fedavg")


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


class KeyedValueError(ValueError):
    """A cross-key validation error that knows which key to blame."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DatasetCfg(_Strict):
    name: str = Field("fmnist", description="fmnist, mnist, cifar10, cifar100, svhn, tinyimagenet, imagefolder "
                                            "(`flare datasets`)")
    root: str | None = Field(None, description="where the data lives (a folder, or a .tar/.tar.gz for imagefolder)")
    format: Literal["auto", "torchvision", "imagefolder", "idx"] = Field(
        "auto", description="auto, torchvision, imagefolder or idx")
    download: bool = Field(False, description="let torchvision download the dataset into root (needs internet)")
    train_subset: int | None = Field(None, gt=0, description="seeded stratified subset of the training set "
                                                             "(at most its size)")
    test_subset: int | None = Field(None, gt=0, description="seeded stratified subset of the test set "
                                                            "(at most its size)")
    cache_dir: str | None = Field(None, description="where decoded uint8 tensors are cached (default $FLARE_CACHE "
                                                    "or ~/.cache/flare)")
    public_size: int = Field(0, ge=0, description="samples held out for the server's public bank")


class PartitionCfg(_Strict):
    kind: Literal["dirichlet", "dirichlet-fafi", "iid", "shards"] = Field(
        "dirichlet", description="dirichlet (card dealer: every sample once), dirichlet-fafi (the official FAFI "
                                 "partition: min(N_c, round(10·N_0·q)) samples of class c, overlapping across "
                                 "clients), iid or shards")
    rng: Literal["generator", "legacy"] = Field(
        "generator", description="generator (numpy's Generator, seeded) or legacy (numpy's legacy RandomState and "
                                 "Python's random in the reference's order: the notes' exact class counts; "
                                 "dirichlet kinds and iid)")
    alpha: float = Field(0.05, gt=0, description="Dirichlet concentration (smaller = more skew)")
    shards_per_client: int = Field(2, ge=1, description="classes per client for kind=shards")


class ModelCfg(_Strict):
    name: str = Field("resnet18", description="resnet18, resnet34, resnet50 (CIFAR-style) or cnn (`flare models`)")
    width: float = Field(1.0, gt=0, description="channel width multiplier (0.25 → d = 128 for resnet18)")


class OptimCfg(_Strict):
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0, description="SGD weight decay (the seeds' configs wrote 1e-4 but their "
                                                       "code never applied it)")
    grad_clip: float | None = Field(1.0, gt=0, description="clip the global gradient norm (null: off)")
    reset_each_round: bool = Field(True, description="fresh optimizer (momentum) every round, as the seeds did")
    linear_scaling: bool = Field(False, description="scale lr by batch_size/512")


class LRScheduleCfg(_Strict):
    kind: Literal["constant", "cosine", "sgdr"] = Field("constant", description="constant, cosine or sgdr "
                                                                                "(SPEC §8)")
    decay_per_round: float = Field(1.0, gt=0, le=1, description="constant: lr *= this every round (seeds: 0.998)")
    min_lr: float = Field(0.0, ge=0, description="floor of cosine/sgdr")
    t0: float = Field(10.0, description="sgdr: first period, in local epochs")
    t_mult: float = Field(2.0, ge=1, description="sgdr: period multiplier")
    cycle_decay: float = Field(1.0, gt=0, le=1, description="sgdr: peak lr multiplied by this at each restart")
    reset_momentum: bool = Field(False, description="sgdr: clear momentum buffers at each restart")

    @field_validator("t0")
    @classmethod
    def _t0_positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("T_0 must be > 0 (the first SGDR period, in local epochs)")
        return v


class AugmentCfg(_Strict):
    per_image: bool = Field(True, description="False: one parameter set per batch, as the seeds' code did")
    input_scaling: Literal["dataset", "reference"] = Field(
        "dataset", description="dataset: (x − mean)/std of the training set for training and test; reference: the "
                               "reference's transforms (CIFAR-10, Tiny and datasets it lacks: train views "
                               "Normalize(0.5) → [−1, 1], test [0, 1]; CIFAR-100, SVHN: normalised by the dataset "
                               "and again by the augmentation, the colour jitter clamping to [0, 1] when it fires)")


class LossCfg(_Strict):
    objective: Literal["fafi", "ce"] = Field("fafi", description="fafi (prototype head) or ce (plain classifier: "
                                                                 "fedavg/ensemble baselines)")
    tau_con: float = Field(0.07, gt=0, description="SupCon temperature τ")
    base_tau: float = Field(0.07, gt=0, description="SupCon base temperature")
    tau_pf: float = Field(1.0, gt=0, description="prototype–feature temperature")
    tau_pp: float = Field(1.0, gt=0, description="prototype–prototype temperature")
    contrast: Literal["none", "memory-bank", "public-bank", "two-stage"] = Field(
        "none", description="contrast-set extension: none, memory-bank, public-bank, two-stage")
    bank_size: int = Field(4096, ge=1, description="memory bank FIFO size")
    bank_tau: float = Field(0.5, gt=0, description="temperature of the bank terms")
    public_stage_epochs: int = Field(1, ge=0, description="two-stage: the first local epochs, which use the "
                                                          "public-bank term alone")
    teacher_epochs: int = Field(3, ge=1, description="public bank: epochs the server trains its teacher")
    ce_input: Literal["augmented", "plain"] = Field(
        "augmented", description="objective=ce (FedAvg/Ensemble): two augmented views, or one un-augmented view "
                                 "(the evaluation transform), as the reference trained its baselines")


class AlignCfg(_Strict):
    anchors: Literal["none", "random", "etf"] = Field("none", description="fixed anchors A: none, random or etf")
    target: Literal["fixed", "progressive"] = Field("fixed", description="fixed (A) or progressive "
                                                                         "((1−p)P⁰ + pA, V8)")
    lambda0: float = Field(1.0, ge=0, description="λ0 for lambda_rule=fixed")
    lambda_rule: Literal["fixed", "entropy"] = Field("fixed", description="fixed (λ0) or entropy "
                                                                          "(V9: λ_min + H/log2C·(λ_max − λ_min))")
    lambda_min: float = Field(0.1, ge=0, description="entropy rule λ_min")
    lambda_max: float = Field(10.0, ge=0, description="entropy rule λ_max")
    schedule: ScheduleName = Field("constant", description="annealing a(p) of λ: constant, linear, cosine")
    surgery: Literal["none", "pcgrad"] = Field("none", description="gradient surgery: none or pcgrad (Plan C)")
    target_progress: Literal["global", "round-reset"] = Field(
        "global", description="progress of V8's target: global (the run's `progress`) or round-reset (j/E, j the "
                              "epoch within the round, as the reference: with E = 1 the target stays at P⁰)")

    @model_validator(mode="after")
    def _range(self) -> "AlignCfg":
        if self.lambda_min > self.lambda_max:
            raise ValueError(
                f"align.lambda_min ({self.lambda_min}) > align.lambda_max ({self.lambda_max}); "
                "the entropy rule needs lambda_min <= lambda_max"
            )
        return self


class LamCfg(_Strict):
    """The λ learner of SPEC §7 (V10–V14)."""

    learner: Literal["none", "uw", "uw-rescaled", "decoupled"] = Field(
        "none", description="λ learner (SPEC §7): none, uw (V10), uw-rescaled (V10r/V11), decoupled (V12–V14)")
    sigma_lr: float = Field(0.005, gt=0, description="SGD lr of the log-variances s_l, s_a")
    anneal: ScheduleName = Field("constant", description="V11: external a(p) on L_align; V12+: meta s(p)")
    gamma_reg: float = Field(0.0, ge=0, description="V13 stability anchor γ_reg·e^{-s_a}")
    beta: float = Field(0.0, ge=0, description="V14 ceiling β·s_l²")
    gamma_lambda: float = Field(0.0, ge=0, description="V14 safety valve γ_λ·ReLU(λ_raw − valve_threshold)")
    valve_threshold: float = Field(50.0, gt=0, description="V14: λ_raw above this opens the safety valve "
                                                           "(the notes' λ_max = 50)")


class ServerCfg(_Strict):
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
    primary: Literal["auto", "feature", "iffi", "iffi_reference", "output", "fedavg"] = Field(
        "auto", description="the rule whose accuracy is 'the' accuracy (auto: feature for prototype heads, "
                            "output otherwise)")


class EvalCfg(_Strict):
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


class LoggingCfg(_Strict):
    tensorboard: bool = Field(False, description="also write TensorBoard scalars to <run>/tensorboard")


class Config(_Strict):
    protocol: Literal["clean", "reference"] = Field(
        "clean", description="clean (ours) or reference: sets every protocol item the config does not set itself "
                             "to the reference code's behaviour (docs/reproduction.md lists the items)")
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
        """protocol=reference fills every protocol item the mapping leaves unset (config/protocol.py)."""
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
        if self.align.surgery == "pcgrad":
            needs_anchors.append("align.surgery=pcgrad")
        if self.lam.learner != "none":
            needs_anchors.append(f"lam.learner={self.lam.learner}")
        if self.server.protos == "trainable" and self.server.protos_init == "anchors":
            needs_anchors.append("server.protos_init=anchors")
        if self.server.protos == "trainable" and self.server.protos_flow == "reference":
            needs_anchors.append("server.protos_flow=reference")
        if needs_anchors and self.align.anchors == "none":
            raise KeyedValueError("align.anchors", f"{', '.join(needs_anchors)} needs anchors to align to, but "
                                  "align.anchors=none; set align.anchors=etf (or random)")
        if self.loss.objective == "ce" and (self.align.anchors != "none" or self.server.protos == "trainable"):
            raise KeyedValueError("loss.objective", "alignment and trainable global prototypes need the "
                                  "prototype head (loss.objective=fafi), not a plain classifier")
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
            if rule not in EVAL_RULES:
                raise KeyedValueError("eval.rules", f"unknown rule {rule!r}; the rules are {', '.join(EVAL_RULES)}")
            if self.loss.objective == "ce" and rule in ("feature", "iffi", "iffi_reference"):
                raise KeyedValueError("eval.rules", f"rule {rule!r} reads prototypes, which loss.objective=ce has not; "
                                      "use output, fedavg or primary")
        if self.eval.every > 1 and self.server.protos == "trainable" and self.server.protos_flow == "reference":
            raise KeyedValueError("eval.every", "with server.protos_flow=reference the server trains the clients' "
                                  "next target G at every evaluation, so skipping evaluations would change training; "
                                  "set eval.every=1")
        if self.client_engine == "batched":
            blocked = self.batched_engine_blockers()
            if blocked:
                key, value = blocked[0]
                raise KeyedValueError(key, f"client_engine=batched does not support {key}={value} (it trains "
                                      "every client as one vmapped program, which covers the Table 1 methods: FAFI, "
                                      "CE baselines, fixed/entropy λ with annealing, the decoupled λ learner); use "
                                      f"client_engine=sequential (or threads) for {key}={value}")
        return self

    def batched_engine_blockers(self) -> list[tuple[str, object]]:
        """(key, value) of every setting the batched client engine does not implement (docs/performance.md)."""
        out: list[tuple[str, object]] = []
        if self.align.surgery != "none":
            out.append(("align.surgery", self.align.surgery))
        if self.loss.contrast != "none":
            out.append(("loss.contrast", self.loss.contrast))
        if self.lam.learner not in ("none", "decoupled"):
            out.append(("lam.learner", self.lam.learner))
        if self.progress != "epoch":
            out.append(("progress", self.progress))
        if self.align.anchors != "none" and self.align.target != "fixed":
            out.append(("align.target", self.align.target))
        if self.lr_schedule.kind == "sgdr" and self.lr_schedule.reset_momentum:
            out.append(("lr_schedule.reset_momentum", True))
        if self.loss.ce_input != "augmented":
            out.append(("loss.ce_input", self.loss.ce_input))
        if self.drop_last:
            out.append(("drop_last", True))
        if self.server.protos == "trainable" and self.server.protos_flow != "spec":
            out.append(("server.protos_flow", self.server.protos_flow))
        return out

    @property
    def head(self) -> str:
        return "prototype" if self.loss.objective == "fafi" else "linear"

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
