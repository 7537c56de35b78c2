"""Image datasets as whole uint8 tensors.

Every dataset is decoded once into one N×C×H×W uint8 tensor per split plus int64 labels and cached on
disk, so training can cut batches on the GPU by indexing instead of running a DataLoader.

Nothing is downloaded unless `download=True`, and a missing, partial or corrupt dataset raises
`FlareError` naming the path and the command that fixes it; there is no silent fallback to another source.

Sample order is deterministic: image folders are sorted by (label, file path), Tiny-ImageNet's val split
follows `val_annotations.txt`, the other formats keep their files' order."""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
from pydantic import BaseModel

from flare.data.formats import (DEBIAN_FMNIST, _Source, _has_idx_files, _is_archive, _locate_cifar,
                                _locate_imagefolder, _locate_mnist, _locate_svhn, _locate_tiny, _tiny_base)
from flare.durable import atomic_torch_save
from flare.errors import FlareError
from flare.registry import DATASETS


@dataclass(frozen=True)
class DatasetFacts:
    """Where a dataset is read from: its name, `dataset.root`, `dataset.format`, `dataset.download` and the cache
    folder (`dataset.cache_dir`); a dataset built in memory reads none of them."""
    name: str
    root: str | os.PathLike | None = None
    format: str = "auto"
    download: bool = False
    cache_dir: str | os.PathLike | None = None


class DatasetSource(Protocol):
    """What `DATASETS` holds (`DatasetInfo`): built by `DATASETS.create` into an `ImageData` — read from files
    (`locate`, the built-in ones) or made by a plugin's `build(facts, options)` (`register_dataset`); its
    `num_classes` and `kind` are read when the config is validated."""
    description: str
    num_classes: int | None

    def __call__(self, facts: DatasetFacts, options: BaseModel | None) -> ImageData: ...

FORMATS = ("auto", "torchvision", "imagefolder", "idx")
_CACHE_VERSION = 1  # bump when the decoded layout changes, so old cache files are never read


@dataclass(repr=False)
class ImageData:
    """A whole dataset in memory: uint8 N×C×H×W images, int64 labels, class names, normalisation stats."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: list[str]
    mean: tuple[float, ...]  # per-channel mean of train_x / 255
    std: tuple[float, ...]   # per-channel (population) std of train_x / 255

    @classmethod
    def from_tensors(cls, name: str, train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor,
                     test_y: torch.Tensor, classes: list[str]) -> "ImageData":
        """A dataset built in memory (a plugin's), checked like a decoded one and given its normalisation stats."""
        _check_arrays(name, f"plugin dataset {name}", train_x, train_y, test_x, test_y, classes)
        mean, std = _channel_stats(train_x)
        return cls(name, train_x, train_y, test_x, test_y, list(classes), mean, std)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_channels(self) -> int:
        return self.train_x.shape[1]

    @property
    def image_size(self) -> int:
        return self.train_x.shape[2]


@dataclass(frozen=True)
class DatasetInfo:
    description: str
    formats: tuple[str, ...]  # the explicit formats it accepts ("auto" is always accepted)
    num_classes: int | None   # checked when read from an image folder, to catch a tree of the wrong dataset
    locate: Callable[[str, Path | None, str, bool], _Source] | None  # (name, root, format, download)
    build: Callable[[DatasetFacts, object], ImageData] | None = None  # made in memory: (facts, options) -> data
    kind: str = "images"  # what its samples are (images, or a frozen encoder's features): `Strategy.inputs`

    def __call__(self, facts: DatasetFacts, options: BaseModel | None) -> ImageData:
        """The dataset as whole tensors: a plugin's built (not cached), a built-in one read (`_read`)."""
        if self.build is None:
            return _read(self, facts)
        data = self.build(facts, options)
        if not isinstance(data, ImageData):
            raise FlareError(f"dataset {facts.name!r} built {type(data).__name__}, not an ImageData.",
                             key="dataset.name", fix="its build function must return flare.data.datasets.ImageData.")
        return data


def register_dataset(name: str, build: Callable | None = None, *, options=None, description: str = "",
                     num_classes: int | None = None, check=None, overwrite: bool = False, kind: str = "images"):
    """Register a dataset built in memory, `build(facts: DatasetFacts, options) -> ImageData` (`options`:
    `dataset.options` validated by the `options` model, or None); usable as a decorator; `check(cfg)` refuses a
    config the dataset cannot serve (`Registry.register`). Built-in datasets are read from files instead."""
    if build is None:
        return lambda fn: register_dataset(name, fn, options=options, description=description,
                                           num_classes=num_classes, check=check, overwrite=overwrite, kind=kind)
    doc = (build.__doc__ or "").strip().splitlines()
    desc = description or (doc[0] if doc else "")
    DATASETS.register(name, DatasetInfo(desc, (), num_classes, None, build, kind), options=options, description=desc,
                      check=check, overwrite=overwrite)
    return build


# ----------------------------------------------------------------------------- public API


def load_dataset(name: str, root: str | os.PathLike | None, format: str = "auto", download: bool = False,
                 cache_dir: str | os.PathLike | None = None, options: dict | None = None) -> ImageData:
    """Load a dataset as whole tensors, decoding it only when the on-disk cache is missing or stale (`_cache_file`:
    its key)."""
    return DATASETS.create(name, DatasetFacts(name, root, format, download, cache_dir), options)


def _read(info: DatasetInfo, facts: DatasetFacts) -> ImageData:
    """A built-in dataset read from its files (through the cache)."""
    name, root, format, download, cache_dir = facts.name, facts.root, facts.format, facts.download, facts.cache_dir
    root_path = Path(root).expanduser() if root not in (None, "") else None
    fmt = _resolve_format(name, info, root_path, format)
    source = (_locate_imagefolder(name, root_path) if fmt == "imagefolder"
              else info.locate(name, root_path, fmt, download))

    cache_file = _cache_file(_cache_dir(cache_dir), name, fmt, source.paths)
    data = _load_cache(cache_file, name)
    if data is not None:
        return data

    train_x, train_y, test_x, test_y, classes = source.read()
    if fmt == "imagefolder" and info.num_classes and len(classes) != info.num_classes:
        raise FlareError(f"{root_path} holds {len(classes)} classes, but {name} has {info.num_classes}.",
                         key="dataset.root", fix=f"point dataset.root at a {name} image folder, "
                         "or use dataset.name=imagefolder for an arbitrary tree.")
    _check_arrays(name, root_path or DEBIAN_FMNIST, train_x, train_y, test_x, test_y, classes)
    mean, std = _channel_stats(train_x)
    data = ImageData(name, train_x, train_y, test_x, test_y, list(classes), mean, std)
    _save_cache(cache_file, data)
    return data


def stratified_subset(y: torch.Tensor, n: int | None, seed: int) -> torch.Tensor:
    """Sorted int64 indices of a seeded random subset of size n with the class proportions of y.

    Each class gets round(n * its share); the rounding surplus or deficit goes to the classes whose
    exact share was rounded the most (ties: lowest label), so the total is exactly n.
    `n` None or >= len(y) gives all indices. Runs on CPU; returns CPU indices."""
    y = y.detach().cpu()
    total = len(y)
    if n is None or n >= total:
        return torch.arange(total)
    labels, counts = torch.unique(y, return_counts=True)
    exact = counts.double() * n / total
    take = torch.floor(exact + 0.5).long()
    if diff := n - int(take.sum()):
        rest = exact - take  # > 0: got less than its share
        order = torch.argsort(-rest if diff > 0 else rest, stable=True)
        take[order[:abs(diff)]] += 1 if diff > 0 else -1
    gen = torch.Generator().manual_seed(seed)
    picks = []
    for label, k in zip(labels.tolist(), take.tolist()):
        idx = torch.nonzero(y == label).squeeze(1)
        picks.append(idx[torch.randperm(len(idx), generator=gen)[:k]])
    return torch.sort(torch.cat(picks)).values


# ----------------------------------------------------------------------------- format choice


def _resolve_format(name: str, info: DatasetInfo, root: Path | None, format: str) -> str:
    """Turn "auto" into a concrete format and reject formats the dataset cannot be read from."""
    if format not in FORMATS:
        raise FlareError(f"unknown dataset format {format!r}.", key="dataset.format",
                         fix=f"use one of: {', '.join(FORMATS)}.")
    if format != "auto":
        if format not in info.formats:
            raise FlareError(f"dataset {name} cannot be read as format={format}.", key="dataset.format",
                             fix=f"use one of: {', '.join(('auto',) + info.formats)}.")
        return format
    if name == "imagefolder":
        return "imagefolder"
    if name == "tinyimagenet" and root is not None and _tiny_base(root):
        return "tinyimagenet"  # its official tree also has train/ and test/ folders: check it first
    if root is not None and (_is_archive(root) or ((root / "train").is_dir() and (root / "test").is_dir())):
        return "imagefolder"
    if name == "tinyimagenet":
        return "tinyimagenet"
    if name == "fmnist" and root is None:
        return "idx"  # the Debian package
    if name in ("fmnist", "mnist") and root is not None and _has_idx_files(root):
        return "idx"
    return "torchvision"


# ----------------------------------------------------------------------------- checks, stats, cache


def _check_arrays(name, root, train_x, train_y, test_x, test_y, classes) -> None:
    """Catch malformed sources (label out of range, count mismatch) before they reach training."""
    for split, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
        problem = None
        if x.dtype != torch.uint8 or x.ndim != 4:
            problem = f"{split} images are {x.dtype} {tuple(x.shape)}, expected uint8 N×C×H×W"
        elif len(x) != len(y):
            problem = f"{split} has {len(x)} images but {len(y)} labels"
        elif len(y) and (int(y.min()) < 0 or int(y.max()) >= len(classes)):
            problem = f"{split} labels span {int(y.min())}..{int(y.max())}, but there are {len(classes)} classes"
        if problem:
            raise FlareError(f"{name} under {root}: {problem}.", key="dataset.root",
                             fix="re-download or re-export the dataset.")
    if len(train_y) == 0:
        raise FlareError(f"{name} under {root} has no training images.", key="dataset.root", fix="check dataset.root.")


def _channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std of x / 255 from 256-bin histograms (no float copy of the dataset)."""
    values = torch.arange(256, dtype=torch.float64) / 255
    means, stds = [], []
    for c in range(x.shape[1]):
        hist = torch.bincount(x[:, c].reshape(-1), minlength=256).double()
        hist /= hist.sum()
        mean = float((hist * values).sum())
        means.append(mean)
        stds.append(float((hist * (values - mean) ** 2).sum()) ** 0.5)
    return tuple(means), tuple(stds)


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    """The cache folder (dataset.cache_dir, else $FLARE_CACHE, else ~/.cache/flare), created; checked before anything
    is decoded, so a bad one is an error that names it rather than a warning after minutes of decoding."""
    where = "dataset.cache_dir" if cache_dir is not None else ("$FLARE_CACHE" if os.environ.get("FLARE_CACHE")
                                                                  else "the default cache ~/.cache/flare")
    d = Path(cache_dir or os.environ.get("FLARE_CACHE") or Path.home() / ".cache" / "flare").expanduser()
    fix = "set dataset.cache_dir to a folder you can write to (it holds the decoded datasets)."
    if d.exists() and not d.is_dir():
        raise FlareError(f"{where} '{d}' is a file, not a folder.", key="dataset.cache_dir", fix=fix)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlareError(f"{where} '{d}' cannot be created ({e.strerror}).", key="dataset.cache_dir", fix=fix) from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise FlareError(f"{where} '{d}' is not writable.", key="dataset.cache_dir", fix=fix)
    return d


def _cache_file(cache_dir: Path, name: str, fmt: str, paths: list[Path]) -> Path:
    """Cache file name: a hash of name, format and the contents of every source file (each named by its path
    inside its source). Contents, not size and mtime: a read-only data mount that is re-created with new mtimes
    (every session of a shared machine) would otherwise decode the same images again and leave a stale copy
    behind; hashing the files costs well under a second, decoding them minutes."""
    h = hashlib.sha256(json.dumps([_CACHE_VERSION, name, fmt]).encode())
    for path in paths:
        path = path.resolve()
        files = {path.name: path} if path.is_file() else {
            str(f.relative_to(path)): f for f in sorted(path.rglob("*")) if f.is_file()}
        for rel, f in files.items():
            with open(f, "rb") as fh:
                h.update(f"{rel}\0{hashlib.file_digest(fh, 'sha256').hexdigest()}\n".encode())
    return cache_dir / f"{name}-{fmt}-{h.hexdigest()[:16]}.pt"


def _load_cache(path: Path, name: str) -> ImageData | None:
    if not path.is_file():
        return None
    try:
        d = torch.load(path, weights_only=True)
        return ImageData(name, d["train_x"], d["train_y"], d["test_x"], d["test_y"],
                         list(d["classes"]), tuple(d["mean"]), tuple(d["std"]))
    except Exception as e:
        warnings.warn(f"dataset cache {path} is unreadable ({e}); decoding the dataset again", stacklevel=3)
        return None


def _save_cache(path: Path, data: ImageData) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_torch_save({"train_x": data.train_x.contiguous(), "train_y": data.train_y,
                           "test_x": data.test_x.contiguous(), "test_y": data.test_y,
                           "classes": data.classes, "mean": list(data.mean), "std": list(data.std)}, path)
    except OSError as e:
        warnings.warn(f"could not write dataset cache {path} ({e}); the dataset will be decoded again next time",
                      stacklevel=3)


# name -> (classes, channels, size, train, test): stand-ins of the real shapes for benchmarks and
# smoke tests on machines without the real files. Not learnable beyond a class-dependent colour.
SYNTHETIC = {"synthetic-cifar10": (10, 3, 32, 50_000, 10_000), "synthetic-cifar100": (100, 3, 32, 50_000, 10_000)}


def synthetic_dataset(facts: DatasetFacts, options: None) -> ImageData:
    """Seeded random images whose mean colour depends on the class (generated, never cached)."""
    C, ch, hw, n_train, n_test = SYNTHETIC[facts.name]
    g = torch.Generator().manual_seed(0)
    centre = torch.randint(0, 176, (C, ch, 1, 1), generator=g, dtype=torch.uint8)

    def make(n):
        y = torch.randint(0, C, (n,), generator=g)
        x = torch.randint(0, 81, (n, ch, hw, hw), generator=g, dtype=torch.uint8)
        return x.add_(centre[y]), y  # centre + U{0..80} stays within 0..255

    train_x, train_y = make(n_train)
    test_x, test_y = make(n_test)
    mean, std = _channel_stats(train_x)
    return ImageData(facts.name, train_x, train_y, test_x, test_y, [f"class{c}" for c in range(C)], mean, std)


_BUILTIN: dict[str, DatasetInfo] = {
    "fmnist": DatasetInfo("Fashion-MNIST: 10 clothing classes, 1x28x28, 60k/10k (Debian package or torchvision)",
                          ("idx", "torchvision", "imagefolder"), 10, _locate_mnist),
    "mnist": DatasetInfo("MNIST digits: 10 classes, 1x28x28, 60k/10k (torchvision layout or IDX files)",
                         ("idx", "torchvision", "imagefolder"), 10, _locate_mnist),
    "cifar10": DatasetInfo("CIFAR-10: 10 classes, 3x32x32, 50k/10k (torchvision pickles or image folder/tar)",
                           ("torchvision", "imagefolder"), 10, _locate_cifar),
    "cifar100": DatasetInfo("CIFAR-100: 100 fine classes, 3x32x32, 50k/10k (torchvision pickles or image folder/tar)",
                            ("torchvision", "imagefolder"), 100, _locate_cifar),
    "svhn": DatasetInfo("SVHN cropped digits: 10 classes, 3x32x32, 73k/26k (torchvision .mat files, needs scipy)",
                        ("torchvision", "imagefolder"), 10, _locate_svhn),
    "tinyimagenet": DatasetInfo("Tiny-ImageNet-200: 200 classes, 3x64x64, 100k/10k (official tree, val = test)",
                                ("imagefolder",), 200, _locate_tiny),
    "imagefolder": DatasetInfo("any train/<class>/*, test/<class>/* tree, as a folder or .tar/.tar.gz",
                               ("imagefolder",), None, None)}
for _name, _info in _BUILTIN.items():
    DATASETS.register(_name, _info, description=_info.description)
for _name, _like in (("synthetic-cifar10", "CIFAR-10"), ("synthetic-cifar100", "CIFAR-100")):
    register_dataset(_name, synthetic_dataset, num_classes=SYNTHETIC[_name][0],
                     description=f"generated stand-in, {_like}'s shapes (benchmarks; no files)")
