"""IntactOFL (flare/baselines/intactofl.py) against its reference code, zenghui9977/IntactOFL: the gate and the
mixture, one generator step's loss and one gate step (loss and update) equal the reference's formulas, written out
here on the same tensors; the client models stay intact; and the strategy runs through `flare run`, `flare fuse`
and the Flower server (the in-process engine stand-in of test_flower_protocol.py)."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import flare_in_process
from test_baselines_data import client, norm, patterns

from flare.baselines.intactofl import GateSynthesis, IntactOFL, IntactOFLOptions, MixtureOfExperts
from flare.baselines.kd import eval_mode
from flare.config import load_config
from flare.rundir import read_jsonl
from flare.runner import Run
from flare.server.strategy import ServerContext, make_strategy, strategy_facts

TINY = {"epochs": 3, "g_steps": 6, "synthesis_batch": 16, "batch_size": 16}
TINY_OPTIONS = [f"server.strategies.intactofl.{k}={v}" for k, v in TINY.items()]
SHAPE = (3, 12, 12)


def reference_kldiv(logits, targets, T, reduction="batchmean"):
    """synthesizer_utils.py:28-31."""
    q = F.log_softmax(logits / T, dim=1)
    p = F.softmax(targets / T, dim=1)
    return F.kl_div(q, p, reduction=reduction) * (T * T)


def reference_gate(linear, x, topk):
    """LinearGatingNetwork.forward, synthesizer_utils.py:820-828."""
    h = linear(x.view(-1, x[0].numel()))
    topk_logits, indices = h.topk(topk, dim=-1)
    return torch.full_like(h, 0.0).scatter(-1, indices, topk_logits)


def reference_moe(models, linear, x, topk):
    """MoEEnsemble.forward without features, synthesizer_utils.py:845-888: (logits, weights)."""
    weight_list = reference_gate(linear, x, topk)
    logits_total = torch.stack([m(x)[1] for m in models], dim=0)
    return torch.mean(logits_total.permute(1, 0, 2) * weight_list.unsqueeze(-1), dim=1), weight_list


def reference_ensemble(models, x):
    """utils.py:241-265: Σ_k logits_k / K."""
    total = 0
    for m in models:
        total = total + m(x)[1] * (1.0 / len(models))
    return total


class LinearExpert(torch.nn.Module):
    def __init__(self, d, c, seed):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, c, generator=torch.Generator().manual_seed(seed)))
        self.num_classes = c

    def forward(self, x):
        return x.flatten(1), x.flatten(1) @ self.w


def test_the_gate_and_the_mixture_are_the_references():
    K, B, C = 5, 6, 4
    x = torch.randn(B, *SHAPE, generator=torch.Generator().manual_seed(1))
    experts = [LinearExpert(x[0].numel(), C, s) for s in range(K)]
    torch.manual_seed(2)
    gate = torch.nn.Linear(x[0].numel(), K)
    moe = MixtureOfExperts(experts, gate, top_k=3)
    with torch.no_grad():
        w, out = moe(x)
        ref_out, ref_w = reference_moe(experts, gate, x, 3)
    assert torch.equal(w, ref_w)
    assert torch.allclose(out, ref_out, rtol=1e-6, atol=1e-6)
    assert ((w == 0).sum(1) == K - 3).all()  # top-3 of 5: two zeroed per row, and the kept ones are the largest
    scores = gate(x.flatten(1))
    kept = w != 0
    assert (scores[kept].view(B, 3).min(1).values >= scores[~kept].view(B, 2).max(1).values).all()
    b, c = 4, 2  # one entry by hand: (1/K) Σ_k w_bk z_k[b, c]
    by_hand = sum(float(w[b, k]) * float(x[b].flatten() @ experts[k].w.detach()[:, c]) for k in range(K)) / K
    assert float(out[b, c]) == pytest.approx(by_hand, rel=1e-5)


def test_top_k_share_and_options():
    models = [LinearExpert(4, 2, s) for s in range(5)]
    for share, k in ((1.0, 5), (0.6, 3), (0.1, 1)):  # int(share·K) (oneshot_intactofl.py:55), at least one
        cfg, ctx = context(models=models, extra=[f"server.strategies.intactofl.top_k_share={share}"])
        assert GateSynthesis(strategy_facts(cfg), make_strategy(cfg, "intactofl").options, ctx, SHAPE, IntactOFL.tag,
                             False).student.top_k == k
    o = IntactOFLOptions()  # the published CIFAR-10 setting (cifar10_clients5_dir0.1.yaml:123-144)
    assert (o.epochs, o.g_steps, o.lr_g, o.synthesis_batch, o.batch_size, o.lr, o.weight_decay, o.temperature,
            o.balance, o.distill, o.top_k_share, o.adv_temperature, o.clip) == (
        200, 30, 1e-3, 128, 128, 0.01, 1e-4, 4.0, 0.01, 1.0, 1.0, 3.0, 10.0)


def context(models=None, extra=(), seed=0, weights=None):
    """Two tiny skewed clients (test_baselines_data.py's), uniform weights (the reference's Ensemble)."""
    cfg = load_config(None, "fedavg", ["model.name=cnn", "model.width=0.25", "device=cpu", f"seed={seed}",
                                       *TINY_OPTIONS, *extra])
    models = models or [client(11, "linear", (0, 1, 2)), client(12, "linear", (1, 2, 3))]
    w = weights if weights is not None else torch.full((len(models),), 1.0 / len(models))
    return cfg, ServerContext(0, [], models, w, None, None, {}, [], None, norm, SHAPE)


def test_one_generator_step_loss_is_the_references():
    """IntactOFLSynthesizer.synthesize (synthesizer_utils.py:677-732): the mixture is the teacher, the plain
    ensemble the adversary, BN term Σ r / K over the teacher's forward (DeepInversionHook, :43-64)."""
    cfg, ctx = context(extra=["server.strategies.intactofl.g_steps=1", "server.strategies.intactofl.top_k_share=0.5"])
    o = make_strategy(cfg, "intactofl").options
    syn = GateSynthesis(strategy_facts(cfg), o, ctx, SHAPE, IntactOFL.tag, False)
    gen = copy.deepcopy(syn.gen_net)
    g = torch.Generator().set_state(syn.g.get_state())
    with eval_mode(ctx.models):
        syn.synthesize()
    (got,) = syn.g_losses[0]

    gen.reset(g)  # the generator's re-initialisation draws, then z and the sorted pseudo-labels (:690-695)
    z = torch.randn(o.synthesis_batch, o.nz, generator=g)
    targets = torch.randint(0, 4, (o.synthesis_batch,), generator=g).sort()[0]
    gen.train()
    inputs = (gen(z) - 0.5) / 0.25  # Normalizer(mean 0.5, std 0.25): the test's normalisation
    r_features = {}

    def hook(module, inp, out):
        x = inp[0]
        mean = x.mean([0, 2, 3])
        var = x.permute(1, 0, 2, 3).contiguous().view([x.shape[1], -1]).var(1, unbiased=False)
        r_features[module] = torch.norm(module.running_var.data - var, 2) + torch.norm(
            module.running_mean.data - mean, 2)

    bns = [b for m in ctx.models for b in m.modules() if isinstance(b, torch.nn.BatchNorm2d)]
    assert bns
    handles = [b.register_forward_hook(hook) for b in bns]
    try:
        with torch.no_grad():
            t_out, _ = reference_moe(ctx.models, syn.student.gate, inputs, 1)
            loss_bn = sum(r_features.values()) / len(ctx.models)
            loss_oh = F.cross_entropy(t_out, targets)
            s_out = reference_ensemble(ctx.models, inputs)
            mask = (s_out.max(1)[1] != t_out.max(1)[1]).float()
            loss_adv = -(reference_kldiv(s_out, t_out, T=3, reduction="none").sum(1) * mask).mean()
    finally:
        for h in handles:
            h.remove()
    assert mask.sum() > 0 and loss_bn > 0  # every term is exercised
    want = float(o.bn * loss_bn + o.oh * loss_oh + o.adv * loss_adv)
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("perturb", ["ods", "none"])
def test_one_gate_step_is_the_references(perturb):
    """intactofl_moe_train (oneshot_intactofl.py:9-46) on one pool batch: the ODS step on the plain ensemble, the
    loss CE + α·std(weights) + β·KL_T, the gate's gradient clipped to 10, one SGD step (:101)."""
    cfg, ctx = context(extra=["server.strategies.intactofl.batch_size=8", "server.strategies.intactofl.top_k_share=0.5",
                              f"server.strategies.intactofl.perturb={perturb}",
                              "server.strategies.intactofl.balance=0.5"])  # a visible balance term
    o = make_strategy(cfg, "intactofl").options
    syn = GateSynthesis(strategy_facts(cfg), o, ctx, SHAPE, IntactOFL.tag, False)
    syn.pool_x, syn.pool_y = patterns(8, 3), torch.arange(8) % 4
    gate = copy.deepcopy(syn.student.gate)
    g = torch.Generator().set_state(syn.g.get_state())
    with eval_mode(ctx.models):
        syn.distil()
    (got,) = syn.kd_losses

    perm = torch.randperm(8, generator=g)  # the pool's shuffle (the reference's DataLoader(shuffle=True))
    images, labels = norm(syn.pool_x[perm]), syn.pool_y[perm]
    if perturb == "ods":
        images.requires_grad = True
        out = reference_ensemble(ctx.models, images)
        random_w = torch.rand(out.shape, generator=g) * 2 - 1  # uniform_(-1, 1)
        loss_ods = (random_w * F.softmax(out / 4, dim=1)).sum()
        loss_ods.backward()
        images = (torch.sign(images.grad) * o.eps + images).detach()
    logits, out_weights = reference_moe(ctx.models, gate, images, 1)
    with torch.no_grad():
        t_out = reference_ensemble(ctx.models, images)
    loss = (F.cross_entropy(logits, labels) + 0.5 * torch.std(out_weights)
            + 1.0 * reference_kldiv(logits, t_out.detach(), T=4))
    assert got == pytest.approx(loss.item(), rel=1e-5)
    before = gate.weight.detach().clone()
    opt = torch.optim.SGD(gate.parameters(), 0.01, weight_decay=1e-4, momentum=0.9)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters=gate.parameters(), max_norm=10)
    opt.step()
    new = syn.student.gate
    assert not torch.equal(new.weight, before), "the gate moved"
    assert torch.allclose(new.weight, gate.weight, rtol=1e-5, atol=1e-7)
    assert torch.allclose(new.bias, gate.bias, rtol=1e-5, atol=1e-7)


def test_the_gate_learns_on_a_fixed_pool():
    """Passes over one pool of 16 images: with the published lr the gate's loss falls; with lr ≈ 0 it stays where it
    started (nothing else moves without ODS and augmentation), so the first assertion can fail."""
    losses = {}
    for lr in ("0.01", "1e-12"):
        cfg, ctx = context(extra=[f"server.strategies.intactofl.lr={lr}", "server.strategies.intactofl.epochs=20",
                                  "server.strategies.intactofl.perturb=none"])
        syn = GateSynthesis(strategy_facts(cfg), make_strategy(cfg, "intactofl").options, ctx, SHAPE, IntactOFL.tag, False)
        syn.pool_x, syn.pool_y = patterns(16, 3), torch.arange(16) % 4
        with eval_mode(ctx.models):
            for _ in range(20):
                syn.distil()
        losses[lr] = syn.kd_losses
    first, last = losses["0.01"][0], losses["0.01"][-1]
    assert last < 0.9 * first, losses["0.01"]
    assert losses["1e-12"][0] == pytest.approx(first, rel=1e-6)
    assert losses["1e-12"][-1] == pytest.approx(first, rel=1e-4)


def test_the_experts_stay_intact_and_the_predictor_is_a_function_of_the_seed():
    x = norm(patterns(16, 5))
    outs = []
    for seed in (0, 0, 1):
        cfg, ctx = context(seed=seed)
        for m in ctx.models:
            m.train()  # as the in-process runner hands the live client models over
        saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in ctx.models]
        rng = torch.get_rng_state()
        pred = make_strategy(cfg, "intactofl").predictor(ctx)
        assert torch.equal(torch.get_rng_state(), rng)  # the global generator is never drawn from
        for m, st in zip(ctx.models, saved):
            assert m.training and all(torch.equal(v, st[k]) for k, v in m.state_dict().items())
        moe = pred.model
        assert list(moe.state_dict()) == ["gate.weight", "gate.bias"]  # only the gate is the server's own
        for e, m in zip(moe.experts, ctx.models):  # frozen copies of the clients, as they were
            assert e is not m and not e.training and all(torch.equal(v, m.state_dict()[k])
                                                         for k, v in e.state_dict().items())
        with torch.no_grad():
            outs.append(pred.scores(x))
            w, logits = moe(x)
            assert torch.equal(outs[-1], logits.float())
        assert pred.logs["pool"] == 3 * 16 and pred.logs["top_k"] == 2 and pred.logs["g_loss_last"] < \
            pred.logs["g_loss_first"]
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def rounds_of(d):
    return [r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "round"]


@pytest.mark.long
def test_through_flare_run_and_flare_fuse(tiny_overrides, tmp_path, capsys):
    cfg = load_config(None, "fedavg", tiny_overrides + ["rounds=2", "eval.rules=[primary,output,intactofl]",
                                                        *TINY_OPTIONS])
    d = tmp_path / "ce"
    Run(cfg, d, quiet=True).execute()
    first, last = rounds_of(d)
    assert "acc_intactofl" not in first  # every_round = False: the last round only
    assert 0 <= last["acc_intactofl"] <= 1 and last["intactofl.seconds"] > 0 and last["intactofl.pool"] == 48
    assert last["intactofl.top_k"] == 3 and last["intactofl.g_loss_last"] < last["intactofl.g_loss_first"]
    # with a budget curve (scored for the record only, it changes nothing the gate learns)
    # in this process, as the run was (test_baselines_data.py fuses the other data-free servers in a real process)
    r = flare_in_process(["fuse", d, "--strategies", "intactofl", *TINY_OPTIONS,
                          "server.strategies.intactofl.curve_every=1"], capsys)
    assert r.returncode == 0, r.stderr
    (fused,) = [f for f in read_jsonl(d / "fuse.jsonl") if f["kind"] == "fuse"]
    assert fused["strategy"] == "intactofl" and fused["options"]["epochs"] == 3
    # the same saved clients, seed and options: the run's own numbers
    assert fused["acc"] == last["acc_intactofl"]
    assert fused["intactofl.gate_loss_last"] == last["intactofl.gate_loss_last"]
    curve = fused["intactofl.curve"]
    assert [c[:2] for c in curve] == [[1, 6], [2, 12], [3, 18]] and curve[-1][2] == fused["acc"]
    bad = flare_in_process(["fuse", d, "--strategies", "intactofl", "server.strategies.intactofl.top_k_share=0"],
                           capsys)
    assert bad.returncode == 2 and "server.strategies.intactofl.top_k_share" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_through_the_flower_server(tiny_overrides, tmp_path):
    """The primary strategy over Flower's protocol (test_flower_protocol.py's engine stand-in): `flare run`'s
    numbers, and no predictor file — a gate over K experts is not one model of the run's architecture."""
    pytest.importorskip("flwr")
    from test_flower_protocol import Nodes, strip

    ov = tiny_overrides + ["rounds=1", "server.primary=intactofl", *TINY_OPTIONS]
    Run(load_config(None, "fedavg", ov), tmp_path / "inproc", quiet=True).execute()
    Nodes().federate(ov, tmp_path / "fed", preset="fedavg")
    a, b = rounds_of(tmp_path / "inproc"), rounds_of(tmp_path / "fed")
    timeless = lambda r: {k: v for k, v in strip(r).items() if not k.endswith(".seconds")}  # noqa: E731
    assert [timeless(r) for r in a] == [timeless(r) for r in b]
    (last,) = b
    assert last["primary"] == "intactofl" and last["acc"] == last["acc_intactofl"]
    state = json.loads((tmp_path / "fed" / "state.json").read_text())
    assert any("no predictor saved" in w and "intactofl" in w for w in state["warnings"])
