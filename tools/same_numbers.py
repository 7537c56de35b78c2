"""Prove that a refactor left every method's numbers unchanged: run the same tiny experiments at two revisions and
compare their metrics.jsonl record by record.

    python tools/same_numbers.py --before REV --after REV [--presets all|a,b,c] [--main-seed N] [--out DIR]
                                 [--jobs 1] [--threads 1] [--python PY]
    python tools/same_numbers.py --dirs RECORDS RUNS     # two finished run trees, e.g. on two machines

`--dirs A B` runs nothing: it compares every <method>/seed=N/metrics.jsonl found under either tree with its
namesake in the other, by the same rule (timing keys aside), and says ALL IDENTICAL only when both trees hold the
same runs and every pair is identical. Its use: `make run` on another machine against the main job's committed
records (results/main/main), which tells whether that machine reproduces them bit for bit.

What it does
  1. Makes a detached git worktree of each revision under --out (default /tmp/same-numbers): OUT/tree-<sha12>,
     reused when it is already there at that commit.
  2. In each tree runs every preset `flare presets` lists there (or the --presets given) with one tiny, fixed
     configuration — the same command line in both trees:
         python -m flare.cli run --quiet --preset P --out RUN_DIR  <TINY overrides> [dataset.public_size=...]
     TINY (below) is Fashion-MNIST (600 train / 200 test samples), 3 clients, Dirichlet α 0.5, 2 rounds of one
     local epoch, the CNN at width 0.125 (feature dimension 16 ≥ C − 1, so ETF anchors exist), CPU. Presets that
     hold out a public slice (their YAML sets dataset.public_size: public-bank, two-stage) get
     dataset.public_size=100 instead of their 1000.
     With --main-seed N it also runs the main job's command for that one seed in both trees (the Makefile's
     `run` target): python -m flare.cli compare --config configs/main.yaml --presets <Makefile PRESETS>
     --seeds N --out DIR, and compares each of its run directories (OUT/.../main/<preset>/seed=N).
  3. Compares each run's metrics.jsonl of the two revisions record by record (`compare_records`): the same
     number of records, the same keys, equal values — equal as JSON text, so 1 ≠ 1.0 ≠ true and every float
     bit for bit — and prints a table: run, records, identical, first difference (record index, key, before,
     after). Exit status 0 only when every run is identical, else 1.

Same CPU kernels in both revisions. A CPU run's digits follow the kernel level ATen and oneDNN dispatch to.
Newer revisions pin it to AVX2 by default (src/flare/cpu.py), older ones (e.g. beff429) let torch pick the
CPU's best (AVX512 on this workplace's VMs), and only the newest pin MKL's branch too, so every child process of
*both* revisions runs with
    ATEN_CPU_CAPABILITY=avx2  ONEDNN_MAX_CPU_ISA=AVX2  MKL_CBWR=AVX2,STRICT  MKL_ENABLE_INSTRUCTIONS=AVX2
and also with OMP_NUM_THREADS=MKL_NUM_THREADS=--threads (default 1; the thread count changes float summation
order), PYTHONPATH=<tree>/src:<tree>/paper/src (checked: `flare` must import from that tree, not from the venv's
editable install; the paper suite too, whose `flare paper` command every `flare` invocation loads), FLARE_CACHE=OUT/cache/<sha12> (decoded datasets, one cache per revision), FLARE_QUIET=1,
PYTHONHASHSEED=0, with the python running this script (or --python); FLARE_CPU_ISA and FLARE_CPU_ISA_PINNED of
the caller's environment are removed, so no pin of the caller's reaches one side only.
Before any run, one child process per side reports torch.backends.cpu.get_cpu_capability(): the two must agree
(AVX2 on x86-64), and `flare` must come from that side's tree.

With --fuse NAMES (default list: FUSE_STRATEGIES) it also proves `flare fuse` unchanged: each side's finished runs
of the --fuse-runs presets are the saved clients (the runs themselves compared identical above; what a run saves
for fuse — checkpoint.pt, later uploads.pt — is its own side's); each side fuses a copy of its own, one strategy per
process (`flare fuse COPY --strategies S` + FUSE_BUDGET, the data-free servers and FedDF at a few steps), and the
two fuse.jsonl are compared like metrics.jsonl. A strategy both sides refuse for a run (exit 2: e.g. FedProto over
a linear head) counts as identical when the two refusals read the same, and the table says "both refused".

Keys the comparison ignores (timing: they differ between any two runs). A real metrics.jsonl has `seconds`
(client and round records), `seconds_train`, `seconds_eval`, `seconds_aggregate` (round records); the rule
ignores any key whose last dotted part starts with `seconds`, ends with `_seconds`, or is `time`, `wall` or
`timestamp` (`is_timing_key`; `otfusion.seconds` is a strategy's own clock in a fuse record).

Keys in only one revision's records are differences, except ALLOWED_NEW_KEYS: keys newer code added that carry
no number of the method, accepted only when present on the --after side alone, and reported in the table's
notes whenever used:
    evaluated   round records of rounds skipped by eval.every carry "evaluated": false (newer code only; with
                the default eval.every=1 no record has it)

Resumable: a run directory whose state.json says {"status": "finished"} with rounds_done equal to its
config.yaml's rounds (what src/flare/rundir.py leaves after a complete run) is not run again; the main job is
skipped when every one of its run directories is finished. Runs live in OUT/runs-<hash of the tiny
configuration>/<before|after>-<sha12>/, so changing TINY never reuses runs of another configuration. Each
run's stdout and stderr go to a .log file beside its directory.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

TINY = ["dataset.name=fmnist", "dataset.train_subset=600", "dataset.test_subset=200", "num_clients=3",
        "partition.alpha=0.5", "rounds=2", "local_epochs=1", "model.name=cnn", "model.width=0.125",
        "batch_size=32", "test_batch_size=100", "device=cpu", "seed=1"]
PUBLIC = ["dataset.public_size=100"]  # for presets that hold out a public slice (their YAML sets public_size)
KERNEL_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2,STRICT",
              "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
TIMING_NAMES = {"time", "wall", "timestamp"}
ALLOWED_NEW_KEYS = {"evaluated": "set to false on round records eval.every skips (newer code only)"}
MAIN_PRESETS_DEFAULT = "fafi,fedavg,ensemble,etf-anneal,flare"
FUSE_STRATEGIES = ("otfusion,regmean,fedlpa,feddf,dense,coboosting,intactofl,fens,bnrecal,fedproto,fedproto_fused,"
                   "iffi,iffi_reference")
FUSE_BUDGET = ["server.strategies.dense.epochs=2", "server.strategies.dense.g_steps=2",
               "server.strategies.coboosting.epochs=2", "server.strategies.coboosting.g_steps=2",
               "server.strategies.intactofl.epochs=2", "server.strategies.intactofl.g_steps=2",
               "server.strategies.feddf.steps=20", "server.strategies.fens.rounds=3"]


# ----------------------------------------------------------------------------------------------
# comparison (pure: tests/test_same_numbers.py checks it on constructed records)


def is_timing_key(key: str) -> bool:
    """A timing key, also as a strategy's own log (`otfusion.seconds` in a fuse record)."""
    key = key.rsplit(".", 1)[-1]
    return key.startswith("seconds") or key.endswith("_seconds") or key in TIMING_NAMES


def _canon(v) -> str:
    """A value as JSON text: equal text means the same number bit for bit and the same JSON type."""
    return json.dumps(v, sort_keys=True)


@dataclass
class Difference:
    index: int | None  # record index (0-based), None for the record count
    key: str
    before: object
    after: object

    def describe(self) -> str:
        where = "record count" if self.index is None else f"record {self.index}, {self.key}"
        return f"{where}: {_short(self.before)} -> {_short(self.after)}"


@dataclass
class Comparison:
    records: tuple[int, int]
    differences: list[Difference] = field(default_factory=list)
    allowed: dict[str, int] = field(default_factory=dict)  # allow-listed key -> records where it was accepted
    ignored: set[str] = field(default_factory=set)         # timing keys seen

    @property
    def identical(self) -> bool:
        return not self.differences


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_MISSING = _Absent()  # the value shown for a key a record lacks


def compare_records(before: list[dict], after: list[dict], allowed_new: set[str] | dict | None = None) -> Comparison:
    """Compare two runs' records in order. Timing keys (`is_timing_key`) are ignored; a key on one side only is a
    difference unless it is in `allowed_new` (default ALLOWED_NEW_KEYS) and on the `after` side; values must be
    equal as JSON text. Every difference is listed, first one first."""
    allowed_new = set(ALLOWED_NEW_KEYS if allowed_new is None else allowed_new)
    cmp = Comparison(records=(len(before), len(after)))
    if len(before) != len(after):
        cmp.differences.append(Difference(None, "records", len(before), len(after)))
    for i, (b, a) in enumerate(zip(before, after)):
        for k in list(dict.fromkeys([*b, *a])):
            if is_timing_key(k):
                cmp.ignored.add(k)
                continue
            if k not in b and k in allowed_new:
                cmp.allowed[k] = cmp.allowed.get(k, 0) + 1
                continue
            bv, av = b.get(k, _MISSING), a.get(k, _MISSING)
            if (k in b) != (k in a) or _canon(bv) != _canon(av):
                cmp.differences.append(Difference(i, k, bv, av))
    return cmp


def _short(v, n: int = 28) -> str:
    s = repr(v) if v is _MISSING else _canon(v)
    return s if len(s) <= n else s[: n - 1] + "…"


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------
# revisions, trees and runs


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def resolve(repo: Path, rev: str) -> str:
    try:
        return git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        sys.exit(f"same_numbers: '{rev}' is not a revision of {repo}")


def worktree(repo: Path, sha: str, out: Path, log) -> Path:
    """OUT/tree-<sha12>, a detached worktree at `sha` (reused when already there at that commit)."""
    path = out / f"tree-{sha[:12]}"
    if path.is_dir() and (path / ".git").exists():
        try:
            head = git(path, "rev-parse", "HEAD")
        except subprocess.CalledProcessError:
            head = None
        if head != sha:
            sys.exit(f"same_numbers: {path} exists but is at {head}, not {sha}; remove it (git worktree remove).")
        status = git(path, "status", "--porcelain", "--untracked-files=no")
        if status:
            sys.exit(f"same_numbers: {path} has local changes to tracked files:\n{status}\nremove it and rerun.")
        log(f"tree {sha[:12]}: reusing {path}")
        return path
    if path.exists():
        sys.exit(f"same_numbers: {path} exists and is not a git worktree; remove it.")
    try:
        git(repo, "worktree", "add", "--detach", str(path), sha)
    except subprocess.CalledProcessError as e:
        sys.exit(f"same_numbers: `git worktree add --detach {path} {sha[:12]}` failed:\n{e.stderr.strip()}")
    log(f"tree {sha[:12]}: created {path}")
    return path


@dataclass
class Side:
    name: str   # before | after
    rev: str
    sha: str
    tree: Path
    runs: Path  # where this side's run directories go
    env: dict


def child_env(tree: Path, sha: str, out: Path, threads: int) -> dict:
    env = dict(os.environ)
    for k in ("FLARE_CPU_ISA", "FLARE_CPU_ISA_PINNED"):  # a caller's own pin must not reach one side only
        env.pop(k, None)
    env.update(KERNEL_ENV)
    env.update({"PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree / 'paper' / 'src'}", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "FLARE_CACHE": str(out / "cache" / sha[:12]), "FLARE_QUIET": "1", "PYTHONHASHSEED": "0"})
    return env


def check_child(side: Side, python: str) -> str:
    """Check that a child process of this side imports `flare` from its tree; return the CPU kernel level torch
    dispatches to there (AVX2 under KERNEL_ENV on x86-64; the caller checks both sides agree)."""
    code = ("import os, flare, torch; print(os.path.realpath(flare.__file__)); "
            "print(torch.backends.cpu.get_cpu_capability(), torch.__version__)")
    got = subprocess.run([python, "-c", code], cwd=side.tree, env=side.env, capture_output=True, text=True)
    lines = got.stdout.split()
    want = os.path.realpath(side.tree / "src")
    if got.returncode != 0 or len(lines) < 2 or not lines[0].startswith(want + os.sep):
        sys.exit(f"same_numbers: in {side.tree}, `import flare` gives {got.stdout.strip() or got.stderr.strip()}, "
                 f"not a module under {want}")
    return " ".join(lines[1:3])  # e.g. "AVX2 2.14.1+cu130"


def list_presets(side: Side, python: str) -> list[str]:
    p = subprocess.run([python, "-m", "flare.cli", "presets"], cwd=side.tree, env=side.env, capture_output=True,
                       text=True)
    if p.returncode != 0:
        sys.exit(f"same_numbers: `flare presets` failed in {side.tree}:\n{p.stderr}")
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def needs_public(tree: Path, preset: str) -> bool:
    import yaml
    f = tree / "src" / "flare" / "presets" / f"{preset}.yaml"
    try:
        m = yaml.safe_load(f.read_text()) or {}
    except OSError:
        return False
    return bool((m.get("dataset") or {}).get("public_size"))


def finished(run_dir: Path) -> bool:
    """What a complete run leaves (src/flare/rundir.py): state.json {"status": "finished", "rounds_done": R} with R
    its config.yaml's rounds, and a metrics.jsonl."""
    try:
        st = json.loads((run_dir / "state.json").read_text())
        import yaml
        rounds = int((yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("rounds"))
    except (OSError, ValueError, TypeError):
        return False
    return (st.get("status") == "finished" and st.get("rounds_done") == rounds
            and (run_dir / "metrics.jsonl").is_file())


def main_presets(tree: Path) -> str:
    mk = tree / "Makefile"
    m = re.search(r"^PRESETS\s*\?=\s*(\S+)", mk.read_text(), re.M) if mk.is_file() else None
    return m.group(1) if m else MAIN_PRESETS_DEFAULT


@dataclass
class Job:
    label: str           # table row: a preset, or main:<preset> seed=N
    side: Side
    argv: list[str]      # after `python -m flare.cli`
    dirs: list[Path]     # run directories it produces (each compared)
    log_file: Path


class Progress:
    def __init__(self):
        self.t0 = time.time()
        self.lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        with self.lock:
            print(f"[{time.time() - self.t0:7.1f}s] {msg}", flush=True)


def run_job(job: Job, python: str, log: Progress) -> tuple[bool, str]:
    """(ok, why-not). A job whose directories are all finished is not run again."""
    tag = f"{job.label} @ {job.side.name} {job.side.sha[:12]}"
    if all(finished(d) for d in job.dirs):
        log(f"skip     {tag} (finished earlier)")
        return True, ""
    log(f"start    {tag}")
    t = time.time()
    job.log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(job.log_file, "w") as f:
        f.write(f"$ cd {job.side.tree} && {python} -m flare.cli {shlex.join(job.argv)}\n")
        f.flush()
        rc = subprocess.run([python, "-m", "flare.cli", *job.argv], cwd=job.side.tree, env=job.side.env, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    dt = time.time() - t
    if rc != 0 or not all(finished(d) for d in job.dirs):
        tail = [ln for ln in job.log_file.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        why = f"exit {rc}: {tail[0][:120] if tail else ''} (log: {job.log_file})"
        log(f"FAILED   {tag} after {dt:.1f}s — {why}")
        return False, why
    log(f"finished {tag} in {dt:.1f}s")
    return True, ""


def compare_fuses(args, sides: list[Side], presets: list[str], strategies: list[str], log) -> tuple[bool, list]:
    """`flare fuse` of each strategy over the same clients (each side's own run of each of `presets`: what a side's
    runs save for fuse is that side's to write, and the runs themselves are compared record by record), by each
    side's code, one strategy per process so a refusal of one does not hide the others; rows for the table."""
    import shutil
    rows, ok = [], True
    budget = hashlib.sha256(json.dumps(FUSE_BUDGET).encode()).hexdigest()[:8]
    for p in presets:
        if not all(finished(s.runs / p) for s in sides):
            rows.append([f"fuse:{p}", "-", "no", f"no finished run of {p} on both sides to fuse"])
            ok = False
            continue
        for name in strategies:
            outcome = {}
            for s in sides:
                d = s.runs.parent / f"fuse-{budget}-{s.name}-{s.sha[:12]}" / p / name
                done = d.parent / f"{name}.outcome.json"  # a side's fuse is kept, like its runs (resumable)
                if done.is_file():
                    outcome[s.name] = tuple(json.loads(done.read_text()))
                    continue
                if d.exists():
                    shutil.rmtree(d)
                shutil.copytree(s.runs / p, d, ignore=shutil.ignore_patterns("fuse.jsonl", ".lock", "plots"))
                own = [o for o in FUSE_BUDGET if o.startswith(f"server.strategies.{name}.")]  # fuse refuses others
                r = subprocess.run([args.python, "-m", "flare.cli", "fuse", str(d), "--strategies", name, *own],
                                   cwd=s.tree, env=s.env, capture_output=True, text=True)
                recs = read_records(d / "fuse.jsonl") if r.returncode == 0 else None
                said = r.stderr.replace(str(d), "RUN").strip().splitlines()[-1:] if r.returncode else []
                outcome[s.name] = (r.returncode, recs, said)
                done.write_text(json.dumps(outcome[s.name]))
            (rb, fb, eb), (ra, fa, ea) = outcome["before"], outcome["after"]
            label = f"fuse:{p} {name}"
            if rb == ra == 0:
                c = compare_records(fb, fa)
                first = c.differences[0].describe() if c.differences else ""
                rows.append([label, str(len(fa)), "yes" if c.identical else "no", first])
                ok &= c.identical
            else:
                same = rb == ra and eb == ea
                rows.append([label, "-", "yes (both refused)" if same else "no",
                             f"refused on both sides: {eb[0][:90] if eb else ''}" if same
                             else f"before exit {rb} {eb}, after exit {ra} {ea}"])
                ok &= same
            log(f"fused    {label}: {rows[-1][2]}")
    return ok, rows


# ----------------------------------------------------------------------------------------------


def comparison_row(label: str, c: Comparison) -> list[str]:
    """One row of the printed table: run, records (n, or n/m when the counts differ), identical, first difference."""
    n = str(c.records[0]) if c.records[0] == c.records[1] else f"{c.records[0]}/{c.records[1]}"
    first = c.differences[0].describe() if c.differences else ""
    first += f"  (+{len(c.differences) - 1} more)" if len(c.differences) > 1 else ""
    return [label, n, "yes" if c.identical else "no", first]


def compare_dirs(a: Path, b: Path) -> tuple[list[list[str]], bool, set[str]]:
    """Rows (run, records, identical, first difference), whether all are identical, the timing keys seen: every
    <method>/seed=N run directory holding a metrics.jsonl under either tree, against its namesake in the other."""
    runs = sorted({d.parent.relative_to(root) for root in (a, b) for d in root.glob("*/seed=*/metrics.jsonl")})
    rows, ok, ignored = [], bool(runs), set()
    for r in runs:
        fa, fb = a / r / "metrics.jsonl", b / r / "metrics.jsonl"
        if not (fa.is_file() and fb.is_file()):
            rows.append([str(r), "-", "no", f"only under {a if fa.is_file() else b}"])
            ok = False
            continue
        c = compare_records(read_records(fa), read_records(fb))
        ignored |= c.ignored
        rows.append(comparison_row(str(r), c))
        ok &= c.identical
    return rows, ok, ignored


def main_dirs(a: Path, b: Path) -> int:
    for d in (a, b):
        if not d.is_dir():
            print(f"same_numbers: {d} is not a directory of runs (<method>/seed=N/metrics.jsonl)", file=sys.stderr)
            return 2
    rows, ok, ignored = compare_dirs(a, b)
    if not rows:
        print(f"same_numbers: neither {a} nor {b} holds a <method>/seed=N/metrics.jsonl", file=sys.stderr)
        return 2
    print(f"A: {a}\nB: {b}\n\n" + table(rows, ["run", "records", "identical", "first difference (record, key: A -> B)"]))
    print(f"\nignored timing keys seen: {', '.join(sorted(ignored)) or 'none'}")
    print(f"\n{'ALL IDENTICAL' if ok else 'DIFFERENCES FOUND'} — {a} vs {b}, {len(rows)} run(s)")
    return 0 if ok else 1


def table(rows: list[list[str]], head: list[str]) -> str:
    w = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * x for x in w]), *map(line, rows)])


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="the revision before the refactor (any git revision)")
    ap.add_argument("--after", help="the revision after it")
    ap.add_argument("--dirs", nargs=2, type=Path, metavar=("A", "B"),
                    help="run nothing: compare two finished run trees (<method>/seed=N/) record by record")
    ap.add_argument("--presets", default="all", help="all (what `flare presets` lists) or a,b,c")
    ap.add_argument("--main-seed", type=int, default=None, help="also run the main job's command for this seed")
    ap.add_argument("--out", default="/tmp/same-numbers", help="worktrees, runs and logs (default %(default)s)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at the same time (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of each run, both sides (default 1)")
    ap.add_argument("--fuse", nargs="?", const=FUSE_STRATEGIES, default=None,
                    help="also compare `flare fuse` of these strategies over the before side's saved runs "
                         "(no value: %(const)s)")
    ap.add_argument("--fuse-runs", default="fafi,fedavg", help="the presets whose runs --fuse fuses (%(default)s)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter (default: this one)")
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="the git repository")
    args = ap.parse_args(argv)
    if args.dirs is None and not (args.before and args.after):
        ap.error("give --before REV and --after REV, or --dirs A B")
    if args.dirs is not None and (args.before or args.after):
        ap.error("--dirs compares two run trees; it takes no revisions")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dirs is not None:
        return main_dirs(*args.dirs)
    t_start = time.time()
    log = Progress()
    repo, out = Path(args.repo), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tiny_hash = hashlib.sha256(json.dumps([TINY, PUBLIC, args.threads]).encode()).hexdigest()[:8]
    runs_root = out / f"runs-{tiny_hash}"
    sides = []
    for name, rev in (("before", args.before), ("after", args.after)):
        sha = resolve(repo, rev)
        tree = worktree(repo, sha, out, log)
        sides.append(Side(name, rev, sha, tree, runs_root / f"{name}-{sha[:12]}",
                          child_env(tree, sha, out, args.threads)))
    kernels = {s.name: check_child(s, args.python) for s in sides}
    if kernels["before"] != kernels["after"]:
        sys.exit(f"same_numbers: the two sides' processes dispatch to different CPU kernels ({kernels})")
    before, after = sides
    print(f"before: {before.rev} = {before.sha}\nafter:  {after.rev} = {after.sha}\n"
          f"env (both): {' '.join(f'{k}={v}' for k, v in KERNEL_ENV.items())} OMP_NUM_THREADS={args.threads} "
          f"PYTHONPATH=<tree>/src:<tree>/paper/src; kernels, torch (both): {kernels['after']}; python: {args.python}\n"
          f"runs: {runs_root}", flush=True)

    listed = {s.name: list_presets(s, args.python) for s in sides}
    if args.presets == "all":
        presets = list(dict.fromkeys(listed["before"] + listed["after"]))
    else:
        presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = [p for p in presets if p not in listed["before"] and p not in listed["after"]]
    if unknown:
        sys.exit(f"same_numbers: unknown preset(s) {', '.join(unknown)}; both trees list: "
                 f"{', '.join(sorted(set(listed['before']) | set(listed['after'])))}")

    # pairs: (label, {side: job or None (preset missing there)})
    pairs: list[tuple[str, dict]] = []
    for p in presets:
        extra = PUBLIC if any(needs_public(s.tree, p) for s in sides) else []
        jobs = {}
        for s in sides:
            d = s.runs / p
            jobs[s.name] = (Job(p, s, ["run", "--quiet", "--preset", p, "--out", str(d), *TINY, *extra], [d],
                                s.runs / "logs" / f"{p}.log") if p in listed[s.name] else None)
        pairs.append((p, jobs))
    print(f"command (both trees): python -m flare.cli run --quiet --preset P --out DIR {shlex.join(TINY)}"
          f"  [+ {shlex.join(PUBLIC)} for presets with a public slice]", flush=True)
    if args.main_seed is not None:
        mp = main_presets(after.tree)
        for s in sides:
            if main_presets(s.tree) != mp:
                log(f"note: {s.name}'s Makefile PRESETS is {main_presets(s.tree)}; both sides run {mp}")
        cfg_texts = {s.name: (s.tree / "configs" / "main.yaml").read_text() for s in sides}
        if cfg_texts["before"] != cfg_texts["after"]:
            log("note: configs/main.yaml differs between the revisions (each tree runs its own)")
        jobs = {}
        for s in sides:
            d = s.runs / f"main-seed{args.main_seed}"
            dirs = [d / p / f"seed={args.main_seed}" for p in mp.split(",")]
            jobs[s.name] = Job(f"main seed={args.main_seed}", s,
                               ["compare", "--quiet", "--config", "configs/main.yaml", "--presets", mp, "--seeds",
                                str(args.main_seed), "--out", str(d)], dirs,
                               s.runs / "logs" / f"main-seed{args.main_seed}.log")
        print(f"main job (both trees): python -m flare.cli {shlex.join(jobs['after'].argv[:-2])} --out DIR", flush=True)
        pairs.append(("main", jobs))

    todo = [j for _, js in pairs for j in (js["before"], js["after"]) if j is not None]
    failed: dict[int, str] = {}
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for j, (ok, why) in zip(todo, pool.map(lambda j: run_job(j, args.python, log), todo)):
            if not ok:
                failed[id(j)] = why

    rows, all_ok, notes, ignored = [], True, [], set()
    for label, js in pairs:
        jb, ja = js["before"], js["after"]
        if jb is None or ja is None:
            all_ok = False
            rows.append([label, "-", "no", f"preset missing in {'before' if jb is None else 'after'}"])
            continue
        if id(jb) in failed or id(ja) in failed:
            all_ok = False
            rows.append([label, "-", "no", "run failed: " + "; ".join(
                f"{s}: {failed[id(j)]}" for s, j in (("before", jb), ("after", ja)) if id(j) in failed)])
            continue
        for db, da in zip(jb.dirs, ja.dirs):
            row_label = label if len(jb.dirs) == 1 else f"main:{db.parent.name} {db.name}"
            c = compare_records(read_records(db / "metrics.jsonl"), read_records(da / "metrics.jsonl"))
            ignored |= c.ignored
            rows.append(comparison_row(row_label, c))
            all_ok &= c.identical
            for k, cnt in c.allowed.items():
                notes.append(f"{row_label}: allow-listed key '{k}' only in after's records ({cnt} records)")
            if len(c.differences) > 1:
                keys = sorted({d.key for d in c.differences})
                notes.append(f"{row_label}: {len(c.differences)} differences, keys: {', '.join(keys)}")

    if args.fuse:
        fused_ok, fuse_rows = compare_fuses(args, sides, [p.strip() for p in args.fuse_runs.split(",")],
                                            [n.strip() for n in args.fuse.split(",")], log)
        rows += fuse_rows
        all_ok &= fused_ok
    print("\n" + table(rows, ["run", "records", "identical", "first difference (record, key: before -> after)"]))
    print(f"\nignored timing keys seen: {', '.join(sorted(ignored)) or 'none'}")
    for n in notes:
        print("note: " + n)
    print(f"\n{'ALL IDENTICAL' if all_ok else 'DIFFERENCES FOUND'} — {before.rev} ({before.sha[:12]}) vs "
          f"{after.rev} ({after.sha[:12]}), {len(rows)} run(s), wall {time.time() - t_start:.1f}s")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
