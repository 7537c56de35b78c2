"""`flare sweep`: a base config × presets × a grid (and zips) over any keys × seeds — one run per point.

A sweep file (YAML: `name`, `config`, `base`, `presets`, `seeds`, `grid`, `zip`, `resources`; the format with an
example: docs/experiments.md) names the points. Every point is built as `flare compare` builds a method: preset ←
base ← the point's values, and validated before any run starts; so are the run directories (a directory that holds
a different experiment is an error). A point's directory is named from its values — preset, each grid key, the
first key of each zip group, seed — e.g. `etf-anneal_alpha=0.05_lambda0=5_seed=1`. Finished points are skipped,
unfinished ones resume from their last complete round; `experiments.execute` runs them, one after another or in
parallel through Ray.
"""
from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flare.config import (build_config, config_for_preset, deep_merge, known_keys, list_presets, mapping_keys,
                          parse_overrides, read_yaml_mapping)
from flare.errors import FlareError
from flare.records import set_key
from flare.report.tables import points_table
from flare.experiments.execute import Point, check_data, check_dirs, execute_points, format_throughput, point_status, throughput
from flare.rundir import RunDir, atomic_write_text

class SweepResources(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpus_per_point: float = Field(1.0, gt=0, description="Ray CPUs (and torch threads) per point")
    gpus_per_point: float | None = Field(None, ge=0, description="Ray GPUs per point; null: 1, or a fraction "
                                                                 "when there are fewer GPUs than workers")


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    description: str = ""
    config: str | None = None
    base: dict[str, Any] = Field(default_factory=dict)
    presets: list[str] | None = None
    seeds: list[int] | None = None
    grid: dict[str, Any] | None = None
    zip: dict[str, Any] | list[dict[str, Any]] | None = None
    resources: SweepResources = SweepResources()


# ----------------------------------------------------------------------------------------------
# loading and validation


def unflatten(m: dict) -> dict:
    """{'a.b': 1, 'c': {'d': 2}} -> {'a': {'b': 1}, 'c': {'d': 2}} (dotted keys anywhere at the top)."""
    out: dict = {}
    for k, v in m.items():
        set_key(node := {}, str(k), v)
        out = deep_merge(out, node)
    return out


def _check_swept(key: str, vals: Any, where: str, src: str) -> list:
    """A key of the grid or a zip group must be a config key, and its values a list of at least one."""
    known = set(known_keys()) | {"preset", "seed"}
    if key not in known and not any(key.startswith(m + ".") for m in mapping_keys()):  # plugin options: per point
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise FlareError(f"sweep file '{src}': {where} key '{key}' is not a config key{hint}.", key=f"{where}.{key}",
                         fix="use the dotted keys of `flare config-reference`, e.g. partition.alpha or align.lambda0.")
    if not isinstance(vals, list):
        raise FlareError(f"sweep file '{src}': {where}.{key} must be a list of values, got {vals!r}.",
                         key=f"{where}.{key}", fix=f"write e.g. {key}: [{vals!r}] or list several values.")
    if not vals:
        raise FlareError(f"sweep file '{src}': {where}.{key} is an empty list, so the sweep has no points.",
                         key=f"{where}.{key}", fix="give at least one value, or remove the key.")
    return vals


def load_sweep(path: str | Path) -> tuple[SweepSpec, dict]:
    """Read and validate a sweep file; returns the spec and its base config mapping (file ← base)."""
    path = Path(path)
    return parse_sweep(read_yaml_mapping(path, what="sweep file"), src=str(path), rel_to=path.parent)


def parse_sweep(raw: Any, src: str = "<sweep>", rel_to: Path | None = None) -> tuple[SweepSpec, dict]:
    if not isinstance(raw, dict):
        raise FlareError(f"sweep file '{src}' must hold a mapping (name, base, presets, seeds, grid, zip).",
                         key="--config")
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as err:
        msgs = []
        for e in err.errors():
            loc = ".".join(str(x) for x in e["loc"])
            if e["type"] == "extra_forbidden":
                close = difflib.get_close_matches(loc, list(SweepSpec.model_fields), n=1)
                msgs.append(f"unknown sweep key '{loc}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
            else:
                msgs.append(f"{loc}: {e['msg']}")
        raise FlareError(f"sweep file '{src}': " + "; ".join(msgs) + ".", key="--config",
                         fix="a sweep file has the keys name, description, config, base, presets, seeds, grid, "
                             "zip and resources (docs/experiments.md); config keys go under base or grid.") from None
    base: dict = {}
    if spec.config:
        cpath = Path(rel_to or ".") / spec.config  # an absolute path stays as it is
        if not cpath.is_file():
            raise FlareError(f"sweep file '{src}': config file '{cpath}' does not exist.", key="config",
                             fix="give a path relative to the sweep file, or an absolute one.")
        base = read_yaml_mapping(cpath, what=f"sweep file '{src}': config file", key="config")
    base = deep_merge(base, unflatten(spec.base))
    # the grid/zip/presets/seeds checks that need no config building
    if spec.grid is not None and not spec.grid:
        raise FlareError(f"sweep file '{src}': the grid is empty.", key="grid",
                         fix="list at least one key with its values, e.g. grid: {partition.alpha: [0.05, 0.1]}, "
                             "or remove `grid`.")
    for k, v in (spec.grid or {}).items():
        _check_swept(k, v, "grid", src)
    for i, group in enumerate(_zip_groups(spec)):
        where = "zip" if isinstance(spec.zip, dict) else f"zip[{i}]"
        if not group:
            raise FlareError(f"sweep file '{src}': {where} is empty.", key=where, fix="list keys with values or remove it.")
        lens = {}
        for k, v in group.items():
            lens[k] = len(_check_swept(k, v, where, src))
            if k in (spec.grid or {}):
                raise FlareError(f"sweep file '{src}': key '{k}' is both in the grid and in {where}.", key=k,
                                 fix="sweep it in one place only.")
        if len(set(lens.values())) > 1:
            raise FlareError(f"sweep file '{src}': the lists of {where} have different lengths "
                             f"({', '.join(f'{k}: {n}' for k, n in lens.items())}).", key=where,
                             fix="zip pairs values up by position: give every list the same length.")
    zip_keys = [k for g in _zip_groups(spec) for k in g]
    if len(zip_keys) != len(set(zip_keys)):
        raise FlareError(f"sweep file '{src}': a key appears in two zip groups.", key="zip", fix="list it once.")
    for dim, (listed, key) in {"presets": (spec.presets, "preset"), "seeds": (spec.seeds, "seed")}.items():
        if listed is not None:
            if not listed:
                raise FlareError(f"sweep file '{src}': {dim} is an empty list.", key=dim,
                                 fix=f"give at least one, or remove `{dim}`.")
            if key in (spec.grid or {}) or key in zip_keys:
                raise FlareError(f"sweep file '{src}': {key} is given both as `{dim}` and in grid/zip.", key=dim,
                                 fix="give it in one place only.")
    known = list_presets()
    for p in spec.presets or (spec.grid or {}).get("preset") or []:
        if p not in known:
            close = difflib.get_close_matches(str(p), known, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise FlareError(f"sweep file '{src}': preset '{p}' does not exist.{hint}", key="presets",
                             fix=f"use one of: {', '.join(known)} (`flare presets` lists them).")
    if spec.name is None:
        spec.name = Path(src).stem if src != "<sweep>" else "sweep"
    return spec, base


def _zip_groups(spec: SweepSpec) -> list[dict]:
    return [spec.zip] if isinstance(spec.zip, dict) else list(spec.zip or [])


# ----------------------------------------------------------------------------------------------
# expansion and naming


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        s = str(v).lower()
    elif isinstance(v, float):
        s = format(v, "g")
    elif v is None:
        s = "none"
    elif isinstance(v, (list, tuple)):
        s = "-".join(_fmt(x) for x in v)
    elif isinstance(v, dict):
        s = "-".join(f"{k}{_fmt(x)}" for k, x in v.items())
    else:
        s = str(v)
        if "/" in s or os.sep in s:  # a path: its last component names it
            s = Path(s.rstrip("/")).name or s
    return re.sub(r"[^A-Za-z0-9._+-]", "-", s)


def _short_keys(keys: list[str]) -> dict[str, str]:
    last = [k.split(".")[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def point_name(parts: list[str]) -> str:
    name = "_".join(parts) or "point"
    if len(name) > 120:
        name = name[:100] + "-" + hashlib.sha1(name.encode()).hexdigest()[:10]
    return name


def expand(spec: SweepSpec, base: dict, overrides: dict | None = None) -> list[Point]:
    """Every point of the sweep with its validated Config (raises FlareError naming the point).

    Points come in product order: presets, the grid's keys, the zip groups, seeds — except that a `preset` or
    `seed` given inside `grid` keeps its place in the grid's file order, so a sweep can say which runs come first
    (`grid: {protocol: [...], seed: [...], preset: [...]}` runs seed by seed). Directory names do not depend on
    that order: preset first, seed last."""
    base = deep_merge(base, overrides or {})
    grid = dict(spec.grid or {})
    if spec.presets is not None:
        grid = {"preset": spec.presets, **grid}
    named = [k for k in grid if k not in ("preset", "seed")] + [next(iter(g)) for g in _zip_groups(spec)]
    short = _short_keys(named)
    rank = {k: i + 1 for i, k in enumerate(named)} | {"preset": 0, "seed": len(named) + 1}
    # a dimension: a list of (assignment, (name rank, name part))
    dims: list[list[tuple[dict, tuple[int, str]]]] = []
    for k, vals in grid.items():
        part = {"preset": _fmt, "seed": lambda v: f"seed={_fmt(v)}"}.get(k, lambda v, k=k: f"{short[k]}={_fmt(v)}")
        dims.append([({k: v}, (rank[k], part(v))) for v in vals])
    for g in _zip_groups(spec):
        first = next(iter(g))
        dims.append([({k: g[k][i] for k in g}, (rank[first], f"{short[first]}={_fmt(g[first][i])}"))
                     for i in range(len(g[first]))])
    if "seed" not in grid:  # the seeds' own list (or the base's one seed) varies fastest
        seeds = spec.seeds if spec.seeds is not None else [base.get("seed", 1)]
        dims.append([({"seed": s} if spec.seeds is not None else {}, (rank["seed"], f"seed={_fmt(s)}")) for s in seeds])
    points: list[Point] = []
    for combo in itertools.product(*dims):
        values = {k: v for assign, _ in combo for k, v in assign.items()}
        name = point_name([part for _, (_, part) in sorted(combo, key=lambda c: c[1][0]) if part])
        preset = values.get("preset") or base.get("preset")
        mapping = deep_merge(base, unflatten({k: v for k, v in values.items() if k != "preset"}))
        try:
            cfg = config_for_preset(mapping, preset) if preset else build_config(mapping)
        except FlareError as e:
            raise FlareError(f"sweep '{spec.name}', point '{name}': {e.message}", key=e.key, fix=e.fix) from None
        points.append(Point(name, values, cfg))
    seen: dict[str, Point] = {}
    for p in points:
        if p.name in seen:
            raise FlareError(f"sweep '{spec.name}': two points get the run directory '{p.name}' "
                             f"({seen[p.name].values} and {p.values}).", key="grid",
                             fix="remove the repeated value (or values that differ only in characters a directory "
                                 "name cannot hold).")
        seen[p.name] = p
    return points


def run_sweep(path: str | Path, out: str | Path | None = None, *, overrides: list[str] | None = None,
              workers: int = 1, address: str | None = None, cpus_per_point: float | None = None,
              gpus_per_point: float | None = None, quiet: bool = False, dry_run: bool = False,
              report: bool = True) -> tuple[list[Point], dict[str, dict]]:
    if workers < 1:
        raise FlareError(f"--workers must be at least 1, got {workers}.", key="--workers")
    spec, base = load_sweep(path)
    points = expand(spec, base, parse_overrides(overrides or []))
    out = Path(out) if out else Path("runs") / "sweeps" / _fmt(spec.name or "sweep")
    for p in points:
        p.dir = out / p.name
    check_dirs(points)
    check_data([p.config for p in points])
    cpp = cpus_per_point if cpus_per_point is not None else spec.resources.cpus_per_point
    gpp = gpus_per_point if gpus_per_point is not None else spec.resources.gpus_per_point
    if dry_run:
        for p in points:
            print(f"{point_status(p):>9}  {p.dir}")
        return points, {}
    RunDir(out).create()
    atomic_write_text(out / "sweep.yaml", Path(path).read_text())
    t0 = time.perf_counter()
    results = execute_points(points, workers=workers, address=address, cpus_per_point=cpp, gpus_per_point=gpp,
                             quiet=quiet, desc=f"sweep {spec.name}")
    speed = {**throughput(results, time.perf_counter() - t0), "workers": workers}
    status = {p.name: results.get(p.name, {}).get("status") or point_status(p) for p in points}
    man = {"name": spec.name, "description": spec.description, "overrides": list(overrides or []),
           "points": [{"name": p.name, "dir": str(p.dir), "values": p.values, "status": status[p.name],
                       "error": results.get(p.name, {}).get("error")} for p in points], "throughput": speed}
    atomic_write_text(out / "sweep.json", json.dumps(man, indent=1, default=str))
    table = points_table([(p.name, p.dir, status[p.name], results.get(p.name, {}).get("seconds")) for p in points])
    line = f"{format_throughput(speed)} ({workers} worker{'s' if workers > 1 else ''})"
    atomic_write_text(out / "sweep.md", f"# Sweep {spec.name}\n\n{spec.description}\n\n{table}\n\n{line}\n")
    if not quiet:
        print(f"\n{table}\n\n{line}\n")
    if report and (dirs := [p.dir for p in points if (p.dir / "metrics.jsonl").exists()]):
        from flare.report.report import write_report  # lazy: pyplot (about 0.8 s), only a sweep that reports
        md = write_report(dirs, out / "report", title=f"Sweep {spec.name}")
        if not quiet:
            print(f"report: {md}")
    return points, results
