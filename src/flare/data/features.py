"""A frozen encoder's features of a whole dataset, computed once and cached: the `features` dataset
(docs/frozen-encoder.md). A frozen encoder's feature of an image never changes, so the encoder runs once per image and
stored copy: float32 train features N×C×D (copy 0: the plain image; its mirror image with `flip`; `views` copies
augmented with the SupCon policy from a fixed seed), test features N×1×D. A cache file stores its key: a file of
another key, or unreadable, is refused, never used nor overwritten. Extraction: float32 (2 CPU cores have no fast bf16
path), NHWC (oneDNN's fast layout for depthwise convolutions, twice NCHW's speed here), chunks saved as they finish."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn
from tqdm import tqdm

from flare.data.augment import TwoViewAugment, normalize
from flare.data.datasets import ImageData, _cache_dir, load_dataset, register_dataset
from flare.durable import atomic_torch_save
from flare.errors import FlareError
from flare.models import ModelFacts
from flare.registry import MODELS

CACHE_VERSION = 1  # bump when the stored layout changes
AUGMENT_SEED = 0   # the augmented copies' stream: fixed, so every run reads the same copies
POLICY = "supcon"  # data/augment.py's TwoViewAugment defaults
ALL_STAGES = 8     # the head and EfficientNet-Lite's 7 block stages: what a cache of a new setting stores
CHUNK_BATCHES = 16  # batches per chunk file: at most this much work is lost to an interruption


class FeatureOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field("cifar10", description="the image dataset the encoder reads (`flare datasets`)")
    root: str | None = Field(None, description="the source's dataset.root")
    format: str = Field("auto", description="the source's dataset.format")
    encoder: str = Field("efficientnet_lite0", description="a frozen pretrained encoder (`flare models`)")
    resolution: int | None = Field(None, ge=32, le=512, description="the encoder's input side (null: its training one)")
    resize: Literal["bicubic", "bilinear"] = Field("bicubic", description="the upsampling to it (bicubic: timm's)")
    stages: int = Field(1, ge=1, le=ALL_STAGES, description="1: the penultimate layer, pooled; N: + the last N − 1 "
                                                            "block stages' outputs, pooled, concatenated")
    flip: bool = Field(False, description="store each training image's horizontal flip as copy 1 (one more forward)")
    views: int = Field(0, ge=0, le=16, description="augmented copies of each training image (two-view objectives)")
    batch_size: int = Field(128, ge=1, le=4096, description="images per encoder forward (speed only)")
    cache_dir: str | None = Field(None, description="where the features are cached (default $FLARE_CACHE or "
                                                    "~/.cache/flare)")


@dataclass(repr=False)
class FeatureData(ImageData):
    """An ImageData whose samples are encoder features: train_x float32 N×C×D, test_x N×1×D. A feature vector is a
    D-channel 1×1 "image" to the rest of FLARE (in_channels = D, image_size = 1): the model builder receives D."""

    key: dict | None = None
    test_flip: Tensor | None = None  # with `flip`: the test images' mirrored features, N×1×D (test-time averaging)

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[-1])

    @property
    def image_size(self) -> int:
        return 1


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
        h.update(str(tuple(t.shape)).encode() + t.contiguous().numpy().tobytes())
    return h.hexdigest()


def cache_key(opts: FeatureOptions, data: ImageData, weights_sha: str) -> dict:
    """What the stored tensors depend on. The original setting (bicubic, penultimate layer) keeps its key, name and
    layout; any other stores every stage's pooled output, so one extraction serves every `stages`."""
    key = {"version": CACHE_VERSION, "encoder": opts.encoder, "resolution": opts.resolution,
           "weights_sha256": weights_sha, "dataset": data.name, "images_sha256": images_sha256(data),
           "augmentation": {"policy": POLICY, "views": opts.views, "seed": AUGMENT_SEED} if opts.views else None}
    return key if opts.resize == "bicubic" and opts.stages == 1 else {**key, "resize": opts.resize,
                                                                      "stored_stages": ALL_STAGES}


def cache_path(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    how = "".join(f"-{key[k]}" for k in ("resize", "view") if k in key)
    return cache_dir / (f"features-{key['dataset']}-{key['encoder']}-{key['resolution']}px-"
                        f"{(key['augmentation'] or {}).get('views', 0)}v{how}-{digest}.pt")


@functools.lru_cache(maxsize=2)  # a grid's worker runs many points over one file: read once while it stays the same
def _load_file(path: str, stamp: tuple) -> dict:  # stamp: inode, size, mtime (a cache is replaced by a rename)
    return torch.load(path, map_location="cpu", weights_only=True)


def read_cache(path: Path, key: dict) -> dict | None:
    """The cached tensors; None without a file; a FlareError for an unreadable file or another key's (naming it)."""
    if not path.exists():
        return None
    fix = f"delete {path} (it is recomputed on the next run), or point dataset.options.cache_dir elsewhere."
    try:
        d = _load_file(str(path), ((st := path.stat()).st_ino, st.st_size, st.st_mtime_ns))
        stored, t = json.loads(d["key"]), {k: d[k].clone() for k in ("train", "train_y", "test", "test_y")}
        t.update(classes=list(d["classes"]), widths=list(d.get("widths", [d["train"].shape[-1]])))
    except Exception as e:  # noqa: BLE001 — any unreadable file is reported, never used
        why = str(e).splitlines()[0][:160] if str(e) else ""
        raise FlareError(f"feature cache {path} is corrupt ({type(e).__name__}: {why}).", key="dataset.options",
                         fix=fix) from None
    if stored != key:
        diff = sorted(k for k in set(stored) | set(key) if stored.get(k) != key.get(k))
        raise FlareError(f"feature cache {path} holds features of another setting (its {', '.join(diff)} "
                         "differ from this run's).", key="dataset.options", fix=fix)
    train, test, views = t["train"], t["test"], 1 + (key["augmentation"] or {}).get("views", 0)
    if (train.dim() != 3 or train.shape[:2] != (len(t["train_y"]), views) or train.shape[-1] != sum(t["widths"])
            or test.dim() != 3 or len(test) != len(t["test_y"]) or not torch.isfinite(train).all()
            or not torch.isfinite(test).all()):
        raise FlareError(f"feature cache {path} is corrupt (its tensors' shapes or values are not what its key says).",
                         key="dataset.options", fix=fix)
    return t


# ----------------------------------------------------------------------------------------------- extraction


@torch.inference_mode()
def encode(encoder: nn.Module, x: Tensor, view, batch_size: int, stages: int = 1) -> Tensor:
    """Features (float32 N×D) of the uint8 images `x`, `view(batch)` giving each batch's encoder input."""
    return torch.cat([encoder(view(x[s:s + batch_size]).contiguous(memory_format=torch.channels_last), stages).float()
                      for s in range(0, len(x), batch_size)])


def _encoder_entry(name: str):
    """The registry entry of `name`, refused unless it is a frozen pretrained encoder (carries `weights_sha256`)."""
    entry = MODELS.entry(name, "dataset.options.encoder")
    if getattr(entry.obj, "weights_sha256", None) is None:
        raise FlareError(f"model {name!r} is not a frozen pretrained encoder.", key="dataset.options.encoder",
                         fix="use efficientnet_lite0, efficientnet_lite1 or efficientnet_lite2 (`flare models`).")
    return entry


def frozen_encoder(name: str, resolution: int, resize: str = "bicubic") -> nn.Module:
    """The registered encoder `name` at `resolution`, frozen, NHWC."""
    opts = _encoder_entry(name).options(resolution=resolution, resize=resize)
    return MODELS.create(name, ModelFacts(3, 1.0), opts).to(memory_format=torch.channels_last)


def extract_features(opts: FeatureOptions, data: ImageData, parts: Path, stages: int = 1, flip: bool = False,
                     quiet: bool = False) -> tuple[dict, dict]:
    """(tensors, facts): the first `stages` pooled outputs of every image (mirrored with `flip`; else also `views`
    augmented copies of each training image); facts: images, the chunks' wall seconds summed, images/s. A chunk is
    saved in `parts` with the random stream's state after it: a rerun resumes from the last one, bit for bit."""
    if data.in_channels != 3:
        raise FlareError(f"the pretrained encoder {opts.encoder} takes RGB images; {data.name} has {data.in_channels} "
                         "channel(s).", key="dataset.options.source", fix="use an RGB dataset.")
    enc = frozen_encoder(opts.encoder, opts.resolution, opts.resize)
    plain = lambda b: normalize(b.flip(-1) if flip else b, enc.mean, enc.std)  # noqa: E731
    augment = TwoViewAugment(data.image_size, 3, enc.mean, enc.std).single_view
    streams = {"train": (data.train_x, plain), "test": (data.test_x, plain),
               **{f"copy{v}": (data.train_x, augment) for v in range(1, (not flip) * opts.views + 1)}}
    step, n = opts.batch_size * CHUNK_BATCHES, sum(len(x) for x, _ in streams.values())
    out, seconds = {name: [] for name in streams}, parts.mkdir(parents=True, exist_ok=True) or 0.0
    bar = tqdm(total=n, desc=f"{opts.encoder} {opts.resolution}px {opts.resize}{' flip' * flip}", unit="img",
               disable=quiet, mininterval=10, smoothing=0.05)
    torch.manual_seed(AUGMENT_SEED)  # only the augmented copies draw from it
    for name, s in [(name, s) for name, (x, _) in streams.items() for s in range(0, len(x), step)]:
        if (f := parts / f"{name}-{s:07d}.pt").exists():
            chunk = torch.load(f, map_location="cpu", weights_only=True)
        else:
            (x, view), t0 = streams[name], time.perf_counter()
            chunk = {"x": encode(enc, x[s:s + step], view, opts.batch_size, stages), "rng": torch.get_rng_state()}
            atomic_torch_save(chunk := {**chunk, "seconds": time.perf_counter() - t0}, f)
        torch.set_rng_state(chunk["rng"])
        out[name].append(chunk["x"])
        seconds += chunk["seconds"]
        bar.update(len(chunk["x"]))
    bar.close()
    test = torch.cat(out.pop("test"))[:, None]
    tensors = {"train": torch.stack([torch.cat(v) for v in out.values()], 1), "train_y": data.train_y.clone(),
               "test": test, "test_y": data.test_y.clone(), "classes": list(data.classes),
               **({"widths": list(enc.widths[:stages])} if stages > 1 else {})}
    return tensors, {"images": n, "seconds": seconds, "images_per_second": n / seconds,
                     "threads": torch.get_num_threads()}


def cached(opts: FeatureOptions, images: ImageData, key: dict, quiet: bool) -> dict:
    """`key`'s cached tensors, extracted first when there is no file (chunks kept in `<file>.b<batch>.parts/`)."""
    path = cache_path(_cache_dir(opts.cache_dir), key)
    if (tensors := read_cache(path, key)) is None:
        parts = path.with_name(f"{path.stem}.b{opts.batch_size}.parts")
        tensors, facts = extract_features(opts, images, parts, key.get("stored_stages", 1), "view" in key, quiet)
        atomic_torch_save({"key": json.dumps(key, sort_keys=True), **tensors}, path)
        path.with_suffix(".json").write_text(json.dumps({**key, "extraction": facts}, indent=1) + "\n")
        shutil.rmtree(parts)
        if not quiet:
            print(f"flare: cached {facts['images']} images' features in {path} ({facts['seconds']:.0f} s)", flush=True)
    return tensors


def load_features(opts: FeatureOptions, quiet: bool | None = None) -> FeatureData:
    """The features dataset of `opts`, from its cache. Mirror images are a cache of their own (train and test, no
    augmented copies): runs with and without `flip` share the plain one."""
    quiet = bool(os.environ.get("FLARE_QUIET")) if quiet is None else quiet
    enc, where = _encoder_entry(opts.encoder).obj, "dataset.options.encoder"  # null resolution: the encoder's own
    opts = opts.model_copy(update={"resolution": opts.resolution or enc.native_resolution(key=where)})
    try:
        _cache_dir(opts.cache_dir)
        images = load_dataset(opts.source, opts.root, format=opts.format, cache_dir=opts.cache_dir)
    except FlareError as e:  # the image dataset's keys are this dataset's options: name what the user wrote
        def own(text):
            return re.sub(r"\bdataset\.(?!options\.)", "dataset.options.", text.replace("dataset.name", "dataset.source"))
        raise FlareError(own(e.message), key=e.key and own(e.key), fix=e.fix and own(e.fix)) from None
    key = cache_key(opts, images, enc.weights_sha256(key=where))
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


@register_dataset("features", options=FeatureOptions, num_classes=None, kind="features")
def features_dataset(facts, options: FeatureOptions) -> FeatureData:
    """A frozen pretrained encoder's cached features of an image dataset (docs/frozen-encoder.md)"""
    return load_features(options)
