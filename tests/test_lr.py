"""Learning-rate schedules for local training and the LR probe (docs/method.md#learning-rate-schedules)."""
import json
import math

import pytest
import torch

from flare.cli import main
from flare.config import build_config
from flare.data.datasets import ImageData
from flare.errors import FlareError
from flare.lrprobe import top_hessian_eigenvalue
from flare.schedules import LRSchedule




# ----------------------------------------------------------------------------------------------
# the schedules as functions


def test_constant_with_decay_per_round():
    s = LRSchedule("constant", 0.05, 50, decay_per_round=0.998)
    assert s(0.0, 0) == 0.05 and s(7.5, 7) == pytest.approx(0.05 * 0.998 ** 7)
    assert LRSchedule("constant", 0.05, 50)(33.0, 33) == 0.05


def test_cosine_over_the_whole_training():
    s = LRSchedule("cosine", 0.1, 40, min_lr=0.01)
    assert s(0, 0) == pytest.approx(0.1)
    assert s(20, 20) == pytest.approx(0.055)
    assert s(40, 39) == pytest.approx(0.01)
    assert s(10, 10) == pytest.approx(0.01 + 0.045 * (1 + math.cos(math.pi / 4)))


def _jumps(s: LRSchedule, upto: float, dt: float = 0.01) -> list[float]:
    ts = [i * dt for i in range(int(upto / dt) + 1)]
    lrs = [s(t, 0) for t in ts]
    return [round(ts[i + 1], 6) for i in range(len(ts) - 1) if lrs[i + 1] > lrs[i] + 1e-12]


@pytest.mark.parametrize("t0,t_mult,expect", [(2.0, 2.0, [2.0, 6.0, 14.0, 30.0]), (3.0, 1.0, [3.0, 6.0, 9.0, 12.0]),
                                              (1.0, 3.0, [1.0, 4.0, 13.0])])
def test_sgdr_restarts_fall_at_t0_t0_1_plus_tmult(t0, t_mult, expect):
    upto = expect[-1] + 0.5
    s = LRSchedule("sgdr", 0.1, 100, t0=t0, t_mult=t_mult)
    assert _jumps(s, upto) == pytest.approx(expect)  # the lr jumps back up exactly there
    for r in expect:
        assert s(r, 0) == pytest.approx(0.1) and s(r - 1e-6, 0) < 1e-6  # restart to the peak from ~η_min


def test_sgdr_cycle_decay_lowers_each_peak():
    s = LRSchedule("sgdr", 0.1, 100, t0=2, t_mult=2, cycle_decay=0.5, min_lr=0.001)
    assert [s(t, 0) for t in (0, 2, 6, 14)] == pytest.approx([0.1, 0.05, 0.025, 0.0125])
    assert s(1.0, 0) == pytest.approx(0.001 + 0.5 * (0.1 - 0.001))  # half way through the first cycle


def test_t0_must_be_positive():
    """The config refuses what LRSchedule cannot run, naming the key and its bound."""
    for t0 in (0, -1):
        with pytest.raises(FlareError) as e:
            build_config({"lr_schedule": {"kind": "sgdr", "t0": t0}})
        assert e.value.key == "lr_schedule.t0" and "greater than 0" in str(e.value)
    with pytest.raises(FlareError) as e:
        build_config({"lr_schedule": {"kind": "step"}})
    assert e.value.key == "lr_schedule.kind"


# ----------------------------------------------------------------------------------------------
# the schedules inside the training loop


def _client(overrides):
    from test_alignment import tiny_client

    return tiny_client(overrides)


def test_trainer_sets_the_scheduled_lr_every_step(monkeypatch):
    client, ctx = _client({"lr": 0.1, "lr_schedule": {"kind": "cosine"}})
    seen, orig = [], client._step

    def step(ctx_, idx, p):
        seen.append(client.optimizer.param_groups[0]["lr"])
        return orig(ctx_, idx, p)

    monkeypatch.setattr(client, "_step", step)
    for r in range(3):
        client.train_round(ctx, r)
    steps, T = 3, 6  # 48 samples / 16 per batch; R·E = 3·2 epochs
    expect = [0.5 * 0.1 * (1 + math.cos(math.pi * (e + b / steps) / T)) for e in range(T) for b in range(steps)]
    assert seen == pytest.approx(expect)


@pytest.mark.parametrize("reset", [True, False])
def test_sgdr_momentum_reset_at_each_restart(reset, monkeypatch):
    client, ctx = _client({"optim": {"reset_each_round": False},
                           "lr_schedule": {"kind": "sgdr", "t0": 1, "t_mult": 1, "reset_momentum": reset}})
    has_buffer, orig = [], client._step

    def step(ctx_, idx, p):
        st = client.optimizer.state
        has_buffer.append(any("momentum_buffer" in s for s in st.values()))
        return orig(ctx_, idx, p)

    monkeypatch.setattr(client, "_step", step)
    for r in range(2):
        client.train_round(ctx, r)
    # 4 epochs × 3 steps; a restart at the start of every epoch (T_0 = 1, T_mult = 1)
    firsts = [has_buffer[e * 3] for e in range(4)]
    assert firsts[0] is False                       # a fresh optimizer before the very first step
    if reset:
        assert firsts[1:] == [False, False, False]  # cleared at each restart
    else:
        assert firsts[1:] == [True, True, True]     # momentum carried over the restarts
    assert all(has_buffer[e * 3 + 1] for e in range(4))


# ----------------------------------------------------------------------------------------------
# LR probe


def test_probe_recovers_the_top_eigenvalue_of_a_quadratic():
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(30, 30, generator=g, dtype=torch.double))
    eigs = torch.linspace(0.1, 4.0, 30, dtype=torch.double)
    eigs[-1] = 7.3
    H = Q @ torch.diag(eigs) @ Q.T
    x = torch.nn.Parameter(torch.randn(30, generator=g, dtype=torch.double))
    est = top_hessian_eigenvalue([lambda: 0.5 * x @ H @ x], [x], iters=20)
    assert est.value == pytest.approx(7.3, rel=0.05)


def test_probe_tolerance_stops_early_at_the_same_answer():
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(30, 30, generator=g, dtype=torch.double))
    eigs = torch.linspace(0.1, 2.0, 30, dtype=torch.double)
    eigs[-1] = 7.3
    x = torch.nn.Parameter(torch.randn(30, generator=g, dtype=torch.double))
    H = Q @ torch.diag(eigs) @ Q.T
    full = top_hessian_eigenvalue([lambda: 0.5 * x @ H @ x], [x], iters=60)
    early = top_hessian_eigenvalue([lambda: 0.5 * x @ H @ x], [x], iters=60, tol=1e-4)
    assert len(full.history) == 60
    assert 3 <= len(early.history) < 60
    assert early.rel_change < 1e-4
    assert early.value == pytest.approx(7.3, rel=1e-3)


def test_probe_finds_the_largest_not_the_most_negative_eigenvalue():
    H = torch.diag(torch.tensor([-20.0, 5.0, 1.0, 0.5]))
    x = torch.nn.Parameter(torch.ones(4))
    est = top_hessian_eigenvalue([lambda: 0.5 * x @ H @ x], [x], iters=40)
    assert est.value == pytest.approx(5.0, rel=0.05)


def test_probe_on_a_linear_regression_model_averages_its_batches():
    """MSE of a linear model is quadratic in the weights: H = 2 XᵀX / N (mean over batches)."""
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(8, 1, bias=False)
    X = [torch.randn(64, 8, generator=g) * torch.linspace(0.2, 2.0, 8) for _ in range(3)]
    Y = [torch.randn(64, 1, generator=g) for _ in range(3)]
    fns = [lambda x=x, y=y: torch.nn.functional.mse_loss(lin(x), y) for x, y in zip(X, Y)]
    H = sum(2 * x.T @ x / len(x) for x in X) / 3
    truth = float(torch.linalg.eigvalsh(H.double()).max())
    est = top_hessian_eigenvalue(fns, list(lin.parameters()), iters=20)
    assert est.value == pytest.approx(truth, rel=0.05)
    # only one batch gives a different answer: the batches really are averaged
    one = float(torch.linalg.eigvalsh((2 * X[0].T @ X[0] / 64).double()).max())
    assert abs(one - truth) / truth > 0.02


def test_probe_matches_the_full_hessian_of_a_small_network():
    g = torch.Generator().manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x, y = torch.randn(32, 4, generator=g), torch.arange(32) % 3
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def f(flat):
        ps, i = {}, 0
        for n, s in zip(names, shapes):
            ps[n] = flat[i:i + s.numel()].reshape(s)
            i += s.numel()
        return torch.nn.functional.cross_entropy(torch.func.functional_call(net, ps, (x,)), y)

    Hf = torch.autograd.functional.hessian(f, flat0)
    truth = float(torch.linalg.eigvalsh(Hf.double()).max())
    est = top_hessian_eigenvalue([lambda: torch.nn.functional.cross_entropy(net(x), y)], list(net.parameters()),
                                 iters=60)
    assert est.value == pytest.approx(truth, rel=0.05)


# ----------------------------------------------------------------------------------------------
# the command, and the linear-scaling rule through the runner, on a fake dataset


def _fake_data():
    g = torch.Generator().manual_seed(0)
    return ImageData("fake", torch.randint(0, 256, (120, 3, 8, 8), generator=g, dtype=torch.uint8),
                     torch.arange(120) % 10, torch.randint(0, 256, (40, 3, 8, 8), generator=g, dtype=torch.uint8),
                     torch.arange(40) % 10, [str(c) for c in range(10)], (0.5,) * 3, (0.25,) * 3)


TINY = ["model.name=cnn", "model.width=0.125", "batch_size=32", "device=cpu", "num_clients=2"]


@pytest.mark.parametrize("lr,warn,where", [(1000.0, True, []), (1e-6, False, ["--all-data"])])
def test_lr_probe_command(lr, warn, where, monkeypatch, capsys):
    monkeypatch.setattr("flare.data.prepare.load_dataset", lambda *a, **k: _fake_data())
    rc = main(["lr-probe", "--preset", "entropy-lambda", "--batches", "2", "--iters", "8", *where, *TINY, f"lr={lr}"])
    out = capsys.readouterr().out
    assert rc == 0
    assert ("the whole training set (120 samples)" in out) == bool(where)
    if where:  # balanced fake labels: normalised entropy 1 → λ0 = λ_max = 10 in the probed loss
        assert "+ 10·L_align" in out
    L = float(out.split("L = ")[1].split()[0])
    eta = float(out.split("eta_crit = 2/L = ")[1].split()[0])
    assert L > 0 and eta == pytest.approx(2 / L, rel=1e-4)
    assert f"lr = {lr:.6g}" in out
    assert ("WARNING" in out) == warn


def test_lr_probe_caps_the_probe_batch_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr("flare.data.prepare.load_dataset", lambda *a, **k: _fake_data())
    assert main(["lr-probe", "--all-data", "--iters", "3", *TINY, "batch_size=100"]) == 0
    out = capsys.readouterr().out
    assert "2 fixed batch(es) of 64 (120 images) (config batch_size 100; --batch-size to change)" in out
    assert main(["lr-probe", "--all-data", "--iters", "3", "--batch-size", "100", "--batches", "1", *TINY,
                 "batch_size=100"]) == 0
    out = capsys.readouterr().out
    assert "1 fixed batch(es) of 100 (100 images), 3 power iterations" in out


@pytest.mark.parametrize("flag,value", [("--batch-size", "0"), ("--tol", "1.5")])
def test_lr_probe_bad_probe_settings_exit_2(flag, value, monkeypatch, capsys):
    monkeypatch.setattr("flare.data.prepare.load_dataset", lambda *a, **k: _fake_data())
    assert main(["lr-probe", flag, value, *TINY]) == 2
    assert flag in capsys.readouterr().err


def test_lr_probe_bad_client_exits_2(monkeypatch, capsys):
    monkeypatch.setattr("flare.data.prepare.load_dataset", lambda *a, **k: _fake_data())
    assert main(["lr-probe", "--client", "5", *TINY]) == 2
    assert "--client" in capsys.readouterr().err


def test_linear_scaling_through_the_runner(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("flare.data.prepare.load_dataset", lambda *a, **k: _fake_data())
    out = tmp_path / "r"
    rc = main(["run", "--quiet", "--preset", "fafi", "--out", str(out), *TINY, "rounds=1", "optim.linear_scaling=true"])
    assert rc == 0, capsys.readouterr().err
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in recs if r["kind"] == "client"]
    assert len(lrs) == 2 and lrs == pytest.approx([0.05 * 32 / 512] * 2)
