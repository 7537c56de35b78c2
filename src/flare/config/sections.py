"""The config's sections for data, model and optimisation, and the field types every section uses for a key that
names a part or holds a part's options (`part`, `part_options`, `part_table`: the registry checks the name and
validates the options); the loss, alignment, λ and server sections and the cross-key checks are in `schema.py`."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from flare.errors import KeyedValueError, short
from flare.registry import DATASETS, FLOAT32_MAX, MODELS, PARTITIONS, SCALINGS, Registry, boolean_number, nonfinite


class Strict(BaseModel):
    """Every config section: unknown keys are refused, and a number is never a boolean (pydantic would read
    `rounds: true` as 1 and `lr: true` as 1.0; YAML writes true for yes, on and y as well, so such a value is a
    slip, not a number)."""

    # allow_inf_nan=False: a float key is finite unless its Field says otherwise (an infinite lr passes `gt=0` and
    # would fail only after the clients trained)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if why := boolean_number(cls, info.field_name, value):
            raise ValueError(why)
        return value

    @field_validator("*")
    @classmethod
    def _float32_range(cls, value: Any) -> Any:
        if nonfinite(value):  # NaN and ±inf are refused by allow_inf_nan=False before this runs
            raise ValueError(f"give a finite number within ±{FLOAT32_MAX:.3g} (a run computes in float32)")
        return value


def part(registry: Registry, key: str | None = None, also: tuple[str, ...] = ()) -> Any:
    """The type of a key that names a part of `registry` (`key`: the config key, the registry's own by default;
    `also`: other words it accepts, e.g. `auto`). An unknown name lists the registered ones."""
    key = key or registry.key

    def known(name: str) -> str:
        if name not in also and name not in registry:
            raise KeyedValueError(key, registry.unknown(name, key, also))
        return name
    return Annotated[str, AfterValidator(known)]


def part_options(registry: Registry, name_field: str) -> Any:
    """The type of a section's `options`: validated by the options model of the part its `name_field` names, with
    the defaults filled in (so config.yaml records them); left alone when that name already failed."""
    key = registry.key.rsplit(".", 1)[0] + ".options"

    def validate(options: dict, info: ValidationInfo) -> dict:
        name = info.data.get(name_field)
        if name is None:
            return options
        opts = registry.options(name, options, key)
        return opts.model_dump(mode="json") if opts is not None else {}
    return Annotated[dict[str, Any], AfterValidator(validate)]


def part_table(registry: Registry, key: str) -> Any:
    """The type of a mapping `part name: {option: value}` (`loss.terms`, `server.strategies`): every name checked
    against `registry`, its options validated and filled in."""
    def validate(table: Any) -> Any:
        if not isinstance(table, dict):
            raise KeyedValueError(key, f"{key} must be a mapping of {registry.kind}: {{option: value}}, got {short(table)}")
        out = {}
        for name, opts in table.items():
            where = f"{key}.{name}"
            if name not in registry:
                raise KeyedValueError(where, registry.unknown(name, where))
            o = registry.options(name, opts, where)
            out[name] = o.model_dump(mode="json") if o is not None else {}
        return out
    return Annotated[dict[str, dict[str, Any]], BeforeValidator(validate)]


DatasetName, DatasetOptions = part(DATASETS), part_options(DATASETS, "name")
PartitionKind, PartitionOptions = part(PARTITIONS), part_options(PARTITIONS, "kind")
ModelName, ModelOptions = part(MODELS), part_options(MODELS, "name")
InputScalingName = part(SCALINGS)
# Bounds of the size-like keys whose value is allocated as it stands (a 10¹⁴-wide projection fails in the
# allocator with a traceback): far above any network these datasets train (resnet18 at width 16 has 2.9·10⁹
# weights), far below what an allocator refuses.
MAX_WIDTH = 16.0
MAX_FEATURE_DIM = 65536
OPTIONS_DESCRIPTION = "options of the chosen part, when it declares an options model (plugins; docs/extending.md)"


class DatasetCfg(Strict):
    name: DatasetName = Field("fmnist", description="fmnist, mnist, cifar10, cifar100, svhn, tinyimagenet, "
                                                    "imagefolder or a plugin's (`flare datasets`)")
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
    options: DatasetOptions = Field({}, description=OPTIONS_DESCRIPTION)


class PartitionCfg(Strict):
    kind: PartitionKind = Field(
        "dirichlet", description="dirichlet (card dealer: every sample once), dirichlet-fafi (the official FAFI "
                                 "partition: min(N_c, round(10·N_0·q)) samples of class c, overlapping across "
                                 "clients), iid, shards or a plugin's (`flare parts`)")
    rng: Literal["generator", "legacy"] = Field(
        "generator", description="generator (numpy's Generator, seeded) or legacy (numpy's legacy RandomState and "
                                 "Python's random in the reference's order: the notes' exact class counts; "
                                 "dirichlet kinds and iid)")
    alpha: float = Field(0.05, gt=0, description="Dirichlet concentration (smaller = more skew)")
    shards_per_client: int = Field(2, ge=1, description="classes per client for kind=shards")
    options: PartitionOptions = Field({}, description=OPTIONS_DESCRIPTION)


class ArchitectureCfg(Strict):
    """One client's network in `model.clients` / `model.mix`, or the server's in `server.model` (a bare name is
    read as `{name: NAME}`); what it leaves out is taken from `model` (config/architectures.py)."""

    name: ModelName = Field(description="a registered model (`flare models`)")
    width: float | None = Field(None, gt=0, le=MAX_WIDTH, description="its width (null: model.width)")
    options: ModelOptions = Field({}, description=OPTIONS_DESCRIPTION)
    checkpoint: str | None = Field(None, description="a local state dict it starts from (null: model.checkpoint "
                                                     "when the name is model.name, else the seeded init)")


def _architecture(where: str, value: Any) -> ArchitectureCfg:
    """One entry (a model name, or a mapping), validated with its errors keyed `where` (model.clients[2] …)."""
    if isinstance(value, ArchitectureCfg):
        return value
    try:
        return ArchitectureCfg.model_validate({"name": value} if isinstance(value, str) else value)
    except ValidationError as err:
        msgs = []
        for e in err.errors():
            msg = e["msg"].removeprefix("Value error, ").replace("for model.name", f"for {where}")
            keyed = isinstance((e.get("ctx") or {}).get("error"), KeyedValueError)
            at = ".".join(str(x) for x in e["loc"])
            msgs.append(msg if keyed else f"{where}.{at}={short(e.get('input'))}: {msg}")
        raise KeyedValueError(where, "; ".join(msgs)) from None


def architecture(key: str) -> Any:
    """The type of a key holding one architecture (`server.model`)."""
    return Annotated[Any, BeforeValidator(lambda v: None if v is None else _architecture(key, v))]


def _client_entries(value: Any) -> Any:
    key = "model.clients"
    if value is None:
        return None
    if isinstance(value, list):
        return [_architecture(f"{key}[{i}]", e) for i, e in enumerate(value)]
    if isinstance(value, dict):
        out, given = {}, {}  # client index -> its entry, and the key that gave it
        for k, e in value.items():
            if isinstance(k, bool) or not str(k).lstrip("-").isdigit():
                raise KeyedValueError(key, f"{key} maps client indices to architectures, but {short(k)} is not a client "
                                           "index (0, 1, …)")
            if int(k) in out:  # 0 and "0" (or 00) are one client: which entry wins must not be guessed
                raise KeyedValueError(f"{key}.{int(k)}", f"{key} gives client {int(k)} twice (as "
                                                         f"{given[int(k)]!r} and {short(k)}); give each client one entry")
            out[int(k)], given[int(k)] = _architecture(f"{key}.{k}", e), k
        return out
    raise KeyedValueError(key, f"{key} must be a list with one architecture per client, or a mapping client index → "
                               f"architecture; got {short(value)}")


def _mix(value: Any) -> Any:
    key = "model.mix"
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise KeyedValueError(key, f"{key} must be a mapping model name → number of clients, e.g. "
                                   f"{{resnet18: 3, cnn: 2}}; got {short(value)}")
    for name, count in value.items():
        if name not in MODELS:
            raise KeyedValueError(f"{key}.{name}", MODELS.unknown(str(name), f"{key}"))
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise KeyedValueError(f"{key}.{name}", f"{key}.{name}={short(count)}: a number of clients must be an "
                                                   "integer ≥ 0")
    return value


ClientArchitectures = Annotated[Any, BeforeValidator(_client_entries)]
ModelMix = Annotated[Any, BeforeValidator(_mix)]


class ModelCfg(Strict):
    name: ModelName = Field("resnet18", description="resnet18, resnet34, resnet50 (CIFAR-style), cnn, wrn16_1, "
                                                      "wrn40_1, cnn_dense, cnn_coboost, timm/<any timm name> or a "
                                                      "plugin's (`flare models`; docs/models.md)")
    width: float = Field(1.0, gt=0, le=MAX_WIDTH, description="channel width multiplier (0.25 → d = 128 for resnet18)")
    options: ModelOptions = Field({}, description=OPTIONS_DESCRIPTION)
    checkpoint: str | None = Field(None, description="a local state dict every client starts from, loaded "
                                                     "weights_only into the seeded init (null: the seeded init; "
                                                     "docs/models.md#checkpoint)")
    clients: ClientArchitectures = Field(
        None, description="per-client architectures: a list of num_clients entries, or a mapping client index → "
                          "entry (the others run `model`); an entry is a model name or {name, width, options, "
                          "checkpoint} (docs/heterogeneous.md)")
    mix: ModelMix = Field(
        None, description="a named mix, model name → number of clients (summing to num_clients), dealt to the "
                          "clients by a permutation seeded with `seed`")
    feature_dim: int | None = Field(None, ge=1, le=MAX_FEATURE_DIM,
                                    description="shared feature dimension d: a linear projection of the encoder's "
                                                "pooled feature to d before the head (null: the encoder's own d; "
                                                "clients whose encoders' d differ need it)")


class OptimCfg(Strict):
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0, description="SGD weight decay (the seeds' configs wrote 1e-4 but their "
                                                       "code never applied it)")
    grad_clip: float | None = Field(1.0, gt=0, description="clip the global gradient norm (null: off)")
    reset_each_round: bool = Field(True, description="fresh optimizer (momentum) every round, as the seeds did")
    linear_scaling: bool = Field(False, description="scale lr by batch_size/512")


class LRScheduleCfg(Strict):
    kind: Literal["constant", "cosine", "sgdr"] = Field(
        "constant", description="constant, cosine or sgdr (docs/method.md#learning-rate-schedules)")
    decay_per_round: float = Field(1.0, gt=0, le=1, description="constant: lr *= this every round (seeds: 0.998)")
    min_lr: float = Field(0.0, ge=0, description="floor of cosine/sgdr")
    t0: float = Field(10.0, gt=0, description="sgdr: first period, in local epochs")
    t_mult: float = Field(2.0, ge=1, description="sgdr: period multiplier")
    cycle_decay: float = Field(1.0, gt=0, le=1, description="sgdr: peak lr multiplied by this at each restart")
    reset_momentum: bool = Field(False, description="sgdr: clear momentum buffers at each restart")


class AugmentCfg(Strict):
    per_image: bool = Field(True, description="False: one parameter set per batch, as the seeds' code did")
    schedule: Literal["per_batch", "chunked"] = Field(
        "per_batch", description="per_batch: each step augments its own batch; chunked: runs of consecutive batches "
                                 "of an epoch are augmented in one call and the steps slice their views out of it "
                                 "(faster for small models at small batches; other random draws, needs "
                                 "per_image=true; docs/performance.md#chunked-augmentation)")
    crop: Literal["kornia", "separable"] = Field("kornia", description="separable: kornia's crops as two small matrix "
                                                 "products per image, faster on small images; other last digits")
    input_scaling: InputScalingName = Field(
        "dataset", description="dataset: (x − mean)/std of the training set for training and test; reference: the "
                               "reference's transforms (CIFAR-10, Tiny and datasets it lacks: train views "
                               "Normalize(0.5) → [−1, 1], test [0, 1]; CIFAR-100, SVHN: normalised by the dataset "
                               "and again by the augmentation, the colour jitter clamping to [0, 1] when it fires); "
                               "none: x/255 only (ToTensor), training and test — NIID-Bench's, FedLPA's and DENSE's "
                               "Fashion-MNIST")

    @model_validator(mode="after")
    def _chunked_draws_per_image(self):
        # per_image=false means one parameter set per training batch; a chunked call spans several batches
        if self.schedule == "chunked" and not self.per_image:
            raise KeyedValueError("augment.schedule", "augment.schedule=chunked draws every image's parameters "
                                  "itself; augment.per_image=false (one parameter set per batch) needs per_batch")
        return self
