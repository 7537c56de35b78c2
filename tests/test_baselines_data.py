"""The distilling, data-free and recalibrating baselines (flare/baselines/distill.py, datafree.py, bnrecal.py):
FedDF moves its student towards the ensemble, DENSE's and Co-Boosting's generators lower their loss, BatchNorm
recalibration sets the statistics of the public slice and leaves the clients alone, each strategy is a function of
the seed, and all of them run through `flare run` and `flare fuse` (and refuse a run without public data)."""
import copy
import functools
import re
import subprocess
import sys

import pytest
import torch

from conftest import finished_fedavg_run, flare_in_process
from flare.baselines.bnrecal import recalibrate
from flare.baselines.kd import kd_loss
from flare.config import load_config
from flare.data.augment import normalize
from flare.errors import FlareError
from flare.models import create_model
from flare.rundir import read_jsonl
from flare.runner import Run
from flare.server.rules import fedavg_model
from flare.server.rounds import rules_for
from flare.server.strategy import ServerContext, make_strategy

# the patterns' class is a stripe's column, which a 4-pixel crop shift would move: FedDF's test runs without it
TINY = {"feddf": {"steps": 40, "batch_size": 16, "augment": "false"},
        "dense": {"epochs": 3, "g_steps": 6, "synthesis_batch": 16, "batch_size": 16},
        "coboosting": {"epochs": 3, "g_steps": 6, "synthesis_batch": 16, "batch_size": 16},
        "bnrecal": {"batch_size": 10}}


def tiny_options(names=TINY) -> list[str]:
    return [f"server.strategies.{n}.{k}={v}" for n in names for k, v in TINY[n].items()]


def patterns(n: int, seed: int) -> torch.Tensor:
    """n uint8 3×12×12 images of 4 colour/stripe patterns with noise (the tiny image folder's kind)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (4, 3, 1, 1), generator=torch.Generator().manual_seed(0))
    y = torch.arange(n) % 4
    x = base[y].expand(n, 3, 12, 12).clone()
    for i in range(n):
        x[i, :, :, int(y[i])] = 255 - base[y[i], :, 0, 0, None]
    return (x + torch.randint(-40, 40, x.shape, generator=g)).clamp(0, 255).to(torch.uint8)


def norm(x):
    return normalize(x, [0.5, 0.5, 0.5], [0.25, 0.25, 0.25])


@functools.lru_cache
def _trained(seed: int, head: str, classes: tuple[int, ...]) -> dict:
    torch.manual_seed(seed)
    m = create_model("cnn", 3, 4, 0.25, head=head)
    x = patterns(64, seed)
    y = torch.arange(64) % 4
    keep = torch.isin(y, torch.tensor(classes))
    opt = torch.optim.Adam(m.parameters(), lr=0.02)
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(m(norm(x[keep]))[1], y[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def client(seed: int, head: str, classes: tuple[int, ...]) -> torch.nn.Module:
    """A tiny client trained briefly on its own classes of the patterns (a skewed, one-shot client)."""
    m = create_model("cnn", 3, 4, 0.25, head=head)
    m.load_state_dict(_trained(seed, head, classes))
    return m.eval()


def context(preset="fafi", head="prototype", public=48, extra=(), seed=0):
    cfg = load_config(None, preset, ["model.name=cnn", "model.width=0.25", "device=cpu", f"seed={seed}",
                                     f"dataset.public_size={public}", *tiny_options(), *extra])
    models = [client(11, head, (0, 1, 2)), client(12, head, (1, 2, 3))]
    G = torch.randn(4, models[0].feature_dim, generator=torch.Generator().manual_seed(3))
    pub = patterns(public, 1) if public else None
    return cfg, ServerContext(0, [], models, torch.tensor([0.6, 0.4]), G if head == "prototype" else None,
                              None, {}, [], pub, norm, (3, 12, 12))


def ensemble_argmax(models, w, x):
    with torch.no_grad():
        return sum(wk * m(x)[1] for wk, m in zip(w, models)).argmax(1)


def test_feddf_reports_its_steps_as_it_goes(capsys, monkeypatch):
    """FedDF's 10,000 published steps take minutes on a CPU: off a terminal the build prints its progress lines."""
    cfg, ctx = context()
    monkeypatch.setenv("FLARE_QUIET", "0")
    make_strategy(cfg, "feddf").predictor(ctx)
    assert re.search(r"^feddf: 40/40 steps, \d+ s$", capsys.readouterr().err, re.M)


def test_feddf_student_agrees_more_with_the_ensemble_on_held_out_inputs():
    cfg, ctx = context()
    held = norm(patterns(64, 2))  # never seen by the distillation
    want = ensemble_argmax(ctx.models, ctx.weights, held)
    pred = make_strategy(cfg, "feddf").predictor(ctx)
    with torch.no_grad():
        teacher = sum(w * m(held)[1] for w, m in zip(ctx.weights, ctx.models))
        start = fedavg_model(ctx.models, ctx.weights)(held)[1]  # where FedDF starts from
        before = (start.argmax(1) == want).float().mean().item()
        after = (pred.scores(held).argmax(1) == want).float().mean().item()
        kl_before, kl_after = kd_loss(start, teacher, 1.0).item(), kd_loss(pred.scores(held), teacher, 1.0).item()
    assert after >= before + 0.25 and after >= 0.75, (before, after)
    assert kl_after < kl_before / 2, (kl_before, kl_after)
    assert pred.logs["loss_last"] < pred.logs["loss_first"] and pred.logs["steps"] == 40
    assert pred.logs["agree_public_after"] > pred.logs["agree_public_before"]


@pytest.mark.parametrize("name", ["dense", "coboosting"])
def test_the_generator_loss_falls(name):
    """g_loss_first/last: the loss at the first and the last generator step, averaged over the epochs (the generator
    restarts every epoch). Without augmentation nothing but the generator moves within an epoch, so a generator
    that cannot learn (lr_g ≈ 0) keeps its loss: the assertion can fail."""
    logs = {}
    for lr in ("1e-3", "1e-12"):  # the published lr_g, and one that cannot move the generator
        cfg, ctx = context(public=0, extra=[f"server.strategies.{name}.lr_g={lr}",
                                            f"server.strategies.{name}.augment=false"])
        pred = make_strategy(cfg, name).predictor(ctx)  # no public slice: the shape is ctx.input_shape
        assert pred.scores(norm(patterns(8, 2))).shape == (8, 4)
        logs[lr] = pred.logs
    first, last = logs["1e-3"]["g_loss_first"], logs["1e-3"]["g_loss_last"]
    assert last < first - 0.1 * abs(first), (first, last)
    assert abs(logs["1e-12"]["g_loss_first"] - logs["1e-12"]["g_loss_last"]) < 0.05 * (first - last), logs
    assert logs["1e-3"]["pool"] == 3 * 16 and logs["1e-3"]["epochs"] == 3


def test_bn_recalibration_sets_the_public_statistics_and_leaves_the_clients_alone():
    cfg, ctx = context()
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in ctx.models]
    pred = make_strategy(cfg, "bnrecal").predictor(ctx)  # batches of 10 over 48 images: the merge is exercised
    for m, st in zip(ctx.models, saved):
        assert not m.training and all(torch.equal(v, st[k]) for k, v in m.state_dict().items())
    conv, bn = ctx.models[0].encoder.body[0], ctx.models[0].encoder.body[1]
    with torch.no_grad():
        h = conv(norm(ctx.public_x)).double()  # the first BatchNorm's inputs over the whole slice
    rec_bn = pred.models[0].encoder.body[1]
    assert torch.allclose(rec_bn.running_mean.double(), h.mean((0, 2, 3)), rtol=1e-6, atol=1e-7)
    assert torch.allclose(rec_bn.running_var.double(), h.var((0, 2, 3), unbiased=True), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(rec_bn.running_var, bn.running_var)
    # a single pass of torch's own cumulative average (momentum=None) agrees when one batch holds the slice
    ref = recalibrate(ctx.models[1], ctx.public_x, norm, batch_size=64)
    m = copy.deepcopy(ctx.models[1])
    for b in m.modules():
        if isinstance(b, torch.nn.BatchNorm2d):
            b.reset_running_stats()
            b.momentum = None
    with torch.no_grad():
        m.train()(norm(ctx.public_x))
    for a, b in zip(ref.modules(), m.modules()):
        if isinstance(a, torch.nn.BatchNorm2d):
            assert torch.allclose(a.running_mean, b.running_mean, atol=1e-6)
            assert torch.allclose(a.running_var, b.running_var, rtol=1e-5, atol=1e-6)


def test_bnrecal_rules_and_heads():
    cfg, ctx = context(preset="fedavg", head="linear")
    assert make_strategy(cfg, "bnrecal").rule == "output"
    assert make_strategy(cfg, "bnrecal").predictor(ctx).scores(norm(patterns(4, 2))).shape == (4, 4)
    with pytest.raises(FlareError, match="server.strategies.bnrecal.rule"):
        make_strategy(load_config(None, "fedavg", ["dataset.public_size=8", "server.strategies.bnrecal.rule=feature"]),
                      "bnrecal")
    cfg, _ = context()
    assert make_strategy(cfg, "bnrecal").rule == "feature"


@pytest.mark.parametrize("name", ["feddf", "dense", "coboosting", "bnrecal"])
def test_each_strategy_is_a_function_of_the_seed(name):
    x = norm(patterns(16, 5))
    runs = [context(seed=seed) for seed in (0, 0, 1)]  # (building the test's clients draws from torch's RNG)
    rng = torch.get_rng_state()
    outs = []
    for cfg, ctx in runs:
        for m in ctx.models:
            m.train()  # as the in-process runner hands the live client models over
        saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in ctx.models]
        with torch.no_grad():
            outs.append(make_strategy(cfg, name).predictor(ctx).scores(x))
        for m, st in zip(ctx.models, saved):  # the clients are never trained, nor their BN statistics moved
            assert m.training and all(torch.equal(v, st[k]) for k, v in m.state_dict().items())
    assert torch.equal(outs[0], outs[1])
    if name != "bnrecal":  # recalibration draws nothing
        assert not torch.equal(outs[0], outs[2])
    assert torch.equal(torch.get_rng_state(), rng)  # the global generator is never drawn from


def rounds_of(d):
    return [r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "round"]


@pytest.mark.long
def test_end_to_end_through_flare_run_and_flare_fuse(tiny_overrides, tmp_path, default_torch_threads):
    names = ["feddf", "dense", "coboosting", "bnrecal"]
    cfg = load_config(None, "fafi", tiny_overrides + ["rounds=1", "dataset.public_size=16",
                                                      "eval.rules=[primary,feddf,dense,coboosting,bnrecal]",
                                                      *tiny_options()])
    d = tmp_path / "fafi"
    Run(cfg, d, quiet=True).execute()
    (last,) = rounds_of(d)
    for n in names:
        assert 0 <= last[f"acc_{n}"] <= 1 and last[f"{n}.seconds"] > 0, n
    assert last["dense.g_loss_last"] < last["dense.g_loss_first"]
    assert last["bnrecal.public"] == 16 and last["feddf.steps"] == 40
    r = subprocess.run([sys.executable, "-m", "flare.cli", "fuse", str(d), "--strategies", "feddf,bnrecal"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    fused = {f["strategy"]: f for f in read_jsonl(d / "fuse.jsonl")}
    for n in ("feddf", "bnrecal"):  # the same saved states, seed and public slice: the run's own numbers
        assert fused[n]["acc"] == last[f"acc_{n}"] and f"{n}.seconds" in fused[n]
    assert fused["feddf"]["feddf.loss_last"] == last["feddf.loss_last"]


def test_data_free_servers_with_plain_classifiers_and_no_public_data(tiny_overrides, tmp_path):
    cfg = load_config(None, "fedavg", tiny_overrides + ["rounds=1", "eval.rules=[primary,dense,coboosting]",
                                                        *tiny_options(["dense", "coboosting"])])
    d = tmp_path / "ce"
    Run(cfg, d, quiet=True).execute()
    (last,) = rounds_of(d)
    for n in ("dense", "coboosting"):
        assert 0 <= last[f"acc_{n}"] <= 1 and last[f"{n}.pool"] == 48, n
    assert 0 <= last["coboosting.w_min"] <= last["coboosting.w_max"] <= 1


@pytest.mark.parametrize("name", ["feddf", "bnrecal"])
def test_without_public_data_the_run_exits_2_naming_the_key(name, tiny_overrides, tmp_path, capsys):
    r = flare_in_process(["run", "--preset", "fafi", "--out", tmp_path / "r", "--quiet", *tiny_overrides, "rounds=1",
                          f"eval.rules=[primary,{name}]"], capsys)
    assert r.returncode == 2, r.stderr
    assert "dataset.public_size" in r.stderr and name in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("preset,rule", [("fafi", "feature"), ("etf-anneal", "feature"), ("flare", "feature"),
                                         ("fedavg", "output")])
def test_the_strategies_compose_with_every_client_kind(preset, rule):
    cfg = load_config(None, preset, ["dataset.public_size=8", "eval.rules=[primary,feddf,dense,coboosting,bnrecal]"])
    assert {"feddf", "dense", "coboosting", "bnrecal"} <= set(rules_for(cfg, cfg.rounds - 1))
    assert make_strategy(cfg, "bnrecal").rule == rule


def dies_in_epoch_two(calls: list):
    """`Synthesis.distil` as a kill in the build's second epoch sees it: KeyboardInterrupt there, the real epoch
    before (each call appends to `calls`)."""
    from flare.baselines.datafree import Synthesis

    distil = Synthesis.distil

    def distil_or_die(self):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        distil(self)
    return distil_or_die


@pytest.mark.parametrize("name", ["dense", "coboosting", "intactofl"])
def test_an_interrupted_build_resumes_from_its_last_epoch_bit_for_bit(name, tmp_path, monkeypatch):
    """With a scratch folder the build saves its progress after every epoch; killed in its second epoch and run
    again, it starts at the second epoch and ends where an uninterrupted build without a folder ends."""
    from flare.baselines.datafree import Synthesis

    extra = [f"server.strategies.intactofl.{k}={v}" for k, v in TINY["dense"].items()]
    x = norm(patterns(16, 5))
    cfg, ctx = context(extra=extra)
    whole = make_strategy(cfg, name).predictor(ctx)
    distil, calls = Synthesis.distil, []

    cfg, ctx = context(extra=extra)
    ctx.scratch = tmp_path / name
    monkeypatch.setattr(Synthesis, "distil", dies_in_epoch_two(calls))
    with pytest.raises(KeyboardInterrupt):
        make_strategy(cfg, name).predictor(ctx)
    assert len(list(ctx.scratch.glob("*.pt"))) == 1
    calls.clear()
    monkeypatch.setattr(Synthesis, "distil", lambda self: (calls.append(1), distil(self)))
    resumed = make_strategy(cfg, name).predictor(ctx)
    assert len(calls) == 2  # epochs 2 and 3 only
    with torch.no_grad():
        assert torch.equal(resumed.scores(x), whole.scores(x))
    assert {k: v for k, v in resumed.logs.items() if k != "seconds"} == \
        {k: v for k, v in whole.logs.items() if k != "seconds"}
    cfg, ctx = context(extra=extra + [f"server.strategies.{name}.epochs=4"])  # other options: another file
    ctx.scratch = tmp_path / name
    calls.clear()
    make_strategy(cfg, name).predictor(ctx)
    assert len(calls) == 4 and len(list(ctx.scratch.glob("*.pt"))) == 2


def test_fuse_gives_a_data_free_server_another_budget_and_its_curve(tiny_overrides, tmp_path, capsys, monkeypatch):
    """`flare fuse` takes server-strategy options anew (the clients are the checkpoint's): the record names them,
    the same options count as fused, others fuse again; the budget curve scores the student on the way without
    changing it (its last point is the fused accuracy, and the accuracy is that of a fuse without a curve). The
    build reports its epochs as it goes (hours at the published budget), with the curve's last point."""
    from flare.cli import main

    cfg = load_config(None, "fedavg", tiny_overrides + ["rounds=1"])
    d = tmp_path / "ce"
    Run(cfg, d, quiet=True).execute()
    opts = [f"server.strategies.dense.{k}={v}" for k, v in TINY["dense"].items()]
    monkeypatch.setenv("FLARE_QUIET", "0")
    assert main(["fuse", str(d), "--strategies", "dense", *opts, "server.strategies.dense.curve_every=1"]) == 0
    monkeypatch.setenv("FLARE_QUIET", "1")
    printed = capsys.readouterr()
    assert "[epochs=3 g_steps=6" in printed.out
    assert re.search(r"^dense: 3/3 epochs \(student \d+\.\d\d% after epoch 3\), \d+ s$", printed.err, re.M)
    assert not (d / "fuse-scratch").exists()  # the build's progress, kept while it runs, is gone with its record
    assert main(["fuse", str(d), "--strategies", "dense", *opts, "server.strategies.dense.curve_every=1"]) == 0
    (rec,) = [f for f in read_jsonl(d / "fuse.jsonl") if f["kind"] == "fuse"]  # the same options: not again
    assert rec["options"]["curve_every"] == 1 and rec["options"]["epochs"] == 3
    curve = rec["dense.curve"]
    assert [c[:2] for c in curve] == [[1, 6], [2, 12], [3, 18]]
    assert curve[-1][2] == rec["acc"]
    assert rec["dense.best_epoch_acc"] == max(c[2] for c in curve)
    assert main(["fuse", str(d), "--strategies", "dense", *opts]) == 0
    plain = [f for f in read_jsonl(d / "fuse.jsonl") if f["kind"] == "fuse"][-1]
    assert "dense.curve" not in plain and plain["acc"] == rec["acc"] and plain["options"] != rec["options"]


@pytest.mark.parametrize("override,message", [
    ("lr=0.1", "takes only server-strategy options"),
    ("server.weights=uniform", "takes only server-strategy options"),
    ("server.strategies.coboosting.epochs=2", "'coboosting' is not among --strategies"),
    ("server.strategies.dense.epochs=0", "server.strategies.dense.epochs")])
def test_fuse_refuses_an_override_that_is_not_an_option_of_a_fused_strategy(override, message, tiny_overrides,
                                                                              tmp_path, capsys):
    d = finished_fedavg_run(tiny_overrides, tmp_path / "ce")
    r = flare_in_process(["fuse", d, "--strategies", "dense", override], capsys)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (d / "fuse.jsonl").exists()


def test_fuse_refuses_a_torn_progress_file_and_names_it(tiny_overrides, tmp_path, monkeypatch, capsys):
    """A data-free build's saved progress that cannot be read (a copy cut short) stops `flare fuse` with exit 2 and
    the file's name, no traceback, the file left as it was: never hours of build restarted without a word."""
    from flare.baselines.datafree import Synthesis
    from flare.cli import main

    d = finished_fedavg_run(tiny_overrides, tmp_path / "ce")
    opts = [f"server.strategies.dense.{k}={v}" for k, v in TINY["dense"].items()]
    monkeypatch.setattr(Synthesis, "distil", dies_in_epoch_two([]))
    assert main(["fuse", str(d), "--strategies", "dense", *opts]) != 0  # interrupted in its second epoch
    monkeypatch.undo()  # the fuse below is the real one
    (saved,) = (d / "fuse-scratch" / "dense").glob("*.pt")
    torn = saved.read_bytes()[:1000]
    saved.write_bytes(torn)
    r = flare_in_process(["fuse", d, "--strategies", "dense", *opts], capsys)
    assert r.returncode == 2 and saved.name in r.stderr and "delete it" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and saved.read_bytes() == torn and not (d / "fuse.jsonl").exists()
