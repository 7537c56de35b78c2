"""The options of `flare paper`, checked before the first run (under --dry-run too): every mistake names the option
the user typed (`--datasets`, `--strategies`, ...), never a config key they did not write.

Two passes, because some options can only be judged against the plan: `parse_options` checks what the command line
says on its own (lists, names, data roots); `check_against_plan` checks --strategies and --baseline against the
points the selected experiments would run, once they are expanded (their plugins loaded)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from flare.config import parse_list, parse_overrides
from flare.data.datasets import DATASETS
from flare.errors import FlareError
from flare.registry import STRATEGIES, load_plugins

from flare_paper import reproduce
from flare_paper.scales import SCALES, Scale

ROOTLESS = {"fmnist", "synthetic-cifar10", "synthetic-cifar100"}  # loadable without dataset.root
EXPERIMENTS = ["table1", "ablation", "robustness", "lambda0", "alpha", "reproduce"]


@dataclass
class PaperOptions:
    """The command line of `flare paper`, parsed and checked."""

    scale: Scale
    out: Path
    datasets: list[str]
    seeds: list[int]
    roots: dict[str, dict]
    only: list[str] | None
    protocols: list[str]         # of the suite's experiments: clean unless --protocol says otherwise
    repro_protocols: list[str]   # of the reproduction: clean,reference unless --protocol says otherwise
    overrides: dict
    strategies: list[str]
    baseline: str | None


def default_data_root(name: str) -> dict:
    """dataset.root/format for a dataset from env FLARE_DATA_<NAME>, else {} (the loader's own default: Debian's
    Fashion-MNIST, generated synthetic data; every other dataset needs a root, which `parse_options` checks)."""
    env = os.environ.get(f"FLARE_DATA_{name.upper()}")
    return _root_mapping(env) if env else {}


def _root_mapping(path: str) -> dict:
    p = Path(path).expanduser()
    m = {"root": str(p.resolve()) if p.exists() else str(p)}
    if p.suffix in (".gz", ".tar", ".tgz") or (p.is_dir() and (p / "train").is_dir()):
        m["format"] = "imagefolder"
    return m


def parse_data_roots(items: list[str]) -> dict[str, dict]:
    """`--data-root NAME=PATH` (repeatable): a known dataset, a path, each dataset once."""
    out = {}
    example = "write e.g. --data-root cifar10=../shared/data/cifar10-jpg.tar.gz"
    for it in items or []:
        name, sep, path = (s.strip() for s in it.partition("="))
        if not sep or not name or not path:
            raise FlareError(f"--data-root '{it}' is not of the form NAME=PATH.", key="--data-root", fix=example)
        if name not in DATASETS:
            raise FlareError(f"--data-root '{it}' names the unknown dataset '{name}'.", key="--data-root",
                             fix=f"use names of `flare datasets`: {', '.join(DATASETS.names())}.")
        if name in out:
            raise FlareError(f"--data-root gives '{name}' twice.", key="--data-root", fix="give each dataset once.")
        out[name] = _root_mapping(path)
    return out


def settings_for(text: str | None, default: list[str]) -> list[str]:
    """--protocol: some of clean, reference (in that order), or `default` when not given."""
    names = default if text is None else parse_list(text, "--protocol", example="clean,reference")
    return reproduce.settings_for(names)


def parse_options(scale_name: str, out: str | Path | None, datasets: str | None, seeds: str | None,
                  data_root: list[str] | None, only: str | None, protocol: str | None, overrides: list[str] | None,
                  strategies: str | None, baseline: str | None, workers: int) -> PaperOptions:
    """Every option that can be judged without the plan; the plugins the overrides name are loaded first, so their
    datasets and strategies count as known."""
    if scale_name not in SCALES:
        raise FlareError(f"unknown scale '{scale_name}'.", key="--scale", fix=f"use one of: {', '.join(SCALES)}.")
    scale = SCALES[scale_name]
    if out is not None and not str(out).strip():
        raise FlareError("--out is empty.", key="--out", fix=f"leave it out (default runs/paper-{scale_name}) or "
                                                               "give a directory.")
    if workers < 1:
        raise FlareError(f"--workers {workers}: at least one worker runs the points.", key="--workers",
                         fix="give --workers 1 (sequential) or more.")
    ov = parse_overrides(overrides or [])
    plugins = ov.get("plugins")  # a malformed value is the config's to refuse, when the points are built
    load_plugins(plugins if isinstance(plugins, list) else [])
    names = parse_list(datasets, "--datasets", example="cifar10,fmnist") if datasets is not None else scale.datasets
    for d in names:
        if d not in DATASETS:
            raise FlareError(f"unknown dataset '{d}' in --datasets.", key="--datasets",
                             fix=f"use names of `flare datasets`: {', '.join(DATASETS.names())}.")
    roots = parse_data_roots(data_root or [])
    for d in names:
        if d not in ROOTLESS and not (roots.get(d) or default_data_root(d)):
            raise FlareError(f"--datasets includes {d}, but where it lives is not given.", key="--data-root",
                             fix=f"pass --data-root {d}=PATH (e.g. cifar10=../shared/data/cifar10-jpg.tar.gz) or set "
                                 f"FLARE_DATA_{d.upper()}=PATH.")
    only_list = None if only is None else parse_list(only, "--only", example="table1,ablation")
    bad = [o for o in only_list or [] if o not in EXPERIMENTS]
    if bad:
        raise FlareError(f"--only names unknown experiments: {', '.join(bad)}.", key="--only",
                         fix=f"use some of: {', '.join(EXPERIMENTS)}.")
    strategy_names = [] if strategies is None else parse_list(strategies, "--strategies", duplicates="drop",
                                                               example="output,fedproto")
    for n in strategy_names:  # registered by the built-ins or by a plugin loaded above
        STRATEGIES.entry(n, key="--strategies")
    if baseline is not None and not baseline.strip():
        raise FlareError("--baseline is empty.", key="--baseline", fix="name a method the experiments run, e.g. fafi.")
    return PaperOptions(
        scale=scale, out=Path(out) if out else Path("runs") / f"paper-{scale.name}", datasets=list(names),
        seeds=(parse_list(seeds, "--seeds", convert=int, example="1,2,3") if seeds is not None else list(scale.seeds)),
        roots=roots, only=only_list, protocols=settings_for(protocol, ["clean"]),
        repro_protocols=settings_for(protocol, ["clean", "reference"]), overrides=ov, strategies=strategy_names,
        baseline=baseline)


def check_against_plan(opts: PaperOptions, selected: list, table1: list) -> None:
    """--baseline must be a method the selected experiments run; every --strategies name must serve each Table 1
    run it would fuse (its `check` on that run's config; strategies reading prototypes skip plain classifiers, as
    the fuse does). `selected`, `table1`: expanded points."""
    methods = list(dict.fromkeys(str(p.values.get("preset") or p.config.preset) for p in selected))
    if opts.baseline is not None and opts.baseline not in methods:
        raise FlareError(f"--baseline {opts.baseline} is not among the methods these experiments run "
                         f"({', '.join(methods) or 'none'}).", key="--baseline",
                         fix=f"use one of: {', '.join(methods)}, or leave --baseline out (fafi when present).")
    for n in opts.strategies:
        strategy = STRATEGIES.get(n, key="--strategies")
        for p in table1:
            if strategy.needs_prototypes and p.config.head != "prototype":
                continue
            try:
                strategy.check(p.config)
            except FlareError as e:
                raise FlareError(f"server strategy '{n}' cannot fuse Table 1's run '{p.name}': "
                                 f"{e.key + ': ' if e.key else ''}{e.message}", key="--strategies",
                                 fix=f"leave '{n}' out of --strategies" + (f", or set {e.key} for every run "
                                                                           f"(a KEY=VALUE of `flare paper`)"
                                                                           if e.key else "") + ".") from None
