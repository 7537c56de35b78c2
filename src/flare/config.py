"""The configuration schema: one pydantic model, validated before anything runs.

A run's config is built in layers: schema defaults <- preset YAML <- the user's YAML file <- dotted
`KEY=VALUE` overrides from the command line. A *method* is nothing but a preset: a few lines that pick
the composable parts (objective, anchors, schedule, λ learner, gradient surgery, server rules).
Every mistake becomes a `FlareError` that names the key and the fix (the CLI prints it, exit code 2).
"""
from __future__ import annotations

import copy
import difflib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flare.errors import FlareError

ScheduleName = Literal["constant", "linear", "cosine"]


class KeyedValueError(ValueError):
    """A cross-key validation error that knows which key to blame."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DatasetCfg(_Strict):
    name: str = "fmnist"
    root: str | None = None
    format: Literal["auto", "torchvision", "imagefolder", "idx"] = "auto"
    download: bool = False
    train_subset: int | None = Field(None, gt=0, description="seeded stratified subset of the training set")
    test_subset: int | None = Field(None, gt=0, description="seeded stratified subset of the test set")
    cache_dir: str | None = None
    public_size: int = Field(0, ge=0, description="samples held out for the server's public bank")


class PartitionCfg(_Strict):
    kind: Literal["dirichlet", "iid", "shards"] = "dirichlet"
    alpha: float = Field(0.05, gt=0, description="Dirichlet concentration (smaller = more skew)")
    shards_per_client: int = Field(2, ge=1, description="classes per client for kind=shards")


class ModelCfg(_Strict):
    name: str = "resnet18"
    width: float = Field(1.0, gt=0)


class OptimCfg(_Strict):
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, description="the seeds wrote 5e-4 in configs but never applied it")
    grad_clip: float | None = Field(1.0, gt=0)
    reset_each_round: bool = Field(True, description="fresh optimizer (momentum) every round, as the seeds did")
    linear_scaling: bool = Field(False, description="scale lr by batch_size/512")


class LRScheduleCfg(_Strict):
    kind: Literal["constant", "cosine", "sgdr"] = "constant"
    decay_per_round: float = Field(1.0, gt=0, le=1, description="constant: lr *= this every round (seeds: 0.998)")
    min_lr: float = Field(0.0, ge=0)
    t0: float = Field(10.0, description="sgdr: first period, in local epochs")
    t_mult: float = Field(2.0, ge=1)
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


class LossCfg(_Strict):
    objective: Literal["fafi", "ce"] = "fafi"
    tau_con: float = Field(0.07, gt=0)
    base_tau: float = Field(0.07, gt=0)
    tau_pf: float = Field(1.0, gt=0)
    tau_pp: float = Field(1.0, gt=0)
    contrast: Literal["none", "memory-bank", "public-bank", "two-stage"] = "none"
    bank_size: int = Field(4096, ge=1)
    bank_tau: float = Field(0.5, gt=0)
    alignment_epochs: int = Field(1, ge=0, description="two-stage: epochs that use the public-bank term alone")
    teacher_epochs: int = Field(3, ge=1, description="public bank: epochs the server trains its teacher")


class AlignCfg(_Strict):
    anchors: Literal["none", "random", "etf"] = "none"
    target: Literal["fixed", "progressive"] = "fixed"
    lambda0: float = Field(1.0, ge=0)
    lambda_rule: Literal["fixed", "entropy"] = "fixed"
    lambda_min: float = Field(0.1, ge=0)
    lambda_max: float = Field(10.0, ge=0)
    schedule: ScheduleName = "constant"
    surgery: Literal["none", "pcgrad"] = "none"

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

    learner: Literal["none", "uw", "uw-rescaled", "decoupled"] = "none"
    sigma_lr: float = Field(0.005, gt=0)
    anneal: ScheduleName = Field("constant", description="V11: external a(p) on L_align; V12+: meta s(p)")
    gamma_reg: float = Field(0.0, ge=0, description="V13 stability anchor γ_reg·e^{-s_a}")
    beta: float = Field(0.0, ge=0, description="V14 ceiling β·s_l²")
    gamma_lambda: float = Field(0.0, ge=0, description="V14 safety valve γ_λ·ReLU(λ_raw − λ_max)")
    lambda_max: float = Field(50.0, gt=0, description="V14 valve threshold")


class ServerCfg(_Strict):
    weights: Literal["size", "uniform"] = "size"
    protos: Literal["mean", "trainable"] = "mean"
    protos_init: Literal["mean", "anchors"] = "mean"
    server_epochs: int = Field(20, ge=1)
    server_lr: float = Field(1e-3, gt=0)
    gamma_etf: float = Field(0.1, ge=0)
    primary: Literal["auto", "feature", "iffi", "iffi_reference", "output", "fedavg"] = "auto"


class EvalCfg(_Strict):
    noise_seed: int = 0


class LoggingCfg(_Strict):
    tensorboard: bool = False


class Config(_Strict):
    preset: str | None = None
    method: str = "fafi"
    description: str = ""
    notes_name: str = ""
    seed: int = 1
    device: str = "auto"
    num_clients: int = Field(5, ge=1)
    rounds: int = Field(50, ge=1)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(512, ge=1)
    test_batch_size: int = Field(256, ge=1)
    lr: float = Field(0.05, gt=0)
    progress: Literal["epoch", "step"] = "epoch"
    amp: Literal["auto", "off", "bf16"] = "auto"
    channels_last: bool = Field(True, description="NHWC layout on CUDA (ignored on CPU)")
    compile: bool = False
    concurrent_clients: bool = False
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
        if needs_anchors and self.align.anchors == "none":
            raise KeyedValueError("align.anchors", f"{', '.join(needs_anchors)} needs anchors to align to, but "
                                  "align.anchors=none; set align.anchors=etf (or random)")
        if self.loss.objective == "ce" and (self.align.anchors != "none" or self.server.protos == "trainable"):
            raise KeyedValueError("loss.objective", "alignment and trainable global prototypes need the "
                                  "prototype head (loss.objective=fafi), not a plain classifier")
        if self.loss.contrast in ("public-bank", "two-stage") and self.dataset.public_size == 0:
            raise KeyedValueError("dataset.public_size", f"loss.contrast={self.loss.contrast} needs a public "
                                  "slice held out by the server; set dataset.public_size (e.g. 1000)")
        return self

    @property
    def head(self) -> str:
        return "prototype" if self.loss.objective == "fafi" else "linear"

    @property
    def total_epochs(self) -> int:
        return self.rounds * self.local_epochs


# ----------------------------------------------------------------------------------------------
# presets


def _preset_dir():
    return resources.files("flare") / "presets"


def list_presets() -> dict[str, dict]:
    """name -> the preset's YAML mapping (with its description and the notes' V-number)."""
    out = {}
    for f in sorted(_preset_dir().iterdir(), key=lambda p: p.name):
        if f.name.endswith(".yaml"):
            out[f.name[:-5]] = yaml.safe_load(f.read_text()) or {}
    return out


def preset_mapping(name: str) -> dict:
    presets = list_presets()
    if name not in presets:
        close = difflib.get_close_matches(name, presets, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise FlareError(f"unknown preset '{name}'.{hint}", key="preset",
                         fix=f"use one of: {', '.join(presets)} (`flare presets` lists them).")
    m = presets[name]
    m.setdefault("method", name)
    m["preset"] = name
    return m


# ----------------------------------------------------------------------------------------------
# layering and validation


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_overrides(items: list[str]) -> dict:
    """`a.b=3 c=[1,2]` -> {'a': {'b': 3}, 'c': [1, 2]} (values parsed as YAML scalars)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise FlareError(f"override '{item}' is not of the form KEY=VALUE.", key=item,
                             fix="write e.g. partition.alpha=0.1")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise FlareError(f"override '{item}' has an empty key.", fix="write e.g. rounds=5")
        try:
            value = yaml.safe_load(raw) if raw.strip() != "" else None
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise FlareError(f"override '{item}' conflicts with another override.", key=key)
        node[parts[-1]] = value
    return out


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _known_keys(ann, prefix + name + ".")
    return keys


def _explain(err: ValidationError) -> FlareError:
    """Turn pydantic's report into one paragraph that names the key and the fix."""
    lines, first_key, fix = [], None, None
    known = _known_keys(Config)
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if not key and isinstance(cause, KeyedValueError):
            key = cause.key
        first_key = first_key or key
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, known, n=1)
            lines.append(f"unknown key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
            fix = fix or "remove it or correct its spelling; README's config reference lists every key."
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{msg}" if isinstance(cause, KeyedValueError) else f"{key}={e.get('input')!r}: {msg}")
            fix = fix or "correct that value (README's config reference gives types and ranges)."
    return FlareError("invalid configuration: " + "; ".join(lines) + ".", key=first_key, fix=fix)


def build_config(mapping: dict) -> Config:
    try:
        return Config.model_validate(mapping)
    except ValidationError as err:
        raise _explain(err) from None


def load_config(config_file: str | Path | None = None, preset: str | None = None,
                overrides: list[str] | dict | None = None) -> Config:
    """defaults <- preset <- file <- overrides. The file may name a preset with `preset: NAME`."""
    file_map: dict = {}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise FlareError(f"config file '{path}' does not exist.", key="--config",
                             fix="give the path of a YAML file.")
        try:
            file_map = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise FlareError(f"config file '{path}' is not valid YAML: {e}", key="--config") from None
        if not isinstance(file_map, dict):
            raise FlareError(f"config file '{path}' must hold a mapping of keys.", key="--config")
    ov = overrides if isinstance(overrides, dict) else parse_overrides(list(overrides or []))
    preset = preset or ov.get("preset") or file_map.get("preset")
    mapping: dict = {}
    if preset:
        mapping = deep_merge(mapping, preset_mapping(preset))
    mapping = deep_merge(mapping, file_map)
    mapping = deep_merge(mapping, ov)
    if preset:
        mapping["preset"] = preset
    return build_config(mapping)


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# Descriptions for keys whose Field has none (kept here so the schema above stays compact).
DESCRIPTIONS = {
    "preset": "method preset applied under the file and overrides (`flare presets`)",
    "method": "display name of the method (defaults to the preset's name)",
    "description": "one-line description (set by presets)",
    "notes_name": "the research notes' name for this method, e.g. V7",
    "seed": "seeds the partition, the global init, the anchors and every client's random streams",
    "device": "auto (the GPU when there is one), cpu, cuda, cuda:N",
    "num_clients": "K, the number of clients",
    "rounds": "R, evaluation checkpoints (rounds) of local training",
    "local_epochs": "E, local epochs per round (R·E epochs in total per client)",
    "batch_size": "B, local batch size (two views each: 2B images per step)",
    "test_batch_size": "evaluation batch size",
    "lr": "SGD learning rate",
    "progress": "granularity of p = e/(R·E): per completed epoch (the seeds') or per step",
    "amp": "bf16 autocast: auto (on GPUs that support it), off, bf16",
    "compile": "torch.compile the client models",
    "concurrent_clients": "train a round's clients concurrently on one GPU",
    "dataset.name": "fmnist, mnist, cifar10, cifar100, svhn, tinyimagenet, imagefolder (`flare datasets`)",
    "dataset.root": "where the data lives (a folder, or a .tar/.tar.gz for imagefolder)",
    "dataset.format": "auto, torchvision, imagefolder or idx",
    "dataset.download": "let torchvision download the dataset into root (needs internet)",
    "dataset.cache_dir": "where decoded uint8 tensors are cached (default $FLARE_CACHE or ~/.cache/flare)",
    "partition.kind": "dirichlet (card dealer), iid or shards",
    "model.name": "resnet18, resnet34, resnet50 (CIFAR-style) or cnn (`flare models`)",
    "model.width": "channel width multiplier (0.25 → d = 128 for resnet18)",
    "optim.momentum": "SGD momentum",
    "optim.grad_clip": "clip the global gradient norm (null: off)",
    "lr_schedule.kind": "constant, cosine or sgdr (SPEC §8)",
    "lr_schedule.min_lr": "floor of cosine/sgdr",
    "lr_schedule.t_mult": "sgdr: period multiplier",
    "loss.objective": "fafi (prototype head) or ce (plain classifier: fedavg/ensemble baselines)",
    "loss.tau_con": "SupCon temperature τ",
    "loss.base_tau": "SupCon base temperature",
    "loss.tau_pf": "prototype–feature temperature",
    "loss.tau_pp": "prototype–prototype temperature",
    "loss.contrast": "contrast-set extension: none, memory-bank, public-bank, two-stage",
    "loss.bank_size": "memory bank FIFO size",
    "loss.bank_tau": "temperature of the bank terms",
    "align.anchors": "fixed anchors A: none, random or etf",
    "align.target": "fixed (A) or progressive ((1−p)P⁰ + pA, V8)",
    "align.lambda0": "λ0 for lambda_rule=fixed",
    "align.lambda_rule": "fixed (λ0) or entropy (V9: λ_min + H/log2C·(λ_max − λ_min))",
    "align.lambda_min": "entropy rule λ_min",
    "align.lambda_max": "entropy rule λ_max",
    "align.schedule": "annealing a(p) of λ: constant, linear, cosine",
    "align.surgery": "gradient surgery: none or pcgrad (Plan C)",
    "lam.learner": "λ learner (SPEC §7): none, uw (V10), uw-rescaled (V10r/V11), decoupled (V12–V14)",
    "lam.sigma_lr": "SGD lr of the log-variances s_l, s_a",
    "server.weights": "aggregation weights: size (n_i/Σn) or uniform (1/K)",
    "server.protos": "global prototypes: mean or trainable (Plan B)",
    "server.protos_init": "Plan B init: mean of client prototypes or the anchors",
    "server.server_epochs": "Plan B server epochs",
    "server.server_lr": "Plan B Adam lr",
    "server.gamma_etf": "Plan B weight of MSE(G, A)",
    "server.primary": "the rule whose accuracy is 'the' accuracy (auto: feature for prototype heads, output otherwise)",
    "eval.noise_seed": "seed of IFFI's noise inputs",
    "logging.tensorboard": "also write TensorBoard scalars to <run>/tensorboard",
}


def config_reference() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every key — the README's config table is built from this."""
    rows = []

    def walk(model: type[BaseModel], inst: BaseModel, prefix: str):
        for name, field in model.model_fields.items():
            ann = field.annotation
            val = getattr(inst, name)
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, val, prefix + name + ".")
                continue
            t = str(ann).replace("typing.", "").replace("<class '", "").replace("'>", "")
            key = prefix + name
            rows.append((key, t, repr(val), field.description or DESCRIPTIONS.get(key, "")))

    walk(Config, Config(), "")
    return rows


def as_mapping(cfg: Config) -> dict[str, Any]:
    return cfg.model_dump(mode="json")
