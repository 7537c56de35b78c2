"""DENSE's own code (zj-jayzhang/DENSE, `loop_df_fl.py`) run for a cell of the DENSE Fashion-MNIST table
(configs/papers/dense-fmnist.yaml), so that a gap between FLARE and the paper can be placed: does the paper's
number come from its code at the stated setting (then FLARE computes something else), or does its code, run here,
land where FLARE lands (then the paper ran something its code and README do not state)?

    python benchmarks/reference_dense.py --checkout PATH/TO/DENSE --method fedavg --alpha 0.3 --seed 0 --commit
    python benchmarks/reference_dense.py --checkout PATH/TO/DENSE --method dense --alpha 0.3 --seed 0 --commit

The reference code is not part of FLARE and is never copied into it: give a checkout (237c5dd was run). What runs
is its script's own `__main__` block, executed from the checkout's file, with the flags the README's two commands
use at the table cell's setting: `--type pretrain` trains the five clients one after the other and scores their
plain average (FedAvg) and logit ensemble; `--type kd_train` reloads those clients from the file the pretrain wrote
and runs DENSE's generator fusion. A `dense` cell therefore needs the `fedavg` cell of its α and seed first, in the
same run directory. The fusion runs at the table's budget (`fuse_options.dense.epochs`, 20 × 30 = 600 generator
steps, a tenth of the README's 200 epochs; `--epochs` overrides it) and the record says which.

Stand-ins, and nothing else: the device (`.cuda()` on tensors and modules returns them unchanged: CPU), logging
(`wandb` is a no-op, tqdm bars are silent), DataLoader workers (`num_workers=0`, no pinned memory: one process on a
shared machine — the main process draws the sampler's seeds either way, so the clients' batches are the same; the
DENSE server's random flips of its pooled images then come from the main process's stream), three imports no
Fashion-MNIST path calls (`ipdb`; `torch._six`, gone from torch 2, which `models/vit.py` imports), and the data:
torchvision's own `FashionMNIST` class, reading IDX files that this process writes from the arrays FLARE prepares,
under the run directory instead of the hard-coded `/dataset`. The child also creates `df_ckpt/`, where the script
saves its best student without creating the folder.

The split: the script's own `partition_data` runs (its draws, in its order), and its index lists are then replaced
by FLARE's partition of the cell (`--partition flare`, the default; `own` keeps the script's). The record says
which was used and whether the two are equal; FLARE's `partition.rng=legacy` draws the script's stream, so they
should be. The clients' sizes and class histograms are kept.

Resumable: after each client's local training the child saves the client's weights, its accuracy curve and the
random streams (torch, numpy, random) under the run directory, and a rerun loads a saved client instead of
training it and restores the streams, so it goes on as one sitting would have. The fusion is not resumable; its
curve so far is kept. While a cell runs, `progress.json` beside its records holds every accuracy so far and the
time spent (no weights); when it ends, `record.json` replaces it. Checkpoints live under `runs/`, never in the
records.

The child process never imports FLARE (importing it pins the process's kernels); this process prepares the data
and the partition with FLARE, starts the child, and writes the record with the wall and CPU seconds of every
sitting, the checkout's commit, the torch version and the CPU model.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import resource
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "configs" / "papers" / "dense-fmnist.yaml"
RESULTS = ROOT / "results" / "papers-reference"
RUNS = ROOT / "runs" / "papers-reference"
SCRIPT = "loop_df_fl.py"
STAND_INS = [
    "device: .cuda() on tensors and modules returns them unchanged (CPU)",
    "logging: wandb is a no-op module; tqdm bars are disabled",
    "DataLoader: num_workers=0, pin_memory=False (one process; same sampler seeds)",
    "imports never called on the Fashion-MNIST path: ipdb (empty), torch._six (container_abcs = collections.abc)",
    "data: torchvision's FashionMNIST reading IDX files written from FLARE's prepared arrays, rooted in the run "
    "directory instead of /dataset",
    "filesystem: df_ckpt/ created in the run directory (the script saves there without creating it)",
]


# ------------------------------------------------------------------------------------------------ both sides
def write_idx(path: Path, arr) -> None:
    """An IDX file (unsigned bytes) as torchvision's MNIST readers expect it: magic 0x0800 | ndim, then the sizes."""
    import numpy as np

    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    path.write_bytes(head + arr.tobytes())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ------------------------------------------------------------------------------------------------ the child
class Recorder:
    """Every accuracy the script computes, by what it scored (taken from `test`'s call site), written to
    progress.json after each, with wall and CPU seconds, so an interrupted sitting leaves its curve behind."""

    def __init__(self, path: Path, state: dict):
        self.path, self.state = path, state
        self.client: int | None = None

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1) + "\n")
        tmp.replace(self.path)


def _stand_ins(data_root: Path) -> None:
    """The device, logging, worker and import stand-ins of the module docstring, before the script is imported."""
    import collections.abc

    import torch
    import torch.utils.data
    import torchvision.datasets
    import tqdm

    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    plot = types.SimpleNamespace(line_series=lambda *a, **k: None)
    sys.modules["wandb"] = types.SimpleNamespace(init=lambda *a, **k: None, log=lambda *a, **k: None, plot=plot)
    sys.modules["ipdb"] = types.ModuleType("ipdb")
    six = types.ModuleType("torch._six")
    six.container_abcs = collections.abc
    sys.modules["torch._six"] = six

    class DataLoader(torch.utils.data.DataLoader):
        def __init__(self, *a, **k):
            k["num_workers"], k["pin_memory"] = 0, False
            super().__init__(*a, **k)

    torch.utils.data.DataLoader = DataLoader

    class Quiet(tqdm.tqdm):
        def __init__(self, *a, **k):
            k["disable"] = True
            super().__init__(*a, **k)

    tqdm.tqdm = Quiet
    base = torchvision.datasets.FashionMNIST

    class FashionMNIST(base):  # the class name names the folder torchvision reads: <root>/FashionMNIST/raw
        def __init__(self, root, *a, **k):
            k["download"] = False
            super().__init__(str(data_root), *a, **k)

    torchvision.datasets.FashionMNIST = FashionMNIST


def _streams():
    import random

    import numpy as np
    import torch

    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}


def _restore(streams) -> None:
    import random

    import numpy as np
    import torch

    torch.set_rng_state(streams["torch"])
    np.random.set_state(streams["numpy"])
    random.setstate(streams["random"])


def child(checkout: Path, spec_path: Path) -> int:
    """Runs the script's `__main__` block with the spec's flags, recording as it goes; returns the exit status."""
    t_start, c_start = time.time(), time.process_time()
    spec = json.loads(spec_path.read_text())
    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chdir(run_dir)  # the script writes its client file, pool, figure and best student into the working directory
    (run_dir / "df_ckpt").mkdir(exist_ok=True)
    sys.path.insert(0, str(checkout))
    _stand_ins(run_dir / "data")
    import numpy as np
    import torch

    import loop_df_fl as L  # noqa: E402  (the checkout's script, its `__main__` block not yet run)

    progress = Path(spec["progress"])
    prev = json.loads(progress.read_text()) if progress.is_file() else {}
    sittings = prev.get("sittings", []) + [{"started": time.strftime("%Y-%m-%dT%H:%M:%S")}]
    rec = Recorder(progress, {"status": "running", "argv": spec["argv"], "sittings": sittings, "clients": {},
                              "fedavg": None, "ensemble": None, "student_curve": [], "partition": None,
                              "torch": torch.__version__, "threads": torch.get_num_threads()})
    sitting = sittings[-1]

    def tick() -> None:
        sitting["wall_seconds"] = round(time.time() - t_start, 1)
        sitting["cpu_seconds"] = round(time.process_time() - c_start, 1)

    their_partition = L.partition_data

    def partition_data(*a, **k):
        train, test, groups, counts = their_partition(*a, **k)  # their draws, in their order
        flare = [np.asarray(ix, dtype=np.int64) for ix in json.loads(Path(spec["flare_partition"]).read_text())]
        own = [np.asarray(groups[i], dtype=np.int64) for i in range(len(groups))]
        same = len(own) == len(flare) and all(np.array_equal(a_, b_) for a_, b_ in zip(own, flare))
        same_sets = len(own) == len(flare) and all(set(a_.tolist()) == set(b_.tolist()) for a_, b_ in zip(own, flare))
        used = flare if spec["partition"] == "flare" else own
        if spec["partition"] == "flare":
            groups = {i: ix for i, ix in enumerate(flare)}
        labels = np.asarray(train.targets)
        rec.state["partition"] = {
            "used": spec["partition"], "own_equals_flare": same, "own_equals_flare_as_sets": same_sets,
            "client_sizes": [len(ix) for ix in used],
            "class_histograms": [np.bincount(labels[ix], minlength=int(labels.max()) + 1).tolist() for ix in used],
            "own_client_sizes": [len(ix) for ix in own]}
        rec.save()
        return train, test, groups, counts

    L.partition_data = partition_data
    their_test = L.test
    fedavg_seen = [False]

    def test(model, loader):
        acc, loss = their_test(model, loader)
        tick()
        if rec.client is not None:
            rec.state["clients"][str(rec.client)]["acc_per_epoch"].append(acc)
        elif isinstance(model, L.Ensemble):
            rec.state["ensemble"] = acc
        elif not fedavg_seen[0]:  # the first whole-model score outside a client is the plain average's
            fedavg_seen[0] = True
            rec.state["fedavg"] = acc
        else:  # kd_train: the student after each epoch
            rec.state["student_curve"].append({"epoch": len(rec.state["student_curve"]) + 1, "acc": acc,
                                               "wall_seconds": sitting["wall_seconds"]})
        rec.save()
        return acc, loss

    L.test = test
    their_update = L.LocalUpdate.update_weights
    saved = run_dir / "clients"

    def update_weights(self, model, client_id):
        f = saved / f"client{client_id}.pt"
        if f.is_file():  # trained in an earlier sitting: its weights, curve and the streams it left behind
            s = torch.load(f, weights_only=False)
            _restore(s["streams"])
            rec.state["clients"][str(client_id)] = s["record"]
            rec.save()
            return s["weights"], np.array(s["record"]["acc_per_epoch"])
        w0, c0 = time.time(), time.process_time()
        rec.client = client_id
        rec.state["clients"][str(client_id)] = {"acc_per_epoch": [], "size": len(self.train_loader.dataset)}
        try:
            w, accs = their_update(self, model, client_id)
        finally:
            rec.client = None
        entry = rec.state["clients"][str(client_id)]
        entry.update(seconds=round(time.time() - w0, 1), cpu_seconds=round(time.process_time() - c0, 1),
                     sitting=len(sittings))
        saved.mkdir(exist_ok=True)
        torch.save({"weights": w, "record": entry, "streams": _streams()}, f.with_suffix(".tmp"))
        f.with_suffix(".tmp").replace(f)
        rec.save()
        return w, accs

    L.LocalUpdate.update_weights = update_weights
    source = Path(L.__file__).read_text()
    main = next(n for n in ast.parse(source).body
                if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    sys.argv = [SCRIPT, *spec["argv"]]
    code = compile(ast.Module(body=main.body, type_ignores=[]), L.__file__, "exec")
    exec(code, vars(L))  # the script's own block, its line numbers in tracebacks
    tick()
    rec.state["status"] = "finished"
    rec.save()
    return 0


# ------------------------------------------------------------------------------------------------ the parent
def table_cell(table: Path, alpha: float, seed: int) -> tuple[dict, dict]:
    """The table file's spec and its FedAvg cell at (α, seed) — whose clients DENSE's column fuses."""
    sys.path.insert(0, str(ROOT / "tools"))
    import papers

    spec = papers.load_table(table)
    name = papers.cell_name("fedavg", alpha, seed)
    for cell in papers.cells(spec):
        if cell["name"] == name:
            return spec, cell
    raise SystemExit(f"reference_dense: {table} has no cell {name}")


def their_flags(cell: dict, method: str, epochs: int | None) -> tuple[list[str], dict | None]:
    """The script's flags for the cell (the README's two commands at the cell's setting), and for `dense` the
    budget it runs. Refuses a cell whose setting this mapping does not cover."""
    c = cell["config"]
    need = {"dataset.name": (c["dataset"]["name"], "fmnist"), "model.name": (c["model"]["name"], "cnn_mnist_dense"),
            "partition.kind": (c["partition"]["kind"], "noniid-labeldir"), "partition.rng": (c["partition"]["rng"],
                                                                                             "legacy"),
            "train_mode_epochs": (c.get("train_mode_epochs"), 1), "test_batch_size": (c["test_batch_size"], 256),
            "drop_last": (c["drop_last"], False), "optim.momentum": (c["optim"]["momentum"], 0.9),
            "optim.weight_decay": (c["optim"]["weight_decay"], 0.0)}
    off = [f"{k}={v[0]!r} (the script: {v[1]!r})" for k, v in need.items() if v[0] != v[1]]
    if off:
        raise SystemExit("reference_dense: the cell's setting is not the script's: " + "; ".join(off))
    flags = ["--dataset", "fmnist", "--model", "fmnist_cnn", "--partition", "dirichlet", "--iid", "0",
             "--beta", f"{c['partition']['alpha']:g}", "--seed", str(c["seed"]), "--num_users", str(c["num_clients"])]
    if method == "fedavg":
        return flags + ["--type", "pretrain", "--local_ep", str(c["rounds"] * c["local_epochs"]),
                        "--local_bs", str(c["batch_size"]), "--lr", f"{c['lr']:g}"], None
    d = c["server"]["strategies"]["dense"]
    table_epochs = cell["fuse_options"]["dense"]["epochs"]
    run_epochs = epochs or table_epochs
    budget = {"epochs": run_epochs, "g_steps": d["g_steps"], "generator_steps": run_epochs * d["g_steps"],
              "table_epochs": table_epochs, "published_epochs": d["epochs"],
              "published_generator_steps": d["epochs"] * d["g_steps"]}
    # --bn 1.0 as the README's command gives it; the script's hooks never attach (the table writes it as 0.0)
    return flags + ["--type", "kd_train", "--epochs", str(run_epochs), "--lr", f"{d['lr']:g}",
                    "--batch_size", str(d["batch_size"]), "--synthesis_batch_size", str(d["synthesis_batch"]),
                    "--g_steps", str(d["g_steps"]), "--lr_g", f"{d['lr_g']:g}", "--bn", "1.0",
                    "--oh", f"{d['oh']:g}", "--T", f"{d['temperature']:g}", "--adv", f"{d['adv']:g}",
                    "--save_dir", "pool", "--other", "fmnist"], budget


def prepare(cell: dict, run_dir: Path) -> Path:
    """FLARE's data and partition for the cell: IDX files for torchvision's reader, the clients' index lists."""
    from flare.config.load import load_config
    from flare.data.prepare import prepare_data, split

    cfg = load_config(overrides=cell["config"])
    data, public = prepare_data(cfg)
    assert public is None, "the table's cells hold out no public slice"
    raw = run_dir / "data" / "FashionMNIST" / "raw"
    for name, arr in (("train-images-idx3-ubyte", data.train_x[:, 0]), ("train-labels-idx1-ubyte", data.train_y),
                      ("t10k-images-idx3-ubyte", data.test_x[:, 0]), ("t10k-labels-idx1-ubyte", data.test_y)):
        write_idx(raw / name, arr.numpy())
    part = split(cfg, data.train_y, len(data.classes))
    out = run_dir / "flare-partition.json"
    out.write_text(json.dumps([ix.tolist() for ix in part.client_indices]))
    return out


def flare_values(spec: dict, cell: dict, method: str) -> dict:
    """FLARE's recorded value for the same cell (results/papers/), and the paper's, in percent."""
    d = ROOT / "results" / "papers" / spec["table"] / cell["name"]
    out: dict = {"records": str(d.relative_to(ROOT))}
    try:
        rounds = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"kind": "round"' in x]
        out["fedavg"], out["ensemble"] = 100 * rounds[-1]["acc_fedavg"], 100 * rounds[-1]["acc_output"]
        fuse = [json.loads(x) for x in (d / "fuse.jsonl").read_text().splitlines() if x.strip()]
        dense = [f for f in fuse if f.get("strategy") == "dense"]
        if dense:
            out["dense"] = 100 * dense[-1]["acc"]
            out["dense_curve"] = [[e, s, 100 * a] for e, s, a in dense[-1].get("dense.curve", [])]
    except (OSError, KeyError, IndexError, ValueError):
        pass
    col = "FedAvg" if method == "fedavg" else "DENSE"
    out["paper"] = spec.get("published", {}).get(col, {}).get(cell["alpha"])
    return out


def _commit(paths: list[Path], message: str) -> None:
    """Commits only the given record paths (the worktree may hold other edits); retries on another git's lock."""
    rel = [str(p.relative_to(ROOT)) for p in paths]
    for _ in range(20):
        add = subprocess.run(["git", "-C", str(ROOT), "add", "-A", "--", *rel], capture_output=True, text=True)
        com = subprocess.run(["git", "-C", str(ROOT), "commit", "-q", "-m", message, "--", *rel],
                             capture_output=True, text=True) if add.returncode == 0 else add
        if com.returncode == 0 or "nothing to commit" in com.stdout + com.stderr:
            return
        time.sleep(3)
    print(f"reference_dense: could not commit {rel}: {com.stderr.strip()}", file=sys.stderr)


def cell_arguments(doc: str, repo: str, methods: tuple[str, ...], alpha: float, table: Path) -> argparse.ArgumentParser:
    """The command line every reference driver shares: which checkout, which table cell, where runs and records go."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, required=True, help=f"a checkout of {repo}")
    ap.add_argument("--method", choices=methods, default=methods[0])
    ap.add_argument("--alpha", type=float, default=alpha)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table", type=Path, default=table)
    ap.add_argument("--partition", choices=("flare", "own"), default="flare",
                    help="the clients' index lists: FLARE's partition of the cell (default) or the script's own")
    ap.add_argument("--epochs", type=int, help="dense: the server's epochs (default: the table's budget)")
    ap.add_argument("--runs", type=Path, default=RUNS, help="run directories (checkpoints; never committed)")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the records go")
    ap.add_argument("--commit", action="store_true", help="git-commit the cell's records when it finishes")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # the run: its spec JSON
    return ap


def main(argv=None) -> int:
    ap = cell_arguments(__doc__, "zj-jayzhang/DENSE", ("fedavg", "dense"), alpha=0.3, table=TABLE)
    args = ap.parse_args(argv)
    checkout = args.checkout.resolve()
    if args.child:
        return child(checkout, args.child)
    if not (checkout / SCRIPT).is_file() or not (checkout / "helpers" / "synthesizers.py").is_file():
        print(f"reference_dense: {checkout} is not a checkout of zj-jayzhang/DENSE (no {SCRIPT} and "
              "helpers/synthesizers.py).", file=sys.stderr)
        return 2
    spec, cell = table_cell(args.table, args.alpha, args.seed)
    flags, budget = their_flags(cell, args.method, args.epochs)
    name = f"{args.method}-a{args.alpha:g}-s{args.seed}"
    if args.partition == "own":
        name += "-own-split"
    suffix = "" if args.partition == "flare" else "-own-split"
    run_dir = (args.runs / spec["table"] / f"a{args.alpha:g}-s{args.seed}{suffix}").resolve()
    dest = args.results / spec["table"] / name
    record = dest / "record.json"
    if record.is_file():
        print(f"reference_dense: {name} is recorded ({record}); nothing to run.")
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = run_dir / f"{args.method}-argv.json"
    if manifest.is_file() and json.loads(manifest.read_text()) != flags:
        print(f"reference_dense: {run_dir} holds a run of {args.method} with other flags ({manifest}); move it "
              "aside to run this setting.", file=sys.stderr)
        return 2
    manifest.write_text(json.dumps(flags))
    if args.method == "dense":
        pkl = run_dir / f"fmnist_{cell['config']['num_clients']}clients_{args.alpha:g}.pkl"
        if not pkl.is_file():
            print(f"reference_dense: no clients to fuse ({pkl}): run --method fedavg for α = {args.alpha:g}, "
                  f"seed {args.seed} first.", file=sys.stderr)
            return 2
        pool = run_dir / "pool"  # an interrupted fusion's images would join the new pool: start it empty
        if pool.is_dir():
            for f in pool.iterdir():
                f.unlink()
            (run_dir / "progress-dense-restarted").write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
    part = prepare(cell, run_dir)
    progress = dest / "progress.json"
    if args.method == "dense" and progress.is_file():  # the fusion restarts from its first epoch
        old = json.loads(progress.read_text())
        progress.write_text(json.dumps({"sittings": old.get("sittings", [])}))
    child_spec = run_dir / f"{args.method}-spec.json"
    child_spec.write_text(json.dumps({"run_dir": str(run_dir), "argv": flags, "partition": args.partition,
                                      "flare_partition": str(part), "progress": str(progress.resolve())}))
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    ours = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    edited = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", str(Path(__file__).resolve())],
                            capture_output=True, text=True).stdout.strip()
    from flare import cpu

    print(f"reference_dense: {name} in {run_dir}; records to {dest}", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--checkout", str(checkout),
                         "--child", str(child_spec)], env=cpu.user_environment()).returncode
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    state = json.loads(progress.read_text()) if progress.is_file() else {"sittings": [{}]}
    state["sittings"][-1].update(process_wall_seconds=round(wall, 1), process_cpu_seconds=round(cpu_s, 1),
                                 exit_status=rc, cpu_model=cpu_model())
    progress.write_text(json.dumps(state, indent=1) + "\n")
    if rc != 0 or state.get("status") != "finished":
        print(f"reference_dense: {name} stopped (exit {rc}); rerun the same command to go on.", file=sys.stderr)
        return 1
    rec = {"reference": f"zj-jayzhang/DENSE {SCRIPT} --type {'pretrain' if args.method == 'fedavg' else 'kd_train'}",
           "commit": commit, "checkout_modified": bool(dirty), "driver": {"flare_commit": ours,
                                                                          "driver_modified": bool(edited)}, "table": spec["table"], "cell": name,
           "flare_cell": cell["name"], "method": args.method, "alpha": args.alpha, "seed": args.seed,
           "argv": flags, "flare_config": cell["config"], "budget": budget, "stand_ins": STAND_INS,
           "partition": state["partition"],
           "clients": [{"client": int(k), **v} for k, v in sorted(state["clients"].items(), key=lambda kv: int(kv[0]))],
           "fedavg": state["fedavg"], "ensemble": state["ensemble"], "student_curve": state["student_curve"],
           "compare": flare_values(spec, cell, args.method), "accuracy_unit": "percent",
           "wall_seconds": round(sum(s.get("process_wall_seconds", 0) for s in state["sittings"]), 1),
           "cpu_seconds": round(sum(s.get("process_cpu_seconds", 0) for s in state["sittings"]), 1),
           "sittings": state["sittings"], "torch": state["torch"], "threads": state["threads"],
           "cpu_model": cpu_model(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    if state["student_curve"]:
        accs = [p["acc"] for p in state["student_curve"]]
        rec["student_final"], rec["student_best"] = accs[-1], max(accs)
    dest.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(rec, indent=1) + "\n")
    progress.unlink()
    print(json.dumps({k: rec[k] for k in ("cell", "fedavg", "ensemble", "wall_seconds", "cpu_seconds")}), flush=True)
    if args.commit:
        _commit([dest], f"papers-reference: {spec['table']} {name} records (DENSE's own code)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
