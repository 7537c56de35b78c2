"""Image datasets as whole uint8 tensors.

Every dataset is decoded once into one N×C×H×W uint8 tensor per split plus int64 labels and cached on
disk, so training can cut batches on the GPU by indexing instead of running a DataLoader.

Nothing is downloaded unless `download=True`, and a missing, partial or corrupt dataset raises
`FlareError` naming the path and the command that fixes it; there is no silent fallback to another source.

Sample order is deterministic: image folders are sorted by (label, file path), Tiny-ImageNet's val split
follows `val_annotations.txt`, the other formats keep their files' order.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pickle
import struct
import sys
import tarfile
import tempfile
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from flare.errors import FlareError

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
FORMATS = ("auto", "torchvision", "imagefolder", "idx")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm"}

FMNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                  "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
DIGITS = [str(i) for i in range(10)]
TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"

_CACHE_VERSION = 1  # bump when the decoded layout changes, so old cache files are never read
_WORKERS = min(8, os.cpu_count() or 1)

# train_x, train_y, test_x, test_y, classes
Arrays = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[str]]


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

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_channels(self) -> int:
        return self.train_x.shape[1]

    @property
    def image_size(self) -> int:
        return self.train_x.shape[2]

    def __repr__(self) -> str:
        c, h, w = self.train_x.shape[1:]
        return (f"ImageData({self.name}: {len(self.train_y)} train / {len(self.test_y)} test, "
                f"{c}x{h}x{w}, {self.num_classes} classes)")


@dataclass
class _Source:
    """Where a dataset lives: the files/folders whose size+mtime key the cache, and how to decode them."""

    paths: list[Path]
    read: Callable[[], Arrays]


@dataclass(frozen=True)
class DatasetInfo:
    description: str
    formats: tuple[str, ...]  # the explicit formats it accepts ("auto" is always accepted)
    num_classes: int | None   # checked when read from an image folder, to catch a tree of the wrong dataset
    locate: Callable[[str, Path | None, str, bool], _Source] | None  # (name, root, format, download)


# ----------------------------------------------------------------------------- public API


def list_datasets() -> list[tuple[str, str]]:
    """(name, description) of every registered dataset, for `flare datasets`."""
    return [(name, info.description) for name, info in DATASETS.items()]


def load_dataset(name: str, root: str | os.PathLike | None, format: str = "auto", download: bool = False,
                 cache_dir: str | os.PathLike | None = None) -> ImageData:
    """Load a dataset as whole tensors, decoding it only when the on-disk cache is missing or stale.

    The cache key is the dataset name, format and the absolute path, size and mtime of every source file,
    so editing or replacing the source invalidates it.
    """
    info = DATASETS.get(name)
    if info is None:
        raise FlareError(f"unknown dataset {name!r}.", key="dataset.name",
                         fix=f"use one of: {', '.join(DATASETS)}.")
    if name in SYNTHETIC:
        return synthetic_dataset(name)
    root_path = Path(root).expanduser() if root not in (None, "") else None
    fmt = _resolve_format(name, info, root_path, format)
    if fmt == "imagefolder":
        source = _locate_imagefolder(name, root_path)
    else:
        source = info.locate(name, root_path, fmt, download)

    cache_file = _cache_file(cache_dir, name, fmt, source.paths)
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
    `n` None or >= len(y) gives all indices. Runs on CPU; returns CPU indices.
    """
    y = y.detach().cpu()
    total = len(y)
    if n is None or n >= total:
        return torch.arange(total)
    if n < 0:
        raise ValueError(f"subset size must be >= 0, got {n}")
    labels, counts = torch.unique(y, return_counts=True)
    exact = counts.double() * n / total
    take = torch.floor(exact + 0.5).long()
    diff = n - int(take.sum())
    if diff:
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


def _is_archive(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _has_idx_files(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in ("train-images-idx3-ubyte", "train-images-idx3-ubyte.gz"))


def _tiny_base(root: Path) -> Path | None:
    for base in (root, root / "tiny-imagenet-200"):
        if (base / "wnids.txt").is_file():
            return base
    return None


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


# ----------------------------------------------------------------------------- IDX (MNIST family)

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file (MNIST's container: zero bytes, dtype code, ndim, big-endian dims, data)."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise _corrupt(path, e) from None
    if len(raw) < 4 or raw[0] or raw[1] or raw[2] not in _IDX_DTYPES or len(raw) < 4 + 4 * raw[3]:
        raise _corrupt(path, "not an IDX file (bad header)")
    dims = struct.unpack_from(f">{raw[3]}I", raw, 4)
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    offset, count = 4 + 4 * len(dims), int(np.prod(dims))
    if len(raw) != offset + count * dtype.itemsize:
        raise _corrupt(path, f"size does not match its header {dims} (truncated?)")
    return np.frombuffer(raw, dtype, count, offset).reshape(dims)


def _locate_mnist(name: str, root: Path | None, fmt: str, download: bool) -> _Source:
    classes = FMNIST_CLASSES if name == "fmnist" else DIGITS
    if fmt == "idx":
        folder = root if root is not None else DEBIAN_FMNIST
        files = []
        for stem in _IDX_FILES:
            found = [folder / f for f in (stem + ".gz", stem) if (folder / f).is_file()]
            if not found:
                raise _missing_mnist(name, folder, stem + "[.gz]", debian=root is None or folder == DEBIAN_FMNIST)
            files.append(found[0])
    else:
        if root is None:
            raise _missing_mnist(name, None, "", debian=name == "fmnist")
        tv_name = "FashionMNIST" if name == "fmnist" else "MNIST"
        folder = root / tv_name / "raw"
        files = [folder / stem for stem in _IDX_FILES]  # torchvision keeps them gunzipped
        if download and not all(f.is_file() for f in files):
            _download(name, root, lambda: _torchvision_class(tv_name)(str(root), train=True, download=True))
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise _missing_mnist(name, root, str(missing[0].relative_to(root)), debian=False)

    def read() -> Arrays:
        x_tr, y_tr, x_te, y_te = (torch.from_numpy(_read_idx(f).copy()) for f in files)
        return x_tr.unsqueeze(1), y_tr.long(), x_te.unsqueeze(1), y_te.long(), classes

    return _Source(files, read)


def _missing_mnist(name: str, folder: Path | None, what: str, debian: bool) -> FlareError:
    if debian and name == "fmnist":
        return FlareError(f"Fashion-MNIST not found ({DEBIAN_FMNIST}/ has no {what or 'IDX files'}).",
                          key="dataset.root", fix="apt-get install -y dataset-fashion-mnist, "
                          "or set dataset.root=DIR dataset.download=true.")
    where = f"under {folder} (no {what})" if folder is not None else "(dataset.root is not set)"
    return FlareError(f"{name} not found {where}.", key="dataset.root",
                      fix=f"set dataset.root=DIR dataset.download=true (needs internet), or point dataset.root "
                      f"at a folder holding {'FashionMNIST' if name == 'fmnist' else 'MNIST'}/raw/*-ubyte "
                      "(torchvision layout) or the four *-ubyte[.gz] IDX files.")


# ----------------------------------------------------------------------------- CIFAR, SVHN
# torchvision's CIFAR10/CIFAR100/SVHN refuse files whose md5 differs from the official release, which
# rules out every test fixture (and any re-exported copy), so they are used here only to download; the
# pickles and .mat files are read directly, exactly as torchvision reads them.

_CIFAR = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"],
                "batches.meta", "label_names", "labels", "CIFAR10"),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "meta", "fine_label_names", "fine_labels", "CIFAR100"),
}


def _locate_cifar(name: str, root: Path | None, fmt: str, download: bool) -> _Source:
    folder_name, train_files, test_files, meta_file, names_key, labels_key, tv_name = _CIFAR[name]
    fix = (f"set dataset.download=true (needs internet) or point dataset.root at the folder that contains "
           f"{folder_name}/ (or use dataset.format=imagefolder for an image-folder export).")
    if root is None:
        raise FlareError(f"{name} needs dataset.root.", key="dataset.root", fix=fix)
    folder = root / folder_name
    files = [folder / f for f in train_files + test_files + [meta_file]]
    if download and not all(f.is_file() for f in files):
        _download(name, root, lambda: _torchvision_class(tv_name)(str(root), train=True, download=True))
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FlareError(f"{name} not found under {root} (missing {folder_name}/{', '.join(missing)}).",
                         key="dataset.root", fix=fix)

    def read_split(names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        for f in names:
            entry = _unpickle(folder / f)
            try:
                xs.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                ys.append(np.asarray(entry[labels_key], dtype=np.int64))
            except (KeyError, ValueError, TypeError) as e:
                raise _corrupt(folder / f, f"not a CIFAR batch ({e!r})") from None
        return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))

    def read() -> Arrays:
        meta = _unpickle(folder / meta_file)
        if not isinstance(meta, dict) or names_key not in meta:
            raise _corrupt(folder / meta_file, f"no {names_key!r} entry")
        return (*read_split(train_files), *read_split(test_files), [str(c) for c in meta[names_key]])

    return _Source(files, read)


def _unpickle(path: Path):
    try:
        with open(path, "rb") as f:
            return pickle.load(f, encoding="latin1")
    except Exception as e:  # a damaged pickle can raise almost anything
        raise _corrupt(path, e) from None


def _locate_svhn(name: str, root: Path | None, fmt: str, download: bool) -> _Source:
    fix = ("set dataset.download=true (needs internet) or point dataset.root at the folder that contains "
           "train_32x32.mat and test_32x32.mat.")
    if root is None:
        raise FlareError("svhn needs dataset.root.", key="dataset.root", fix=fix)
    files = [root / "train_32x32.mat", root / "test_32x32.mat"]
    for split, f in zip(("train", "test"), files):
        if download and not f.is_file():
            _download(name, root, lambda split=split: _torchvision_class("SVHN")(str(root), split=split, download=True))
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FlareError(f"svhn not found under {root} (missing {', '.join(missing)}).", key="dataset.root", fix=fix)

    def read_split(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            import scipy.io
        except ImportError:
            raise FlareError("reading SVHN needs scipy.", key="dataset.name", fix="pip install scipy") from None
        try:
            mat = scipy.io.loadmat(str(path))
            x = np.ascontiguousarray(np.transpose(mat["X"], (3, 2, 0, 1)), dtype=np.uint8)  # H×W×C×N -> N×C×H×W
            y = np.asarray(mat["y"], dtype=np.int64).reshape(-1)
        except Exception as e:
            raise _corrupt(path, e) from None
        y[y == 10] = 0  # SVHN stores digit 0 as label 10; torchvision maps it back
        return torch.from_numpy(x), torch.from_numpy(y)

    return _Source(files, lambda: (*read_split(files[0]), *read_split(files[1]), DIGITS))


# ----------------------------------------------------------------------------- Tiny-ImageNet


def _locate_tiny(name: str, root: Path | None, fmt: str, download: bool) -> _Source:
    """Tiny-ImageNet's official tree; its labelled val split is the test split (test/ has no labels).

    Classes are the wnids sorted alphabetically (like torchvision's ImageFolder), not wnids.txt's order.
    """
    fix = (f"download {TINY_URL} and unzip it into DIR, then set dataset.root=DIR "
           "(or set dataset.root=DIR dataset.download=true).")
    if root is None:
        raise FlareError("tinyimagenet needs dataset.root.", key="dataset.root", fix=fix)
    base = _tiny_base(root)
    if base is None and download:
        from torchvision.datasets.utils import download_and_extract_archive
        _download(name, root, lambda: download_and_extract_archive(TINY_URL, str(root), md5=TINY_MD5))
        base = _tiny_base(root)
    if base is None:
        raise FlareError(f"Tiny-ImageNet not found: neither {root} nor {root / 'tiny-imagenet-200'} has wnids.txt.",
                         key="dataset.root", fix=fix)
    for sub in ("train", "val/images", "val/val_annotations.txt"):
        if not (base / sub).exists():
            raise FlareError(f"Tiny-ImageNet under {base} is incomplete: {sub} is missing.",
                             key="dataset.root", fix=fix)

    def read() -> Arrays:
        classes = sorted({w.strip() for w in (base / "wnids.txt").read_text().split() if w.strip()})
        label = {w: i for i, w in enumerate(classes)}
        train = []
        for w in classes:
            folder = base / "train" / w / "images"
            if not folder.is_dir():
                raise FlareError(f"Tiny-ImageNet under {base} has no train/{w}/images/.", key="dataset.root", fix=fix)
            train += [(str(p), p, label[w]) for p in sorted(folder.iterdir()) if _is_image(p.name)]
        test = []
        for line in (base / "val" / "val_annotations.txt").read_text().splitlines():
            if not line.strip():
                continue
            fname, w = line.split("\t")[:2]
            if w not in label:
                raise _corrupt(base / "val" / "val_annotations.txt", f"{fname} has wnid {w}, not in wnids.txt")
            p = base / "val" / "images" / fname
            if not p.is_file():
                raise FlareError(f"Tiny-ImageNet: {p} is listed in val_annotations.txt but missing.",
                                 key="dataset.root", fix=fix)
            test.append((str(p), p, label[w]))
        return _decode_splits(name, train, test, classes)

    return _Source([base / "wnids.txt", base / "train", base / "val"], read)


# ----------------------------------------------------------------------------- image folders


def _is_image(filename: str) -> bool:
    return not filename.startswith(".") and os.path.splitext(filename)[1].lower() in IMAGE_SUFFIXES


def _locate_imagefolder(name: str, root: Path | None) -> _Source:
    """A train/<class>/*, test/<class>/* tree, as a folder or a tar archive, possibly under one top folder."""
    fix = "point dataset.root at a folder or .tar/.tar.gz holding train/<class>/* and test/<class>/*."
    if root is None:
        raise FlareError(f"{name} as an image folder needs dataset.root.", key="dataset.root", fix=fix)
    if not root.exists():
        raise FlareError(f"{root} does not exist.", key="dataset.root", fix=fix)
    if root.is_file():
        return _Source([root], lambda: _read_tree(name, str(root), _tar_entries(root)))
    base = root
    if not (root / "train").is_dir() and not (root / "test").is_dir():
        subdirs = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
        if len(subdirs) == 1:
            base = subdirs[0]
    _require_splits(str(base), {d.name for d in base.iterdir() if d.is_dir()})
    return _Source([base / "train", base / "test"], lambda: _read_tree(name, str(base), _dir_entries(base)))


def _require_splits(where: str, top: set[str]) -> None:
    missing = [s for s in ("train", "test") if s not in top]
    if missing:
        found = ", ".join(sorted(top)) or "nothing"
        raise FlareError(f"{where} has no {' and no '.join(s + '/' for s in missing)} folder with "
                         f"class subfolders of images (found: {found}).",
                         key="dataset.root", fix="lay the images out as train/<class>/* and test/<class>/*.")


def _dir_entries(base: Path) -> list[tuple[tuple[str, ...], Path]]:
    entries = []
    for split in ("train", "test"):
        for dirpath, dirnames, filenames in os.walk(base / split):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(base).parts
            entries += [(rel + (f,), Path(dirpath) / f) for f in filenames if _is_image(f)]
    return entries


def _tar_entries(path: Path) -> list[tuple[tuple[str, ...], bytes]]:
    """Every image in a tar archive as (path parts, bytes): one sequential pass, nothing written to disk."""
    entries = []
    try:
        with tarfile.open(path, "r|*") as tar:
            for member in tar:
                parts = tuple(p for p in member.name.split("/") if p not in ("", "."))
                if member.isfile() and parts and _is_image(parts[-1]):
                    entries.append((parts, tar.extractfile(member).read()))
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise FlareError(f"cannot read archive {path}: {e}.", key="dataset.root",
                         fix="re-copy or re-create the archive (`tar tzf FILE` must list it without errors), "
                         "or point dataset.root at the unpacked folder.") from None
    # the tree may sit under one top-level folder (e.g. cifar10-jpg/train/...)
    tops = {parts[0] for parts, _ in entries if len(parts) > 1}
    if len(tops) == 1 and not tops & {"train", "test"}:
        entries = [(parts[1:], data) for parts, data in entries if len(parts) > 1]
    return entries


def _read_tree(name: str, where: str, entries: list[tuple[tuple[str, ...], Path | bytes]]) -> Arrays:
    """Group split/class/.../file entries, label classes by sorted train/ folder name, and decode."""
    _require_splits(where, {parts[0] for parts, _ in entries if len(parts) >= 3})
    splits: dict[str, list] = {"train": [], "test": []}
    for parts, payload in entries:
        if len(parts) >= 3 and parts[0] in splits:
            splits[parts[0]].append((parts[1], "/".join(parts), payload))
    classes = sorted({cls for cls, _, _ in splits["train"]})
    label = {c: i for i, c in enumerate(classes)}
    extra = sorted({cls for cls, _, _ in splits["test"]} - set(classes))
    if extra:
        raise FlareError(f"{where}: test/ has classes with no train/ images: {', '.join(extra)}.",
                         key="dataset.root", fix="give every test class training images, or remove it from test/.")
    items = {s: sorted((label[cls], rel, payload) for cls, rel, payload in v) for s, v in splits.items()}
    train = [(f"{where}/{rel}", payload, y) for y, rel, payload in items["train"]]
    test = [(f"{where}/{rel}", payload, y) for y, rel, payload in items["test"]]
    return _decode_splits(name, train, test, classes)


# ----------------------------------------------------------------------------- decoding


def _decode_image(data: bytes, where: str) -> torch.Tensor:
    """One encoded image -> C×H×W uint8 with C = 1 (grayscale) or 3 (RGB).

    JPEGs go through torchvision's libjpeg-turbo decoder: it releases the GIL and skips Pillow's
    per-image Python overhead (~3x faster on 32x32 images, identical pixels). Everything else (PNG with
    palettes, BMP, TIFF, ...) goes through Pillow.
    """
    if data[:3] == b"\xff\xd8\xff":
        from torchvision.io import ImageReadMode, decode_jpeg
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            img = decode_jpeg(buf, mode=ImageReadMode.UNCHANGED)
            return img if img.shape[0] in (1, 3) else decode_jpeg(buf, mode=ImageReadMode.RGB)  # e.g. CMYK
        except RuntimeError:
            pass  # let Pillow try, and word the error if it fails too
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as im:
            arr = np.array(im.convert("L" if im.mode in ("1", "L", "LA", "I", "I;16", "F") else "RGB"))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise FlareError(f"cannot decode image {where}: {e}.", key="dataset.root",
                         fix="replace or delete the broken file.") from None
    t = torch.from_numpy(arr)
    return t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1).contiguous()


def _decode_chunk(chunk: list[tuple[str, Path | bytes, int]]) -> list[torch.Tensor]:
    out = []
    for where, payload, _ in chunk:
        if isinstance(payload, Path):
            try:
                payload = payload.read_bytes()
            except OSError as e:
                raise FlareError(f"cannot read {where}: {e}.", key="dataset.root",
                                 fix="check the file's permissions.") from None
        out.append(_decode_image(payload, where))
    return out


def _decode_all(items: list[tuple[str, Path | bytes, int]], desc: str) -> list[torch.Tensor]:
    """Decode in chunks on a thread pool (the JPEG decoder releases the GIL), with a progress bar."""
    from tqdm import tqdm
    quiet = os.environ.get("FLARE_QUIET", "") not in ("", "0") or not sys.stderr.isatty()
    chunks = [items[i:i + 256] for i in range(0, len(items), 256)]
    out: list[torch.Tensor] = []
    pool = ThreadPoolExecutor(_WORKERS)
    try:
        with tqdm(total=len(items), desc=desc, unit="img", disable=quiet, file=sys.stderr) as bar:
            for part in pool.map(_decode_chunk, chunks):
                out += part
                bar.update(len(part))
    finally:
        pool.shutdown(cancel_futures=True)
    return out


def _decode_splits(name: str, train: list, test: list, classes: list[str]) -> Arrays:
    """Decode both splits into uint8 tensors: one size for all, gray only if every image is gray."""
    images = {s: _decode_all(items, f"decoding {name} {s}") for s, items in (("train", train), ("test", test))}
    every = [(img, where) for s, items in (("train", train), ("test", test))
             for img, (where, _, _) in zip(images[s], items)]
    if not every:
        raise FlareError(f"no images found for {name}.", key="dataset.root", fix="check dataset.root.")
    ref, ref_where = every[0][0].shape[1:], every[0][1]
    for img, where in every:
        if img.shape[1:] != ref:
            raise FlareError(f"images differ in size: {where} is {img.shape[2]}x{img.shape[1]}, "
                             f"{ref_where} is {ref[1]}x{ref[0]}.", key="dataset.root",
                             fix="resize all images to one size first (e.g. `mogrify -resize WxH! ...`).")
    channels = 1 if all(img.shape[0] == 1 for img, _ in every) else 3

    def stack(imgs: list[torch.Tensor]) -> torch.Tensor:
        if not imgs:
            return torch.empty((0, channels, *ref), dtype=torch.uint8)
        return torch.stack([img.expand(channels, -1, -1) for img in imgs])

    def labels(items: list) -> torch.Tensor:
        return torch.tensor([y for _, _, y in items], dtype=torch.int64)

    return stack(images["train"]), labels(train), stack(images["test"]), labels(test), classes


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


def _download(name: str, root: Path, fetch: Callable[[], object]) -> None:
    """Run a torchvision download, turning its errors (offline, bad checksum) into a FlareError."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        fetch()
    except Exception as e:
        raise FlareError(f"downloading {name} into {root} failed: {e}", key="dataset.download",
                         fix="check the internet connection, or copy the files into dataset.root by hand "
                         "and set dataset.download=false.") from None


def _torchvision_class(name: str):
    import torchvision.datasets
    return getattr(torchvision.datasets, name)


def _corrupt(path: Path, why: object) -> FlareError:
    return FlareError(f"cannot read {path}: {why}.", key="dataset.root",
                      fix="delete the file and download it again (dataset.download=true), "
                      "or replace it with a good copy.")


def _cache_file(cache_dir: str | os.PathLike | None, name: str, fmt: str, paths: list[Path]) -> Path:
    """Cache file name: a hash of name, format and (path, size, mtime) of every source file."""
    if cache_dir is None:
        cache_dir = os.environ.get("FLARE_CACHE") or Path.home() / ".cache" / "flare"
    h = hashlib.sha256(json.dumps([_CACHE_VERSION, name, fmt]).encode())
    for path in paths:
        path = path.resolve()
        if path.is_file():
            files = [str(path)]
        else:
            files = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames.sort()
                files += [os.path.join(dirpath, f) for f in sorted(filenames)]
        for f in files:
            st = os.stat(f)
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return Path(cache_dir).expanduser() / f"{name}-{fmt}-{h.hexdigest()[:16]}.pt"


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
    """Write the cache atomically (temp file + rename), so a crash never leaves a half-written cache."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save({"train_x": data.train_x.contiguous(), "train_y": data.train_y,
                        "test_x": data.test_x.contiguous(), "test_y": data.test_y,
                        "classes": data.classes, "mean": list(data.mean), "std": list(data.std)}, f)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared FLARE_CACHE should stay readable
        os.replace(tmp, path)
    except OSError as e:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
        warnings.warn(f"could not write dataset cache {path} ({e}); the dataset will be decoded again next time",
                      stacklevel=3)


# name -> (classes, channels, size, train, test): stand-ins of the real shapes for benchmarks and
# smoke tests on machines without the real files. Not learnable beyond a class-dependent colour.
SYNTHETIC = {
    "synthetic-cifar10": (10, 3, 32, 50_000, 10_000),
    "synthetic-cifar100": (100, 3, 32, 50_000, 10_000),
}


def synthetic_dataset(name: str, seed: int = 0) -> ImageData:
    """Seeded random images whose mean colour depends on the class (generated, never cached)."""
    C, ch, hw, n_train, n_test = SYNTHETIC[name]
    g = torch.Generator().manual_seed(seed)
    centre = torch.randint(0, 176, (C, ch, 1, 1), generator=g, dtype=torch.uint8)

    def make(n):
        y = torch.randint(0, C, (n,), generator=g)
        x = torch.randint(0, 81, (n, ch, hw, hw), generator=g, dtype=torch.uint8)
        return x.add_(centre[y]), y  # centre + U{0..80} stays within 0..255

    train_x, train_y = make(n_train)
    test_x, test_y = make(n_test)
    mean, std = _channel_stats(train_x)
    return ImageData(name, train_x, train_y, test_x, test_y, [f"class{c}" for c in range(C)], mean, std)


DATASETS: dict[str, DatasetInfo] = {
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
                               ("imagefolder",), None, None),
    "synthetic-cifar10": DatasetInfo("generated stand-in with CIFAR-10's shapes (benchmarks, no files needed)",
                                     (), 10, None),
    "synthetic-cifar100": DatasetInfo("generated stand-in with CIFAR-100's shapes (benchmarks, no files needed)",
                                      (), 100, None),
}
