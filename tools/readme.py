"""Every generated block of the README and the docs pages, between markers, so that no table can drift from its
source. Each block has one page (`Static.page`, `Results.page`): the README keeps the main job's; the rest live on
the docs site's pages (docs/results/ for the results blocks), where `mkdocs build` shows them as they are.

    python tools/readme.py                 # rewrite the static blocks (presets, methods table, config reference)
                                           # and re-render every results block from its records or runs
    python tools/readme.py --run main      # run a results block's commands first (finished runs are kept),
                                           # then copy what it renders from into results/main/
    python tools/readme.py --run all       # every results block (about an hour on 2 CPU cores)
    python tools/readme.py --rebuild main  # render a block from results/main/ alone, running nothing (or `all`)
    python tools/readme.py --list          # the blocks and their commands
    python tools/readme.py --check         # exit 1 if a block is stale or was edited by hand (the tests run this)

A block is `<!-- BEGIN id sha=… -->` … `<!-- END id -->`; `sha` is a hash of its content, so a hand edit is
caught. A results block shows the exact commands it ran, the table rendered from their run directories, and
the machine it ran on (torch, threads, CPU): the same command gives the same digits only with the same torch
build, thread count and CPU kernels (docs/reproducibility.md).

A hash only says the text is what the generator once wrote, not that it is what today's records say. So a block's
records are committed: `--run` copies every file the block renders from (each command's `--out` directory and
`> file`, the figures it shows, the machine facts of the run) from the checkout's `runs/` into `results/<block>/`,
keeping the runs' configs, partitions, metrics, fuse records, states and summaries but never checkpoints or plots.
A record keeps its run's path relative to runs/ (`runs/main/fafi/seed=1` is recorded at
`results/main/main/fafi/seed=1`): so a block renders the same from either directory — its renderer is handed the
one or the other and joins the same relative paths — and no committed path sits under a directory that the
checkout's .gitignore ignores (`runs/`). A block with a `results/<block>/` directory is rendered from it alone,
and `--check` (the tests) renders it again and fails when the page's text differs — an edited record, or a block
left from older runs. Converting a block that has no records yet (the long ones: baselines, heterogeneous,
cpu-speed, ...) is `python tools/readme.py --run <block>` then committing `results/<block>/` with its page; if the
block's numbers changed, that is a finding to report before committing.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "paper" / "src"))  # flare_paper, the paper suite's own distribution

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flare.config import config_reference, config_reference_markdown, list_presets  # noqa: E402,F401 (tests read tool.config_reference)
from flare.config import preset_mapping  # noqa: E402
from flare_paper.reproduction import reproduction_markdown  # noqa: E402
from flare.report.compare import compare_markdown, compare_rows  # noqa: E402
from flare.report.fused import fused_table, fused_values, fused_vs_table  # noqa: E402
from flare.report.tables import fmt_ms, md_table  # noqa: E402
from flare.report.runs import Row  # noqa: E402
from flare.rundata import RunData  # noqa: E402
from flare.stats import holm, paired, verdict  # noqa: E402

README = ROOT / "README.md"
PATTERN = re.compile(r"<!-- BEGIN (?P<id>[\w-]+) sha=(?P<sha>\w+) -->\n(?P<body>.*?)<!-- END (?P=id) -->", re.S)


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------------------------
# static blocks: rendered from the code alone


def methods_table() -> str:
    """The notes' V-numbers → presets, and what each preset sets over the defaults."""
    def flat(m, prefix=""):
        for k, v in m.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            elif k not in ("description", "notes_name", "method", "preset"):
                yield f"`{prefix}{k}={v}`"

    rows = ["| notes | preset | config it sets (over the defaults) |", "| --- | --- | --- |"]
    for name in list_presets():
        m = preset_mapping(name)  # without the report metadata (label, color): what a run is configured with
        rows.append(f"| {m.get('notes_name', '')} | `{name}` | {', '.join(flat(m))} |")
    return "\n".join(rows) + "\n"


def methods_at_a_glance() -> str:
    """Each preset with the notes' name and its one-line description: the README's overview of the methods."""
    rows = ["| notes | preset | what it is |", "| --- | --- | --- |"]
    for name, m in list_presets().items():
        rows.append(f"| {m.get('notes_name', '')} | `{name}` | {' '.join(str(m.get('description', '')).split())} |")
    return "\n".join(rows) + "\n"


def config_table() -> str:
    return config_reference_markdown() + "\n"


def papers_table_keys() -> str:
    """Every key of a tools/papers.py table file (configs/papers/*.yaml), from the schema the tool checks them by."""
    spec = importlib.util.spec_from_file_location("papers_tool", ROOT / "tools" / "papers.py")
    papers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(papers)
    return papers.table_keys_markdown()


def plugin_source(path: str) -> Callable[[], str]:
    """A plugin module the tests import and run, shown whole on a docs page: the page cannot drift from the file."""
    return lambda: "```python\n" + (ROOT / path).read_text() + "```\n"


@dataclass
class Static:
    """A block rendered from the code alone (presets, schema), and the page (relative to the checkout) holding it."""
    render: Callable[[], str]
    page: str


STATIC = {"presets": Static(methods_at_a_glance, "README.md"),
          "methods": Static(methods_table, "docs/methods.md"),
          "config-reference": Static(config_table, "docs/configuration.md"),
          "papers-table-keys": Static(papers_table_keys, "docs/papers.md"),
          "extending-sends": Static(plugin_source("tests/plugins/flare_sending_plugin.py"), "docs/extending.md"),
          "cpu-vs-reference": Static(lambda: cpu_against_reference(), "docs/performance.md")}  # defined below


# ----------------------------------------------------------------------------------------------
# results blocks: commands, then a rendering of what they wrote


RUNS = ROOT / "runs"             # where the blocks' commands write (`--out runs/...`); never committed
OUT = RUNS / "readme"            # logs and machine facts of each block's last --run
IMG = ROOT / "docs" / "img"      # figures the blocks show (copied from the run directories)
RESULTS_DIR = ROOT / "results"   # the committed records: results/<block>/ mirrors the block's paths under runs/
CIFAR = "../shared/data/cifar10-jpg.tar.gz"
CIFAR_ARGS = f"dataset.name=cifar10 dataset.format=imagefolder dataset.root={CIFAR}"


@dataclass
class Results:
    id: str
    commands: list[str]  # each writes under runs/ (`--out runs/...`, `--record runs/...`, `> runs/...`)
    # the block's body from the files under a runs directory: the checkout's runs/ (RUNS) or the block's records
    # (results/<block>/); every path it joins is relative to runs/ (`base / "readme/x.json"`)
    render: Callable[[Path], str]
    figures: dict[str, str] = field(default_factory=dict)  # file relative to runs/ -> docs/img name
    page: str = "README.md"  # the file (relative to the checkout) whose markers hold the block
    # The figures a block keeps of its commands' `--record` outputs, read at --run into its facts file. Set for
    # benchmark timings: every run rewrites those files with new digits, so they are generated output, not records
    # to commit; the facts file keeps what the table shows. None: the outputs themselves are the records.
    keep: Callable[[Path], dict] | None = None

    def __post_init__(self):
        record_paths(self)  # a command that writes outside runs/ fails here, where the block is defined


def runs_relative(path: str) -> str:
    """A command's output (`runs/x`, as the command writes it) relative to runs/: the path its record keeps."""
    if not path.startswith("runs/"):
        raise ValueError(f"{path}: a results block's commands write under runs/ (its records keep the paths "
                         "relative to runs/)")
    return path.removeprefix("runs/")


def record_paths(block: Results) -> list[str]:
    """The paths (relative to runs/) a block is rendered from: each command's `--out`, `--record` and `> file`, the
    figures it shows and the machine facts of its last --run."""
    paths = [str(OUT.relative_to(RUNS) / f"{block.id}.json"), *block.figures]
    outputs = r"--out (\S+)" if block.keep is not None else r"--(?:out|record) (\S+)"  # kept: in the facts file
    for cmd in block.commands:
        paths += map(runs_relative, re.findall(outputs, cmd) + re.findall(r"> (\S+)", cmd))
    return list(dict.fromkeys(paths))


def _compare_rows(base: Path, out: str, presets: list[str], seeds: list[int] | None = None) -> list[tuple[dict, Row]]:
    rows = compare_rows([(p, [base / out / p] if not seeds else [base / out / p / f"seed={s}" for s in seeds])
                         for p in presets])
    for _, row in rows:
        if not all(r.rounds for r in row.runs):
            raise FileNotFoundError(f"{out}/{row.label}: no finished run (run the block first)")
    return rows


def compare_block(out: str, presets: list[str], seeds: list[int] | None = None) -> Callable[[Path], str]:
    """What `flare compare` printed: the table, then each method against FAFI, paired by seed."""
    return lambda base: compare_markdown(_compare_rows(base, out, presets, seeds)) + "\n"


def section_of(report: str, heading: str) -> Callable[[Path], str]:
    """The table under `## heading` of a report.md (what the command printed)."""
    def render(base: Path) -> str:
        text = (base / report).read_text()
        part = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
        return "\n".join(ln for ln in part.splitlines() if ln.startswith("|")) + "\n"
    return render


def reproduction(out: str) -> Callable[[Path], str]:
    """The reproduction report's markdown, its headings moved under its page's section, its figure in docs/img."""
    def render(base: Path) -> str:
        md = reproduction_markdown(base / out, image_dir=IMG)
        md = re.sub(r"^(#+) ", lambda m: "#" * (len(m[1]) + 2) + " ", md, flags=re.M)
        return md.replace(f"]({IMG.name}/", f"](docs/{IMG.name}/") + "\n"
    return render


def pytest_summary(base: Path) -> str:
    log = (base / OUT.relative_to(RUNS) / "tests.log").read_text().strip().splitlines()
    return f"`{log[-1].strip('= ')}`\n"


def efficiency_table(base: Path) -> str:
    rows = ["| config | bare fwd+bwd+step (samples/s) | end-to-end local training (samples/s) | efficiency |",
            "| --- | --- | --- | --- |"]
    for name in ("efficiency-resnet18", "efficiency-cnn"):
        text = (base / OUT.relative_to(RUNS) / f"{name}.out").read_text()
        conf = re.search(r"config: (.*)", text).group(1)
        bare, e2e, eff = (re.search(rf"{k}\s*:\s*([\d.]+)", text).group(1)
                          for k in ("bare fwd\+bwd\+step|bare forward\+backward\+step", "end-to-end local training",
                                    "efficiency"))
        rows.append(f"| {conf} | {bare} | {e2e} | {eff} |")
    return "\n".join(rows) + "\n"


AUGMENT_SCHEDULE_RUNS = {  # name -> efficiency.py's arguments: the main job's model and batch, and the issue's
    "fmnist-cnn0.5-b64": "dataset.name=fmnist batch_size=64 model.name=cnn model.width=0.5 --steps 30 --repeats 9",
    "fmnist-cnn0.25-b64": "dataset.name=fmnist batch_size=64 model.name=cnn model.width=0.25 --steps 30 --repeats 9",
    "cifar-cnn0.25-b512": "model.name=cnn model.width=0.25 --steps 4 --repeats 5",
}


AUGMENT_SCHEDULES = "per_batch,chunked,chunked+separable"  # augment.schedule[+augment.crop], one column each


def augment_schedule_kept(base: Path) -> dict:
    """The runs' `efficiency.py --record` outputs, by run name: what the block's facts file keeps of them."""
    return {name: json.loads((base / OUT.relative_to(RUNS) / f"augment-schedule-{name}.json").read_text())
            for name in AUGMENT_SCHEDULE_RUNS}


def augment_schedule_table(base: Path) -> str:
    """efficiency.py --schedules: each schedule's end to end ÷ the bare step, from what the facts file kept of the
    runs' JSON records."""
    rows = ["| config | load average before / after | bare step (samples/s, median) | per_batch ÷ bare (median) | "
            "chunked ÷ bare (median) | chunked+separable ÷ bare (median) |", "| --- | --- | --- | --- | --- | --- |"]
    kept = json.loads((base / OUT.relative_to(RUNS) / "augment-schedule.json").read_text())["kept"]
    for name in AUGMENT_SCHEDULE_RUNS:
        r = kept[name]
        bare = r["bare_step"]["median"]
        load = " / ".join("/".join(f"{v:.2f}" for v in r[k]) for k in ("load_before", "load_after"))
        rows.append(f"| {r['config']} | {load} | {bare:.0f} | " + " | ".join(
            f"{r['schedules'][s]['median'] / bare:.3f}" for s in AUGMENT_SCHEDULES.split(",")) + " |")
    return "\n".join(rows) + "\n"


MAX_POOL_MODELS = "cnn@0.25,cnn@0.5,simple-cnn@1,cnn_mnist_dense@1"  # the main job's CNN and the papers' tables'


def max_pool_table(base: Path) -> str:
    """benchmarks/max_pool.py --record: torch's pool against flare's, rendered by the benchmark's own row format."""
    bench = _script("benchmarks/max_pool.py")
    rec = json.loads((base / OUT.relative_to(RUNS) / "max-pool-record.json").read_text())
    return f"{rec['setting']}.\n\n" + "\n".join([bench.HEADER, *map(bench.table_row, rec["rows"])]) + "\n"


def kernels_table(dirs: dict[str, str]) -> Callable[[Path], str]:
    """The same command under each kernel level: what torch dispatched to (state.json) and the digits it gave."""
    def render(base: Path) -> str:
        rows = ["| run | cpu_isa | CPU kernels torch dispatched to | final acc (feature) | peak (round) |",
                "| --- | --- | --- | --- | --- |"]
        for label, d in dirs.items():
            b = json.loads((base / d / "state.json").read_text()).get("backend", {})
            run = RunData.load(base / d)
            best, at = run.peak("acc")
            rows.append(f"| {label} | `{b.get('cpu_isa')}` | {b.get('cpu_kernels')} | {100 * run.final('acc'):.2f} | "
                        f"{100 * best:.2f} ({at}) |")
        return "\n".join(rows) + "\n"
    return render


def _script(path: str):
    """A script of this checkout (tools/…, benchmarks/…) as a module: they are not a package, and a block renders
    through the script's own functions so the page and the script cannot disagree."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_paths_table(out: str, paths: list[str]) -> Callable[[Path], str]:
    """tools/kernel_paths.py's table, computed again from the runs under `out` (not from its printed copy)."""
    def render(base: Path) -> str:
        kp = _script("tools/kernel_paths.py")
        results = {p: kp.path_results(base / out, p, MAIN_PRESETS) for p in paths}
        rows = kp.analyse(results, MAIN_PRESETS)
        final = ", ".join(sorted({results[p]["final"] for p in paths}))
        return kp.markdown(rows, results, [], final) + "\n"
    return render


def frozen_encoder_block(base: Path) -> str:
    """tools/frozen_grid.py's tables, computed from the finished runs under base (docs/frozen-encoder.md)."""
    grid = _script("tools/frozen_grid.py")
    return grid.render(base)


def frozen_224_commands() -> list[str]:
    """The 224 grid, and the closed-form rows of each other encoder whose runs exist (its cache is a background job
    of hours: the block gains its command once the rows do)."""
    cmds = ["python tools/frozen_grid.py --grid 224 --out runs/frozen-encoder-224/grid"]
    for enc in ("efficientnet_lite1", "efficientnet_lite2"):
        rel = f"frozen-encoder-224/{enc}"
        if (RUNS / rel).is_dir() or (RESULTS_DIR / "frozen-encoder-224" / rel).is_dir():
            cmds.append(f"python tools/frozen_grid.py --grid 224 --encoder {enc} --out runs/{rel}")
    rel = "frozen-encoder-224/mirrored"  # the closed-form heads with the mirror images in their statistics
    if (RUNS / rel).is_dir() or (RESULTS_DIR / "frozen-encoder-224" / rel).is_dir():
        cmds.append(f"python tools/frozen_grid.py --grid 224 --mirrored --seed-major --out runs/{rel}")
    return cmds


def frozen_encoder_224_block(base: Path) -> str:
    """The 224 px grid and tools/frozen_bounds.py's independent bounds beside it (docs/frozen-encoder.md)."""
    return _script("tools/frozen_grid.py").render_224(base)


def gpu_lease_block(calls: list[str]) -> Callable[[Path], str]:
    """tools/gpu_lease.py's tables of what each `benchmarks/gpu_suite.sh lease` call brought back."""
    def render(base: Path) -> str:
        lease = _script("tools/gpu_lease.py")
        return lease.render(base / "gpu-lease", calls)
    return render


def cpu_profile_block(record: str) -> Callable[[Path], str]:
    """benchmarks/cpu_profile.py's tables, rendered by the benchmark's own `markdown` from its JSON record."""
    def render(base: Path) -> str:
        bench = _script("benchmarks/cpu_profile.py")
        return bench.markdown(json.loads((base / record).read_text()))
    return render


# The cpu_profile blocks that ran the reference's own setting with no kernel cap: a CPU type each, and FLARE's exact
# and fast profiles there against the reference's wall time on that type.
REFERENCE_SETTING_BLOCKS = ("cpu-speed", "cpu-avx2-only")


def cpu_against_reference() -> str:
    """One row per CPU type: the reference's wall time (ours where reference_fafi.py timed it, else the figure we
    were given) beside FLARE's exact and fast profiles, from the committed records of the blocks that ran its
    setting, and the CPU types the reference was timed on where FLARE has no uncapped record."""
    bench = _script("benchmarks/cpu_profile.py")
    out = ["| CPU | the reference (OursV4), wall | FLARE exact (default), wall | FLARE `speed=fast`, wall | record |",
           "| --- | --- | --- | --- | --- |"]
    cpus = []
    for b in REFERENCE_SETTING_BLOCKS:
        rec = json.loads((records_of(RESULTS[b]) / f"readme/{b}-record.json").read_text())
        by, ref = {r["profile"]: r for r in rec["rows"]}, bench.reference(rec)
        where = f"[{b}]({RESULTS[b].page.removeprefix('docs/')})" if RESULTS[b].page != "docs/performance.md" \
            else f"the {b} block on this page"
        if ref is None:
            ref_txt, times = "never timed on this CPU type", lambda p: f"{by[p]['wall']:.1f} s"
        else:
            own = bench.timed_here(rec["machine"]["cpu"])
            ref_txt = f"{ref[1]:.1f} s, " + (f"timed here {own['date']} (reference_fafi.py)" if own
                                             else "the figure we were given")
            times = lambda p: f"{by[p]['wall']:.1f} s ({ref[1] / by[p]['wall']:.2f}× faster)"  # noqa: E731
            cpus.append(rec["machine"]["cpu"])
        out.append(f"| {rec['machine']['cpu']} | {ref_txt} | {times('exact')} | {times('fast')} | {where}, "
                   f"{rec['date']} |")
    out += [f"| {model} ({isa}) | {secs:.1f} s, the figure we were given | not measured: no such CPU at hand | "
            "not measured | — |" for model, isa, secs in bench.REFERENCE_TIMES
            if not any(bench.of_type(cpu, model, isa) for cpu in cpus)]
    return "\n".join(out) + "\n"


def step_flops_block(base: Path) -> str:
    """benchmarks/step_flops.py's table, rendered by the benchmark's own `markdown` from its JSON record."""
    rec = json.loads((base / OUT.relative_to(RUNS) / "step-flops-record.json").read_text())
    return _script("benchmarks/step_flops.py").markdown(rec)


def file_text(path: str) -> Callable[[Path], str]:
    return lambda base: (base / path).read_text().strip() + "\n"


MAIN_PRESETS = ["fafi", "fedavg", "ensemble", "etf-anneal", "flare"]
MAIN_SEEDS = [1, 2, 3, 4, 5]
UX = ("flare run --preset fafi dataset.name=fmnist num_clients=5 rounds=5 batch_size=64 model.name=cnn "
      "model.width=0.5 dataset.train_subset=10000 dataset.test_subset=2000 partition.alpha=0.05 seed=1")
ALIGN_PRESETS = ["fafi", "drcl", "drcl-anneal", "etf-anneal", "entropy-lambda", "decoupled", "flare"]
CIFAR_SMALL = (f"{CIFAR_ARGS} dataset.train_subset=10000 dataset.test_subset=2000 model.name=cnn model.width=0.5 "
               "num_clients=5 rounds=5 batch_size=64")

# The one-shot baselines (docs/baselines.md): clients trained once per method and seed, every server strategy over the same
# saved uploads. The data-free servers and FedDF run far fewer steps than published (their defaults stay the
# config's defaults, for GPU runs): the block must fit ~90 minutes on 2 cores.
BASELINE_PRESETS = ["fafi", "etf-anneal", "flare", "fedavg"]
BASELINE_STRATEGIES = ["otfusion", "regmean", "fedlpa", "feddf", "dense", "coboosting", "intactofl", "fens",
                       "bnrecal", "fedproto", "fedproto_fused"]
BNBATCH_PRESETS = ["fafi", "etf-anneal", "flare"]  # eval.bn=batch changes the feature rules only: prototype heads
BASELINE_ARGS = (f"{CIFAR_ARGS} dataset.train_subset=10000 dataset.test_subset=2000 dataset.public_size=1000 "
                 "model.name=cnn model.width=0.5 num_clients=5 rounds=1 local_epochs=2 batch_size=64 "
                 "server.strategies.feddf.steps=300 server.strategies.dense.epochs=3 server.strategies.dense.g_steps=8 "
                 "server.strategies.dense.synthesis_batch=128 server.strategies.dense.batch_size=128 "
                 "server.strategies.coboosting.epochs=3 server.strategies.coboosting.g_steps=8")
# options `flare fuse` takes anew over the saved clients: a strategy that joined after they were trained gets its
# budget here, not in their config (IntactOFL: DENSE's budget above)
BASELINE_FUSE_ARGS = "server.strategies.intactofl.epochs=3 server.strategies.intactofl.g_steps=8"


def baselines_block(base: Path) -> str:
    """Per α: every strategy's accuracy over each method's clients (mean ± std over 3 seeds) and its cost, then every
    cell against FAFI's own feature fusion over FAFI clients, paired by seed — and what that says, in words."""
    out = []
    for a in (0.05, 0.5):
        rows = [row for _, row in _compare_rows(base, f"readme/baselines-a{a}", BASELINE_PRESETS, [1, 2, 3])]
        names = ["feature", "output", "fedavg", *BASELINE_STRATEGIES]
        vs = fused_vs_table(rows, names, "fafi", "feature")
        # the same clients (training does not read eval.bn) evaluated with per-batch BN statistics, the reference's
        # accident that BN recalibration answers: its feature fusion beside bnrecal's
        batch = {row.label: row for _, row in _compare_rows(base, f"readme/baselines-a{a}-bnbatch",
                                                             BNBATCH_PRESETS, [1, 2, 3])}
        bn_cells = [fmt_ms(*batch[r.label].stat("acc_feature")[:2]) if r.label in batch else "—" for r in rows]
        table = fused_table(rows, names).rstrip("\n") + "\n| feature, eval.bn=batch | " + " | ".join(bn_cells) + " | — |"
        up = [ln.split(" | ")[:2] for ln in vs.splitlines() if "higher (significant)" in ln]
        down = [ln.split(" | ")[:2] for ln in vs.splitlines() if "lower (significant)" in ln]
        said = lambda cells: ", ".join(f"{s.strip('| ')} on {c}" for s, c in cells) or "none"  # noqa: E731
        out += [f"α = {a} — accuracy (%) over each method's clients, mean ± std over seeds 1–3, and the strategy's "
                "mean wall time per run (built-in rules: scored in the run itself; the last row: the same clients' "
                "feature fusion with per-batch BatchNorm statistics, `eval.bn=batch`):", "", table, "",
                "Against FAFI's own server (feature fusion over FAFI clients), paired by seed:", "", vs, "",
                f"At this scale, significantly above FAFI's feature fusion: {said(up)}; significantly below: "
                f"{said(down)}; every other cell is not distinguishable from it with 3 seeds.", ""]
    return "\n".join(out)


# Clients of different architectures (docs/heterogeneous.md): DENSE's five-network setting against five ResNet-18
# clients, each client method through feature fusion and the output ensemble, and the distilling servers over the
# plain (CE) clients; paired by seed (a seed fixes the partition, the test subset and the public slice).
HETERO_PRESETS = ["fafi", "etf-anneal", "flare", "ensemble"]
HETERO_RUNS = {"homogeneous": "readme/hetero-homogeneous", "mixed": "readme/hetero-mixed"}
HETERO_DATAFREE = "2 epochs of 5 generator steps (the published 200 × 30)"
HETERO_CELLS = [(p, s) for p in ("fafi", "etf-anneal", "flare") for s in ("feature", "output", "bnrecal")] + \
    [("ensemble", s) for s in ("output", "feddf", "dense", "coboosting", "bnrecal")]


def _heterogeneous_figure(vals: dict, path: Path) -> None:
    """One bar pair per (clients, server): homogeneous and mixed, mean over seeds with each seed as a dot."""
    import matplotlib.pyplot as plt  # lazy: only this block draws here
    from flare.report.figures import save_figure

    fig, ax = plt.subplots(figsize=(11, 3.8))
    for j, (k, colour) in enumerate((("homogeneous", "#4c72b0"), ("mixed", "#dd8452"))):
        xs = [i + (j - 0.5) * 0.38 for i in range(len(HETERO_CELLS))]
        ys = [100 * float(np.mean(list(vals[k, p, s].values()))) for p, s in HETERO_CELLS]
        ax.bar(xs, ys, width=0.36, color=colour, label=f"{k} ({'5 × ResNet-18' if k == 'homogeneous' else '5 architectures'})")
        for x, (p, s) in zip(xs, HETERO_CELLS):
            pts = [100 * v for v in vals[k, p, s].values()]
            ax.plot([x] * len(pts), pts, "o", color="black", ms=2.5)
    short = {"fafi": "FAFI", "etf-anneal": "V7", "flare": "FLARE", "ensemble": "CE clients"}
    ax.set_xticks(range(len(HETERO_CELLS)), [f"{short.get(p, p)}\n{s}" for p, s in HETERO_CELLS], fontsize=7)
    ax.set(ylabel="test accuracy (%)", title="Clients of different architectures: each server over the same "
                                              "clients, 3 seeds (dots)")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)


def heterogeneous_block(base: Path) -> str:
    """Each (clients, server) cell over both settings with the mixed − homogeneous difference paired by seed, then
    feature fusion of V7 and FLARE clients against FAFI's in each setting — and what that says, in words."""
    rows = {k: dict(zip(HETERO_PRESETS, (row for _, row in _compare_rows(base, out, HETERO_PRESETS, [1, 2, 3]))))
            for k, out in HETERO_RUNS.items()}
    vals = {(k, p, s): fused_values(rows[k][p], s) for k in HETERO_RUNS for p, s in HETERO_CELLS}
    label = {p: rows["mixed"][p].runs[0].cfg.get("notes_name") or p for p in HETERO_PRESETS}

    def ms(v: dict) -> str:
        x = list(v.values())
        return fmt_ms(float(np.mean(x)), float(np.std(x, ddof=1)) if len(x) > 1 else math.nan) if x else "—"

    def tested(pairs):  # [(a, b)] → [(Paired, Holm-adjusted p)], adjusted over the table
        ts = [paired(a, b) for a, b in pairs]
        return list(zip(ts, holm([t.p for t in ts])))

    def cells(t, pa):
        ci = f"[{100 * t.low:+.2f}, {100 * t.high:+.2f}]" if t.testable else "—"
        return [f"{100 * t.mean:+.2f}", ci, f"{t.p:.3g}" if t.testable else "—", f"{pa:.3g}" if t.testable else "—",
                verdict(t, pa)]

    diff = tested([(vals["mixed", p, s], vals["homogeneous", p, s]) for p, s in HETERO_CELLS])
    body = [[label[p], s, ms(vals["homogeneous", p, s]), ms(vals["mixed", p, s]), *cells(t, pa)]
            for (p, s), (t, pa) in zip(HETERO_CELLS, diff)]
    t1 = md_table(["clients", "server", "homogeneous (5 × ResNet-18)", "mixed (5 architectures)",
                   "Δ mixed − homogeneous (points)", "95 % CI", "p (paired t)", "p (Holm)", "difference"], body)
    vs = [(k, p) for k in HETERO_RUNS for p in ("etf-anneal", "flare")]
    anchor = tested([(vals[k, p, "feature"], vals[k, "fafi", "feature"]) for k, p in vs])
    t2 = md_table(["setting", "clients", "Δ feature fusion vs FAFI's (points)", "95 % CI", "p (paired t)", "p (Holm)",
                   "difference"], [[k, label[p], *cells(t, pa)] for (k, p), (t, pa) in zip(vs, anchor)])
    mean = lambda k, p, s: 100 * float(np.mean(list(vals[k, p, s].values())))  # noqa: E731
    methods = ("fafi", "etf-anneal", "flare")
    lost = ", ".join(f"{mean('mixed', p, 'feature') - mean('homogeneous', p, 'feature'):+.2f} ({label[p]})"
                     for p in methods)
    ensemble = ", ".join(f"{mean('mixed', p, 'output') - mean('homogeneous', p, 'output'):+.2f}" for p in methods)
    below = ", ".join(f"{mean('mixed', p, 'feature') - mean('mixed', p, 'output'):+.2f}" for p in methods)
    mixed_vs = [(p, t, pa) for (k, p), (t, pa) in zip(vs, anchor) if k == "mixed"]
    helped = [label[p] for p, t, pa in mixed_vs if pa < 0.05 and t.mean > 0]
    answer = (f"**Yes, for {', '.join(helped)}**" if helped else "**No, not at this scale**")
    text = (f"Did the anchors make heterogeneous feature fusion work? {answer}: against FAFI's clients, mixed, V7 "
            "and FLARE clients' feature fusion differ by " + " and ".join(
                f"{100 * t.mean:+.2f} points [{100 * t.low:+.2f}, {100 * t.high:+.2f}] ({verdict(t, pa)})"
                for _, t, pa in mixed_vs) + ". Going from five ResNet-18 clients to five architectures, feature "
            f"fusion moved by {lost} points, the output ensemble over the same clients by {ensemble}; over the mixed "
            f"clients feature fusion ends {below} points from their output ensemble (FAFI, V7, FLARE). Three seeds, "
            "3 rounds of 1,000 images per client: a gap smaller than the seeds' spread is not resolved here.")
    chance = 100 / len(rows["mixed"]["ensemble"].runs[0].partition["clients"][0]["class_histogram"])
    idle = [n for n in ("dense", "coboosting") if all(mean(k, "ensemble", n) < 1.5 * chance for k in HETERO_RUNS)]
    if idle:
        text += (f" {' and '.join(idle)} stay near chance ({chance:.0f} %) in both settings: "
                 f"{HETERO_DATAFREE} leave their students untrained at this budget, so those rows say nothing about "
                 "architectures.")
    _heterogeneous_figure(vals, IMG / "heterogeneous.png")
    return ("Accuracy (%) after the last round, mean ± std over seeds 1–3; the servers a run does not evaluate itself "
            "(FedDF, DENSE, Co-Boosting, BN recalibration) are `flare fuse` over its saved clients. Paired by seed "
            "(same partition, test subset and public slice), Holm-adjusted over each table:\n\n"
            "![every server over homogeneous and mixed clients](docs/img/heterogeneous.png)\n\n" + t1
            + "\n\nDo the anchors make feature fusion work across architectures? V7 and FLARE clients against FAFI "
            "clients, feature fusion, paired by seed:\n\n" + t2 + "\n\n" + text + "\n")


RESULTS = {r.id: r for r in [
    Results("main", ["flare compare --config configs/main.yaml --presets " + ",".join(MAIN_PRESETS) +
                     f" --seeds {','.join(map(str, MAIN_SEEDS))} --workers 2 --out runs/main"],
            compare_block("main", MAIN_PRESETS, MAIN_SEEDS),
            {"main/compare_accuracy.png": "main-accuracy.png"}),
    Results("kernel-paths", ["python tools/kernel_paths.py --paths avx2,avx512,default --out runs/kernel-paths"],
            kernel_paths_table("kernel-paths", ["avx2", "avx512", "default"]),
            page="docs/reproducibility.md"),
    Results("cifar-baselines",
            [f"flare compare --presets fafi,fedavg,ensemble {CIFAR_SMALL} partition.alpha={a} --out runs/readme/cifar-a{a}"
             for a in (0.05, 0.5)],
            lambda base: "\n".join(f"α = {a}:\n\n" + compare_block(f"readme/cifar-a{a}",
                                                                        ["fafi", "fedavg", "ensemble"])(base)
                                   for a in (0.05, 0.5)),
            page="docs/results/cifar-baselines.md"),
    Results("alignment",
            [f"flare compare --presets {','.join(ALIGN_PRESETS)} {CIFAR_SMALL} partition.alpha=0.05 "
             "--out runs/readme/alignment"],
            compare_block("readme/alignment", ALIGN_PRESETS),
            {"readme/alignment/compare_diagnostics.png": "alignment-diagnostics.png",
             "readme/alignment/flare/plots/lambda.png": "flare-lambda.png"},
            page="docs/results/alignment.md"),
    Results("paper-cpu",
            [f"flare paper --scale cpu --datasets cifar10 --only table1,ablation --data-root cifar10={CIFAR} "
             "--out runs/readme/paper-cpu"],
            section_of("readme/paper-cpu/report/report.md", "Table 1"),
            {"readme/paper-cpu/report/figure1_accuracy.png": "paper-cpu-figure1.png",
             "readme/paper-cpu/report/figure2_lambda_eff.png": "paper-cpu-figure2.png"},
            page="docs/results/paper-cpu.md"),
    Results("reproduce-cpu",
            [f"flare paper --scale cpu --only reproduce --datasets cifar10 --data-root cifar10={CIFAR} "
             "--out runs/readme/reproduce-cpu"],
            reproduction("readme/reproduce-cpu"),
            page="docs/results/reproduce-cpu.md"),
    Results("efficiency-cpu",
            ["python benchmarks/efficiency.py model.name=resnet18 model.width=0.25 --steps 6 --repeats 2 "
             "> runs/readme/efficiency-resnet18.out",
             "python benchmarks/efficiency.py model.name=cnn model.width=1.0 --steps 6 --repeats 2 "
             "> runs/readme/efficiency-cnn.out"],
            efficiency_table,
            page="docs/results/efficiency-cpu.md"),
    Results("augment-schedule",
            [f"OMP_NUM_THREADS=1 python benchmarks/efficiency.py {args} --clock cpu --schedules {AUGMENT_SCHEDULES} "
             f"--record runs/readme/augment-schedule-{name}.json" for name, args in AUGMENT_SCHEDULE_RUNS.items()],
            augment_schedule_table,
            page="docs/performance.md", keep=augment_schedule_kept),
    Results("max-pool",
            [f"OMP_NUM_THREADS=1 python benchmarks/max_pool.py --models {MAX_POOL_MODELS} --repeats 15 "
             "--record runs/readme/max-pool-record.json"],
            max_pool_table, page="docs/performance.md"),
    Results("step-flops",  # the main job's step, the bare step and a single-thread SGEMM, in FLOP/s
            ["OMP_NUM_THREADS=1 python benchmarks/step_flops.py --steps 30 --repeats 7 --clock cpu "
             "--options nhwc,nomkldnn,compiled,batched5 --record runs/readme/step-flops-record.json"],
            step_flops_block, page="docs/performance.md"),
    Results("kernels",
            [f"{UX} --out runs/readme/ux-pinned", f"{UX} cpu_isa=native --out runs/readme/ux-native"],
            kernels_table({"default": "readme/ux-pinned", "`cpu_isa=native`": "readme/ux-native"}),
            page="docs/results/kernels.md"),
    Results("cpu-speed",  # the reference's own setting on this CPU: exact, native, fast and the bare-kernel probe
            [f"python benchmarks/cpu_profile.py --data-root {CIFAR} --out runs/readme/cpu-speed --record "
             "runs/readme/cpu-speed-record.json"],
            cpu_profile_block("readme/cpu-speed-record.json"),
            page="docs/results/cpu-speed.md"),
    Results("gpu-lease",  # device calls (docs/performance.md); each $OUT fetched to runs/gpu-lease/callN
            ["DEADLINE=565 bash benchmarks/gpu_suite.sh lease    # call1",
             "EFFICIENCY=0 FULL_LIMIT=225 DEADLINE=250 bash benchmarks/gpu_suite.sh lease    # call2",
             "DEADLINE=565 FULL_ROUNDS=3 FULL_LIMIT=80 EFFICIENCY=0 TABLE_WORKERS=2 TABLE_ENGINE=sequential "
             "EXTRA=eval.every=5 bash benchmarks/gpu_suite.sh lease    # call3",
             "bash results/gpu-lease/gpu-lease/call4/command.sh    # call4: 4 rounds sequential, 4 compiled"],
            gpu_lease_block(["call1", "call2", "call3", "call4"]),
            page="docs/performance.md"),
    Results("cpu-profile",
            [f"python benchmarks/cpu_profile.py --data-root {CIFAR} --train-subset 1000 --test-subset 200 "
             "--set model.width=0.25 --out runs/readme/cpu-profile --record runs/readme/cpu-profile-record.json"],
            cpu_profile_block("readme/cpu-profile-record.json"),
            page="docs/performance.md"),
    Results("cpu-emulated-no-bf16",  # an Intel AVX512 Xeon without bf16, as far as oneDNN can be told to be one
            [f"python benchmarks/cpu_profile.py --data-root {CIFAR} --onednn-isa AVX512_CORE_VNNI "
             "--out runs/readme/cpu-emulated --record runs/readme/cpu-emulated-record.json"],
            cpu_profile_block("readme/cpu-emulated-record.json"),
            page="docs/performance.md"),
    Results("cpu-emulated-no-bf16-small",  # the same at the small setting: a run too short to be probed
            [f"python benchmarks/cpu_profile.py --data-root {CIFAR} --onednn-isa AVX512_CORE_VNNI --train-subset 1000 "
             "--test-subset 200 --set model.width=0.25 --out runs/readme/cpu-emulated-small --record "
             "runs/readme/cpu-emulated-small-record.json"],
            cpu_profile_block("readme/cpu-emulated-small-record.json"),
            page="docs/performance.md"),
    Results("cpu-emulated-avx2",  # an AVX2-only CPU, as far as ATen, oneDNN and MKL can be told to be one
            [f"python benchmarks/cpu_profile.py --data-root {CIFAR} --avx2-only --out runs/readme/cpu-avx2 --record "
             "runs/readme/cpu-avx2-record.json"],
            cpu_profile_block("readme/cpu-avx2-record.json"),
            page="docs/performance.md"),
    Results("cpu-avx2-only",  # the same on a CPU that is AVX2-only (no cap): the machine the block above emulates
            [f"python benchmarks/cpu_profile.py --data-root {CIFAR} --out runs/readme/cpu-avx2-only --record "
             "runs/readme/cpu-avx2-only-record.json"],
            cpu_profile_block("readme/cpu-avx2-only-record.json"),
            page="docs/performance.md"),
    Results("baselines",
            [cmd for a in (0.05, 0.5) for cmd in (
                f"flare compare --presets {','.join(BASELINE_PRESETS)} --seeds 1,2,3 {BASELINE_ARGS} "
                f"partition.alpha={a} --out runs/readme/baselines-a{a}",
                f"flare fuse runs/readme/baselines-a{a}/*/seed=* --strategies {','.join(BASELINE_STRATEGIES)} "
                f"{BASELINE_FUSE_ARGS}",
                f"flare compare --presets {','.join(BNBATCH_PRESETS)} --seeds 1,2,3 {BASELINE_ARGS} partition.alpha={a} "
                f"eval.bn=batch --out runs/readme/baselines-a{a}-bnbatch")],
            baselines_block,
            page="docs/results/baselines.md"),
    Results("heterogeneous",
            [f"flare compare --config configs/heterogeneous.yaml --presets {','.join(HETERO_PRESETS)} --seeds 1,2,3 "
             "--out runs/readme/hetero-mixed",
             f"flare compare --config configs/heterogeneous.yaml --presets {','.join(HETERO_PRESETS)} --seeds 1,2,3 "
             "model.clients=null --out runs/readme/hetero-homogeneous",
             "flare fuse runs/readme/hetero-*/ensemble/seed=* --strategies feddf,dense,coboosting,bnrecal",
             "flare fuse runs/readme/hetero-*/fafi/seed=* runs/readme/hetero-*/etf-anneal/seed=* "
             "runs/readme/hetero-*/flare/seed=* --strategies bnrecal"],
            heterogeneous_block,
            page="docs/results/heterogeneous.md"),
    Results("frozen-encoder", ["python tools/frozen_grid.py --out runs/frozen-encoder"], frozen_encoder_block,
            page="docs/frozen-encoder.md"),
    Results("frozen-encoder-224", frozen_224_commands(), frozen_encoder_224_block, page="docs/frozen-encoder.md"),
    Results("encoder-speed", ["python benchmarks/encoder.py --resolution 64 --images 256 --repeats 3 > "
                              "runs/readme/encoder-speed.md"], file_text("readme/encoder-speed.md"),
            page="docs/frozen-encoder.md"),
    Results("encoder-speed-224", ["python benchmarks/encoder.py --resolution 224 --resize bilinear --stages 8 "
                                  "--images 256 --repeats 3 --no-bf16 --no-nchw > runs/readme/encoder-speed-224.md"],
            file_text("readme/encoder-speed-224.md"), page="docs/frozen-encoder.md"),
    Results("frozen-grid-speed",  # needs FLARE_CACHE naming the 224 px Lite0 cache; reads it, never extracts
            ["python benchmarks/frozen_grid_speed.py --before 81a9598 --out runs/frozen-grid-speed --record "
             "runs/readme/frozen-grid-speed-record.json"],
            lambda base: _script("benchmarks/frozen_grid_speed.py").markdown(
                json.loads((base / "readme/frozen-grid-speed-record.json").read_text())),
            page="docs/frozen-encoder.md"),
    # The one deselected test checks every page's blocks, this one included: it cannot pass before this block exists.
    Results("tests", ["python -m pytest -q -p no:cacheprovider -n 2 -m 'not slow' tests "
                      "--deselect tests/test_readme.py::test_generated_blocks_are_current_and_untouched "
                      "> runs/readme/tests.log"],
            pytest_summary,
            page="docs/results/tests.md"),
]}


def machine() -> dict:
    from flare.speed import read_cpu  # the model name, and the family, model number and stepping where it has them
    facts = read_cpu()
    cpu = facts.model + (", family {} model {} stepping {}".format(*facts.signature) if facts.signature else "")
    # The CPU's name alone does not say which kernels torch picks (two "AMD EPYC" VMs gave other digits), so record
    # the instruction set torch dispatches to as well.
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "cpu": cpu,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_isa": os.environ.get("FLARE_CPU_ISA_PINNED"),  # what FLARE pinned this process (and its runs) to
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d")}


def run_block(block: Results) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FLARE_QUIET="1")
    t0 = time.perf_counter()
    for cmd in block.commands:
        python = shlex.quote(sys.executable)
        if cmd.startswith("flare paper "):  # the flare_paper package's command: found without its entry point
            argv = cmd.replace("flare paper ", f"{python} -m flare_paper ", 1)
        elif cmd.startswith("flare "):
            argv = cmd.replace("flare ", f"{python} -m flare.cli ", 1)
        else:
            argv = cmd.replace("python ", f"{python} ", 1)
        print(f"[{block.id}] {cmd}", flush=True)
        r = subprocess.run(argv, shell=True, cwd=ROOT, env=env)
        if r.returncode not in (0, 1 if block.id == "tests" else 0):
            raise SystemExit(f"[{block.id}] command failed with exit code {r.returncode}: {cmd}")
    facts = {**machine(), "wall_seconds": time.perf_counter() - t0}
    if block.keep is not None:
        facts["kept"] = block.keep(RUNS)
    (OUT / f"{block.id}.json").write_text(json.dumps(facts, indent=1))
    record(block)


# ----------------------------------------------------------------------------------------------
# committed records: results/<block>/ holds the files a block is rendered from, so its page can be rebuilt


# What a run's records are: its config, partition, metrics, fuse records, state and summaries, reports; never its
# checkpoints (tens of MB, and nothing a table reads) nor its plots (the figures a block shows are copied by name).
RECORD_SUFFIXES = (".yaml", ".json", ".jsonl", ".md", ".csv", ".txt", ".log", ".out")


def records_of(block: Results) -> Path:
    return RESULTS_DIR / block.id


# Reports a command derives from the runs it wrote (`flare compare` rewrites compare.md from the runs' metrics): no
# block renders from them, and a committed copy would only be a second, drifting rendering of the same records.
DERIVED_REPORTS = {"compare.md"}


def _is_record(path: Path) -> bool:
    return (path.suffix in RECORD_SUFFIXES and path.name not in DERIVED_REPORTS
            and not any(part.startswith(".") for part in path.parts))


def record(block: Results) -> Path:
    """Copy what the block renders from out of runs/ into results/<block>/, each file at its path relative to runs/
    (runs/x/y → results/<block>/x/y; a fresh copy of each path: a file the last run no longer wrote must not
    linger). Other files under results/<block>/ are left alone: records a block reads that no command of it writes
    (a bounds script's own records) live there too."""
    dest = records_of(block)
    for rel in record_paths(block):
        target = dest / rel
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
    for rel in record_paths(block):
        src = RUNS / rel
        files = [src] if src.is_file() else sorted(f for f in src.rglob("*") if f.is_file()
                                                  and _is_record(f.relative_to(src)))
        if not files:
            raise SystemExit(f"[{block.id}] nothing to record at {rel}: did the commands write it?")
        for f in files:
            target = dest / f.relative_to(RUNS)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
    return dest


def base_of(block: Results) -> Path:
    """The runs directory the block is rendered from: its committed records (results/<block>/) when it has them,
    else the checkout's runs/."""
    return records_of(block) if records_of(block).is_dir() else RUNS


def _wrap_command(cmd: str, width: int = 110) -> str:
    """A long command shown on several lines (shell continuations), as one would type it."""
    lines, cur = [], ""
    for word in cmd.split(" "):
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur + " \\")
            cur = "    " + word
        else:
            cur = f"{cur} {word}" if cur else word
    return "\n".join(lines + [cur])


def run_kernels(block: Results, base: Path) -> list[str]:
    """The CPU kernel levels the block's runs recorded (state.json's backend), found under each command's --out."""
    found = set()
    for cmd in block.commands:
        for out in re.findall(r"--out (\S+)", cmd):
            for st in (base / runs_relative(out)).rglob("state.json"):
                try:
                    level = (json.loads(st.read_text()).get("backend") or {}).get("cpu_kernels")
                except (OSError, json.JSONDecodeError):
                    continue
                if level:
                    found.add(level)
    return sorted(found)


def relink(body: str, page: str) -> str:
    """A body's figure links as its page needs them: renderers write them relative to the checkout (docs/img/…),
    which is right for the README only; a block on a docs page reads them relative to that page (../img/…)."""
    rel = Path(os.path.relpath(IMG, (ROOT / page).parent)).as_posix()
    return body.replace(f"]({IMG.relative_to(ROOT).as_posix()}/", f"]({rel}/")


def render_block(block: Results, base: Path | None = None, copy_figures: bool = True) -> str:
    """The block's text from the files under `base`, a runs directory (default `base_of`: its records
    results/<block>/ if committed, else the checkout's runs/); the figures it shows are copied into docs/img (not by
    a check, which compares them instead: `problems`)."""
    base = base_of(block) if base is None else base
    facts = json.loads((base / OUT.relative_to(RUNS) / f"{block.id}.json").read_text())
    body = relink(block.render(base), block.page)
    for src, name in block.figures.items() if copy_figures else ():
        IMG.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(base / src, IMG / name)
    cmds = "\n".join(_wrap_command(c) for c in block.commands)
    levels = run_kernels(block, base)  # what the runs dispatched to; else (no runs) the generator's own process
    cap = (f", runs on {' and '.join(levels)} kernels" if levels else
           f", {facts['cpu_capability']} kernels" if facts.get("cpu_capability") else "")
    where = facts["gpu"] or f"{facts['cpus']}-core CPU ({facts['cpu']}{cap})"
    if facts.get("device_calls"):  # measured on a lent GPU: nothing here can rerun it, only re-render its records
        return (f"```bash\n{cmds}\n```\n\n{body}\n<sub>Measured in {facts['device_calls']} device calls on "
                f"{facts['date']}: {where}, torch {facts['torch']}, {facts['wall_seconds'] / 60:.1f} min wall; rendered "
                f"from results/{block.id}/ by `python tools/readme.py --rebuild {block.id}`.</sub>\n")
    return (f"```bash\n{cmds}\n```\n\n{body}\n"
            f"<sub>Generated by `python tools/readme.py --run {block.id}` on {facts['date']}: {where}, torch "
            f"{facts['torch']}, {facts['threads']} torch threads, {facts['wall_seconds'] / 60:.1f} min wall"
            + (f" ({facts['wall_note']})" if facts.get("wall_note") else "") + ".</sub>\n")


# ----------------------------------------------------------------------------------------------
# the pages


def blocks(text: str) -> dict[str, tuple[str, str]]:
    return {m["id"]: (m["sha"], m["body"]) for m in PATTERN.finditer(text)}


def replace_block(text: str, block_id: str, body: str) -> str:
    if not body.endswith("\n"):
        body += "\n"
    new = f"<!-- BEGIN {block_id} sha={_digest(body)} -->\n{body}<!-- END {block_id} -->"
    out, n = PATTERN.subn(lambda m: new if m["id"] == block_id else m[0], text)
    if block_id not in blocks(text):
        raise SystemExit(f"the page has no block '{block_id}': add <!-- BEGIN {block_id} sha=0 --> ... "
                         f"<!-- END {block_id} --> where it belongs")
    return out


def pages() -> list[str]:
    """Every file that holds generated blocks: the README and the docs pages the blocks name."""
    return list(dict.fromkeys(["README.md", *(b.page for b in (*STATIC.values(), *RESULTS.values()))]))


def page_of(block_id: str) -> str | None:
    """The one page a block belongs on (None for an id the generator does not know)."""
    block = STATIC.get(block_id) or RESULTS.get(block_id)
    return block.page if block else None


def problems(text: str, page: str = "README.md") -> list[str]:
    """Stale static blocks, blocks whose content does not match their hash (edited by hand), and results blocks
    that differ from what their committed records render to (records edited, or a block left from older runs) —
    of one page (`text` is its content)."""
    found = blocks(text)
    out = [f"block '{b}' is missing" for b in STATIC if b not in found and STATIC[b].page == page]
    # one place per fact: a block copied onto a second page would be checked in neither's name
    out += [f"block '{b}' belongs on {page_of(b)}, not here" for b in found if page_of(b) not in (page, None)]
    out += [f"block '{b}' has records in {records_of(RESULTS[b]).relative_to(ROOT)}/ but no place in {page}"
            for b in recorded() if b not in found and RESULTS[b].page == page]
    for b, (sha, body) in found.items():
        if sha != _digest(body):
            out.append(f"block '{b}' was edited by hand (its hash does not match): regenerate it with "
                       f"`python tools/readme.py{' --run ' + b if b not in STATIC else ''}`")
        elif b in STATIC and body != STATIC[b].render():
            out.append(f"block '{b}' is stale: run `python tools/readme.py`")
        elif b in recorded():
            block, base = RESULTS[b], records_of(RESULTS[b])
            fix = f"`python tools/readme.py --rebuild {b}` (or --run {b} for fresh records)"
            if body != render_block(block, base, copy_figures=False):
                out.append(f"block '{b}' is not what its records in {base.relative_to(ROOT)}/ render to: {fix}")
            out += [f"docs/img/{name} is not the figure recorded at {base.relative_to(ROOT)}/{src}: {fix}"
                    for src, name in block.figures.items()
                    if not (IMG / name).is_file() or (IMG / name).read_bytes() != (base / src).read_bytes()]
    return out


def recorded() -> list[str]:
    """The results blocks with committed records (results/<block>/)."""
    return [b for b in RESULTS if records_of(RESULTS[b]).is_dir()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="report stale or hand-edited blocks, change nothing")
    ap.add_argument("--run", metavar="ID", help="run a results block's commands first (or `all`)")
    ap.add_argument("--rebuild", metavar="ID", help="render results blocks from their records in results/ alone, "
                    "running nothing (`all`: every block that has records)")
    ap.add_argument("--list", action="store_true", help="list the results blocks and their commands")
    args = ap.parse_args(argv)
    if args.list:
        for b in RESULTS.values():
            print(f"{b.id} ({b.page}):\n  " + "\n  ".join(b.commands))
        return 0
    if args.check:
        bad = [f"{page}: {p}" for page in pages() for p in problems((ROOT / page).read_text(), page)]
        for p in bad:
            print(p, file=sys.stderr)
        return 1 if bad else 0
    if args.rebuild:
        ids = recorded() if args.rebuild == "all" else args.rebuild.split(",")
        missing = [i for i in ids if i not in RESULTS or not records_of(RESULTS[i]).is_dir()]
        if missing:
            raise SystemExit(f"no records in results/ for {missing}: `--run` a block first (--list shows them)")
        for i in ids:
            page = ROOT / RESULTS[i].page
            page.write_text(replace_block(page.read_text(), i, render_block(RESULTS[i])))
        return 0
    if args.run:
        ids = list(RESULTS) if args.run == "all" else args.run.split(",")
        unknown = [i for i in ids if i not in RESULTS]
        if unknown:
            raise SystemExit(f"unknown results block(s) {unknown}; --list shows them")
        for i in ids:
            run_block(RESULTS[i])
    for page in pages():  # read now: a page may have been edited while the blocks ran
        text = (ROOT / page).read_text()
        for b, static in STATIC.items():
            if static.page == page:
                text = replace_block(text, b, static.render())
        for b in RESULTS.values():
            if b.page != page:
                continue
            if b.id not in blocks(text):
                print(f"{page} has no block '{b.id}'; skipped", file=sys.stderr)
                continue
            try:
                text = replace_block(text, b.id, render_block(b))
            except (FileNotFoundError, IndexError) as e:
                print(f"[{b.id}] not rendered (run it with --run {b.id}): {e}", file=sys.stderr)
        (ROOT / page).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
