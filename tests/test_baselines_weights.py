"""Weight-space fusion baselines (flare/baselines/otfusion.py, fedlpa.py): OTFusion undoes a neuron permutation
(BatchNorm and residual streams included), RegMean/FedLPA return identical clients unchanged and solve their linear
system exactly, every one is deterministic, all three run end to end through `flare run` and `flare fuse`, and bad
inputs are one-paragraph errors naming the key."""
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import flare_in_process
from flare.config import load_config
from flare.errors import FlareError
from flare.models import create_model
from flare.rundir import read_jsonl
from flare.runner import Run
from flare.server.extras import ClientData
from flare.server.strategy import ServerContext, make_strategy
from flare.server.upload import Upload
from flare.baselines.fedlpa import blocks, client_factors, damped, factor_layers, solve_layer
from flare.baselines.otfusion import alignment_plan


def randomise_bn(model: torch.nn.Module, seed: int = 0) -> None:
    """BatchNorm weights, biases and running statistics away from their init, so the test sees them mapped."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            m.weight.data = 1 + 0.3 * torch.randn(n, generator=g)
            m.bias.data = 0.3 * torch.randn(n, generator=g)
            m.running_mean = 0.2 * torch.randn(n, generator=g)
            m.running_var = 0.5 + torch.rand(n, generator=g)


def permuted(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """A copy with every hidden channel permuted, written out by hand per architecture (independent of the plan the
    fusion builds): the small CNN's three layers; ResNet-18's four residual streams (stem + layer1, then one per
    stage, shared by each block's conv2/bn2 and its shortcut) and every block's inner conv1 channels."""
    g = torch.Generator().manual_seed(seed)
    sd = {k: v.clone() for k, v in model.state_dict().items()}

    def perm(n):
        return torch.randperm(n, generator=g)

    def conv(prefix, out_p, in_p):
        w = sd[f"{prefix}.weight"]
        w = w[out_p] if out_p is not None else w
        sd[f"{prefix}.weight"] = w[:, in_p] if in_p is not None else w

    def bn(prefix, p):
        for k in ("weight", "bias", "running_mean", "running_var"):
            sd[f"{prefix}.{k}"] = sd[f"{prefix}.{k}"][p]

    enc = model.encoder
    if hasattr(enc, "body"):  # cnn: conv 0, 4, 8 with BN 1, 5, 9
        prev = None
        for c in (0, 4, 8):
            p = perm(enc.body[c].out_channels)
            conv(f"encoder.body.{c}", p, prev)
            bn(f"encoder.body.{c + 1}", p)
            prev = p
    else:  # resnet18
        s = perm(enc.stem[0].out_channels)
        conv("encoder.stem.0", s, None)
        bn("encoder.stem.1", s)
        for li in range(1, 5):
            for bi, block in enumerate(getattr(enc, f"layer{li}")):
                pre = f"encoder.layer{li}.{bi}"
                q = perm(block.conv1.out_channels)
                conv(f"{pre}.conv1", q, s)
                bn(f"{pre}.bn1", q)
                proj = isinstance(block.shortcut, torch.nn.Sequential)
                out = perm(block.conv2.out_channels) if proj else s
                conv(f"{pre}.conv2", out, q)
                bn(f"{pre}.bn2", out)
                if proj:
                    conv(f"{pre}.shortcut.0", out, s)
                    bn(f"{pre}.shortcut.1", out)
                s = out
        prev = s
    if "head.prototypes" in sd:
        sd["head.prototypes"] = sd["head.prototypes"][:, prev]
    else:
        sd["head.fc.weight"] = sd["head.fc.weight"][:, prev]
    other = copy.deepcopy(model)
    other.load_state_dict(sd)
    return other.eval()


def context(cfg, models, weights=None, extras=None, r=0):
    uploads = [Upload(i, m.state_dict(), 10 * (i + 1), getattr(m, "prototypes", None)) for i, m in enumerate(models)]
    w = torch.tensor(weights if weights is not None else [1 / len(models)] * len(models))
    return ServerContext(r, uploads, models, w, None, None, extras=extras or [{} for _ in models])


def close_states(a, b, tol=1e-5):
    return all(torch.allclose(a[k].float(), b[k].float(), atol=tol, rtol=0) for k in a)


@pytest.mark.parametrize("arch,head", [("cnn", "prototype"), ("resnet18", "prototype"), ("resnet18", "linear")])
def test_otfusion_undoes_a_neuron_permutation(arch, head):
    torch.manual_seed(0)
    model = create_model(arch, 3, 4, width=0.25, head=head).eval()
    randomise_bn(model)
    other = permuted(model)
    x = torch.randn(5, 3, 12, 12)
    with torch.no_grad():
        f0, y0 = model(x)
        f1, y1 = other(x)
    assert torch.allclose(y0, y1, atol=1e-5)  # the permutation is a symmetry of the network ...
    assert not close_states(model.state_dict(), other.state_dict())  # ... that moves its weights
    cfg = load_config(None, "fafi", ["server.strategies.otfusion.pivot=0"])
    pred = make_strategy(cfg, "otfusion", "eval.rules").predictor(context(cfg, [model, other], [0.3, 0.7]))
    assert close_states(pred.model.state_dict(), model.state_dict())
    with torch.no_grad():
        assert torch.allclose(pred.scores(x), y0, atol=1e-5)
    assert pred.logs["unmoved_share"] < 0.5 and pred.logs["pivot"] == 0 and pred.logs["seconds"] > 0
    # without the option the pivot is the largest weight: client 1, so the fusion returns the permuted copy
    pred1 = make_strategy(load_config(None, "fafi"), "otfusion").predictor(context(cfg, [model, other], [0.3, 0.7]))
    assert close_states(pred1.model.state_dict(), other.state_dict())


def test_the_alignment_plan_shares_one_map_per_residual_stream():
    plan = alignment_plan(create_model("resnet18", 3, 4, width=0.25))
    g = plan.axes
    assert g["encoder.layer1.0.conv2.weight"][0] == g["encoder.stem.0.weight"][0] == g["encoder.layer1.1.bn2.weight"][0]
    assert g["encoder.layer2.0.conv2.weight"][0] == g["encoder.layer2.0.shortcut.0.weight"][0] \
        == g["encoder.layer2.1.conv2.weight"][0] != g["encoder.layer2.0.conv1.weight"][0]
    assert g["head.prototypes"] == (None, g["encoder.layer4.1.conv2.weight"][0])
    (both,) = [grp for grp in plan.groups if len(grp.rows) == 2 and "layer2.0" in grp.rows[0][0]]
    assert [r[0] for r in both.rows] == ["encoder.layer2.0.conv2.weight", "encoder.layer2.0.shortcut.0.weight"]


def client_data(cfg, model, cid=0, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, 12, 12), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return ClientData(cid, copy.deepcopy(model), x, y, lambda u: u.float() / 127.5 - 1, None, torch.device("cpu"))


@pytest.mark.parametrize("name,arch,head,max_block", [
    ("regmean", "cnn", "prototype", 0), ("fedlpa", "cnn", "prototype", 0), ("regmean", "resnet18", "linear", 0),
    ("fedlpa", "resnet18", "linear", 0), ("regmean", "cnn", "linear", 50), ("fedlpa", "cnn", "prototype", 50)])
def test_identical_clients_come_back_unchanged(name, arch, head, max_block):
    torch.manual_seed(0)
    model = create_model(arch, 3, 4, width=0.25, head=head).eval()
    randomise_bn(model)
    cfg = load_config(None, "fafi", [f"server.strategies.{name}.batches=2", f"server.strategies.{name}.batch_size=16",
                                     f"server.strategies.{name}.max_block={max_block}"])
    s = make_strategy(cfg, name, "eval.rules")
    extras = s.client_extras(client_data(cfg, model))
    assert {k: (tuple(v.shape), v.dtype) for k, v in extras.items()} == s.extras_shapes(model)
    if max_block:  # the 8·9 = 72 and 16·9 = 144 columns of the second and third convs: 2 and 3 blocks of 36 / 48
        assert extras["encoder.body.4.A"].shape == (2, 36, 36) and extras["encoder.body.8.A"].shape == (3, 48, 48)
    pred = s.predictor(context(cfg, [model, copy.deepcopy(model)], [0.25, 0.75], [extras, extras]))
    assert close_states(pred.model.state_dict(), model.state_dict(), 1e-6)
    assert pred.logs["upload_mb"] > 0 and pred.logs["residual"] < 1e-9


def random_spd(n, g):
    q = torch.randn(n, n, generator=g, dtype=torch.float64)
    return q @ q.T + 0.1 * torch.eye(n, dtype=torch.float64)


def test_the_merge_solves_the_linear_system_exactly():
    """2 clients, one layer (3 outputs, 4 inputs + bias): the refined FedLPA solution is the vectorised system's
    (Σ w_k A_kᵀ⊗G_k) vec(M) = Σ w_k vec(G_k W_k A_k); the closed form alone is not; RegMean is its G = I case."""
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    Ws = [torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in w]
    As = [random_spd(5, g) for _ in w]
    Gs = [random_spd(3, g) for _ in w]

    def vec(X):
        return X.T.reshape(-1)  # column-major

    def direct(Gl, Al=As):
        K = sum(wk * torch.kron(A.T.contiguous(), G) for wk, A, G in zip(w, Al, Gl))
        rhs = sum(wk * vec(G @ W @ A) for wk, W, A, G in zip(w, Ws, Al, Gl))
        return torch.linalg.solve(K, rhs).reshape(5, 3).T

    want = direct(Gs)
    M0, res0, _ = solve_layer(Ws, [A[None] for A in As], [G[None] for G in Gs], w, refine_steps=0)
    M, _, res = solve_layer(Ws, [A[None] for A in As], [G[None] for G in Gs], w, refine_steps=20)
    assert (M0 - want).abs().max() > 1e-3 and res0 > 1e-3  # the closed form is an approximation here
    assert torch.allclose(M, want, atol=1e-10) and res < 1e-12
    eye = [torch.eye(3, dtype=torch.float64)] * 2
    R, _, _ = solve_layer(Ws, [A[None] for A in As], None, w)
    assert torch.allclose(R, direct(eye), atol=1e-12)
    # block-diagonal factors (max_block=3 over 5 columns: 2 blocks of 3, padded to 6) solve the block-diagonal system
    nb, bs = blocks(5, 3)
    assert (nb, bs) == (2, 3)
    Ab = [torch.zeros(nb, bs, bs, dtype=torch.float64) for _ in As]
    for A, B in zip(As, Ab):
        B[0], B[1, :2, :2] = A[:3, :3], A[3:, 3:]
    Ab = damped(Ab, 5, 0.0, [0.3, 0.7])
    Af = [torch.block_diag(B[0], B[1, :2, :2]) for B in Ab]
    Mb, _, _ = solve_layer([torch.nn.functional.pad(W, (0, 1)) for W in Ws], Ab, [G[None] for G in Gs], w, 30)
    assert torch.allclose(Mb[:, :5], direct(Gs, Af), atol=1e-9) and Mb[:, 5].abs().max() < 1e-12


def test_the_strategies_are_deterministic():
    torch.manual_seed(0)
    a = create_model("cnn", 3, 4, width=0.25).eval()
    b = create_model("cnn", 3, 4, width=0.25).eval()
    cfg = load_config(None, "fafi", ["server.strategies.fedlpa.fisher=sampled", "server.strategies.fedlpa.batches=2",
                                     "server.strategies.fedlpa.batch_size=16"])
    for name in ("otfusion", "fedlpa"):
        runs = []
        for _ in range(2):
            s = make_strategy(cfg, name, "eval.rules")
            ex = [s.client_extras(client_data(cfg, m, cid=i, seed=i)) for i, m in enumerate((a, b))]
            runs.append((ex, s.predictor(context(cfg, [a, b], [0.4, 0.6], ex)).model.state_dict()))
        (e1, s1), (e2, s2) = runs
        assert all(torch.equal(x[k], y[k]) for x, y in zip(e1, e2) for k in x)
        assert all(torch.equal(s1[k], s2[k]) for k in s1), name
    assert not torch.equal(e1[0]["encoder.body.0.G"], e1[1]["encoder.body.0.G"])


def flare(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "flare.cli", *map(str, argv)], capture_output=True, text=True,
                          env=env)


FAST = ["server.strategies.fedlpa.batches=1", "server.strategies.fedlpa.batch_size=32",
        "server.strategies.regmean.batches=1", "server.strategies.regmean.batch_size=32"]


RULES = "eval.rules=[primary,otfusion,regmean,fedlpa]"


def check_run_and_fuse(d, fuse=lambda *argv: flare("fuse", *argv)):
    """Every strategy scored at the last round only, with its logs; `flare fuse` over the saved states (factors
    recomputed from them) reproduces the run's own numbers. `fuse`: a `flare fuse` process, or the command in this
    process (the numbers are exact either way when both sides run at the same thread count)."""
    rounds = [x for x in read_jsonl(d / "metrics.jsonl") if x["kind"] == "round"]
    assert "acc_otfusion" not in rounds[0]  # every_round=False: the last round only
    last = rounds[-1]
    for n in ("otfusion", "regmean", "fedlpa"):
        assert 0 <= last[f"acc_{n}"] <= 1 and last[f"{n}.seconds"] > 0
    assert last["fedlpa.upload_mb"] > last["regmean.upload_mb"] > 0  # FedLPA uploads G as well as A
    assert last["fedlpa.peak_mb"] > last["fedlpa.factors_mb"] > last["fedlpa.upload_mb"]  # 3 clients' factors held
    assert last["otfusion.peak_mb"] > 0
    assert last["fedlpa.residual"] < min(1e-4, last["fedlpa.residual_closed_form"])  # CG refined the closed form
    assert 0 <= last["otfusion.unmoved_share"] <= 1
    f = fuse(d, "--strategies", "otfusion,fedlpa")
    assert f.returncode == 0, f.stderr
    recs = {x["strategy"]: x for x in read_jsonl(d / "fuse.jsonl")}
    assert set(recs) == {"otfusion", "fedlpa"}
    for n, x in recs.items():  # the same saved states, the same seeded factors: the run's own numbers
        assert x["acc"] == last[f"acc_{n}"], (n, x, last)
    assert recs["fedlpa"]["fedlpa.upload_mb"] == last["fedlpa.upload_mb"]
    return last


@pytest.mark.long
def test_fafi_clients_through_flare_run_and_fuse(tiny_overrides, tmp_path):
    d = tmp_path / "fafi"
    r = flare("run", "--preset", "fafi", "--out", d, "--quiet", *tiny_overrides, *FAST, RULES)
    assert r.returncode == 0, r.stderr
    check_run_and_fuse(d)


def test_ce_clients_run_and_fuse(tiny_overrides, tmp_path, capsys):
    """The fedavg preset's plain classifiers (linear head), run and fused in this process (the FAFI test above runs
    both as processes)."""
    d = tmp_path / "fedavg"
    Run(load_config(None, "fedavg", tiny_overrides + FAST + [RULES]), d, quiet=True).execute()
    last = check_run_and_fuse(d, lambda *argv: flare_in_process(["fuse", *argv], capsys))
    assert last["primary"] == "fedavg"


def test_weight_fusion_refuses_clients_of_different_architectures():
    """The weight-fusing strategies take the uploads as they come: clients of two architectures are refused by the
    config, naming the key that chose the strategy (an upload of another architecture than its client's is turned
    away by the upload gate: tests/test_flower_mixed.py)."""
    mixed = ["model.clients=[cnn, wrn16_1]", "num_clients=2", "model.feature_dim=16"]
    for name in ("otfusion", "regmean", "fedlpa"):
        for key, choice in (("eval.rules", f"eval.rules=[{name}]"), ("server.primary", f"server.primary={name}")):
            with pytest.raises(FlareError, match=f"'{name}' cannot fuse clients of different architectures") as e:
                load_config(None, "fafi", [*mixed, choice])
            assert e.value.key == key


def test_otfusion_and_regmean_refuse_unsupported_layers():
    model = create_model("cnn", 3, 4, width=0.25)
    model.encoder.body[1] = torch.nn.GroupNorm(2, model.encoder.body[1].num_features)
    with pytest.raises(FlareError, match=r"'encoder.body.1' \(GroupNorm\)") as e:
        alignment_plan(model, "eval.rules")
    assert e.value.key == "eval.rules"
    with pytest.raises(FlareError, match=r"'encoder.body.1' \(GroupNorm\)"):
        factor_layers(model, "regmean", "eval.rules")


PLUGIN = '''
from torch import nn
from flare.models import register_model


@register_model("ln_mlp")
def ln_mlp(facts, options):
    """Pool, flatten, a Linear and a LayerNorm: a layer FedLPA does not merge."""
    enc = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(facts.in_channels * 16, 16), nn.LayerNorm(16),
                        nn.ReLU())
    enc.feature_dim = 16
    return enc
'''


def test_fedlpa_over_an_unsupported_layer_exits_2(tiny_overrides, tmp_path):
    (tmp_path / "ln_plugin.py").write_text(textwrap.dedent(PLUGIN))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = flare("run", "--preset", "fafi", "--out", tmp_path / "r", "--quiet", *tiny_overrides, "rounds=1",
              "plugins=[ln_plugin]", "model.name=ln_mlp", "eval.rules=[primary,fedlpa]", env=env)
    assert r.returncode == 2, r.stderr
    assert "eval.rules" in r.stderr and "'encoder.3' (LayerNorm)" in r.stderr and "fedlpa" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3, r.stderr


def test_without_pot_everything_but_otfusion_runs(monkeypatch):
    """POT is the optional `baselines` extra: a config loads (which imports every built-in part) in a process
    where `import ot` fails, and OTFusion's transport says what to install instead of a traceback."""
    code = textwrap.dedent("""
        import sys
        sys.modules["ot"] = None  # `import ot` raises ImportError from here on
        from flare.config import load_config
        cfg = load_config(None, "fafi", ["dataset.name=synthetic-cifar10"])
        print("loaded", cfg.preset)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "loaded fafi" in out.stdout, out.stderr
    from flare.baselines import otfusion
    monkeypatch.setitem(sys.modules, "ot", None)
    with pytest.raises(FlareError, match="needs POT") as e:
        otfusion._transport(torch.randn(4, 3), torch.randn(4, 3), "euclidean")
    assert "flare-ofl[baselines]" in e.value.fix
