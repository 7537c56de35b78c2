"""Global alignment (docs/method.md#anchors): anchors, schedules, the entropy rule, PCGrad, Plan B, banks, progress,
the presets, and the bad-input errors. Tiny models and synthetic tensors only."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flare.cli import main
from flare.client.lam import LamProvider, entropy_lambda, initial_lambda
from flare.client.surgery import pcgrad_backward
from flare.client.terms.align import AnchorFacts, align_loss, align_target, simplex_etf
from flare.client.terms.banks import (MemoryBank, PublicBankExtension,
                                      bank_facts, build_public_bank, public_infonce,
                                      train_teacher)
from flare.client.terms.fafi import fafi_terms, supcon_loss
from flare.client.trainer import Client, TrainContext
from flare.config import ServerCfg, build_config, list_presets, load_config
from flare.data.datasets import ImageData
from flare.errors import FlareError
from flare.models import create_model
from flare.registry import ANCHORS, CONTRAST, SCHEDULES, NoFacts
from flare.schedules import LRSchedule
from flare.server.protos import ServerPrototypes, train_global_prototypes

# ----------------------------------------------------------------------------------------------
# helpers: a tiny client on synthetic data, a fake dataset for the runner


class TwoViews(torch.nn.Module):
    """Augmentation stand-in: two identical normalised views."""

    def forward(self, x):
        v = x.float() / 255.0 - 0.5
        return v, v.clone()


def make_anchors(kind, num_classes, dim, seed):
    """The run's anchors as the server builds them: by name, from the run facts."""
    return ANCHORS.create(kind, AnchorFacts(num_classes, dim, seed))


def tiny_client(overrides: dict, n: int = 48, seed: int = 0, classes: int = 10):
    cfg = build_config({"rounds": 3, "local_epochs": 2, "batch_size": 16, "model": {"name": "cnn", "width": 0.125},
                        "device": "cpu", "amp": "off", "channels_last": False, **overrides})
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, 8, 8), generator=g, dtype=torch.uint8)
    y = torch.arange(n) % classes
    torch.manual_seed(seed)
    model = create_model("cnn", 3, classes, 0.125, head="prototype")
    anchors = make_anchors(cfg.align.anchors, classes, model.feature_dim, 7)
    ls = cfg.lr_schedule
    ctx = TrainContext(cfg=cfg, train_x=x, train_y=y, augment=TwoViews(), anchors=anchors, device=torch.device("cpu"),
                       amp_dtype=None, lr_schedule=LRSchedule(ls.kind, cfg.lr, cfg.total_epochs,
                                                              decay_per_round=ls.decay_per_round, min_lr=ls.min_lr,
                                                              t0=ls.t0, t_mult=ls.t_mult, cycle_decay=ls.cycle_decay))
    return Client(0, torch.arange(n), model, ctx, normalized_entropy=0.5), ctx


def fake_data(n_train=200, n_test=60, classes=10, size=8):
    g = torch.Generator().manual_seed(0)
    return ImageData("fake", torch.randint(0, 256, (n_train, 3, size, size), generator=g, dtype=torch.uint8),
                     torch.arange(n_train) % classes,
                     torch.randint(0, 256, (n_test, 3, size, size), generator=g, dtype=torch.uint8),
                     torch.arange(n_test) % classes, [str(c) for c in range(classes)], (0.5,) * 3, (0.25,) * 3)


@pytest.fixture
def fake_dataset(monkeypatch):
    monkeypatch.setattr("flare.data.prepare.load_dataset", lambda *a, **k: fake_data())




TINY = ["--quiet", "model.name=cnn", "model.width=0.125", "rounds=2", "batch_size=32", "test_batch_size=64", "device=cpu",
        "num_clients=3", "partition.alpha=0.5"]


def run_cli(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


# ----------------------------------------------------------------------------------------------
# anchors


@pytest.mark.parametrize("C,d", [(10, 512), (100, 512), (10, 9), (100, 99), (10, 10)])
def test_etf_unit_rows_and_equal_negative_cosines(C, d):
    A = simplex_etf(C, d, torch.Generator().manual_seed(3)).double()
    assert A.shape == (C, d)
    assert torch.allclose(A.norm(dim=1), torch.ones(C, dtype=torch.double), atol=1e-5)
    gram = A @ A.T
    off = gram[~torch.eye(C, dtype=torch.bool)]
    assert torch.allclose(off, torch.full_like(off, -1.0 / (C - 1)), atol=1e-5)
    assert torch.allclose(A.sum(0), torch.zeros(d, dtype=torch.double), atol=1e-4)  # centred: a simplex


def test_etf_too_small_dimension_is_a_clear_error():
    with pytest.raises(FlareError) as e:
        make_anchors("etf", 10, 8, 0)
    assert e.value.key == "align.anchors" and "d >= C-1" in str(e.value)


def test_anchors_are_shared_and_seeded():
    a1, a2 = make_anchors("random", 10, 32, 5), make_anchors("random", 10, 32, 5)
    assert torch.equal(a1, a2) and not torch.equal(a1, make_anchors("random", 10, 32, 6))
    assert torch.allclose(a1.norm(dim=1), torch.ones(10), atol=1e-6)
    assert torch.equal(make_anchors("etf", 10, 32, 5), make_anchors("etf", 10, 32, 5))
    assert make_anchors("none", 10, 32, 5) is None


def test_align_loss_and_progressive_target():
    P0, A = torch.randn(4, 6), torch.randn(4, 6)
    assert torch.equal(align_target(A, "fixed", 0.3, P0), A)
    assert torch.allclose(align_target(A, "progressive", 0.0, P0), P0)
    assert torch.allclose(align_target(A, "progressive", 1.0, P0), A)
    assert torch.allclose(align_target(A, "progressive", 0.25, P0), 0.75 * P0 + 0.25 * A)
    assert torch.isclose(align_loss(P0, A), ((P0 - A) ** 2).mean())


# ----------------------------------------------------------------------------------------------
# schedules and the λ rules


@pytest.mark.parametrize("name,values", [("constant", (1, 1, 1)), ("linear", (1, 0.5, 0)), ("cosine", (1, 0.5, 0))])
def test_schedule_values(name, values):
    f = SCHEDULES.create(name, NoFacts())
    assert [f(p) for p in (0.0, 0.5, 1.0)] == pytest.approx(values, abs=1e-12)


def test_cosine_differs_from_linear_inside():
    assert SCHEDULES.create("cosine", NoFacts())(0.25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_unknown_schedule_names_the_key():
    with pytest.raises(FlareError) as e:
        SCHEDULES.create("exp", NoFacts(), key="align.schedule")
    assert e.value.key == "align.schedule"


@pytest.mark.parametrize("H,lam", [(1.9079, 5.7859), (1.7997, 5.4634), (0.6091, 1.9152), (1.1689, 3.5837),
                                   (1.7245, 5.2395)])
def test_entropy_rule_reproduces_the_notes_table(H, lam):
    """notes 'Why v10 fails': λ_min = 0.1, λ_max = 10, C = 10."""
    assert entropy_lambda(H / math.log2(10), 0.1, 10.0) == pytest.approx(lam, abs=5e-4)


def test_entropy_rule_from_config_and_fixed_rule():
    assert entropy_lambda(0.5743, 0.1, 10.0) == pytest.approx(5.7859, abs=1e-3)
    cfg = load_config(None, "entropy-lambda")
    assert initial_lambda(cfg, 0.5743) == pytest.approx(5.7856, abs=1e-4)
    assert initial_lambda(cfg, 0.0) == pytest.approx(0.1) and initial_lambda(cfg, 1.0) == pytest.approx(10.0)
    assert initial_lambda(load_config(None, "etf-anneal"), 0.5743) == 5.0


def test_fixed_provider_multiplies_lambda0_by_schedule():
    prov = LamProvider(5.0, "linear")
    base, al = torch.tensor(2.0), torch.tensor(3.0)
    st = prov(base, al, 0.4)
    assert float(st.align) == pytest.approx(5.0 * 0.6 * 3.0) and float(st.logs["lambda"]) == pytest.approx(3.0)
    assert prov(base, None, 0.4).align is None


# ----------------------------------------------------------------------------------------------
# progress: once from 0 to 1 over all rounds, through the real training loop


class RecordingLam(LamProvider):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.ps: list[float] = []

    def __call__(self, base, align, p):
        self.ps.append(p)
        return super().__call__(base, align, p)


def test_progress_runs_once_over_all_rounds_epoch_granularity():
    client, ctx = tiny_client({"align": {"anchors": "etf", "schedule": "linear", "lambda0": 2.0}})
    client.lam = RecordingLam(2.0, "linear")
    R, E, steps = 3, 2, 3  # 48 samples / batch 16
    records = [client.train_round(ctx, r) for r in range(R)]
    ps = client.lam.ps
    assert len(ps) == R * E * steps
    expect = [e / (R * E) for e in range(R * E) for _ in range(steps)]
    assert ps == pytest.approx(expect)            # not reset at round boundaries (the seeds' saw-tooth)
    assert records[-1]["progress"] == 1.0
    # λ and align_loss are logged per client and round: λ = λ0·(1 − p) averaged over the round's steps
    for r, rec in enumerate(records):
        p_round = [(r * E + e) / (R * E) for e in range(E)]
        assert rec["lambda"] == pytest.approx(2.0 * (1 - sum(p_round) / E), rel=1e-5)
        assert rec["align_loss"] > 0


def test_progress_step_granularity_is_monotone_and_reaches_one():
    client, ctx = tiny_client({"progress": "step", "align": {"anchors": "random", "schedule": "linear"}})
    client.lam = RecordingLam(1.0, "linear")
    for r in range(3):
        client.train_round(ctx, r)
    ps = client.lam.ps
    assert ps[0] == 0.0 and all(b > a for a, b in zip(ps, ps[1:]))
    assert ps[-1] == pytest.approx(1 - 1 / len(ps))


def test_alignment_pulls_prototypes_to_the_anchors():
    dist = {}
    for lam0 in (0.0, 200.0):
        client, ctx = tiny_client({"lr": 0.05, "align": {"anchors": "etf", "lambda0": lam0}})
        before = float(align_loss(client.model.prototypes.detach(), ctx.anchors))
        client.train_round(ctx, 0)
        dist[lam0] = float(align_loss(client.model.prototypes.detach(), ctx.anchors))
    assert dist[200.0] < dist[0.0] and dist[200.0] < before


# ----------------------------------------------------------------------------------------------
# PCGrad


def _pcgrad_case(a, b):
    w = torch.nn.Parameter(torch.zeros(len(a)))
    a, b = torch.tensor(a), torch.tensor(b)
    logs = pcgrad_backward((w * a).sum(), (w * b).sum(), [w])
    return w.grad, a, b, logs


def test_pcgrad_removes_the_conflict():
    g, a, b, logs = _pcgrad_case([1.0, 0.0, 2.0], [-1.0, 1.0, 0.0])
    assert float(a @ b) < 0 and float(logs["pcgrad_conflict"]) == 1.0
    g_loc = g - b
    assert float(g_loc @ b) >= -1e-6                           # non-negative after the surgery
    assert torch.allclose(g_loc, a - (a @ b) / (b @ b) * b)
    assert float(logs["grad_cos"]) == pytest.approx(float(a @ b / (a.norm() * b.norm())))


def test_pcgrad_leaves_a_non_conflicting_pair_untouched():
    g, a, b, logs = _pcgrad_case([1.0, 0.5, 2.0], [0.5, 1.0, -0.1])
    assert float(a @ b) > 0 and float(logs["pcgrad_conflict"]) == 0.0
    assert torch.equal(g, a + b)


def test_pcgrad_judges_the_conflict_over_all_parameters():
    """Per-parameter dots of mixed sign, total positive: no projection anywhere."""
    w1, w2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a1, a2, b1, b2 = torch.tensor([1.0, 0]), torch.tensor([3.0, 0]), torch.tensor([-1.0, 0]), torch.tensor([1.0, 0])
    logs = pcgrad_backward((w1 * a1).sum() + (w2 * a2).sum(), (w1 * b1).sum() + (w2 * b2).sum(), [w1, w2])
    assert float(logs["pcgrad_conflict"]) == 0.0
    assert torch.equal(w1.grad, a1 + b1) and torch.equal(w2.grad, a2 + b2)


def test_pcgrad_extra_goes_to_its_own_parameters_only():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    s = torch.nn.Parameter(torch.tensor(0.3))
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 1.0])
    # the local part depends on s too (as V10's ½e^{−s_l}·base does): s must get exactly what a plain
    # backward of local + align + extra would give it
    local = lambda: torch.exp(-s) * (w * a).sum()  # noqa: E731
    align = lambda: (w * b).sum()  # noqa: E731
    extra = lambda: s ** 2  # noqa: E731
    logs = pcgrad_backward(local(), align(), [w], extra=extra())
    assert float(logs["pcgrad_extra_on_weights"]) == 0.0
    s_grad, w_grad = s.grad.clone(), w.grad.clone()
    s.grad = w.grad = None
    (local() + align() + extra()).backward()
    assert torch.allclose(s_grad, s.grad)
    g_loc = torch.exp(-s.detach()) * a
    assert torch.allclose(w_grad, g_loc - (g_loc @ b) / (b @ b) * b + b)


def test_pcgrad_reports_an_extra_that_reaches_the_weights():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    logs = pcgrad_backward((w * a).sum(), (w * b).sum(), [w], extra=(w ** 2).sum())
    assert float(logs["pcgrad_extra_on_weights"]) == 1.0
    assert torch.allclose(w.grad, a + b + 2 * w.detach())  # kept, and visible in the logs


def test_pcgrad_through_the_trainer_logs_conflicts():
    client, ctx = tiny_client({"align": {"anchors": "etf", "lambda0": 5.0, "schedule": "linear",
                                         "surgery": "pcgrad"}})
    rec = client.train_round(ctx, 0)
    assert 0.0 <= rec["pcgrad_conflict"] <= 1.0 and -1.0 <= rec["grad_cos"] <= 1.0 and "lambda" in rec


# ----------------------------------------------------------------------------------------------
# Plan B


def _client_protos(K=4, C=10, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(C, d, generator=g)
    return [base + 0.5 * torch.randn(C, d, generator=g) for _ in range(K)]


def test_plan_b_lowers_its_server_loss():
    protos = _client_protos()
    A = make_anchors("etf", 10, 16, 1)
    cfg = ServerCfg(protos="trainable", server_epochs=20, server_lr=1e-2)
    G, logs = train_global_prototypes(protos, cfg, A)
    assert logs["server_loss_last"] < logs["server_loss_first"]
    assert G.shape == (10, 16) and not torch.allclose(G, torch.stack(protos).mean(0))
    # the same through the server's part for G across rounds (spec: nothing kept, nothing sent), and mean stays the
    # plain mean
    spec = ServerPrototypes(cfg)
    ups = [SimpleNamespace(prototypes=P) for P in protos]
    read, kept, logs2 = spec.fold(0, ups, A, spec.initial_state(A))
    assert torch.equal(G, read["G"]) and logs2 == logs and kept is None
    assert spec.configure_train(0, spec.initial_state(A)) == {}
    read, kept, none = ServerPrototypes(ServerCfg()).fold(0, ups, A, {})
    assert torch.allclose(read["G"], torch.stack(protos).mean(0)) and none == {} and kept is None
    # the reference flow keeps G from the anchors on, sends it, and keeps the trained G
    ref = ServerPrototypes(cfg.model_copy(update={"protos_flow": "reference"}))
    start = ref.initial_state(A)
    assert torch.equal(start["G"], A) and torch.equal(ref.configure_train(0, start)["align_target"], A)
    read, kept, logs3 = ref.fold(0, ups, A, start)
    assert torch.allclose(read["G"], torch.stack(protos).mean(0)) and not torch.equal(kept["G"], A)
    assert {"server_loss_first", "server_loss_last", "server_g_std"} <= set(logs3)
    assert ServerPrototypes(cfg).fold(0, [SimpleNamespace(prototypes=None)], A, {}) == ({}, None, {})


def test_plan_b_initialisation_from_anchors_and_the_missing_anchor_error():
    protos = _client_protos()
    A = make_anchors("etf", 10, 16, 1)
    G, _ = train_global_prototypes(protos, ServerCfg(protos="trainable", protos_init="anchors", server_epochs=1,
                                                     server_lr=1e-6), A)
    assert torch.allclose(G, A, atol=1e-4)
    with pytest.raises(FlareError) as e:  # refused before anything trains
        build_config({"align": {"anchors": "none"}, "server": {"protos": "trainable", "protos_init": "anchors"}})
    assert e.value.key == "align.anchors" and "server.protos_init=anchors" in e.value.message


# ----------------------------------------------------------------------------------------------
# banks


def _by_label(q):
    """The bank's (features, labels) sorted by label (every label is pushed once at a time here)."""
    f, y = q.contrast_bank()
    order = torch.argsort(y)
    return f[order], y[order]


def test_memory_bank_is_a_fifo_of_the_configured_size():
    q = MemoryBank(size=5, dim=3)
    rows = torch.randn(9, 3)
    q.push(rows[:3], torch.arange(3))
    f, y = _by_label(q)
    assert len(q) == 3 and y.tolist() == [0, 1, 2] and torch.allclose(f, F.normalize(rows[:3], dim=1))
    q.push(rows[3:7], torch.arange(3, 7))
    f, y = _by_label(q)
    assert len(q) == 5 and y.tolist() == [2, 3, 4, 5, 6]
    assert torch.allclose(f, F.normalize(rows[2:7], dim=1))
    q.push(rows, torch.arange(9))  # more than the size at once: only the newest 5 survive
    assert _by_label(q)[1].tolist() == [4, 5, 6, 7, 8]
    q2 = MemoryBank(5, 3)
    q2.load_state_dict(q.state_dict())
    assert torch.equal(_by_label(q2)[0], _by_label(q)[0])


def test_memory_bank_extension_uses_the_bank_temperature_from_the_first_step():
    ext = MemoryBank(8, 4, torch.device("cpu"))
    feat, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    bank = ext.contrast_bank()
    assert bank[0].shape == (0, 4)
    t = fafi_terms(feat, torch.randn(6, 3), y, torch.randn(3, 4), bank=bank, bank_tau=0.5)
    z = F.normalize(feat, dim=1)
    assert torch.isclose(t["loss_con"], supcon_loss(z, y, tau=0.5, base_tau=0.5))
    ext.after_step(feat, y)
    assert len(ext) == 6
    t2 = fafi_terms(feat, torch.randn(6, 3), y, torch.randn(3, 4), bank=ext.contrast_bank(), bank_tau=0.5)
    assert not torch.isclose(t2["loss_con"], t["loss_con"])  # the bank entries now take part


def test_memory_bank_through_the_trainer_fills_to_its_size():
    client, ctx = tiny_client({"loss": {"contrast": "memory-bank", "bank_size": 40}})
    ctx.extension_factory = CONTRAST.create(ctx.cfg.loss.contrast, bank_facts(ctx.cfg.loss, None, ctx.device))
    client.extension = ctx.extension_factory(client, ctx)
    client.train_round(ctx, 0)  # 2 epochs × 48 samples × 2 views = 192 rows pushed
    assert len(client.extension) == 40


def test_public_infonce_hand_example():
    """Image 0's views agree (positive logit 1/τ), image 1's views meet at 45° (positive logit cos 45°/τ); the
    bank is orthogonal to all of them (negative logits 0). Rows are [view1; view2]."""
    r = 1 / math.sqrt(2)
    view1 = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]])
    view2 = torch.tensor([[1.0, 0, 0, 0], [r, r, 0, 0]])
    bank = torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 1.0], [0, 0, -1.0, 0]])
    tau = 0.5
    expect = (2 * math.log(1 + 3 * math.exp(-1 / tau)) + 2 * math.log(1 + 3 * math.exp(-r / tau))) / 4
    assert public_infonce(torch.cat([view1, view2]), bank, tau).item() == pytest.approx(expect, rel=1e-6)


def test_public_bank_and_two_stage_terms():
    bank = F.normalize(torch.randn(5, 4), dim=1)
    feat, y = torch.randn(6, 4), torch.zeros(6, dtype=torch.long)
    terms = {"loss_cls": torch.tensor(1.0)}
    pub = PublicBankExtension(bank, 0.5, None)
    assert set(pub.adjust_terms(terms, feat, y, 0)) == {"loss_cls", "loss_public"} and pub.contrast_bank() is None
    two = PublicBankExtension(bank, 0.5, public_stage_epochs=2)
    assert set(two.adjust_terms(terms, feat, y, 0)) == {"loss_public"}
    assert set(two.adjust_terms(terms, feat, y, 1)) == {"loss_public"}
    assert two.adjust_terms(terms, feat, y, 2) is terms


def test_public_bank_factory_trains_a_seeded_teacher():
    cfg = build_config({"batch_size": 16, "dataset": {"public_size": 32},
                        "loss": {"contrast": "public-bank", "teacher_epochs": 2}})
    g = torch.Generator().manual_seed(0)
    public = (torch.randint(0, 256, (32, 3, 8, 8), generator=g, dtype=torch.uint8), torch.arange(32) % 10)
    torch.manual_seed(0)
    model = create_model("cnn", 3, 10, 0.125)
    norm = lambda x: x.float() / 255.0 - 0.5  # noqa: E731
    b1 = build_public_bank(cfg, public, model, TwoViews(), norm, torch.device("cpu"))
    b2 = build_public_bank(cfg, public, model, TwoViews(), norm, torch.device("cpu"))
    assert b1.shape == (32, model.feature_dim) and torch.equal(b1, b2)
    assert torch.allclose(b1.norm(dim=1), torch.ones(32), atol=1e-5)
    _teacher, losses = train_teacher(cfg, public, model, TwoViews(), torch.device("cpu"))
    assert len(losses) == 2
    with pytest.raises(FlareError) as e:  # the config refuses a public bank without a public slice
        build_config({"loss": {"contrast": "two-stage"}})
    assert e.value.key == "dataset.public_size"
    with pytest.raises(FlareError) as e:  # and so does a client handed no bank
        CONTRAST.create(cfg.loss.contrast, bank_facts(cfg.loss, None, torch.device("cpu")))
    assert e.value.key == "loss.contrast"


# ----------------------------------------------------------------------------------------------
# presets and end-to-end runs on a fake dataset


ALIGN_PRESETS = {
    "drcl": ("random", "fixed", "constant", 1.0), "drcl-anneal": ("random", "fixed", "linear", 5.0),
    "etf-anneal": ("etf", "fixed", "linear", 5.0), "progressive": ("etf", "progressive", "linear", 5.0),
    "pcgrad": ("etf", "fixed", "linear", 5.0), "server-protos": ("etf", "fixed", "linear", 5.0),
}


def test_presets_are_listed_with_the_notes_names():
    p = list_presets()
    for name in ("drcl", "drcl-anneal", "etf-anneal", "progressive", "entropy-lambda", "server-protos",
                 "entropy-server-protos", "pcgrad", "memory-bank", "public-bank", "two-stage"):
        assert p[name].get("notes_name") and p[name].get("description"), name
    for name, (anchors, target, sched, lam0) in ALIGN_PRESETS.items():
        a = load_config(None, name).align
        assert (a.anchors, a.target, a.schedule, a.lambda0) == (anchors, target, sched, lam0), name
    assert load_config(None, "pcgrad").align.surgery == "pcgrad"
    assert load_config(None, "server-protos").server.protos == "trainable"
    c = load_config(None, "entropy-server-protos")
    assert c.server.protos == "trainable" and c.align.lambda_rule == "entropy" and c.align.anchors == "etf"
    assert load_config(None, "public-bank").dataset.public_size > 0
    assert load_config(None, "two-stage").loss.contrast == "two-stage"
    assert load_config(None, "memory-bank").loss.contrast == "memory-bank"


@pytest.mark.parametrize("preset,keys", [
    ("entropy-server-protos", ["lambda", "align_loss"]),
    ("memory-bank", ["loss_con"]),
    ("two-stage", []),
])
def test_end_to_end_runs_log_what_they_should(preset, keys, fake_dataset, tmp_path, capsys):
    extra = ["dataset.public_size=40"] if preset == "two-stage" else []
    rc, out, err = run_cli(["run", *TINY[:1], "--preset", preset, "--out", str(tmp_path / preset), *TINY[1:], *extra],
                            capsys)
    assert rc == 0, err
    recs = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
    clients = [r for r in recs if r["kind"] == "client"]
    rounds = [r for r in recs if r["kind"] == "round"]
    assert len(rounds) == 2 and all("g_protos_std" in r and "inter_client_proto_std" in r for r in rounds)
    for k in keys:
        assert all(k in c for c in clients), k
    if preset == "entropy-server-protos":
        ents = {c["client"]: c["normalized_entropy"] for c in clients}
        # epoch progress, R·E = 2: round 0 uses p = 0, so λ is the entropy rule's λ0_i exactly
        for c in clients:
            if c["round"] == 0:
                assert c["lambda"] == pytest.approx(entropy_lambda(ents[c["client"]], 0.1, 10.0), rel=1e-5)
        assert all("server_loss_first" in r and "server_loss_last" in r for r in rounds)
    if preset == "two-stage":  # stage 1 (global epoch 0) public term only, then the base loss only
        assert all(("loss_cls" in c) == (c["round"] > 0) for c in clients)
        assert all(("loss_public" in c) == (c["round"] == 0) for c in clients)


# ----------------------------------------------------------------------------------------------
# bad input: a clear error naming the key, exit code 2


@pytest.mark.parametrize("args,key", [
    (["align.lambda_min=5", "align.lambda_max=1"], "align.lambda_min"),
    (["lr_schedule.t0=0"], "lr_schedule.t0"),
    (["lr_schedule.t0=-2", "lr_schedule.kind=sgdr"], "lr_schedule.t0"),
    (["align.schedule=exponential"], "align.schedule"),
    (["lam.anneal=exponential"], "lam.anneal"),
    (["lr_schedule.kind=step"], "lr_schedule.kind"),
    (["align.anchors=etf", "model.width=0.05"], "align.anchors"),           # cnn d = 6 < C − 1 = 9
    (["dataset.public_size=500"], "dataset.public_size"),                   # fake training set: 200
    (["loss.contrast=public-bank"], "dataset.public_size"),                 # no public slice
])
def test_bad_input_exits_2_naming_the_key(args, key, fake_dataset, tmp_path, capsys):
    rc, out, err = run_cli(["run", "--out", str(tmp_path / "r"), *TINY, *args], capsys)
    assert rc == 2
    assert key in err and "Traceback" not in err
