"""`flare compare`: several methods on the *same* partition, init and seed — each preset's config is the user's
config file and overrides applied over the preset (`config.config_for_preset`), all validated before the first
run starts — then the comparison report (`report.compare`)."""
from __future__ import annotations

from pathlib import Path

from flare.config import config_for_preset, deep_merge, parse_overrides, read_yaml_mapping
from flare.errors import FlareError
from flare.experiments.execute import Point, check_data, execute_points
from flare.rundir import RunDir
from flare.runner import Run


def run_compare(presets: list[str], out: Path, config_file: str | None = None, overrides: list[str] | None = None,
                seeds: list[int] | None = None, quiet: bool = False, log=print,
                baseline: str | None = None, workers: int = 1) -> tuple[str, str]:
    """Run (or resume) every preset into `out/<preset>` (with `seeds`: `out/<preset>/seed=<s>`, one run each), then
    write compare.md and its figures; returns the title and the table.

    `workers` > 1 runs that many runs at once in local processes of one torch thread each (`execute_points`): on a
    CPU the small networks of a comparison use two threads poorly, so two one-thread runs side by side finish the
    table sooner. A run's digits follow its thread count, so a table states its workers (compare.md's command)."""
    if baseline is not None and baseline not in presets:
        raise FlareError(f"--baseline {baseline} is not among --presets {','.join(presets)}.", key="--baseline",
                         fix="add it to --presets, or name one of them.")
    ov = parse_overrides(overrides or [])
    base = deep_merge(read_yaml_mapping(config_file) if config_file else {}, ov)
    if "preset" in base:
        raise FlareError("`preset` in the config or overrides of `flare compare` would be overridden by --presets.",
                         key="preset", fix="remove it; --presets lists the methods to compare.")
    if seeds and "seed" in ov:
        raise FlareError("both seed=... and --seeds are given.", key="--seeds",
                         fix="give the seeds in one place (--seeds replaces the config file's seed).")
    plan = []  # (preset, run directory, config): every config is validated before any run starts
    for name in presets:
        for s in seeds or [None]:
            cfg = config_for_preset(base if s is None else {**base, "seed": s}, name)
            plan.append((name, out / name if s is None else out / name / f"seed={s}", cfg))
    for _, d, cfg in plan:  # every run directory it would continue, checked before any is written
        RunDir(d).check_continues(cfg)
    check_data([cfg for _, _, cfg in plan])
    RunDir(out).create()
    if workers > 1:
        points = [Point(name if seeds is None else f"{name} seed {cfg.seed}", {}, cfg, d) for name, d, cfg in plan]
        ran = execute_points(points, workers=workers, quiet=quiet, desc="compare", log=log, ray=False)
        failed = [f"{n}: {r.get('error', '')}" for n, r in ran.items() if r.get("status") == "failed"]
        if failed:  # one paragraph like a federation's failure: each run's directory keeps what it wrote
            raise FlareError(f"{len(failed)} of {len(points)} compare runs failed — " + "; ".join(failed),
                             fix="read the failed run's directory under --out; the same command resumes the "
                                 "finished and unfinished runs.")
        diverged = [f"{n}: {r.get('error', '')}" for n, r in ran.items() if r.get("status") == "diverged"]
        if diverged:  # as one run at a time would stop on its TrainingDiverged, with what it wrote kept
            raise FlareError("a run diverged — " + "; ".join(diverged))
    else:
        for name, d, cfg in plan:
            Run(cfg, d, quiet=quiet, label=name if seeds is None else f"{name} seed {cfg.seed}").execute()
    from flare.report.compare import write_compare_report  # lazy: pyplot (about 0.8 s), once runs are done
    return write_compare_report([(n, [d for m, d, _ in plan if m == n]) for n in presets], out, baseline)
