"""tools/frozen_bounds.py (the independent centralised bounds), tools/fed3r_rf.py (Fed3R-RF's σ and λ) and
tools/frozen_grid.py's 224 px grid: the choices are made on the held-out training slice, never on the test set, and
bad input is exit 2, one paragraph, nothing written. Small synthetic tensors: seconds."""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
ROOT = Path(__file__).resolve().parents[1]


def tool(name):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def blobs(n, d=6, classes=3, seed=0, spread=1.0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    centres = rng.normal(size=(classes, d)) * 2
    return centres[y] + spread * rng.normal(size=(n, d)), y


@pytest.mark.parametrize("head", ["lda", "ridge", "gnb", "qda", "logreg"])
def test_a_bound_chooses_on_the_held_out_slice_and_refits_on_everything(head, monkeypatch):
    fb = tool("frozen_bounds")
    x, y = blobs(600)
    xt, yt = blobs(300, seed=1)
    rec = fb.run_cell(head, x, y, xt, yt, holdout=120)
    held = [c["holdout_acc"] for c in rec["candidates"]]
    assert rec["chosen"] == rec["candidates"][int(np.argmax(held))]["value"]  # the first best on the slice
    assert rec["holdout_acc"] == max(held) and rec["train_images"] == 600 and rec["holdout_images"] == 120
    # the test set cannot move the choice: scored with its labels scrambled, the chosen value is the same
    scrambled = fb.run_cell(head, x, y, xt, (yt + 1) % 3, holdout=120)
    assert scrambled["chosen"] == rec["chosen"] and scrambled["test_acc"] != rec["test_acc"]
    # and the refit is on all the training images: its test accuracy is the estimator's own on the pooled data
    _, values, make = fb._heads()[head]
    assert rec["test_acc"] == pytest.approx(make(rec["chosen"]).fit(x, y).score(xt, yt))


def test_with_mirrors_the_slice_holds_out_whole_images_and_the_fit_sees_both_copies(monkeypatch):
    """--flip: rows i and i + N are one image; the held-out slice is drawn over images and leaves both copies out
    of every fit, the final fit sees all 2N rows, and the test-time average is recorded beside the plain score."""
    fb = tool("frozen_bounds")
    x, y = blobs(300)
    xm = x + 0.05 * np.random.default_rng(3).normal(size=x.shape)  # the "mirror": a near copy
    xt, yt = blobs(150, seed=1)
    fits = []
    real = fb._heads

    def spying():
        heads = real()
        param, values, make = heads["ridge"]

        def make_spy(v):
            est = make(v)
            fit = est.fit
            est.fit = lambda a, b: (fits.append(a.copy()), fit(a, b))[1]
            return est
        return {**heads, "ridge": (param, values, make_spy)}
    monkeypatch.setattr(fb, "_heads", spying)
    rec = fb.run_cell("ridge", np.concatenate([x, xm]), np.concatenate([y, y]), xt, yt, holdout=60,
                      xt_flip=xt + 0.01)
    fit, held = fb.holdout_split(y, 60)
    slice_fit = fits[0]
    assert len(slice_fit) == 2 * len(fit)  # both copies of every image in the fit, none of the held-out images
    assert {tuple(r) for r in slice_fit} == {tuple(r) for r in np.concatenate([x[fit], xm[fit]])}
    assert len(fits[-1]) == 600 and rec["train_images"] == 600  # the final fit: every row
    assert 0 <= rec["test_acc_tta"] <= 1 and "test_acc_tta" not in fb.run_cell("ridge", x, y, xt, yt, holdout=60)


def test_flip_without_a_mirrored_cache_is_exit_2_nothing_written(tmp_path, capsys):
    pytest.importorskip("efficientnet_lite_pytorch")
    fb = tool("frozen_bounds")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "features-cifar10-efficientnet_lite0-224px-0v-bilinear-0123456789abcdef.pt").write_bytes(b"")
    out = tmp_path / "out"
    assert fb.main(["--flip", "--cache-dir", str(cache), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no mirrored feature cache of efficientnet_lite0 at 224 px" in err and len(err.splitlines()) == 1, err
    assert not out.exists() and [p.name for p in cache.iterdir()] == [
        "features-cifar10-efficientnet_lite0-224px-0v-bilinear-0123456789abcdef.pt"]


def test_the_grid_option_is_the_stages_the_held_out_lda_picked(tmp_path):
    fb = tool("frozen_bounds")
    for s, held, test in [(1, 0.80, 0.95), (2, 0.83, 0.70), (3, 0.83, 0.99)]:  # the test accuracies are not read
        (tmp_path / f"stages{s}-lda.json").write_text(json.dumps({"holdout_acc": held, "test_acc": test}))
    assert fb.choose(tmp_path, [1, 2, 3]) == (2, {1: 0.80, 2: 0.83, 3: 0.83})  # a tie: the fewer stages


@pytest.mark.parametrize("argv,says", [
    (["--heads", "lda,svm"], "--heads"),
    (["--stages", "0,4"], "--stages"),
    (["--holdout", "3"], "--holdout"),
    (["--encoder", "efficientnet_lite2"], "no feature cache of efficientnet_lite2 at 260 px"),
    (["--resolution", "96"], "no feature cache of efficientnet_lite0 at 96 px"),
    (["--encoder", "resnet18"], "not a frozen pretrained encoder"),
])
def test_bad_bounds_input_is_exit_2_one_paragraph_nothing_written(argv, says, tmp_path, capsys):
    pytest.importorskip("efficientnet_lite_pytorch")
    fb = tool("frozen_bounds")
    out = tmp_path / "out"
    assert fb.main([*argv, "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_a_missing_encoder_package_is_exit_2_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite_pytorch.utils", None)  # the own resolution's source
    fb = tool("frozen_bounds")
    assert fb.main(["--encoder", "efficientnet_lite2", "--cache-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "efficientnet-lite-pytorch" in err and len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


def test_another_encoder_needs_its_own_bounds_and_the_224_grid(tmp_path, capsys, monkeypatch):
    pytest.importorskip("efficientnet_lite_pytorch")
    fg = tool("frozen_grid")
    monkeypatch.setattr(fg.bounds_tool(), "OUT", tmp_path / "bounds")
    out = tmp_path / "runs"
    assert fg.main(["--grid", "224", "--encoder", "efficientnet_lite2", "--out", str(out)]) == 2
    assert "no finished lda bounds" in capsys.readouterr().err
    assert fg.main(["--encoder", "efficientnet_lite2", "--out", str(out)]) == 2
    assert "--grid 224" in capsys.readouterr().err
    assert not out.exists()


def test_the_statistics_heads_leave_a_cell_whose_uploads_exceed_the_budget():
    fg = tool("frozen_grid")
    assert fg.statistics_fit(10, 1904) and not fg.statistics_fit(50, 1904)
    pts = fg.points(Path("runs/x"), "224")
    rules = {(d.parent.parent.name, d.parent.name): ov[1] for d, _, ov in pts if d.parent.name == "fedavg"}
    assert all("gh_qda" in r and "afl" in r for (cell, _), r in rules.items() if cell.endswith(("K5", "K10")))
    assert all("fedcgs" not in r for (cell, _), r in rules.items() if cell.endswith("K50"))
    assert len(pts) == 3 * 3 * 3 * 3  # α × K × seeds × the three client objectives


class PeakedAt:
    """A stand-in estimator whose held-out score peaks at one value of its parameter (fits counted)."""
    fits: list = []

    def __init__(self, v, peak):
        self.v, self.peak = v, peak

    def fit(self, x, y):
        PeakedAt.fits.append(self.v)
        return self

    def score(self, x, y):
        return 1.0 - abs(np.log10(self.v) - np.log10(self.peak)) / 10


def peaked_cell(fb, monkeypatch, peak, done=None):
    """frozen_bounds' cell over a stand-in head whose held-out score peaks at `peak` (candidates 1 and 10)."""
    x, y = blobs(200)
    monkeypatch.setattr(fb, "_heads", lambda: {"ridge": ("alpha", [1.0, 10.0], lambda v: PeakedAt(v, peak))})
    PeakedAt.fits = []
    return fb.run_cell("ridge", x, y, x, y, holdout=40, done=done)


def test_a_choice_at_the_grids_end_grows_the_grid_one_decade_until_it_is_inside(monkeypatch):
    fb = tool("frozen_bounds")
    rec = peaked_cell(fb, monkeypatch, 0.01)
    assert [c["value"] for c in rec["candidates"]] == [1.0, 10.0, 0.1, 0.01, 0.001]
    assert rec["chosen"] == 0.01 and rec["extended_at_edge"] == 3 and not rec["at_edge"]
    # a peak beyond the rule's three decades: the record says the choice is still at the edge
    far = peaked_cell(fb, monkeypatch, 1e-6)
    assert far["chosen"] == 1e-3 and far["extended_at_edge"] == fb.EDGE_STEPS and far["at_edge"]


def test_a_grid_grows_up_to_its_parameters_limit_and_no_further(monkeypatch):
    """QDA's reg_param (and LDA's shrinkage) is a fraction: chosen at 0.5, the grid grows to 1, never to 5 — a
    value scikit-learn refuses — and a choice at 1 is final, not an edge."""
    fb = tool("frozen_bounds")
    x, y = blobs(200)
    monkeypatch.setattr(fb, "_heads", lambda: {"qda": ("reg_param", [0.1, 0.5], lambda v: PeakedAt(v, 3.0))})
    PeakedAt.fits = []
    rec = fb.run_cell("qda", x, y, x, y, holdout=40)
    assert [c["value"] for c in rec["candidates"]] == [0.1, 0.5, 1.0]
    assert rec["chosen"] == 1.0 and rec["extended_at_edge"] == 1 and not rec["at_edge"]
    assert fb.extend_at_edge([0.1, 0.5], 1, fb.TOPS["qda"]) == 1.0
    assert fb.extend_at_edge([0.1, 1.0], 1, fb.TOPS["qda"]) is None
    assert fb.extend_at_edge([1.0, 10.0], 1) == 100.0  # no limit: a decade up


def test_an_edge_choice_in_an_older_record_is_completed_reusing_its_fits(monkeypatch):
    fb = tool("frozen_bounds")
    old = peaked_cell(fb, monkeypatch, 0.1)
    del old["extended_at_edge"]
    old["candidates"], old["chosen"] = old["candidates"][:2], 1.0  # as written before the rule: chosen at the end
    assert fb.stale(old)
    new = peaked_cell(fb, monkeypatch, 0.1, done=old["candidates"])
    assert new["chosen"] == 0.1 and PeakedAt.fits == [0.1, 0.01, 0.1]  # two new candidates, then the refit
    assert not fb.stale(new)


def test_fed3r_rf_runs_with_the_held_out_choice_and_leaves_the_cells_past_the_budget(tmp_path):
    fg = tool("frozen_grid")
    assert fg.fed3r_rf_method(choices=tmp_path) is None  # no choice recorded: no Fed3R-RF run
    opts = fg.load_config(fg.CONFIG_224).dataset.options
    name = f"fed3r-rf-{opts['encoder']}-224px-{opts['resize']}-stages{opts['stages']}-D4096-seed1.json"
    (tmp_path / name).write_text(json.dumps({"random_features": 4096, "kernel_width": 126.5, "ridge": 0.001}))
    preset, ov = fg.fed3r_rf_method(choices=tmp_path)
    assert preset == "fedavg" and "eval.rules=[primary,fed3r]" in ov
    assert {"server.strategies.fed3r.kernel_width=126.5", "server.strategies.fed3r.ridge=0.001",
            "server.strategies.fed3r.random_features=4096"} <= set(ov)
    assert fg.rf_fits(10, 4096) and not fg.rf_fits(50, 4096)
    pts = fg.points(Path("runs/x"), "224", methods={"fed3r-rf": (preset, ov)})
    assert {d.parent.parent.name.split("-")[1] for d, _, _ in pts} == {"K5", "K10"} and len(pts) == 3 * 2 * 3


@pytest.mark.parametrize("argv,says", [(["--methods", "fedavg,svm"], "unknown method"),
                                       (["--methods", "fedavg"], "--grid 224"),
                                       (["--limit", "0"], "--limit"), (["--mirrored"], "--grid 224")])
def test_bad_grid_selection_is_exit_2_one_paragraph_nothing_written(argv, says, tmp_path, capsys):
    fg = tool("frozen_grid")
    out = tmp_path / "runs"
    grid = [] if says == "--grid 224" else ["--grid", "224"]
    assert fg.main([*grid, *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_mirrored_runs_are_the_head_only_runs_that_score_the_statistics_heads_over_the_mirror_images():
    """--mirrored: every closed-form head (Fed3R-RF's fed3r included) counts the flip cache's mirror images, and a
    cell whose statistics pass the budget gets no run (it would score no closed-form head)."""
    fg = tool("frozen_grid")
    pts = fg.points(Path("runs/m"), "224", fg.MIRRORED, dict(fg.HEADS_ONLY), statistics_only=True)
    assert {d.parent.parent.name.split("-")[1] for d, _, _ in pts} == {"K5", "K10"} and len(pts) == 3 * 2 * 3
    for _, _, ov in pts:
        assert "dataset.options.flip=true" in ov and all(f"server.strategies.{h}.mirrored=true" in ov
                                                         for h in fg.STATISTICS)
        assert next(o for o in ov if o.startswith("eval.rules=")).endswith(",".join(fg.STATISTICS) + "]")
    assert len(fg.points(Path("runs/m"), "224", fg.MIRRORED, dict(fg.HEADS_ONLY))) == 3 * 3 * 3  # K = 50 too


# tools/fed3r_rf.py: Fed3R-RF's σ and λ chosen on the held-out slice with FLARE's own random map and ridge
def rings(n=900, seed=0):
    """Three classes on concentric shells in 5 dimensions: no linear head separates them, a Gaussian kernel does."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.nn.functional.normalize(torch.randn(n, 5, generator=g, dtype=torch.float64), dim=1)
    return x * (1.0 + y[:, None]) + 0.15 * torch.randn(n, 5, generator=g, dtype=torch.float64), y


def test_the_choice_is_the_best_held_out_pair_and_its_head_is_flares_ridge_on_the_runs_random_map():
    t = tool("fed3r_rf")
    x, y = rings()
    rec = t.choose(x, y, held_size=150, n_features=256, seed=1, classes=3, log=lambda s: None)
    best = max(c["holdout_acc"] for c in rec["candidates"])
    assert rec["holdout_acc"] == best and rec["kernel_width"] == pytest.approx(rec["median_distance"]
                                                                              * rec["sigma_multiple"])
    assert best > 0.9  # the kernel separates the shells
    # the head the choice scored is FLARE's: its statistics through closed_form.ridge on Fed3R's seeded map
    from flare.baselines.closed_form import ridge
    rf = t.random_map(5, 256, rec["kernel_width"], 1)
    w, b = ridge(*t.statistics(rf.features(x), y, 3), rec["ridge"])
    assert ((rf.features(x) @ w.T + b).argmax(1) == y).double().mean() > 0.9
    # another seed draws another map: the record says which seed's map it chose for
    assert not torch.equal(t.random_map(5, 256, 1.0, 1).omega, t.random_map(5, 256, 1.0, 2).omega)


def test_a_choice_at_a_grids_end_grows_that_grid():
    t = tool("fed3r_rf")
    x, y = rings(600)
    rec = t.choose(x, y, held_size=120, n_features=128, seed=1, classes=3, sigmas=[0.01, 0.02],
                   ridges=[1e-3, 1e-2], log=lambda s: None)
    tried = {c["sigma_multiple"] for c in rec["candidates"]}
    assert tried > {0.01, 0.02}  # far too narrow a kernel at the grid's top: σ grew past it


@pytest.mark.parametrize("argv,says", [(["--features", "10"], "--features"), (["--stages", "9"], "--stages"),
                                       (["--holdout", "3"], "--holdout"),
                                       (["--resolution", "96"], "no feature cache of efficientnet_lite0 at 96 px")])
def test_bad_fed3r_rf_input_is_exit_2_one_paragraph_nothing_written(argv, says, tmp_path, capsys):
    pytest.importorskip("efficientnet_lite_pytorch")
    out = tmp_path / "out"
    assert tool("fed3r_rf").main([*argv, "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_the_tools_random_map_is_the_one_a_fed3r_rf_run_draws_for_its_seed():
    """The choice is made on the map a run of that seed uses: the tool's map equals the strategy's."""
    from flare.config import load_config
    from flare.server.strategy import make_strategy
    features = ["dataset.name=features", "dataset.options.source=imagefolder", "dataset.options.root=/nowhere",
                "model.name=adapter", "eval.rules=[primary,fed3r]", "server.strategies.fed3r.random_features=32",
                "server.strategies.fed3r.kernel_width=2.5"]
    for seed in (1, 2):
        strategy = make_strategy(load_config(None, "fafi", [*features, f"seed={seed}"]), "fed3r")
        mine, theirs = tool("fed3r_rf").random_map(7, 32, 2.5, seed), strategy.random_map(7)
        assert torch.equal(mine.omega, theirs.omega) and torch.equal(mine.beta, theirs.beta)


def test_the_224_block_shows_mirrored_bounds_apart_and_marks_a_choice_only_among_layers(tmp_path):
    """A `-flip` bounds directory is a table of its own (100,000 rows, the mirrored-test score beside the plain
    one), and it never takes the grid's 'chosen' mark (one layer is no choice)."""
    fg = tool("frozen_grid")

    def rec(cache, s, acc, held, tta=None):
        d = tmp_path / "bounds" / cache
        d.mkdir(parents=True, exist_ok=True)
        r = {"head": "lda", "stages": s, "dim": 100 * s, "test_acc": acc, "holdout_acc": held, "chosen": "auto",
             "holdout_images": 5000, **({"test_acc_tta": tta} if tta else {})}
        (d / f"stages{s}-lda.json").write_text(json.dumps(r))
    rec("efficientnet_lite0-224px-bilinear", 1, 0.80, 0.81)
    rec("efficientnet_lite0-224px-bilinear", 8, 0.82, 0.83)
    rec("efficientnet_lite0-224px-bilinear-flip", 8, 0.90, 0.95, tta=0.91)
    (tmp_path / "frozen-encoder-224" / "grid").mkdir(parents=True)
    text = fg.render_224(tmp_path)
    plain, flip = text.split("`efficientnet_lite0-224px-bilinear-flip`")
    assert "| 8 **(chosen)** | 800 | 82.00" in plain and "all 50,000 training features" in plain
    assert "100,000 rows" in flip and "| 8 | 800 | 90.00 <sub>(auto; held-out 95.00; with the mirrored test image 91.00)" \
        in flip and "(chosen)" not in flip.split("Published")[0].split("| stages |")[1]


def test_the_224_target_compares_each_heads_rows_with_the_bounds_on_the_same_rows(tmp_path):
    """Heads over plain statistics are measured against the bounds fitted on each training image once, heads over
    mirrored statistics against the `-flip` bounds (every image and its mirror); the mirrored heads have rows of
    their own and a plain-against-mirrored comparison on the points both ran."""
    fg = tool("frozen_grid")
    for cache, acc in (("efficientnet_lite0-224px-bilinear", 0.80), ("efficientnet_lite0-224px-bilinear-flip", 0.84)):
        (tmp_path / "bounds" / cache).mkdir(parents=True)
        (tmp_path / "bounds" / cache / "stages8-logreg.json").write_text(json.dumps(
            {"head": "logreg", "stages": 8, "dim": 800, "test_acc": acc, "holdout_acc": acc, "chosen": 0.001}))

    def run(where, accs):
        d = tmp_path / "frozen-encoder-224" / where / "a0.1-K10" / "fedavg" / "seed=1"
        d.mkdir(parents=True)
        (d / "state.json").write_text(json.dumps({"status": "finished"}))
        (d / "metrics.jsonl").write_text(json.dumps({"kind": "round", "round": 1, "seconds": 1.0, **accs}) + "\n")
    run("grid", {"acc_fedcgs": 0.79, "acc_afl": 0.797})
    run("mirrored", {"acc_fedcgs": 0.83, "acc_afl": 0.81})
    text = fg.render_224(tmp_path)
    plain, mirrored = text.split("**The target**")[1].split("\n")[0].split("Each training image and its mirror image")
    assert "AFL, 79.70 %" in plain and "80.00 % (efficientnet_lite0-224px-bilinear, stages 8, logreg)" in plain
    assert "gap -0.30 points (within 0.5)" in plain
    assert "FedCGS (mirrored), 83.00 %" in mirrored and "84.00 % (efficientnet_lite0-224px-bilinear-flip" in mirrored
    assert "gap -1.00 points (not within 0.5)" in mirrored
    assert "| 0.1 | 10 | 83.00 (1 seed) |" in text and "| FedCGS | 1 | 79.00 | 83.00 | +4.00 |" in text


def test_recorded_runs_a_checkout_lacks_are_restored_before_the_grid_runs_or_records(tmp_path, monkeypatch):
    """A `--record` replaces the block's copy of every directory it records with the checkout's, so a fresh checkout
    would delete every recorded run it did not run itself — in this invocation's `--out` and in the block's other
    directories alike; the grid copies the recorded ones back first (finished ones only, never over a run the
    checkout has), and then counts them as finished."""
    fg = tool("frozen_grid")
    rt = fg.readme_tool()  # loaded from the real checkout before its paths move
    root = tmp_path / "repo"
    monkeypatch.setattr(rt, "RESULTS_DIR", root / "results")
    monkeypatch.setattr(rt, "RUNS", root / "runs")
    monkeypatch.setattr(rt, "record_paths", lambda block: ["grid", "other"])  # relative to runs/
    monkeypatch.setattr(rt, "RESULTS", {"blk": object()})
    for run, status in (("grid/a/fedavg/seed=1", "finished"), ("grid/a/fedavg/seed=2", "finished"),
                        ("grid/b/fedavg/seed=1", "running"), ("other/a/fedavg/seed=1", "finished")):
        d = root / "results" / "blk" / run
        d.mkdir(parents=True)
        (d / "state.json").write_text(json.dumps({"status": status}))
        (d / "metrics.jsonl").write_text("{}\n")
    own = root / "runs" / "grid" / "a/fedavg/seed=2"
    own.mkdir(parents=True)
    (own / "state.json").write_text(json.dumps({"status": "finished", "local": True}))
    assert fg.restore_recorded("blk") == 2
    out = root / "runs" / "grid"
    assert fg.finished(out / "a/fedavg/seed=1") and (out / "a/fedavg/seed=1" / "metrics.jsonl").is_file()
    assert fg.finished(root / "runs" / "other" / "a/fedavg/seed=1")  # a directory other than this run's --out
    assert json.loads((own / "state.json").read_text())["local"]  # the checkout's own run kept
    assert not (out / "b").exists()  # an unfinished record is not a run to skip
    assert fg.restore_recorded("blk") == 0


def test_the_bounds_coverage_counts_each_offered_choice_and_names_those_without_any():
    """The block says on how many offered feature choices each judged bound exists: a record missing, a cache of
    another resolution or the mirrored rows do not count; a choice with no record at all is named."""
    fg = tool("frozen_grid")
    rec = {"test_acc": 0.8}
    bounds = {"efficientnet_lite0-224px-bilinear": {1: {"lda": rec}, 8: {"lda": rec, "qda": rec, "logreg": rec}},
              "efficientnet_lite0-224px-bilinear-flip": {8: {"lda": rec, "qda": rec}},
              "efficientnet_lite2-64px-bilinear": {8: {"lda": rec}},
              "efficientnet_lite2-260px-bicubic": {4: {"logreg": rec}}}
    line = fg.bounds_coverage(bounds)
    assert "48 offered feature choices" in line
    assert "LDA on 2; QDA on 1; logistic regression on 2." in line
    named = line.split("None yet for ")[1].rstrip(".").split(", ")
    assert sorted(named) == sorted(f"efficientnet_lite{e} {r}" for e in (0, 1, 2) for r in ("bilinear", "bicubic")
                                   if (e, r) not in ((0, "bilinear"), (2, "bicubic")))
