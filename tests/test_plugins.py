"""Plugins: parts registered by a module outside src/ (tests/plugins/flare_demo_plugin.py) validate with the config,
run in `flare run` and in sweep workers, travel in config.yaml, and never reach `flare report`."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flare.cli import main
from flare.config import build_config
from flare.errors import FlareError
from flare.registry import MODELS, NoFacts, Registry
from flare.rundir import read_jsonl
from flare.schedules import ScheduleFn

ROOT = Path(__file__).resolve().parents[1]
LAM = 0.4242  # the demo λ provider's constant: no built-in part produces it


def demo_config(tmp_path, **extra) -> dict:
    cfg = {"plugins": ["flare_demo_plugin"], "device": "cpu", "num_clients": 3, "rounds": 1, "batch_size": 16,
           "test_batch_size": 32, "dataset": {"name": "demo_blobs", "options": {"n_train": 96}},
           "model": {"name": "demo_mlp", "options": {"hidden": 16}}, "partition": {"kind": "demo_round_robin"},
           "loss": {"terms": {"demo_center": {"weight": 0.5, "radius": 2.0}}}, "align": {"anchors": "etf"},
           "lam": {"learner": "demo_constant", "options": {"lam": LAM}}}
    cfg.update(extra)
    return cfg


def assert_plugin_parts_ran(run_dir: Path) -> None:
    clients = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "client"]
    assert len(clients) == 3
    for r in clients:
        assert r["term_demo_center"] > 0 and r["lambda"] == pytest.approx(LAM, rel=1e-6), r
    sizes = [c["num_samples"] for c in json.loads((run_dir / "partition.json").read_text())["clients"]]
    assert sizes == [32, 32, 32]  # round-robin over the demo dataset's 96 samples
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["plugins"] == ["flare_demo_plugin"] and saved["lam"]["options"] == {"lam": LAM}


def test_reregistering_a_name_raises_unless_overwrite():
    reg = Registry("thing", "demo.key", ScheduleFn, NoFacts)
    reg.register("a", 1)
    with pytest.raises(FlareError) as e:
        reg.register("a", 2)
    assert e.value.key == "demo.key" and "already registered" in e.value.message
    with pytest.warns(UserWarning, match="replaced"):
        reg.register("a", 3, overwrite=True)
    assert reg.get("a") == 3
    with pytest.raises(FlareError, match="already registered"):
        MODELS.register("cnn", object())


def test_unknown_part_lists_the_registered_names():
    with pytest.raises(FlareError) as e:
        build_config({"align": {"anchors": "etff"}})
    assert e.value.key == "align.anchors" and "did you mean etf" in e.value.message and "random" in e.value.message


def test_plugin_option_of_the_wrong_type_names_the_option():
    with pytest.raises(FlareError) as e:
        build_config(demo_config(Path("."), loss={"terms": {"demo_center": {"weight": "heavy"}}}))
    assert e.value.key == "loss.terms.demo_center.weight"
    with pytest.raises(FlareError) as e:
        build_config(demo_config(Path("."), model={"name": "demo_mlp", "options": {"hidden": [1]}}))
    assert e.value.key == "model.options.hidden"


def test_batched_engine_runs_the_plugin_term_and_lam_provider(tmp_path):
    """One loss assembly for every engine (client/step.py): the plugin's term and λ provider run vmapped, and the
    records match the sequential engine's (tolerances: tests/test_batched.py)."""
    recs = {}
    for engine in ("sequential", "batched"):
        (tmp_path / f"{engine}.yaml").write_text(yaml.safe_dump(demo_config(tmp_path, client_engine=engine)))
        assert main(["run", "--config", str(tmp_path / f"{engine}.yaml"), "--out", str(tmp_path / engine),
                     "--quiet"]) == 0
        assert_plugin_parts_ran(tmp_path / engine)
        recs[engine] = [r for r in read_jsonl(tmp_path / engine / "metrics.jsonl") if r["kind"] == "client"]
    for a, b in zip(recs["sequential"], recs["batched"]):
        for k in ("term_demo_center", "base_loss", "align_loss", "lambda"):
            assert a[k] == pytest.approx(b[k], rel=1e-4), k


def test_batched_engine_names_a_part_it_cannot_vmap(tmp_path):
    cfg = build_config(demo_config(tmp_path, client_engine="batched",
                                   loss={"terms": {"demo_host_mean": {"weight": 0.1}}}))
    from flare.runner import Run
    with pytest.raises(FlareError) as e:
        Run(cfg, tmp_path / "run", quiet=True).execute()
    assert e.value.key == "loss.terms.demo_host_mean" and "client_engine=sequential" in e.value.render()
    assert f"model.name={cfg.model.name}" in e.value.message  # the model is a suspect too


def test_batched_engine_refuses_a_lam_provider_with_its_own_step(tmp_path):
    from flare.client.batched import BatchedClients
    from flare.client.lam import LamProvider

    class Stepping(LamProvider):
        def step(self):
            self.lambda0 *= 0.9

    assert "step()" in BatchedClients.lam_unsupported(Stepping(0.5))
    assert BatchedClients.lam_unsupported(LamProvider(0.5)) is None


@pytest.mark.long
def test_flare_run_with_a_plugin(tmp_path):
    """A fresh process: the plugin is imported from config.yaml's `plugins`, and each of its parts runs."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(demo_config(tmp_path)))
    r = subprocess.run([sys.executable, "-m", "flare.cli", "run", "--config", str(tmp_path / "c.yaml"),
                        "--out", str(tmp_path / "run"), "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "loaded plugin module flare_demo_plugin" in r.stderr
    assert_plugin_parts_ran(tmp_path / "run")
    # rebuilding the run (resume re-validates a finished run) imports the plugin by its module name, and says so
    again = subprocess.run([sys.executable, "-m", "flare.cli", "run", "--resume", str(tmp_path / "run"), "--quiet"],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "loaded plugin module flare_demo_plugin" in again.stderr
    import torch
    ck = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)  # plain tensors, plugin parts included
    assert len(ck["clients"]) == 3

    # `flare report` reads numbers only: it works where the plugin cannot even be imported
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in os.environ["PYTHONPATH"].split(os.pathsep)
                                                      if "plugins" not in p))
    rep = subprocess.run([sys.executable, "-m", "flare.cli", "report", str(tmp_path / "run"), "--out",
                          str(tmp_path / "rep")], capture_output=True, text=True, env=env)
    assert rep.returncode == 0, rep.stderr
    assert "plugin" not in rep.stderr


def test_threads_engine_runs_the_plugin_parts(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(demo_config(tmp_path, client_engine="threads")))
    assert main(["run", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    assert_plugin_parts_ran(tmp_path / "run")


def test_sweep_workers_import_the_plugin(tmp_path, monkeypatch, capsys):
    """--workers 2 without Ray: two fresh processes rebuild each point's config and import the plugin."""
    monkeypatch.setitem(sys.modules, "ray", None)
    spec = {"name": "p", "base": demo_config(tmp_path), "seeds": [1, 2]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "p"
    assert main(["sweep", "--config", str(tmp_path / "s.yaml"), "--out", str(out), "--workers", "2",
                 "--no-report", "--quiet"]) == 0
    points = sorted(d for d in out.iterdir() if (d / "metrics.jsonl").exists())
    assert len(points) == 2
    infos = [json.loads((d / "sweep_point.json").read_text()) for d in points]
    assert all(i["status"] == "finished" for i in infos) and os.getpid() not in {i["pid"] for i in infos}
    for d in points:
        assert_plugin_parts_ran(d)


def test_a_sweep_grid_over_plugin_options(tmp_path):
    from flare.experiments.sweep import expand, parse_sweep

    spec, base = parse_sweep({"name": "g", "base": demo_config(tmp_path),
                              "grid": {"loss.terms.demo_center.weight": [0.1, 0.2], "lam.options.lam": [0.3]}})
    pts = expand(spec, base)
    assert sorted(p.config.loss.terms["demo_center"]["weight"] for p in pts) == [0.1, 0.2]
    assert {p.config.lam.options["lam"] for p in pts} == {0.3}
    with pytest.raises(FlareError) as e:
        expand(*parse_sweep({"name": "g", "base": demo_config(tmp_path),
                             "grid": {"loss.terms.demo_center.weight": ["heavy"]}}))
    assert "loss.terms.demo_center.weight" in str(e.value)


def test_lr_probe_runs_the_plugin_term_and_lam_provider(tmp_path):
    from flare.lrprobe import probe

    kw = dict(batches=1, iters=3, tol=0.0, progress=False)
    base = probe(build_config(demo_config(tmp_path)), **kw)["L"]
    heavier = demo_config(tmp_path, loss={"terms": {"demo_center": {"weight": 50.0, "radius": 2.0}}})
    assert probe(build_config(heavier), **kw)["L"] != pytest.approx(base, rel=1e-3)
    stronger = demo_config(tmp_path, lam={"learner": "demo_constant", "options": {"lam": 500.0}})
    assert probe(build_config(stronger), **kw)["L"] != pytest.approx(base, rel=1e-3)


def test_listings_include_plugin_parts(capsys):
    assert main(["parts", "--plugin", "flare_demo_plugin"]) == 0
    out = capsys.readouterr().out
    for name in ("demo_center", "demo_constant", "demo_mlp", "demo_blobs", "demo_round_robin"):
        assert re.search(rf"^\s+{name}\s", out, re.M), name
    assert "options: weight: float = 1.0, radius: float = 1.0" in out  # each option's name, type and default
    assert "loss-terms (loss.terms): fn(facts: NoFacts, options: TermOptions) -> Term" in out  # what it is
    assert main(["models", "--plugin", "flare_demo_plugin"]) == 0
    assert "demo_mlp" in capsys.readouterr().out.split()


def test_the_extending_page_runs(tmp_path):
    """docs/extending.md's `my_methods` plugin is one python block: extract it, import it as a module, run a tiny
    `flare run` (its server strategies included: the doc's primary and eval.rules). The page's other python block is
    a tested plugin file, copied in by tools/readme.py (tests/test_extending_sends.py)."""
    text = (ROOT / "docs" / "extending.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith('"""my_methods')]
    (tmp_path / "my_methods.py").write_text(block)
    cfg = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", text, re.S)[0])
    cfg.update({"device": "cpu", "rounds": 1, "num_clients": 2, "batch_size": 16, "test_batch_size": 32,
                "dataset": {"name": "demo_blobs"}, "partition": {"kind": "iid"}})
    cfg["plugins"] = ["flare_demo_plugin", *cfg["plugins"]]  # the doc's plugin, on a dataset with no files
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    r = subprocess.run([sys.executable, "-m", "flare.cli", "run", "--config", str(tmp_path / "c.yaml"),
                        "--out", str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    clients = [x for x in read_jsonl(tmp_path / "run" / "metrics.jsonl") if x["kind"] == "client"]
    assert clients and all("term_logit_norm" in x and x["lambda"] > 0 for x in clients), clients[0]
    last = [x for x in read_jsonl(tmp_path / "run" / "metrics.jsonl") if x["kind"] == "round"][-1]
    assert last["primary"] == "vote" and last["acc"] == last["acc_vote"], last  # the doc's strategies ran
    assert last["vote.samples"] == 96.0  # the clients' class counts arrived as extras: the demo dataset's 96 samples
    assert set(k for k in last if k.startswith("acc_")) == {"acc_vote", "acc_soup", "acc_feature"}, last
    assert last["soup.rounds"] == 2 and last["soup.bytes_up"] == last["soup.bytes_down"] > 0  # it talked back


# One picky part of every kind (tests/plugins/flare_picky_plugin.py): each refuses seed=13 through its own check.
PICKY = [("model", {"model": {"name": "picky_model"}}),
         ("dataset", {"dataset": {"name": "picky_data"}}),
         ("partition", {"partition": {"kind": "picky_partition"}}),
         ("anchors", {"align": {"anchors": "picky_anchors"}}),
         ("λ provider", {"align": {"anchors": "etf"}, "lam": {"learner": "picky_lam"}}),
         ("schedule", {"align": {"anchors": "etf", "schedule": "picky_schedule"}}),
         ("surgery", {"align": {"anchors": "etf", "surgery": "picky_surgery"}}),
         ("contrast bank", {"loss": {"contrast": "picky_bank"}}),
         ("objective", {"loss": {"objective": "picky_objective"}}),
         ("loss term", {"loss": {"terms": {"picky_term": {"weight": 0.1}}}}),
         ("strategy", {"eval": {"rules": ["primary", "picky_strategy"]}})]


@pytest.mark.parametrize("kind,mapping", PICKY, ids=[k for k, _ in PICKY])
def test_a_plugin_part_of_every_kind_refuses_a_config_it_cannot_serve(kind, mapping):
    cfg = {"plugins": ["flare_picky_plugin"], **mapping}
    build_config({**cfg, "seed": 1})  # a config the part serves
    with pytest.raises(FlareError) as e:
        build_config({**cfg, "seed": 13})
    assert e.value.key == "seed" and f"the picky {kind} cannot serve seed=13" in e.value.message


def test_a_part_checks_both_its_own_rule_and_its_registration():
    """An object's own `check` (e.g. an Objective's head rule) and the `check=` it is registered with both run."""
    from flare.client.objective import Objective
    from flare.registry import OBJECTIVES

    seen = []
    reg = Registry("objective", "loss.objective", OBJECTIVES.signature, OBJECTIVES.facts)
    reg.register("linear", Objective(lambda *a: {}, "linear"), check=lambda cfg: seen.append(cfg.seed))
    with pytest.raises(FlareError) as e:  # the Objective's own rule first: alignment needs the prototype head
        reg.check("linear", build_config({"align": {"anchors": "etf"}}))
    assert e.value.key == "loss.objective" and not seen
    reg.check("linear", build_config({"seed": 7}))
    assert seen == [7]


def test_every_registry_states_what_its_entries_are():
    from flare.registry import REGISTRIES

    for kind, reg in REGISTRIES.items():
        assert getattr(reg.signature, "_is_protocol", False), kind
        assert reg.call_signature().startswith(("fn(", "an object with")), kind
