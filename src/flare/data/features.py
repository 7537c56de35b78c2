"""A frozen encoder's features of a whole dataset, computed once and cached: the `features` dataset
(docs/frozen-encoder.md).

With a frozen pretrained encoder (models/pretrained.py) an image's feature never changes, so the encoder runs once
per image — and once per stored copy of each training image (its horizontal flip, augmented copies for the
objectives that contrast two views) — and every client and server after that trains and scores vectors.

Its `FeatureData` holds float32 train features N×C×D (copy 0: the plain image; then the flip with `flip`, then
`views` copies augmented with the run's SupCon policy, drawn from a fixed seed) and test features N×1×D. In a run the
evaluation transform is copy 0 (`first_view`) and the two training views are each a copy drawn uniformly per sample
from the client-round's streams (`FeatureViews`); with one copy both views are the plain feature.

The cache file's key (encoder, weights, dataset, images, resolution, resize, flip, augmentation) is stored inside the
file too: a file whose stored key differs or that cannot be read is refused with an error naming it — never silently
used, never silently overwritten. A cache of any setting but the original one (bicubic, the penultimate layer, no
flip: its key and file are unchanged) stores every stage's pooled output, so one extraction serves every `stages`.
Extraction runs in float32 (2 CPU cores have no fast bf16 path) and NHWC (oneDNN's fast layout for depthwise
convolutions, about twice NCHW's throughput measured here), under inference_mode, in chunks written as they finish,
so that an interrupted extraction of tens of minutes resumes from its last finished chunk."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
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
ALL_STAGES = 8     # the head and EfficientNet-Lite's 7 block stages: what a cache of a new setting stores
CHUNK_BATCHES = 16  # batches per chunk file: at most this much work is lost to an interruption


class FeatureOptions(BaseModel):
    """`dataset.options` of the `features` dataset."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field("cifar10", description="the image dataset the encoder reads (`flare datasets`)")
    root: str | None = Field(None, description="the source's dataset.root")
    format: str = Field("auto", description="the source's dataset.format")
    encoder: str = Field("efficientnet_lite0", description="a frozen pretrained encoder (`flare models`)")
    resolution: int | None = Field(None, ge=32, le=512, description="the side images are resized to for the encoder "
                                   "(default: the encoder's own training resolution, 224 / 240 / 260 for Lite0 / 1 / 2)")
    resize: Literal["bicubic", "bilinear"] = Field("bicubic", description="how images are resized to it (bicubic: "
                                                   "the weights' timm config, and every cache made before this option)")
    stages: int = Field(1, ge=1, le=ALL_STAGES, description="1: the pooled penultimate layer; N: it and the pooled "
                                                            "outputs of the last N − 1 block stages, concatenated")
    flip: bool = Field(False, description="store each training image's horizontal flip as copy 1 (one more forward)")
    views: int = Field(0, ge=0, le=16, description="augmented copies of each training image (two-view objectives)")
    batch_size: int = Field(128, ge=1, le=4096, description="images per encoder forward (speed only)")
    cache_dir: str | None = Field(None, description="where the features are cached (default $FLARE_CACHE or "
                                                    "~/.cache/flare)")

    @model_validator(mode="after")
    def _own_resolution(self) -> "FeatureOptions":
        """The encoder's own resolution filled in, so a run's recorded config names the resolution it ran at."""
        if self.resolution is None:
            self.resolution = _encoder_entry(self.encoder).obj.native_resolution(key="dataset.options.encoder")
        return self


@dataclass(repr=False)
class FeatureData(ImageData):
    """An ImageData whose samples are encoder features: train_x float32 N×(1+V)×D, test_x N×1×D. A feature vector is
    a D-channel 1×1 "image" to the rest of FLARE (in_channels = D, image_size = 1): the model builder receives D."""

    key: dict | None = None
    test_flip: Tensor | None = None  # with `flip`: the test images' mirrored features, N×1×D (test-time averaging)

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
    """What the stored tensors depend on. The fields a new setting adds are left out at the original one (bicubic,
    the penultimate layer, no flip), so its caches keep their key, file name and layout."""
    key = {"version": CACHE_VERSION, "encoder": opts.encoder, "resolution": opts.resolution,
           "weights_sha256": weights_sha, "dataset": data.name, "images_sha256": images_sha256(data),
           "augmentation": {"policy": POLICY, "views": opts.views, "seed": AUGMENT_SEED} if opts.views else None}
    if opts.resize != "bicubic" or opts.stages > 1:
        key.update(resize=opts.resize, stored_stages=ALL_STAGES)
    return key


def cache_path(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    views = (key["augmentation"] or {}).get("views", 0)
    how = "".join(f"-{key[k]}" for k in ("resize", "view") if k in key)
    return cache_dir / f"features-{key['dataset']}-{key['encoder']}-{key['resolution']}px-{views}v{how}-{digest}.pt"


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
        classes, widths = list(d["classes"]), list(d.get("widths", [d["train"].shape[-1]]))
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
            or tensors["train"].shape[-1] != sum(widths)
            or len(tensors["test"]) != len(tensors["test_y"]) or not torch.isfinite(tensors["train"]).all()
            or not torch.isfinite(tensors["test"]).all()):
        raise FlareError(f"feature cache {path} is corrupt (its tensors' shapes or values are not what its key says).",
                         key="dataset.options", fix=fix)
    return {**tensors, "classes": classes, "widths": widths}


# ----------------------------------------------------------------------------------------------- extraction


@torch.inference_mode()
def encode(encoder: nn.Module, x: Tensor, view, batch_size: int, stages: int = 1) -> Tensor:
    """Features (float32 N×D) of the uint8 images `x`, `view(batch)` giving each batch's encoder input."""
    return torch.cat([encoder(view(x[s:s + batch_size]).contiguous(memory_format=torch.channels_last), stages).float()
                      for s in range(0, len(x), batch_size)])


def _encoder_entry(name: str):
    """The registry entry of `name`, refused unless it is a frozen pretrained encoder: a builder that takes a
    `resolution` option and carries the `weights_sha256` and `native_resolution` functions the cache relies on."""
    entry = MODELS.entry(name, "dataset.options.encoder")
    if (entry.options is None or "resolution" not in entry.options.model_fields
            or getattr(entry.obj, "weights_sha256", None) is None):
        raise FlareError(f"model {name!r} is not a frozen pretrained encoder.", key="dataset.options.encoder",
                         fix="use efficientnet_lite0, efficientnet_lite1 or efficientnet_lite2 (`flare models`).")
    return entry


def frozen_encoder(name: str, resolution: int, resize: str = "bicubic") -> nn.Module:
    """The registered encoder `name` at `resolution`, frozen, NHWC."""
    entry = _encoder_entry(name)
    enc = entry.obj(3, 1.0, entry.options(resolution=resolution, resize=resize))
    return enc.eval().to(memory_format=torch.channels_last)


def extract_features(opts: FeatureOptions, data: ImageData, parts: Path, stages: int = 1, flip: bool = False,
                     quiet: bool = False) -> tuple[dict, dict]:
    """(tensors, facts): the first `stages` pooled outputs of every image of `data` (mirrored with `flip`) and, unless
    `flip`, of `opts.views` augmented copies of each training image; facts: the images, the encoder's seconds over all
    chunks (an interrupted extraction's included) and images/s. Each chunk of CHUNK_BATCHES batches is saved in
    `parts` atomically with the augmentation stream's state after it, so a rerun loads the finished chunks, resumes
    the stream where it stood and gives the uninterrupted extraction's tensors bit for bit."""
    if data.in_channels != 3:
        raise FlareError(f"the pretrained encoder {opts.encoder} takes RGB images; {data.name} has "
                         f"{data.in_channels} channel(s).", key="dataset.options.source", fix="use an RGB dataset.")
    enc = frozen_encoder(opts.encoder, opts.resolution, opts.resize)
    plain = lambda b: normalize(b.flip(-1) if flip else b, enc.mean, enc.std)  # noqa: E731
    augment = TwoViewAugment(data.image_size, 3, enc.mean, enc.std)
    streams = {"train": (data.train_x, plain), "test": (data.test_x, plain),
               **{f"copy{v}": (data.train_x, augment.single_view) for v in range(1, (not flip) * opts.views + 1)}}
    step, n = opts.batch_size * CHUNK_BATCHES, sum(len(x) for x, _ in streams.values())
    parts.mkdir(parents=True, exist_ok=True)
    out, seconds = {name: [] for name in streams}, 0.0
    bar = tqdm(total=n, desc=f"{opts.encoder} {opts.resolution}px {opts.resize}{' flip' * flip}", unit="img",
               disable=quiet, mininterval=10, smoothing=0.05)
    torch.manual_seed(AUGMENT_SEED)  # only the augmented copies draw from it
    for name, s in [(name, s) for name, (x, _) in streams.items() for s in range(0, len(x), step)]:
        if (f := parts / f"{name}-{s:07d}.pt").exists():
            chunk = torch.load(f, map_location="cpu", weights_only=True)
        else:
            (x, view), t0 = streams[name], time.perf_counter()
            feats = encode(enc, x[s:s + step], view, opts.batch_size, stages)
            chunk = {"x": feats, "rng": torch.get_rng_state(), "seconds": time.perf_counter() - t0}
            atomic_torch_save(chunk, f)
        torch.set_rng_state(chunk["rng"])
        out[name].append(chunk["x"])
        seconds += chunk["seconds"]
        bar.set_postfix_str(name, refresh=False)
        bar.update(len(chunk["x"]))
    bar.close()
    test = torch.cat(out.pop("test"))
    tensors = {"train": torch.stack([torch.cat(v) for v in out.values()], 1), "train_y": data.train_y.clone(),
               "test": test[:, None], "test_y": data.test_y.clone(), "classes": list(data.classes),
               **({"widths": list(enc.widths[:stages])} if stages > 1 else {})}
    return tensors, {"images": n, "seconds": seconds, "images_per_second": n / seconds,
                     "threads": torch.get_num_threads()}


def cached(opts: FeatureOptions, images: ImageData, key: dict, quiet: bool) -> dict:
    """The tensors of `key`'s cache file, extracted and written first when there is none. An extraction in progress
    keeps its finished chunks beside the file (`<file>.b<batch_size>.parts/`) until the file is written: rerun the
    same command to resume it."""
    path = cache_path(_cache_dir(opts.cache_dir), key)
    if (tensors := read_cache(path, key)) is None:
        parts = path.with_name(f"{path.stem}.b{opts.batch_size}.parts")
        tensors, facts = extract_features(opts, images, parts, key.get("stored_stages", 1), "view" in key, quiet)
        atomic_torch_save({"key": json.dumps(key, sort_keys=True), **tensors}, path)
        path.with_suffix(".json").write_text(json.dumps({**key, "extraction": facts}, indent=1) + "\n")
        shutil.rmtree(parts)
        if not quiet:
            print(f"flare: cached {facts['images']} features in {path} ({facts['seconds']:.0f} s, "
                  f"{facts['images_per_second']:.0f} images/s)", flush=True)
    return tensors


def load_features(opts: FeatureOptions, quiet: bool | None = None) -> FeatureData:
    """The features dataset of `opts`, from its cache. The flipped images are a cache file of their own (train and
    test, no augmented copies), so runs with and without `flip` share the plain one."""
    quiet = bool(os.environ.get("FLARE_QUIET")) if quiet is None else quiet
    images = load_dataset(opts.source, opts.root, format=opts.format, cache_dir=opts.cache_dir)
    key = cache_key(opts, images, _encoder_entry(opts.encoder).obj.weights_sha256(key="dataset.options.encoder"))
    tensors, test_flip = cached(opts, images, key, quiet), None
    if opts.flip:
        flipped = cached(opts, images, {**key, "augmentation": None, "view": "flip"}, quiet)
        tensors["train"] = torch.cat([tensors["train"][:, :1], flipped["train"], tensors["train"][:, 1:]], 1)
        test_flip = flipped["test"]
    d = sum((tensors.get("widths") or [tensors["train"].shape[-1]])[:opts.stages])
    train, test, test_flip = (t if t is None or t.shape[-1] == d else t[..., :d].contiguous()
                              for t in (tensors["train"], tensors["test"], test_flip))
    how = f"-{opts.resize}{'-flip' * opts.flip}-s{opts.stages}" if "resize" in key else "-flip" * opts.flip
    return FeatureData(f"{opts.source}@{opts.encoder}-{opts.resolution}px{how}", train, tensors["train_y"], test,
                       tensors["test_y"], tensors["classes"], (0.0,), (1.0,), key=key, test_flip=test_flip)


@register_dataset("features", options=FeatureOptions, num_classes=None)
def features_dataset(options: FeatureOptions) -> FeatureData:
    """A frozen pretrained encoder's cached features of an image dataset (docs/frozen-encoder.md)"""
    return load_features(options)
