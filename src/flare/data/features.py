"""A frozen encoder's features of a whole dataset, computed once and cached: the `features` dataset
(docs/frozen-encoder.md).

With a frozen pretrained encoder (models/pretrained.py) an image's feature never changes, so the encoder runs once
per image — and once per stated augmented copy of each training image, for the objectives that contrast two views —
and every client and server after that trains and scores vectors.

Its `FeatureData` holds float32 train features N×(1+V)×D (copy 0: the plain image; copies 1..V: augmented with the
run's SupCon policy, drawn from a fixed seed) and test features N×1×D. In a run the evaluation transform is copy 0
(`first_view`) and the two training views are each a copy drawn uniformly per sample from the client-round's
streams (`FeatureViews`); with V = 0 both views are the plain feature.

The cache file's key (encoder, weights, dataset, images, augmentation) is stored inside the file too: a file whose
stored key differs or that cannot be read is refused with an error naming it — never silently used, never silently
overwritten. Extraction runs in float32 (2 CPU cores have no fast bf16 path) and NHWC (oneDNN's fast layout for
depthwise convolutions, about twice NCHW's throughput measured here), under inference_mode."""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn
from tqdm import tqdm

from flare.data.augment import TwoViewAugment, normalize
from flare.data.datasets import ImageData, _cache_dir, load_dataset, register_dataset
from flare.durable import atomic_torch_save
from flare.errors import FlareError
from flare.registry import MODELS

CACHE_VERSION = 1  # bump when the stored layout changes
AUGMENT_SEED = 0   # the augmented copies' stream: fixed, so every run reads the same copies
POLICY = "supcon"  # data/augment.py's TwoViewAugment defaults


class FeatureOptions(BaseModel):
    """`dataset.options` of the `features` dataset."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field("cifar10", description="the image dataset the encoder reads (`flare datasets`)")
    root: str | None = Field(None, description="the source's dataset.root")
    format: str = Field("auto", description="the source's dataset.format")
    encoder: str = Field("efficientnet_lite0", description="a frozen pretrained encoder (`flare models`)")
    resolution: int = Field(224, ge=32, le=512, description="the side images are resized to for the encoder")
    views: int = Field(0, ge=0, le=16, description="augmented copies of each training image (two-view objectives)")
    batch_size: int = Field(128, ge=1, le=4096, description="images per encoder forward (speed only)")
    cache_dir: str | None = Field(None, description="where the features are cached (default $FLARE_CACHE or "
                                                    "~/.cache/flare)")


@dataclass(repr=False)
class FeatureData(ImageData):
    """An ImageData whose samples are encoder features: train_x float32 N×(1+V)×D, test_x N×1×D. A feature vector is
    a D-channel 1×1 "image" to the rest of FLARE (in_channels = D, image_size = 1): the model builder receives D."""

    key: dict | None = None

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[-1])

    @property
    def image_size(self) -> int:
        return 1

    @property
    def views(self) -> int:
        return int(self.train_x.shape[1])

    def __repr__(self) -> str:
        return (f"FeatureData({self.name}: {len(self.train_y)} train × {self.views} copies / {len(self.test_y)} test, "
                f"d = {self.in_channels}, {self.num_classes} classes)")


def first_view(x: Tensor) -> Tensor:
    """The evaluation transform of a features dataset: copy 0, the plain image's feature (B×D)."""
    return x[:, 0]


class FeatureViews(nn.Module):
    """The two training views over cached copies: each view takes, per sample, one of the stored copies uniformly at
    random (torch's default generator of the features' device, which the trainer seeds per client-round)."""

    def single_view(self, x: Tensor) -> Tensor:
        if x.shape[1] == 1:
            return x[:, 0]
        pick = torch.randint(0, x.shape[1], (x.shape[0],), device=x.device)
        return x[torch.arange(x.shape[0], device=x.device), pick]

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.single_view(x), self.single_view(x)


# ----------------------------------------------------------------------------------------------- the cache


def images_sha256(data: ImageData) -> str:
    """A hash of the decoded images and labels themselves: the features belong to exactly these pixels."""
    h = hashlib.sha256()
    for t in (data.train_x, data.train_y, data.test_x, data.test_y):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def cache_key(opts: FeatureOptions, data: ImageData, weights_sha: str) -> dict:
    return {"version": CACHE_VERSION, "encoder": opts.encoder, "resolution": opts.resolution,
            "weights_sha256": weights_sha, "dataset": data.name, "images_sha256": images_sha256(data),
            "augmentation": {"policy": POLICY, "views": opts.views, "seed": AUGMENT_SEED} if opts.views else None}


def cache_path(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    views = (key["augmentation"] or {}).get("views", 0)
    return cache_dir / f"features-{key['dataset']}-{key['encoder']}-{key['resolution']}px-{views}v-{digest}.pt"


def read_cache(path: Path, key: dict) -> dict | None:
    """The cached tensors, None when there is no file; a FlareError for a file that is unreadable or holds another
    key's features (the message says which field differs)."""
    if not path.exists():
        return None
    fix = f"delete {path} (it is recomputed on the next run), or point dataset.options.cache_dir elsewhere."
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
        stored = json.loads(d["key"])
        tensors = {k: d[k] for k in ("train", "train_y", "test", "test_y")}
        classes = list(d["classes"])
    except Exception as e:  # noqa: BLE001 — any unreadable file is reported, never used
        why = str(e).splitlines()[0][:160] if str(e) else ""
        raise FlareError(f"feature cache {path} is corrupt ({type(e).__name__}: {why}).", key="dataset.options",
                         fix=fix) from None
    if stored != key:
        diff = sorted(k for k in set(stored) | set(key) if stored.get(k) != key.get(k))
        raise FlareError(f"feature cache {path} holds features of another setting (its {', '.join(diff)} "
                         "differ from this run's).", key="dataset.options", fix=fix)
    n, views = len(tensors["train_y"]), 1 + (key["augmentation"] or {}).get("views", 0)
    if (tensors["train"].dim() != 3 or tensors["train"].shape[:2] != (n, views) or tensors["test"].dim() != 3
            or len(tensors["test"]) != len(tensors["test_y"]) or not torch.isfinite(tensors["train"]).all()
            or not torch.isfinite(tensors["test"]).all()):
        raise FlareError(f"feature cache {path} is corrupt (its tensors' shapes or values are not what its key says).",
                         key="dataset.options", fix=fix)
    return {**tensors, "classes": classes}


# ----------------------------------------------------------------------------------------------- extraction


@torch.inference_mode()
def encode(encoder: nn.Module, x: Tensor, view, batch_size: int, desc: str, quiet: bool = False) -> Tensor:
    """Features (float32 N×D) of the uint8 images `x`, `view(batch)` giving each batch's encoder input."""
    out = torch.empty(len(x), encoder.feature_dim)
    bar = tqdm(total=len(x), desc=desc, unit="img", disable=quiet, mininterval=5, smoothing=0.1)
    for s in range(0, len(x), batch_size):
        inp = view(x[s:s + batch_size]).contiguous(memory_format=torch.channels_last)
        out[s:s + batch_size] = encoder(inp).float()
        bar.update(len(inp))
    bar.close()
    return out


def _encoder_entry(name: str):
    """The registry entry of `name`, refused unless it is a frozen pretrained encoder: a builder that takes a
    `resolution` option and carries the `weights_sha256` function the cache keys on."""
    entry = MODELS.entry(name, "dataset.options.encoder")
    if (entry.options is None or "resolution" not in entry.options.model_fields
            or getattr(entry.obj, "weights_sha256", None) is None):
        raise FlareError(f"model {name!r} is not a frozen pretrained encoder.", key="dataset.options.encoder",
                         fix="use efficientnet_lite0 (`flare models`).")
    return entry


def frozen_encoder(name: str, resolution: int) -> nn.Module:
    """The registered encoder `name` at `resolution`, frozen, NHWC."""
    entry = _encoder_entry(name)
    enc = entry.obj(3, 1.0, entry.options(resolution=resolution))
    return enc.eval().to(memory_format=torch.channels_last)


def extract_features(opts: FeatureOptions, data: ImageData, quiet: bool = False) -> tuple[dict, dict]:
    """(tensors, facts): the features of every image of `data` and of `opts.views` augmented copies of each training
    image; facts: the images encoded, the seconds and images/s."""
    if data.in_channels != 3:
        raise FlareError(f"the pretrained encoder {opts.encoder} takes RGB images; {data.name} has "
                         f"{data.in_channels} channel(s).", key="dataset.options.source", fix="use an RGB dataset.")
    enc = frozen_encoder(opts.encoder, opts.resolution)
    mean, std = enc.mean, enc.std
    plain = lambda b: normalize(b, mean, std)  # noqa: E731
    augment = TwoViewAugment(data.image_size, 3, mean, std)
    t0 = time.perf_counter()
    copies = [encode(enc, data.train_x, plain, opts.batch_size, f"{opts.encoder} train", quiet)]
    torch.manual_seed(AUGMENT_SEED)
    for v in range(opts.views):
        copies.append(encode(enc, data.train_x, augment.single_view, opts.batch_size,
                             f"{opts.encoder} train copy {v + 1}/{opts.views}", quiet))
    test = encode(enc, data.test_x, plain, opts.batch_size, f"{opts.encoder} test", quiet)
    n = len(data.train_x) * (1 + opts.views) + len(data.test_x)
    seconds = time.perf_counter() - t0
    tensors = {"train": torch.stack(copies, 1), "train_y": data.train_y.clone(), "test": test[:, None],
               "test_y": data.test_y.clone(), "classes": list(data.classes)}
    return tensors, {"images": n, "seconds": seconds, "images_per_second": n / seconds, "threads":
                     torch.get_num_threads()}


def load_features(opts: FeatureOptions, quiet: bool | None = None) -> FeatureData:
    """The features dataset of `opts`: read from its cache, or computed (and cached) when there is none."""
    quiet = bool(os.environ.get("FLARE_QUIET")) if quiet is None else quiet
    try:
        cache_dir = _cache_dir(opts.cache_dir)
        images = load_dataset(opts.source, opts.root, format=opts.format, cache_dir=opts.cache_dir)
    except FlareError as e:  # the image dataset's keys are this dataset's options: name what the user wrote
        def own(text):
            return re.sub(r"\bdataset\.(?!options\.)", "dataset.options.", text.replace("dataset.name", "dataset.source"))
        raise FlareError(own(e.message), key=e.key and own(e.key), fix=e.fix and own(e.fix)) from None
    key = cache_key(opts, images, _encoder_entry(opts.encoder).obj.weights_sha256())
    path = cache_path(cache_dir, key)
    tensors = read_cache(path, key)
    if tensors is None:
        tensors, facts = extract_features(opts, images, quiet)
        atomic_torch_save({"key": json.dumps(key, sort_keys=True), **tensors}, path)
        path.with_suffix(".json").write_text(json.dumps({**key, "extraction": facts}, indent=1) + "\n")
        if not quiet:
            print(f"flare: cached {facts['images']} features in {path} ({facts['seconds']:.0f} s, "
                  f"{facts['images_per_second']:.0f} images/s)", flush=True)
    return FeatureData(f"{opts.source}@{opts.encoder}-{opts.resolution}px", tensors["train"], tensors["train_y"],
                       tensors["test"], tensors["test_y"], tensors["classes"], (0.0,), (1.0,), key=key)


@register_dataset("features", options=FeatureOptions, num_classes=None, kind="features")
def features_dataset(options: FeatureOptions) -> FeatureData:
    """A frozen pretrained encoder's cached features of an image dataset (docs/frozen-encoder.md)"""
    return load_features(options)
