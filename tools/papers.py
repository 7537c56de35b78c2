"""Other papers' tables at their own settings (docs/papers.md): run the cells, keep their records, render the
comparison with the published numbers.

    python tools/papers.py run configs/papers/fedlpa-fmnist.yaml [--commit] [--runs runs/papers] [--dry-run]
                                                                 [--set KEY=VALUE ...]
    python tools/papers.py progress configs/papers/T.yaml [--commit]   # how far unfinished fusions got, recorded
    python tools/papers.py progress configs/papers/T.yaml --stopped "WHY" [--commit]   # their state is gone
    python tools/papers.py render                    # rewrite docs/papers.md's "Against the published numbers"
    python tools/papers.py render --check            # exit 1 if the committed block differs from the records

A table file (configs/papers/*.yaml) names the base config, the methods (a preset, overrides and the server
strategies scored afterwards with `flare fuse`), the α and seed grid, the columns and the paper's printed numbers.
A cell is one method at one (α, seed): one `flare run` into runs/papers/<table>/<cell> — rerunning resumes an
unfinished one, a finished one is not recomputed — then `flare fuse` for its strategies (already fused ones are
skipped; an interrupted data-free fuse goes on from its last finished epoch). Cells run one at a time. A finished cell's records (config, partition, metrics, fuse records, state,
summary; never a checkpoint) are copied to results/papers/<table>/<cell>/ with the table's spec beside them, and
`--commit` commits that directory alone. `render` reads results/papers/ only.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flare.config.load import experiment_differences, load_config, parse_overrides  # noqa: E402
from flare.stats import mean_ci  # noqa: E402

RESULTS = ROOT / "results" / "papers"
DOC = ROOT / "docs" / "papers.md"
RECORDS = ("config.yaml", "partition.json", "metrics.jsonl", "fuse.jsonl", "state.json", "summary.md")
PROGRESS = "fuse-progress.json"  # how far an unfinished data-free fusion has got (`progress`): curve, no weights
BEGIN, END = "<!-- BEGIN published -->", "<!-- END published -->"


# ------------------------------------------------------------------------------------------------ the cells
class TableError(ValueError):
    """A table file that cannot describe a table: `run` stops before it writes anything (exit 2)."""


def load_table(path: str | Path) -> dict:
    """A table file; `extends: OTHER.yaml` (beside it) starts from that table and changes a few keys — a variant of
    a table (a diagnostic at one setting changed) is the few keys it changes, never a copy. `base` and `methods`
    merge key by key (a cell's config); every other key (`columns`, `alphas`, `published`, ...) replaces. A method
    given as null is not run (a diagnostic of one method need not train the parent's others again)."""
    try:
        spec = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        why = " ".join(str(e).split())  # YAML's message spans lines with a caret drawing: one line here
        raise TableError(f"{path}: cannot read the table file ({type(e).__name__}: {why})") from None
    if not isinstance(spec, dict):
        raise TableError(f"{path}: a table file is a mapping of keys (table, alphas, seeds, base, methods, columns)")
    if "extends" in spec:
        parent = load_table(Path(path).parent / spec.pop("extends"))
        spec = {**parent, **spec, **{k: _merge(parent.get(k, {}), spec[k]) for k in ("base", "methods") if k in spec}}
        spec["methods"] = {m: v for m, v in spec.get("methods", {}).items() if v is not None}
    for k in ("table", "alphas", "seeds", "base", "methods", "columns"):
        if k not in spec:
            raise TableError(f"{path} lacks '{k}'")
    if isinstance(spec["seeds"], dict) and sorted(map(float, spec["seeds"])) != sorted(map(float, spec["alphas"])):
        raise TableError(f"{path}: 'seeds' given per α must name every α of 'alphas' and no other "
                         f"(alphas {spec['alphas']}, seeds for {list(spec['seeds'])})")
    return spec


def seeds_for(spec: dict, alpha: float) -> list[int]:
    """The table's seeds at α: one list for every α, or a mapping α → list where one α needs more draws than the
    others (a diagnostic that must reach a test's power at one α only need not pay for it at every α)."""
    seeds = spec["seeds"]
    if isinstance(seeds, dict):
        return next((list(v) for k, v in seeds.items() if float(k) == float(alpha)), [])
    return list(seeds)


def cell_name(method: str, alpha: float, seed: int) -> str:
    return f"{method}-a{alpha:g}-s{seed}"


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in (b or {}).items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def cells(spec: dict) -> list[dict]:
    """Every (method, α, seed) of the table with its flare config (the base, the method's preset and overrides,
    α and seed), in the order they run: seeds outermost, so a partial table already pairs its methods by seed."""
    out = []
    for seed in sorted({sd for a in spec["alphas"] for sd in seeds_for(spec, a)}):
        for alpha in (a for a in spec["alphas"] if seed in seeds_for(spec, a)):
            for method, m in spec["methods"].items():
                cfg = _merge(spec["base"], m.get("config", {}))
                cfg = _merge(cfg, {"preset": m["preset"], "seed": seed, "partition": {"alpha": alpha}})
                out.append({"name": cell_name(method, alpha, seed), "method": method, "alpha": alpha, "seed": seed,
                            "config": cfg, "fuse": list(m.get("fuse", [])),
                            "fuse_options": {k: dict(v) for k, v in (m.get("fuse_options") or {}).items()}})
    return out


def finished(run_dir: Path) -> bool:
    state = run_dir / "state.json"
    if not state.is_file():
        return False
    try:
        return json.loads(state.read_text()).get("status") == "finished"
    except ValueError:
        return False


def stale(rec: Path, cell: dict, overrides: list[str]) -> list[str]:
    """The keys in which a recorded cell's config and the table's cell (with `overrides`) are different experiments:
    a table file edited after a cell was recorded. Such a cell is never skipped as done nor silently replaced."""
    if not (rec / "config.yaml").is_file():
        return []
    new = load_config(overrides=_merge(cell["config"], parse_overrides(list(overrides))))
    return experiment_differences(yaml.safe_load((rec / "config.yaml").read_text()), new)


def _key(strategy: str, options: dict) -> str:
    return strategy + json.dumps(options or {}, sort_keys=True)


def fused(run_dir: Path) -> set[str]:
    """The (strategy, options) pairs fused in a run or records directory, as `_key` strings."""
    f = run_dir / "fuse.jsonl"
    if not f.is_file():
        return set()
    out = set()
    for line in f.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("kind") == "fuse":
            out.add(_key(r.get("strategy"), r.get("options")))
    return out


def fuse_args(cell: dict, strategy: str) -> list[str]:
    """`flare fuse`'s overrides for one strategy of a cell: the table's server options given at fuse time (a
    shortened data-free budget, its curve) — they change what the server builds, never the clients."""
    return [f"server.strategies.{strategy}.{k}={v}" for k, v in cell["fuse_options"].get(strategy, {}).items()]


def copy_records(spec: dict, cell: dict, run_dir: Path, dest: Path, shown: dict | None = None) -> Path:
    """The cell's records (never a checkpoint) and what the cell is, under dest/<cell>/; the table's description
    (columns, the paper's numbers, notes) from `shown`, the table file as it reads now, when given."""
    d = dest / spec["table"] / cell["name"]
    d.mkdir(parents=True, exist_ok=True)
    for name in RECORDS:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, d / name)
    meta = {k: cell[k] for k in ("method", "alpha", "seed", "fuse", "fuse_options")}
    meta["table"] = spec["table"]
    (d / "cell.json").write_text(json.dumps(meta, indent=1) + "\n")
    _drop_finished_progress(d)
    describe(spec, dest, shown)
    return d


def _drop_finished_progress(d: Path) -> None:
    """A fusion's progress note goes once its fuse record is in: the record is the result, the note was its way."""
    f = d / PROGRESS
    if not f.is_file():
        return
    left = {s: e for s, e in json.loads(f.read_text()).items() if not fuse_records(d, s)}
    if left:
        f.write_text(json.dumps(left, indent=1) + "\n")
    else:
        f.unlink()


def progress(spec: dict, runs: Path, dest: Path = RESULTS) -> tuple[list[Path], list[str]]:
    """Record how far each recorded cell's unfinished data-free fusion has got: its curve so far, epochs done and
    wall seconds, read from the build's state in the cell's run directory (`fuse-scratch/<strategy>/`), into
    dest/<table>/<cell>/fuse-progress.json. A fusion at the published budget spans sittings, and its state (weights
    included) is never committed, so without this a session that ends mid-fusion leaves no trace of where the
    student was heading. The note is no result: the block prints it apart from the columns, and the fuse record
    supersedes it. A cell whose strategy folder holds more than one state (a build at other options interrupted
    too) is named and skipped: which one is the table's cannot be told from the files. Returns the files written
    and the skipped cells' reasons."""
    import torch  # only here: rendering and running never need it

    written, skipped = [], []
    for cell in cells(spec):
        rec = dest / spec["table"] / cell["name"]
        if not (rec / "cell.json").is_file():
            continue
        notes, have = {}, fused(rec)  # the cell's fuse file read once
        for s in cell["fuse"]:
            if _key(s, cell["fuse_options"].get(s)) in have:
                continue
            states = sorted((runs / spec["table"] / cell["name"] / "fuse-scratch" / s).glob("*.pt"))
            if len(states) > 1:
                skipped.append(f"{cell['name']}: {len(states)} {s} build states ({', '.join(p.name for p in states)});"
                               " remove the ones not at the table's options")
                continue
            if not states:
                continue
            st = torch.load(states[0], map_location="cpu", weights_only=True)
            notes[s] = {"options": cell["fuse_options"].get(s) or {}, "epoch": int(st["epoch"]),
                        "curve": st["curve"], "seconds": round(float(st["seconds"]), 1),
                        "as_of": time.strftime("%Y-%m-%d %H:%M", time.gmtime(states[0].stat().st_mtime)) + " UTC"}
        if notes:
            (rec / PROGRESS).write_text(json.dumps(notes, indent=1) + "\n")
            written.append(rec / PROGRESS)
    return written, skipped


def stop(spec: dict, runs: Path, why: str, dest: Path = RESULTS, on: str | None = None) -> tuple[list[Path], list[str]]:
    """Mark each recorded unfinished fusion of the table as stopped, with `why` and the date: its state (weights
    included, never committed) is gone — the machine that held it was replaced — so it cannot go on, and the block
    must no longer price it as "≈ N h more". A fusion whose state is still on disk under `runs` is refused (named in
    the second list): it can go on, and marking it stopped would throw that away. Returns the notes written and the
    refusals; nothing is written when anything is refused."""
    on = on or time.strftime("%Y-%m-%d", time.gmtime())
    todo, refused = [], []
    for cell in cells(spec):
        rec = dest / spec["table"] / cell["name"]
        open_ = [s for s, e in in_progress(rec).items() if "stopped" not in e]
        for s in open_:
            states = sorted((runs / spec["table"] / cell["name"] / "fuse-scratch" / s).glob("*.pt"))
            if states:
                refused.append(f"{cell['name']}: its {s} build state is on disk ({states[0]}), so the fusion can go "
                               f"on (run --fuse-only), not stop")
        if open_:
            notes = json.loads((rec / PROGRESS).read_text())
            todo.append((rec, {s: {**e, "stopped": {"why": why, "on": on}} if s in open_ else e
                               for s, e in notes.items()}))
    if refused:
        return [], refused
    for rec, notes in todo:
        (rec / PROGRESS).write_text(json.dumps(notes, indent=1) + "\n")
    return [rec / PROGRESS for rec, _ in todo], []


def describe(spec: dict, dest: Path, shown: dict | None = None) -> Path:
    """dest/<table>/table.yaml: what the block shows of the table (columns, the paper's numbers and their source,
    notes), from `shown` when given. The renderer reads this, never the table file, so the block is the records'."""
    shown = {**(shown or spec), "table": spec["table"]}
    path = dest / spec["table"] / "table.yaml"
    path.write_text(yaml.safe_dump(
        {k: shown[k] for k in ("table", "paper", "note", "spread", "alphas", "seeds", "columns", "published",
                               "published_source", "paired_with")
         if k in shown},
        sort_keys=False))
    return path


def _log(log: Path, msg: str) -> None:
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}"
    print(line, flush=True)
    with log.open("a") as f:
        f.write(line + "\n")


def _flare(*args: str) -> list[str]:
    return [sys.executable, "-m", "flare.cli", *args]


def _git_commit(paths: list[str], message: str, attempts: int = 20) -> None:
    """Commit these paths alone. A session may be committing in the same checkout while a table runs for hours:
    git's index lock is then held for a moment, so a refused commit is retried rather than ending the table."""
    for k in range(attempts):
        add = subprocess.call(["git", "add", "--", *paths], cwd=ROOT)
        if add == 0 and subprocess.call(["git", "commit", "-q", "-m", message, "--", *paths], cwd=ROOT) == 0:
            return
        time.sleep(min(60, 2 ** k))
    raise SystemExit(f"papers: could not commit {paths} after {attempts} attempts")


def run(spec: dict, runs: Path, *, commit: bool, dry_run: bool, overrides: list[str], dest: Path = RESULTS,
        defer: tuple[str, ...] = (), fuse_only: bool = False, only: tuple[str, ...] = (),
        table_path: str | Path | None = None) -> int:
    """Run every cell not yet recorded. `defer` names server strategies left for a later pass (the data-free
    servers cost hours per cell): the cell is recorded without them, and a pass without `defer` fuses them over
    the kept run directory and records the cell again. `fuse_only`: train nothing — only fuse the cells whose
    clients have finished (a second process beside the one training). `only` names the cells this process takes,
    so that two processes can train two cells of one table at once without both resuming the same one.
    `table_path`: the table file, read again as each cell is recorded — a table runs for days, and a correction to
    what it shows (the paper's numbers, a note) made meanwhile must not be undone by a process started before it."""
    table_runs = runs / spec["table"]
    table_runs.mkdir(parents=True, exist_ok=True)
    log = table_runs / "progress.log"
    todo = cells(spec)
    for i, cell in enumerate(todo, 1):
        if only and cell["name"] not in only:
            continue
        run_dir = table_runs / cell["name"]
        rec = dest / spec["table"] / cell["name"]
        todo_fuse = [f for f in cell["fuse"] if f not in defer]
        recorded, have = (rec / "cell.json").is_file(), fused(rec)
        missing = [f for f in todo_fuse if _key(f, cell["fuse_options"].get(f)) not in have]
        done = recorded and not missing
        status = "recorded" if done else ("finished" if finished(run_dir) else
                                          "partial" if run_dir.exists() else "new")
        if recorded and missing:  # recorded without a strategy the table now fuses
            status = (f"recorded without {', '.join(missing)}; its clients "
                      + ("are on disk" if finished(run_dir) else
                         "are not on disk (checkpoints are never committed): "
                         + ("skipped by --fuse-only" if fuse_only else "training them again")))
        changed = stale(rec, cell, overrides)
        if changed:
            msg = (f"[{i}/{len(todo)}] {cell['name']}: recorded at another setting (keys differ: "
                   f"{', '.join(changed)}); move {rec.relative_to(ROOT) if rec.is_relative_to(ROOT) else rec} and {run_dir} aside (or "
                   "restore the table file) to run it at this one")
            if dry_run:
                print(msg)
                continue
            _log(log, msg)
            return 2
        if dry_run:
            print(f"[{i}/{len(todo)}] {cell['name']}: {status}")
            continue
        if done:
            _log(log, f"[{i}/{len(todo)}] {cell['name']}: recorded, skipped")
            continue
        if fuse_only and not recorded:  # the training process records, then fuses it
            continue
        if fuse_only and not finished(run_dir):  # recorded on a machine that is gone: nothing here to fuse over
            _log(log, f"[{i}/{len(todo)}] {cell['name']}: {status.split(';')[0]}, but its clients are not on disk; "
                      "skipped (a pass without --fuse-only trains them again from the same seed)")
            continue
        cfg_path = table_runs / f"{cell['name']}.yaml"
        cfg_path.write_text(yaml.safe_dump(cell["config"], sort_keys=False))
        t0 = time.time()
        if not fuse_only:
            _log(log, f"[{i}/{len(todo)}] {cell['name']}: {status}, training")
            rc = subprocess.call(_flare("run", "--config", str(cfg_path), "--out", str(run_dir), *overrides), cwd=ROOT)
            if rc != 0:
                _log(log, f"[{i}/{len(todo)}] {cell['name']}: flare run exited {rc}; stopping")
                return rc
        for s in todo_fuse:
            if _key(s, cell["fuse_options"].get(s)) in fused(run_dir):
                continue
            _log(log, f"[{i}/{len(todo)}] {cell['name']}: fusing {s} {' '.join(fuse_args(cell, s))}")
            rc = subprocess.call(_flare("fuse", str(run_dir), "--strategies", s, *fuse_args(cell, s)), cwd=ROOT)
            if rc != 0:
                _log(log, f"[{i}/{len(todo)}] {cell['name']}: flare fuse {s} exited {rc}; stopping")
                return rc
        shown = None
        if table_path is not None:
            try:
                shown = load_table(table_path)
            except TableError as e:  # the records still land; the description stays as this process read it
                _log(log, f"[{i}/{len(todo)}] {cell['name']}: {e}; recording the table as it read at the start")
        d = copy_records(spec, cell, run_dir, dest, shown)
        _log(log, f"[{i}/{len(todo)}] {cell['name']}: done in {time.time() - t0:.0f} s → {d.relative_to(ROOT)}"
             if d.is_relative_to(ROOT) else f"[{i}/{len(todo)}] {cell['name']}: done → {d}")
        if commit:  # the records and the docs block rendered from them, in one commit: never a stale block.
            # Rendered by a fresh process: a table runs for days, and the block must be what the checked-out
            # renderer makes of the records, not what the renderer was when this process started.
            subprocess.check_call([sys.executable, str(Path(__file__).resolve()), "render", "--results", str(dest)],
                                  cwd=ROOT)
            _git_commit([str(d), str(d.parent / "table.yaml"), str(DOC), str(DOC.parent / "img")],
                        f"papers: {spec['table']} {cell['name']} records")
    return 0


# ------------------------------------------------------------------------------------------------ the block
def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def fuse_records(cell_dir: Path, strategy: str) -> list[dict]:
    """A cell's fuse records of one strategy, oldest first, with the cell's budget options only: the last is the
    one the table reports."""
    meta = json.loads((cell_dir / "cell.json").read_text()) if (cell_dir / "cell.json").is_file() else {}
    want = (meta.get("fuse_options") or {}).get(strategy, {})
    return [r for r in _jsonl(cell_dir / "fuse.jsonl") if r.get("kind") == "fuse" and r.get("strategy") == strategy
            and (r.get("options") or {}) == want]


def cell_value(cell_dir: Path, key: str, rule: str) -> float:
    """The accuracy (percent) of one column in one cell: `key` a round record's key (acc_fedavg, acc_output, acc)
    or `fuse:<strategy>`; `rule` final (the last round's / the fused model) or peak (the best evaluated round —
    a selection on the test set)."""
    if key.startswith("fuse:"):
        recs = fuse_records(cell_dir, key[5:])
        if not recs:
            return float("nan")
        best = recs[-1].get(f"{key[5:]}.best_epoch_acc")  # a data-free server's best epoch on the test curve
        return 100 * float(best if rule == "peak" and best is not None else recs[-1]["acc"])
    curve = [r.get(key) for r in _jsonl(cell_dir / "metrics.jsonl") if r.get("kind") == "round"]
    curve = [float(v) for v in curve if isinstance(v, (int, float))]
    if not curve:
        return float("nan")
    return 100 * (max(curve) if rule == "peak" else curve[-1])


def summarise(values: list[float]) -> tuple[float, float, float, int]:
    """mean, std (n − 1), half-width of the 95 % t interval, n — over the finite values."""
    return mean_ci(values)


def _ms(m: float, sd: float, n: int) -> str:
    if n == 0:
        return "—"
    return f"{m:.2f}" if n == 1 else f"{m:.2f} ± {sd:.2f}"


def render(results: Path = RESULTS, img_dir: Path | None = None) -> str:
    """The markdown block: per table, column and α, ours (final / the paper's rule) beside the printed number; the
    data-free servers' budgets and budget curves (figures drawn into `img_dir`; None: only named); FAFI and FLARE
    paired by seed with the baselines of the table they share a setting with."""
    lines = []
    tables = sorted(p for p in results.iterdir() if (p / "table.yaml").is_file()) if results.is_dir() else []
    if not tables:
        return "No cell has finished yet: the tables appear here as results/papers/ fills.\n"
    for tdir in tables:
        spec = yaml.safe_load((tdir / "table.yaml").read_text())
        metas = [(d, json.loads((d / "cell.json").read_text())) for d in sorted(tdir.iterdir())
                 if (d / "cell.json").is_file()]
        lines += [f"### {spec['table']} — {spec.get('paper', '')}", ""]
        if spec.get("note"):
            lines += [f"*{spec['note'].strip()}*", ""]
        lines += ["| column | α | seeds | ours: final | ours: paper's rule | paper | ours − paper | paper in our 95 % CI |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for col, c in spec["columns"].items():
            for alpha in spec["alphas"]:
                dirs = sorted(((m["seed"], d) for d, m in metas if m["method"] == c["method"]
                               and float(m["alpha"]) == float(alpha)), key=lambda t: t[0])
                final = [cell_value(d, c["key"], "final") for _, d in dirs]
                rule = [cell_value(d, c["key"], c.get("paper_rule", "final")) for _, d in dirs]
                mf, sf, hf, n = summarise(final)
                mr, sr, hr, nr = summarise(rule)
                seeds = ",".join(str(s) for s, d in dirs if math.isfinite(cell_value(d, c["key"], "final")))
                pub = published(spec, col, alpha)
                rule_txt = f"{_ms(mr, sr, nr)} ({c.get('paper_rule', 'final')})"
                if pub is None or n == 0:
                    diff, inci = "—", "—"
                else:
                    diff = f"{mf - pub:+.2f}"
                    inci = "—" if not math.isfinite(hf) else ("yes" if abs(mf - pub) <= hf else "no")
                lines.append(f"| {col} | {alpha:g} | {seeds or '—'} | {_ms(mf, sf, n)} | {rule_txt} | "
                             f"{published_text(spec, col, alpha)} | {diff} | {inci} |")
        if spec.get("published_source"):  # where the paper column's numbers were read, and how sure that is
            lines += ["", f"The paper's numbers: {' '.join(spec['published_source'].split())}"]
        lines += spread_lines(spec, metas)
        lines += budget_notes(spec, metas)
        lines += progress_lines(spec, metas)
        lines += other_servers(spec, metas)
        cost = cost_lines(spec, metas)
        lines += ([""] if cost and lines[-1] else []) + cost
        lines += paired_rows(spec, metas, results)
        fig = spread_figure(spec, metas, img_dir)
        if fig is not None:
            lines += [f"![{spec['table']}: every draw beside the paper's single run](img/{fig.name})", ""]
        fig = curve_figure(spec, metas, img_dir)
        if fig is not None:
            lines += [f"![{spec['table']}: test accuracy against the data-free server's generator steps]"
                      f"(img/{fig.name})", ""]
        lines.append("")
    lines.append("final: the last round's model (or the fused model); peak: the best evaluated round (a data-free "
                 "server: its best epoch on the test curve), a selection on the test set. The difference and the CI "
                 "use the final column. Paper: not found — the paper prints this cell but no stored source gave its "
                 "number; not in the paper — a column the paper does not have (an extra column, or a method it "
                 "does not run).")
    return "\n".join(lines) + "\n"


def _cell_config(d: Path) -> dict:
    return yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").is_file() else {}


def published(spec: dict, col: str, alpha: float) -> float | None:
    """The paper's printed number for a column at α (YAML may key α as a number or a string), or None."""
    by_alpha = (spec.get("published") or {}).get(col) or {}
    pub = by_alpha.get(alpha, by_alpha.get(str(alpha)))
    return None if pub is None else float(pub)


def published_text(spec: dict, col: str, alpha: float) -> str:
    """The paper column's text. A column the table's `published` does not list is one the paper has no such column
    for (an extra column, or a method the paper does not run); a listed column whose value is null is one the
    paper prints but no stored source gave us. The reader must be able to tell the two apart."""
    pub = published(spec, col, alpha)
    if pub is not None:
        return f"{pub:.2f}"
    return "not found" if col in (spec.get("published") or {}) else "not in the paper"


def draws(spec: dict, metas: list[tuple[Path, dict]]) -> list[tuple[str, float, list[tuple[int, float]]]]:
    """`spread: true`: per column and α that has values, every seed's final value in seed order."""
    if not spec.get("spread"):
        return []
    out = []
    for col, c in spec["columns"].items():
        for alpha in spec["alphas"]:
            vals = sorted(((m["seed"], cell_value(d, c["key"], "final")) for d, m in metas
                           if m["method"] == c["method"] and float(m["alpha"]) == float(alpha)), key=lambda t: t[0])
            vals = [(sd, v) for sd, v in vals if math.isfinite(v)]
            if vals:
                out.append((col, alpha, vals))
    return out


def rank_p(values: list[float], pub: float) -> tuple[str, int, float]:
    """Were the paper's run one more draw of our setting (exchangeable with our draws), the chance that it lies at
    least as far out on its side of our draws as it does: (our draws at or beyond it + 1) / (our draws + 1). A rank
    test: it assumes nothing of the draws' distribution (they are skewed, so a normal interval would mislead), and
    with every draw on one side it is 1 / (n + 1) — so n draws can reject "one lucky draw" at 0.05 only when
    n ≥ 19. Returns the side ('above' or 'below' the median of our draws), the draws at or beyond it, and p."""
    side = "above" if pub >= float(np.median(values)) else "below"
    beyond = sum(1 for v in values if (v >= pub if side == "above" else v <= pub))
    return side, beyond, (beyond + 1) / (len(values) + 1)


def spread_lines(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """Every draw's value and their range beside the paper's number. A paper that prints one run is one draw: the
    question is whether it lies among our draws, not whether it lies in our mean's interval — answered by the range
    and by `rank_p`."""
    out = []
    for col, alpha, vals in draws(spec, metas):
        lo, hi = min(v for _, v in vals), max(v for _, v in vals)
        pub = published(spec, col, alpha)
        where = ("" if pub is None else f"; the paper's {pub:.2f} lies {'inside' if lo <= pub <= hi else 'outside'} it")
        if pub is not None:
            side, beyond, p = rank_p([v for _, v in vals], pub)
            where += (f"; were it one more draw of this setting, one at least this {'high' if side == 'above' else 'low'}"
                      f" has rank probability ({beyond} + 1)/({len(vals)} + 1) = {p:.3f} (one-sided)")
        out += [f"{col}, α = {alpha:g}, by seed: " + ", ".join(f"{sd}: {v:.2f}" for sd, v in vals)
                + f" — range {lo:.2f}–{hi:.2f} over {len(vals)} draw{'s' if len(vals) > 1 else ''}{where}.", ""]
    return [""] + out if spec.get("spread") else []


def spread_figure(spec: dict, metas: list[tuple[Path, dict]], img_dir: Path | None) -> Path | None:
    """One row of dots per column and α (a dot per seed, labelled) with the paper's number as a mark on the same
    row; None when the table lists no spread or has no value yet."""
    rows = [(f"{col}, α = {alpha:g}", vals, published(spec, col, alpha)) for col, alpha, vals in draws(spec, metas)]
    if not rows:
        return None
    out = Path(f"papers-{spec['table']}-spread.png")
    if img_dir is None:
        return out
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.4, 1.2 + 0.7 * len(rows)))
    for y, (label, vals, pub) in enumerate(rows):
        ax.scatter([v for _, v in vals], [y] * len(vals), color="C0", zorder=3, label="our draws" if y == 0 else None)
        last, up = None, True
        for sd, v in sorted(vals, key=lambda t: t[1]):  # neighbours closer than 1.5 points: labels above and below
            up = not up if last is not None and v - last < 1.5 else True
            ax.annotate(str(sd), (v, y), textcoords="offset points", xytext=(0, 7 if up else -14), ha="center",
                        fontsize=7)
            last = v
        if pub is not None:
            ax.vlines(pub, y - 0.35, y + 0.35, colors="C3", linestyles="--", zorder=1,
                      label="the paper's run" if not any(r[2] is not None for r in rows[:y]) else None)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_ylim(len(rows) - 0.4, -0.6)  # the first row on top
    ax.set_xlabel("test accuracy (%), each dot one seed (labelled)")
    ax.set_title(f"{spec['table']}: the spread of partition draws", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(img_dir / out, dpi=110)
    plt.close(fig)
    return out


def budget_notes(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """One line per fused data-free server: the generator steps it ran (the fuse record's options over the cell's
    config) against those of the cell's config, which are the paper's."""
    out = []
    for col, c in spec["columns"].items():
        if not c["key"].startswith("fuse:"):
            continue
        name = c["key"][5:]
        ran, paper = set(), set()
        for d, m in metas:
            if m["method"] != c["method"]:
                continue
            opts = _cell_config(d).get("server", {}).get("strategies", {}).get(name, {})
            for r in fuse_records(d, name)[-1:]:
                used = {**opts, **(r.get("options") or {})}
                if "g_steps" in used or "g_steps" in opts:
                    ran.add((used.get("epochs"), used.get("g_steps")))
                    paper.add((opts.get("epochs"), opts.get("g_steps")))
        for (e, g), (pe, pg) in zip(sorted(ran), sorted(paper)):
            if None in (e, g, pe, pg):
                continue
            short = "" if (e, g) == (pe, pg) else " — **a shortened budget**; the curve below shows where it was heading"
            out.append(f"{col}'s server: {e} epochs × {g} generator steps = {e * g:,} (the paper's: {pe} × {pg} = "
                       f"{pe * pg:,}){short}.")
    return ([""] + out + [""]) if out else []


def in_progress(cell_dir: Path) -> dict[str, dict]:
    """A cell's unfinished fusions (`progress`), each with the budget it runs to (`epochs`, `g_steps`: the cell's
    config under the note's options); a strategy whose fuse record is in has none."""
    f = cell_dir / PROGRESS
    if not f.is_file():
        return {}
    out = {}
    for s, e in json.loads(f.read_text()).items():
        if fuse_records(cell_dir, s):
            continue
        used = {**_cell_config(cell_dir).get("server", {}).get("strategies", {}).get(s, {}), **e["options"]}
        out[s] = {**e, "epochs": used.get("epochs"), "g_steps": used.get("g_steps")}
    return out


def progress_lines(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """One line per unfinished fusion of a table's column: how far it got and its curve so far — no result (its
    column stays empty), the way the budget was heading when the last sitting ended."""
    out = []
    for col, c in spec["columns"].items():
        if not c["key"].startswith("fuse:"):
            continue
        for d, m in sorted(metas, key=lambda t: (float(t[1]["alpha"]), t[1]["seed"])):
            e = in_progress(d).get(c["key"][5:]) if m["method"] == c["method"] else None
            if e is None:
                continue
            steps = ("" if e["g_steps"] is None else
                     f" ({e['epoch'] * e['g_steps']:,} of {e['epochs'] * e['g_steps']:,} generator steps)")
            curve = ", ".join(f"{100 * p[2]:.2f}" for p in e["curve"])
            best = max(e["curve"], key=lambda p: p[2]) if e["curve"] else None
            head = (f"**stopped, not a result** — at epoch {e['epoch']} of {e['epochs']}{steps}, after "
                    f"{_duration(e['seconds'] / 3600)} (state of {e['as_of']}); stopped on {e['stopped']['on']}: "
                    f"{e['stopped']['why']}" if e.get("stopped") else
                    f"**in progress, not a result** — epoch {e['epoch']} of {e['epochs']}{steps}, "
                    f"{_duration(e['seconds'] / 3600)} so far (state of {e['as_of']})")
            out.append(f"{col} over the {m['method']} α = {float(m['alpha']):g}, seed-{m['seed']} clients: {head}"
                       + (f"; the student's test accuracy every {e['curve'][0][1]:,} steps: {curve} (highest "
                          f"{100 * best[2]:.2f} at step {best[1]:,})" if best else "") + ".")
    return ([""] + out + [""]) if out else []


def other_servers(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """Every fuse record of a cell that is not one of the table's servers at the table's options — a server fused
    over the same clients by hand (another option, a plugin's strategy): a diagnostic, listed, never a column."""
    rows = []
    for d, m in sorted(metas, key=lambda t: (float(t[1]["alpha"]), t[1]["seed"], t[1]["method"])):
        table_keys = {_key(s, (m.get("fuse_options") or {}).get(s)) for s in m.get("fuse", [])}
        for r in _jsonl(d / "fuse.jsonl"):
            if r.get("kind") != "fuse" or _key(r.get("strategy"), r.get("options")) in table_keys:
                continue
            opts = ", ".join(f"{k}={v}" for k, v in sorted((r.get("options") or {}).items())) or "its defaults"
            rows.append(f"| {m['method']} | {float(m['alpha']):g} | {m['seed']} | {r['strategy']} | {opts} | "
                        f"{100 * float(r['acc']):.2f} | {_duration(float(r.get('seconds', 0)) / 3600)} |")
    if not rows:
        return []
    return ["", "Other servers fused over the same clients (by hand, `flare fuse`; diagnostics, not columns):", "",
            "| clients | α | seed | server | options | accuracy | wall |", "| --- | --- | --- | --- | --- | --- | --- |",
            *rows]


def _cell_hours(cell_dir: Path) -> float:
    """A cell's clients and evaluation in wall hours: the sum of its round records' `seconds` (local training,
    aggregation, evaluation). Resumed runs keep every finished round's record, so the sum is the cell's cost
    however often it was interrupted."""
    return sum(float(r.get("seconds", 0.0)) for r in _jsonl(cell_dir / "metrics.jsonl")
               if r.get("kind") == "round") / 3600


def _duration(hours: float) -> str:
    return f"{hours:.2f} h" if hours >= 1 else f"{hours * 60:.0f} min" if hours * 60 >= 1 else f"{hours * 3600:.0f} s"


def _rate(values: list[float], unit: str) -> str:
    """Mean duration per unit, with the range and the count where there is more than one."""
    if len(values) == 1:
        return f"{_duration(values[0])} a {unit} (1)"
    spread = f"{_duration(min(values))}–{_duration(max(values))}"
    return f"{_duration(float(np.mean(values)))} a {unit} ({spread}, {len(values)})"


def cost_lines(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """What the table's cells cost, measured from the records' own timings, and what its unrecorded cells and
    fusions would cost at those rates: the budget a reader plans with, from runs rather than from an estimate made
    before them. The table's cells are its columns' methods × α × seeds. Wall time, not CPU time: a process that
    shared its core or was paused reads slower, so the range is printed with the mean."""
    recorded = {d.name for d, _ in metas}
    plan: dict[str, set[str]] = {}                       # method -> the servers its columns fuse
    for c in spec["columns"].values():
        plan.setdefault(c["method"], set()).update([c["key"][5:]] if c["key"].startswith("fuse:") else [])
    parts, todo_h, todo_n, unknown = [], 0.0, 0, []
    for method, servers in plan.items():
        mine = [d for d, m in metas if m["method"] == method]
        hours = [h for h in map(_cell_hours, mine) if h > 0]
        todo = [cell_name(method, a, sd) for a in spec["alphas"] for sd in seeds_for(spec, a)
                if cell_name(method, a, sd) not in recorded]
        if hours:
            parts.append(f"{method} clients {_rate(hours, 'cell')}")
            todo_h, todo_n = todo_h + np.mean(hours) * len(todo), todo_n + len(todo)
        elif todo:
            unknown.append(f"{len(todo)} {method} cell{'s' * (len(todo) != 1)}")
        for server in sorted(servers):
            recs = [fuse_records(d, server) for d in mine]  # each cell's fuse file read once
            secs = [float(r[-1].get("seconds", 0.0)) / 3600 for r in recs if r]
            notes = [(d, e) for d, e in ((d, in_progress(d).get(server)) for d in mine)
                     if e and e["epoch"] and e["epochs"]]
            for d, e in notes:
                rate = e["seconds"] / e["epoch"] / 3600  # hours an epoch
                if e.get("stopped"):  # its state is gone with its clients: both from the start again
                    again = _cell_hours(d) + rate * e["epochs"]
                    parts.append(f"its {server} server stopped at epoch {e['epoch']} of {e['epochs']} after "
                                 f"{_duration(e['seconds'] / 3600)} (to finish: the clients trained again and the "
                                 f"fusion from its first epoch, ≈ {_duration(again)} at their own rates)")
                    todo_h, todo_n = todo_h + again, todo_n + 2
                else:
                    left = rate * (e["epochs"] - e["epoch"])
                    parts.append(f"its {server} server in progress, epoch {e['epoch']} of {e['epochs']} after "
                                 f"{_duration(e['seconds'] / 3600)} (≈ {_duration(left)} more at its own rate)")
                    todo_h, todo_n = todo_h + left, todo_n + 1
            missing = len(todo) + sum(1 for r in recs if not r) - len(notes)
            if secs:
                parts.append(f"its {server} server {_rate(secs, 'fusion')}")
                todo_h, todo_n = todo_h + np.mean(secs) * missing, todo_n + missing
            elif missing:
                unknown.append(f"{missing} {server} fusion{'s' * (missing != 1)}")
    if not parts:
        return []
    rest = (f"still to run: {todo_n} {'client cell or fusion' if todo_n == 1 else 'client cells and fusions'}, "
            f"≈ {_duration(todo_h)} at these rates"
            if todo_n else "nothing left to run")
    if unknown:
        rest += f"; no rate yet for {', '.join(unknown)}"
    return [f"Cost, in wall hours from the records' own timings (one thread per process, on a machine shared with the "
            f"other tables' runs): {'; '.join(parts)}; {rest}.", ""]


def curve_figure(spec: dict, metas: list[tuple[Path, dict]], img_dir: Path | None) -> Path | None:
    """Test accuracy against generator steps of each fused data-free server (the records' `<name>.curve`), one
    line per α (the mean over the seeds) over thin per-seed lines, and the paper's printed value for that column and
    α dotted in the same colour, so the gap is read off the figure; None when no record has a curve."""
    curves: dict[tuple[str, float], list[list]] = {}
    going: list[tuple[str, float, str, list]] = []  # unfinished fusions (column, α, label, curve so far): dashed
    for col, c in spec["columns"].items():
        if not c["key"].startswith("fuse:"):
            continue
        for d, m in metas:
            if m["method"] != c["method"]:
                continue
            for r in fuse_records(d, c["key"][5:])[-1:]:
                if r.get(f"{c['key'][5:]}.curve"):
                    curves.setdefault((col, float(m["alpha"])), []).append(r[f"{c['key'][5:]}.curve"])
            e = in_progress(d).get(c["key"][5:])
            if e and e["curve"]:
                state = "stopped at" if e.get("stopped") else "in progress:"
                going.append((col, float(m["alpha"]), f"{col}, α = {float(m['alpha']):g}, seed {m['seed']} ({state} "
                              f"epoch {e['epoch']} of {e['epochs']})", e["curve"]))
    if not curves and not going:
        return None
    out = Path(f"papers-{spec['table']}-curve.png")
    if img_dir is None:  # the block names the figure; only `render` draws it
        return out
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pubs = []

    def paper_line(col: str, alpha: float, colour: str) -> None:
        if (pub := published(spec, col, alpha)) is not None:
            ax.axhline(pub, color=colour, ls=":", lw=1.2, label=f"{col}, α = {alpha:g}: the paper's {pub:.2f}")
            pubs.append(pub)

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, ((col, alpha), cs) in enumerate(sorted(curves.items())):
        colour = f"C{i}"
        for cv in cs:
            ax.plot([p[1] for p in cv], [100 * p[2] for p in cv], color=colour, lw=0.6, alpha=0.35)
        n = min(len(cv) for cv in cs)
        ax.plot([p[1] for p in cs[0][:n]], [100 * float(np.mean([cv[k][2] for cv in cs])) for k in range(n)],
                color=colour, lw=2, label=f"{col}, α = {alpha:g} ({len(cs)} seed{'s' if len(cs) > 1 else ''})")
        paper_line(col, alpha, colour)
    for j, (col, alpha, label, cv) in enumerate(going, len(curves)):
        ax.plot([p[1] for p in cv], [100 * p[2] for p in cv], color=f"C{j}", lw=1.5, ls="--", marker=".", label=label)
        if (col, alpha) not in curves:
            paper_line(col, alpha, f"C{j}")
    if pubs:  # a dotted line on the frame's edge is not seen
        ax.set_ylim(top=max(ax.get_ylim()[1], max(pubs) + 2))
    ax.set_xlabel("generator steps")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{spec['table']}: the data-free server's student during its budget", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(img_dir / out, dpi=110)
    plt.close(fig)
    return out


def paired_rows(spec: dict, metas: list[tuple[Path, dict]], results: Path) -> list[str]:
    """`paired_with: {table: T, columns: [...]}` (or a list of such): each of this table's columns minus each of T's,
    seed by seed at the same α (the same partition and initial weights), final values: mean ± std and the 95 %
    half-width. `columns: {OURS: THEIRS, ...}` pairs only those; T may be this table itself (FLARE − FAFI). Entries
    naming the same T share one table (a dict holds one pair per key, so two pairs of one column need two entries)."""
    pws, grouped = spec.get("paired_with") or [], {}
    for pw in pws if isinstance(pws, list) else [pws]:
        grouped.setdefault(pw["table"], []).extend(
            list(pw["columns"].items()) if isinstance(pw["columns"], dict)
            else [(col, ocol) for col in spec["columns"] for ocol in pw["columns"]])
    return [line for table, pairs in grouped.items() if (results / table / "table.yaml").is_file()
            for line in _paired_with(spec, metas, results, table, pairs)]


def _paired_with(spec: dict, metas: list[tuple[Path, dict]], results: Path, table: str,
                 pairs: list[tuple[str, str]]) -> list[str]:
    if table == spec["table"]:  # a pairing within the table: its spec and cells are already read
        other, theirs = spec, metas
    else:
        other = yaml.safe_load((results / table / "table.yaml").read_text())
        theirs = [(d, json.loads((d / "cell.json").read_text())) for d in sorted((results / table).iterdir())
                  if (d / "cell.json").is_file()]
    where = "within" if table == spec["table"] else "with"
    out = ["", f"Paired {where} {table} by seed (ours − theirs, final values):", "",
           "| ours | theirs | α | seeds | mean difference ± std | 95 % half-width |", "| --- | --- | --- | --- | --- | --- |"]
    for col, ocol in pairs:
        c, oc = spec["columns"][col], other["columns"][ocol]
        for alpha in spec["alphas"]:
            mine = {m["seed"]: cell_value(d, c["key"], "final") for d, m in metas
                    if m["method"] == c["method"] and float(m["alpha"]) == float(alpha)}
            them = {m["seed"]: cell_value(d, oc["key"], "final") for d, m in theirs
                    if m["method"] == oc["method"] and float(m["alpha"]) == float(alpha)}
            seeds = sorted(k for k in mine.keys() & them.keys() if math.isfinite(mine[k]) and math.isfinite(them[k]))
            mean, sd, hw, n = summarise([mine[k] - them[k] for k in seeds])
            out.append(f"| {col} | {ocol} | {alpha:g} | {','.join(map(str, seeds)) or '—'} | "
                       f"{'—' if n == 0 else (f'{mean:+.2f}' if n == 1 else f'{mean:+.2f} ± {sd:.2f}')} | "
                       f"{'—' if not math.isfinite(hw) else f'±{hw:.2f}'} |")
    return out + [""]


def replace_block(text: str, body: str) -> str:
    i, j = text.index(BEGIN), text.index(END)
    return text[:i + len(BEGIN)] + "\n" + body + text[j:]


def committed_block(text: str) -> str:
    i, j = text.index(BEGIN), text.index(END)
    return text[i + len(BEGIN) + 1:j]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/papers.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a table's cells one at a time, resumably")
    r.add_argument("table")
    r.add_argument("--runs", default=str(ROOT / "runs" / "papers"))
    r.add_argument("--commit", action="store_true", help="git-commit each finished cell's records directory")
    r.add_argument("--dry-run", action="store_true", help="list the cells and their status, run nothing")
    r.add_argument("--defer", action="append", default=[], metavar="STRATEGY",
                   help="leave this server strategy for a later pass; the cell is recorded without it")
    r.add_argument("--fuse-only", action="store_true",
                   help="train nothing: fuse (and record) only the cells whose clients have finished")
    r.add_argument("--cells", action="append", default=[], metavar="NAME",
                   help="take only this cell (repeatable; names as --dry-run lists them): two processes, two cells")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a flare override for every cell (a shortened budget: it lands in each cell's config)")
    t = sub.add_parser("describe", help="rewrite a recorded table's description (the paper's numbers, notes) "
                                        "from its table file, without running a cell")
    t.add_argument("table")
    t.add_argument("--results", default=str(RESULTS), help="the records directory (default results/papers)")
    q = sub.add_parser("progress", help="record how far the table's unfinished data-free fusions have got (their "
                                        "curve so far, no weights), for a sitting that ends before they do")
    q.add_argument("table")
    q.add_argument("--runs", default=str(ROOT / "runs" / "papers"))
    q.add_argument("--results", default=str(RESULTS), help="the records directory (default results/papers)")
    q.add_argument("--commit", action="store_true", help="render the block and commit it with the notes")
    q.add_argument("--stopped", metavar="WHY", help="mark the recorded unfinished fusions as stopped for this reason "
                   "(their state is gone, e.g. the machine that held it was replaced): the block stops pricing them "
                   "as going on; refused where a state is still on disk")
    g = sub.add_parser("render", help="rewrite docs/papers.md's block from results/papers/")
    g.add_argument("--check", action="store_true", help="exit 1 if the committed block is stale")
    g.add_argument("--results", default=str(RESULTS), help="the records directory (default results/papers)")
    a = ap.parse_args(argv)
    if a.cmd in ("run", "describe", "progress"):
        try:
            spec = load_table(a.table)
        except TableError as e:
            print(f"papers: {e}", file=sys.stderr)
            return 2
    if a.cmd == "run":
        names = [c["name"] for c in cells(spec)]
        unknown = [n for n in a.cells if n not in names]
        if unknown:
            print(f"papers: {a.table} has no cell {', '.join(unknown)}; its cells are {', '.join(names)}",
                  file=sys.stderr)
            return 2
        return run(spec, Path(a.runs), commit=a.commit, dry_run=a.dry_run, overrides=a.set,
                   defer=tuple(a.defer), fuse_only=a.fuse_only, only=tuple(a.cells), table_path=a.table)
    if a.cmd == "progress":
        if a.stopped is None:
            written, skipped = progress(spec, Path(a.runs), Path(a.results))
            for why in skipped:
                print(f"papers: skipped {why}", file=sys.stderr)
        elif not a.stopped.strip():
            print("papers: --stopped needs the reason, as the block will print it", file=sys.stderr)
            return 2
        else:
            written, refused = stop(spec, Path(a.runs), a.stopped.strip(), Path(a.results))
            if refused or not written:
                why = "; ".join(refused) or f"{spec['table']} has no recorded unfinished fusion not stopped already"
                print(f"papers: nothing marked stopped — {why}", file=sys.stderr)
                return 2
        for f in written:
            print(f)
        if a.commit and written:
            subprocess.check_call([sys.executable, str(Path(__file__).resolve()), "render", "--results", a.results],
                                  cwd=ROOT)
            _git_commit([*map(str, written), str(DOC), str(DOC.parent / "img")],
                        f"papers: {spec['table']} fusions {'stopped' if a.stopped else 'in progress'} "
                        f"({len(written)} cell{'s' * (len(written) != 1)})")
        return 0
    if a.cmd == "describe":
        if not (Path(a.results) / spec["table"]).is_dir():
            print(f"papers: {spec['table']} has no records under {a.results} yet; its first cell writes the "
                  "description", file=sys.stderr)
            return 2
        print(describe(spec, Path(a.results)))
        return 0
    text = DOC.read_text()
    body = render(Path(a.results), img_dir=None if a.check else DOC.parent / "img")
    if a.check:
        if committed_block(text) != body:
            print("papers: docs/papers.md's block differs from results/papers/ (run tools/papers.py render)")
            return 1
        return 0
    DOC.write_text(replace_block(text, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
