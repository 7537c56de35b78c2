"""The parts of other papers' tables at their own settings (docs/papers.md) and tools/papers.py's block."""
from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from flare.client.step import local_loss
from flare.client.lam import LamStep
from flare.config import build_config
from flare.config.load import experiment_differences
from flare.data.partition import labeldir_partition
from flare.data.scaling import IDENTITY, input_scaling
from flare.errors import FlareError
from flare.models import create_model
from conftest import make_partition

ROOT = Path(__file__).resolve().parents[1]


def _papers():
    spec = importlib.util.spec_from_file_location("papers_tool", ROOT / "tools" / "papers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["papers_tool"] = mod
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------- noniid-labeldir
def test_labeldir_hand_derived_small_case():
    """Two classes of four samples, two clients, seed 3: the draws spelled out in the reference's order."""
    labels = np.array([0, 1, 0, 1, 0, 1, 0, 1])
    rs = np.random.RandomState(3)
    batches = [[], []]
    for c in range(2):
        idx = np.flatnonzero(labels == c)
        rs.shuffle(idx)
        q = rs.dirichlet([0.5, 0.5])
        q = np.array([p * (len(b) < 8 / 2) for p, b in zip(q, batches)])
        q = q / q.sum()
        cut = int(q[0] * 4)  # cumsum(q)[:-1]·N_c, truncated
        batches = [batches[0] + idx[:cut].tolist(), batches[1] + idx[cut:].tolist()]
    for b in batches:
        rs.shuffle(b)
    got = labeldir_partition(labels, 2, 0.5, 3, 2, min_size=0)
    assert [ix.tolist() for ix in got.client_indices] == batches


def test_labeldir_balance_rule_closes_a_full_client():
    """A client that already holds N/K samples gets no share of a later class: every client held fewer than N/K
    samples before the last class it received."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 3000)
    p = labeldir_partition(labels, 5, 0.1, 7, 10, min_size=10)
    N, K = len(labels), 5
    hist = p.histogram()
    for k in range(K):
        received = np.flatnonzero(hist[k])
        if len(received):
            before_last = hist[k, :received[-1]].sum()
            assert before_last < N / K


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_labeldir_invariants(seed):
    labels = np.repeat(np.arange(10), 200)
    a = make_partition(labels, 10, "noniid-labeldir", seed, alpha=0.1, rng="legacy")
    b = make_partition(labels, 10, "noniid-labeldir", seed, alpha=0.1, rng="legacy")
    allix = np.concatenate(a.client_indices)
    assert sorted(allix.tolist()) == list(range(len(labels)))           # every sample exactly once
    assert min(a.sizes) >= 10                                           # min_require_size
    assert all((x == y).all() for x, y in zip(a.client_indices, b.client_indices))  # same seed, same sets
    c = make_partition(labels, 10, "noniid-labeldir", seed + 10, alpha=0.1, rng="legacy")
    assert any(len(x) != len(y) or (x != y).any() for x, y in zip(a.client_indices, c.client_indices))
    g = make_partition(labels, 10, "noniid-labeldir", seed, alpha=0.1, rng="generator")
    assert sorted(np.concatenate(g.client_indices).tolist()) == list(range(len(labels)))


def test_labeldir_refuses_an_impossible_min_size():
    with pytest.raises(FlareError) as e:
        make_partition(np.zeros(20, dtype=np.int64), 5, "noniid-labeldir", 0, alpha=0.5,
                       options={"min_size": 10})
    assert e.value.key == "partition.options.min_size"


# ------------------------------------------------------------------------------------------- networks
def test_simple_cnn_parameter_count_and_no_batchnorm():
    m = create_model("simple-cnn", 1, 10, head="linear")
    # conv 1→6 5×5: 6·25+6; conv 6→16 5×5: 16·150+16; fc 256→120; fc 120→84; head 84→10
    expected = (6 * 25 + 6) + (16 * 6 * 25 + 16) + (256 * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10)
    assert sum(p.numel() for p in m.parameters()) == expected == 44426
    assert not any(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.modules())
    assert m(torch.zeros(2, 1, 28, 28))[1].shape == (2, 10)
    cifar = create_model("simple-cnn", 3, 10, head="linear")  # NIID-Bench's SimpleCNN: 16·5·5 flattened
    assert cifar.encoder.fc1.in_features == 400 and cifar(torch.zeros(1, 3, 32, 32))[1].shape == (1, 10)


def test_dense_mnist_cnn_parameter_count():
    m = create_model("cnn_mnist_dense", 1, 10, head="linear")
    # conv 1→16 5×5 + BN(16); conv 16→32 5×5 + BN(32); fc 32·7·7 → 10
    expected = (16 * 25 + 16) + 32 + (32 * 16 * 25 + 32) + 64 + (1568 * 10 + 10)
    assert sum(p.numel() for p in m.parameters()) == expected == 29034
    assert m.feature_dim == 1568


def test_input_scaling_none_is_to_tensor_alone():
    s = input_scaling("none", "fmnist", (0.286,), (0.353,))
    assert s.pre is None and s.post == IDENTITY and s.test == IDENTITY
    assert build_config({"augment": {"input_scaling": "none"}}).augment.input_scaling == "none"


# --------------------------------------------------------------------------------------------- FedProx
def _plain(base, align):
    return LamStep(base, None)


def _loss(cfg, model, x, y, start):
    feat, logits = model(x)
    params = {n: q for n, q in model.named_parameters() if q.requires_grad}
    return local_loss(cfg, feat, logits, y, None, target=None, weigh=_plain, params=params, start=start)


def test_fedprox_mu_zero_is_plain_ce():
    torch.manual_seed(0)
    model = create_model("simple-cnn", 1, 10, head="linear")
    start = {n: q.detach().clone() + 0.1 for n, q in model.named_parameters()}
    x, y = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    cfg = build_config({"preset": "fedavg", "loss": {"objective": "ce", "ce_input": "plain", "terms": {"fedprox": {"mu": 0.0}}}})
    total = _loss(cfg, model, x, y, start).total()
    assert torch.allclose(total, F.cross_entropy(model(x)[1], y))


def test_fedprox_gradient_is_mu_times_drift():
    torch.manual_seed(0)
    mu = 0.3
    model = create_model("simple-cnn", 1, 10, head="linear")
    start = {n: q.detach().clone() + 0.05 * torch.randn_like(q) for n, q in model.named_parameters()}
    x, y = torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,))
    plain = build_config({"preset": "fedavg", "loss": {"objective": "ce", "ce_input": "plain"}})
    prox = build_config({"preset": "fedavg", "loss": {"objective": "ce", "ce_input": "plain", "terms": {"fedprox": {"mu": mu}}}})
    params = [q for q in model.parameters()]
    g_plain = torch.autograd.grad(_loss(plain, model, x, y, start).total(), params)
    g_prox = torch.autograd.grad(_loss(prox, model, x, y, start).total(), params)
    for (n, q), a, b in zip(model.named_parameters(), g_plain, g_prox):
        assert torch.allclose(b - a, mu * (q.detach() - start[n]), atol=1e-6), n


def test_fedprox_refused_by_the_batched_engine():
    with pytest.raises(FlareError) as e:
        build_config({"preset": "fedavg", "client_engine": "batched", "loss": {"terms": {"fedprox": {"mu": 0.01}}}})
    assert e.value.key == "client_engine"


def test_uses_params_marks_only_weight_terms():
    """Only a config with a weight-reading term makes the clients keep a copy of their start weights."""
    from flare.client.terms.extra import uses_params
    cfg = build_config({"preset": "fedavg", "loss": {"terms": {"fedprox": {"mu": 0.01}}}})
    assert uses_params(cfg.loss) and not uses_params(build_config({"preset": "fedavg"}).loss)


def test_loss_term_options_are_validated_once_not_every_step(monkeypatch):
    """The step sums the terms of loss.terms with options validated once per table (validation is not free, and
    the result cannot change between steps): the same terms, weights and order at every step."""
    from flare.client.terms import extra
    from flare.registry import LOSS_TERMS
    calls = []
    validate = LOSS_TERMS.options
    monkeypatch.setattr(LOSS_TERMS, "options", lambda *a, **k: calls.append(a[0]) or validate(*a, **k))
    extra._built_terms.cache_clear()
    cfg = build_config({"preset": "fedavg", "loss": {"terms": {"fedprox": {"mu": 0.5}}}})
    calls.clear()  # the config's own validation
    w = {"w": torch.ones(3, requires_grad=True)}
    start = {"w": torch.zeros(3)}
    feat, logits, y = torch.zeros(4, 2), torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    steps = [extra.extra_terms(cfg.loss, feat, logits, y, None, w, start) for _ in range(3)]
    assert calls == ["fedprox"]
    assert all(torch.equal(s["term_fedprox"], torch.tensor(0.5 * 0.5 * 3)) for s in steps)


# ------------------------------------------------------------------------------------ tools/papers.py
def test_table_configs_build_valid_flare_configs():
    papers = _papers()
    for f in sorted((ROOT / "configs" / "papers").glob("*.yaml")):
        spec = papers.load_table(f)
        cs = papers.cells(spec)
        assert len(cs) == sum(len(papers.seeds_for(spec, a)) for a in spec["alphas"]) * len(spec["methods"])
        for c in cs[:len(spec["methods"])]:
            cfg = build_config(dict(c["config"]))
            assert cfg.partition.kind == "noniid-labeldir" and cfg.augment.input_scaling == "none"
        assert set(spec.get("published", {})) <= set(spec["columns"])


def _fake_cell(root: Path, table: str, method: str, alpha: float, seed: int, curve: list[float],
               fuse: dict | None = None) -> None:
    d = root / table / f"{method}-a{alpha:g}-s{seed}"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"kind": "round", "round": i, "acc_fedavg": v}) + "\n"
                                             for i, v in enumerate(curve)))
    (d / "fuse.jsonl").write_text("".join(json.dumps({"kind": "fuse", "strategy": k, "acc": v}) + "\n"
                                          for k, v in (fuse or {}).items()))
    (d / "cell.json").write_text(json.dumps({"method": method, "alpha": alpha, "seed": seed, "table": table}))


def test_render_on_synthetic_records(tmp_path):
    papers = _papers()
    spec = {"table": "t", "paper": "P, Table 1", "alphas": [0.1], "seeds": [0, 1, 2],
            "columns": {"FedAvg": {"method": "fedavg", "key": "acc_fedavg", "paper_rule": "peak"},
                        "DENSE": {"method": "fedavg", "key": "fuse:dense", "paper_rule": "final"},
                        "Extra": {"method": "fedavg", "key": "fuse:dense", "paper_rule": "final"}},
            "published": {"FedAvg": {0.1: 55.0}, "DENSE": {0.1: None}}}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "table.yaml").write_text(yaml.safe_dump(spec))
    for s, (last, best, dense) in enumerate([(0.50, 0.60, 0.7), (0.52, 0.62, 0.7), (0.54, 0.64, 0.7)]):
        _fake_cell(tmp_path, "t", "fedavg", 0.1, s, [0.1, best, last], {"dense": dense})
    out = papers.render(tmp_path)
    row = next(line for line in out.splitlines() if line.startswith("| FedAvg"))
    # final 50, 52, 54 → 52 ± 2; peak 60, 62, 64 → 62 ± 2; 95 % half-width 4.303·2/√3 = 4.97
    assert row == ("| FedAvg | 0.1 | 55.00 | not run | 0–2 | 3 | 52.00 ± 2.00 | 47.03 – 56.97 (±4.97) | "
                   "62.00 ± 2.00 (peak) | -3.00 |")
    dense = next(line for line in out.splitlines() if line.startswith("| DENSE"))
    assert "70.00 ± 0.00" in dense and "not found" in dense
    # a column the paper does not have is not reported as a number we failed to find
    extra = next(line for line in out.splitlines() if line.startswith("| Extra"))
    assert "| not in the paper |" in extra and "not found" not in extra
    # a published value outside the interval
    spec["published"]["FedAvg"][0.1] = 60.0
    (tmp_path / "t" / "table.yaml").write_text(yaml.safe_dump(spec))
    assert "| -8.00 |" in papers.render(tmp_path)


def test_servers_fused_by_hand_are_listed_apart_from_the_columns(tmp_path):
    """A fuse record that is not one of the table's servers at the table's options (another option, a plugin's
    strategy) is listed under the table with its options, and never feeds a column."""
    papers = _papers()
    spec = {"table": "t", "paper": "P", "alphas": [0.1], "seeds": [0],
            "columns": {"FedLPA": {"method": "fedavg", "key": "fuse:fedlpa", "paper_rule": "final"}},
            "published": {"FedLPA": {0.1: 55.0}}}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "table.yaml").write_text(yaml.safe_dump(spec))
    _fake_cell(tmp_path, "t", "fedavg", 0.1, 0, [0.3], {"fedlpa": 0.45})
    d = tmp_path / "t" / "fedavg-a0.1-s0"
    (d / "cell.json").write_text(json.dumps({**json.loads((d / "cell.json").read_text()), "fuse": ["fedlpa"]}))
    assert "Other servers" not in papers.render(tmp_path)
    with (d / "fuse.jsonl").open("a") as f:
        for strategy, acc, opts in (("fedlpa_reference", 0.51, {"refine_steps": 0}), ("fedlpa", 0.48, {"batches": 9})):
            f.write(json.dumps({"kind": "fuse", "strategy": strategy, "acc": acc, "seconds": 90, "options": opts}) + "\n")
    out = papers.render(tmp_path)
    assert "| fedavg | 0.1 | 0 | fedlpa_reference | refine_steps=0 | 51.00 | 2 min |" in out
    assert "| fedavg | 0.1 | 0 | fedlpa | batches=9 | 48.00 | 2 min |" in out
    assert "| FedLPA | 0.1 | 55.00 | not run | 0 | 1 | 45.00 |" in out  # the column still reads the table's server
    assert out.count("| fedavg | 0.1 | 0 |") == 2


def test_committed_block_equals_the_records():
    """docs/papers.md's block is what tools/papers.py renders from results/papers/ (vacuous while no cell has
    finished: then both say so)."""
    papers = _papers()
    text = (ROOT / "docs" / "papers.md").read_text()
    block = papers.render(papers.RESULTS, reference=papers.REFERENCE)
    assert papers.committed_block(text) == block
    # the paper's own code's column, from results/papers-reference/ alone: in every table, between the paper's
    # number and FLARE's, and every committed run of it read into its table's rows
    heads = [line for line in block.splitlines() if line.startswith("| column | α |")]
    assert heads and all(h.startswith("| column | α | paper | their code | FLARE: seeds | n |") for h in heads)
    for table in sorted(papers.REFERENCE.iterdir()) if papers.REFERENCE.is_dir() else []:
        if (papers.RESULTS / table.name / "table.yaml").is_file():
            for run in papers.reference_runs(table):
                assert f"seed {run['seed']}" in block, (table.name, run)


def test_render_budget_curve_and_pairing(tmp_path, monkeypatch):
    """A shortened data-free budget is stated against the paper's, its best test-curve epoch is the paper's-rule
    column, the curve is drawn with the paper's value beside it, and a table with `paired_with` prints its
    differences seed by seed."""
    from matplotlib.axes import Axes

    papers = _papers()
    hlines, axhline = [], Axes.axhline
    monkeypatch.setattr(Axes, "axhline", lambda ax, y=0, *a, **k: hlines.append((y, k.get("label"))) or
                        axhline(ax, y, *a, **k))
    res, img = tmp_path / "res", tmp_path / "img"
    spec = {"table": "t", "paper": "P", "alphas": [0.1], "seeds": [0, 1],
            "columns": {"DENSE": {"method": "fedavg", "key": "fuse:dense", "paper_rule": "peak"},
                        "FedAvg": {"method": "fedavg", "key": "acc_fedavg", "paper_rule": "final"}},
            "published": {"DENSE": {0.1: 50.0}}}
    (res / "t").mkdir(parents=True)
    (res / "t" / "table.yaml").write_text(yaml.safe_dump(spec))
    opts = {"epochs": 2, "curve_every": 1}
    for s, accs in enumerate([(0.30, 0.40), (0.36, 0.34)]):
        _fake_cell(res, "t", "fedavg", 0.1, s, [0.2 + s / 10])
        d = res / "t" / f"fedavg-a0.1-s{s}"
        curve = [[1, 30, accs[0]], [2, 60, accs[1]]]
        recs = [{"kind": "fuse", "strategy": "dense", "acc": 0.99},  # the run's own budget: not the table's
                {"kind": "fuse", "strategy": "dense", "acc": accs[1], "options": opts, "dense.curve": curve,
                 "dense.best_epoch_acc": max(accs)}]
        (d / "fuse.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        meta = json.loads((d / "cell.json").read_text())
        (d / "cell.json").write_text(json.dumps({**meta, "fuse_options": {"dense": opts}}))
        (d / "config.yaml").write_text(yaml.safe_dump({"server": {"strategies": {"dense": {"epochs": 200,
                                                                                            "g_steps": 30}}}}))
    other = {"table": "u", "paper": "P", "alphas": [0.1], "seeds": [0, 1],
             "columns": {"FAFI": {"method": "fafi", "key": "acc_fedavg", "paper_rule": "final"},
                         "FLARE": {"method": "flare", "key": "acc_fedavg", "paper_rule": "final"}},
             "paired_with": [{"table": "t", "columns": ["FedAvg"]}, {"table": "u", "columns": {"FLARE": "FAFI"}}]}
    (res / "u").mkdir()
    (res / "u" / "table.yaml").write_text(yaml.safe_dump(other))
    for s in (0, 1):
        _fake_cell(res, "u", "fafi", 0.1, s, [0.5 + s / 10])
        _fake_cell(res, "u", "flare", 0.1, s, [0.47 + s / 5])
    out = papers.render(res, img_dir=img)
    dense = next(line for line in out.splitlines() if line.startswith("| DENSE"))
    # final 40 and 34 → 37 ± 4.24; the best curve epochs 40 and 36 → 38 ± 2.83
    assert "| 37.00 ± 4.24 | -1.12 – 75.12 (±38.12) | 38.00 ± 2.83 (peak) | -13.00 |" in dense
    assert "2 epochs × 30 generator steps = 60 (the paper's: 200 × 30 = 6,000) — **a shortened budget**" in out
    assert (img / "papers-t-curve.png").stat().st_size > 0 and "(img/papers-t-curve.png)" in out
    assert hlines == [(50.0, "DENSE, α = 0.1: the paper's 50.00")]  # the paper's DENSE at α = 0.1, once
    assert out == papers.render(res)  # the check renders the same text without drawing
    # FAFI − FedAvg: seed 0 50 − 20, seed 1 60 − 30 → +30 ± 0
    assert "| FAFI | FedAvg | 0.1 | 0,1 | +30.00 ± 0.00 | ±0.00 |" in out
    # a list of pairings, one of them within the table itself: FLARE − FAFI, seed 0 47 − 50, seed 1 67 − 60 → +2 ± 7.07
    assert "Paired within u by seed" in out and "| FLARE | FAFI | 0.1 | 0,1 | +2.00 ± 7.07 | ±63.53 |" in out


def test_a_cell_counts_as_fused_only_with_the_tables_server_options(tmp_path):
    papers = _papers()
    spec = papers.load_table(ROOT / "configs" / "papers" / "dense-fmnist.yaml")
    cell = papers.cells(spec)[0]
    args = papers.fuse_args(cell, "dense")
    assert "server.strategies.dense.epochs=20" in args and "server.strategies.dense.curve_every=2" in args
    (tmp_path / "fuse.jsonl").write_text(json.dumps({"kind": "fuse", "strategy": "dense", "acc": 0.5}) + "\n")
    assert papers._key("dense", cell["fuse_options"]["dense"]) not in papers.fused(tmp_path)  # the run's budget
    with (tmp_path / "fuse.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "fuse", "strategy": "dense", "acc": 0.4,
                            "options": dict(reversed(list(cell["fuse_options"]["dense"].items())))}) + "\n")
    assert papers._key("dense", cell["fuse_options"]["dense"]) in papers.fused(tmp_path)


def _bn_buffers(model):
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var"))}


def test_train_mode_epochs_freezes_batchnorm_statistics_after_the_first_epochs():
    """DENSE's client loop tests after every epoch and never calls model.train() again: epochs after the first
    train in eval mode. With train_mode_epochs=1 the running statistics stop at their first-epoch values while the
    weights keep moving; without it they keep moving too."""
    from test_alignment import tiny_client
    for n, frozen in ((1, True), (None, False)):
        client, ctx = tiny_client({"preset": "fedavg", "train_mode_epochs": n, "rounds": 2, "local_epochs": 2})
        assert _bn_buffers(client.model), "the test model must hold BatchNorm statistics"
        client.train_round(ctx, 0)  # epochs 1-2: the second already in eval mode when n=1
        after_round = _bn_buffers(client.model)
        weights = {k: v.clone() for k, v in client.model.state_dict().items() if k not in after_round}
        client.train_round(ctx, 1)
        moved = [k for k, v in _bn_buffers(client.model).items() if not torch.equal(v, after_round[k])]
        assert (not moved) == frozen, (n, moved)
        assert any(not torch.equal(v, client.model.state_dict()[k]) for k, v in weights.items())


def test_train_mode_epochs_refused_by_the_batched_engine():
    with pytest.raises((FlareError, ValueError), match="train_mode_epochs"):
        build_config({"preset": "fedavg", "client_engine": "batched", "train_mode_epochs": 1})


def test_a_table_extends_another_by_the_keys_it_changes(tmp_path):
    papers = _papers()
    parent = papers.load_table(ROOT / "configs" / "papers" / "dense-fmnist.yaml")
    child = papers.load_table(ROOT / "configs" / "papers" / "dense-fmnist-bn-train.yaml")
    assert child["table"] == "dense-fmnist-bn-train" and child["alphas"] == [0.1] and child["seeds"] == [0]
    assert set(child["columns"]) == {"FedAvg", "Ensemble"}            # replaced, not merged
    assert child["base"]["train_mode_epochs"] is None and parent["base"]["train_mode_epochs"] == 1
    assert child["base"]["model"] == parent["base"]["model"]          # merged key by key
    assert child["methods"]["fedavg"]["fuse"] == [] and child["methods"]["fedavg"]["preset"] == "fedavg"
    assert "extends" not in child
    (c,) = papers.cells(child)
    assert build_config(dict(c["config"])).train_mode_epochs is None
    # a method given as null is not run: the μ diagnostic trains FedProx alone, its config the table's but μ
    mu = papers.load_table(ROOT / "configs" / "papers" / "fedlpa-fmnist-fedprox-mu.yaml")
    table = {c["name"]: c for c in papers.cells(papers.load_table(ROOT / "configs" / "papers" / "fedlpa-fmnist.yaml"))}
    assert [c["name"] for c in papers.cells(mu)] == ["fedprox-a0.1-s0", "fedprox-a0.1-s1", "fedprox-a0.1-s2"]
    for c in papers.cells(mu):
        old = build_config(dict(table[c["name"]]["config"])).model_dump(mode="json")
        assert experiment_differences(old, build_config(dict(c["config"]))) == ["loss.terms.fedprox.mu"]
    # the full-budget diagnostic changes the server's budget only: its clients are the table's cell, key for key
    full = papers.load_table(ROOT / "configs" / "papers" / "fedlpa-fmnist-dense-full.yaml")
    (c,) = papers.cells(full)
    assert c["name"] == "fedavg-a0.3-s1" and c["fuse"] == ["dense"]
    assert c["fuse_options"]["dense"]["epochs"] * c["config"]["server"]["strategies"]["dense"]["g_steps"] == 6000
    assert table[c["name"]]["fuse_options"]["dense"]["epochs"] == 20
    old = build_config(dict(table[c["name"]]["config"])).model_dump(mode="json")
    assert experiment_differences(old, build_config(dict(c["config"]))) == []
    # Co-Boosting at FedLPA's setting: over the table's FedAvg clients, key for key, at the tables' 600 steps
    from flare.baselines.datafree import CoBoostingOptions

    cob = papers.load_table(ROOT / "configs" / "papers" / "fedlpa-fmnist-coboosting.yaml")
    assert sorted(c["name"] for c in papers.cells(cob)) == sorted(n for n in table if n.startswith("fedavg"))
    for c in papers.cells(cob):
        assert c["fuse"] == ["coboosting"] and c["fuse_options"]["coboosting"]["curve_every"] == 2
        cfg = build_config(dict(c["config"]))
        opts = CoBoostingOptions(**(cfg.server.strategies.get("coboosting") or {}))  # its published defaults
        assert c["fuse_options"]["coboosting"]["epochs"] * opts.g_steps == 600
        old = build_config(dict(table[c["name"]]["config"])).model_dump(mode="json")
        assert experiment_differences(old, cfg) == []


def test_a_recorded_cell_of_another_setting_is_neither_skipped_nor_replaced(tmp_path, capsys):
    """Editing a table file after a cell was recorded: the run is refused before it writes anything, naming the keys
    that differ, and leaves the records alone; the dry run lists it the same way."""
    papers = _papers()
    spec = papers.load_table(ROOT / "configs" / "papers" / "dense-fmnist.yaml")
    cell = papers.cells(spec)[0]
    rec = tmp_path / "res" / spec["table"] / cell["name"]
    rec.mkdir(parents=True)
    from flare.config.load import load_config
    recorded = load_config(overrides=papers._merge(cell["config"], {"train_mode_epochs": None})).model_dump(mode="json")
    (rec / "config.yaml").write_text(yaml.safe_dump(recorded))
    (rec / "cell.json").write_text(json.dumps({"method": "fedavg", "alpha": 0.1, "seed": 0, "table": spec["table"]}))
    assert papers.stale(rec, cell, []) == ["train_mode_epochs"]
    assert papers.stale(rec, cell, ["train_mode_epochs=null"]) == []  # the override is part of the cell
    before = {p.name: p.read_text() for p in rec.iterdir()}
    with pytest.raises(FlareError, match="keys differ: train_mode_epochs"):
        papers.run(spec, tmp_path / "runs", commit=False, dry_run=False, overrides=[], dest=tmp_path / "res")
    assert {p.name: p.read_text() for p in rec.iterdir()} == before and not (tmp_path / "runs").exists()
    papers.run(spec, tmp_path / "runs", commit=False, dry_run=True, overrides=[], dest=tmp_path / "res")
    assert "recorded at another setting" in capsys.readouterr().out


def test_a_note_and_column_pairs_render(tmp_path):
    papers = _papers()
    for t, cols, extra in (("t", {"FedAvg": "acc_fedavg", "Ens": "acc_output"}, {}),
                           ("d", {"FedAvg": "acc_fedavg", "Ens": "acc_output"},
                            {"note": "Diagnostic.", "paired_with": {"table": "t", "columns": {"Ens": "Ens"}}})):
        (tmp_path / t).mkdir()
        (tmp_path / t / "table.yaml").write_text(yaml.safe_dump({
            "table": t, "paper": "P", "alphas": [0.1], "seeds": [0], **extra,
            "columns": {k: {"method": "fedavg", "key": v, "paper_rule": "final"} for k, v in cols.items()}}))
        d = tmp_path / t / "fedavg-a0.1-s0"
        d.mkdir()
        acc = 0.5 if t == "t" else 0.6
        (d / "metrics.jsonl").write_text(json.dumps({"kind": "round", "acc_fedavg": acc, "acc_output": acc + 0.1}) + "\n")
        (d / "cell.json").write_text(json.dumps({"method": "fedavg", "alpha": 0.1, "seed": 0, "table": t}))
    out = papers.render(tmp_path)
    assert "*Diagnostic.*" in out
    assert "| Ens | Ens | 0.1 | 0 | +10.00 | — |" in out and "| FedAvg | Ens |" not in out and "| Ens | FedAvg |" not in out


def test_pairings_with_one_table_share_one_table(tmp_path):
    """Two entries naming the same table (a dict holds one pair per key: FedDF − FedAvg and FedDF − Ensemble need
    two) print one table with both pairs' rows, in the order given."""
    papers = _papers()
    cols = {"FedAvg": "acc_fedavg", "FedDF": "fuse:feddf", "Ens": "acc_output"}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "table.yaml").write_text(yaml.safe_dump({
        "table": "t", "paper": "P", "alphas": [0.1], "seeds": [0],
        "paired_with": [{"table": "t", "columns": {"FedDF": "FedAvg"}}, {"table": "t", "columns": {"FedDF": "Ens"}}],
        "columns": {k: {"method": "fedavg", "key": v, "paper_rule": "final"} for k, v in cols.items()}}))
    d = tmp_path / "t" / "fedavg-a0.1-s0"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"kind": "round", "acc_fedavg": 0.3, "acc_output": 0.5}) + "\n")
    (d / "fuse.jsonl").write_text(json.dumps({"kind": "fuse", "strategy": "feddf", "acc": 0.45}) + "\n")
    (d / "cell.json").write_text(json.dumps({"method": "fedavg", "alpha": 0.1, "seed": 0, "table": "t"}))
    out = papers.render(tmp_path)
    assert out.count("Paired within t by seed") == 1
    rows = [line for line in out.splitlines() if line.startswith("| FedDF |")]
    assert rows[-2:] == ["| FedDF | FedAvg | 0.1 | 0 | +15.00 | — |", "| FedDF | Ens | 0.1 | 0 | -5.00 | — |"]


def test_spread_lists_every_draw_and_places_the_papers_single_run(tmp_path):
    papers = _papers()
    spec = {"table": "t", "paper": "P", "alphas": [0.1], "seeds": [0, 1, 2], "spread": True,
            "columns": {"FedAvg": {"method": "fedavg", "key": "acc_fedavg", "paper_rule": "final"}},
            "published": {"FedAvg": {0.1: 45.0}}}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "table.yaml").write_text(yaml.safe_dump(spec))
    for s, v in enumerate([0.40, 0.55, 0.50]):
        _fake_cell(tmp_path, "t", "fedavg", 0.1, s, [v])
    out = papers.render(tmp_path, img_dir=tmp_path / "img")
    assert "FedAvg, α = 0.1, by seed: 0: 40.00, 1: 55.00, 2: 50.00 — range 40.00–55.00 over 3 draws. Were the " \
           "paper's 45.00 one more draw of this setting, one at least this low has rank probability " \
           "(1 + 1)/(3 + 1) = 0.500 (one-sided): 3 draws cannot tell it from ours." in out
    assert (tmp_path / "img" / "papers-t-spread.png").stat().st_size > 0 and "(img/papers-t-spread.png)" in out
    assert out == papers.render(tmp_path)  # the check names the figure without drawing it
    spec["published"]["FedAvg"][0.1] = 39.0
    (tmp_path / "t" / "table.yaml").write_text(yaml.safe_dump(spec))
    assert "Were the paper's 39.00 one more draw of this setting, one at least this low has rank probability " \
           "(0 + 1)/(3 + 1) = 0.250 (one-sided): the smallest p that 3 draws allow, and above 0.05: 3 draws cannot " \
           "reject it whatever the paper ran (19 could)." in papers.render(tmp_path)


def test_rank_probability_counts_the_draws_on_the_papers_side():
    papers = _papers()
    assert papers.rank_p([70.0, 73.0, 52.0, 76.0], 82.96) == ("above", 0, 0.2)  # every draw under it: 1/(n+1)
    assert papers.rank_p([70.0, 73.0, 52.0, 76.0], 73.0) == ("above", 2, 0.6)   # a tie counts as at or beyond
    assert papers.rank_p([70.0, 73.0, 52.0, 76.0], 60.0) == ("below", 1, 0.4)
    side, beyond, p = papers.rank_p([float(v) for v in range(19)], 99.0)
    assert (beyond, p) == (0, 0.05)  # 19 draws all under: the first n at which the test reaches 0.05


def test_seeds_given_per_alpha_run_only_those_cells(tmp_path):
    papers = _papers()
    spec = {"table": "t", "alphas": [0.1, 0.3], "seeds": {0.1: [0, 1], 0.3: [0, 1, 2, 3]},
            "base": {}, "methods": {"fedavg": {"preset": "fedavg"}}, "columns": {}}
    assert [c["name"] for c in papers.cells(spec)] == ["fedavg-a0.1-s0", "fedavg-a0.3-s0", "fedavg-a0.1-s1",
                                                       "fedavg-a0.3-s1", "fedavg-a0.3-s2", "fedavg-a0.3-s3"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**spec, "seeds": {0.1: [0], 0.5: [0]}}))
    with pytest.raises(FlareError, match="must name every α"):
        papers.load_table(bad)


def test_a_bad_table_file_stops_with_exit_2_before_anything_runs(tmp_path, capsys):
    papers = _papers()
    runs = tmp_path / "runs"
    bad = tmp_path / "bad.yaml"
    for text in ("table: t\nalphas: [0.1]\n", "- a list\n", "table: [unclosed\n"):
        bad.write_text(text)
        assert papers.main(["run", str(bad), "--runs", str(runs)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("papers: ") and "Traceback" not in err and err.count("\n") == 1
    assert papers.main(["run", str(tmp_path / "missing.yaml"), "--runs", str(runs)]) == 2
    assert "does not exist" in capsys.readouterr().err and not runs.exists()


def test_render_check_reads_the_records_directory_it_is_given(tmp_path):
    """`render --results DIR` (what a committing run calls in a fresh process) renders DIR's records: the committed
    block matches results/papers/ and not an empty directory."""
    papers = _papers()
    assert papers.main(["render", "--check"]) == 0
    assert papers.main(["render", "--check", "--results", str(tmp_path)]) == 1


def test_cost_line_is_measured_from_the_records(tmp_path):
    """The cost line sums each cell's round seconds, reads each server's fuse seconds, and prices the cells and
    fusions the table still lacks at those rates; a method with no recorded cell has no rate, and says so."""
    papers = _papers()
    spec = {"table": "t", "paper": "P", "alphas": [0.1], "seeds": [0, 1, 2],
            "columns": {"FedAvg": {"method": "fedavg", "key": "acc_fedavg"},
                        "DENSE": {"method": "fedavg", "key": "fuse:dense"},
                        "FLARE": {"method": "flare", "key": "acc"}},
            "published": {}}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "table.yaml").write_text(yaml.safe_dump(spec))
    for seed, (round_s, dense_s) in enumerate([(1800.0, 3600.0), (3600.0, None)]):
        _fake_cell(tmp_path, "t", "fedavg", 0.1, seed, [0.5, 0.6], {"dense": 0.7} if dense_s else None)
        d = tmp_path / "t" / f"fedavg-a0.1-s{seed}"
        (d / "metrics.jsonl").write_text("".join(json.dumps({"kind": "round", "round": i, "acc_fedavg": 0.5,
                                                             "seconds": round_s / 2}) + "\n" for i in range(2)))
        if dense_s:
            (d / "fuse.jsonl").write_text(json.dumps({"kind": "fuse", "strategy": "dense", "acc": 0.7,
                                                      "seconds": dense_s}) + "\n")
    line = next(ln for ln in papers.render(tmp_path).splitlines() if ln.startswith("Cost"))
    assert "fedavg clients 45 min a cell (30 min–1.00 h, 2)" in line
    assert "its dense server 1.00 h a fusion (1)" in line
    # seed 2's cell (0.75 h) and two fusions (seed 1's and seed 2's, 1 h each): 2.75 h; FLARE's three cells unpriced
    assert "still to run: 3 client cells and fusions, ≈ 2.75 h at these rates" in line
    assert "no rate yet for 3 flare cells" in line


def test_cells_option_takes_only_the_named_cells_and_refuses_an_unknown_one(tmp_path, capsys):
    """Two processes training two cells of one table at once: each takes only the cells it names, so neither
    resumes the other's partial cell; a name the table lacks stops with exit 2 before anything is written."""
    papers = _papers()
    table = ROOT / "configs" / "papers" / "dense-fmnist.yaml"
    runs = tmp_path / "runs"
    assert papers.main(["run", str(table), "--runs", str(runs), "--dry-run",
                        "--cells", "fedavg-a0.5-s2", "--cells", "fedavg-a0.3-s1"]) == 0
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split(":")[0].split()[1] for line in out] == ["fedavg-a0.3-s1", "fedavg-a0.5-s2"]
    assert papers.main(["run", str(table), "--runs", str(tmp_path / "r2"), "--cells", "fedavg-a0.4-s0"]) == 2
    err = capsys.readouterr().err
    assert "has no cell fedavg-a0.4-s0" in err and err.count("\n") == 1 and not (tmp_path / "r2").exists()


def test_the_papers_numbers_and_their_source_follow_the_table_file_not_the_process(tmp_path, capsys):
    """A table runs for days: a correction to the paper's numbers made while a process runs must not be undone when
    that process records its next cell (the records take the table file as it reads then), `describe` applies one
    without running a cell, and the block prints where the numbers were read."""
    papers = _papers()
    table = tmp_path / "t.yaml"
    spec = {"table": "t", "paper": "P, Table 1", "alphas": [0.1], "seeds": [0], "base": {},
            "methods": {"fedavg": {"preset": "fedavg"}},
            "columns": {"FedAvg": {"method": "fedavg", "key": "acc_fedavg"}}, "published": {"FedAvg": {0.1: None}}}
    table.write_text(yaml.safe_dump(spec))
    res = tmp_path / "res"
    assert papers.main(["describe", str(table), "--results", str(res)]) == 2  # no records yet: nothing to describe
    assert "has no records" in capsys.readouterr().err and not res.exists()
    started = papers.load_table(table)  # what a running process holds
    table.write_text(yaml.safe_dump({**spec, "published": {"FedAvg": {0.1: 41.5}}, "published_source": "Table 1, p. 7"}))
    cell = papers.cells(started)[0]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"round": 0, "acc_fedavg": 0.4}) + "\n")
    papers.copy_records(started, cell, run_dir, res, papers.load_table(table))
    shown = yaml.safe_load((res / "t" / "table.yaml").read_text())
    assert shown["published"]["FedAvg"][0.1] == 41.5 and shown["published_source"] == "Table 1, p. 7"
    assert "The paper's numbers: Table 1, p. 7" in papers.render(res)
    papers.copy_records(started, cell, run_dir, res)  # without the file: as the process read it
    assert yaml.safe_load((res / "t" / "table.yaml").read_text())["published"]["FedAvg"][0.1] is None
    assert papers.main(["describe", str(table), "--results", str(res)]) == 0
    assert yaml.safe_load((res / "t" / "table.yaml").read_text())["published"]["FedAvg"][0.1] == 41.5


def test_a_cell_recorded_without_a_server_whose_clients_are_gone_is_named_and_skipped_by_fuse_only(
        tmp_path, capsys, monkeypatch):
    """Checkpoints are never committed, so a cell recorded without DENSE on a machine that is gone has no clients
    to fuse over: the dry run says so, a --fuse-only pass skips it (and goes on to a cell whose clients are on disk)
    instead of failing on a missing run directory, a --fuse-only pass with no other cell is refused before it
    writes anything, and a training pass is told it will train them again."""
    papers = _papers()
    spec = papers.load_table(ROOT / "configs" / "papers" / "fedlpa-fmnist.yaml")
    gone, here = papers.cells(spec)[0], papers.cells(spec)[2]
    from flare.config.load import load_config
    for cell in (gone, here):
        rec = tmp_path / "res" / spec["table"] / cell["name"]
        rec.mkdir(parents=True)
        (rec / "config.yaml").write_text(yaml.safe_dump(load_config(overrides=cell["config"]).model_dump(mode="json")))
        (rec / "cell.json").write_text(json.dumps({"method": "fedavg", "alpha": cell["alpha"], "seed": 0,
                                                   "table": spec["table"]}))
        (rec / "fuse.jsonl").write_text(json.dumps({"kind": "fuse", "strategy": "fedlpa", "options": None}) + "\n")
    here_run = tmp_path / "runs" / spec["table"] / here["name"]
    calls = []
    monkeypatch.setattr(papers.subprocess, "call", lambda *a, **k: calls.append(a[0]) or 0)
    kw = dict(commit=False, overrides=[], dest=tmp_path / "res", only=(gone["name"],))
    papers.run(spec, tmp_path / "runs", dry_run=True, **kw)
    assert "recorded without dense; its clients are not on disk" in capsys.readouterr().out
    with pytest.raises(FlareError, match="1 recorded without a server, their clients not on disk") as e:
        papers.run(spec, tmp_path / "runs", dry_run=False, fuse_only=True, **kw)
    assert e.value.key == "--fuse-only" and calls == [] and not (tmp_path / "runs").exists()
    here_run.mkdir(parents=True)
    (here_run / "state.json").write_text(json.dumps({"status": "finished"}))
    shutil.copy(tmp_path / "res" / spec["table"] / here["name"] / "fuse.jsonl", here_run)  # fedlpa fused there
    kw["only"] = (gone["name"], here["name"])
    assert papers.run(spec, tmp_path / "runs", dry_run=False, fuse_only=True, **kw) == 0
    assert [(c[3], c[4], c[6]) for c in calls] == [("fuse", str(here_run), "dense")]
    log = (tmp_path / "runs" / spec["table"] / "progress.log").read_text()
    assert "its clients are not on disk; skipped" in log
    papers.run(spec, tmp_path / "runs", dry_run=True, fuse_only=False, **kw)
    assert "training them again" in capsys.readouterr().out


# ------------------------------------------------------------------- FedLPA's server as its reference builds it
def _reference_kfac(model, x, y, coor):
    """The reference's factors of every Linear / Conv2d, by its own formulas (kfac_utils.py ComputeCovA and
    ComputeCovG with batch_averaged=True, over one batch holding every sample), each + √(1 − coor)·I."""
    ins, outs = {}, {}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))}
    def keep(n):
        def hook(mod, args, out):
            ins[n] = args[0].detach()
            out.register_hook(lambda g: outs.__setitem__(n, g))
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in layers.items()]
    loss = F.cross_entropy(model(x)[1], y)  # the reference's CrossEntropyLoss: the batch mean
    loss.backward()
    for h in handles:
        h.remove()
    b, c, out = x.shape[0], (1 - coor) ** 0.5, {}
    for n, m in layers.items():
        a, g = ins[n], outs[n]
        if isinstance(m, torch.nn.Conv2d):
            a = F.unfold(a, m.kernel_size).transpose(1, 2)
            spatial = a.shape[1]
            a = torch.cat([a.reshape(-1, a.shape[-1]), a.new_ones(b * spatial, 1)], 1) / spatial
            g = g.permute(0, 2, 3, 1).reshape(-1, g.shape[1]) * b * spatial
            A, G = a.t() @ (a / b), g.t() @ (g / g.shape[0])
        else:
            a = torch.cat([a, a.new_ones(b, 1)], 1)
            A, G = a.t() @ (a / b), g.t() @ (g * b)
        out[f"{n}.A"] = A + c * torch.eye(A.shape[0])
        out[f"{n}.G"] = G + c * torch.eye(G.shape[0])
    return out


def test_the_reference_fedlpa_plugin_uploads_the_references_kfac_factors(monkeypatch):
    from flare.config import load_config
    from flare.server.extras import ClientData
    from flare.server.strategy import ServerContext, make_strategy
    from flare.server.upload import Upload

    monkeypatch.syspath_prepend(str(ROOT / "configs" / "papers" / "plugins"))
    importlib.import_module("flare_fedlpa_reference")
    torch.manual_seed(0)
    models = [create_model("simple-cnn", 1, 10, head="linear").eval() for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (40, 1, 28, 28), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (40,), generator=g)
    cfg = load_config(None, "fedavg", ["model.name=simple-cnn", "server.strategies.fedlpa_reference.batch_size=16"])
    s = make_strategy(cfg, "fedlpa_reference", "eval.rules")
    scale = lambda u: u.float() / 255  # noqa: E731
    extras = [s.client_extras(ClientData(i, m, x, y, scale, None, torch.device("cpu"))) for i, m in enumerate(models)]
    want = _reference_kfac(models[0], scale(x), y, coor=0.999)
    assert sorted(extras[0]) == sorted(want) and any(".conv" in k for k in want)
    for k, v in want.items():  # conv A divided by its 24·24 and 8·8 positions, G multiplied: a scale bug fails here
        assert torch.allclose(extras[0][k][0], v, rtol=1e-4, atol=1e-6), k
    uploads = [Upload(i, m.state_dict(), 40, None) for i, m in enumerate(models)]
    ctx = ServerContext(0, uploads, models, torch.tensor([0.5, 0.5]), None, None, extras=extras)
    fused = s.predictor(ctx).model.state_dict()
    assert fused.keys() == models[0].state_dict().keys()
    assert all(torch.isfinite(v).all() for v in fused.values())


def _one_dense_cell(tmp_path: Path, config: dict, rounds_seconds: float | None = None):
    """A table of one DENSE column at the published 200 epochs over one recorded cell (β = 0.3, seed 1) whose run
    directory holds `config` (and one round record of `rounds_seconds`): papers, the spec, the cell, the run
    directory, the results and runs roots, and the empty folder where the build's state goes."""
    papers = _papers()
    spec = {"table": "t", "paper": "P", "alphas": [0.3], "seeds": [1], "base": {},
            "methods": {"fedavg": {"preset": "fedavg", "fuse": ["dense"],
                                   "fuse_options": {"dense": {"epochs": 200, "curve_every": 2}}}},
            "columns": {"DENSE": {"method": "fedavg", "key": "fuse:dense", "paper_rule": "peak"}},
            "published": {"DENSE": {0.3: 64.27}}}
    res, runs = tmp_path / "res", tmp_path / "runs"
    cell = papers.cells(spec)[0]
    run_dir = runs / "t" / cell["name"]
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    if rounds_seconds is not None:
        (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "round", "round": 1,
                                                           "seconds": rounds_seconds}) + "\n")
    papers.copy_records(spec, cell, run_dir, res)
    (scratch := run_dir / "fuse-scratch" / "dense").mkdir(parents=True)
    return papers, spec, cell, run_dir, res, runs, scratch


def test_an_unfinished_fusion_is_recorded_as_progress_apart_from_the_columns(tmp_path, capsys):
    """A fusion at the published budget spans sittings and its state is never committed: `progress` records its
    curve so far beside the cell's records (no weights), the block prints it apart from the column (which stays
    empty), prices what is left at its own rate and draws it; two build states are named and skipped; the fuse
    record, when it lands, removes the note."""
    papers, spec, cell, run_dir, res, runs, scratch = _one_dense_cell(
        tmp_path, {"server": {"strategies": {"dense": {"epochs": 20, "g_steps": 30}}}})
    torch.save({"student": {"w": torch.zeros(3)}, "epoch": 4, "curve": [[2, 60, 0.3], [4, 120, 0.45]],
                "seconds": 100.0}, scratch / "a.pt")
    written, skipped = papers.progress(spec, runs, res)
    note = json.loads((res / "t" / cell["name"] / papers.PROGRESS).read_text())
    assert written and not skipped and note["dense"]["epoch"] == 4 and "student" not in note["dense"]
    out = papers.render(res, img_dir=tmp_path / "img")
    assert ("DENSE over the fedavg α = 0.3, seed-1 clients: **in progress, not a result** — epoch 4 of 200 "
            "(120 of 6,000 generator steps), 2 min so far") in out
    assert "the student's test accuracy every 60 steps: 30.00, 45.00 (highest 45.00 at step 120)." in out
    assert "| DENSE | 0.3 | 64.27 | not run | — | 0 | — | — | — (peak) | — |" in out  # the column holds no value
    # 100 s for 4 epochs: 196 more take 4,900 s
    assert "its dense server in progress, epoch 4 of 200 after 2 min (≈ 1.36 h more at its own rate)" in out
    assert "still to run: 1 client cell or fusion, ≈ 1.36 h at these rates" in out
    assert (tmp_path / "img" / "papers-t-curve.png").stat().st_size > 0
    torch.save({"epoch": 1, "curve": [], "seconds": 5.0}, scratch / "b.pt")  # a build at other options
    (res / "t" / cell["name"] / papers.PROGRESS).unlink()
    assert papers.main(["progress", str(_write_table(tmp_path, spec)), "--runs", str(runs),
                        "--results", str(res)]) == 2  # nothing recorded: said so, with why
    assert "2 dense build states (a.pt, b.pt)" in capsys.readouterr().err
    assert not (res / "t" / cell["name"] / papers.PROGRESS).exists()
    (scratch / "b.pt").unlink()
    papers.progress(spec, runs, res)
    (run_dir / "fuse.jsonl").write_text(json.dumps({"kind": "fuse", "strategy": "dense", "acc": 0.6,
                                                    "options": {"epochs": 200, "curve_every": 2}}) + "\n")
    papers.copy_records(spec, cell, run_dir, res)
    assert not (res / "t" / cell["name"] / papers.PROGRESS).exists() and "in progress" not in papers.render(res)


def _write_table(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "table.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_fusion_whose_state_is_gone_is_marked_stopped_and_priced_from_the_start(tmp_path, capsys):
    """A fusion's state lives on one machine; when that machine is replaced the note must stop saying "≈ N h more":
    `progress --stopped WHY` marks it (reason and date in the block), the cost prices the clients and the whole
    fusion again, and a state still on disk refuses the mark (exit 2, nothing written)."""
    papers, spec, cell, run_dir, res, runs, scratch = _one_dense_cell(
        tmp_path, {"server": {"strategies": {"dense": {"g_steps": 30}}}}, rounds_seconds=3600.0)
    torch.save({"epoch": 100, "curve": [[50, 1500, 0.5], [100, 3000, 0.55]], "seconds": 36000.0}, scratch / "a.pt")
    papers.progress(spec, runs, res)
    note = res / "t" / cell["name"] / papers.PROGRESS
    before = note.read_text()
    table = str(_write_table(tmp_path, spec))
    args = ["progress", table, "--runs", str(runs), "--results", str(res), "--stopped", "the machine was replaced"]
    assert papers.main(args) == 2  # its state is still here: it can go on
    assert "can go on" in capsys.readouterr().err and note.read_text() == before
    (scratch / "a.pt").unlink()
    assert papers.main(args[:-1] + [" "]) == 2 and note.read_text() == before  # no reason given
    assert papers.main(args) == 0
    assert json.loads(note.read_text())["dense"]["stopped"]["why"] == "the machine was replaced"
    out = papers.render(res, img_dir=tmp_path / "img")
    assert ("DENSE over the fedavg α = 0.3, seed-1 clients: **stopped, not a result** — at epoch 100 of 200 "
            "(3,000 of 6,000 generator steps), after 10.00 h") in out
    assert "in progress" not in out and ": the machine was replaced; the student's test accuracy" in out
    # the clients' 1 h again and 200 epochs at 360 s each (20 h): 21 h, two items
    assert ("its dense server stopped at epoch 100 of 200 after 10.00 h (to finish: the clients trained again and "
            "the fusion from its first epoch, ≈ 21.00 h at their own rates)") in out
    assert "still to run: 2 client cells and fusions, ≈ 21.00 h at these rates" in out
    assert papers.main(args) == 2  # already stopped: nothing left to mark
    assert "no recorded unfinished fusion" in capsys.readouterr().err


# --------------------------------------------------------------------------------- the table file's schema
def _complete_table(tmp_path: Path) -> tuple[Path, dict]:
    """A table file that gives every key of the schema (it extends a small parent beside it): the valid input each
    bad one below is made from. The file sets its keys itself, so the misspelling of any one is its own error."""
    parent = {"table": "parent", "alphas": [0.1], "seeds": [0], "base": {"rounds": 2},
              "methods": {"fedavg": {"preset": "fedavg"}},
              "columns": {"FedAvg": {"method": "fedavg", "key": "acc_fedavg"}}}
    child = {"extends": "parent.yaml", "table": "t", "paper": "P, Table 1", "note": "a diagnostic",
             "alphas": [0.1, 0.3], "seeds": {0.1: [0], 0.3: [0, 1]}, "spread": True,
             "base": {"rounds": 2, "local_epochs": 1},
             "methods": {"fedavg": {"preset": "fedavg", "label": "FedAvg", "fuse": ["dense"],
                                    "fuse_options": {"dense": {"epochs": 2}}, "config": {"lr": 0.05}}},
             "columns": {"FedAvg": {"method": "fedavg", "key": "acc_fedavg", "paper_rule": "final"},
                         "DENSE": {"method": "fedavg", "key": "fuse:dense", "paper_rule": "peak"}},
             "published": {"FedAvg": {0.1: 41.5, 0.3: None}}, "published_source": "Table 1, p. 7",
             "paired_with": [{"table": "t", "columns": {"DENSE": "FedAvg"}}]}
    (tmp_path / "parent.yaml").write_text(yaml.safe_dump(parent))
    return tmp_path / "t.yaml", child


def _schema_paths(model, example: dict, prefix: tuple = ()):
    """(path in `example`, field) of every key of `model` and of the sections inside it, walking the example into
    each section: a key the example lacks fails here, so a key added to the schema is a key these tests cover."""
    for name, field in model.model_fields.items():
        assert name in example, f"the complete table lacks {'.'.join(map(str, prefix + (name,)))}: add it"
        yield prefix + (name,), field
        for sub, value, path in _sections_in(field.annotation, example[name], prefix + (name,)):
            yield from _schema_paths(sub, value, path)


def _sections_in(ann, value, path):
    import typing
    from pydantic import BaseModel
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [(ann, value, path)] if isinstance(value, dict) else []
    if origin is dict and isinstance(value, dict) and value:
        k = next(iter(value))
        return _sections_in(args[1], value[k], path + (k,))
    if origin is list and isinstance(value, list) and value:
        return _sections_in(args[0], value[0], path + (0,))
    return [s for a in (args[:1] if origin is typing.Annotated else args) for s in _sections_in(a, value, path)]


def _wrong_values(field) -> list:
    """Values of other kinds than the field takes (a number where text belongs, text where a list or a mapping
    does, ...), as pydantic itself judges the field's type: two per key."""
    from pydantic import TypeAdapter, ValidationError
    import typing
    adapter = TypeAdapter(typing.Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation)
    out = []
    for value in (1.5, "wrong", ["wrong"], {"wrong": 1}):
        try:
            adapter.validate_python(value)
        except ValidationError:
            out.append(value)
    return out[:2]


def _set(mapping: dict, path: tuple, value) -> dict:
    import copy
    out = copy.deepcopy(mapping)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return out


def _rename(mapping: dict, path: tuple, new: str) -> dict:
    import copy
    out = copy.deepcopy(mapping)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[new] = node.pop(path[-1])
    return out


def _tree(root: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))} if root.exists() else {}


def _refused(papers, capsys, monkeypatch, args: list[str], key: str, runs: Path) -> str:
    """Run the command: exit 2, one paragraph on stderr naming `key`, no traceback, and nothing written — the runs
    directory and results/papers/ as they were, no flare process started. Returns the paragraph."""
    calls = []
    monkeypatch.setattr(papers.subprocess, "call", lambda *a, **k: calls.append(a) or 0)
    before = (_tree(runs), _tree(papers.RESULTS))
    assert papers.main(args) == 2, args
    out, err = capsys.readouterr()
    assert key in err, (key, err)
    assert err.startswith("papers: ") and err.count("\n") == 1 and "Traceback" not in err + out, err
    assert (_tree(runs), _tree(papers.RESULTS)) == before and calls == []
    return err


def test_the_complete_table_is_valid_and_the_docs_list_every_key(tmp_path, capsys):
    papers = _papers()
    table, spec = _complete_table(tmp_path)
    table.write_text(yaml.safe_dump(spec))
    assert papers.main(["run", str(table), "--runs", str(tmp_path / "runs"), "--dry-run"]) == 0
    assert "[1/3] fedavg-a0.1-s0: new" in capsys.readouterr().out and not (tmp_path / "runs").exists()
    paths = list(_schema_paths(papers.Table, spec))
    assert len(paths) == len(papers.table_keys()) > 20
    doc = (ROOT / "docs" / "papers.md").read_text()
    assert all(f"| `{key}` |" in doc for key, *_ in papers.table_keys())


def test_every_misspelt_key_is_refused_with_the_key_it_meant(tmp_path, capsys, monkeypatch):
    """Each key of the schema, misspelt (its last two letters swapped), in the complete table: refused, naming the key
    as written and the one it meant — a misspelt key is never silently ignored (`fuse_option:` would run DENSE at its
    full published budget)."""
    papers = _papers()
    table, spec = _complete_table(tmp_path)
    runs = tmp_path / "runs"
    for path, _ in _schema_paths(papers.Table, spec):
        name = path[-1]
        typo = name[:-2] + name[-1] + name[-2]
        table.write_text(yaml.safe_dump(_rename(spec, path, typo)))
        err = _refused(papers, capsys, monkeypatch, ["run", str(table), "--runs", str(runs)],
                       ".".join(map(str, path[:-1] + (typo,))), runs)
        assert f"did you mean '{name}'?" in err, err


def test_every_key_of_a_wrong_type_is_refused(tmp_path, capsys, monkeypatch):
    """Each key of the schema given values of other kinds than it takes (chosen by the field's own type): refused,
    naming the key."""
    papers = _papers()
    table, spec = _complete_table(tmp_path)
    runs = tmp_path / "runs"
    cases = [(path, value) for path, field in _schema_paths(papers.Table, spec) for value in _wrong_values(field)]
    assert len(cases) >= 2 * len(papers.table_keys()) - 6  # a key that takes anything has fewer wrong kinds
    for path, value in cases:
        table.write_text(yaml.safe_dump(_set(spec, path, value)))
        _refused(papers, capsys, monkeypatch, ["run", str(table), "--runs", str(runs)], ".".join(map(str, path)), runs)


@pytest.mark.parametrize("case", ["binary", "self-extends", "extends-cycle", "scalar-for-list", "no-preset",
                                  "misspelt-server-option", "misspelt-config-key", "alpha-range", "percent-range",
                                  "fuse-only"])
def test_a_table_file_the_tool_cannot_run_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch, case):
    papers = _papers()
    table, spec = _complete_table(tmp_path)
    runs, args = tmp_path / "runs", ["run", str(table), "--runs", str(tmp_path / "runs")]
    if case == "binary":
        table.write_bytes(bytes(range(256)) * 4)
        key = "t.yaml"
    elif case == "self-extends":
        table.write_text(yaml.safe_dump({**spec, "extends": "t.yaml"}))
        key = "extends"
    elif case == "extends-cycle":
        (tmp_path / "parent.yaml").write_text(yaml.safe_dump({**spec, "table": "parent", "extends": "t.yaml"}))
        table.write_text(yaml.safe_dump(spec))
        key = "extends"
    elif case == "scalar-for-list":
        table.write_text(yaml.safe_dump(_set(spec, ("methods", "fedavg", "fuse"), "dense")))
        key = "methods.fedavg.fuse"
    elif case == "no-preset":  # a table of its own (the parent's preset would fill it in)
        table.write_text(yaml.safe_dump({k: v for k, v in _set(spec, ("methods", "fedavg"), {"fuse": ["dense"]}).items()
                                         if k != "extends"}))
        key = "methods.fedavg.preset"
    elif case == "misspelt-server-option":  # the server's budget: FLARE's options for it, not the schema's keys
        table.write_text(yaml.safe_dump(_set(spec, ("methods", "fedavg", "fuse_options"), {"dense": {"epoch": 2}})))
        key = "methods.fedavg.fuse_options.dense.epoch"
    elif case == "misspelt-config-key":
        table.write_text(yaml.safe_dump(_set(spec, ("base", "roundz"), 2)))
        key = "base.roundz"
    elif case == "alpha-range":  # a Dirichlet α is > 0
        table.write_text(yaml.safe_dump({**spec, "alphas": [0.0, 0.3], "seeds": {0.0: [0], 0.3: [0, 1]}}))
        key = "alphas"
    elif case == "percent-range":
        table.write_text(yaml.safe_dump(_set(spec, ("published", "FedAvg", 0.1), 141.5)))
        key = "published.FedAvg.0.1"
    else:  # a valid table with nothing recorded: --fuse-only has no clients to fuse over
        table.write_text(yaml.safe_dump(spec))
        args.append("--fuse-only")
        key = "--fuse-only"
    err = _refused(papers, capsys, monkeypatch, args, key, runs)
    if case == "extends-cycle":
        assert "t.yaml → parent.yaml → t.yaml" in err
    if case == "fuse-only":
        assert "3 not recorded yet" in err


def test_progress_and_run_with_nothing_to_do_say_so(tmp_path, capsys, monkeypatch):
    papers, spec, cell, run_dir, res, runs, scratch = _one_dense_cell(tmp_path, {}, rounds_seconds=60.0)
    table = str(_write_table(tmp_path, spec))
    from flare.config.load import load_config
    (run_dir / "config.yaml").write_text(yaml.safe_dump(load_config(overrides=cell["config"]).model_dump(mode="json")))
    (run_dir / "state.json").write_text(json.dumps({"status": "finished"}))
    (run_dir / "fuse.jsonl").write_text(json.dumps({"kind": "fuse", "strategy": "dense", "acc": 0.6,
                                                    "options": {"epochs": 200, "curve_every": 2}}) + "\n")
    papers.copy_records(spec, cell, run_dir, res)
    before = _tree(res)
    assert papers.main(["progress", table, "--runs", str(runs), "--results", str(res)]) == 2
    assert "progress: nothing recorded" in capsys.readouterr().err and _tree(res) == before
    with pytest.raises(FlareError, match="the one cell of t is recorded with every server") as e:
        papers.run(spec, tmp_path / "fresh", commit=False, dry_run=False, overrides=[], dest=res)
    assert e.value.key == "run" and not (tmp_path / "fresh").exists()


def test_the_dry_run_prices_each_cell_at_the_tables_recorded_rates(tmp_path, capsys):
    """Recorded, resumable and new cells, each with what it will cost at the records' rates (a cell's round seconds,
    a server's fuse seconds), the total, and a server with no record yet named as unpriced; nothing written."""
    papers = _papers()
    spec = {"table": "t", "alphas": [0.1], "seeds": [0, 1, 2], "base": {"rounds": 2},
            "methods": {"fedavg": {"preset": "fedavg", "fuse": ["dense", "feddf"]}},
            "columns": {"DENSE": {"method": "fedavg", "key": "fuse:dense"}}}
    res, runs = tmp_path / "res", tmp_path / "runs"
    done = res / "t" / "fedavg-a0.1-s0"
    done.mkdir(parents=True)
    (done / "metrics.jsonl").write_text("".join(json.dumps({"kind": "round", "seconds": 1800.0}) + "\n" for _ in "ab"))
    (done / "fuse.jsonl").write_text("".join(json.dumps({"kind": "fuse", "strategy": s, "acc": 0.5, "seconds": 900.0})
                                             + "\n" for s in ("dense", "feddf")))
    (done / "cell.json").write_text(json.dumps({"method": "fedavg", "alpha": 0.1, "seed": 0, "table": "t",
                                                "fuse": ["dense", "feddf"], "fuse_options": {}}))
    (done / "fuse.jsonl").write_text(json.dumps({"kind": "fuse", "strategy": "dense", "acc": 0.5, "seconds": 900.0})
                                     + "\n")  # recorded without feddf: no rate for it
    partial = runs / "t" / "fedavg-a0.1-s1"
    partial.mkdir(parents=True)
    (partial / "metrics.jsonl").write_text(json.dumps({"kind": "round", "seconds": 1200.0}) + "\n")
    before = (_tree(res), _tree(runs))
    assert papers.run(spec, runs, commit=False, dry_run=True, overrides=[], dest=res) == 0
    out = capsys.readouterr().out.splitlines()
    # the recorded cell lacks feddf, its clients not on disk: trained again (1 h), and both servers fused over them
    assert out[0] == ("[1/3] fedavg-a0.1-s0: recorded without feddf; its clients are not on disk (checkpoints are "
                      "never committed): training them again — ≈ 1.25 h: clients 1.00 h, dense 15 min; no rate yet for its feddf "
                      "fusion")
    assert out[1] == ("[2/3] fedavg-a0.1-s1: resumable (1 of 2 rounds done) — ≈ 55 min: clients 40 min, dense 15 min; "
                      "no rate yet for its feddf fusion")
    assert out[2] == "[3/3] fedavg-a0.1-s2: new — ≈ 1.25 h: clients 1.00 h, dense 15 min; no rate yet for its feddf fusion"
    assert out[3].startswith("3 of 3 cells to run (3 to train, 6 fusions): ≈ 3.42 h at the wall times recorded in ")
    assert out[3].endswith("no rate yet for fedavg-a0.1-s0's feddf fusion, fedavg-a0.1-s1's feddf fusion, "
                           "fedavg-a0.1-s2's feddf fusion.")
    assert (_tree(res), _tree(runs)) == before


# ------------------------------------------------------------------- the paper's own code, and what n can say
def _fake_reference(root: Path, table: str, method: str, alpha: float, seed: int, values: dict | None = None,
                    progress: dict | None = None) -> None:
    """A run of the paper's own code as benchmarks/reference_dense.py writes it: record.json when it finished
    (its keys: method, alpha, seed, partition.used, accuracy_unit and the values), progress.json while it runs."""
    d = root / table / f"{method}-a{alpha:g}-s{seed}"
    d.mkdir(parents=True)
    if values is not None:
        (d / "record.json").write_text(json.dumps({"reference": "zj-jayzhang/DENSE loop_df_fl.py", "table": table,
                                                   "cell": d.name, "method": method, "alpha": alpha, "seed": seed,
                                                   "partition": {"used": "flare"}, "accuracy_unit": "percent",
                                                   **values}))
    if progress is not None:
        (d / "progress.json").write_text(json.dumps(progress))


def _draws_table(root: Path, pub: dict, values: dict, rule: str = "final", extra: dict | None = None) -> None:
    """A table t of one FedAvg column at α = 0.3 (DENSE's key and the paper's `pub`), seed → final accuracy."""
    spec = {"table": "t", "paper": "P", "alphas": [0.3], "seeds": sorted(values), **(extra or {}),
            "columns": {"FedAvg": {"method": "fedavg", "key": "acc_fedavg", "paper_rule": rule},
                        "Ensemble": {"method": "fedavg", "key": "acc_output", "paper_rule": "final"}},
            "published": {"FedAvg": {0.3: pub}}}
    (root / "t").mkdir(parents=True)
    (root / "t" / "table.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    for s, v in values.items():
        _fake_cell(root, "t", "fedavg", 0.3, s, [v])


def test_their_code_column_sits_between_the_paper_and_flare_and_names_the_pair_that_differs(tmp_path):
    """A cell with a finished run of the paper's code prints its value between the paper's number and FLARE's; an
    unfinished one its progress; none "not run". A cell more than 3 points from the paper names the pair that
    differs, with the numbers: the paper against its code, its code against FLARE on the same seeds, or both."""
    papers = _papers()
    res, ref = tmp_path / "res", tmp_path / "ref"
    _draws_table(res, 82.96, {0: 0.70, 1: 0.74, 2: 0.66})
    _fake_reference(ref, "t", "fedavg", 0.3, 0, {"fedavg": 71.2, "ensemble": 75.5})
    _fake_reference(ref, "t", "fedavg", 0.3, 1, progress={
        "status": "running", "argv": ["--num_users", "5", "--local_ep", "200"],
        "clients": {"0": {"acc_per_epoch": [60.0] * 200, "seconds": 900.0},
                    "1": {"acc_per_epoch": [61.0] * 200, "seconds": 950.0}, "2": {"acc_per_epoch": [50.0] * 40}}})
    out = papers.render(res, reference=ref)
    row = next(line for line in out.splitlines() if line.startswith("| FedAvg"))
    assert row.startswith("| FedAvg | 0.3 | 82.96 | 71.20 (seed 0); seed 1: running, 2 of 5 clients (client 2 at "
                          "epoch 40 of 200) | 0–2 | 3 | 70.00 ± 4.00 |"), row
    assert "| Ensemble | 0.3 | not in the paper | 75.50 (seed 0);" in out
    assert "| paper | their code | FLARE: seeds |" in out
    # FLARE 70.00 is 12.96 under the paper; their code 71.20 misses the paper by 11.76, FLARE's seed 0 (70.00) is
    # within 3 points of it: the gap is between the paper and its code
    line = next(x for x in out.splitlines() if x.startswith("* FedAvg, α = 0.3 (final): FLARE"))
    assert line == ("* FedAvg, α = 0.3 (final): FLARE 70.00 is 12.96 points under the paper's 82.96; their code "
                    "reads 71.20 (seed 0). Differs: paper ↔ its code (82.96 against 71.20, 11.76 points); within 3 "
                    "points: its code ↔ FLARE (71.20 against 70.00 on seed 0, 1.20 points).")
    # their code at the paper's number, FLARE not: the gap is between the code and FLARE
    shutil.rmtree(ref)
    _fake_reference(ref, "t", "fedavg", 0.3, 0, {"fedavg": 82.0})
    line = next(x for x in papers.render(res, reference=ref).splitlines() if "(final): FLARE" in x)
    assert "Differs: its code ↔ FLARE (82.00 against 70.00 on seed 0, 12.00 points); within 3 points: paper ↔ its " \
           "code (82.96 against 82.00, 0.96 points)." in line
    # between both
    shutil.rmtree(ref)
    _fake_reference(ref, "t", "fedavg", 0.3, 0, {"fedavg": 77.0})
    line = next(x for x in papers.render(res, reference=ref).splitlines() if "(final): FLARE" in x)
    assert "Differs: paper ↔ its code (82.96 against 77.00, 5.96 points); its code ↔ FLARE (77.00 against 70.00 on " \
           "seed 0, 7.00 points)." in line
    # no run of the paper's code: the column says so, and no pair is named
    out = papers.render(res, reference=tmp_path / "none")
    assert "| FedAvg | 0.3 | 82.96 | not run |" in out and "↔" not in out


def test_a_code_flare_gap_is_placed_by_the_oracle_of_its_alpha(tmp_path):
    """A code ↔ FLARE pair beyond 3 points says where it differs, from the table's identical-tensors oracle: the
    client step on identical tensors, the server over the script's own clients (its value against FLARE's), and the
    rest left to the random draws the script's seed made unequal. An oracle of another α places nothing."""
    papers = _papers()
    res, ref = tmp_path / "res", tmp_path / "ref"
    _draws_table(res, 82.96, {0: 0.70, 1: 0.74, 2: 0.66})
    _fake_reference(ref, "t", "fedavg", 0.3, 0, {"fedavg": 82.0})
    oracle = {"tool": "benchmarks/reference_dense_oracle.py", "alpha": 0.3, "seed": 0,
              "local": {"script_vs_flare": {"first_divergence": None, "steps": [{"max_abs_diff": 0.0}]}},
              "own_draws": {"init_max_abs_diff": 0.0, "split_equals_flare": True,
                            "first_epoch_order_equals_flare": False},
              "server": {"script": {"fedavg": 80.0, "ensemble": 81.0}, "flare": {"fedavg": 79.0, "ensemble": 81.0}}}
    (ref / "t" / "oracle").mkdir()
    (ref / "t" / "oracle" / "a.json").write_text(json.dumps(oracle))
    line = next(x for x in papers.render(res, reference=ref).splitlines() if "(final): FLARE" in x)
    # FLARE's seed 0 reads 70.00 against the code's 82.00: −12, of which the server explains −1
    assert line.endswith("Where it differs: on identical tensors (below) the client step is bit-identical and "
                         "FLARE's server over the script's own clients reads 79.00 against its 80.00 (-1.00), which "
                         "leaves -11.00 points to the clients' random draws — at seed 0 the script's batch order is "
                         "not FLARE's, the rest of its draws are."), line
    oracle["local"]["script_vs_flare"] = {"first_divergence": {"step": 5, "max_abs_diff": 0.5, "worst_tensor": "w"},
                                          "steps": []}
    (ref / "t" / "oracle" / "a.json").write_text(json.dumps(oracle))
    line = next(x for x in papers.render(res, reference=ref).splitlines() if "(final): FLARE" in x)
    assert "the client step is apart from step 5 on (5.0e-01 in `w`)" in line, line
    # a second seed of the code: the server's share still comes from the oracle's own seed, whose clients it fused
    oracle["local"]["script_vs_flare"] = {"first_divergence": None, "steps": [{"max_abs_diff": 0.0}]}
    (ref / "t" / "oracle" / "a.json").write_text(json.dumps(oracle))
    _fake_reference(ref, "t", "fedavg", 0.3, 1, {"fedavg": 78.0})
    line = next(x for x in papers.render(res, reference=ref).splitlines() if "(final): FLARE" in x)
    assert "its code ↔ FLARE (80.00 against 72.00 on seeds 0,1, 8.00 points)" in line, line
    assert "reads 79.00 against its 80.00 (-1.00) on seed 0, where FLARE − code is -12.00, which leaves -11.00 " \
           "points to the clients' random draws" in line, line
    # an oracle of each seed: each seed's pair placed with its own clients
    seed1 = {"script": {"fedavg": 77.0, "ensemble": 1.0}, "flare": {"fedavg": 76.0, "ensemble": 1.0}}
    (ref / "t" / "oracle" / "b.json").write_text(json.dumps({**oracle, "seed": 1, "server": seed1}))
    line = next(x for x in papers.render(res, reference=ref).splitlines() if "(final): FLARE" in x)
    assert "which leaves -11.00 points to the clients' random draws — at seed 0 the script's batch order is not " \
           "FLARE's, the rest of its draws are; and FLARE's server over the script's own clients reads 76.00 against " \
           "its 77.00 (-1.00) on seed 1, where FLARE − code is -4.00, which leaves -3.00 points to the clients' " \
           "random draws — at seed 1 the script's batch order is not FLARE's" in line, line
    for f in ("a.json", "b.json"):  # oracles that replayed FLARE's draws: that remark once, not once a seed
        o = json.loads((ref / "t" / "oracle" / f).read_text())
        (ref / "t" / "oracle" / f).write_text(json.dumps({k: v for k, v in o.items() if k != "own_draws"}))
    line = next(x for x in papers.render(res, reference=ref).splitlines() if "(final): FLARE" in x)
    assert line.count("so which draw it is was not measured") == 1 and line.endswith(
        "which leaves -3.00 points to the clients' random draws — the oracle gave the script FLARE's initial weights "
        "and batch order, so which draw it is was not measured."), line
    (ref / "t" / "oracle" / "b.json").unlink()
    oracle["seed"] = 2  # clients of a seed the code did not run: nothing to subtract them from
    (ref / "t" / "oracle" / "a.json").write_text(json.dumps(oracle))
    line = next(x for x in papers.render(res, reference=ref).splitlines() if "(final): FLARE" in x)
    assert line.endswith("not placed — on identical tensors (below) the client step is bit-identical; its server ran "
                         "over the seed-2 clients, a seed the code and FLARE did not both run."), line
    oracle["alpha"] = 0.5
    (ref / "t" / "oracle" / "a.json").write_text(json.dumps(oracle))
    line = next(x for x in papers.render(res, reference=ref).splitlines() if "(final): FLARE" in x)
    assert line.endswith("Where it differs: not measured at this α (the oracle ran at α = 0.5, below)."), line


def _dense_table(res: Path) -> None:
    """A one-cell table of a DENSE column (the paper's 83.96 at α = 0.3, its best epoch) whose FLARE seed 0 fuses
    to 61.00."""
    spec = {"table": "t", "paper": "P", "alphas": [0.3], "seeds": [0],
            "columns": {"DENSE": {"method": "fedavg", "key": "fuse:dense", "paper_rule": "peak"}},
            "published": {"DENSE": {0.3: 83.96}}}
    (res / "t").mkdir(parents=True)
    (res / "t" / "table.yaml").write_text(yaml.safe_dump(spec))
    _fake_cell(res, "t", "fedavg", 0.3, 0, [0.7], {"dense": 0.61})


def test_dense_reference_reads_the_students_best_epoch_at_the_papers_rule(tmp_path):
    """DENSE's column reads the reference's student at the column's rule (its best epoch for `peak`, the paper's
    selection; its last for `final`); a fusion under way prints its epochs; a run on the script's own split is
    another experiment and is not read."""
    papers = _papers()
    res, ref = tmp_path / "res", tmp_path / "ref"
    _dense_table(res)
    _fake_reference(ref, "t", "dense", 0.3, 0, progress={"status": "running", "argv": ["--epochs", "20"],
                                                         "student_curve": [{"epoch": 1, "acc": 40.0}] * 7})
    assert "| DENSE | 0.3 | 83.96 | seed 0: running, epoch 7 of 20 |" in papers.render(res, reference=ref)
    shutil.rmtree(ref)
    _fake_reference(ref, "t", "dense", 0.3, 0, {"student_final": 62.5, "student_best": 64.0})
    own = ref / "t" / "dense-a0.3-s1-own-split"
    own.mkdir()
    (own / "record.json").write_text(json.dumps({"method": "dense", "alpha": 0.3, "seed": 1, "student_best": 99.0,
                                                 "partition": {"used": "own"}}))
    out = papers.render(res, reference=ref)
    assert "| DENSE | 0.3 | 83.96 | 64.00 (seed 0) |" in out and "99.00" not in out


def test_fedlpa_reference_fills_the_fedlpa_column_and_its_progress_reads_either_scripts_clients(tmp_path):
    """FedLPA's table reads its own code's runs (benchmarks/reference_fedlpa.py): the FedLPA column the printed
    better-of-two value, DENSE the student's best epoch; a run under way prints its clients from FedLPA's per-epoch
    losses, and DENSE's pretrain its clients before its fusion's epochs; a shortened smoke of the code
    (`table_setting: false`) is never read as the cell."""
    papers = _papers()
    res, ref = tmp_path / "res", tmp_path / "ref"
    spec = {"table": "t", "paper": "P", "alphas": [0.1], "seeds": [0, 1],
            "columns": {"FedLPA": {"method": "fedavg", "key": "fuse:fedlpa", "paper_rule": "final"},
                        "DENSE": {"method": "fedavg", "key": "fuse:dense", "paper_rule": "peak"}},
            "published": {"FedLPA": {0.1: 55.33}, "DENSE": {0.1: 52.93}}}
    (res / "t").mkdir(parents=True)
    (res / "t" / "table.yaml").write_text(yaml.safe_dump(spec))
    _fake_cell(res, "t", "fedavg", 0.1, 0, [0.3], {"fedlpa": 0.47, "dense": 0.40})
    _fake_cell(res, "t", "fedavg", 0.1, 1, [0.3], {"fedlpa": 0.45, "dense": 0.42})
    _fake_reference(ref, "t", "fedlpa", 0.1, 0, {"fedlpa": 48.5, "newton": 48.5, "biased": 31.0})
    _fake_reference(ref, "t", "fedlpa", 0.1, 1, progress={
        "status": "running", "phase": "fedlpa", "num_clients": 10, "local_epochs": 200, "argv": ["--epochs=200"],
        "clients": {"0": {"loss_per_epoch": [1.0] * 200, "seconds": 60.0}, "1": {"loss_per_epoch": [1.0] * 57}}})
    _fake_reference(ref, "t", "dense", 0.1, 0, progress={
        "status": "running", "phase": "pretrain", "num_clients": 10, "local_epochs": 200, "server_epochs": 20,
        "clients": {"0": {"acc_per_epoch": [50.0] * 200, "seconds": 90.0}, "1": {"acc_per_epoch": [40.0] * 3}}})
    smoke = ref / "t" / "fedlpa-a0.1-s1-smoke-e2"
    smoke.mkdir()
    (smoke / "record.json").write_text(json.dumps({"method": "fedlpa", "alpha": 0.1, "seed": 1, "fedlpa": 99.0,
                                                   "table_setting": False, "partition": {"used": "flare"}}))
    out = papers.render(res, reference=ref)
    row = next(line for line in out.splitlines() if line.startswith("| FedLPA"))
    assert row.startswith("| FedLPA | 0.1 | 55.33 | 48.50 (seed 0); seed 1: running, 1 of 10 clients (client 1 at "
                          "epoch 57 of 200) | 0,1 | 2 |"), row
    assert "99.00" not in out
    assert "| DENSE | 0.1 | 52.93 | seed 0: running, 1 of 10 clients (client 1 at epoch 3 of 200) |" in out
    line = next(x for x in out.splitlines() if x.startswith("* FedLPA, α = 0.1 (final): FLARE"))
    assert "Differs: paper ↔ its code (55.33 against 48.50, 6.83 points); within 3 points: its code ↔ FLARE " \
           "(48.50 against 47.00 on seed 0, 1.50 points)." in line
    # the fusion under way: its epochs, not its clients
    shutil.rmtree(ref / "t" / "dense-a0.1-s0")
    _fake_reference(ref, "t", "dense", 0.1, 0, progress={
        "status": "running", "phase": "kd_train", "server_epochs": 20, "clients": {"0": {"seconds": 1.0}},
        "student_curve": [{"epoch": 1, "acc": 30.0}] * 4})
    assert "| DENSE | 0.1 | 52.93 | seed 0: running, epoch 4 of 20 |" in papers.render(res, reference=ref)


def test_n_too_small_to_separate_is_said_instead_of_the_paper_lying_inside_the_interval(tmp_path):
    """Every multi-draw cell prints n, the mean, the SD and the 95 % t interval; where the interval is wider than
    the distance to the paper's number, the block says n cannot separate them — the paper "inside our interval"
    is what any n that small gives, and is never printed as a finding."""
    papers = _papers()
    _draws_table(tmp_path, 74.0, {0: 0.682, 1: 0.742, 2: 0.712})
    out = papers.render(tmp_path)
    row = next(line for line in out.splitlines() if line.startswith("| FedAvg"))
    # 68.2, 74.2, 71.2 → mean 71.20, SD 3.00, half-width 4.303 · 3 / √3 = 7.45
    assert "| 0–2 | 3 | 71.20 ± 3.00 | 63.75 – 78.65 (±7.45) |" in row
    assert "* FedAvg, α = 0.3: n = 3 cannot separate 71.20 from the paper's 74.00: the interval is ±7.45 points, " \
           "the distance 2.80." in out
    assert not any(w in out for w in ("inside", "lies", "| yes |"))
    shutil.rmtree(tmp_path / "t")
    _draws_table(tmp_path, 90.0, {0: 0.682, 1: 0.742, 2: 0.712})
    assert "* FedAvg, α = 0.3: n = 3 separates 71.20 from the paper's 90.00: 18.80 points apart, beyond the " \
           "interval's ±7.45." in papers.render(tmp_path)


def test_draws_added_after_the_first_records_are_flagged_and_left_out_of_the_tests(tmp_path):
    """Twenty draws recorded where ten were registered: the table is flagged, its n, interval and rank test use the
    ten, the other ten are listed as post hoc (hollow in the figure), and the test over all twenty is given apart,
    marked as no test."""
    papers = _papers()
    values = {s: 0.60 + 0.01 * s for s in range(20)}  # 60 … 79, all under the paper's 82.96
    _draws_table(tmp_path, 82.96, values, extra={"spread": True, "registered_seeds": {0.3: list(range(10))}})
    out = papers.render(tmp_path, img_dir=tmp_path / "img")
    assert "**Draws added after the first records — post hoc.** At α = 0.3 the table registered seeds 0–9 with its " \
           "first α = 0.3 record; seeds 10–19 were added after 10 draws had been recorded." in out
    row = next(line for line in out.splitlines() if line.startswith("| FedAvg"))
    assert "| 0–9 (+10–19 post hoc) | 10 | 64.50 ± 3.03 |" in row
    assert "rank probability (0 + 1)/(10 + 1) = 0.091 (one-sided): the smallest p that 10 draws allow, and above " \
           "0.05: 10 draws cannot reject it whatever the paper ran (19 could). Over all 20 draws, post hoc and not a " \
           "test: (0 + 1)/(20 + 1) = 0.048." in out
    assert "added post hoc: 10: 70.00, 11: 71.00" in out
    assert (tmp_path / "img" / "papers-t-spread.png").stat().st_size > 0
    # the registered draws alone: no flag
    spec = yaml.safe_load((tmp_path / "t" / "table.yaml").read_text())
    spec["registered_seeds"] = {0.3: list(range(20))}
    (tmp_path / "t" / "table.yaml").write_text(yaml.safe_dump(spec))
    out = papers.render(tmp_path)
    assert "Draws added after" not in out and "| 0–19 | 20 |" in out and "added post hoc:" not in out


def test_run_refuses_seeds_added_to_a_recorded_table_unless_it_is_a_new_table(tmp_path, capsys, monkeypatch):
    """The draws of a recorded α are registered with its first record and kept by every later record: a table file
    that adds a seed there is refused by `run` and `describe` (exit 2, one paragraph naming `seeds`, nothing
    written); the same seeds under a new `table:` name are a new experiment and run; a new α is registered anew."""
    papers = _papers()
    table, res, runs = tmp_path / "t.yaml", tmp_path / "res", tmp_path / "runs"
    spec = {"table": "t", "paper": "P", "alphas": [0.1, 0.3], "seeds": {0.1: [0, 1], 0.3: [0, 1]}, "base": {},
            "methods": {"fedavg": {"preset": "fedavg"}},
            "columns": {"FedAvg": {"method": "fedavg", "key": "acc_fedavg"}}}
    table.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "round", "acc_fedavg": 0.4}) + "\n")
    started = papers.load_table(table, records=res)
    papers.copy_records(started, papers.cells(started)[0], run_dir, res)  # fedavg-a0.1-s0: α = 0.1 registered
    assert yaml.safe_load((res / "t" / "table.yaml").read_text())["registered_seeds"] == {0.1: [0, 1]}
    grown = {**spec, "seeds": {0.1: [0, 1, 2, 3], 0.3: [0, 1, 2]}}  # 0.3 has no record yet: free to change
    table.write_text(yaml.safe_dump(grown))
    for args in (["run", str(table), "--runs", str(runs), "--results", str(res)],
                 ["describe", str(table), "--results", str(res)]):
        monkeypatch.setattr(papers, "RESULTS", res)  # _refused checks that the records directory is untouched
        err = _refused(papers, capsys, monkeypatch, args, "seeds.0.1", runs)
        assert "add 2,3 to the draws t registered when its first α = 0.1 cell was recorded (0,1)" in err
        assert "new `table:` name" in err
    # a description written while the file reads so (the running process re-reads it) keeps the registration
    papers.copy_records(started, papers.cells(started)[1], run_dir, res, grown)
    assert yaml.safe_load((res / "t" / "table.yaml").read_text())["registered_seeds"] == {0.1: [0, 1],
                                                                                           0.3: [0, 1, 2]}
    # the same draws as a new experiment: a new name, nothing recorded under it
    table.write_text(yaml.safe_dump({**grown, "table": "t-more"}))
    assert papers.main(["run", str(table), "--runs", str(runs), "--results", str(res), "--dry-run"]) == 0
    assert "new" in capsys.readouterr().out
    # fewer seeds than registered is no extension
    table.write_text(yaml.safe_dump({**spec, "seeds": {0.1: [0], 0.3: [0, 1, 2]}}))
    assert papers.main(["run", str(table), "--runs", str(runs), "--results", str(res), "--dry-run"]) == 0
    # a description written before registration was kept: the seeds it lists are what is registered
    shown = yaml.safe_load((res / "t" / "table.yaml").read_text())
    del shown["registered_seeds"]
    (res / "t" / "table.yaml").write_text(yaml.safe_dump({**shown, "seeds": {0.1: [0, 1], 0.3: [0, 1]}}))
    assert papers.registered_seeds(res / "t" / "table.yaml") == {0.1: [0, 1], 0.3: [0, 1]}
    table.write_text(yaml.safe_dump(grown))
    with pytest.raises(FlareError, match="seeds at α = 0.1 add 2,3"):
        papers.load_table(table, records=res)
    papers.copy_records(started, papers.cells(started)[0], run_dir, res, started)
    assert yaml.safe_load((res / "t" / "table.yaml").read_text())["registered_seeds"] == {0.1: [0, 1], 0.3: [0, 1]}


def test_a_code_flare_gap_is_placed_by_flares_server_over_the_scripts_own_clients(tmp_path):
    """benchmarks/reference_fuse.py's record (FLARE's strategy over the clients a run of the paper's code kept) places
    a server column's code ↔ FLARE gap at the column's rule: the server's share, the rest left to the clients. A
    client step compared on identical tensors for another script of the paper is not borrowed; one for the same
    script is."""
    papers = _papers()
    res, ref = tmp_path / "res", tmp_path / "ref"
    _dense_table(res)
    _fake_reference(ref, "t", "dense", 0.3, 0, {"student_final": 55.0, "student_best": 56.0})
    fuse = {"tool": "benchmarks/reference_fuse.py", "alpha": 0.3, "seed": 0, "strategy": "dense",
            "fuse_options": {"epochs": 20}, "reference": {"reference": "o/r train_dense.py"},
            "script": {"final": 55.0, "best": 56.0, "fedavg": 40.0, "ensemble": 70.0},
            "flare": {"final": 57.5, "best": 58.0, "fedavg": 40.1, "ensemble": 70.2, "client_sizes": [1, 2],
                      "cpu_seconds": 3600.0}}
    other = {"tool": "benchmarks/reference_dense_oracle.py", "alpha": 0.3, "seed": 0,
             "reference": "o/r train_fedavg.py --type pretrain",
             "local": {"script_vs_flare": {"first_divergence": None, "steps": [{"max_abs_diff": 0.0}]}}}
    (ref / "t" / "oracle").mkdir()
    (ref / "t" / "oracle" / "b-fuse.json").write_text(json.dumps(fuse))
    (ref / "t" / "oracle" / "a.json").write_text(json.dumps(other))

    def line():
        return next(x for x in papers.render(res, reference=ref).splitlines() if "(peak): FLARE" in x)

    # FLARE's own seed 0 reads 61.00 against the code's best 56.00 (+5): the server holds +2 (58 against 56)
    assert line().endswith("Where it differs: `train_dense.py`'s client step was not compared on identical tensors; "
                           "FLARE's `dense` over the clients the script trained reads 58.00 against its 56.00 (+2.00, "
                           "the server's share), which leaves +3.00 points to the clients (the script's training code "
                           "and its random draws against FLARE's)."), line()
    other["reference"] = "o/r train_dense.py --type pretrain"
    (ref / "t" / "oracle" / "a.json").write_text(json.dumps(other))
    assert "Where it differs: on identical tensors (below) `train_dense.py`'s client step is bit-identical; FLARE's " \
           "`dense` over the clients the script trained reads 58.00" in line(), line()
    out = papers.render(res, reference=ref)
    assert ("FLARE's `dense` as the column runs it (epochs 20) reads 57.50 at its last epoch and 58.00 at its best, "
            "against the script's 55.00 and 56.00; the same clients' FedAvg 40.10 and ensemble 70.20 in FLARE, 40.00 "
            "and 70.00 in the script (1.00 CPU-hours") in out
    fuse["alpha"] = 0.5  # a server over another α's clients places nothing here
    (ref / "t" / "oracle" / "b-fuse.json").write_text(json.dumps(fuse))
    assert "not placed — on identical tensors (below) `train_dense.py`'s client step is bit-identical, but no oracle " \
           "runs this column's server over the script's clients" in line(), line()


def test_the_three_numbers_figure_shows_the_cells_with_a_run_of_the_code_and_only_them(tmp_path, monkeypatch):
    """The figure beside the block: a row per cell with a finished run of the paper's code, the code's seeds and
    FLARE's at the paper's rule and the paper's number; no run of the code, no figure and no line naming one."""
    papers = _papers()
    res, ref, img = tmp_path / "res", tmp_path / "ref", tmp_path / "img"
    _draws_table(res, 82.96, {0: 0.70, 1: 0.74, 2: 0.66})
    assert "three-numbers" not in papers.render(res, img_dir=img, reference=ref)
    assert not (img / "papers-t-three-numbers.png").exists()
    _fake_reference(ref, "t", "fedavg", 0.3, 0, {"fedavg": 71.2, "ensemble": 75.5})
    drawn = []
    real = papers.three_numbers_figure
    monkeypatch.setattr(papers, "three_numbers_figure", lambda spec, rows, d: drawn.append(rows) or real(spec, rows, d))
    out = papers.render(res, img_dir=img, reference=ref)
    assert "(img/papers-t-three-numbers.png)" in out and (img / "papers-t-three-numbers.png").stat().st_size > 0
    (rows,) = drawn
    shown = [(r["col"], r["theirs"], r["chosen"], r["pub"]) for r in rows if r["theirs"]]
    assert shown == [("FedAvg", {0: 71.2}, {0: 70.0, 1: 74.0, 2: 66.0}, 82.96),
                     ("Ensemble", {0: 75.5}, {}, None)], shown  # the fake cells record FedAvg alone
    assert out == papers.render(res, reference=ref)  # the check names the figure without drawing it
