"""`flare paper --scale smoke|cpu|full`: the experiments of docs/method.md#experiments as sweeps, then one report.

Experiments (each a sweep; identical configs across them run once):

* ``table1``     Table 1 / Figure 1 — one-shot FedAvg, FAFI (V4), V7 and FLARE on every dataset × α ∈ {0.1, 0.05}.
* ``ablation``   Table 2 / Figure 2 — FLARE, w/o safety valve (V12), w/o meta-annealing (V10-rescaled),
                 w/o learned λ (V7), FAFI (V4) on the hardest setting (the notes: CIFAR-100, α = 0.05).
* ``robustness`` Table 3 / Figure 3 — V12 vs FLARE where the notes saw λ_raw explode (SVHN, α = 0.05).
* ``lambda0``    V7 with λ0 ∈ {1, 2.5, 5, 10, 20, 50} (CIFAR-10, α = 0.05): the notes' U-shape.
* ``alpha``      methods against α ∈ {0.05, 0.1, 0.3, 0.5} (CIFAR-10).
* server strategies (simple vs IFFI) need no runs of their own: every run evaluates every fusion rule.
* ``reproduce``  only when named in --only: the notes' CIFAR-10 table under protocol clean and reference, the
                 one-item protocol ablation and the fusion-rule figure (`experiments.reproduce`); its report is
                 `report/reproduction.md` (`flare.report.reproduction.write_reproduction_report`).

`--protocol clean,reference` runs the experiments under each protocol (a `protocol` grid axis; clean alone adds
none, so the directories of earlier suites stay valid). At `--scale full` the notes' per-dataset settings apply
(`Scale.rules`): CIFAR-100 with the entropy rule's λ_max = 20 and V7's λ0 = 20; SVHN α = 0.05 with batch 256 and
seed 114514 in place of seed 1 (the fork's configs).

Scales: ``full`` is the notes' setting (ResNet-18, 5 clients, R/E per dataset, seed 1) and prints the notes' reference
numbers (docs/method.md#reference-numbers) beside ours; ``cpu`` is a small CNN on data subsets of the offline CIFAR-10
export and Fashion-MNIST (about an hour on 2 cores); ``smoke`` is the same pipeline in minutes, for CI. When a dataset
an experiment prefers is not among --datasets, it runs on the first one that is (the report says so).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from flare.config import parse_overrides
from flare.data.datasets import DATASETS
from flare.errors import FlareError
from flare.config import build_config
from flare.config.protocol import ITEM_KEYS
from flare.experiments import reproduce
from flare.experiments.execute import Point, check_dirs, execute_points, read_point_file
from flare.experiments.sweep import SweepSpec, expand, unflatten
from flare.fuse import fuse_runs
from flare.registry import STRATEGIES
from flare.report.paper import PaperRuns, PaperScale, write_paper_report
from flare.report.reproduction import write_reproduction_report
from flare.rundata import num
from flare.rundir import RunDir, atomic_write_text, flatten

# ----------------------------------------------------------------------------------------------
# scales


@dataclass
class ScaleRule:
    """Extra config values for the points that match (flat keys; "preset" matches the point's preset), and a seed
    map (e.g. the notes ran SVHN α = 0.05 with seed 114514 where everything else used seed 1). Keys the user
    overrides on the command line win."""

    match: dict
    set: dict = field(default_factory=dict)
    seed_map: dict = field(default_factory=dict)


@dataclass
class Scale:
    name: str
    description: str
    datasets: list[str]
    seeds: list[int]
    common: dict
    per_dataset: dict[str, dict]
    table1_alphas: list[float] = field(default_factory=lambda: [0.1, 0.05])
    table1_methods: list[str] = field(default_factory=lambda: ["fedavg", "fafi", "etf-anneal", "flare"])
    ablation_methods: list[str] = field(default_factory=lambda: ["flare", "decoupled", "uw-rescaled", "etf-anneal",
                                                                 "fafi"])
    robust_methods: list[str] = field(default_factory=lambda: ["decoupled", "flare"])
    lambda0s: list[float] = field(default_factory=lambda: [1.0, 2.5, 5.0, 10.0, 20.0, 50.0])
    sweep_alphas: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.3, 0.5])
    alpha_methods: list[str] = field(default_factory=lambda: ["fafi", "drcl", "drcl-anneal", "etf-anneal", "flare"])
    hard: list[str] = field(default_factory=lambda: ["cifar100", "tinyimagenet", "cifar10", "svhn", "fmnist"])
    robust: list[str] = field(default_factory=lambda: ["svhn", "cifar10", "cifar100", "fmnist"])
    sweep: list[str] = field(default_factory=lambda: ["cifar10", "svhn", "cifar100", "fmnist"])
    hard_alpha: float = 0.05
    references: bool = False
    rules: list[ScaleRule] = field(default_factory=list)
    reproduce_methods: list[str] = field(default_factory=lambda: list(reproduce.METHODS))
    reproduce_alphas: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.3, 0.5])
    later_alphas: list[float] = field(default_factory=lambda: [0.05, 0.3])  # where the notes' later batch has numbers
    ablation_items: list[str] = field(default_factory=lambda: list(ITEM_KEYS))
    reproduce_rounds: int | None = None

    def for_report(self) -> PaperScale:
        return PaperScale(self.name, self.description, self.references, self.table1_alphas, self.hard_alpha)


# the notes' R and E (docs/method.md#experiments); Tiny-ImageNet's E is not given: we use CIFAR-100's
DATASET_DEFAULTS = {
    "cifar10": {"rounds": 50, "local_epochs": 1},
    "svhn": {"rounds": 50, "local_epochs": 1},
    "cifar100": {"rounds": 10, "local_epochs": 10},
    "tinyimagenet": {"rounds": 10, "local_epochs": 10},
    "fmnist": {"rounds": 50, "local_epochs": 1},
    "mnist": {"rounds": 50, "local_epochs": 1},
}

SCALES = {
    "full": Scale(
        "full", "the notes' setting: ResNet-18, 5 clients, batch 512, lr 0.05, R/E per dataset, whole datasets",
        datasets=["cifar10", "cifar100", "svhn"], seeds=[1],
        common={"model": {"name": "resnet18", "width": 1.0}, "num_clients": 5, "batch_size": 512},
        per_dataset={k: dict(v) for k, v in DATASET_DEFAULTS.items()}, references=True,
        rules=[ScaleRule({"dataset.name": "cifar100"}, {"align.lambda_max": 20.0}),
               ScaleRule({"dataset.name": "cifar100", "preset": "etf-anneal"}, {"align.lambda0": 20.0}),
               ScaleRule({"dataset.name": "svhn", "partition.alpha": 0.05}, {"batch_size": 256}, {1: 114514})]),
    "cpu": Scale(
        "cpu", "CPU-sized: a small CNN (width 0.5), batch 64, 2000/1000-sample subsets of the offline CIFAR-10 "
               "export and Fashion-MNIST; about an hour on 2 cores",
        datasets=["cifar10", "fmnist"], seeds=[1],
        common={"model": {"name": "cnn", "width": 0.5}, "num_clients": 5, "batch_size": 64},
        per_dataset={"cifar10": {"rounds": 10, "local_epochs": 1, "dataset": {"train_subset": 2000,
                                                                               "test_subset": 1000}},
                     "fmnist": {"rounds": 6, "local_epochs": 1, "dataset": {"train_subset": 2000,
                                                                              "test_subset": 1000}},
                     "svhn": {"rounds": 8, "local_epochs": 1, "dataset": {"train_subset": 2000, "test_subset": 1000}},
                     "cifar100": {"rounds": 4, "local_epochs": 2, "dataset": {"train_subset": 4000,
                                                                                "test_subset": 1000}}},
        lambda0s=[1.0, 5.0, 20.0, 50.0], sweep_alphas=[0.05, 0.1, 0.5],
        alpha_methods=["fafi", "etf-anneal", "flare"], reproduce_alphas=[0.05, 0.5], later_alphas=[0.05],
        ablation_items=[k for k in ITEM_KEYS if k != "amp"], reproduce_rounds=6),
    "smoke": Scale(
        "smoke", "CI smoke test: a tiny CNN, 2 rounds on 400/200 Fashion-MNIST samples",
        datasets=["fmnist"], seeds=[1],
        common={"model": {"name": "cnn", "width": 0.25}, "num_clients": 5, "batch_size": 32},
        per_dataset={"fmnist": {"rounds": 2, "local_epochs": 1, "dataset": {"train_subset": 400, "test_subset": 200}},
                     "cifar10": {"rounds": 2, "local_epochs": 1, "dataset": {"train_subset": 300,
                                                                              "test_subset": 200}}},
        lambda0s=[1.0, 5.0], sweep_alphas=[0.05, 0.1], alpha_methods=["fafi"], reproduce_methods=["fedavg", "fafi"],
        reproduce_alphas=[0.05], later_alphas=[0.05], ablation_items=["eval.bn", "loss.ce_input", "drop_last"]),
}


# ----------------------------------------------------------------------------------------------
# data locations


def default_data_root(name: str) -> dict:
    """dataset.root/format for a dataset from env FLARE_DATA_<NAME>, else {} (the loader's own default: Debian's
    Fashion-MNIST, generated synthetic data; every other dataset needs a root, which `run_paper` checks)."""
    env = os.environ.get(f"FLARE_DATA_{name.upper()}")
    return _root_mapping(name, env) if env else {}


def _root_mapping(name: str, path: str) -> dict:
    p = Path(path).expanduser()
    m = {"root": str(p.resolve()) if p.exists() else str(p)}
    if p.suffix in (".gz", ".tar", ".tgz") or (p.is_dir() and (p / "train").is_dir()):
        m["format"] = "imagefolder"
    return m


def parse_data_roots(items: list[str]) -> dict[str, dict]:
    out = {}
    for it in items or []:
        if "=" not in it:
            raise FlareError(f"--data-root '{it}' is not of the form NAME=PATH.", key="--data-root",
                             fix="write e.g. --data-root cifar10=../shared/data/cifar10-jpg.tar.gz")
        k, v = it.split("=", 1)
        out[k.strip()] = _root_mapping(k.strip(), v.strip())
    return out


# ----------------------------------------------------------------------------------------------
# the experiments as sweeps


ROOTLESS = {"fmnist", "synthetic-cifar10", "synthetic-cifar100"}  # loadable without dataset.root
ZIP_KEYS = ("dataset.name", "dataset.root", "dataset.format", "dataset.train_subset", "dataset.test_subset",
            "rounds", "local_epochs")


def dataset_mapping(scale: Scale, name: str, roots: dict[str, dict]) -> dict:
    """The flat (dotted) config values that place a run on dataset `name` at this scale."""
    per = scale.per_dataset.get(name) or DATASET_DEFAULTS.get(name) or {"rounds": 10, "local_epochs": 1}
    ds = {"name": name, "root": None, "format": "auto", "train_subset": None, "test_subset": None}
    ds.update(per.get("dataset", {}))
    ds.update(roots.get(name) or default_data_root(name))
    flat = {f"dataset.{k}": v for k, v in ds.items() if f"dataset.{k}" in ZIP_KEYS}
    flat["rounds"] = per.get("rounds", 10)
    flat["local_epochs"] = per.get("local_epochs", 1)
    return flat


def _pick(prefs: list[str], available: list[str]) -> str:
    for p in prefs:
        if p in available:
            return p
    return available[0]


@dataclass
class Experiment:
    key: str
    title: str
    spec: SweepSpec
    dataset: str | None = None
    points: list[Point] = field(default_factory=list)

    def for_report(self) -> PaperRuns:
        secs = [num(read_point_file(p.dir).get("seconds")) for p in self.points]
        return PaperRuns(self.key, self.title, self.spec.description, self.dataset, list(self.spec.seeds or []),
                         [(p.values, p.dir) for p in self.points], sum(x for x in secs if x == x))


def experiments(scale: Scale, datasets: list[str], seeds: list[int], roots: dict, base: dict) -> list[Experiment]:
    def zip_for(names):
        ms = [dataset_mapping(scale, n, roots) for n in names]
        return {k: [m[k] for m in ms] for k in ZIP_KEYS}

    def spec(name, desc, presets, names, grid=None, fixed=None):
        b = dict(base)
        b.update(fixed or {})
        return SweepSpec(name=name, description=desc, base=b, presets=presets, seeds=seeds, grid=grid,
                         zip=zip_for(names))

    hard = _pick(scale.hard, datasets)
    robust = _pick(scale.robust, datasets)
    sweep_ds = _pick(scale.sweep, datasets)
    a = scale.hard_alpha
    return [
        Experiment("table1", "Table 1 — main comparison",
                   spec("table1", "FedAvg, FAFI (V4), V7, FLARE on every dataset and α", scale.table1_methods,
                        datasets, grid={"partition.alpha": scale.table1_alphas})),
        Experiment("ablation", "Table 2 — ablation",
                   spec("ablation", f"FLARE and its ablations on {hard}, α={a:g}", scale.ablation_methods, [hard],
                        fixed={"partition.alpha": a}), hard),
        Experiment("robustness", "Table 3 — robustness",
                   spec("robustness", f"V12 vs FLARE on {robust}, α={a:g}", scale.robust_methods, [robust],
                        fixed={"partition.alpha": a}), robust),
        Experiment("lambda0", "λ0 sweep (V7)",
                   spec("lambda0", f"V7 with λ0 ∈ {scale.lambda0s} on {sweep_ds}, α={a:g}", ["etf-anneal"],
                        [sweep_ds], grid={"align.lambda0": scale.lambda0s}, fixed={"partition.alpha": a}),
                   sweep_ds),
        Experiment("alpha", "α sweep",
                   spec("alpha", f"{', '.join(scale.alpha_methods)} against α on {sweep_ds}", scale.alpha_methods,
                        [sweep_ds], grid={"partition.alpha": scale.sweep_alphas}), sweep_ds),
    ]


def _spec_yaml(spec: SweepSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True, exclude={"resources"}), sort_keys=False,
                          allow_unicode=True)


# ----------------------------------------------------------------------------------------------
# the suite


def _split(v: str | list | None) -> list[str] | None:
    if isinstance(v, str):
        return [x.strip() for x in v.split(",") if x.strip()]
    return v


def apply_rules(rules: list[ScaleRule], points: list[Point], user_keys: set[str]) -> None:
    """The scale's per-setting values (`ScaleRule`) on the points they match, in place (config, values, name)."""
    for p in points:
        for rule in rules:
            flat = flatten(p.mapping)
            flat["preset"] = p.values.get("preset") or p.config.preset
            if not all(flat.get(k) == v for k, v in rule.match.items()):
                continue
            m = p.mapping
            changes = {k: v for k, v in rule.set.items() if k not in user_keys}
            for k, v in changes.items():
                node = m
                *head, last = k.split(".")
                for h in head:
                    node = node.setdefault(h, {})
                node[last] = v
            new_seed = rule.seed_map.get(p.config.seed) if "seed" not in user_keys else None
            if new_seed is not None:
                p.name = p.name.replace(f"seed={p.config.seed}", f"seed={new_seed}")
                m["seed"] = p.values["seed"] = new_seed
            p.values.update(changes)
            p.config = build_config(m)


def run_paper(scale_name: str, out: str | Path | None = None, datasets: str | list[str] | None = None,
              seeds: str | list[int] | None = None, workers: int = 1, address: str | None = None,
              data_root: list[str] | None = None, quiet: bool = False, dry_run: bool = False,
              overrides: list[str] | None = None, only: str | list[str] | None = None,
              protocol: str | list[str] | None = None, baseline: str | None = None,
              strategies: str | None = None) -> Path | None:
    if scale_name not in SCALES:
        raise FlareError(f"unknown scale '{scale_name}'.", key="--scale", fix=f"use one of: {', '.join(SCALES)}.")
    scale = SCALES[scale_name]
    datasets = _split(datasets) or list(scale.datasets)
    for d in datasets:
        if d not in DATASETS:
            raise FlareError(f"unknown dataset '{d}' in --datasets.", key="--datasets",
                             fix=f"use names of `flare datasets`: {', '.join(DATASETS.names())}.")
    if isinstance(seeds, str):
        try:
            seeds = [int(s) for s in seeds.split(",") if s.strip()]
        except ValueError:
            raise FlareError(f"--seeds '{seeds}' is not a comma-separated list of integers.", key="--seeds") from None
    seeds = seeds or list(scale.seeds)
    roots = parse_data_roots(data_root or [])
    for d in datasets:
        if d not in ROOTLESS and not (roots.get(d) or default_data_root(d)):
            raise FlareError(f"--datasets includes {d}, but where it lives is not given.", key="--data-root",
                             fix=f"pass --data-root {d}=PATH (e.g. cifar10=../shared/data/cifar10-jpg.tar.gz) or set "
                                 f"FLARE_DATA_{d.upper()}=PATH.")
    only = _split(only)
    # --protocol: the protocols of every experiment; by default clean, and clean,reference for the reproduction
    protocols = reproduce.settings_for(_split(protocol) or ["clean"])
    repro_protocols = reproduce.settings_for(_split(protocol) or ["clean", "reference"])
    base = dict(scale.common)
    out = Path(out) if out else Path("runs") / f"paper-{scale.name}"
    exps = experiments(scale, datasets, seeds, roots, {})
    spec_keys = [e.key for e in exps]
    if only:
        bad = [o for o in only if o not in spec_keys + ["reproduce"]]
        if bad:
            raise FlareError(f"--only names unknown experiments: {', '.join(bad)}.", key="--only",
                             fix=f"use some of: {', '.join(spec_keys + ['reproduce'])}.")
    if protocols != ["clean"]:
        for e in exps:
            e.spec.grid = {**(e.spec.grid or {}), "protocol": protocols}
    ov = parse_overrides(overrides or [])
    planned: list[reproduce.Planned] = []
    ds = _pick(["cifar10"], datasets)
    if only and "reproduce" in only:
        planned = reproduce.plan(scale, ds, dataset_mapping(scale, ds, roots), seeds, repro_protocols, base, ov)
        # first: the reproduction's runs own their directories, the suite's experiments share them
        exps = [Experiment(pl.key, pl.title, pl.spec, ds) for pl in planned] + exps
    wanted = {e.key for e in exps if not only or e.key in only or (e.key not in spec_keys and "reproduce" in only)}
    # expand, place and deduplicate every point before anything runs (all errors surface here)
    unique: dict[str, Point] = {}
    user_keys = set(flatten(ov))
    for e in exps:
        e.spec.base = {**base, **e.spec.base}
        e.points = expand(e.spec, unflatten(e.spec.base), ov)
        apply_rules(scale.rules, e.points, user_keys)
        for p in e.points:
            key = json.dumps(p.mapping, sort_keys=True)
            if key in unique:
                p.dir = unique[key].dir
            else:
                p.dir = out / e.key / p.name
                unique[key] = p
    todo = list(unique.values())
    keep = {str(p.dir) for e in exps if e.key in wanted for p in e.points}
    todo = [p for p in todo if str(p.dir) in keep]  # the other experiments are not run; their report shows what exists
    if planned:
        todo = reproduce.order(todo, scale.hard_alpha)
    check_dirs(todo)
    if dry_run:
        for e in exps:
            if e.key not in wanted:
                continue
            print(f"# {e.key}: {e.title} — {e.spec.description}")
            for p in e.points:
                print(f"    {p.dir}" + ("" if p.dir == out / e.key / p.name else "   (shared)"))
        print(f"{len(todo)} distinct runs")
        return None
    RunDir(out).create()
    (out / "sweeps").mkdir(exist_ok=True)
    for e in exps:
        atomic_write_text(out / "sweeps" / f"{e.key}.yaml", _spec_yaml(e.spec))
    if planned:
        cmd = reproduce.command_line(scale.name, datasets, seeds, repro_protocols, data_root or [], out,
                                     overrides or [])
        reproduce.write_manifest(out, planned, {e.key: e.points for e in exps}, cmd, scale.name, ds, seeds,
                                 repro_protocols)
    t0 = time.perf_counter()
    results = execute_points(todo, workers=workers, address=address, quiet=quiet, desc=f"paper {scale.name}")
    wall = time.perf_counter() - t0
    timing = {"scale": scale.name, "datasets": datasets, "seeds": seeds, "protocols": protocols, "runs": len(todo),
              "wall_seconds_this_invocation": wall,
              "run_seconds": {str(p.dir): results.get(p.name, {}).get("seconds") for p in todo}}
    atomic_write_text(out / "paper.json", json.dumps(timing, indent=1, default=str))
    failed = {n: r for n, r in results.items() if r.get("status") in ("failed", "diverged")}
    if strategies:
        fuse_points([p for e in exps if e.key == "table1" for p in e.points], strategies, quiet)
    md = None
    spec_exps = [e for e in exps if e.key in spec_keys]
    if not only or any(k in spec_keys for k in only):
        md = write_paper_report(scale.for_report(), datasets, [e.for_report() for e in spec_exps], out / "report",
                                wall, failed, baseline)
        if not quiet:
            print((out / "report" / "report.md").read_text())
    if planned:
        md = write_reproduction_report(out)
        if not quiet:
            print(md.read_text())
    if not quiet:
        print(f"\nreport: {md}  ({len(todo)} runs, {wall / 60:.1f} min this invocation)")
    return md


def fuse_points(points: list[Point], strategies: str, quiet: bool) -> None:
    """`--strategies`: every named server strategy over each finished run's saved clients (`flare fuse`; those that
    read prototypes only over prototype heads). Resumable like fuse itself."""
    names = [n.strip() for n in strategies.split(",") if n.strip()]
    for p in dict((str(p.dir), p) for p in points).values():
        rd = RunDir(p.dir)
        if rd.read_state().get("status") != "finished":
            continue
        head = build_config(rd.read_config()).head
        ok = [n for n in names if head == "prototype" or not STRATEGIES.get(n).needs_prototypes]
        for d, recs in fuse_runs([str(p.dir)], ",".join(ok)):
            if not quiet:
                print(f"fuse {d}: " + ", ".join(f"{r['strategy']} {100 * r['acc']:.2f}%" for r in recs))
