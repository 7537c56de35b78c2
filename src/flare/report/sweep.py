"""`flare sweep`: a base config × presets × a grid (and zips) over any keys × seeds — one run per point.

A sweep file (YAML):

    name: alpha-lambda0            # run directories go to runs/sweeps/<name> unless --out says otherwise
    config: ../main.yaml           # optional base config file (relative to the sweep file)
    base:                          # optional config mapping over it (nested or dotted keys)
      dataset: {name: fmnist, train_subset: 2000, test_subset: 500}
      rounds: 5
    presets: [fafi, etf-anneal]    # optional (or `preset: [...]` in the grid)
    seeds: [1, 2]                  # optional (or `seed: [...]` in the grid)
    grid:                          # Cartesian product, dotted keys of `flare config-reference`
      partition.alpha: [0.05, 0.1]
      align.lambda0: [1, 5]
    zip:                           # optional: lists of equal length that vary together
      dataset.name: [cifar10, fmnist]    # (a list of such mappings gives several zip groups)
      rounds: [10, 5]
    resources: {cpus_per_point: 1, gpus_per_point: null}   # Ray: per point (null GPUs: auto)

Every point is built as `flare compare` builds a method: preset ← base ← the point's values, and
validated before any run starts; so are the run directories (a directory that holds a different
experiment is an error). A point's directory is named from its values — preset, each grid key, the
first key of each zip group, seed — e.g. `etf-anneal_alpha=0.05_lambda0=5_seed=1`. Finished points are
skipped, unfinished ones resume from their last complete round (see runner.py). With `--workers N > 1`
points run in parallel as Ray tasks (`pip install 'flare-ofl[sweep]'`), each calling the same
`Run(...).execute()`; without Ray they run one after another.
"""
from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import os
import re
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flare.errors import FlareError, TrainingDiverged

POINT_FILE = "sweep_point.json"  # per run directory: start/end wall-clock times, pid, host, outcome


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


@dataclass
class Point:
    name: str
    values: dict[str, Any]          # the swept keys of this point (preset, grid and zip keys, seed)
    config: Any                     # flare.config.Config
    dir: Path | None = None
    aliases: list[tuple[str, str]] = field(default_factory=list)  # (sweep, name) pairs deduplicated into it

    @property
    def mapping(self) -> dict:
        return self.config.model_dump(mode="json")


# ----------------------------------------------------------------------------------------------
# loading and validation


def _unflatten(m: dict) -> dict:
    """{'a.b': 1, 'c': {'d': 2}} -> {'a': {'b': 1}, 'c': {'d': 2}} (dotted keys anywhere at the top)."""
    from flare.config import deep_merge

    out: dict = {}
    for k, v in m.items():
        parts = str(k).split(".")
        node: dict = {}
        cur = node
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = v
        out = deep_merge(out, node)
    return out


def _known_keys() -> set[str]:
    from flare.config import Config, _known_keys as kk

    return set(kk(Config)) | {"preset", "seed"}


def _check_key(key: str, where: str, src: str) -> None:
    known = _known_keys()
    if key in known:
        return
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise FlareError(f"sweep file '{src}': {where} key '{key}' is not a config key{hint}.", key=f"{where}.{key}",
                     fix="use the dotted keys of `flare config-reference`, e.g. partition.alpha or align.lambda0.")


def _check_values(key: str, vals: Any, where: str, src: str) -> list:
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
    if not path.is_file():
        raise FlareError(f"sweep file '{path}' does not exist.", key="--config", fix="give the path of a YAML file.")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise FlareError(f"sweep file '{path}' is not valid YAML: {e}", key="--config") from None
    return parse_sweep(raw, src=str(path), rel_to=path.parent)


def parse_sweep(raw: Any, src: str = "<sweep>", rel_to: Path | None = None) -> tuple[SweepSpec, dict]:
    from flare.config import deep_merge

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
        cpath = Path(spec.config)
        if not cpath.is_absolute() and rel_to is not None:
            cpath = rel_to / cpath
        if not cpath.is_file():
            raise FlareError(f"sweep file '{src}': config file '{cpath}' does not exist.", key="config",
                             fix="give a path relative to the sweep file, or an absolute one.")
        base = yaml.safe_load(cpath.read_text()) or {}
    base = deep_merge(base, _unflatten(spec.base))
    # the grid/zip/presets/seeds checks that need no config building
    if spec.grid is not None and not spec.grid:
        raise FlareError(f"sweep file '{src}': the grid is empty.", key="grid",
                         fix="list at least one key with its values, e.g. grid: {partition.alpha: [0.05, 0.1]}, "
                             "or remove `grid`.")
    for k, v in (spec.grid or {}).items():
        _check_key(k, "grid", src)
        _check_values(k, v, "grid", src)
    for i, group in enumerate(_zip_groups(spec)):
        where = "zip" if isinstance(spec.zip, dict) else f"zip[{i}]"
        if not group:
            raise FlareError(f"sweep file '{src}': {where} is empty.", key=where, fix="list keys with values or remove it.")
        lens = {}
        for k, v in group.items():
            _check_key(k, where, src)
            lens[k] = len(_check_values(k, v, where, src))
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
    presets = spec.presets or (spec.grid or {}).get("preset") or []
    if presets:
        from flare.config import list_presets

        known = list_presets()
        for p in presets:
            if p not in known:
                close = difflib.get_close_matches(str(p), known, n=3)
                hint = f" Did you mean {', '.join(close)}?" if close else ""
                raise FlareError(f"sweep file '{src}': preset '{p}' does not exist.{hint}", key="presets",
                                 fix=f"use one of: {', '.join(known)} (`flare presets` lists them).")
    if spec.name is None:
        spec.name = Path(src).stem if src != "<sweep>" else "sweep"
    return spec, base


def _zip_groups(spec: SweepSpec) -> list[dict]:
    if spec.zip is None:
        return []
    return [spec.zip] if isinstance(spec.zip, dict) else list(spec.zip)


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
    """Every point of the sweep with its validated Config (raises FlareError naming the point)."""
    from flare.config import build_config, deep_merge
    from flare.runner import config_for_preset

    base = deep_merge(base, overrides or {})
    grid = dict(spec.grid or {})
    presets = spec.presets if spec.presets is not None else grid.pop("preset", None)
    seeds = spec.seeds if spec.seeds is not None else grid.pop("seed", None)
    named = list(grid) + [next(iter(g)) for g in _zip_groups(spec)]
    short = _short_keys(named)
    # a dimension: a list of (assignment, name part)
    dims: list[list[tuple[dict, str | None]]] = []
    if presets is not None:
        dims.append([({"preset": p}, _fmt(p)) for p in presets])
    for k, vals in grid.items():
        dims.append([({k: v}, f"{short[k]}={_fmt(v)}") for v in vals])
    for g in _zip_groups(spec):
        first = next(iter(g))
        n = len(g[first])
        dims.append([({k: g[k][i] for k in g}, f"{short[first]}={_fmt(g[first][i])}") for i in range(n)])
    if seeds is not None:
        dims.append([({"seed": s}, f"seed={_fmt(s)}") for s in seeds])
    else:
        dims.append([({}, f"seed={_fmt(base.get('seed', 1))}")])
    points: list[Point] = []
    for combo in itertools.product(*dims):
        values: dict = {}
        parts = []
        for assign, part in combo:
            values.update(assign)
            if part:
                parts.append(part)
        name = point_name(parts)
        preset = values.get("preset") or base.get("preset")
        mapping = deep_merge(base, _unflatten({k: v for k, v in values.items() if k != "preset"}))
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


# ----------------------------------------------------------------------------------------------
# run-directory state


def _same_experiment(d: Path, cfg) -> tuple[bool, list[str]]:
    p = d / "config.yaml"
    if not p.exists():
        return True, []
    old = yaml.safe_load(p.read_text()) or {}
    new = cfg.model_dump(mode="json")
    if old == new:
        return True, []
    return False, sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def point_status(p: Point) -> str:
    """finished | diverged | partial | new"""
    d = p.dir
    st_path = d / "state.json"
    if st_path.exists():
        try:
            st = json.loads(st_path.read_text())
        except json.JSONDecodeError:
            st = {}
        if st.get("status") == "finished":
            return "finished"
    info = read_point_file(d)
    if info.get("status") == "diverged":
        return "diverged"
    return "partial" if (d / "checkpoint.pt").exists() else "new"


def read_point_file(d: Path) -> dict:
    p = Path(d) / POINT_FILE
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        return {}


def check_dirs(points: list[Point]) -> None:
    """Before anything runs: every existing run directory must hold the same experiment."""
    bad = []
    for p in points:
        same, keys = _same_experiment(p.dir, p.config)
        if not same:
            bad.append(f"{p.dir} (keys differ: {', '.join(keys)})")
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise FlareError("run directories hold a different experiment than the sweep asks for: "
                         + "; ".join(bad[:5]) + more + ".", key="--out",
                         fix="choose another --out, or delete those directories to recompute them.")


# ----------------------------------------------------------------------------------------------
# execution


def run_point(config: dict, out_dir: str, threads: int | None = None) -> dict:
    """Run (or resume) one point; records start/end times and the outcome in <dir>/sweep_point.json.
    Called in-process for sequential sweeps and inside a Ray task for parallel ones."""
    from flare.runner import atomic_write_text

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    info: dict = {"start": time.time(), "pid": os.getpid(), "host": socket.gethostname(), "status": "running"}
    atomic_write_text(d / POINT_FILE, json.dumps(info, indent=1))
    import torch

    from flare.config import build_config
    from flare.runner import Run

    if threads:
        torch.set_num_threads(max(1, int(threads)))
    info["threads"] = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        summary = Run(build_config(config), d, quiet=True).execute()
        info.update(status="finished", summary=summary)
    except TrainingDiverged as e:
        info.update(status="diverged", error=e.render())
    except FlareError as e:
        info.update(status="error", error=e.render(), key=e.key, fix=e.fix, message=e.message)
    except Exception:  # noqa: BLE001 — one broken point must not take the other points down
        info.update(status="failed", error=traceback.format_exc())
    info["end"] = time.time()
    info["seconds"] = time.perf_counter() - t0
    atomic_write_text(d / POINT_FILE, json.dumps(info, indent=1, default=str))
    return info


def _bar(total: int, initial: int, quiet: bool, desc: str):
    from tqdm.auto import tqdm

    from flare.progress import quiet_env

    return tqdm(total=total, initial=initial, desc=desc, unit="point", disable=quiet or quiet_env(),
                file=sys.stderr, dynamic_ncols=True)


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def execute_points(points: list[Point], *, workers: int = 1, address: str | None = None,
                   cpus_per_point: float = 1.0, gpus_per_point: float | None = None, quiet: bool = False,
                   desc: str = "sweep", log: Callable[[str], None] | None = None) -> dict[str, dict]:
    """Run every unfinished point; returns name -> outcome ({'status': ..., ...}). Raises FlareError for a
    user mistake that a point reports at run time (e.g. a missing dataset), after stopping the others."""
    log = log or (lambda m: None if quiet else print(m, flush=True))
    results: dict[str, dict] = {}
    todo = []
    for p in points:
        st = point_status(p)
        if st == "finished":
            results[p.name] = {"status": "skipped", **{k: v for k, v in read_point_file(p.dir).items()
                                                       if k in ("start", "end", "seconds")}}
        elif st == "diverged":
            results[p.name] = {"status": "diverged", "error": read_point_file(p.dir).get("error", "")}
        else:
            todo.append((p, st))
    n_skip = len(points) - len(todo)
    n_resume = sum(1 for _, st in todo if st == "partial")
    log(f"{desc}: {len(points)} points — {n_skip} done earlier (skipped), {n_resume} to resume, "
        f"{len(todo) - n_resume} to run" + (f", {workers} workers" if workers > 1 else ""))
    if not todo:
        return results
    threads = max(1, int(cpus_per_point)) if (workers > 1 or address) else None
    ran = None
    if workers > 1 or address:
        ran = _execute_ray([p for p, _ in todo], workers, address, cpus_per_point, gpus_per_point, threads,
                           quiet, desc, n_skip, len(points), log)
    if ran is None:
        ran = {}
        with _bar(len(points), n_skip, quiet, desc) as bar:
            for p, _ in todo:
                bar.set_postfix_str(p.name)
                info = run_point(p.mapping, str(p.dir), threads)
                ran[p.name] = info
                bar.update(1)
                if info["status"] == "error":
                    break
    results.update(ran)
    errors = [(n, r) for n, r in ran.items() if r.get("status") == "error"]
    if errors:
        n, r = errors[0]
        raise FlareError(f"sweep point '{n}' stopped: {r.get('message', r.get('error'))}", key=r.get("key"),
                         fix=r.get("fix"))
    return results


def _execute_ray(points: list[Point], workers: int, address: str | None, cpus_per_point: float,
                 gpus_per_point: float | None, threads: int | None, quiet: bool, desc: str, n_skip: int,
                 total: int, log) -> dict[str, dict] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import ray
    except ImportError:
        log("flare: Ray is not installed, so the points run one after another in this process. "
            "For parallel points: pip install 'flare-ofl[sweep]' (or pip install ray).")
        return None
    started = False
    if not ray.is_initialized():
        kw = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR", ignore_reinit_error=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if address:
                ray.init(address=address, **kw)
            else:
                ray.init(num_cpus=max(1, math.ceil(workers * cpus_per_point)), num_gpus=_gpu_count(), **kw)
        started = True
    try:
        total_gpus = float(ray.cluster_resources().get("GPU", 0))
        if gpus_per_point is None:
            gpus_per_point = min(1.0, total_gpus / workers) if total_gpus else 0.0
        if gpus_per_point and gpus_per_point > 1:
            gpus_per_point = float(int(gpus_per_point))  # Ray: fractions only below 1
        log(f"{desc}: Ray {'cluster at ' + address if address else 'on this machine'} — "
            f"{ray.cluster_resources().get('CPU', 0):g} CPUs, {total_gpus:g} GPUs; per point "
            f"{cpus_per_point:g} CPU, {gpus_per_point:g} GPU")
        task = ray.remote(num_cpus=cpus_per_point, num_gpus=gpus_per_point, max_retries=0)(run_point)
        queue = list(points)
        inflight: dict = {}
        out: dict[str, dict] = {}
        stop = False
        with _bar(total, n_skip, quiet, desc) as bar:
            while queue or inflight:
                while queue and not stop and len(inflight) < workers:
                    p = queue.pop(0)
                    inflight[task.remote(p.mapping, str(p.dir.resolve()), threads)] = p
                if not inflight:
                    break
                done, _ = ray.wait(list(inflight), num_returns=1)
                for ref in done:
                    p = inflight.pop(ref)
                    try:
                        info = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 — the worker died (OOM, node lost, ...)
                        info = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
                    out[p.name] = info
                    bar.set_postfix_str(p.name)
                    bar.update(1)
                    if info.get("status") == "error":
                        stop = True
        return out
    finally:
        if started:
            ray.shutdown()


# ----------------------------------------------------------------------------------------------
# the command


def default_out(spec: SweepSpec) -> Path:
    return Path("runs") / "sweeps" / _fmt(spec.name or "sweep")


def manifest(spec: SweepSpec, points: list[Point], results: dict[str, dict], overrides: list[str] | None = None) -> dict:
    return {"name": spec.name, "description": spec.description, "overrides": list(overrides or []),
            "points": [{"name": p.name, "dir": str(p.dir), "values": p.values,
                        "status": results.get(p.name, {}).get("status", point_status(p)),
                        "error": results.get(p.name, {}).get("error")} for p in points]}


def results_table(points: list[Point], results: dict[str, dict]) -> str:
    from flare.report.run_report import load_run

    rows = ["| point | status | final acc | peak acc (round) | seconds |", "| --- | --- | --- | --- | --- |"]
    for p in points:
        r = results.get(p.name, {})
        run = load_run(p.dir) if (p.dir / "metrics.jsonl").exists() else {"rounds": []}
        rounds = run["rounds"]
        acc = peak = "—"
        if rounds:
            accs = [x.get("acc") for x in rounds]
            accs = [a if isinstance(a, (int, float)) else float("nan") for a in accs]
            acc = f"{100 * accs[-1]:.2f}"
            b = max(range(len(accs)), key=lambda i: -1 if math.isnan(accs[i]) else accs[i])
            peak = f"{100 * accs[b]:.2f} ({rounds[b]['round']})"
        secs = r.get("seconds")
        rows.append(f"| {p.name} | {r.get('status', point_status(p))} | {acc} | {peak} | "
                    f"{'—' if secs is None else f'{secs:.1f}'} |")
    return "\n".join(rows)


def run_sweep(path: str | Path, out: str | Path | None = None, *, overrides: list[str] | None = None,
              workers: int = 1, address: str | None = None, cpus_per_point: float | None = None,
              gpus_per_point: float | None = None, quiet: bool = False, dry_run: bool = False,
              report: bool = True) -> tuple[list[Point], dict[str, dict]]:
    from flare.config import parse_overrides
    from flare.runner import atomic_write_text

    if workers < 1:
        raise FlareError(f"--workers must be at least 1, got {workers}.", key="--workers")
    spec, base = load_sweep(path)
    points = expand(spec, base, parse_overrides(overrides or []))
    out = Path(out) if out else default_out(spec)
    for p in points:
        p.dir = out / p.name
    check_dirs(points)
    cpp = cpus_per_point if cpus_per_point is not None else spec.resources.cpus_per_point
    gpp = gpus_per_point if gpus_per_point is not None else spec.resources.gpus_per_point
    if dry_run:
        for p in points:
            print(f"{point_status(p):>9}  {p.dir}")
        return points, {}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "sweep.yaml", Path(path).read_text())
    results = execute_points(points, workers=workers, address=address, cpus_per_point=cpp, gpus_per_point=gpp,
                             quiet=quiet, desc=f"sweep {spec.name}")
    atomic_write_text(out / "sweep.json", json.dumps(manifest(spec, points, results, overrides), indent=1,
                                                           default=str))
    table = results_table(points, results)
    atomic_write_text(out / "sweep.md", f"# Sweep {spec.name}\n\n{spec.description}\n\n{table}\n")
    if not quiet:
        print(f"\n{table}\n")
    if report:
        from flare.report.report import write_report

        dirs = [p.dir for p in points if (p.dir / "metrics.jsonl").exists()]
        if dirs:
            md = write_report(dirs, out / "report", title=f"Sweep {spec.name}")
            if not quiet:
                print(f"report: {md}")
    return points, results
