"""`flare` — the command line: run, compare, lr-probe, sweep, report, fuse, federate, presets, datasets, models,
parts, config-reference, and the commands other packages add through the `flare.commands` entry points (`flare
paper`: the flare-paper distribution). Every command's options: its `--help` and docs/getting-started.md's table.

Every user mistake is a one-paragraph message on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a shared machine (sweep
# workers, a second run) spinning threads starve each other — a CNN step measured 0.76 s with the default
# and 0.26 s with PASSIVE while another training process ran on the same 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from flare import cpu  # noqa: E402  (imports nothing that computes)

# Before the imports below run their first tensor operation: the CPU kernel level this command asks for
# (flare/cpu.py; each run checks it against its validated config).
cpu.pin(cpu.early_level(sys.argv[1:]))

from flare.config import (Config, build_config, config_reference_markdown, deep_merge,  # noqa: E402
                          experiment_differences, list_presets, load_config, parse_list, parse_overrides)
from flare.errors import FlareError, check_path  # noqa: E402
from flare.experiments.compare import run_compare  # noqa: E402
from flare.experiments.sweep import run_sweep  # noqa: E402
from flare.fuse import fuse_runs  # noqa: E402
from flare.lrprobe import format_probe, probe  # noqa: E402
from flare.registry import DATASETS, MODELS, REGISTRIES, load_plugins  # noqa: E402
from flare.rundir import RunDir, extension_problem  # noqa: E402
from flare.runner import Run  # noqa: E402

COMMAND_GROUP = "flare.commands"  # the entry points of the commands other packages add (command_adders)


def _count(text: str) -> int:
    """A positive count on the command line (argparse reports a bad one as a usage error, exit 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"{n} is not between 1 and 256")
    return n


def _default_out(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _resume_config(args) -> Config:
    """`flare run --resume DIR [KEY=VALUE ...]`: DIR's own config, with overrides applied only where that is sound
    (more rounds, when nothing depends on R); anything else is refused, never ignored."""
    d = Path(args.resume)
    if args.out and Path(args.out).resolve() != d.resolve():
        raise FlareError(f"--resume {args.resume} continues that directory, so --out {args.out} cannot apply.",
                         key="--out", fix="drop --out (or give the same directory); to branch off into a new "
                                          f"directory, run `flare run --config {d / 'config.yaml'} --out NEW ...`.")
    if args.config or args.preset:
        raise FlareError("--resume takes the run's config from its directory; --config and --preset cannot apply.",
                         key="--config" if args.config else "--preset", fix="drop them.")
    old = RunDir(d).read_config() if d.is_dir() else None
    if old is None:
        raise FlareError(f"'{args.resume}' is not a run directory (no config.yaml).", key="--resume",
                         fix="give the --out directory of an earlier run.")
    cfg = build_config(deep_merge(old, parse_overrides(args.overrides)))
    diff = experiment_differences(old, cfg)
    why = extension_problem(old, cfg) if diff == ["rounds"] else None
    if diff and (diff != ["rounds"] or why):
        raise FlareError(f"--resume cannot change {', '.join(diff)}" + (f": {why}" if why else
                         " (the rounds already trained were made with the old values)") + ".", key=diff[0],
                         fix=f"resume without those overrides, or start a new run with them: `flare run --config "
                             f"{d / 'config.yaml'} --out NEW ...`.")
    return cfg


def cmd_run(args) -> None:
    if args.resume:
        cfg, out = _resume_config(args), Path(args.resume)
    else:
        cfg = load_config(args.config, args.preset, args.overrides)
        out = Path(args.out) if args.out else _default_out(cfg.method)
    s = Run(cfg, out, quiet=args.quiet).execute()
    final = "" if s.get("final", "last round") == "last round" else f", {s['final']}"
    print(f"{cfg.method}: final acc ({s.get('primary')}{final}) = {100 * s.get('acc', float('nan')):.2f}%  "
          f"peak {100 * s.get('peak_acc', float('nan')):.2f}% at round {s.get('peak_round')}  → {out}")


def cmd_compare(args) -> None:
    out = Path(args.out) if args.out else _default_out("compare")
    presets = parse_list(args.presets, "--presets", example="fafi,fedavg")
    seeds = None if args.seeds is None else parse_list(args.seeds, "--seeds", convert=int, example="1,2,3")
    title, table = run_compare(presets, out, args.config, args.overrides, seeds=seeds, quiet=args.quiet,
                               baseline=args.baseline, workers=args.workers)
    print(f"\n{title}\n\n{table}\n\nrun directories and plots: {out}")


def cmd_presets(args) -> None:
    rows = list_presets()
    w = max(len(n) for n in rows)
    for name, m in rows.items():
        print(f"{name:<{w}}  {m.get('notes_name', ''):<14}  {m.get('description', '')}")


def cmd_listing(args) -> None:
    """`flare datasets` and `flare models`: every dataset or model with what it is; a library's catalogue as one row
    (`timm/<any of N names>`)."""
    load_plugins(args.plugin, key="--plugin")
    for name, desc in args.registry.describe():
        print(f"{name:<{args.width}}  {desc}")


def cmd_parts(args) -> None:
    """Every registry with what its entries are, its parts (built-in, entry-point plugins and --plugin modules) and
    each part's options (name: type = default)."""
    load_plugins(args.plugin, key="--plugin")
    for kind, reg in REGISTRIES.items():
        print(f"{kind} ({reg.key}): {reg.call_signature()}")
        for name in reg.names():
            print(f"  {name:<16}  {reg.entry(name).description}")
            if rows := reg.option_rows(name):
                print(f"  {'':<16}  options: " + ", ".join(f"{o}: {t} = {d}" for o, t, d in rows))
        for name, desc in reg.namespaces():
            print(f"  {name:<16}  {desc}")


def cmd_config_reference(args) -> None:
    print(config_reference_markdown())


def cmd_lr_probe(args) -> None:
    cfg = load_config(args.config, args.preset, args.overrides)
    r = probe(cfg, client=args.client, all_data=args.all_data, batches=args.batches, iters=args.iters,
              batch_size=args.batch_size, tol=args.tol)
    print(format_probe(cfg, r))


def cmd_sweep(args) -> int:
    _, results = run_sweep(args.config, args.out, overrides=args.overrides, workers=args.workers,
                           address=args.address, cpus_per_point=args.cpus_per_point,
                           gpus_per_point=args.gpus_per_point, quiet=args.quiet, dry_run=args.dry_run,
                           report=not args.no_report)
    bad = {n: r for n, r in results.items() if r.get("status") in ("failed", "diverged")}
    for n, r in bad.items():
        last = (str(r.get("error") or "").strip().splitlines() or [""])[-1]
        print(f"flare: sweep point {n} {r['status']}: {last}", file=sys.stderr)
    return 1 if any(r["status"] == "failed" for r in bad.values()) else 0


def cmd_report(args) -> None:
    from flare.report.report import write_report  # lazy: pyplot, about 0.8 s a process; only `flare report` needs it
    out = Path(args.out or (Path(args.dirs[0]) / "report" if len(args.dirs) == 1 else _default_out("report")))
    print(f"report: {write_report(args.dirs, out, title=args.title or 'FLARE report', baseline=args.baseline)}")


def cmd_fuse(args) -> None:
    """Server strategies over finished runs' saved client states (flare/fuse.py). The run's own config.yaml is the
    experiment: the only KEY=VALUE overrides are server-strategy options (server.strategies.<name>.<option>)."""
    dirs = [d for d in args.dirs if not ("=" in d and not Path(d).exists())]
    overrides = [d for d in args.dirs if d not in dirs]
    for path, recs in fuse_runs(dirs, args.strategies, args.round, args.plugin, overrides):
        for f in recs:
            opts = " ".join(f"{k}={v}" for k, v in f.get("options", {}).items())
            print(f"{path}: {f['strategy']} acc = {100 * float(f['acc']):.2f}% ({float(f['seconds']):.1f} s)"
                  + (f" [{opts}]" if opts else ""))


def cmd_federate(args) -> None:
    try:  # lazy: Flower is an optional extra (flare-ofl[flower])
        from flare.flower.federation import federate
        from flare.flower.protocol import export_partitions
    except ImportError:
        raise FlareError("flare federate needs Flower, which is not installed.", key="federate",
                         fix="pip install 'flare-ofl[flower]' (in a checkout: pip install -e '.[flower]').") from None
    if args.export_partitions:
        overrides = args.overrides + ([f"num_clients={args.clients}"] if args.clients else [])
        paths = export_partitions(load_config(args.config, args.preset, overrides), args.export_partitions)
        print(f"wrote {len(paths)} client files and dataset-meta.json to {args.export_partitions}")
        return
    s = federate(args.config, args.preset, args.overrides, out=args.out, clients=args.clients,
                 min_clients=args.min_clients, timeout=args.timeout, upload=args.upload, simulation=args.simulation,
                 local_data=args.local_data, workdir=args.workdir)
    acc = s.get("acc")
    print(f"{s.get('method')}: final acc ({s.get('primary')}) = "
          f"{'n/a' if acc is None else f'{100 * acc:.2f}%'} over the federation → {s['out']}  (logs {s['logs']})")


PATH_OPTIONS = ("config", "out", "resume", "dirs", "workdir", "export_partitions")  # every option naming a path
BASELINE_HELP = "the method every other is tested against, paired by seed (default: fafi if present, else the first)"
class _Parser(argparse.ArgumentParser):
    def __init__(self, *a, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*a, **kw)

    def error(self, message):
        """argparse's own message (it names the option at fault) plus the fix, exit code 2."""
        self.print_usage(sys.stderr)
        unknown_command = message.startswith("argument command: invalid choice")
        added = (" A command another package adds (`flare paper`) is there once that package is installed with its "
                 "entry points (`pip install -e .` in this checkout)." if unknown_command else "")
        self.exit(2, f"{self.prog}: error: {message}. Fix: options are spelled out in full (no abbreviations); "
                     f"`{self.prog} --help` lists them, and config keys go as KEY=VALUE.{added}\n")


def build_parser(commands: list[Callable] | None = None) -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: argparse would otherwise take `--pre` (or `--preset` on `compare`, a prefix of
    # `--presets`) for another option and silently run something else
    p = _Parser(prog="flare", description="FLARE: one-shot federated learning research framework.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    r = sub.add_parser("run", help="run one experiment")
    r.add_argument("--config", help="YAML config file")
    r.add_argument("--preset", help="method preset (see `flare presets`)")
    r.add_argument("--out", help="run directory (default runs/<method>-<time>)")
    r.add_argument("--resume", metavar="DIR", help="continue an interrupted run from its last complete round")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    r.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("compare", help="run several presets on the same partition and seed, print a table")
    c.add_argument("--presets", required=True, help="comma-separated preset names")
    c.add_argument("--config", help="YAML config file (applied over each preset)")
    c.add_argument("--out", help="output directory (one run directory per preset inside)")
    c.add_argument("--seeds", help="comma-separated seeds: every method runs once per seed, the table shows mean ± std")
    c.add_argument("--baseline", help=BASELINE_HELP)
    c.add_argument("--workers", type=_count, default=1,
                   help="runs at once, each in its own process with one torch thread (default 1: one run at a time "
                        "with torch's threads); the thread count changes the digits")
    c.add_argument("--quiet", action="store_true")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    c.set_defaults(fn=cmd_compare)

    lp = sub.add_parser("lr-probe", help="largest Hessian eigenvalue L at the initial model and eta_crit = 2/L")
    lp.add_argument("--config", help="YAML config file")
    lp.add_argument("--preset", help="method preset (see `flare presets`)")
    lp.add_argument("--client", type=int, default=0, help="probe this client's data (default 0)")
    lp.add_argument("--all-data", action="store_true", help="probe the whole training set instead of one client")
    lp.add_argument("--batches", type=int, default=2, help="fixed batches the loss is averaged over (default 2)")
    lp.add_argument("--batch-size", type=int, default=None,
                    help="images per probe batch (default: the config's batch_size, at most 64)")
    lp.add_argument("--iters", type=int, default=30, help="most power iterations (default 30)")
    lp.add_argument("--tol", type=float, default=1e-3,
                    help="stop once the estimate changes by less than this, relatively (default 1e-3; 0: all)")
    lp.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    lp.set_defaults(fn=cmd_lr_probe)

    sw = sub.add_parser("sweep", help="run a grid of configs, presets and seeds (one run directory per point)")
    sw.add_argument("--config", required=True, metavar="SWEEP.yaml", help="sweep file (docs/experiments.md)")
    sw.add_argument("--out", help="output directory (default runs/sweeps/<sweep name>)")
    sw.add_argument("--workers", type=int, default=1, help="points in parallel through Ray (default 1: sequential)")
    sw.add_argument("--address", help="join an existing Ray cluster (e.g. auto or HOST:6379)")
    sw.add_argument("--cpus-per-point", type=float, help="Ray CPUs (and torch threads) per point (default 1)")
    sw.add_argument("--gpus-per-point", type=float, help="Ray GPUs per point (default: 1, or a fraction when "
                                                          "there are fewer GPUs than workers)")
    sw.add_argument("--dry-run", action="store_true", help="validate and list the points, run nothing")
    sw.add_argument("--no-report", action="store_true", help="do not write <out>/report")
    sw.add_argument("--quiet", action="store_true")
    sw.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied over the sweep's base config")
    sw.set_defaults(fn=cmd_sweep)

    rp = sub.add_parser("report", help="tables and figures over any set of run directories")
    rp.add_argument("dirs", nargs="+", metavar="DIR", help="run directories, or folders holding them")
    rp.add_argument("--out", help="report directory (default DIR/report for one DIR)")
    rp.add_argument("--title", help="report title")
    rp.add_argument("--baseline", help=BASELINE_HELP)
    rp.set_defaults(fn=cmd_report)

    fu = sub.add_parser("fuse", help="score server strategies over finished runs' saved client states (no client "
                                     "retrained); results in RUN_DIR/fuse.jsonl and summary.md")
    fu.add_argument("dirs", nargs="+", metavar="RUN_DIR", help="finished run directories, and server-strategy "
                    "options given anew (server.strategies.<name>.<option>=VALUE: the one override fuse takes)")
    fu.add_argument("--strategies", required=True, help="comma-separated registered server strategies "
                                                        "(`flare parts` lists them); those fused before are skipped")
    fu.add_argument("--round", type=int, help="the round whose states to fuse: only the last round's are saved")
    fu.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                    help="import this plugin module first, for its strategies (repeatable)")
    fu.set_defaults(fn=cmd_fuse)

    fd = sub.add_parser("federate", help="run one experiment as a real Flower federation on this machine "
                                         "(a SuperLink and K SuperNodes on 127.0.0.1; needs flare-ofl[flower])")
    fd.add_argument("--config", help="YAML config file")
    fd.add_argument("--preset", help="method preset (see `flare presets`)")
    fd.add_argument("--out", help="run directory (default runs/federate-<method>-<time>)")
    fd.add_argument("--clients", type=int, help="K: SuperNodes to start (sets num_clients)")
    fd.add_argument("--min-clients", type=int, default=0,
                    help="proceed when at least this many clients upload (default 0: every client)")
    fd.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the clients' replies")
    fd.add_argument("--upload", choices=["once", "per-round"],
                    help="once (deployment: one upload; the default with SuperNodes) or per-round (a snapshot per "
                         "round: the accuracy curve; the default with --simulation)")
    fd.add_argument("--simulation", action="store_true", help="Flower's Ray simulation runtime instead of SuperNodes")
    fd.add_argument("--local-data", action="store_true",
                    help="give every SuperNode its own .npz of its partition (data-path) instead of the dataset")
    fd.add_argument("--workdir", help="where the processes' logs go (default a new temporary folder)")
    fd.add_argument("--export-partitions", metavar="DIR",
                    help="only write every client's partition (client-<i>.npz) and dataset-meta.json to DIR, "
                         "for the nodes of a multi-machine deployment; starts nothing")
    fd.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    fd.set_defaults(fn=cmd_federate)

    sub.add_parser("presets", help="list method presets with the notes' names").set_defaults(fn=cmd_presets)
    for name, what, defaults in (("datasets", "list datasets", dict(fn=cmd_listing, registry=DATASETS, width=14)),
                                 ("models", "list models", dict(fn=cmd_listing, registry=MODELS, width=24)),
                                 ("parts", "list every registry of parts with names, descriptions, options",
                                  dict(fn=cmd_parts))):
        lp_ = sub.add_parser(name, help=what + " (plugins included)")
        lp_.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                         help="also import this plugin module (repeatable); `flare.plugins` entry points always")
        lp_.set_defaults(**defaults)
    sub.add_parser("config-reference", help="print every config key as a markdown table").set_defaults(
        fn=cmd_config_reference)
    for add in command_adders() if commands is None else commands:
        add(sub)
    p.commands = sub.choices  # name → subcommand parser (see parse_args)
    return p


def command_adders() -> list[Callable]:
    """The commands other packages add (`flare paper`: the flare_paper package), each an entry point of the group
    `flare.commands` naming `add(subparsers)`, which adds its subparser with `set_defaults(fn=...)`: a package
    built on flare extends the command line without flare importing it."""
    return [ep.load() for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda ep: ep.name)]


def parse_args(argv: list[str] | None = None, commands: list[Callable] | None = None) -> argparse.Namespace:
    """Options and KEY=VALUE overrides in any order: `flare run rounds=5 --preset fafi` works too.

    argparse stops a `nargs="*"` positional at the first option, and its `parse_intermixed_args`, which would
    allow interleaving, refuses parsers with subcommands; so the subcommand's own parser parses what follows it.
    """
    parser = build_parser(commands)
    argv = list(sys.argv[1:] if argv is None else argv)
    i = next((k for k, a in enumerate(argv) if not a.startswith("-")), None)
    if i is None or argv[i] not in parser.commands:
        return parser.parse_args(argv)  # help, or argparse's own message for a missing / unknown command
    args = parser.commands[argv[i]].parse_intermixed_args(argv[i + 1:])
    args.command = argv[i]
    return args


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning is one line for the user (`flare: warning: ...`), not a source location and a code excerpt."""
    return f"flare: warning: {message}\n"


def main(argv: list[str] | None = None, commands: list[Callable] | None = None) -> int:
    """`flare`; `commands`: the adders of the extra commands (default: the `flare.commands` entry points)."""
    warnings.formatwarning = _warning_line
    args = parse_args(argv, commands)
    try:
        if getattr(args, "out", None) is not None and not args.out.strip():
            raise FlareError("--out is empty.", key="--out", fix="give a directory, or leave --out out for the "
                                                                 "default.")
        for option in PATH_OPTIONS:
            value = getattr(args, option, None) or []
            for path in value if isinstance(value, list) else [value]:
                check_path(path, "DIR" if option == "dirs" else f"--{option.replace('_', '-')}")
        rc = args.fn(args)  # a command's exit code; None: 0
        sys.stdout.flush()  # a reader that went away shows up here, not in the interpreter's exit
        return rc or 0
    except BrokenPipeError:
        # `flare presets | head`: stop quietly like a Unix tool killed by SIGPIPE (exit 128 + 13), and point
        # stdout at /dev/null so that Python's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except FlareError as e:
        print(f"flare: error: {e.render()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flare: interrupted; rerun the same command (or `flare run --resume DIR`) to continue.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
