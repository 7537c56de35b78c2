import json
import math
import os
import subprocess
import sys

import pytest
import torch

from flare.config import load_config
from flare.errors import FlareError, TrainingDiverged
from flare.rundir import read_jsonl
from flare.runner import Run


def metrics(d):
    return read_jsonl(d / "metrics.jsonl")


@pytest.mark.plots
def test_run_writes_the_run_directory(tiny_overrides, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(None, "fafi", tiny_overrides)
    s = Run(cfg, out, quiet=True).execute()
    for f in ("config.yaml", "partition.json", "metrics.jsonl", "summary.md", "plots/accuracy.png",
              "plots/label_distribution.png", "plots/diagnostics.png"):
        assert (out / f).exists(), f
    recs = metrics(out)
    rounds = [r for r in recs if r["kind"] == "round"]
    clients = [r for r in recs if r["kind"] == "client"]
    assert [r["round"] for r in rounds] == [0, 1]
    assert len(clients) == 2 * 3
    for k in ("acc_feature", "acc_iffi", "acc_iffi_reference", "acc_output", "acc_fedavg", "model_variance_mean",
              "g_protos_std", "inter_client_proto_std", "seconds", "method"):
        assert k in rounds[-1], k
    for k in ("loss_cls", "loss_con", "loss_pf", "loss_pp", "base_loss", "round", "client"):
        assert k in clients[0], k
    assert 0.0 <= s["acc"] <= 1.0
    part = json.loads((out / "partition.json").read_text())
    assert sum(c["num_samples"] for c in part["clients"]) == 4 * 24


def test_flare_plots_0_draws_no_figure_links_none_and_leaves_none_behind(tiny_overrides, tmp_path, monkeypatch):
    """FLARE_PLOTS=0 (the suite's default, tests/conftest.py): the same records, no plots/*.png, summary.md without
    a Plots section; figures an earlier report drew are removed, and with the switch on they are drawn and linked."""
    from flare.report.run_report import PLOTS, write_run_report

    out = tmp_path / "run"
    Run(load_config(None, "flare", tiny_overrides), out, quiet=True).execute()
    assert os.environ["FLARE_PLOTS"] == "0" and not list((out / "plots").glob("*.png"))
    assert "## Plots" not in (out / "summary.md").read_text()
    monkeypatch.setenv("FLARE_PLOTS", "1")
    write_run_report(out)
    summary = (out / "summary.md").read_text()
    assert sorted(p.stem for p in (out / "plots").glob("*.png")) == sorted(PLOTS.values())  # flare learns λ: four
    assert all(f"![{alt}](plots/{name}.png)" in summary for alt, name in PLOTS.items())
    monkeypatch.setenv("FLARE_PLOTS", "0")
    write_run_report(out)
    assert not list((out / "plots").glob("*.png")) and "## Plots" not in (out / "summary.md").read_text()


def test_linear_baseline_has_only_its_rules(tiny_overrides, tmp_path):
    out = tmp_path / "ens"
    Run(load_config(None, "ensemble", tiny_overrides), out, quiet=True).execute()
    last = [r for r in metrics(out) if r["kind"] == "round"][-1]
    assert "acc_output" in last and "acc_fedavg" in last
    assert "acc_feature" not in last and "g_protos_std" not in last


def test_same_config_and_seed_give_identical_metrics(tiny_overrides, tmp_path):
    vals = []
    for name in ("a", "b"):
        Run(load_config(None, "fafi", tiny_overrides), tmp_path / name, quiet=True).execute()
        recs = metrics(tmp_path / name)
        vals.append([{k: v for k, v in r.items() if not k.startswith("seconds")} for r in recs])
    assert vals[0] == vals[1]


def test_a_different_seed_changes_the_numbers(tiny_overrides, tmp_path):
    a = Run(load_config(None, "fafi", tiny_overrides), tmp_path / "a", quiet=True).execute()
    b = Run(load_config(None, "fafi", tiny_overrides + ["seed=2"]), tmp_path / "b", quiet=True).execute()
    assert a["model_variance_mean"] != b["model_variance_mean"]


def test_empty_client_is_skipped_with_a_warning(tiny_overrides, tmp_path):
    ov = [o for o in tiny_overrides if not o.startswith(("num_clients", "partition.alpha"))]
    ov += ["num_clients=12", "partition.alpha=0.01", "rounds=1"]
    run = Run(load_config(None, "fafi", ov), tmp_path / "e", quiet=True)
    with pytest.warns(UserWarning, match="no samples"):
        run.execute()
    part = json.loads((tmp_path / "e" / "partition.json").read_text())
    empty = [c["client"] for c in part["clients"] if c["num_samples"] == 0]
    assert empty
    trained = {r["client"] for r in metrics(tmp_path / "e") if r["kind"] == "client"}
    assert not (trained & set(empty))
    assert "no samples" in (tmp_path / "e" / "summary.md").read_text()


def test_nan_loss_stops_with_client_round_and_term_and_keeps_metrics(tiny_overrides, tmp_path, monkeypatch):
    import flare.client.step as step  # every engine builds its loss there (local_loss)
    import flare.client.trainer as trainer

    real = step.base_terms

    def poisoned(*a, **k):
        t = real(*a, **k)
        if calls["round"] == 1:
            t["loss_con"] = t["loss_con"] * float("nan")
        return t

    calls = {"round": 0}
    real_train = trainer.Client.train_round

    def train_round(self, ctx, round_idx, on_step=None):
        calls["round"] = round_idx
        return real_train(self, ctx, round_idx, on_step)

    monkeypatch.setattr(step, "base_terms", poisoned)
    monkeypatch.setattr(trainer.Client, "train_round", train_round)
    out = tmp_path / "nan"
    with pytest.raises(TrainingDiverged) as e:
        Run(load_config(None, "fafi", tiny_overrides), out, quiet=True).execute()
    msg = e.value.render()
    assert "loss_con" in msg and "round 2" in msg and "client 0" in msg  # index 1 = the second round
    recs = metrics(out)
    assert recs and all(r["round"] == 0 for r in recs)
    assert all(math.isfinite(r["acc_feature"]) for r in recs if r["kind"] == "round")


def test_finished_run_is_not_recomputed_and_other_config_is_refused(tiny_overrides, tmp_path):
    out = tmp_path / "done"
    cfg = load_config(None, "fafi", tiny_overrides)
    Run(cfg, out, quiet=True).execute()
    before = (out / "metrics.jsonl").read_text()
    Run(cfg, out, quiet=True).execute()
    assert (out / "metrics.jsonl").read_text() == before
    with pytest.raises(FlareError) as e:
        Run(load_config(None, "fafi", tiny_overrides + ["lr=0.01"]), out, quiet=True).execute()
    assert "lr" in e.value.render()


@pytest.mark.parametrize("preset", ["fafi", "flare"])
def test_concurrent_clients_give_the_sequential_numbers(preset, tiny_overrides, tmp_path, monkeypatch):
    """Each client augments from its own stream, so threads change the schedule of the work, not its values."""
    import threading

    import flare.client.trainer as trainer

    real = trainer.Client.train_round
    threads: dict[str, set] = {"false": set(), "true": set()}
    mode_now = {}

    def spy(self, ctx, round_idx, on_step=None):
        threads[mode_now["m"]].add(threading.current_thread().name)
        return real(self, ctx, round_idx, on_step)

    monkeypatch.setattr(trainer.Client, "train_round", spy)
    runs = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        mode_now["m"] = mode
        engine = "threads" if mode == "true" else "sequential"
        run = Run(load_config(None, preset, tiny_overrides + [f"client_engine={engine}"]), out, quiet=True)
        run.execute()
        recs = [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in metrics(out)]
        runs[mode] = sorted(recs, key=lambda r: (r["round"], r["kind"], r.get("client", -1)))
    clients = [r for r in runs["true"] if r["kind"] == "client"]
    assert sorted((r["round"], r["client"]) for r in clients) == [(r, c) for r in range(2) for c in range(3)]
    assert threads["false"] == {threading.main_thread().name}  # the switch was really taken: the clients of
    assert threading.main_thread().name not in threads["true"] and len(threads["true"]) >= 2  # a round in threads
    assert runs["true"] == runs["false"]


COMPILE_SWITCH = """
import json, sys, torch
from flare.config import load_config
from flare.runner import Run
compiled, real = [], torch.nn.Module.compile
def spy(self, *a, **k):
    compiled.append(type(self).__name__)
    return real(self, *a, **k)
torch.nn.Module.compile = spy
out, overrides, last = sys.argv[1], sys.argv[2:], {}
for mode in ("false", "true"):
    Run(load_config(None, "fafi", overrides + ["rounds=1", "cpu_isa=native", "drop_last=true", f"compile={mode}"]),
        f"{out}/{mode}", quiet=True).execute()
    rows = [json.loads(l) for l in open(f"{out}/{mode}/metrics.jsonl")]
    last[mode] = [r for r in rows if r["kind"] == "round"][-1]
    last[mode + "_compiled"] = list(compiled)
print(json.dumps(last))
"""


@pytest.mark.long
def test_compile_switch_trains_the_same_model(tiny_overrides, tmp_path):
    """compile=true (torch.compile, inductor on CPU) changes speed, not the numbers. In its own process at native
    kernels: compile under a pinned lower level is refused (flare.backend says why). drop_last=true gives training
    one batch shape: each further shape (a client's last, smaller batch) is one more compile, and with a cold
    inductor cache (a fresh CI machine) the two it saves cost about 40 s of one core."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                            "FLARE_CPU_ISA_PINNED")}
    r = subprocess.run([sys.executable, "-c", COMPILE_SWITCH, str(tmp_path), *tiny_overrides], capture_output=True,
                       text=True, env={**env, "FLARE_CPU_ISA": "native", "FLARE_QUIET": "1"})
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["false_compiled"] == [] and last["true_compiled"] == ["FlareNet"] * 3  # every client, only when asked
    for k in ("acc_feature", "acc_fedavg", "model_variance_mean", "g_protos_std"):
        assert last["true"][k] == pytest.approx(last["false"][k], rel=1e-4, abs=1e-6), k


def test_synthetic_dataset_is_learnable(tmp_path):
    """The benchmarks' stand-in data carries its label in the mean colour: a short run must beat chance (10 %)."""
    cfg = load_config(None, "fedavg", ["dataset.name=synthetic-cifar10", "dataset.train_subset=1000",
                                       "dataset.test_subset=500", "model.name=cnn", "model.width=0.25",
                                       "num_clients=2", "partition.kind=iid", "rounds=2", "batch_size=32",
                                       "device=cpu"])
    s = Run(cfg, tmp_path / "syn", quiet=True).execute()
    assert s["rounds"] == 2 and s["acc"] > 0.3, s
