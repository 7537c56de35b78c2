"""`flare paper --scale smoke|cpu|full`: the paper's experiments (docs/experiments.md) as sweeps, then one report.

Experiments (each a sweep; identical configs across them run once):

* ``table1``     Table 1 / Figure 1 — one-shot FedAvg, FAFI (V4), V7 and FLARE on every dataset × α ∈ {0.1, 0.05}.
* ``ablation``   Table 2 / Figure 2 — FLARE, w/o safety valve (V12), w/o meta-annealing (V10-rescaled),
                 w/o learned λ (V7), FAFI (V4) on the hardest setting (the notes: CIFAR-100, α = 0.05).
* ``robustness`` Table 3 / Figure 3 — V12 vs FLARE where the notes saw λ_raw explode (SVHN, α = 0.05).
* ``lambda0``    V7 with λ0 ∈ {1, 2.5, 5, 10, 20, 50} (CIFAR-10, α = 0.05): the notes' U-shape.
* ``alpha``      methods against α ∈ {0.05, 0.1, 0.3, 0.5} (CIFAR-10).
* server strategies (simple vs IFFI) need no runs of their own: every run evaluates every fusion rule.
* ``reproduce``  only when named in --only: the notes' CIFAR-10 table under protocol clean and reference, the
                 one-item protocol ablation and the fusion-rule figure (`paper.reproduce`); its report is
                 `report/reproduction.md` (`flare_paper.reproduction.write_reproduction_report`).

`--protocol clean,reference` runs the experiments under each protocol (a `protocol` grid axis; clean alone adds
none, so the directories of earlier suites stay valid). At `--scale full` the notes' per-dataset settings apply
(`scales.Scale.rules`): CIFAR-100 with the entropy rule's λ_max = 20 and V7's λ0 = 20; SVHN α = 0.05 with batch 256
and seed 114514 in place of seed 1 (the fork's configs).

Scales (`scales.py`): ``full`` is the notes' setting (ResNet-18, 5 clients, R/E per dataset, seed 1) and prints
the notes' reference numbers (`reference.py`) beside ours; ``cpu`` is a small CNN on data subsets of the offline
CIFAR-10 export and Fashion-MNIST (about an hour on 2 cores); ``smoke`` is the same pipeline in minutes, for CI.
When a dataset an experiment prefers is not among --datasets, it runs on the first one that is (the report says
so). Every option is checked before the first run (`options.py`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import yaml

from flare.config import build_config
from flare.experiments.execute import Point, check_dirs, execute_points, read_point_file
from flare.experiments.sweep import SweepSpec, expand, unflatten
from flare.fuse import fuse_runs
from flare.registry import STRATEGIES
from flare.rundata import num
from flare.records import flatten
from flare.rundir import RunDir, atomic_write_text

from flare_paper import reproduce
from flare_paper.options import EXPERIMENTS, PaperOptions, check_against_plan, default_data_root, parse_options
from flare_paper.report import PaperRuns, write_paper_report
from flare_paper.reproduction import write_reproduction_report
from flare_paper.scales import ABLATION_VARIANTS, DATASET_DEFAULTS, Scale, ScaleRule

# ----------------------------------------------------------------------------------------------
# the experiments as sweeps


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
    names: dict[str, str] = field(default_factory=dict)  # preset -> its role in this experiment (Table 2's variants)

    def for_report(self) -> PaperRuns:
        secs = [num(read_point_file(p.dir).get("seconds")) for p in self.points]
        return PaperRuns(self.key, self.title, self.spec.description, self.dataset, list(self.spec.seeds or []),
                         [(p.values, p.dir) for p in self.points], sum(x for x in secs if x == x), self.names)


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
                        fixed={"partition.alpha": a}), hard, names=dict(ABLATION_VARIANTS)),
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


@dataclass
class Plan:
    """Every experiment with its points placed and deduplicated, and the points this invocation runs."""

    exps: list[Experiment]
    todo: list[Point]
    wanted: set[str]
    planned: list[reproduce.Planned]
    dataset: str  # the reproduction's


def plan_suite(o: PaperOptions) -> Plan:
    """Expand, place and deduplicate every point before anything runs, then check the options that depend on the
    plan: every error surfaces here, under --dry-run too."""
    scale = o.scale
    base = dict(scale.common)
    exps = experiments(scale, o.datasets, o.seeds, o.roots, {})
    spec_keys = [e.key for e in exps]
    if o.protocols != ["clean"]:
        for e in exps:
            e.spec.grid = {**(e.spec.grid or {}), "protocol": o.protocols}
    planned: list[reproduce.Planned] = []
    ds = _pick(["cifar10"], o.datasets)
    only = o.only
    if only and "reproduce" in only:
        planned = reproduce.plan(scale, ds, dataset_mapping(scale, ds, o.roots), o.seeds, o.repro_protocols, base,
                                 o.overrides)
        # first: the reproduction's runs own their directories, the suite's experiments share them
        exps = [Experiment(pl.key, pl.title, pl.spec, ds) for pl in planned] + exps
    wanted = {e.key for e in exps if not only or e.key in only or (e.key not in spec_keys and "reproduce" in only)}
    unique: dict[str, Point] = {}
    user_keys = set(flatten(o.overrides))
    for e in exps:
        e.spec.base = {**base, **e.spec.base}
        e.points = expand(e.spec, unflatten(e.spec.base), o.overrides)
        apply_rules(scale.rules, e.points, user_keys)
        for p in e.points:
            key = json.dumps(p.mapping, sort_keys=True)
            if key in unique:
                p.dir = unique[key].dir
            else:
                p.dir = o.out / e.key / p.name
                unique[key] = p
    keep = {str(p.dir) for e in exps if e.key in wanted for p in e.points}
    todo = [p for p in unique.values() if str(p.dir) in keep]  # the others are not run; the report shows what exists
    if planned:
        todo = reproduce.order(todo, scale.hard_alpha)
    check_against_plan(o, [p for e in exps if e.key in wanted for p in e.points],
                       [p for e in exps if e.key == "table1" for p in e.points])
    check_dirs(todo)
    return Plan(exps, todo, wanted, planned, ds)


def run_paper(scale_name: str, out: str | None = None, datasets: str | None = None, seeds: str | None = None,
              workers: int = 1, address: str | None = None, data_root: list[str] | None = None, quiet: bool = False,
              dry_run: bool = False, overrides: list[str] | None = None, only: str | None = None,
              protocol: str | None = None, baseline: str | None = None, strategies: str | None = None):
    """The CLI's `flare paper`: check every option, plan, then (unless `dry_run`) run what is missing and write the
    report(s); returns the last report's path (None under `dry_run`)."""
    o = parse_options(scale_name, out, datasets, seeds, data_root, only, protocol, overrides, strategies, baseline,
                      workers)
    plan = plan_suite(o)
    exps, todo, out = plan.exps, plan.todo, o.out
    if dry_run:
        for e in exps:
            if e.key not in plan.wanted:
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
    if plan.planned:
        cmd = reproduce.command_line(o.scale.name, o.datasets, o.seeds, o.repro_protocols, data_root or [], out,
                                     overrides or [])
        reproduce.write_manifest(out, plan.planned, {e.key: e.points for e in exps}, cmd, o.scale.name, plan.dataset,
                                 o.seeds, o.repro_protocols)
    t0 = time.perf_counter()
    results = execute_points(todo, workers=workers, address=address, quiet=quiet, desc=f"paper {o.scale.name}")
    wall = time.perf_counter() - t0
    timing = {"scale": o.scale.name, "datasets": o.datasets, "seeds": o.seeds, "protocols": o.protocols,
              "runs": len(todo), "wall_seconds_this_invocation": wall,
              "run_seconds": {str(p.dir): results.get(p.name, {}).get("seconds") for p in todo}}
    atomic_write_text(out / "paper.json", json.dumps(timing, indent=1, default=str))
    failed = {n: r for n, r in results.items() if r.get("status") in ("failed", "diverged")}
    if o.strategies:
        fuse_points([p for e in exps if e.key == "table1" for p in e.points], o.strategies, quiet)
    md = None
    spec_exps = [e for e in exps if e.key in EXPERIMENTS]
    if not o.only or any(k != "reproduce" for k in o.only):
        md = write_paper_report(o.scale.for_report(), o.datasets, [e.for_report() for e in spec_exps],
                                out / "report", wall, failed, o.baseline)
        if not quiet:
            print((out / "report" / "report.md").read_text())
    if plan.planned:
        md = write_reproduction_report(out)
        if not quiet:
            print(md.read_text())
    if not quiet:
        print(f"\nreport: {md}  ({len(todo)} runs, {wall / 60:.1f} min this invocation)")
    return md


def fuse_points(points: list[Point], names: list[str], quiet: bool) -> None:
    """`--strategies`: every named server strategy over each finished run's saved clients (`flare fuse`; those that
    read prototypes only over prototype heads). Resumable like fuse itself."""
    for p in dict((str(p.dir), p) for p in points).values():
        rd = RunDir(p.dir)
        if rd.read_state().get("status") != "finished":
            continue
        head = build_config(rd.read_config()).head
        ok = [n for n in names if head == "prototype" or not STRATEGIES.get(n, key="--strategies").needs_prototypes]
        if not ok:
            continue
        for d, recs in fuse_runs([str(p.dir)], ",".join(ok)):
            if not quiet:
                print(f"fuse {d}: " + ", ".join(f"{r['strategy']} {100 * r['acc']:.2f}%" for r in recs))
