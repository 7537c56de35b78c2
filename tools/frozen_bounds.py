"""Independent centralised bounds on a frozen encoder's cached CIFAR-10 features (docs/frozen-encoder.md).

scikit-learn's LinearDiscriminantAnalysis (shrinkage), QuadraticDiscriminantAnalysis (reg_param), GaussianNB
(var_smoothing), RidgeClassifier (alpha) and LogisticRegression (C, on standardised features), each fitted on all
50,000 training features and scored on the 10,000 test features, for every layer choice (`stages`) asked for. They
are what a one-shot head over the same features can be compared with without trusting FLARE's own strategies (a
one-client FedCGS run checks FLARE against itself, not against anyone else).

Nothing is chosen on the test set: every hyper-parameter is chosen on a held-out stratified slice of the *training*
set (`--holdout` images, fixed seed) — each candidate fitted on the rest and scored on the slice, the best (the first
on a tie) refitted on all 50,000 and scored once on the test set. The slice accuracies are what `--choose` reads to
pick the grid's feature option.

    python tools/frozen_bounds.py                                    # Lite0, 224 px, bilinear: every cell missing
                                                                     # (LDA on stages 1-8; the rest on 4, 8, 1)
    python tools/frozen_bounds.py --encoder efficientnet_lite2       # the same cells on Lite2's own 260 px cache
    python tools/frozen_bounds.py --choose                           # the stages value the held-out slice picks
    python tools/frozen_bounds.py --flip --stages 8 --other-stages 8 # the mirror images as training copies too

One JSON record per (cache, stages, head) under `--out/<encoder>-<res>px-<resize>/`: the candidates' slice
accuracies and fit seconds, the chosen value, its test accuracy, the iterations LogisticRegression ran and whether
it converged, the wall seconds and scikit-learn's version. With `--flip` (the cache's mirrored copy, `flip: true`)
every training image is fitted twice, as itself and mirrored, the held-out slice holds out both copies of its images
and scores the plain ones, and the test score is the plain test images' (the record adds the score that averages
each test image's decision over it and its mirror, `test_acc_tta`); its records go to `<cache>-flip/`. A finished
cell is skipped (resumable). A choice at the end of its numeric candidates grows the grid one decade that way (at
most three times, and upwards no further than the parameter's limit, `TOPS`; `extend_at_edge`), a rule fixed before
any score is read; older records chosen at an edge are completed the same way. The cache must exist: this script
never starts an extraction (exit 2 naming the file it looked for).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from flare.errors import FlareError  # noqa: E402

OUT = ROOT / "results" / "frozen-encoder-224" / "bounds"
DATA = dict(source="cifar10", root="/work/shared/data/cifar10-jpg.tar.gz", format="imagefolder", views=0,
            batch_size=128)
HOLDOUT_SEED = 0
LOGREG_MAX_ITER = 300  # lbfgs on standardised features; the record says whether it converged within this

# head → (the hyper-parameter, its candidates, the estimator for a value). Candidates span the usual decades; the
# slice, not the test set, picks among them.
def _heads():
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis, QuadraticDiscriminantAnalysis
    from sklearn.linear_model import LogisticRegression, RidgeClassifier
    from sklearn.naive_bayes import GaussianNB
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    return {
        "lda": ("shrinkage", ["auto", 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5],
                lambda v: LinearDiscriminantAnalysis(solver="lsqr", shrinkage=v)),
        "ridge": ("alpha", [1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4], lambda v: RidgeClassifier(alpha=v)),
        "gnb": ("var_smoothing", [1e-9, 1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0], lambda v: GaussianNB(var_smoothing=v)),
        "qda": ("reg_param", [1e-3, 1e-2, 0.1, 0.5], lambda v: QuadraticDiscriminantAnalysis(reg_param=v)),
        "logreg": ("C", [0.01, 0.1, 1.0],
                   lambda v: make_pipeline(StandardScaler(), LogisticRegression(C=v, max_iter=LOGREG_MAX_ITER))),
    }


HEADS = ("lda", "ridge", "gnb", "qda", "logreg")
CHEAP = ("lda", "ridge", "gnb")  # a few minutes a cell on a busy 2-core machine; QDA and logistic regression more


def refuse(message: str, fix: str) -> FlareError:
    return FlareError(message, key="--encoder", fix=fix)


def feature_options(encoder: str, resolution: int | None, resize: str, cache_dir: str, flip: bool = False):
    from flare.data.features import FeatureOptions
    return FeatureOptions(**DATA, encoder=encoder, resolution=resolution, resize=resize, stages=8, cache_dir=cache_dir,
                          flip=flip)


def load_cached(opts):
    """The features of `opts` from its existing cache file; refused (never extracted) when there is none."""
    from flare.data.datasets import _cache_dir, load_dataset
    from flare.data.features import _encoder_entry, cache_key, cache_path, load_features
    enc = _encoder_entry(opts.encoder).obj
    opts = opts.model_copy(update={"resolution": opts.resolution or enc.native_resolution(key="--encoder")})
    where = Path(opts.cache_dir or os.environ.get("FLARE_CACHE") or Path.home() / ".cache" / "flare").expanduser()
    stem = f"features-{opts.source}-{opts.encoder}-{opts.resolution}px-0v-{opts.resize}"
    for kind, pattern in [("", f"{stem}-[0-9a-f]*.pt")] + [(" mirrored", f"{stem}-flip-[0-9a-f]*.pt")] * opts.flip:
        if not any(where.glob(pattern)):
            raise refuse(f"no{kind} feature cache of {opts.encoder} at {opts.resolution} px ({opts.resize}) in {where}. "
                         "This script reads caches, it never extracts one.",
                         fix="build the cache first (docs/frozen-encoder.md, chunked extraction), or pass the "
                             "--encoder, --resolution, --resize (and --flip) of a cache that exists.")
    images = load_dataset(opts.source, opts.root, format=opts.format, cache_dir=opts.cache_dir)
    path = cache_path(_cache_dir(opts.cache_dir), cache_key(opts, images, enc.weights_sha256(key="--encoder")))
    if not path.exists():
        raise refuse(f"no finished feature cache of {opts.encoder} at {opts.resolution} px ({opts.resize}, all stages) "
                     f"in {opts.cache_dir}: looked for {path.name}. This script reads caches, it never extracts one.",
                     fix="build the cache first (docs/frozen-encoder.md, chunked extraction), or pass the --encoder, "
                         "--resolution and --resize of a cache that exists.")
    return opts, load_features(opts, quiet=True), path


def holdout_split(y: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import StratifiedShuffleSplit
    fit, held = next(StratifiedShuffleSplit(n_splits=1, test_size=size, random_state=HOLDOUT_SEED).split(y, y))
    return fit, held


EDGE_STEPS = 3  # at most this many decades added beyond a grid's end (the edge rule in `run_cell`)
# The largest value a head's hyper-parameter can take: LDA's shrinkage and QDA's reg_param are mixing fractions in
# [0, 1] (scikit-learn refuses more), so their grids grow up to 1 and no further.
TOPS = {"lda": 1.0, "qda": 1.0}


def extend_at_edge(values: list, best: int, top: float = math.inf) -> object | None:
    """The candidate one decade beyond the grid's end when the slice's choice sits at that end, else None.

    The rule is fixed before any score is read: a hyper-parameter chosen at the first or last of its numeric
    candidates says the slice would have liked a value outside them, so the grid grows by a factor of 10 that way
    (at most `EDGE_STEPS` times) until the choice is inside. Upwards it stops at `top`, the parameter's own limit
    (`TOPS`): a decade past 0.5 is 1, and a choice at the limit is final. Non-numeric candidates (LDA's "auto")
    never extend."""
    numeric = [v for v in values if isinstance(v, (int, float))]
    if len(numeric) < 2 or not isinstance(values[best], (int, float)):
        return None
    lo, hi = min(numeric), max(numeric)
    if values[best] == lo:
        return lo / 10
    if values[best] == hi:
        return None if hi >= top else min(hi * 10, top)
    return None


def run_cell(head: str, x: np.ndarray, y: np.ndarray, xt: np.ndarray, yt: np.ndarray, holdout: int,
             done: list[dict] | None = None, xt_flip: np.ndarray | None = None) -> dict:
    """Choose `head`'s hyper-parameter on the held-out slice, refit on all training features, score once on test.

    `done`: candidates of an earlier record of the same cell, reused rather than refitted (the fits are
    deterministic on the same features and slice), so a grown candidate list costs only its new values.
    `xt_flip`: the test images' mirrored features; then `x` holds every training image twice (plain, then mirrored:
    rows i and i + N are one image), the slice holds out both copies of its images and scores the plain ones."""
    import sklearn
    from sklearn.exceptions import ConvergenceWarning
    import warnings
    param, values, make = _heads()[head]
    values, top = list(values), TOPS.get(head, math.inf)
    if xt_flip is None:
        fit, held = holdout_split(y, holdout)
    else:  # the slice is drawn over images, as without mirrors; both copies of a held-out image stay out
        n = len(y) // 2
        fit, held = holdout_split(y[:n], holdout)
        fit = np.concatenate([fit, fit + n])
    t_all = time.perf_counter()
    reuse = {repr(c["value"]): c for c in done or []}
    cands: list[dict] = []
    extended = 0

    def score(v):
        if repr(v) in reuse:
            cands.append(reuse[repr(v)])
            return
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=ConvergenceWarning)
            warnings.simplefilter("ignore", category=UserWarning)  # QDA's "variables are collinear" at small reg
            clf = make(v).fit(x[fit], y[fit])
        cands.append({"value": v, "holdout_acc": float(clf.score(x[held], y[held])),
                      "fit_seconds": time.perf_counter() - t0, **_iters(clf)})
        print(f"  {head} {param}={v}: held-out {100 * cands[-1]['holdout_acc']:.2f} % "
              f"({cands[-1]['fit_seconds']:.0f} s)", flush=True)

    for v in values:
        score(v)
    while True:
        best = max(range(len(cands)), key=lambda i: (cands[i]["holdout_acc"], -i))
        grow = extend_at_edge(values, best, top) if extended < EDGE_STEPS else None
        if grow is None:
            break
        values.append(grow)
        extended += 1
        score(grow)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=ConvergenceWarning)
        warnings.simplefilter("ignore", category=UserWarning)
        clf = make(values[best]).fit(x, y)
    fit_s = time.perf_counter() - t0
    return {"head": head, "estimator": type(clf.steps[-1][1] if hasattr(clf, "steps") else clf).__name__,
            "param": param, "chosen": values[best], "holdout_acc": cands[best]["holdout_acc"],
            "test_acc": float(clf.score(xt, yt)), **_tta(clf, xt, xt_flip, yt),
            "candidates": cands, "extended_at_edge": extended,
            "at_edge": extend_at_edge(values, best, top) is not None, "final_fit_seconds": fit_s, **_iters(clf),
            "train_images": int(len(y)), "test_images": int(len(yt)), "holdout_images": int(holdout),
            "holdout_seed": HOLDOUT_SEED, "dim": int(x.shape[1]), "dtype": str(x.dtype),
            "wall_seconds": time.perf_counter() - t_all, "sklearn": sklearn.__version__,
            "threads": _threads()}


def _tta(clf, xt: np.ndarray, xt_flip: np.ndarray | None, yt: np.ndarray) -> dict:
    """The test accuracy of each image's decision averaged over it and its mirror (probabilities where the
    estimator has them, else its decision function); nothing without mirrors."""
    if xt_flip is None:
        return {}
    score = clf.predict_proba if hasattr(clf, "predict_proba") else clf.decision_function
    avg = (score(xt) + score(xt_flip)) / 2
    return {"test_acc_tta": float((clf.classes_[avg.argmax(1)] == yt).mean())}


def _iters(clf) -> dict:
    est = clf.steps[-1][1] if hasattr(clf, "steps") else clf
    if getattr(est, "n_iter_", None) is None or not hasattr(est, "max_iter"):
        return {}
    n = int(np.max(est.n_iter_))
    return {"n_iter": n, "max_iter": int(est.max_iter), "converged": n < int(est.max_iter)}


def _threads() -> int:
    from threadpoolctl import threadpool_info
    return max((i.get("num_threads", 1) for i in threadpool_info()), default=1)


def cache_dir_name(opts) -> str:
    return f"{opts.encoder}-{opts.resolution}px-{opts.resize}" + "-flip" * bool(opts.flip)


def choose(out: Path, stages: list[int], head: str = "lda") -> tuple[int, dict]:
    """The stages value whose `head` scored best on the held-out training slice (test accuracies not read)."""
    held = {}
    for s in stages:
        f = out / f"stages{s}-{head}.json"
        if f.exists():
            held[s] = json.loads(f.read_text())["holdout_acc"]
    if not held:
        raise FlareError(f"no finished {head} bounds under {out}.", key="--choose", fix="run the bounds first.")
    return max(held, key=lambda s: (held[s], -s)), held


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", default="efficientnet_lite0")
    ap.add_argument("--resolution", type=int, default=None, help="null: the encoder's own (224 / 240 / 260)")
    ap.add_argument("--resize", default="bilinear", choices=["bicubic", "bilinear"])
    ap.add_argument("--stages", default="1,2,3,4,5,6,7,8", help="layer choices, comma-separated (1: penultimate)")
    ap.add_argument("--heads", default=",".join(HEADS))
    ap.add_argument("--other-stages", default="4,8,1", help="the stages the heads other than LDA run on (LDA, which "
                                                            "picks the grid's option, runs on every --stages value)")
    ap.add_argument("--holdout", type=int, default=5000)
    ap.add_argument("--flip", action="store_true", help="fit on every training image and its mirror image too (the "
                                                        "cache's flip: true copy)")
    ap.add_argument("--cache-dir", default=os.environ.get("FLARE_CACHE", "/work/cache/features"))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--choose", action="store_true", help="print the stages value the held-out LDA picks, run nothing")
    args = ap.parse_args(argv)
    try:
        stages = [int(s) for s in args.stages.split(",")]
        other = [int(s) for s in args.other_stages.split(",")]
        heads = args.heads.split(",")
        if bad := [h for h in heads if h not in HEADS]:
            raise FlareError(f"unknown head(s) {bad}.", key="--heads", fix=f"choose among {', '.join(HEADS)}.")
        if bad := [s for s in stages + other if not 1 <= s <= 8]:
            raise FlareError(f"stages {bad} out of range.", key="--stages", fix="use 1 to 8.")
        if not 10 <= args.holdout <= 25000:
            raise FlareError(f"--holdout {args.holdout} out of range.", key="--holdout", fix="use 10 to 25,000.")
        opts = feature_options(args.encoder, args.resolution, args.resize, args.cache_dir, args.flip)
        if args.choose:
            from flare.data.features import _encoder_entry
            res = args.resolution or _encoder_entry(args.encoder).obj.native_resolution(key="--encoder")
            out = Path(args.out) / cache_dir_name(opts.model_copy(update={"resolution": res}))
            best, held = choose(out, stages)
            print(json.dumps({"stages": best, "holdout_lda": held}))
            return 0
        opts, data, path = load_cached(opts)
    except FlareError as e:
        print(f"frozen_bounds: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) / cache_dir_name(opts)
    x_all = data.train_x[:, 0].double().numpy()
    xt_all = data.test_x[:, 0].double().numpy()
    y, yt = data.train_y.numpy(), data.test_y.numpy()
    xtf_all = None
    if opts.flip:  # copy 1 is the mirror image (flare.data.features): rows N.. of the training set
        x_all = np.concatenate([x_all, data.train_x[:, 1].double().numpy()])
        y = np.concatenate([y, y])
        xtf_all = data.test_flip[:, 0].double().numpy()
    # LDA on every layer choice first (the held-out choice of the grid's option reads it), then the others, the
    # cheap ones first, on the layer choices most likely to matter
    cells = [(s, "lda") for s in stages if "lda" in heads] + \
            [(s, h) for h in CHEAP if h != "lda" and h in heads for s in other] + \
            [(s, h) for s in other for h in heads if h not in CHEAP]
    for s, h in cells:
        f = out / f"stages{s}-{h}.json"
        earlier = json.loads(f.read_text()) if f.exists() else None
        if earlier is not None and not stale(earlier):
            continue
        d = int(sum(data_widths(data, path)[:s]))
        print(f"{cache_dir_name(opts)} stages={s} (d={d}) {h}", flush=True)
        rec = run_cell(h, np.ascontiguousarray(x_all[:, :d]), y, np.ascontiguousarray(xt_all[:, :d]), yt,
                       args.holdout, done=earlier["candidates"] if earlier else None,
                       xt_flip=None if xtf_all is None else np.ascontiguousarray(xtf_all[:, :d]))
        rec.update({"encoder": opts.encoder, "resolution": opts.resolution, "resize": opts.resize, "stages": s,
                    "cache": path.name, "flip": bool(opts.flip)})
        out.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1) + "\n")
        tmp.replace(f)
        print(f"  -> chosen {rec['param']}={rec['chosen']}: held-out {100 * rec['holdout_acc']:.2f} %, "
              f"test {100 * rec['test_acc']:.2f} % ({rec['wall_seconds']:.0f} s)", flush=True)
    return 0


def stale(record: dict) -> bool:
    """A finished record to redo: one written before the edge rule whose choice sat at its grid's end (its
    finished candidates are reused), or one whose head's candidates have grown since."""
    head = record["head"]
    values = [c["value"] for c in record["candidates"]]
    if "extended_at_edge" not in record:
        best = values.index(record["chosen"])
        if extend_at_edge(values, best, TOPS.get(head, math.inf)) is not None:
            return True
    return any(repr(v) not in {repr(c) for c in values} for v in _heads()[head][1])


def data_widths(data, path: Path) -> list[int]:
    """Each stored stage's width, as the cache file lists them (the columns `stages: N` reads are the first N)."""
    import torch
    if not hasattr(data_widths, "memo"):
        data_widths.memo = {}
    if path not in data_widths.memo:
        data_widths.memo[path] = list(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["widths"])
    return data_widths.memo[path]


if __name__ == "__main__":
    sys.exit(main())
