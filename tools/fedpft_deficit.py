"""Where FedPFT's deficit against the Gaussian heads comes from, measured (docs/frozen-encoder.md).

FedPFT (the Flower baseline) has each client fit a Gaussian mixture to each class's frozen features (2 spherical
components, tol 1e-12, max_iter 10000), send it in float16, and the server train a linear head on samples drawn from
the mixtures (AdamW, lr 1e-4, batch 32, one epoch). Against the closed-form heads it loses points; the candidates are
the mixture (spherical variances keep one number per component where LDA keeps a full covariance; two components;
the EM tolerance the grid loosens) and the head's training recipe (one epoch at lr 1e-4). Each variant below changes
one of them, on one subset of the training features, and every variant's head is scored on all 10,000 test features:

* `real`: the head trained on the subset's real features (no mixture): the recipe's own ceiling;
* the mixture variants: covariance type (spherical, diag, full), components, EM tolerance;
* each with the baseline's one epoch and with ten (the recipe's share of the loss);
* scikit-learn's LinearDiscriminantAnalysis on the same subset: the Gaussian head the closed-form strategies build.

The pipeline is the baseline's, written out with scikit-learn and torch (FLARE's `fedpft` offers spherical and
diagonal mixtures only): GaussianMixture(random_state=0) per class, parameters rounded through float16, `sample`
as many features as the class holds, Linear(d, C) under AdamW (weight decay 0.01, torch's default) on shuffled
batches of 32 with plain cross-entropy, from a seeded generator. One record per variant under `--out`; a finished
variant is skipped.

    python tools/fedpft_deficit.py                # Lite0 224 px, the grid's `stages`, 1,000 images a class
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

OUT = ROOT / "results" / "frozen-encoder-224" / "fedpft-deficit"
SEED = 0
# name → (covariance type, components, tol, max_iter); None: no mixture (the real features)
VARIANTS = {
    "real": None,
    "spherical-2-tol1e-3": ("spherical", 2, 1e-3, 100),      # the grid's
    "spherical-2-tol1e-12": ("spherical", 2, 1e-12, 10000),  # the baseline's default
    "spherical-8-tol1e-3": ("spherical", 8, 1e-3, 100),
    "diag-2-tol1e-3": ("diag", 2, 1e-3, 100),
    "full-1-tol1e-3": ("full", 1, 1e-3, 100),
    "full-2-tol1e-3": ("full", 2, 1e-3, 100),
}
EPOCHS = (1, 10)


def subset(y: np.ndarray, per_class: int) -> np.ndarray:
    rng = np.random.default_rng(SEED)
    return np.sort(np.concatenate([rng.choice(np.flatnonzero(y == c), per_class, replace=False)
                                   for c in np.unique(y)]))


def synthetic(x: np.ndarray, y: np.ndarray, cov: str, m: int, tol: float, max_iter: int) -> tuple:
    """The baseline's client and server: a mixture per class, float16 on the wire, `count` samples back."""
    from sklearn.mixture import GaussianMixture
    xs, ys, iters = [], [], []
    for c in np.unique(y):
        rows = x[y == c]
        g = GaussianMixture(n_components=m, covariance_type=cov, random_state=SEED, tol=tol, max_iter=max_iter).fit(rows)
        iters.append(int(g.n_iter_))
        s = GaussianMixture(n_components=m, covariance_type=cov, random_state=SEED)
        s.means_ = g.means_.astype(np.float16).astype(np.float32)
        s.weights_ = g.weights_.astype(np.float16).astype(np.float32)
        s.covariances_ = g.covariances_.astype(np.float16).astype(np.float32)
        if cov == "full":  # float16 rounding can break symmetry; sampling takes the symmetric part
            s.covariances_ = (s.covariances_ + s.covariances_.transpose(0, 2, 1)) / 2
        z, _ = s.sample(len(rows))
        xs.append(z.astype(np.float32))
        ys.append(np.full(len(rows), c, np.int64))
    return np.concatenate(xs), np.concatenate(ys), iters


def train_head(x: np.ndarray, y: np.ndarray, classes: int, epochs: int) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(SEED)
    head = torch.nn.Linear(x.shape[1], classes)
    with torch.no_grad():
        bound = 1 / x.shape[1] ** 0.5
        for p in (head.weight, head.bias):
            p.uniform_(-bound, bound, generator=gen)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4, weight_decay=0.01)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(epochs):
        perm = torch.randperm(len(yt), generator=gen)
        for s in range(0, len(yt), 32):
            ix = perm[s:s + 32]
            loss = torch.nn.functional.cross_entropy(head(xt[ix]), yt[ix])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return head


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-class", type=int, default=1000)
    ap.add_argument("--stages", type=int, default=None, help="default: configs/frozen-encoder-224.yaml's")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from flare.config import load_config
    from flare.data.features import FeatureOptions, load_features
    from flare.errors import FlareError
    sys.path.insert(0, str(ROOT / "tools"))
    import frozen_bounds as fb
    cfg = load_config(ROOT / "configs" / "frozen-encoder-224.yaml").dataset.options
    stages = args.stages or cfg["stages"]
    try:
        unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
        if unknown:
            raise FlareError(f"unknown variant(s) {unknown}.", key="--variants", fix=f"choose among {', '.join(VARIANTS)}.")
        opts, _, path = fb.load_cached(fb.feature_options(cfg["encoder"], cfg["resolution"], cfg["resize"],
                                                          os.environ.get("FLARE_CACHE", "/work/cache/features")))
    except FlareError as e:
        print(f"fedpft_deficit: {e}", file=sys.stderr)
        return 2
    data = load_features(opts.model_copy(update={"stages": stages}), quiet=True)
    x, y = data.train_x[:, 0].numpy(), data.train_y.numpy()
    ix = subset(y, args.per_class)
    x, y = x[ix], y[ix]
    xt, yt = data.test_x[:, 0].numpy(), data.test_y.numpy()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    common = {"encoder": opts.encoder, "resolution": opts.resolution, "resize": opts.resize, "stages": stages,
              "dim": int(x.shape[1]), "per_class": args.per_class, "subset_seed": SEED, "test_images": int(len(yt)),
              "threads": torch.get_num_threads()}
    f = out / "lda.json"
    if not f.exists():
        import sklearn
        from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
        t0 = time.perf_counter()
        acc = float(LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto").fit(x, y).score(xt, yt))
        f.write_text(json.dumps({**common, "variant": "lda", "test_acc": acc, "sklearn": sklearn.__version__,
                                 "seconds": time.perf_counter() - t0}, indent=1) + "\n")
        print(f"lda (Ledoit-Wolf) on the subset: {100 * acc:.2f} %", flush=True)
    for name in args.variants.split(","):
        f = out / f"{name}.json"
        if f.exists():
            continue
        t0 = time.perf_counter()
        spec = VARIANTS[name]
        if spec is None:
            xs, ys, iters = x.astype(np.float32), y, []
        else:
            xs, ys, iters = synthetic(x.astype(np.float64), y, *spec)
        fit_s = time.perf_counter() - t0
        accs = {}
        for e in EPOCHS:
            head = train_head(xs, ys, 10, e)
            with torch.no_grad():
                accs[str(e)] = float((head(torch.from_numpy(xt)).argmax(1).numpy() == yt).mean())
        rec = {**common, "variant": name, "mixture": None if spec is None else
               dict(zip(("covariance_type", "components", "tol", "max_iter"), spec)),
               "em_iterations_per_class": iters, "test_acc_by_epochs": accs, "mixture_seconds": fit_s,
               "seconds": time.perf_counter() - t0}
        f.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"{name}: " + ", ".join(f"{e} epoch(s) {100 * a:.2f} %" for e, a in accs.items())
              + f" (mixtures {fit_s:.0f} s, EM iterations {iters})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
