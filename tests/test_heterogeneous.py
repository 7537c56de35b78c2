"""Clients of different architectures (docs/heterogeneous.md): `model.clients` / `model.mix` / `model.feature_dim` /
`server.model`, resolved at config validation, trained per architecture, fused by the strategies that can.

The runs are tiny Fashion-MNIST (600 train, 200 test images, 3 clients at width 0.125): one mixed run of
[cnn, wrn16_1, cnn_dense] with a shared d = 16 is trained once per session and copied to the tests that read, fuse or
resume it (conftest.copy_of_finished_run).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import copy_of_finished_run, run_interrupted
from flare.baselines.kd import fresh_model
from flare.cli import main
from flare.client.batched import BatchedClients
from flare.config import config_to_yaml, load_config
from flare.config.architectures import server_architecture
from flare.data import formats
from flare.metrics import model_variance_mean
from flare.models import create_model
from flare.rundir import read_jsonl
from flare.runner import Run
from flare.server.rounds import rules_for
from flare.server.rules import FedAvgRule, fedavg_model
from flare.server.strategy import ServerContext, make_strategy, strategy_facts
from flare.server.upload import Upload

pytestmark = pytest.mark.skipif(not all((formats.DEBIAN_FMNIST / f"{s}.gz").exists() for s in formats._IDX_FILES),
                                reason="dataset-fashion-mnist is not installed")

NAMES = ["cnn", "wrn16_1", "cnn_dense"]  # d = 16, 8, 8 at width 0.125: they need model.feature_dim
TINY = ["dataset.name=fmnist", "dataset.train_subset=600", "dataset.test_subset=200", "num_clients=3", "rounds=1",
        "model.name=cnn", "model.width=0.125", "batch_size=32", "device=cpu"]
MIXED = [f"model.clients=[{','.join(NAMES)}]", "model.feature_dim=16"]
# small enough for the fuse test: the strategies' options live in the run's config
STRATEGY_OPTIONS = ["dataset.public_size=100", "server.strategies.feddf.steps=10",
                    *(f"server.strategies.{n}.{k}={v}" for n in ("dense", "coboosting", "intactofl")
                      for k, v in (("epochs", 1), ("g_steps", 1), ("synthesis_batch", 16), ("batch_size", 16)))]
FUSES_MIXED = ["output", "feature", "bnrecal", "fedproto_fused", "feddf", "dense", "coboosting", "intactofl"]
ONE_ARCHITECTURE = ["fedavg", "otfusion", "regmean", "fedlpa", "fedproto"]


@pytest.fixture(scope="session")
def fmnist_cache(tmp_path_factory):
    """One dataset cache for the session: the shared run's config.yaml names it."""
    return tmp_path_factory.mktemp("fmnist-cache")


@pytest.fixture
def mixed_ov(fmnist_cache):
    """The shared mixed run's overrides (fafi clients)."""
    return [*TINY, f"dataset.cache_dir={fmnist_cache}", *MIXED, *STRATEGY_OPTIONS]


@pytest.fixture
def mixed_run(mixed_ov, tmp_path):
    """A copy of the session's one-round mixed run."""
    return copy_of_finished_run("mixed-fmnist", tmp_path / "mixed",
                                lambda d: Run(load_config(None, "fafi", mixed_ov), d, quiet=True).execute())


def cli(argv, capsys):
    rc = main(argv)
    return rc, capsys.readouterr().err


def no_timing(recs):
    return [{k: v for k, v in r.items() if not k.startswith("seconds") and not k.endswith(".seconds")} for r in recs]


def archs(*ov):
    cfg = load_config(None, "fafi", ["num_clients=3", "model.name=cnn", "model.width=0.125", *ov])
    return cfg, cfg.client_architectures()


# --- config resolution ------------------------------------------------------------------------------------------


def test_a_list_and_a_mapping_name_each_clients_architecture():
    cfg, a = archs(f"model.clients=[{','.join(NAMES)}]")
    assert [x.name for x in a] == NAMES and {x.width for x in a} == {0.125} and cfg.mixed_architectures
    cfg, a = archs("model.clients={1: wrn16_1}")  # the others run model.name
    assert [x.name for x in a] == ["cnn", "wrn16_1", "cnn"] and cfg.mixed_architectures
    cfg, a = archs("model.clients=[cnn,cnn,cnn]")
    assert not cfg.mixed_architectures and a == archs()[1]
    assert not archs()[0].mixed_architectures and len(archs()[1]) == 3


def test_a_mix_is_dealt_by_a_permutation_seeded_with_seed():
    def names(seed):
        return [x.name for x in archs("model.mix={cnn: 2, wrn16_1: 1}", f"seed={seed}")[1]]

    by_seed = {s: names(s) for s in range(1, 9)}
    for got in by_seed.values():
        assert sorted(got) == ["cnn", "cnn", "wrn16_1"]
    assert names(1) == by_seed[1]  # the same seed: the same assignment
    assert len({tuple(v) for v in by_seed.values()}) > 1  # other seeds deal otherwise
    assert by_seed[1] != by_seed[3]  # measured: seed 1 gives wrn16_1 to client 1, seed 3 to client 2
    cfg, a = archs("model.mix={cnn: 3, wrn16_1: 0}")  # a mix of one architecture is no mixed run
    assert not cfg.mixed_architectures and [x.name for x in a] == ["cnn"] * 3


def test_an_entry_takes_what_it_leaves_out_from_model():
    pytest.importorskip("timm")
    ov = ["model.name=timm/resnet18", "model.width=1", "model.checkpoint=/init.pt", "model.options.drop_rate=0.1",
          "num_clients=4", "model.clients=[cnn, {name: timm/resnet18, width: 0.5}, {name: timm/resnet18, options: "
                                       "{drop_rate: 0.2}}, {name: cnn, checkpoint: /c.pt, width: 0.25}]"]
    cfg = load_config(None, "fafi", ov)
    cnn, half, other, own = cfg.client_architectures()
    assert (cnn.name, cnn.width, cnn.options, cnn.checkpoint, cnn.label) == ("cnn", 1.0, {}, None, "cnn")
    assert (half.width, half.options, half.checkpoint, half.label) == (0.5, cfg.model.options, "/init.pt",
                                                                       "timm/resnet18@0.5")
    assert other.width == 1.0 and other.options["drop_rate"] == 0.2 and other.checkpoint == "/init.pt"
    assert (own.width, own.checkpoint, own.label) == (0.25, "/c.pt", "cnn@0.25")
    assert len({cnn, half, other, own}) == 4 and cfg.mixed_architectures


def test_an_entry_spelling_out_the_default_options_is_the_same_architecture():
    pytest.importorskip("timm")
    cfg = load_config(None, "fafi", ["num_clients=3", "model.name=timm/resnet18", "model.clients=[timm/resnet18, "
                                     "{name: timm/resnet18, options: {stem: small}}, timm/resnet18]"])
    assert len(set(cfg.client_architectures())) == 1 and not cfg.mixed_architectures


def test_the_server_architecture():
    assert server_architecture(archs("model.clients=[wrn16_1,cnn_dense,cnn_dense]")[0]).name == "cnn_dense"
    assert server_architecture(archs("model.clients=[wrn16_1,cnn,cnn_dense]")[0]).name == "wrn16_1"  # tie: lowest
    assert server_architecture(archs("model.clients=[cnn,cnn_dense,wrn16_1]")[0]).name == "cnn"
    assert server_architecture(archs()[0]).name == "cnn"
    cfg, _ = archs("model.clients=[wrn16_1,cnn,cnn]", "server.model={name: cnn_dense, width: 0.5}")
    srv = server_architecture(cfg)
    assert (srv.name, srv.width, srv.label) == ("cnn_dense", 0.5, "cnn_dense@0.5")


@pytest.mark.parametrize("ov", [[f"model.clients=[{','.join(NAMES)}]"], ["model.clients={2: wrn16_1}"],
                                ["model.mix={cnn_dense: 1, wrn16_1: 2}", "seed=3"],
                                ["model.clients=[cnn,wrn16_1,wrn16_1]", "server.model=cnn_dense"]])
def test_config_yaml_round_trip_keeps_the_architectures(ov, tmp_path):
    cfg, a = archs(*ov, "model.feature_dim=16")
    (tmp_path / "config.yaml").write_text(config_to_yaml(cfg))
    back = load_config(tmp_path / "config.yaml")
    assert back.client_architectures() == a and [x.label for x in back.client_architectures()] == [x.label for x in a]
    assert server_architecture(back) == server_architecture(cfg) and back.model.feature_dim == 16
    assert back == cfg


# --- FlareNet with a shared d -----------------------------------------------------------------------------------


def test_feature_dim_projects_the_encoders_feature():
    torch.manual_seed(0)
    m = create_model("wrn16_1", 1, 10, width=0.125, feature_dim=16)
    feat, logits = m(torch.randn(2, 1, 28, 28))
    assert feat.shape == (2, 16) and logits.shape == (2, 10) and m.feature_dim == 16
    sd = m.state_dict()
    assert sd["proj.weight"].shape == (16, 8) and sd["proj.bias"].shape == (16,)
    plain = create_model("wrn16_1", 1, 10, width=0.125)
    assert plain.proj is None and not any(k.startswith("proj.") for k in plain.state_dict())
    assert plain(torch.randn(2, 1, 28, 28))[0].shape == (2, 8)
    assert set(sd) - set(plain.state_dict()) == {"proj.weight", "proj.bias"}


# --- a run with mixed clients -----------------------------------------------------------------------------------


def test_a_mixed_run_writes_each_clients_architecture(mixed_run, mixed_ov):
    d, cfg = mixed_run, load_config(None, "fafi", mixed_ov)
    part = json.loads((d / "partition.json").read_text())
    assert [c["model"] for c in part["clients"]] == NAMES
    summary = (d / "summary.md").read_text()
    assert "model 1 × cnn, 1 × wrn16_1, 1 × cnn_dense (width 0.125 → d=16)" in summary, summary
    for i, n in enumerate(NAMES):
        assert f"| {i} | {n} | {part['clients'][i]['num_samples']} |" in summary
    ck = torch.load(d / "checkpoint.pt", weights_only=True)
    for st, n in zip(ck["clients"], NAMES):
        want = create_model(n, 1, 10, 0.125, head=cfg.head, feature_dim=16).state_dict()
        assert {k: tuple(v.shape) for k, v in st["model"].items()} == {k: tuple(v.shape) for k, v in want.items()}
    (last,) = [r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "round"]
    assert 0 <= last["acc_feature"] <= 1 and 0 <= last["acc_output"] <= 1
    # no two clients share a layout: no spread to average (metrics.jsonl writes NaN as text)
    assert "acc_fedavg" not in last and last["model_variance_mean"] == "nan"
    assert "fedavg" not in rules_for(cfg) and "feature" in rules_for(cfg)
    assert "fedavg" in rules_for(load_config(None, "fafi", TINY))  # the same rules for one architecture keep it


def test_the_batched_engine_gives_the_sequential_numbers(mixed_run, mixed_ov, tmp_path, monkeypatch):
    """One vmapped program per architecture (client/batched.py by_architecture); tolerances as test_batched.py."""
    groups = []
    real = BatchedClients.__init__

    def spy(self, clients, *a, **k):
        groups.append([c.cid for c in clients])
        real(self, clients, *a, **k)

    monkeypatch.setattr(BatchedClients, "__init__", spy)
    run = Run(load_config(None, "fafi", mixed_ov + ["client_engine=batched"]), tmp_path / "b", quiet=True)
    run.execute()
    assert sorted(groups) == [[0], [1], [2]]  # the batched engine trained them, one group per architecture
    want, got = (no_timing(read_jsonl(d / "metrics.jsonl")) for d in (mixed_run, tmp_path / "b"))
    assert len(want) == len(got) == 4
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if k.startswith("acc"):
                assert abs(v - b[k]) <= 1 / 200 + 1e-9, (k, v, b[k])  # one image of the 200-image test set
            elif isinstance(v, float):
                assert abs(v - b[k]) <= 1e-3 * max(abs(v), abs(b[k])) + 1e-7, (a["kind"], a.get("client"), k, v, b[k])
            else:
                assert v == b[k], k


def test_an_interrupted_mixed_run_resumes_to_the_uninterrupted_one(mixed_ov, tmp_path, monkeypatch):
    """Stopped after its first round (as test_resume.py does), then resumed: the metrics and every client's state
    of the same two-round run uninterrupted, each client in its own architecture."""
    cfg = load_config(None, "fafi", mixed_ov + ["rounds=2"])
    run_interrupted(cfg, tmp_path / "run", monkeypatch, at_round=1)
    assert json.loads((tmp_path / "run" / "state.json").read_text())["rounds_done"] == 1
    assert main(["run", "--resume", str(tmp_path / "run"), "--quiet"]) == 0
    Run(cfg, tmp_path / "ref", quiet=True).execute()
    got, want = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("run", "ref"))
    assert [r["round"] for r in got if r["kind"] == "round"] == [0, 1]
    assert no_timing(got) == no_timing(want)
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True)["clients"] for d in ("run", "ref"))
    for x, y, n in zip(a, b, NAMES):
        assert x["model"].keys() == y["model"].keys(), n
        assert all(torch.equal(x["model"][k], y["model"][k]) for k in y["model"]), n


# --- flare fuse -------------------------------------------------------------------------------------------------


def test_fuse_over_a_mixed_run(mixed_run, capsys):
    fuse = mixed_run / "fuse.jsonl"
    for name in ONE_ARCHITECTURE:
        rc, err = cli(["fuse", str(mixed_run), "--strategies", f"output,{name}"], capsys)
        assert rc == 2 and f"server strategy '{name}' cannot fuse clients of different architectures" in err, err
        assert "--strategies" in err and "Traceback" not in err and not fuse.exists()
    assert main(["fuse", str(mixed_run), "--strategies", ",".join(FUSES_MIXED)]) == 0
    recs = {r["strategy"]: r for r in read_jsonl(fuse)}
    assert set(recs) == set(FUSES_MIXED)
    for n, r in recs.items():
        assert 0 <= r["acc"] <= 1, (n, r)
    (last,) = [r for r in read_jsonl(mixed_run / "metrics.jsonl") if r["kind"] == "round"]
    for n in ("output", "feature"):  # each client rebuilt in its own architecture: the run's own numbers
        assert recs[n]["acc"] == last[f"acc_{n}"], n
    before = fuse.read_bytes()
    rc, err = cli(["fuse", str(mixed_run), "--strategies", "fedavg"], capsys)
    assert rc == 2 and fuse.read_bytes() == before


# --- the students of the distilling servers ---------------------------------------------------------------------


def context(cfg, models, weights, **kw):
    uploads = [Upload(i, m.state_dict(), 10 * (i + 1), getattr(m, "prototypes", None)) for i, m in enumerate(models)]
    return ServerContext(0, uploads, models, torch.tensor(weights), None, None,
                         extras=[{} for _ in models], **kw)


def client_models(cfg):
    torch.manual_seed(0)
    return [create_model(a.name, 1, 10, a.width, head=cfg.head, feature_dim=cfg.model.feature_dim).eval()
            for a in cfg.client_architectures()]


def test_feddf_starts_from_the_fedavg_of_the_server_architectures_clients():
    cfg, _ = archs("model.clients=[cnn,wrn16_1,cnn]", "model.feature_dim=16", "dataset.public_size=8")
    models, w = client_models(cfg), [0.5, 0.3, 0.2]
    pub = torch.zeros(4, 1, 28, 28, dtype=torch.uint8)
    start = make_strategy(cfg, "feddf")._start(context(cfg, models, w), pub).state_dict()
    want = fedavg_model([models[0], models[2]], torch.tensor([0.5, 0.2]) / 0.7, FedAvgRule.options_in(cfg).buffers).state_dict()
    assert start.keys() == want.keys() and all(torch.allclose(start[k].float(), want[k].float()) for k in want)
    first = models[0].state_dict()
    assert not all(torch.equal(start[k], first[k]) for k in want)  # both cnn clients, not the first alone
    # a server architecture no client runs: its fresh seeded init
    cfg, _ = archs("model.clients=[cnn,wrn16_1,cnn]", "model.feature_dim=16", "dataset.public_size=8",
                   "server.model=cnn_dense")
    start = make_strategy(cfg, "feddf")._start(context(cfg, models, w), pub)
    assert type(start.encoder) is type(create_model("cnn_dense", 1, 10, 0.125).encoder)
    fresh = fresh_model(strategy_facts(cfg), 1, 10, 0, torch.device("cpu"))
    assert start.state_dict().keys() == fresh.state_dict().keys()


@pytest.mark.parametrize("name", ["dense", "coboosting"])
def test_the_data_free_students_are_the_server_architecture(name):
    cfg = load_config(None, "fafi", ["num_clients=3", "model.name=cnn", "model.width=0.125", "model.feature_dim=16",
                                     "model.clients=[cnn,wrn16_1,cnn]", "server.model=cnn_dense",
                                     *(f"server.strategies.{name}.{k}={v}" for k, v in (
                                         ("epochs", 1), ("g_steps", 1), ("synthesis_batch", 16), ("batch_size", 16),
                                         ("ngf", 8), ("nz", 16)))])
    ctx = context(cfg, client_models(cfg), [0.4, 0.3, 0.3], input_shape=(1, 28, 28),
                  normalize=lambda x: x.float() / 255)
    student = make_strategy(cfg, name).predictor(ctx).model
    dense_encoder = type(create_model("cnn_dense", 1, 10, 0.125).encoder)
    assert type(student.encoder) is dense_encoder and student.feature_dim == 16
    assert all(type(m.encoder) is not dense_encoder for m in ctx.models)


# --- model_variance_mean ----------------------------------------------------------------------------------------


def _std_mean(models):
    flat = torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models])
    return float(flat.std(dim=0, unbiased=True).mean())


def test_model_variance_mean_over_architecture_groups():
    torch.manual_seed(0)
    cnn = [create_model("cnn", 1, 10, 0.125) for _ in range(3)]
    wrn = [create_model("wrn16_1", 1, 10, 0.125) for _ in range(2)]
    dense = create_model("cnn_dense", 1, 10, 0.125)
    assert model_variance_mean(cnn) == pytest.approx(_std_mean(cnn), rel=1e-6)  # one architecture: as before
    assert model_variance_mean(cnn[:1]) == 0.0
    mixed = [wrn[0], cnn[0], dense, cnn[1], wrn[1], cnn[2]]  # the lone cnn_dense has no spread of its own
    want = (_std_mean(cnn) + _std_mean(wrn)) / 2
    assert model_variance_mean(mixed) == pytest.approx(want, rel=1e-6)
    assert model_variance_mean(mixed) != pytest.approx(_std_mean(cnn), rel=1e-3)
    assert math.isnan(model_variance_mean([cnn[0], wrn[0], dense]))


# --- a d that differs without model.feature_dim ------------------------------------------------------------------


def test_encoders_of_different_d_need_feature_dim(fmnist_cache, tmp_path, capsys):
    out = tmp_path / "run"
    rc, err = cli(["run", *TINY, f"dataset.cache_dir={fmnist_cache}", f"model.clients=[{','.join(NAMES)}]",
                   "--out", str(out), "--quiet"], capsys)
    assert rc == 2 and "Traceback" not in err, err
    assert "model.feature_dim" in err and "wrn16_1: d = 8" in err and "cnn: d = 16" in err, err
    assert not out.exists()
