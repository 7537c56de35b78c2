"""tools/fed3r_rf.py: Fed3R-RF's σ and λ chosen on the held-out training slice with FLARE's own random map and ridge;
bad input is exit 2, one paragraph, nothing written. Synthetic features: seconds."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")
ROOT = Path(__file__).resolve().parents[1]


def tool():
    if "fed3r_rf" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fed3r_rf", ROOT / "tools" / "fed3r_rf.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fed3r_rf"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["fed3r_rf"]


def rings(n=900, seed=0):
    """Three classes on concentric shells in 5 dimensions: no linear head separates them, a Gaussian kernel does."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.nn.functional.normalize(torch.randn(n, 5, generator=g, dtype=torch.float64), dim=1)
    return x * (1.0 + y[:, None]) + 0.15 * torch.randn(n, 5, generator=g, dtype=torch.float64), y


def test_the_choice_is_the_best_held_out_pair_and_its_head_is_flares_ridge_on_the_runs_random_map():
    t = tool()
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
    t = tool()
    x, y = rings(600)
    rec = t.choose(x, y, held_size=120, n_features=128, seed=1, classes=3, sigmas=[0.01, 0.02],
                   ridges=[1e-3, 1e-2], log=lambda s: None)
    tried = {c["sigma_multiple"] for c in rec["candidates"]}
    assert tried > {0.01, 0.02}  # far too narrow a kernel at the grid's top: σ grew past it


@pytest.mark.parametrize("argv,says", [(["--features", "10"], "--features"), (["--stages", "9"], "--stages"),
                                       (["--holdout", "3"], "--holdout"),
                                       (["--resolution", "96"], "no feature cache of efficientnet_lite0 at 96 px")])
def test_bad_input_is_exit_2_one_paragraph_nothing_written(argv, says, tmp_path, capsys):
    pytest.importorskip("efficientnet_lite_pytorch")
    out = tmp_path / "out"
    assert tool().main([*argv, "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 2
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
        mine, theirs = tool().random_map(7, 32, 2.5, seed), strategy.random_map(7)
        assert torch.equal(mine.omega, theirs.omega) and torch.equal(mine.beta, theirs.beta)
