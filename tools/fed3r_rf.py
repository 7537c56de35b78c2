"""Fed3R-RF's kernel width σ and ridge λ, chosen on the held-out slice of the training features (never the test set).

Fed3R with random features (closed_form.py, `server.strategies.fed3r.random_features`) is ridge regression on
φ(x) = √(2/D) cos(xΩ + β), Ω ~ N(0, σ⁻²): a Gaussian-kernel head from one upload per client (the counts, the class
sums of φ and Σ φφᵀ), and the only closed-form head here that is not linear in the features. Its paper publishes no
σ for these features, so the σ is a choice, made the way tools/frozen_bounds.py makes its bounds' choices: on the
same held-out stratified slice of the training set (5,000 images, fixed seed), each (σ, λ) fitted on the rest with
FLARE's own `ridge` and random map and scored on the slice, the best one recorded. σ is searched in multiples of the
median pairwise distance between training features (a fixed subsample of the fitted part: a rule read off the
features, not the labels), λ in decades; a choice at a grid's end grows that grid one step (`extend_at_edge`, at most
three times). D is fixed (`--features`): the server holds each client's D × D second moment until it sums them, so D
is a memory decision (4,096: 134 MB a client), not a tuned one.

    python tools/fed3r_rf.py                       # Lite0 224 px bilinear, all stages stored: the grid's cache

One JSON record under results/frozen-encoder-224/choices/: every candidate's held-out accuracy, the choice, the
median distance, D, the random map's seed, the wall seconds. It never reads the test features. The one-shot run with
the chosen options is an ordinary `flare run` (its command in docs/frozen-encoder.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tools"))

import frozen_bounds as fb  # noqa: E402
from flare.baselines.closed_form import RF_TAG, RandomFeatureLinear, ridge  # noqa: E402
from flare.errors import FlareError  # noqa: E402
from flare.rng import derived_seed  # noqa: E402

OUT = ROOT / "results" / "frozen-encoder-224" / "choices"
SIGMA_MULTIPLES = [0.5, 1.0, 2.0, 4.0]
RIDGES = [1e-4, 1e-3, 1e-2, 1e-1, 1.0]
MEDIAN_SAMPLE = 2000  # features whose pairwise distances give the median (1,000 × 1,000 pairs)


def random_map(d: int, n: int, sigma: float, seed: int) -> RandomFeatureLinear:
    """The run's random map as Fed3R draws it for run seed `seed` (closed_form.Fed3R.random_map)."""
    gen = torch.Generator().manual_seed(derived_seed(seed, 0, RF_TAG))
    omega = torch.randn(d, n, generator=gen, dtype=torch.float64) / sigma
    beta = torch.rand(n, generator=gen, dtype=torch.float64) * 2 * torch.pi
    return RandomFeatureLinear(omega, beta, torch.zeros(1, n), torch.zeros(1))


def statistics(phi: torch.Tensor, y: torch.Tensor, classes: int) -> tuple[torch.Tensor, ...]:
    """Fed3R-RF's upload of these samples: counts, class sums of φ, Σ φφᵀ (1 × D × D)."""
    counts = torch.bincount(y, minlength=classes).double()
    sums = torch.zeros(classes, phi.shape[1], dtype=phi.dtype).index_add_(0, y, phi)
    return counts, sums, (phi.T @ phi)[None]


def features(rf: RandomFeatureLinear, x: torch.Tensor, chunk: int = 5000) -> torch.Tensor:
    return torch.cat([rf.features(x[i:i + chunk]) for i in range(0, len(x), chunk)])


def median_distance(x: torch.Tensor, seed: int = 0) -> float:
    pick = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:MEDIAN_SAMPLE]
    half = len(pick) // 2
    return float(torch.cdist(x[pick[:half]], x[pick[half:]]).median())


def choose(x: torch.Tensor, y: torch.Tensor, held_size: int, n_features: int, seed: int, classes: int = 10,
           sigmas=SIGMA_MULTIPLES, ridges=RIDGES, log=print) -> dict:
    """Every (σ multiple, λ) scored on the held-out slice; either grid grown at its end by the edge rule."""
    fit, held = (torch.as_tensor(i) for i in fb.holdout_split(y.numpy(), held_size))
    med = median_distance(x[fit])
    sigmas, ridges, scores = list(sigmas), list(ridges), {}

    def score_sigma(m):
        t0 = time.perf_counter()
        rf = random_map(x.shape[1], n_features, med * m, seed)
        stats = statistics(features(rf, x[fit]), y[fit], classes)
        ph = features(rf, x[held])
        for lam in ridges:
            if (m, lam) not in scores:
                w, b = ridge(*stats, lam)
                scores[m, lam] = float(((ph @ w.T + b).argmax(1) == y[held]).double().mean())
                log(f"  σ = {m} × median, λ = {lam}: held-out {100 * scores[m, lam]:.2f} % "
                    f"({time.perf_counter() - t0:.0f} s)")

    for m in sigmas:
        score_sigma(m)
    for _ in range(2 * fb.EDGE_STEPS):
        best = max(scores, key=lambda k: (scores[k], -sigmas.index(k[0]), -ridges.index(k[1])))
        grow_s = fb.extend_at_edge(sigmas, sigmas.index(best[0]))
        grow_l = fb.extend_at_edge(ridges, ridges.index(best[1]))
        if grow_s is None and grow_l is None:
            break
        if grow_l is not None and len(ridges) < len(RIDGES) + fb.EDGE_STEPS:
            ridges.append(grow_l)
            for m in sigmas:  # the new λ at every σ already tried
                score_sigma(m)
        if grow_s is not None and len(sigmas) < len(SIGMA_MULTIPLES) + fb.EDGE_STEPS:
            sigmas.append(grow_s)
            score_sigma(grow_s)
        elif grow_l is None or len(ridges) >= len(RIDGES) + fb.EDGE_STEPS:
            break
    best = max(scores, key=lambda k: (scores[k], -sigmas.index(k[0]), -ridges.index(k[1])))
    return {"median_distance": med, "sigma_multiple": best[0], "kernel_width": med * best[0], "ridge": best[1],
            "holdout_acc": scores[best], "random_features": n_features, "seed": seed,
            "candidates": [{"sigma_multiple": m, "ridge": lam, "holdout_acc": a} for (m, lam), a in scores.items()],
            "at_edge": fb.extend_at_edge(sigmas, sigmas.index(best[0])) is not None
            or fb.extend_at_edge(ridges, ridges.index(best[1])) is not None,
            "train_images": int(len(fit)), "holdout_images": int(len(held)), "holdout_seed": fb.HOLDOUT_SEED}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", default="efficientnet_lite0")
    ap.add_argument("--resolution", type=int, default=None)
    ap.add_argument("--resize", default="bilinear", choices=["bicubic", "bilinear"])
    ap.add_argument("--stages", type=int, default=8, help="the grid's layer choice (configs/frozen-encoder-224.yaml)")
    ap.add_argument("--features", type=int, default=4096, help="D, the random features")
    ap.add_argument("--seed", type=int, default=1, help="the run seed whose random map is used (the grid's first)")
    ap.add_argument("--holdout", type=int, default=5000)
    ap.add_argument("--cache-dir", default=os.environ.get("FLARE_CACHE", "/work/cache/features"))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    try:
        if not 1 <= args.stages <= 8:
            raise FlareError(f"--stages {args.stages} out of range.", key="--stages", fix="use 1 to 8.")
        if not 64 <= args.features <= 16384:
            raise FlareError(f"--features {args.features} out of range.", key="--features",
                             fix="use 64 to 16,384 (the server holds a D × D float64 matrix per client).")
        if not 10 <= args.holdout <= 25000:
            raise FlareError(f"--holdout {args.holdout} out of range.", key="--holdout", fix="use 10 to 25,000.")
        opts, data, path = fb.load_cached(fb.feature_options(args.encoder, args.resolution, args.resize,
                                                             args.cache_dir))
    except FlareError as e:
        print(f"fed3r_rf: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    d = int(sum(fb.data_widths(data, path)[:args.stages]))
    x, y = data.train_x[:, 0, :d].double().contiguous(), data.train_y
    name = f"fed3r-rf-{fb.cache_dir_name(opts)}-stages{args.stages}-D{args.features}-seed{args.seed}.json"
    print(f"{name}: d = {d}", flush=True)
    t0 = time.perf_counter()
    rec = choose(x, y, args.holdout, args.features, args.seed, log=lambda s: print(s, flush=True))
    rec.update({"encoder": opts.encoder, "resolution": opts.resolution, "resize": opts.resize, "stages": args.stages,
                "dim": d, "cache": path.name, "wall_seconds": time.perf_counter() - t0, "torch": torch.__version__})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(rec, indent=1) + "\n")
    print(f"-> σ = {rec['sigma_multiple']} × {rec['median_distance']:.2f} = {rec['kernel_width']:.3f}, λ = "
          f"{rec['ridge']}: held-out {100 * rec['holdout_acc']:.2f} %", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
