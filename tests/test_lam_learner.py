"""The λ learner (V10–V14, docs/method.md#learned-λ-v10v14): gradient routing, warm start, the valve, the notes'
failure modes, checkpoints, the trainer's single backward, and the runner's λ_raw warning."""
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flare.client.lam import LamLearner, initial_lambda, lam_facts, runaway_warnings
from flare.config import load_config
from flare.errors import FlareError
from flare.registry import ANCHORS, LAM_PROVIDERS

LEARNER_PRESETS = ["uw", "uw-rescaled", "uw-anneal-linear", "uw-anneal-cosine", "decoupled", "decoupled-stable",
                   "flare"]
CPU = torch.device("cpu")




class TinyProto(nn.Module):
    """A 2-layer encoder and a C×d prototype matrix: enough to have 'weights' on both sides of the loss."""

    def __init__(self, in_dim=5, d=6, C=4, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.enc = nn.Sequential(nn.Linear(in_dim, 8), nn.Tanh(), nn.Linear(8, d))
        for m in self.enc:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, generator=g)
                nn.init.normal_(m.bias, generator=g)
        self.prototypes = nn.Parameter(torch.randn(C, d, generator=g))


def tiny_losses(model, x, y, A):
    """(base, L_align) of the tiny model — base touches encoder and prototypes, L_align only prototypes."""
    f = model.enc(x)
    z = F.normalize(f, dim=1)
    base = F.cross_entropy(z @ model.prototypes.T, y) + 0.1 * f.square().mean()
    align = F.mse_loss(model.prototypes, A)
    return base, align


def tiny_setup(seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    model = TinyProto(seed=seed)
    x = torch.randn(16, 5, generator=g)
    y = torch.randint(0, 4, (16,), generator=g)
    A = F.normalize(torch.randn(4, 6, generator=g), dim=1)
    return model, x, y, A


def learner_grads(learner, model, x, y, A, p):
    """What the trainer does: one forward, the provider, ONE backward of local + align + sigma."""
    for q in model.parameters():
        q.grad = None
    base, align = tiny_losses(model, x, y, A)
    st = learner(base, align, p)
    total = st.local + st.align + (st.sigma if st.sigma is not None else 0)
    total.backward()
    wg = [q.grad.clone() for q in model.parameters()]
    sg = [learner.s_l.grad.clone(), learner.s_a.grad.clone()]
    return wg, sg, st, base.item(), align.item()


def weight_grads_of(fn, model, x, y, A):
    base, align = tiny_losses(model, x, y, A)
    return list(torch.autograd.grad(fn(base, align), list(model.parameters())))


def sigma_grads_of(fn, s_l0, s_a0):
    s_l = torch.tensor(s_l0, dtype=torch.float32, requires_grad=True)
    s_a = torch.tensor(s_a0, dtype=torch.float32, requires_grad=True)
    return list(torch.autograd.grad(fn(s_l, s_a), [s_l, s_a]))


def assert_all_close(got, want, rtol=1e-5, atol=1e-7):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=rtol, atol=atol), (g, w)


def sched(name, p):
    return {"constant": 1.0, "linear": 1.0 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p))}[name]


# ---------------------------------------------------------------------------------------------------
# gradient routing


DECOUPLED_CASES = [
    # (label, lam0, anneal, gamma_reg, beta, gamma_lambda, lambda_max, p)
    ("V12", 3.0, "linear", 0.0, 0.0, 0.0, 50.0, 0.3),
    ("V12-cosine", 3.0, "cosine", 0.0, 0.0, 0.0, 50.0, 0.6),
    ("V13", 3.0, "linear", 1e-3, 0.0, 0.0, 50.0, 0.3),
    ("V14 valve idle", 3.0, "linear", 1e-3, 0.01, 0.1, 50.0, 0.3),
    ("V14 valve active", 80.0, "linear", 1e-3, 0.01, 0.1, 50.0, 0.3),
    ("V14 strong", 80.0, "linear", 0.5, 0.7, 2.0, 10.0, 0.8),
]


@pytest.mark.parametrize("case", DECOUPLED_CASES, ids=[c[0] for c in DECOUPLED_CASES])
def test_decoupled_routes_weights_to_Lw_and_sigma_to_Lsigma(case):
    _, lam0, anneal, gamma_reg, beta, gamma_lambda, lambda_max, p = case
    model, x, y, A = tiny_setup()
    L = LamLearner("decoupled", lam0, anneal=anneal, gamma_reg=gamma_reg, beta=beta, gamma_lambda=gamma_lambda,
                   valve_threshold=lambda_max)
    with torch.no_grad():  # move s_l off 0 so that β·s_l² has a gradient
        L.s_l.fill_(0.4)
    wg, sg, st, b, la = learner_grads(L, model, x, y, A, p)
    s_l0, s_a0 = 0.4, -math.log(lam0)
    s = sched(anneal, p)
    lam_raw = math.exp(s_l0 - s_a0)
    lam_eff = s * lam_raw
    assert st.logs["lambda_raw"].item() == pytest.approx(lam_raw, rel=1e-5)
    assert st.logs["lambda_eff"].item() == pytest.approx(lam_eff, rel=1e-5)
    assert st.logs["s_p"].item() == pytest.approx(s, abs=1e-7)
    # weights: exactly ∇(base + λ_eff·L_align), λ_eff a constant
    assert_all_close(wg, weight_grads_of(lambda base, align: base + lam_eff * align, model, x, y, A))

    # σ: exactly ∇ L_σ, with base and L_align as numbers
    def L_sigma(s_l, s_a):
        out = 0.5 * torch.exp(-s_l) * b + s * 0.5 * torch.exp(-s_a) * la + 0.5 * (s_l + s_a)
        out = out + gamma_reg * torch.exp(-s_a) + beta * s_l ** 2
        return out + gamma_lambda * torch.relu(torch.exp(s_l - s_a) - lambda_max)

    assert_all_close(sg, sigma_grads_of(L_sigma, s_l0, s_a0))


@pytest.mark.parametrize("anneal,p", [("constant", 0.0), ("constant", 0.7), ("linear", 0.4), ("cosine", 0.9)])
def test_uw_rescaled_weights_see_base_plus_lambda_raw_align(anneal, p):
    """V10-rescaled (and V11 = + a(p)): weights see base + a(p)·λ_raw·L_align; σ the gradient of
    L' = 2·sg(e^{s_l})·L."""
    model, x, y, A = tiny_setup(1)
    L = LamLearner("uw-rescaled", 4.0, anneal=anneal)
    with torch.no_grad():
        L.s_l.fill_(-0.3)
    wg, sg, st, b, la = learner_grads(L, model, x, y, A, p)
    a = sched(anneal, p)
    lam_raw = math.exp(-0.3 + math.log(4.0))
    assert_all_close(wg, weight_grads_of(lambda base, align: base + a * lam_raw * align, model, x, y, A))
    if anneal == "constant":  # plain V10-rescaled: no annealing anywhere
        assert_all_close(wg, weight_grads_of(lambda base, align: base + lam_raw * align, model, x, y, A))
    scale = 2 * math.exp(-0.3)

    def L_prime(s_l, s_a):
        return scale * (0.5 * torch.exp(-s_l) * b + 0.5 * torch.exp(-s_a) * a * la + 0.5 * (s_l + s_a))

    assert_all_close(sg, sigma_grads_of(L_prime, -0.3, -math.log(4.0)))


def test_uw_is_one_objective_for_weights_and_sigma():
    """V10: weights and σ both get the gradient of L = ½e^{−s_l}·base + ½e^{−s_a}·L_align + ½(s_l + s_a)."""
    model, x, y, A = tiny_setup(2)
    L = LamLearner("uw", 2.5)
    with torch.no_grad():
        L.s_l.fill_(0.25)
    wg, sg, st, _, _ = learner_grads(L, model, x, y, A, 0.3)
    s_l = torch.tensor(0.25, requires_grad=True)
    s_a = torch.tensor(-math.log(2.5), requires_grad=True)
    base, align = tiny_losses(model, x, y, A)
    full = 0.5 * torch.exp(-s_l) * base + 0.5 * torch.exp(-s_a) * align + 0.5 * (s_l + s_a)
    ref = torch.autograd.grad(full, list(model.parameters()) + [s_l, s_a])
    assert_all_close(wg, list(ref[:-2]))
    assert_all_close(sg, list(ref[-2:]))
    # the hidden learning-rate change: the weights' gradient is ½e^{−s_l} times that of base + λ_raw·L_align
    lam_raw = math.exp(0.25 + math.log(2.5))
    plain = weight_grads_of(lambda b, a: b + lam_raw * a, model, x, y, A)
    assert_all_close(wg, [0.5 * math.exp(-0.25) * g for g in plain])
    assert st.logs["loss_scale"].item() == pytest.approx(0.5 * math.exp(-0.25))


def test_sigma_gradient_does_not_leak_into_weights_under_uw_rescaled():
    """Counter-check that routing is not vacuous: without the stop-gradient on σ²_local the weights would get
    2e^{s_l}·½e^{−s_l} = 1× base but σ would see base's gradient scaled — compare against the *wrong*
    (un-detached) formula and make sure the learner does not match it for σ."""
    model, x, y, A = tiny_setup(3)
    L = LamLearner("uw-rescaled", 4.0)
    with torch.no_grad():
        L.s_l.fill_(0.5)
    _, sg, _, b, la = learner_grads(L, model, x, y, A, 0.0)

    def wrong(s_l, s_a):  # differentiating through the 2·σ²_local factor too
        return 2 * torch.exp(s_l) * (0.5 * torch.exp(-s_l) * b + 0.5 * torch.exp(-s_a) * la + 0.5 * (s_l + s_a))

    w = sigma_grads_of(wrong, 0.5, -math.log(4.0))
    assert not torch.allclose(sg[0], w[0], rtol=1e-3)


# ---------------------------------------------------------------------------------------------------
# warm start, valve


@pytest.mark.parametrize("preset", LEARNER_PRESETS)
def test_lambda_raw_starts_at_entropy_rule(preset):
    cfg = load_config(preset=preset)
    assert cfg.align.lambda_rule == "entropy" and cfg.align.anchors == "etf"
    H = 0.37
    want = 0.1 + H * (10.0 - 0.1)
    assert initial_lambda(cfg, H) == pytest.approx(want)
    prov = provider(cfg, H)
    assert isinstance(prov, LamLearner)
    assert prov.s_l.item() == 0.0
    assert prov.s_a.item() == pytest.approx(-math.log(want), rel=1e-6)
    st = prov(torch.tensor(2.0), torch.tensor(0.5), 0.0)
    assert st.logs["lambda_raw"].item() == pytest.approx(want, rel=1e-6)
    assert st.logs["lambda_eff"].item() == pytest.approx(want, rel=1e-6)  # s(0) = a(0) = 1


def test_valve_is_zero_below_lambda_max_and_pushes_down_above():
    def sigma_loss_and_grads(lam0, gamma_lambda, p=1.0):
        L = LamLearner("decoupled", lam0, anneal="linear", gamma_reg=1e-3, beta=0.01, gamma_lambda=gamma_lambda,
                       valve_threshold=50.0)
        st = L(torch.tensor(3.0), torch.tensor(0.2), p)
        st.sigma.backward()
        return L, st.sigma.item(), L.s_l.grad.clone(), L.s_a.grad.clone()

    # below λ_max: the valve adds nothing, neither to the loss nor to the gradient
    _, v0, gl0, ga0 = sigma_loss_and_grads(40.0, 0.0)
    _, v1, gl1, ga1 = sigma_loss_and_grads(40.0, 0.1)
    assert v0 == v1 and torch.equal(gl0, gl1) and torch.equal(ga0, ga1)
    # above: + γ_λ·λ_raw on ∂/∂s_l, − γ_λ·λ_raw on ∂/∂s_a (λ_raw = exp(s_l − s_a) carries the gradient)
    L0, v0, gl0, ga0 = sigma_loss_and_grads(80.0, 0.0)
    L1, v1, gl1, ga1 = sigma_loss_and_grads(80.0, 0.1)
    assert v1 - v0 == pytest.approx(0.1 * (80.0 - 50.0), rel=1e-4)
    assert (gl1 - gl0).item() == pytest.approx(0.1 * 80.0, rel=1e-4)
    assert (ga1 - ga0).item() == pytest.approx(-0.1 * 80.0, rel=1e-4)
    # one σ step: without the valve λ_raw climbs (annealing has switched the align term off), with it λ_raw falls
    L0.step()
    L1.step()
    assert L0.state_logs()["lambda_raw_end"] > 80.0
    assert L1.state_logs()["lambda_raw_end"] < 80.0


# ---------------------------------------------------------------------------------------------------
# the notes' failure modes, reproduced under control


def run_trainer_like(learner, steps, p, seed=0, weight_lr=0.02, base_scale=8.0):
    """The trainer's loop on the tiny model: forward, provider, one backward, weight step with clipping, σ step.
    Fresh random labels keep the local task from getting easy, and `base_scale` brings the tiny model's base
    (≈ 1.4) to the size of FAFI's four-term base on real data (≈ 10 early in training). Returns λ_raw after
    every σ step."""
    torch.manual_seed(seed)
    model, x, y, A = tiny_setup(seed)
    opt = torch.optim.SGD(model.parameters(), lr=weight_lr, momentum=0.9)
    traj = []
    for t in range(steps):
        yb = torch.randint(0, 4, (16,))  # fresh random labels: the local task never gets easy
        opt.zero_grad(set_to_none=True)
        base, align = tiny_losses(model, x, yb, A)
        st = learner(base_scale * base, align, p)
        (st.local + st.align + (st.sigma if st.sigma is not None else 0)).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        learner.step()
        traj.append(learner.state_logs()["lambda_raw_end"])
    return traj


def preset_learner(preset, lam0, **over):
    cfg = load_config(preset=preset, overrides=[f"lam.{k}={v}" for k, v in over.items()])
    cfg = cfg.model_copy(update={"align": cfg.align.model_copy(update={"lambda_rule": "fixed", "lambda0": lam0})})
    return provider(cfg, 0.0)


def provider(cfg, H):
    """The client's λ provider as the trainer builds it: by name, from its run facts and options."""
    return LAM_PROVIDERS.create(cfg.lam.learner, lam_facts(cfg, H, CPU), cfg.lam.options)


@pytest.mark.parametrize("v11", ["uw-anneal-linear", "uw-anneal-cosine"])
def test_v11_explodes_when_annealing_switches_align_off_flare_does_not(v11):
    """Notes (002): as a(p) → 0, s_a loses the align term's pull, the ½ s_a regulariser drives it down and
    λ_raw explodes. At p = 1 (a = 0) V11 grows by orders of magnitude within a few hundred σ steps (default
    σ lr 0.005); FLARE under exactly the same conditions stays within a small factor of λ_max."""
    lam0 = 10.0
    v11_traj = run_trainer_like(preset_learner(v11, lam0), 300, p=1.0)
    assert all(math.isfinite(v) for v in v11_traj)
    assert v11_traj[-1] > 100 * lam0                      # orders of magnitude in 300 steps
    assert v11_traj[-1] > 100 * v11_traj[0]
    fl_traj = long_runs()["flare-300"]
    assert max(fl_traj) < 2 * 50.0
    assert max(fl_traj) > 0.8 * 50.0                      # it did reach the ceiling: the valve is what stops it


_LONG: dict = {}


def long_runs():
    """Shared trajectories (computed once): the same conditions for every method, a = s(p) = 0."""
    if not _LONG:
        _LONG["flare-300"] = run_trainer_like(preset_learner("flare", 10.0), 300, p=1.0)
        # σ lr × 10 compresses the notes' 50 rounds into a few hundred steps
        for name in ("decoupled", "decoupled-stable", "flare"):
            _LONG[name] = run_trainer_like(preset_learner(name, 10.0, sigma_lr=0.05), 800, p=1.0)
    return _LONG


def test_long_horizon_v12_and_v13_explode_flare_holds():
    """The SVHN story: V12 runs past 100 × λ_max; V13's anchor (γ_reg = 1e-3) floors σ²_align but λ_raw still
    ends far above λ_max; FLARE's valve holds it near λ_max without collapsing it."""
    runs = long_runs()
    assert runs["decoupled"][-1] > 100 * 50.0
    assert max(runs["decoupled-stable"]) > 5 * 50.0
    assert runs["decoupled-stable"][-1] < runs["decoupled"][-1] / 100   # the anchor does something
    fl = runs["flare"]
    assert max(fl) < 1.2 * 50.0
    assert min(fl[len(fl) // 2:]) > 0.5 * 50.0


# ---------------------------------------------------------------------------------------------------
# state


def test_state_dict_round_trip_weights_only(tmp_path):
    L = LamLearner("decoupled", 3.0, sigma_lr=0.05, anneal="linear", gamma_reg=1e-3, beta=0.01,
                   gamma_lambda=0.1)
    for _ in range(5):
        st = L(torch.tensor(2.0), torch.tensor(0.3), 0.5)
        st.sigma.backward()
        L.step()
    torch.save({"lam": L.state_dict()}, tmp_path / "ck.pt")
    state = torch.load(tmp_path / "ck.pt", weights_only=True)["lam"]
    M = LamLearner("decoupled", 7.0, sigma_lr=0.001, anneal="linear", gamma_reg=1e-3, beta=0.01,
                   gamma_lambda=0.1)
    M.load_state_dict(state)
    assert M.s_l.item() == L.s_l.item() and M.s_a.item() == L.s_a.item()
    assert M.optimizer.param_groups[0]["lr"] == 0.05   # the σ optimizer's state travels too
    assert M.s_l.requires_grad and M.s_a.requires_grad
    assert M.optimizer.param_groups[0]["params"][0] is M.s_l
    for _ in range(3):  # continuing from the copy is continuing from the original
        for X in (L, M):
            X(torch.tensor(2.0), torch.tensor(0.3), 0.6).sigma.backward()
            X.step()
    assert M.s_l.item() == L.s_l.item() and M.s_a.item() == L.s_a.item()
    assert M.state_logs() == L.state_logs()
    with pytest.raises(FlareError):
        LamLearner("uw", 3.0).load_state_dict(state)


def test_config_mistakes_are_flare_errors():
    # every cross-key mistake is caught by the config, before any data is loaded
    with pytest.raises(FlareError) as e:
        load_config(overrides=["lam.learner=decoupled"])  # no anchors
    assert e.value.key == "align.anchors"
    with pytest.raises(FlareError) as e:
        load_config(preset="flare", overrides=["align.schedule=linear"])
    assert e.value.key == "align.schedule"
    with pytest.raises(FlareError) as e:
        load_config(preset="uw-rescaled", overrides=["lam.gamma_lambda=0.1"])
    assert e.value.key == "lam.learner"
    with pytest.raises(FlareError) as e:
        load_config(preset="flare", overrides=["align.lambda_min=0"])
    assert e.value.key == "align.lambda_min"
    with pytest.raises(FlareError) as e:  # the learners' own check, run once, by the config
        load_config(preset="flare", overrides=["align.lambda_rule=fixed", "align.lambda0=0"])
    assert e.value.key == "align.lambda0"


# ---------------------------------------------------------------------------------------------------
# inside the real trainer: one forward, one backward per step; logs; checkpoints


class TwoViews(nn.Module):
    def forward(self, x):
        x = x.float() / 255.0
        return x, x.flip(-1)


def make_client(preset, tmp_overrides=()):
    from flare.client.terms.align import AnchorFacts
    from flare.client.trainer import Client, TrainContext
    from flare.models import create_model
    from flare.schedules import LRSchedule

    cfg = load_config(preset=preset, overrides=["rounds=3", "batch_size=8", "channels_last=false", "device=cpu",
                                                "model.name=cnn", "model.width=0.25", *tmp_overrides])
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (20, 1, 28, 28), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (20,), generator=g)
    model = create_model("cnn", 1, 10, 0.25, head="prototype")
    anchors = ANCHORS.create("etf", AnchorFacts(10, model.feature_dim, 8))
    ctx = TrainContext(cfg=cfg, train_x=x, train_y=y, augment=TwoViews(), anchors=anchors, device=CPU,
                       amp_dtype=None, lr_schedule=LRSchedule("constant", cfg.lr, cfg.total_epochs))
    return Client(0, torch.arange(20), model, ctx, normalized_entropy=0.5), ctx


def test_trainer_single_forward_single_backward_logs_and_checkpoint(tmp_path, monkeypatch):
    client, ctx = make_client("flare")
    forwards = []
    client.model.register_forward_hook(lambda *a: forwards.append(1))
    backwards = []
    real_backward = torch.autograd.backward

    def counting_backward(*a, **k):
        backwards.append(1)
        return real_backward(*a, **k)

    monkeypatch.setattr(torch.autograd, "backward", counting_backward)
    s_before = (client.lam.s_l.item(), client.lam.s_a.item())
    rec = client.train_round(ctx, 0)
    steps = rec["steps"]
    assert steps == 3 and len(forwards) == steps and len(backwards) == steps
    for k in ("s_l", "s_a", "lambda_raw", "lambda_eff", "s_p", "base_loss", "align_loss"):
        assert k in rec and math.isfinite(rec[k]), k
    assert (rec["s_l"], rec["s_a"]) != s_before               # σ learned
    assert rec["lambda_raw"] == pytest.approx(0.1 + 0.5 * 9.9, rel=0.05)
    assert rec["s_p"] == pytest.approx(1.0)                    # p = 0 during round 0
    assert client.lam.s_l.grad is None                         # σ gradients cleared after their step
    # checkpoint through the real client state, read back with weights_only=True
    torch.save({"clients": [client.state_dict()]}, tmp_path / "checkpoint.pt")
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    other, _ = make_client("flare")
    other.load_state_dict(ck["clients"][0])
    assert other.lam.s_l.item() == client.lam.s_l.item() and other.lam.s_a.item() == client.lam.s_a.item()
    monkeypatch.setattr(torch.autograd, "backward", real_backward)
    r1 = client.train_round(ctx, 1)
    r2 = other.train_round(ctx, 1)
    assert r1["s_l"] == pytest.approx(r2["s_l"], abs=1e-6) and r1["s_a"] == pytest.approx(r2["s_a"], abs=1e-6)
    assert r1["s_p"] == pytest.approx(1 - 1 / 3)


@pytest.mark.parametrize("preset", ["uw", "uw-anneal-cosine"])
def test_trainer_runs_uw_modes(preset):
    client, ctx = make_client(preset)
    rec = client.train_round(ctx, 0)
    assert math.isfinite(rec["lambda_raw"]) and math.isfinite(rec["s_a"])
    assert client.lam.s_a.grad is None


# ---------------------------------------------------------------------------------------------------
# the runner's warning


def test_watch_warns_on_runaway_and_non_finite_lambda_raw(tmp_path):
    from flare.report.run_report import summary_markdown
    from flare.rundata import RunData
    from flare.rundir import RunDir

    cfg = load_config(preset="decoupled")
    recs = [{"client": 0, "round": 7, "lambda_raw": 4999.0},            # just below 100 × λ_max: fine
            {"client": 3, "round": 14, "lambda_raw": 204658.41},        # the notes' SVHN client 3
            {"client": 1, "round": 14, "lambda_raw": float("inf")},
            {"client": 2, "round": 15, "lambda_raw": float("nan")},
            {"client": 4, "round": 15}]                                  # no λ learner logs
    found = runaway_warnings(cfg, recs)  # records hold the 0-based round index; messages count from 1
    assert len(found) == 3
    assert "client 3, round 15" in found[0]
    assert "client 1, round 15" in found[1] and "client 2, round 16" in found[2]
    assert not any("client 0" in w for w in found)
    RunDir(tmp_path).write_state("running", 15, found)
    md = summary_markdown(RunData.load(tmp_path))
    assert "## Warnings" in md and "client 3, round 15" in md


def test_watch_fires_on_a_real_v11_explosion(tmp_path):
    """End to end at the learner level: the state a V11 client reaches at a → 0 trips the runner's warning."""
    L = preset_learner("uw-anneal-linear", 10.0, sigma_lr=0.05)
    traj = run_trainer_like(L, 100, p=1.0)
    rec = {"client": 2, "round": 9, **L.state_logs(), "lambda_raw": sum(traj[-10:]) / 10}
    found = runaway_warnings(load_config(preset="uw-anneal-linear"), [rec])
    assert found and "client 2, round 10" in found[0]


def test_pcgrad_composes_with_the_learner():
    """Gradient surgery looks at `local` and `align` over the weights; σ's objective lives in `sigma` only, so
    σ still learn and nothing of L_σ reaches the weights."""
    client, ctx = make_client("flare", ["align.surgery=pcgrad"])
    before = (client.lam.s_l.item(), client.lam.s_a.item())
    rec = client.train_round(ctx, 0)
    assert rec["pcgrad_extra_on_weights"] == 0.0
    assert (rec["s_l"], rec["s_a"]) != before
