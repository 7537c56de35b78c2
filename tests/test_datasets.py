"""Dataset loaders, each tested offline on small files written here in the real on-disk format."""
from __future__ import annotations

import gzip

import os
import pickle
import shutil
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flare.data import datasets as D
from flare.data import decode
from flare.data import formats as F
from flare.data.datasets import load_dataset, stratified_subset
from flare.errors import FlareError
from flare.registry import DATASETS

from conftest import PLUGINS

CIFAR_TAR = Path("/work/shared/data/cifar10-jpg.tar.gz")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("FLARE_QUIET", "1")


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def rng(seed=0):
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- writers


def write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    raw = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(raw) if gz else raw)


def write_mnist(folder: Path, gz: bool, n_train=12, n_test=6, size=28):
    r = rng()
    arrays = {
        "train-images-idx3-ubyte": r.integers(0, 256, (n_train, size, size), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": r.integers(0, 256, (n_test, size, size), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test)[::-1] % 10).astype(np.uint8),
    }
    for stem, arr in arrays.items():
        write_idx(folder / (stem + (".gz" if gz else "")), arr, gz)
    return arrays


def write_cifar10(root: Path, per_batch=4):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    r = rng(1)
    xs, ys = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = r.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        y = list(r.integers(0, 10, per_batch))
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "data": x, "labels": y, "filenames": []}, f)
        xs.append(x)
        ys.append(y)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names, "num_cases_per_batch": per_batch}, f)
    return xs, ys, names


def write_png(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path, format="PNG")


def solid(value, size=(6, 5), gray=False):
    shape = (size[1], size[0]) if gray else (size[1], size[0], 3)
    return np.full(shape, value, dtype=np.uint8)


CLASSES = ["ant", "cat", "dog"]  # written in another order; sorted -> labels 0, 1, 2


def write_tree(base: Path, gray=False, n_train=3, n_test=2):
    """train/<cls>/<i>.png with pixel value 40*label + i, so every image can be traced back exactly."""
    for split, n in (("train", n_train), ("test", n_test)):
        for cls in ("dog", "ant", "cat"):
            for i in range(n):
                write_png(base / split / cls / f"{i}.png", solid(40 * CLASSES.index(cls) + i, gray=gray))
    (base / "train" / "cat" / "notes.txt").write_text("not an image")
    (base / "train" / "cat" / ".hidden.png").write_bytes(b"junk")


def make_tar(src: Path, dest: Path, top: str | None, mode: str) -> Path:
    with tarfile.open(dest, mode) as tar:
        for split in ("train", "test"):
            tar.add(src / split, arcname=f"{top}/{split}" if top else split)
    return dest


# ----------------------------------------------------------------------------- MNIST family


def test_fmnist_idx_folder_gz(tmp_path, cache):
    arrays = write_mnist(tmp_path / "fm", gz=True)
    data = load_dataset("fmnist", tmp_path / "fm", cache_dir=cache)
    assert data.train_x.shape == (12, 1, 28, 28) and data.test_x.shape == (6, 1, 28, 28)
    assert data.train_x.dtype == torch.uint8 and data.train_y.dtype == torch.int64
    assert data.train_x.is_contiguous()
    assert torch.equal(data.train_x[:, 0], torch.from_numpy(arrays["train-images-idx3-ubyte"]))
    assert data.test_y.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
    assert data.classes[0] == "T-shirt/top" and data.num_classes == 10
    assert (data.in_channels, data.image_size) == (1, 28)
    x = arrays["train-images-idx3-ubyte"] / 255
    assert data.mean == pytest.approx((x.mean(),)) and data.std == pytest.approx((x.std(),))


def test_fmnist_default_is_debian_dir(tmp_path, cache, monkeypatch):
    write_mnist(tmp_path / "deb", gz=True)
    monkeypatch.setattr(F, "DEBIAN_FMNIST", tmp_path / "deb")
    assert len(load_dataset("fmnist", None, cache_dir=cache).train_y) == 12


def test_fmnist_debian_missing(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(F, "DEBIAN_FMNIST", tmp_path / "nothing")
    with pytest.raises(FlareError) as e:
        load_dataset("fmnist", None, cache_dir=cache)
    assert e.value.key == "dataset.root" and "apt-get install -y dataset-fashion-mnist" in e.value.fix


@pytest.mark.parametrize("name, folder", [("fmnist", "FashionMNIST"), ("mnist", "MNIST")])
def test_mnist_torchvision_layout(tmp_path, cache, name, folder):
    # torchvision keeps the gunzipped IDX files in ROOT/<Class>/raw and checks only that they exist
    arrays = write_mnist(tmp_path / folder / "raw", gz=False, size=28)
    data = load_dataset(name, tmp_path, cache_dir=cache)
    assert torch.equal(data.test_x[:, 0], torch.from_numpy(arrays["t10k-images-idx3-ubyte"]))
    assert data.train_y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    import torchvision.datasets
    tv = getattr(torchvision.datasets, folder)(str(tmp_path), train=True)  # torchvision agrees
    assert torch.equal(tv.data, data.train_x[:, 0]) and torch.equal(tv.targets, data.train_y)


def test_mnist_missing_never_downloads(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(F, "_download", lambda *a: pytest.fail("downloaded without download=True"))
    with pytest.raises(FlareError) as e:
        load_dataset("mnist", tmp_path, cache_dir=cache)
    assert e.value.key == "dataset.root" and "dataset.download=true" in e.value.fix
    with pytest.raises(FlareError) as e:
        load_dataset("mnist", None, cache_dir=cache)
    assert e.value.key == "dataset.root"


def test_download_true_fetches_missing_files(tmp_path, cache, monkeypatch):
    calls = []

    def fake_download(name, root, fetch):
        calls.append(name)
        write_mnist(root / "FashionMNIST" / "raw", gz=False)

    monkeypatch.setattr(F, "_download", fake_download)
    assert len(load_dataset("fmnist", tmp_path, download=True, cache_dir=cache).train_y) == 12
    load_dataset("fmnist", tmp_path, download=True, cache_dir=cache)  # present now: no second fetch
    assert calls == ["fmnist"]


def test_download_failure_is_flare_error(tmp_path, cache, monkeypatch):
    class Offline:
        def __init__(self, *a, **k):
            raise RuntimeError("Error downloading: no route to host")

    monkeypatch.setattr(F, "_torchvision_class", lambda name: Offline)
    with pytest.raises(FlareError) as e:
        load_dataset("cifar10", tmp_path, download=True, cache_dir=cache)
    assert e.value.key == "dataset.download" and "no route to host" in e.value.message


def test_idx_truncated_and_bad_gzip(tmp_path, cache):
    write_mnist(tmp_path, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(FlareError, match="train-images-idx3-ubyte.gz") as e:
        load_dataset("fmnist", tmp_path, cache_dir=cache)
    assert e.value.key == "dataset.root"
    write_idx(path, np.zeros((3, 28, 28), np.uint8), gz=True)  # valid file, 3 images for 12 labels
    with pytest.raises(FlareError, match="12 labels"):
        load_dataset("fmnist", tmp_path, cache_dir=cache)


# ----------------------------------------------------------------------------- CIFAR, SVHN


def test_cifar10_pickles(tmp_path, cache):
    xs, ys, names = write_cifar10(tmp_path)
    data = load_dataset("cifar10", tmp_path, cache_dir=cache)
    assert data.train_x.shape == (20, 3, 32, 32) and data.test_x.shape == (4, 3, 32, 32)
    assert data.train_x.dtype == torch.uint8 and data.test_y.dtype == torch.int64
    assert data.classes == names
    # the pickle row holds the R plane, then G, then B, each row-major
    assert torch.equal(data.train_x[5], torch.from_numpy(xs[1][1].reshape(3, 32, 32)))
    assert data.train_y.tolist() == sum(ys[:5], []) and data.test_y.tolist() == ys[5]
    all_x = np.concatenate(xs[:5]).reshape(-1, 3, 32, 32) / 255
    assert data.mean == pytest.approx(tuple(all_x.mean((0, 2, 3))))
    assert data.std == pytest.approx(tuple(all_x.std((0, 2, 3))))


def test_cifar100_pickles(tmp_path, cache):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    r = rng(2)
    for name, n in (("train", 7), ("test", 3)):
        with open(folder / name, "wb") as f:
            pickle.dump({"data": r.integers(0, 256, (n, 3072), dtype=np.uint8),
                         "fine_labels": [99 - i for i in range(n)], "coarse_labels": [0] * n}, f)
    fine = [f"class{i:02d}" for i in range(100)]
    with open(folder / "meta", "wb") as f:
        pickle.dump({"fine_label_names": fine, "coarse_label_names": [f"super{i}" for i in range(20)]}, f)
    data = load_dataset("cifar100", tmp_path, format="torchvision", cache_dir=cache)
    assert data.num_classes == 100 and data.classes == fine
    assert data.train_y.tolist() == [99, 98, 97, 96, 95, 94, 93] and len(data.test_y) == 3


def test_cifar_missing_batch_and_corrupt_pickle(tmp_path, cache):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FlareError, match="data_batch_3") as e:
        load_dataset("cifar10", tmp_path, cache_dir=cache)
    assert e.value.key == "dataset.root" and "dataset.download=true" in e.value.fix
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"\x80\x04garbage")
    with pytest.raises(FlareError, match="data_batch_3") as e:
        load_dataset("cifar10", tmp_path, cache_dir=cache)
    assert e.value.key == "dataset.root"


def test_svhn_mat(tmp_path, cache):
    scipy_io = pytest.importorskip("scipy.io")
    r = rng(3)
    mats = {}
    for split, n in (("train", 5), ("test", 3)):
        X = r.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)  # H×W×C×N, as in the official files
        y = np.array([[10], [1], [2], [10], [9]][:n], dtype=np.uint8)  # digit 0 is stored as 10
        scipy_io.savemat(tmp_path / f"{split}_32x32.mat", {"X": X, "y": y})
        mats[split] = (X, y)
    data = load_dataset("svhn", tmp_path, cache_dir=cache)
    assert data.train_x.shape == (5, 3, 32, 32) and data.test_x.shape == (3, 3, 32, 32)
    X, _ = mats["train"]
    assert data.train_x[4, 2, 7, 19] == X[7, 19, 2, 4]  # [n, c, h, w] <- [h, w, c, n]
    assert data.train_y.tolist() == [0, 1, 2, 0, 9] and data.test_y.tolist() == [0, 1, 2]
    assert data.classes == [str(i) for i in range(10)]


def test_svhn_missing(tmp_path, cache):
    with pytest.raises(FlareError, match="train_32x32.mat") as e:
        load_dataset("svhn", tmp_path, cache_dir=cache)
    assert e.value.key == "dataset.root"


# ----------------------------------------------------------------------------- Tiny-ImageNet


COLORS = {"n01443537": (250, 0, 0), "n02085620": (0, 250, 0), "n09999999": (0, 0, 250)}


def write_tiny(base: Path):
    (base / "wnids.txt").parent.mkdir(parents=True, exist_ok=True)
    (base / "wnids.txt").write_text("n09999999\nn01443537\nn02085620\n")  # not sorted on purpose
    for w, color in COLORS.items():
        for i in range(2):
            p = base / "train" / w / "images" / f"{w}_{i}.JPEG"
            p.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), color).save(p, "JPEG", quality=95)
        (base / "train" / w / f"{w}_boxes.txt").write_text("")
    # the real set has a few grayscale JPEGs among the RGB ones
    Image.new("L", (8, 8), 128).save(base / "train" / "n02085620" / "images" / "n02085620_9.JPEG", "JPEG")
    (base / "val" / "images").mkdir(parents=True)
    lines = []
    for i, w in enumerate(["n02085620", "n09999999", "n01443537", "n02085620"]):
        Image.new("RGB", (8, 8), COLORS[w]).save(base / "val" / "images" / f"val_{i}.JPEG", "JPEG", quality=95)
        lines.append(f"val_{i}.JPEG\t{w}\t0\t0\t7\t7")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    (base / "test" / "images").mkdir(parents=True)  # unlabelled in the official set: never read


@pytest.mark.parametrize("nested", [False, True])
def test_tinyimagenet(tmp_path, cache, nested):
    write_tiny(tmp_path / "tiny-imagenet-200" if nested else tmp_path)
    data = load_dataset("tinyimagenet", tmp_path, cache_dir=cache)
    assert data.classes == sorted(COLORS)
    assert data.train_x.shape == (7, 3, 8, 8) and data.test_x.shape == (4, 3, 8, 8)
    assert data.train_y.tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert data.test_y.tolist() == [1, 2, 0, 1]  # val_annotations.txt order
    gray = data.train_x[4]  # n02085620_9, expanded to RGB
    assert torch.equal(gray[0], gray[1]) and abs(int(gray[0, 4, 4]) - 128) <= 2
    for x, y in zip(data.test_x, data.test_y):
        expected = torch.tensor(COLORS[data.classes[y]], dtype=torch.float32)
        assert torch.allclose(x.float().mean((1, 2)), expected, atol=8)


def test_tinyimagenet_errors(tmp_path, cache):
    with pytest.raises(FlareError, match="wnids.txt") as e:
        load_dataset("tinyimagenet", tmp_path, cache_dir=cache)
    assert e.value.key == "dataset.root" and "tiny-imagenet-200.zip" in e.value.fix
    write_tiny(tmp_path)
    ann = tmp_path / "val" / "val_annotations.txt"
    ann.write_text(ann.read_text() + "val_9.JPEG\tn00000000\t0\t0\t1\t1\n")
    with pytest.raises(FlareError, match="n00000000"):
        load_dataset("tinyimagenet", tmp_path, cache_dir=cache)


# ----------------------------------------------------------------------------- image folders


def check_tree(data, channels=3):
    assert data.classes == CLASSES
    assert data.train_x.shape == (9, channels, 5, 6) and data.test_x.shape == (6, channels, 5, 6)
    assert data.train_x.dtype == torch.uint8 and data.train_y.dtype == torch.int64
    assert data.train_y.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and data.test_y.tolist() == [0, 0, 1, 1, 2, 2]
    expected = torch.tensor([40 * y + i for y in range(3) for i in range(3)], dtype=torch.uint8)
    assert torch.equal(data.train_x[:, :, 2, 3], expected[:, None].expand(-1, channels))
    values = expected.double() / 255
    assert data.mean == pytest.approx((values.mean().item(),) * channels)


def test_imagefolder_dir(tmp_path, cache):
    write_tree(tmp_path / "tree")
    check_tree(load_dataset("imagefolder", tmp_path / "tree", cache_dir=cache))


@pytest.mark.parametrize("suffix, mode, top", [(".tar", "w", None), (".tar.gz", "w:gz", "export"),
                                               (".tgz", "w:gz", None), (".tar", "w", "export")])
def test_imagefolder_archives(tmp_path, cache, suffix, mode, top):
    write_tree(tmp_path / "tree")
    archive = make_tar(tmp_path / "tree", tmp_path / f"data{suffix}", top, mode)
    check_tree(load_dataset("imagefolder", archive, cache_dir=cache))


def test_named_dataset_auto_detects_imagefolder(tmp_path, cache):
    write_tree(tmp_path / "tree")
    archive = make_tar(tmp_path / "tree", tmp_path / "x.tar.gz", None, "w:gz")
    with pytest.raises(FlareError, match="3 classes") as e:  # cifar10 must have 10 classes
        load_dataset("cifar10", archive, cache_dir=cache)
    assert e.value.key == "dataset.root"


def test_imagefolder_gray_and_mixed(tmp_path, cache):
    write_tree(tmp_path / "gray", gray=True)
    check_tree(load_dataset("imagefolder", tmp_path / "gray", cache_dir=cache), channels=1)
    write_tree(tmp_path / "mixed", gray=True)
    write_png(tmp_path / "mixed" / "test" / "ant" / "0.png", solid(0))  # one RGB image -> all RGB
    check_tree(load_dataset("imagefolder", tmp_path / "mixed", cache_dir=cache), channels=3)


def test_imagefolder_size_mismatch(tmp_path, cache):
    write_tree(tmp_path)
    write_png(tmp_path / "test" / "dog" / "1.png", solid(0, size=(7, 5)))
    with pytest.raises(FlareError, match="test/dog/1.png is 7x5") as e:
        load_dataset("imagefolder", tmp_path, cache_dir=cache)
    assert e.value.key == "dataset.root"


@pytest.mark.parametrize("missing", ["train", "test"])
def test_imagefolder_missing_split(tmp_path, cache, missing):
    write_tree(tmp_path / "tree")
    kept = "test" if missing == "train" else "train"
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        tar.add(tmp_path / "tree" / kept, arcname=f"top/{kept}")
    shutil.rmtree(tmp_path / "tree" / missing)
    for root in (tmp_path / "tree", tmp_path / "a.tar"):
        with pytest.raises(FlareError, match=f"no {missing}/ folder") as e:
            load_dataset("imagefolder", root, cache_dir=cache)
        assert e.value.key == "dataset.root"


def test_imagefolder_corrupt_archives(tmp_path, cache):
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(os.urandom(2000))
    with pytest.raises(FlareError, match="bad.tar.gz") as e:
        load_dataset("imagefolder", bad, cache_dir=cache)
    assert e.value.key == "dataset.root"
    write_tree(tmp_path / "tree")
    good = make_tar(tmp_path / "tree", tmp_path / "good.tar.gz", None, "w:gz").read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good[: len(good) // 2])
    with pytest.raises(FlareError, match="cut.tar.gz"):
        load_dataset("imagefolder", cut, cache_dir=cache)


def test_imagefolder_corrupt_image(tmp_path, cache):
    write_tree(tmp_path)
    (tmp_path / "train" / "ant" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (tmp_path / "train" / "cat" / "1.jpg").write_bytes(b"\xff\xd8\xff\xe0broken jpeg")
    with pytest.raises(FlareError, match=r"train/(ant/1.png|cat/1.jpg)") as e:
        load_dataset("imagefolder", tmp_path, cache_dir=cache)
    assert e.value.key == "dataset.root"


def test_imagefolder_jpeg_matches_pillow(tmp_path, cache):
    """JPEGs are decoded by torchvision; the pixels must be what Pillow gives."""
    r = rng(4)
    for split in ("train", "test"):
        arr = r.integers(0, 256, (16, 16, 3), dtype=np.uint8)
        (tmp_path / split / "a").mkdir(parents=True)
        Image.fromarray(arr).save(tmp_path / split / "a" / "0.jpg", quality=75)
    data = load_dataset("imagefolder", tmp_path, cache_dir=cache)
    pil = np.array(Image.open(tmp_path / "train" / "a" / "0.jpg").convert("RGB"))
    assert torch.equal(data.train_x[0], torch.from_numpy(pil).permute(2, 0, 1))


# ----------------------------------------------------------------------------- names, formats, cache


def test_unknown_name_and_formats(tmp_path, cache):
    with pytest.raises(FlareError) as e:
        load_dataset("imagenet", tmp_path, cache_dir=cache)
    assert e.value.key == "dataset.name" and "cifar10" in e.value.fix and "tinyimagenet" in e.value.fix
    with pytest.raises(FlareError) as e:
        load_dataset("cifar10", tmp_path, format="lmdb", cache_dir=cache)
    assert e.value.key == "dataset.format"
    with pytest.raises(FlareError) as e:
        load_dataset("svhn", tmp_path, format="idx", cache_dir=cache)
    assert e.value.key == "dataset.format"
    with pytest.raises(FlareError) as e:
        load_dataset("imagefolder", tmp_path / "nope", cache_dir=cache)
    assert e.value.key == "dataset.root"


def test_list_datasets():
    # the datasets of tests/plugins/ are registered too when an earlier test in this process imported their module
    plugins = {f.stem for f in Path(PLUGINS).glob("*.py")}
    names = {n: d for n, d in DATASETS.describe() if getattr(DATASETS.get(n).build, "__module__", None) not in plugins}
    assert set(names) == {"fmnist", "mnist", "cifar10", "cifar100", "svhn", "tinyimagenet", "imagefolder",
                          "synthetic-cifar10", "synthetic-cifar100", "features"}
    assert all(desc for desc in names.values())


def test_cache_hit_skips_decoding_and_is_keyed_on_contents(tmp_path, cache, monkeypatch):
    write_tree(tmp_path / "tree")
    archive = make_tar(tmp_path / "tree", tmp_path / "t.tar.gz", None, "w:gz")
    first = load_dataset("imagefolder", archive, cache_dir=cache)
    assert [p.suffix for p in cache.iterdir()] == [".pt"]  # atomic write left no temp file

    def boom(*a):
        raise AssertionError("decoded again")

    monkeypatch.setattr(decode, "decode_image", boom)
    monkeypatch.setattr(F, "_tar_entries", boom)
    second = load_dataset("imagefolder", archive, cache_dir=cache)
    for field in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(first, field), getattr(second, field))
    assert (second.classes, second.mean, second.std) == (first.classes, first.mean, first.std)
    os.utime(archive, ns=(1, 1))  # touched or re-mounted, same bytes: still a hit, still one file
    load_dataset("imagefolder", archive, cache_dir=cache)
    assert len(list(cache.iterdir())) == 1
    write_png(tmp_path / "tree" / "train" / "dog" / "extra.png", solid(7))  # changed bytes: a miss
    make_tar(tmp_path / "tree", archive, None, "w:gz")
    with pytest.raises(AssertionError, match="decoded again"):
        load_dataset("imagefolder", archive, cache_dir=cache)


def test_cache_idx_and_env_dir(tmp_path, monkeypatch):
    write_mnist(tmp_path / "fm", gz=True)
    monkeypatch.setenv("FLARE_CACHE", str(tmp_path / "envcache"))
    load_dataset("fmnist", tmp_path / "fm")
    assert len(list((tmp_path / "envcache").glob("fmnist-idx-*.pt"))) == 1
    monkeypatch.setattr(F, "_read_idx", lambda p: pytest.fail("decoded again"))
    assert len(load_dataset("fmnist", tmp_path / "fm").test_y) == 6


def test_unreadable_cache_is_rebuilt(tmp_path, cache):
    write_tree(tmp_path)
    load_dataset("imagefolder", tmp_path, cache_dir=cache)
    (cache_file,) = cache.iterdir()
    cache_file.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="unreadable"):
        check_tree(load_dataset("imagefolder", tmp_path, cache_dir=cache))


# ----------------------------------------------------------------------------- stratified_subset


def test_stratified_subset_proportions_and_seed():
    shuffle = torch.randperm(1000, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0] * 600 + [1] * 300 + [2] * 100)[shuffle]
    idx = stratified_subset(y, 100, seed=1)
    assert idx.dtype == torch.int64 and len(idx) == 100 and len(set(idx.tolist())) == 100
    assert torch.equal(idx, torch.sort(idx).values)
    assert torch.bincount(y[idx]).tolist() == [60, 30, 10]
    assert torch.equal(idx, stratified_subset(y, 100, seed=1))
    assert not torch.equal(idx, stratified_subset(y, 100, seed=2))


def test_stratified_subset_rounding_and_edges():
    y = torch.arange(30) % 3  # three classes of 10: 10 * 1/3 rounds to 3 each, one more goes to class 0
    idx = stratified_subset(y, 10, seed=0)
    assert len(idx) == 10 and torch.bincount(y[idx]).tolist() == [4, 3, 3]
    y = torch.tensor([0] * 5 + [1] * 5 + [2] * 5 + [3] * 5)  # 4 * round(2.5) = 12 > 10: trimmed
    assert len(stratified_subset(y, 10, seed=0)) == 10
    assert torch.equal(stratified_subset(y, None, seed=0), torch.arange(20))
    assert torch.equal(stratified_subset(y, 50, seed=0), torch.arange(20))
    assert len(stratified_subset(y, 0, seed=0)) == 0


# ----------------------------------------------------------------------------- real data (skipped if absent)


@pytest.mark.skipif(not all((F.DEBIAN_FMNIST / f"{s}.gz").exists() for s in F._IDX_FILES),
                    reason="dataset-fashion-mnist is not installed")
def test_real_debian_fashion_mnist(cache):
    data = load_dataset("fmnist", None, cache_dir=cache)
    assert data.train_x.shape == (60000, 1, 28, 28) and data.test_x.shape == (10000, 1, 28, 28)
    assert torch.bincount(data.train_y).tolist() == [6000] * 10
    assert data.mean == pytest.approx((0.2860,), abs=1e-3) and data.std == pytest.approx((0.3530,), abs=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(not CIFAR_TAR.exists(), reason=f"{CIFAR_TAR} is absent")
def test_real_cifar10_jpeg_tar(cache):
    data = load_dataset("cifar10", CIFAR_TAR, format="imagefolder", cache_dir=cache)
    assert data.train_x.shape == (50000, 3, 32, 32) and data.test_x.shape == (10000, 3, 32, 32)
    assert data.classes == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    assert torch.bincount(data.test_y).tolist() == [1000] * 10
    test_mean = (data.test_x.double() / 255).mean((0, 2, 3))
    assert test_mean.tolist() == pytest.approx([0.494, 0.485, 0.450], abs=5e-3)


def test_synthetic_dataset_shapes_and_determinism():
    a = D.load_dataset("synthetic-cifar100", None)
    b = D.load_dataset("synthetic-cifar100", None)
    assert a.train_x.shape == (50_000, 3, 32, 32) and a.test_x.shape == (10_000, 3, 32, 32)
    assert a.train_x.dtype == torch.uint8 and a.num_classes == 100
    assert torch.equal(a.train_x[:100], b.train_x[:100]) and torch.equal(a.test_y, b.test_y)
