"""FedLPA's own code (lebronlambert/FedLPA_NeurIPS2024) run for cells of the FedLPA Fashion-MNIST table
(configs/papers/fedlpa-fmnist.yaml), so that a gap between FLARE and the paper can be placed: does the paper's
number come from its code at the stated setting (then FLARE computes something else), or does its code, run here,
land where FLARE lands (then the paper ran something its code and scripts do not state)?

    python benchmarks/reference_fedlpa.py --checkout PATH/TO/FedLPA --method fedlpa --alpha 0.1 --seed 0 --commit
    python benchmarks/reference_fedlpa.py --checkout PATH/TO/FedLPA --method dense --alpha 0.1 --seed 0 --commit

The reference code is not part of FLARE and is never copied into it: give a checkout (08dd729 was run). What runs
is a script's own `__main__` block, executed from the checkout's file, with the flags `scripts/experiments.sh`
gives at the table cell's setting (its Fashion-MNIST lines, E = 200, read from the table file):
* `fedlpa`: `experiments_our.py --alg=our` (S:9-30) trains the ten clients one after the other, takes K-FAC
  factors over one pass of each client's data, solves the aggregation twice (the closed form, "biased", and
  10,000 gradient steps from it, "newton") and prints the better of the two on the test set — the value its
  Table 1 prints, recorded as `fedlpa`, with `newton` and `biased` beside it.
* `dense`: `experiments_dense.py` twice, as S:250-251 runs it: `--type=pretrain` trains DENSE's ten clients apart
  (no weight decay, a test after every local epoch) and saves them; `--type=kd_train` reloads them, scores their
  plain average and logit ensemble, and runs DENSE's generator fusion, scoring the student after every epoch (the
  paper prints the best). One cell, two child processes, one record. The fusion runs at the table's budget
  (`fuse_options.dense.epochs`, 20 × 30 = 600 generator steps, a tenth of the script's 200 epochs; `--epochs`
  overrides it) and the record says which.

Stand-ins, and nothing else (the record lists the ones its script needed):
* `fedlpa`: the device only, through the script's own flag: `--device=cpu` where the script passes `cuda:0`.
  The data is read from `--datadir` (the script's flag) as torchvision's FashionMNIST reads it: IDX files this
  process writes from the arrays FLARE prepares. Logging goes to the script's own log file under the run directory.
* `dense`: the device (`.cuda()` on tensors and modules returns them unchanged: CPU), tqdm bars silent, DataLoader
  workers (`num_workers=0`, no pinned memory; the synthesizer asks for 4), `ipdb` (imported by
  `helpers/synthesizers.py`, never called), and the source read with tabs expanded to 8 columns: Python 3 refuses
  `experiments_dense.py` as released (TabError in `get_model`'s `vgg-9` branch, lines 225-231, which mixes tabs
  and spaces and which a Fashion-MNIST run never enters); 8 columns is Python 2's reading, and no other line
  changes. The data as for `fedlpa`, under the script's default `./data/` (the run directory).

The split: the script's own `partition_data` runs (its draws, in its order: `np.random.seed(init_seed)` right
before it), and its index lists are then replaced by FLARE's partition of the cell (`--partition flare`, the
default; `own` keeps the script's). The record says which was used and whether the two are equal; FLARE's
`partition.rng=legacy` draws the script's stream, so they should be.

Resumable per client: after each client's local training (for `fedlpa` with its K-FAC factors) the child saves the
client's weights, its record and the random streams (torch, numpy, random) under the run directory, and a rerun
loads a saved client instead of training it and restores the streams, so it goes on as one sitting would have.
For `dense`, a finished pretrain (its client file) is not run again; the fusion is not resumable, and a rerun
starts it from its first epoch. While a cell runs, `progress.json` beside its records holds every value so far
(each client's loss per epoch for `fedlpa`, from the script's own log lines; its test accuracy per epoch for
`dense`) and the time spent (no weights); when it ends, `record.json` replaces it. Checkpoints live under `runs/`,
never in the records. `--local-epochs N` runs a shortened smoke of the same code (its record says so and the
block never reads it); give it `--results` outside results/papers-reference.

The child process never imports FLARE; this process prepares the data and the partition with FLARE, starts the
child, and writes the record with the wall and CPU seconds of every sitting, the checkout's commit, the torch
version and the CPU model. Helpers shared with the DENSE driver come from benchmarks/reference_dense.py.
"""
from __future__ import annotations

import ast
import json
import logging
import platform
import resource
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_dense as ref  # noqa: E402  (stdlib only at import: the child stays free of FLARE)

ROOT = ref.ROOT
TABLE = ROOT / "configs" / "papers" / "fedlpa-fmnist.yaml"
RESULTS = ref.RESULTS
RUNS = ref.RUNS
SCRIPTS = {"fedlpa": "experiments_our.py", "dense": "experiments_dense.py"}
STAND_INS = {
    "fedlpa": ["device: --device=cpu, the script's own flag (scripts/experiments.sh passes cuda:0)",
               "data: torchvision's FashionMNIST reading IDX files written from FLARE's prepared arrays under "
               "--datadir (the script's flag), the run directory"],
    "dense": ["device: .cuda() on tensors and modules returns them unchanged (CPU)",
              "logging: tqdm bars are disabled",
              "DataLoader: num_workers=0, pin_memory=False (one process; the synthesizer asks for 4 workers)",
              "imports never called on the Fashion-MNIST path: ipdb (empty)",
              "source: experiments_dense.py read with tabs expanded to 8 columns (Python 3 refuses the mixed tabs "
              "of get_model's vgg-9 branch, lines 225-231, with TabError; no Fashion-MNIST line changes)",
              "data: torchvision's FashionMNIST reading IDX files written from FLARE's prepared arrays under the "
              "script's default ./data/ (the run directory)"],
}


# ------------------------------------------------------------------------------------------------ the child
def _dense_stand_ins() -> None:
    """experiments_dense.py's stand-ins of the module docstring, before its modules are imported."""
    import torch
    import torch.utils.data
    import tqdm

    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    sys.modules["ipdb"] = types.ModuleType("ipdb")

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


def load_script(checkout: Path, script: str) -> tuple[types.ModuleType, ast.If]:
    """The script as a module (its top level run, its `__main__` block not) and that block, from the checkout's
    file; experiments_dense.py with tabs expanded (a stand-in, above). Line numbers are the file's."""
    path = checkout / script
    source = path.read_text()
    if script == SCRIPTS["dense"]:
        source = source.expandtabs(8)
    mod = types.ModuleType(path.stem)
    mod.__file__ = str(path)
    sys.modules[path.stem] = mod
    tree = ast.parse(source, str(path))
    main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    tree.body = [n for n in tree.body if n is not main]
    exec(compile(tree, str(path), "exec"), vars(mod))
    return mod, main


class EpochLog(logging.Filter):
    """The script's own per-epoch log line ('Epoch: %d Loss: %f ...'), read as the root logger receives it: the
    script replaces the root logger's handlers, never its filters."""

    def __init__(self, on_epoch):
        super().__init__()
        self.on_epoch = on_epoch

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg.startswith("Epoch: ") and " Loss: " in msg:
            self.on_epoch(float(msg.split(" Loss: ")[1].split()[0]))
        return True


def child(checkout: Path, spec_path: Path) -> int:
    """Runs one script's `__main__` block with the spec's flags, recording as it goes; returns the exit status."""
    import os

    t_start, c_start = time.time(), time.process_time()
    spec = json.loads(spec_path.read_text())
    method, phase = spec["method"], spec["phase"]
    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    os.chdir(run_dir)  # the scripts write their client file, pool and logs into the working directory
    sys.path.insert(0, str(checkout))
    if method == "dense":
        _dense_stand_ins()
    import numpy as np
    import torch

    L, main = load_script(checkout, SCRIPTS[method])
    progress = Path(spec["progress"])
    prev = json.loads(progress.read_text()) if progress.is_file() else {}
    sittings = prev.get("sittings", []) + [{"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "phase": phase}]
    state = {"status": "running", "phase": phase, "argv": spec["argv"], "sittings": sittings,
             "num_clients": spec["num_clients"], "local_epochs": spec["local_epochs"],
             "server_epochs": spec.get("server_epochs"), "clients": {}, "partition": prev.get("partition"),
             "torch": torch.__version__, "threads": torch.get_num_threads()}
    if phase == "kd_train":  # the pretrain's clients stay in the record; the fusion starts again
        state.update(clients=prev.get("clients", {}), fedavg=None, ensemble=None, student_curve=[])
    rec = ref.Recorder(progress, state)
    sitting = sittings[-1]
    current: list = [None]  # the client being trained
    mark = [0.0]  # CPU seconds at the last epoch's end (or the client's start)

    def epoch_cpu(entry: dict) -> None:
        """Each local epoch's CPU seconds, so a smoke of a few epochs prices the table's 200."""
        now = time.process_time()
        entry.setdefault("epoch_cpu_seconds", []).append(round(now - mark[0], 2))
        mark[0] = now

    def tick() -> None:
        sitting["wall_seconds"] = round(time.time() - t_start, 1)
        sitting["cpu_seconds"] = round(time.process_time() - c_start, 1)

    their_partition = L.partition_data

    def partition_data(*a, **k):
        out = list(their_partition(*a, **k))  # their draws, in their order
        y_train, groups = np.asarray(out[1]), out[4]
        flare = [list(map(int, ix)) for ix in json.loads(Path(spec["flare_partition"]).read_text())]
        own = [list(map(int, groups[i])) for i in range(len(groups))]
        if spec["partition"] == "flare":
            out[4] = {i: ix for i, ix in enumerate(flare)}
        used = flare if spec["partition"] == "flare" else own
        rec.state["partition"] = {
            "used": spec["partition"], "own_equals_flare": own == flare,
            "own_equals_flare_as_sets": len(own) == len(flare) and all(set(a_) == set(b_) for a_, b_ in
                                                                       zip(own, flare)),
            "client_sizes": [len(ix) for ix in used],
            "class_histograms": [np.bincount(y_train[ix], minlength=int(y_train.max()) + 1).tolist() for ix in used],
            "own_client_sizes": [len(ix) for ix in own]}
        rec.save()
        return tuple(out)

    L.partition_data = partition_data
    saved = run_dir / "clients"

    def resume(client_id, load) -> tuple | None:
        """A client trained in an earlier sitting: its weights and factors (through `load`), record and streams."""
        f = saved / f"client{client_id}.pt"
        if not f.is_file():
            return None
        s = torch.load(f, weights_only=False)
        load(s)
        ref._restore(s["streams"])
        rec.state["clients"][str(client_id)] = s["record"]
        rec.save()
        return s["returned"]

    def keep(client_id, payload: dict, returned, w0: float, c0: float) -> None:
        entry = rec.state["clients"][str(client_id)]
        entry.update(seconds=round(time.time() - w0, 1), cpu_seconds=round(time.process_time() - c0, 1),
                     sitting=len(sittings))
        saved.mkdir(exist_ok=True)
        f = saved / f"client{client_id}.pt"
        torch.save({**payload, "record": entry, "returned": returned, "streams": ref._streams()},
                   f.with_suffix(".tmp"))
        f.with_suffix(".tmp").replace(f)
        tick()
        rec.save()

    if method == "fedlpa":
        def on_epoch(loss: float) -> None:
            if current[0] is not None:
                rec.state["clients"][str(current[0])]["loss_per_epoch"].append(loss)
                epoch_cpu(rec.state["clients"][str(current[0])])
                tick()
                rec.save()

        logging.getLogger().addFilter(EpochLog(on_epoch))
        their_train = L.train_net_blockoffline

        def train_net_blockoffline(net_id, net_local, f_local, *a, **k):
            def load(s):
                net_local.load_state_dict(s["weights"])
                for name, (A, G) in s["factors"].items():
                    f_local[name][0], f_local[name][1] = A, G

            done = resume(net_id, load)
            if done is not None:
                return tuple(done)
            w0, c0 = time.time(), time.process_time()
            current[0], mark[0] = net_id, c0
            rec.state["clients"][str(net_id)] = {"loss_per_epoch": [], "size": int(a[2])}
            try:
                train_acc, test_acc = their_train(net_id, net_local, f_local, *a, **k)
            finally:
                current[0] = None
            rec.state["clients"][str(net_id)].update(train_acc=100 * train_acc, test_acc=100 * test_acc)
            factors = {name: (f_local[name][0], f_local[name][1]) for name in f_local}
            keep(net_id, {"weights": net_local.state_dict(), "factors": factors}, [train_acc, test_acc], w0, c0)
            return train_acc, test_acc

        L.train_net_blockoffline = train_net_blockoffline
        their_accuracy, server_scores = L.compute_accuracy, []

        def compute_accuracy(model, dataloader, *a, **k):
            out = their_accuracy(model, dataloader, *a, **k)
            if current[0] is None and dataloader is vars(L).get("test_dl_global"):
                server_scores.append(100 * (out[0] if isinstance(out, tuple) else out))  # newton, then biased
            return out

        L.compute_accuracy = compute_accuracy
    else:
        their_test = L.test
        fedavg_seen = [False]

        def test(model, loader):
            acc, loss = their_test(model, loader)
            tick()
            if current[0] is not None:
                rec.state["clients"][str(current[0])]["acc_per_epoch"].append(acc)
                epoch_cpu(rec.state["clients"][str(current[0])])
            elif isinstance(model, L.Ensemble):
                rec.state["ensemble"] = acc
            elif not fedavg_seen[0]:  # kd_train scores the plain average first
                fedavg_seen[0] = True
                rec.state["fedavg"] = acc
            else:  # then the student after each epoch
                rec.state["student_curve"].append({"epoch": len(rec.state["student_curve"]) + 1, "acc": acc,
                                                   "wall_seconds": sitting["wall_seconds"]})
            rec.save()
            return acc, loss

        L.test = test
        their_update = L.LocalUpdate.update_weights

        def update_weights(self, model, client_id):
            done = resume(client_id, lambda s: None)
            if done is not None:
                return done[0], np.array(done[1])
            w0, c0 = time.time(), time.process_time()
            current[0], mark[0] = client_id, c0
            rec.state["clients"][str(client_id)] = {"acc_per_epoch": [],
                                                    "size": len(self.train_loader.dataset)}
            try:
                w, accs = their_update(self, model, client_id)
            finally:
                current[0] = None
            keep(client_id, {}, [w, list(map(float, accs))], w0, c0)
            return w, accs

        L.LocalUpdate.update_weights = update_weights
    sys.argv = [SCRIPTS[method], *spec["argv"]]
    exec(compile(ast.Module(body=main.body, type_ignores=[]), L.__file__, "exec"), vars(L))
    if method == "fedlpa":
        g = vars(L)
        rec.state.update(fedlpa=100 * g["best_acc"], newton=server_scores[0], biased=server_scores[1])
        # beyond the script, after it ended: its own weighted average of these clients (`avg_param`, computed and
        # never scored) scored by its own compute_accuracy — the FedAvg of the very clients FedLPA aggregates
        g["global_model"].load_state_dict(g["avg_param"])
        rec.state["fedavg_of_these_clients"] = 100 * their_accuracy(g["global_model"], g["test_dl_global"])
    tick()
    rec.state["status"] = "finished"
    rec.save()
    return 0


# ------------------------------------------------------------------------------------------------ the parent
def their_flags(cell: dict, method: str, run_dir: Path, local_epochs: int | None = None,
                epochs: int | None = None) -> tuple[list[list[str]], dict | None]:
    """The script's flags for the cell, one list per child (`fedlpa`: one; `dense`: pretrain, kd_train), as
    scripts/experiments.sh gives them at the cell's setting, and for `dense` the fusion's budget. Refuses a cell
    whose setting the scripts do not run."""
    c = cell["config"]
    need = {"dataset.name": (c["dataset"]["name"], "fmnist"), "model.name": (c["model"]["name"], "simple-cnn"),
            "partition.kind": (c["partition"]["kind"], "noniid-labeldir"),
            "partition.rng": (c["partition"]["rng"], "legacy"), "num_clients": (c["num_clients"], 10),
            "batch_size": (c["batch_size"], 64), "test_batch_size": (c["test_batch_size"], 32),
            "lr": (c["lr"], 0.01), "drop_last": (c["drop_last"], False), "optim.momentum": (c["optim"]["momentum"],
                                                                                            0.9),
            "optim.weight_decay": (c["optim"]["weight_decay"], 1e-5),  # experiments_our.py --reg default
            "augment.input_scaling": (c["augment"]["input_scaling"], "none")}
    off = [f"{k}={v[0]!r} (the script: {v[1]!r})" for k, v in need.items() if v[0] != v[1]]
    if off:
        raise SystemExit("reference_fedlpa: the cell's setting is not the script's: " + "; ".join(off))
    beta, seed, n = f"{c['partition']['alpha']:g}", str(c["seed"]), str(c["num_clients"])
    local = str(local_epochs or c["rounds"] * c["local_epochs"])
    if method == "fedlpa":  # S:9-30
        return [["--model=simple-cnn", "--dataset=fmnist", "--alg=our", f"--lr={c['lr']:g}",
                 f"--batch-size={c['batch_size']}", f"--epochs={local}", f"--n_parties={n}",
                 f"--rho={c['optim']['momentum']:g}", "--comm_round=1", "--partition=noniid-labeldir",
                 f"--beta={beta}", "--device=cpu", f"--datadir={run_dir / 'data'}/", f"--logdir={run_dir / 'logs'}/",
                 "--noise=0", f"--init_seed={seed}", "--coor=0.999"]], None
    d = c["server"]["strategies"]["dense"]
    table_epochs = cell["fuse_options"]["dense"]["epochs"]
    run_epochs = epochs or table_epochs
    budget = {"epochs": run_epochs, "g_steps": d["g_steps"], "generator_steps": run_epochs * d["g_steps"],
              "table_epochs": table_epochs, "published_epochs": d["epochs"],
              "published_generator_steps": d["epochs"] * d["g_steps"]}
    pretrain = ["--type=pretrain", f"--lr={c['lr']:g}", "--model=fmnist_cnn", "--dataset=fmnist", f"--beta={beta}",
                f"--seed={seed}", f"--num_users={n}", f"--local_ep={local}", f"--epochs={d['epochs']}",
                "--partition", "noniid-labeldir"]  # S:250
    # S:251; --bn 1.0 as the script gives it (simple-cnn has no BatchNorm: the term is 0 either way)
    kd = ["--type=kd_train", f"--epochs={run_epochs}", f"--lr={d['lr']:g}", "--batch_size", str(d["batch_size"]),
          f"--synthesis_batch_size={d['synthesis_batch']}", "--g_steps", str(d["g_steps"]), "--lr_g", f"{d['lr_g']:g}",
          "--bn", "1.0", "--oh", f"{d['oh']:g}", "--T", f"{d['temperature']:g}", "--save_dir=run/fmnist",
          "--other=fmnist", "--model=fmnist_cnn", "--dataset=fmnist", f"--adv={d['adv']:g}", f"--beta={beta}",
          f"--seed={seed}", "--num_users", n, "--partition", "noniid-labeldir"]
    return [pretrain, kd], budget


def flare_values(spec: dict, cell: dict) -> dict:
    """FLARE's recorded values for the same cell (results/papers/, each at the table's budget) and the paper's."""
    sys.path.insert(0, str(ROOT / "tools"))
    import papers

    d = ROOT / "results" / "papers" / spec["table"] / cell["name"]
    out: dict = {"records": str(d.relative_to(ROOT))}
    for name, key, rule in (("fedavg", "acc_fedavg", "final"), ("ensemble", "acc_output", "final"),
                            ("fedlpa", "fuse:fedlpa", "final"), ("dense", "fuse:dense", "final"),
                            ("dense_best", "fuse:dense", "peak")):
        try:
            v = papers.cell_value(d, key, rule)
        except (OSError, KeyError, ValueError):
            continue
        if v == v:
            out[name] = v
    out["paper"] = {col: v.get(cell["alpha"]) for col, v in (spec.get("published") or {}).items()}
    return out


def main(argv=None) -> int:
    ap = ref.cell_arguments(__doc__, "lebronlambert/FedLPA_NeurIPS2024", tuple(SCRIPTS), alpha=0.1, table=TABLE)
    ap.add_argument("--local-epochs", type=int, help="a shortened smoke: the clients' local epochs (not the table's)")
    args = ap.parse_args(argv)
    checkout = args.checkout.resolve()
    if args.child:
        return child(checkout, args.child)
    if not all((checkout / s).is_file() for s in (*SCRIPTS.values(), "kfac.py")):
        print(f"reference_fedlpa: {checkout} is not a checkout of lebronlambert/FedLPA_NeurIPS2024 (no "
              f"{', '.join(SCRIPTS.values())} and kfac.py).", file=sys.stderr)
        return 2
    spec, cell = ref.table_cell(args.table, args.alpha, args.seed)
    suffix = ("" if args.partition == "flare" else "-own-split") + (
        f"-smoke-e{args.local_epochs}" if args.local_epochs else "")
    name = f"{args.method}-a{args.alpha:g}-s{args.seed}{suffix}"
    run_dir = (args.runs / spec["table"] / name).resolve()
    flags, budget = their_flags(cell, args.method, run_dir, args.local_epochs, args.epochs)
    dest = args.results / spec["table"] / name
    record = dest / "record.json"
    if record.is_file():
        print(f"reference_fedlpa: {name} is recorded ({record}); nothing to run.")
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = run_dir / "argv.json"
    if manifest.is_file() and json.loads(manifest.read_text()) != flags:
        print(f"reference_fedlpa: {run_dir} holds a run with other flags ({manifest}); move it aside to run this "
              "setting.", file=sys.stderr)
        return 2
    manifest.write_text(json.dumps(flags))
    part = ref.prepare(cell, run_dir)
    progress = dest / "progress.json"
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    ours = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    edited = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", str(Path(__file__).resolve())],
                            capture_output=True, text=True).stdout.strip()
    from flare import cpu

    phases = ["fedlpa"] if args.method == "fedlpa" else ["pretrain", "kd_train"]
    print(f"reference_fedlpa: {name} in {run_dir}; records to {dest}", flush=True)
    for phase, argv_ in zip(phases, flags):
        if phase == "pretrain" and (run_dir / f"fmnist_{cell['config']['num_clients']}clients_{args.alpha}.pkl"
                                    ).is_file():
            continue  # the clients are saved: the fusion goes on from them
        if phase == "kd_train" and (run_dir / "run").is_dir():  # an interrupted fusion's pool would join the new one
            import shutil

            shutil.rmtree(run_dir / "run")
            (run_dir / "kd_train-restarted").write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
        child_spec = run_dir / f"{phase}-spec.json"
        child_spec.write_text(json.dumps({
            "run_dir": str(run_dir), "method": args.method, "phase": phase, "argv": argv_,
            "partition": args.partition, "flare_partition": str(part), "progress": str(progress.resolve()),
            "num_clients": cell["config"]["num_clients"],
            "local_epochs": args.local_epochs or cell["config"]["rounds"] * cell["config"]["local_epochs"],
            "server_epochs": budget["epochs"] if budget else None}))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.time()
        rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--checkout", str(checkout),
                             "--child", str(child_spec)], env=cpu.user_environment()).returncode
        wall = time.time() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        state = json.loads(progress.read_text()) if progress.is_file() else {"sittings": [{}]}
        state["sittings"][-1].update(process_wall_seconds=round(wall, 1), process_cpu_seconds=round(cpu_s, 1),
                                     exit_status=rc, cpu_model=ref.cpu_model())
        progress.write_text(json.dumps(state, indent=1) + "\n")
        if rc != 0 or state.get("status") != "finished":
            print(f"reference_fedlpa: {name} stopped in its {phase} (exit {rc}); rerun the same command to go on.",
                  file=sys.stderr)
            return 1
    state = json.loads(progress.read_text())
    rec = {"reference": f"lebronlambert/FedLPA_NeurIPS2024 {SCRIPTS[args.method]}", "commit": commit,
           "checkout_modified": bool(dirty), "driver": {"flare_commit": ours, "driver_modified": bool(edited)},
           "table": spec["table"], "cell": name, "flare_cell": cell["name"], "method": args.method,
           "alpha": args.alpha, "seed": args.seed, "table_setting": not args.local_epochs,
           "argv": flags, "flare_config": cell["config"], "budget": budget, "stand_ins": STAND_INS[args.method],
           "partition": state["partition"],
           "clients": [{"client": int(k), **v} for k, v in sorted(state["clients"].items(), key=lambda kv: int(kv[0]))],
           "compare": flare_values(spec, cell), "accuracy_unit": "percent",
           "wall_seconds": round(sum(s.get("process_wall_seconds", 0) for s in state["sittings"]), 1),
           "cpu_seconds": round(sum(s.get("process_cpu_seconds", 0) for s in state["sittings"]), 1),
           "sittings": state["sittings"], "torch": state["torch"], "threads": state["threads"],
           "cpu_model": ref.cpu_model(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    keys = ("fedlpa", "newton", "biased", "fedavg_of_these_clients") if args.method == "fedlpa" else (
        "fedavg", "ensemble", "student_curve")
    rec.update({k: state.get(k) for k in keys})
    if args.method == "dense" and state.get("student_curve"):
        accs = [p["acc"] for p in state["student_curve"]]
        rec["student_final"], rec["student_best"] = accs[-1], max(accs)
    record.write_text(json.dumps(rec, indent=1) + "\n")
    progress.unlink()
    print(json.dumps({k: rec.get(k) for k in ("cell", *keys[:3], "student_best", "wall_seconds", "cpu_seconds")
                      if k != "student_curve"}), flush=True)
    if args.commit:
        ref._commit([dest], f"papers-reference: {spec['table']} {name} records (FedLPA's own code)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
