"""Readers of the on-disk dataset formats, each returning whole uint8 tensors: IDX (MNIST family), torchvision's
CIFAR pickles and SVHN .mat files, Tiny-ImageNet's tree, and image folders (a folder or a tar archive). `datasets`
picks the reader, caches what it returns and registers the datasets by name.

Every reader raises `FlareError` naming the path and the fix for a missing, partial or corrupt source."""
from __future__ import annotations

import gzip
import os
import pickle
import struct
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from flare.data.decode import Arrays, decode_splits
from flare.errors import FlareError

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm"}

FMNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                  "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
DIGITS = [str(i) for i in range(10)]
TINY_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"


@dataclass
class _Source:
    """Where a dataset lives: the files/folders whose contents key the cache, and how to decode them."""

    paths: list[Path]
    read: Callable[[], Arrays]


# ----------------------------------------------------------------------------- layouts


def _is_archive(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)


def _has_idx_files(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in ("train-images-idx3-ubyte", "train-images-idx3-ubyte.gz"))


def _tiny_base(root: Path) -> Path | None:
    return next((base for base in (root, root / "tiny-imagenet-200") if (base / "wnids.txt").is_file()), None)


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
        if missing := [f for f in files if not f.is_file()]:
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
    "cifar100": ("cifar-100-python", ["train"], ["test"], "meta", "fine_label_names", "fine_labels", "CIFAR100")}


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
    if missing := [f.name for f in files if not f.is_file()]:
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
    if missing := [f.name for f in files if not f.is_file()]:
        raise FlareError(f"svhn not found under {root} (missing {', '.join(missing)}).", key="dataset.root", fix=fix)

    def read_split(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        import scipy.io  # lazy: see _torchvision_class

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

    Classes are the wnids sorted alphabetically (like torchvision's ImageFolder), not wnids.txt's order."""
    fix = (f"download {TINY_URL} and unzip it into DIR, then set dataset.root=DIR "
           "(or set dataset.root=DIR dataset.download=true).")
    if root is None:
        raise FlareError("tinyimagenet needs dataset.root.", key="dataset.root", fix=fix)
    base = _tiny_base(root)
    if base is None and download:
        from torchvision.datasets.utils import download_and_extract_archive  # lazy: see _torchvision_class

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
        return decode_splits(name, train, test, classes)

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


def _require_splits(where: str, top: set[str], layout: str | None = None) -> None:
    if missing := [s for s in ("train", "test") if s not in top]:
        found = layout or ", ".join(f"{t}/" for t in sorted(top)) or "no folders"
        raise FlareError(f"{where} has no {' and no '.join(s + '/' for s in missing)} folder with "
                         f"class subfolders of images (found: {found}).",
                         key="dataset.root", fix="lay the images out as train/<class>/* and test/<class>/*.")


def _describe_layout(entries: list[tuple[tuple[str, ...], object]], most: int = 4) -> str:
    """Where the images of an archive sit, e.g. "images/a/ (3 images), images/b/ (2 images)"."""
    count: dict[str, int] = {}
    for parts, _ in entries:
        d = "/".join(parts[:-1][:3]) + "/" if len(parts) > 1 else "the archive's top level"
        count[d] = count.get(d, 0) + 1
    if not count:
        return "no images at all"
    shown = [f"{d} ({n} image{'s' if n > 1 else ''})" for d, n in sorted(count.items())[:most]]
    return ", ".join(shown) + (f" and {len(count) - most} more folders" if len(count) > most else "")


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
    # the tree may sit under one top-level folder (e.g. cifar10-jpg/train/...): strip it when train/ or test/
    # is below it, and keep the paths as they are otherwise (so an error shows the layout that is really there)
    tops = {parts[0] for parts, _ in entries if len(parts) > 1}
    if len(tops) == 1 and not tops & {"train", "test"}:
        inner = [(parts[1:], data) for parts, data in entries if len(parts) > 1]
        if {parts[0] for parts, _ in inner if len(parts) >= 3} & {"train", "test"}:
            entries = inner
    return entries


def _read_tree(name: str, where: str, entries: list[tuple[tuple[str, ...], Path | bytes]]) -> Arrays:
    """Group split/class/.../file entries, label classes by sorted train/ folder name, and decode."""
    _require_splits(where, {parts[0] for parts, _ in entries if len(parts) >= 3}, _describe_layout(entries))
    splits: dict[str, list] = {"train": [], "test": []}
    for parts, payload in entries:
        if len(parts) >= 3 and parts[0] in splits:
            splits[parts[0]].append((parts[1], "/".join(parts), payload))
    classes = sorted({cls for cls, _, _ in splits["train"]})
    label = {c: i for i, c in enumerate(classes)}
    if extra := sorted({cls for cls, _, _ in splits["test"]} - set(classes)):
        raise FlareError(f"{where}: test/ has classes with no train/ images: {', '.join(extra)}.",
                         key="dataset.root", fix="give every test class training images, or remove it from test/.")
    items = {s: sorted((label[cls], rel, payload) for cls, rel, payload in v) for s, v in splits.items()}
    train, test = ([(f"{where}/{rel}", payload, y) for y, rel, payload in items[s]] for s in ("train", "test"))
    return decode_splits(name, train, test, classes)


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
    """Imported only when a download needs it: importing torchvision pulls in torch._dynamo,
    seconds of start-up for every `flare` process (Flower nodes, sweep workers) that only reads local files."""
    import torchvision.datasets  # lazy: see the docstring

    return getattr(torchvision.datasets, name)


def _corrupt(path: Path, why: object) -> FlareError:
    return FlareError(f"cannot read {path}: {why}.", key="dataset.root",
                      fix="delete the file and download it again (dataset.download=true), "
                      "or replace it with a good copy.")


