"""`flare paper`: the paper suite's command, which the flare_paper package adds to flare's command line through the
`flare.commands` entry point (paper/pyproject.toml) — flare never imports this package. `flare-paper ARGS` (and
`python -m flare_paper ARGS`) is the same command where the entry point is not installed.

  flare paper    --scale smoke|cpu|full [--datasets a,b] [--seeds 1,2] [--only EXP,...] [--protocol clean,reference]
                 [--strategies a,b] [--out DIR] [--workers N]
"""
from __future__ import annotations

import sys

from flare import cli

from flare_paper.suite import run_paper


def add_command(subparsers) -> None:
    """Add `paper` to flare's subcommands (the `flare.commands` entry point)."""
    pa = subparsers.add_parser("paper", help="the experiments of docs/method.md#experiments as sweeps, then the "
                                             "report")
    pa.add_argument("--scale", required=True, choices=["smoke", "cpu", "full"])
    pa.add_argument("--datasets", help="comma-separated datasets (default per scale)")
    pa.add_argument("--seeds", help="comma-separated seeds (default per scale)")
    pa.add_argument("--out", help="output directory (default runs/paper-<scale>)")
    pa.add_argument("--data-root", action="append", default=[], metavar="NAME=PATH",
                    help="where a dataset lives, e.g. cifar10=../shared/data/cifar10-jpg.tar.gz (repeatable; "
                         "env FLARE_DATA_<NAME>)")
    pa.add_argument("--workers", type=int, default=1, help="points in parallel through Ray")
    pa.add_argument("--address", help="join an existing Ray cluster")
    pa.add_argument("--only", help="run only these experiments (comma-separated: table1, ablation, robustness, "
                                   "lambda0, alpha, reproduce); the report shows what exists of the others. "
                                   "reproduce runs only when named: the notes' table under both protocols, the "
                                   "one-item protocol ablation, report/reproduction.md")
    pa.add_argument("--protocol", help="comma-separated protocols, clean and/or reference (default clean; "
                                       "clean,reference for reproduce)")
    pa.add_argument("--baseline", help="the method every other is tested against, paired by seed (default: fafi if present, else the first)")
    pa.add_argument("--strategies", help="server strategies to score over Table 1's saved clients once they are "
                                         "trained (`flare fuse`; e.g. otfusion,fedlpa,feddf — those needing public "
                                         "data want dataset.public_size=N); the report gets their tables")
    pa.add_argument("--dry-run", action="store_true", help="list the runs, run nothing")
    pa.add_argument("--quiet", action="store_true")
    pa.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every run (e.g. device=cuda)")
    pa.set_defaults(fn=cmd_paper)


def cmd_paper(args) -> int:
    run_paper(args.scale, out=args.out, datasets=args.datasets, seeds=args.seeds, workers=args.workers,
              address=args.address, data_root=args.data_root, quiet=args.quiet, dry_run=args.dry_run,
              overrides=args.overrides, only=args.only, protocol=args.protocol, baseline=args.baseline,
              strategies=args.strategies)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`flare-paper ARGS`: `flare paper ARGS` with this package's command given directly."""
    return cli.main(["paper", *(sys.argv[1:] if argv is None else argv)], commands=[add_command])


if __name__ == "__main__":
    sys.exit(main())
