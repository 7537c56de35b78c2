"""Model zoo (docs/models.md): a timm-style registry of encoders plus the `FlareNet` wrapper.

    model = create_model("resnet18", in_channels=3, num_classes=10, width=1.0, head="prototype")
    feat, logits = model(x)        # feat = f(x) (B×d, un-normalised); logits from the head

The built-in networks are registered below, `timm/<name>` for any timm architecture by `timm_zoo.py`, in
`flare.registry.MODELS`, plus any a plugin registers (`register_model`). `load_checkpoint` starts a model from a
local state dict (`model.checkpoint`)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from pydantic import BaseModel
from torch import Tensor, nn

from ..errors import FlareError
from ..registry import MODELS
from . import cifar as _cifar
from . import cnn as _cnn
from . import resnet as _resnet
from . import small as _small
from . import pretrained as _pretrained
from .heads import ETFHead, LinearHead, PrototypeHead
from .timm_zoo import timm_names  # registers the timm/ namespace (timm itself is imported on first use)


@dataclass(frozen=True)
class ModelFacts:
    """What an encoder is built from besides its options: the input's channels and `model.width`."""
    in_channels: int
    width: float


class ModelBuilder(Protocol):
    """What `MODELS` holds: builds an encoder with a `feature_dim` attribute; `options`: the validated `model.options`
    (None for a builder without an options model). `create_model` adds the head the objective trains."""
    def __call__(self, facts: ModelFacts, options: BaseModel | None) -> nn.Module: ...

__all__ = ["FlareNet", "PrototypeHead", "LinearHead", "create_model", "list_models", "register_model", "HEADS",
           "check_state_fits", "layout", "load_checkpoint", "create_architecture", "check_input_fits", "timm_names"]

HEADS: dict[str, type[nn.Module]] = {"prototype": PrototypeHead, "linear": LinearHead, "etf": ETFHead}


def register_model(name_or_fn, *, options: type[BaseModel] | None = None, description: str = "",
                   check=None, overwrite: bool = False):
    """Register an encoder builder (`ModelBuilder`) as `@register_model` (name = function name) or
    `@register_model("name", options=MyOptions)`; `check(cfg)` refuses a config the model cannot serve
    (`Registry.register`). Re-registering a name raises unless `overwrite=True`."""
    kw = dict(options=options, description=description, check=check, overwrite=overwrite)
    if callable(name_or_fn):
        return MODELS.register(name_or_fn.__name__, name_or_fn, **kw)
    return MODELS.register(str(name_or_fn), **kw)


def list_models() -> list[str]:
    """Sorted list of registered model names."""
    return sorted(MODELS.names())


class FlareNet(nn.Module):
    """Encoder f plus a head. `forward(x) -> (feat, logits)` with feat = f(x) (raw, un-normalised)."""

    def __init__(self, encoder: nn.Module, head: nn.Module, *, name: str = "", proj: nn.Linear | None = None):
        super().__init__()
        self.encoder = encoder
        self.proj = proj  # None adds no tensor: a model without model.feature_dim keeps its state dict
        self.head = head
        self.name = name
        self.feature_dim: int = int(proj.out_features if proj is not None else encoder.feature_dim)
        self.num_classes: int = int(head.num_classes)
        self.head_kind: str = getattr(head, "kind", "linear")

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        feat = self.encoder(x)
        if self.proj is not None:
            feat = self.proj(feat)
        return feat, self.head(feat)

    @property
    def prototypes(self) -> nn.Parameter | None:
        """The head's C×d prototype matrix (a Parameter), or None for a linear head."""
        return getattr(self.head, "prototypes", None)


def create_model(name: str, in_channels: int, num_classes: int, width: float = 1.0, head: str = "prototype",
                 options: dict | None = None, feature_dim: int | None = None) -> FlareNet:
    """Build a registered encoder + head. Unknown names raise `FlareError` (key `model.name`). `feature_dim`: a
    linear projection of the encoder's feature to that d before the head (`model.feature_dim`: the shared d that
    makes prototypes, anchors and features of different encoders comparable)."""
    MODELS.entry(name)  # an unknown name first
    if head not in HEADS:
        raise FlareError(f"unknown head {head!r}.", key="model.head", fix="one of " + ", ".join(sorted(HEADS)) + ".")
    try:
        w = float(width)
    except (TypeError, ValueError):
        w = float("nan")
    if not w > 0:  # also rejects NaN
        raise FlareError(f"width must be a positive number, got {width!r}.", key="model.width",
                         fix="use e.g. 1.0, 0.5 or 0.25.")
    width = w
    if int(in_channels) < 1 or int(num_classes) < 1:
        raise FlareError(f"in_channels and num_classes must be ≥ 1 (got {in_channels}, {num_classes}).", key="model",
                         fix="check the dataset: 1 channel for Fashion-MNIST, 3 for CIFAR.")
    try:
        encoder = MODELS.create(name, ModelFacts(int(in_channels), width), options)
        proj = nn.Linear(int(encoder.feature_dim), int(feature_dim)) if feature_dim is not None else None
        d = int(feature_dim) if feature_dim is not None else int(encoder.feature_dim)
        return FlareNet(encoder, HEADS[head](int(num_classes), d), name=name, proj=proj)
    except (MemoryError, RuntimeError) as e:  # a size no allocator grants (a plugin's or timm's own size option)
        if not isinstance(e, MemoryError) and "alloc" not in str(e).lower():
            raise
        raise FlareError(f"model {name} at width {width:g}" + (f" with options {options}" if options else "")
                         + (f" and feature_dim {feature_dim}" if feature_dim is not None else "")
                         + f" needs more memory than this machine can allocate ({str(e).splitlines()[0][:160]}).",
                         key="model.width", fix="use a smaller model.width, model.feature_dim or size in "
                                                "model.options.") from None


def _net(cls, *args):
    """A network class `cls(*args, in_channels, width)` as a builder `(facts, options) -> encoder`."""
    return lambda facts, options: cls(*args, facts.in_channels, facts.width)


R, C, S = _resnet, _cifar, _small  # the modules of the built-in networks
for _name, _build, _what in (
        ("resnet18", _net(R.ResNetEncoder, R.BasicBlock, (2, 2, 2, 2)), "CIFAR-style ResNet-18 (d = 512·width)"),
        ("resnet34", _net(R.ResNetEncoder, R.BasicBlock, (3, 4, 6, 3)), "CIFAR-style ResNet-34 (d = 512·width)"),
        ("resnet50", _net(R.ResNetEncoder, R.Bottleneck, (3, 4, 6, 3)), "CIFAR-style ResNet-50 (d = 2048·width)"),
        ("cnn", _net(_cnn.SmallCNN), "small CNN for CPU runs"),
        ("wrn16_1", _net(C.WideResNet, 16, 1), "CIFAR WideResNet-16-1 (d = 64·width)"),
        ("wrn40_1", _net(C.WideResNet, 40, 1), "CIFAR WideResNet-40-1 (d = 64·width)"),
        ("cnn_dense", _net(C.PaperCNN, (32, 64, 64), 64), "DENSE's small CIFAR CNN (d = 64·width)"),
        ("cnn_coboost", _net(C.PaperCNN, (128, 128, 128), None), "Co-Boosting's CIFAR CNN (d = 2048·width)"),
        ("simple-cnn", _net(S.SimpleCNN), "NIID-Bench's simple-cnn, FedLPA's clients (no BN; d = 84·width)"),
        ("cnn_mnist_dense", _net(S.DenseMnistCNN), "DENSE's FMNIST/MNIST CNN (BN; d = 1568·width at 28×28)")):
    register_model(_name, description=_what)(_build)
for _name, _builder in _pretrained.ENCODERS.items():
    register_model(_name, options=_pretrained.EncoderOptions, check=_pretrained.refuse_image_runs,
                   description=f"{_name}, ImageNet weights, frozen: via dataset.name=features (d = 1280)")(_builder)
register_model("adapter", options=_pretrained.AdapterOptions, description="linear / MLP adapter over cached "
               "encoder features (d = dim·width; dim 0: identity)")(_pretrained.adapter)


def layout(model: nn.Module | dict) -> tuple:
    """The names and shapes of a model's (or a state dict's) tensors: models of one layout can be stacked (the
    batched engine) or averaged tensor by tensor (FedAvg, FedDF's start); clients of different architectures differ
    in it."""
    state = model.state_dict() if isinstance(model, nn.Module) else model
    return tuple((k, tuple(v.shape)) for k, v in state.items())


def check_state_fits(model: nn.Module, state: dict, source: str, *, key: str, fix: str) -> None:
    """Refuse a state dict that does not fit `model` with a FlareError naming the first tensor at fault and both
    shapes (torch's `load_state_dict` would list every mismatch in a traceback, after the caller may have written)."""
    if not isinstance(state, dict):
        raise FlareError(f"{source} holds no model state (a {type(state).__name__}).", key=key, fix=fix)
    own = model.state_dict()
    for name, t in own.items():
        if name not in state:
            raise FlareError(f"{source} does not fit the model: tensor '{name}' (shape {tuple(t.shape)}) is missing "
                             f"({sum(k not in state for k in own)} of the model's {len(own)} missing).",
                             key=key, fix=fix)
        got = getattr(state[name], "shape", None)
        if got is None or tuple(got) != tuple(t.shape):
            raise FlareError(f"{source} does not fit the model: tensor '{name}' has shape "
                             f"{tuple(got) if got is not None else type(state[name]).__name__} there, the model's is "
                             f"{tuple(t.shape)}.", key=key, fix=fix)
    if extra := [k for k in state if k not in own]:
        raise FlareError(f"{source} does not fit the model: it holds tensor '{extra[0]}', which the model has not "
                         f"({len(extra)} such).", key=key, fix=fix)


def check_input_fits(model: FlareNet, in_channels: int, image_size: int, label: str, key: str = "model") -> None:
    """Refuse a model that cannot take the run's inputs (a timm family whose downsampling shrinks a 28×28 image below
    a kernel, or a ViT that asserts on its 224×224 input size, say) with a FlareError keyed by the architecture's
    config key (`key`: `model`, `model.clients.1`, `server.model`) before any file is written, instead of a
    traceback in the first step: one eval-mode forward of two blank images, under no_grad, so no state (BatchNorm
    statistics, the RNG) moves. Whatever that forward raises is the model's refusal of the input: networks say so by
    RuntimeError (a kernel larger than its input), AssertionError (timm's size checks) or ValueError alike."""
    was = model.training
    x = torch.zeros(2, int(in_channels), int(image_size), int(image_size), device=next(model.parameters()).device)
    try:
        with torch.no_grad():
            model.eval()(x)
    except FlareError:
        raise
    except Exception as e:  # noqa: BLE001 — see the docstring
        why = str(e).splitlines()[0].rstrip(".") if str(e).strip() else "no message"
        raise FlareError(f"model {label} cannot take the dataset's {in_channels}×{image_size}×{image_size} inputs "
                         f"({type(e).__name__}: {why}).", key=f"{key}.name",
                         fix=f"choose a model whose downsampling fits the image size, or a timm model's options that "
                             f"fit it ({key}.options.patch_size, e.g. 1 for ConvNeXt at 28×28; for a ViT or Swin, "
                             f"{key}.options.img_size={image_size} and a patch_size that divides it; docs/models.md, "
                             "\"Stem for small inputs\").") from None
    finally:
        model.train(was)


def create_architecture(arch, in_channels: int, num_classes: int, head: str, feature_dim: int | None = None,
                        checkpoint: bool = True) -> FlareNet:
    """The model of one `config.architectures.Architecture` (a client's, or the server's), started from its
    checkpoint when it names one and `checkpoint` is True (False: weights that will be loaded anyway, or a fresh
    student); its init draws from torch's global generator, which the caller seeds. An error names the
    architecture's own keys (`model.clients.1.width`, `server.model.checkpoint`), not the top-level model's."""
    try:
        model = create_model(arch.name, in_channels, num_classes, arch.width, head=head, options=arch.options,
                             feature_dim=feature_dim)
    except FlareError as e:
        raise _keyed(e, arch.key) from None
    if checkpoint and arch.checkpoint is not None:
        load_checkpoint(model, arch.checkpoint, key=arch.checkpoint_key)
    return model


def _keyed(e: FlareError, key: str) -> FlareError:
    """`e`, raised while building the model of the architecture at config key `key`, with its `model.width`,
    `model.options` … (what a builder knows itself as) renamed to that key's own (`model.clients.1.width`): the fix
    then changes that entry, not every client that runs the top-level model."""
    if key == "model":
        return e

    def own(text: str | None) -> str | None:
        return _MODEL_KEY.sub(lambda m: f"{key}.{m.group(1)}", text) if text else text
    return FlareError(own(e.message), key=own(e.key), fix=own(e.fix))


_MODEL_KEY = re.compile(r"(?<![\w.])model\.(width|options|name)\b")  # not inside server.model.width


def load_checkpoint(model: FlareNet, path: str, key: str = "model.checkpoint") -> None:
    """Load the local state dict at `path` into `model` (`model.checkpoint`): a raw state dict or one under
    "model" / "state_dict", of the whole model (encoder + head) or of its encoder alone (the head then keeps its
    seeded init). `weights_only=True`, so the file can hold tensors but no code; nothing is downloaded."""
    own = key.removesuffix(".checkpoint")
    fix = f"give a state dict saved from the same {own}.name, {own}.width, head and dataset (channels, classes)."
    p = Path(path).expanduser()
    if not p.is_file():
        raise FlareError(f"checkpoint {path} is not a file.", key=key, fix="give the path of a local .pt file "
                                                                          "saved with torch.save(state_dict).")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 — any unreadable file is the user's, reported without a traceback
        raise FlareError(f"checkpoint {path} cannot be read as tensors ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}).", key=key,
                         fix="save it with torch.save(model.state_dict(), path); files that need code to load "
                             "(weights_only=False) are refused.") from None
    state = (next((obj[k] for k in ("model", "state_dict") if isinstance(obj.get(k), dict)), obj)
             if isinstance(obj, dict) else obj)
    whole = isinstance(state, dict) and any(str(k).startswith(("encoder.", "proj.", "head.")) for k in state)
    target = model if whole or not isinstance(state, dict) else model.encoder
    check_state_fits(target, state, f"checkpoint {path}" + ("" if target is model else " (an encoder's state)"),
                     key=key, fix=fix)
    for name, t in state.items():  # a NaN weight or running_var would surface only as a diverged loss, later
        if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).sum())
            raise FlareError(f"checkpoint {path} holds non-finite values (NaN or Inf) in tensor '{name}' ({bad} of "
                             f"{t.numel()}); a model started from it cannot train.", key=key,
                             fix="give a checkpoint saved before training diverged, or leave the key null to start "
                                 "from the seeded init.")
    target.load_state_dict(state)
