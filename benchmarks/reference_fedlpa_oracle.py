"""FedLPA's own code (lebronlambert/FedLPA_NeurIPS2024, `experiments_our.py`) and FLARE side by side on identical
tensors, at a cell of the FedLPA Fashion-MNIST table (configs/papers/fedlpa-fmnist.yaml): where do they part ways?

    python benchmarks/reference_fedlpa_oracle.py --checkout PATH/TO/FedLPA --alpha 0.1 --seed 0 --client 0 \
        --epochs 2 --saved-clients runs/papers-reference/fedlpa-fmnist/fedlpa-a0.1-s0/clients --record FILE.json

Two parts, each measured, never assumed.

* **The client** (`local`). One client's local training, once by the script's own `train_net_blockoffline` and
  once by FLARE's `Client.train_round` at the table cell's config (the FedAvg method whose clients the table's
  FedLPA column fuses), from the same initial weights (FLARE's seeded init, copied into the script's
  `SimpleCNNMNIST` by position: the two networks list the same tensors in the same order) and over the same
  batches in the same order (FLARE's round plan, served to the script's loader by a batch sampler; the images
  are the script's own `FashionMNIST_truncated` items, IDX files written from FLARE's arrays). After step 1, 2
  and 5 and after every epoch the two models' parameters are compared (largest absolute difference over all
  tensors); at the end also their logits on the first 1,000 test images and both test accuracies. A difference
  that float summation order explains stays near 1e-6 after a step; a setting that differs shows at step 1.
  Fewer `--epochs` than a round run as a shortened first round, whose permutations are the cell's first ones
  (FLARE draws a round's permutations one after another from one generator; checked here); whole rounds
  (`--epochs 20`) are the cell's own rounds, one optimiser carried across them as the cell carries it.
* **The server** (`server`, with `--saved-clients`). The ten clients the script trained at the cell, with the
  K-FAC factors it took (the clients/ directory `benchmarks/reference_fedlpa.py` keeps under runs/). Their
  aggregation is run by the script's own statements (its `__main__` block, from the size weights to the two
  solutions, executed from the checkout's file); FLARE's `merge` (flare.baselines.fedlpa) is given the same
  weights and the same factors (no damping of its own: the script's √(1 − coor)·I is in them) and solves the
  closed form ("biased") and the refined system ("newton" approaches it). Then FLARE's `fedlpa` as the table runs
  it — its own factors from 4 × 128 samples, its relative damping — over the same clients, and
  `fedlpa_reference`'s factors (configs/papers/plugins) beside the script's. Every solution is scored on the test
  set by the script's `compute_accuracy`, as the script scores its own.

Both codes run in this one process, on the same kernels; the script's module is executed from the checkout's file
(its top level; its `__main__` block only where the server part says), never copied. Without `--checkout` the tool
says so and exits 0: the reference is not part of FLARE.
"""
from __future__ import annotations

import argparse
import ast
import copy
import json
import logging
import math
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_dense as ref  # noqa: E402
import reference_fedlpa as drv  # noqa: E402

ROOT = ref.ROOT
TABLE = ROOT / "configs" / "papers" / "fedlpa-fmnist.yaml"
PLUGINS = ROOT / "configs" / "papers" / "plugins"
SAME = 1e-5  # the largest parameter difference float summation order explains after a step (the task's yardstick)


# ------------------------------------------------------------------------------------------------ FLARE's side
def flare_config(table: Path, alpha: float, seed: int, epochs: int, sets: list[str]):
    """The table cell's FLARE config (its FedAvg method: the clients the FedLPA column fuses) with any `--set`
    overrides (a test's tiny data), and how many of its rounds `epochs` spans: fewer epochs than a round run as a
    shortened first round (`local_epochs` = epochs), a whole number of rounds as the cell's own. Returns the
    table's spec, the cell, the config, the cell's epochs per round and the rounds run."""
    from flare.config.load import deep_merge, load_config, parse_overrides

    spec, cell = ref.table_cell(table, alpha, seed)
    mapping = deep_merge(copy.deepcopy(cell["config"]), parse_overrides(list(sets)))
    full, rounds = mapping["local_epochs"], 1
    if epochs <= full:
        mapping["local_epochs"] = epochs
    elif epochs % full == 0 and epochs // full <= mapping["rounds"]:
        rounds = epochs // full
    else:
        raise SystemExit(f"reference_fedlpa_oracle: --epochs must be 1..{full} or whole rounds of {full} epochs, at "
                         f"most {mapping['rounds']} of them.")
    return spec, cell, load_config(overrides=mapping), full, rounds


def flare_client(cfg, k: int):
    """The run's setup and its client k, built as `flare run` builds them."""
    from flare.setup import RunSetup

    setup = RunSetup.build(cfg)
    clients = setup.make_clients(lambda m: None, lambda m: None)
    return setup, clients[k]


def plan_positions(client, ctx, full_epochs: int, rounds: int):
    """The client's batch order over its first `rounds` rounds as positions into its own samples (one permutation per
    epoch), and whether they are the cell's: a shortened first round's permutations must be the first of the full
    round's (one generator draws them one after another), whole rounds are the cell's own."""
    import torch

    from flare.client.plan import RoundPlan

    inv = torch.full((int(client.indices.max()) + 1,), -1, dtype=torch.long)
    inv[client.indices.cpu()] = torch.arange(client.num_samples)
    plans = [RoundPlan(client, ctx, r) for r in range(rounds)]
    pos = torch.cat([inv[p.samples.cpu()].reshape(p.E, client.num_samples) for p in plans])
    if rounds > 1 or plans[0].E == full_epochs:
        return pos, True
    longer = copy.copy(client)
    longer.cfg = ctx.cfg.model_copy(update={"local_epochs": full_epochs})
    ctx_full = copy.copy(ctx)
    ctx_full.cfg = longer.cfg
    full = RoundPlan(longer, ctx_full, 0).samples.cpu()
    return pos, bool(torch.equal(full[:plans[0].samples.numel()], plans[0].samples.cpu()))


# ------------------------------------------------------------------------------------------------ the script's side
FEDAVG_SCRIPT = "experiments.py"  # the paper's FedAvg column: scripts/experiments.sh's `--alg=fedavg` lines


def their_modules(checkout: Path):
    """experiments_our.py and experiments.py as modules (their top levels run, their `__main__` blocks kept aside),
    with the globals their functions read from those blocks (`logger`, `device`, `param_shapes`; experiments.py's
    `train_net` reads `args`, set by `their_args`). Returns both modules and experiments_our.py's `__main__`."""
    import torch

    sys.path.insert(0, str(checkout))
    L, main = drv.load_script(checkout, drv.SCRIPTS["fedlpa"])
    E, _ = drv.load_script(checkout, FEDAVG_SCRIPT)
    quiet = logging.getLogger("fedlpa-oracle.reference")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    for mod in (L, E):
        mod.logger, mod.device, mod.param_shapes = quiet, torch.device("cpu"), {}
    return L, E, main


def their_args(L, E, cell: dict, run_dir: Path, epochs: int, cfg) -> tuple:
    """Each script's own parser over the flags `scripts/experiments.sh` gives at the cell (reference_fedlpa's for
    experiments_our.py; experiments.py's lines are the same flags with `--alg=fedavg` and no `--coor`), the batch
    size FLARE's config runs (the table's 64; a test's smaller one). Returns both parsed and both flag lists."""
    flags = [*drv.their_flags(cell, "fedlpa", run_dir, epochs)[0][0], f"--batch-size={cfg.batch_size}"]
    e_flags = [("--alg=fedavg" if f == "--alg=our" else f) for f in flags if not f.startswith("--coor")]
    old = sys.argv
    try:
        sys.argv = [drv.SCRIPTS["fedlpa"], *flags]
        args = L.get_args()
        sys.argv = [FEDAVG_SCRIPT, *e_flags]
        E.args = E.get_args()
    finally:
        sys.argv = old
    return args, E.args, flags, e_flags


class PlannedBatches:
    """A batch sampler for the script's loader: the loader's pass p (the script iterates it once for its accuracy
    before training, then once per epoch, then for its factors and its accuracy after) serves `orders[p - 1]` for
    p = 1..E and the samples in order otherwise; `served` keeps (pass, first position) of every batch."""

    def __init__(self, orders, n: int, batch: int):
        self.orders, self.n, self.B, self.passes, self.served = orders, n, batch, 0, []

    def __iter__(self):
        p, self.passes = self.passes, self.passes + 1
        order = self.orders[p - 1].tolist() if 1 <= p <= len(self.orders) else list(range(self.n))
        for s in range(0, self.n, self.B):
            self.served.append(p)
            yield order[s:s + self.B]

    def __len__(self) -> int:
        return math.ceil(self.n / self.B)


def snapshot_steps(spe: int, epochs: int) -> list[int]:
    return sorted({1, 2, 5, *(spe * e for e in range(1, epochs + 1))} & set(range(1, spe * epochs + 1)))


def max_diff(a: dict, b: dict) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a.values(), b.values()))


def matched_keys(flare_state: dict, their_state: dict) -> list[tuple[str, str]]:
    """FLARE's keys and the script's, paired by position; refused unless every pair has one shape."""
    pairs = list(zip(flare_state, their_state))
    if len(flare_state) != len(their_state) or any(flare_state[a].shape != their_state[b].shape for a, b in pairs):
        raise SystemExit("reference_fedlpa_oracle: FLARE's network and the script's do not list the same tensors: "
                         f"{[(k, tuple(v.shape)) for k, v in flare_state.items()]} against "
                         f"{[(k, tuple(v.shape)) for k, v in their_state.items()]}")
    return pairs


# ------------------------------------------------------------------------------------------------ part 1: a client
def by_script(train, net, sampler: PlannedBatches, want: list[int]) -> dict:
    """Runs one of the scripts' client functions (`train`, no arguments), watching its SGD steps from outside:
    the parameters after each step in `want`, how many steps, in which passes of the loader, the CPU seconds."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    snaps, count, passes = {}, [0], set()

    def after_step(opt, a, kw):
        if isinstance(opt, torch.optim.SGD):  # K-FAC's optimiser only gathers statistics: it never steps
            count[0] += 1
            passes.add(sampler.served[-1])
            if count[0] in want:
                snaps[count[0]] = {k: v.detach().clone() for k, v in net.state_dict().items()}

    handle = register_optimizer_step_post_hook(after_step)
    t0 = time.process_time()
    try:
        train()
    finally:
        handle.remove()
    return {"snaps": snaps, "steps": count[0], "passes": sorted(passes), "cpu": round(time.process_time() - t0, 1)}


def compared(a: dict, b: dict, keys: list[tuple[str, str]], init: list, spe: int) -> dict:
    """Step by step, the largest absolute difference between two runs' parameters (a's and b's keys paired, `init`
    the initial tensors in that order), the tensor where it is largest, and how far each run has moved from the
    init; the first step past `SAME`."""
    def moved(run, s, side):
        return max(float((run["snaps"][s][k[side]].double() - t.double()).abs().max()) for k, t in zip(keys, init))

    rows = []
    for s in sorted(a["snaps"]):
        per = {ka: float((a["snaps"][s][ka].double() - b["snaps"][s][kb].double()).abs().max()) for ka, kb in keys}
        rows.append({"step": s, "epoch": round(s / spe, 4), "max_abs_diff": max(per.values()),
                     "worst_tensor": max(per, key=per.get), "max_abs_update": [moved(a, s, 0), moved(b, s, 1)]})
    first = next((r for r in rows if r["max_abs_diff"] > SAME), None)
    return {"steps": rows, "first_divergence": first, "verdict": "same" if first is None else "differs"}


def local_part(L, E, args, e_args, setup, client, pos, epochs: int, rounds: int) -> dict:
    import torch

    cfg, ctx = setup.cfg, setup.ctx
    n, B = client.num_samples, cfg.batch_size
    spe = math.ceil(n / B)
    want = snapshot_steps(spe, epochs)
    dataidxs = client.indices.cpu().tolist()
    _, test_dl, train_ds, _ = L.get_dataloader(args.dataset, args.datadir, args.batch_size, 32, dataidxs, 0)

    nets, _, _ = L.init_nets(args.net_config, 0, 2, args)
    ours, fedavg = nets[0], nets[1]  # experiments_our.py's client, experiments.py's (the same class)
    flare_init = {k: v.detach().clone() for k, v in client.model.state_dict().items()}
    pairs = matched_keys(flare_init, ours.state_dict())
    for net in (ours, fedavg):
        net.load_state_dict({b: flare_init[a] for a, b in pairs})

    # the inputs: the script's item for each of the client's samples against FLARE's plain view of the same sample
    xs = torch.stack([train_ds[i][0] for i in range(n)])
    ys = torch.as_tensor([int(train_ds[i][1]) for i in range(n)])
    inputs = {"max_abs_diff": float((xs - ctx.plain(ctx.train_x[client.indices]).cpu()).abs().max()),
              "labels_equal": bool(torch.equal(ys, ctx.train_y[client.indices].cpu()))}

    def loader():
        sampler = PlannedBatches(pos, n, B)
        return sampler, torch.utils.data.DataLoader(train_ds, batch_sampler=sampler)

    # experiments_our.py (--alg=our): train, then its K-FAC pass (no step); its posterior term is 0 in round 1
    s_o, dl_o = loader()
    f_local = OrderedDict((name, {}) for name, m in ours.named_modules() if type(m).__name__ in {"Linear", "Conv2d"})
    f_global = copy.deepcopy(f_local)
    run_o = by_script(lambda: L.train_net_blockoffline(client.cid, ours, f_local, copy.deepcopy(ours.state_dict()),
                                                       f_global, n, dl_o, test_dl, epochs, args.lr, args.coor, args,
                                                       device="cpu"), ours, s_o, want)
    # experiments.py (--alg=fedavg, the paper's FedAvg column): its train_net
    s_e, dl_e = loader()
    run_e = by_script(lambda: E.train_net(client.cid, fedavg, dl_e, test_dl, epochs, e_args.lr, e_args.optimizer,
                                          device="cpu"), fedavg, s_e, want)
    # FLARE's client, the same steps
    snaps_f, steps_f = {}, [0]

    def on_step():
        steps_f[0] += 1
        if steps_f[0] in want:
            snaps_f[steps_f[0]] = {k: v.detach().clone() for k, v in client.model.state_dict().items()}

    t0 = time.process_time()
    for r in range(rounds):  # the cell's rounds: one optimiser throughout (optim.reset_each_round: false)
        client.train_round(ctx, r, on_step=on_step)
    run_f = {"snaps": snaps_f, "steps": steps_f[0], "cpu": round(time.process_time() - t0, 1)}

    # the trained models on the same test inputs: logits and accuracy (the script's compute_accuracy)
    tx = setup.server.test_x[:1000].cpu()
    client.model.eval()
    ours.eval()
    with torch.no_grad():
        lf, lo = client.model(setup.norm(tx))[1], ours(setup.norm(tx))
    as_script = copy.deepcopy(ours)
    as_script.load_state_dict({tb: client.model.state_dict()[fa] for fa, tb in pairs})
    same, init = [(b, b) for _, b in pairs], [flare_init[a] for a, _ in pairs]
    return {"client": client.cid, "samples": n, "batch_size": B, "steps_per_epoch": spe, "epochs": epochs,
            "inputs": inputs,
            "optimizer_steps": {"our_script": run_o["steps"], "fedavg_script": run_e["steps"], "flare": run_f["steps"]},
            "loader_passes_with_steps": {"our_script": run_o["passes"], "fedavg_script": run_e["passes"]},
            "our_script_vs_flare": compared(run_o, run_f, [(b, a) for a, b in pairs], init, spe),
            "our_script_vs_fedavg_script": compared(run_o, run_e, same, init, spe),
            "final_logits_max_abs_diff_our_script_vs_flare": float((lf - lo).abs().max()),
            "final_logits_max_abs": float(lo.abs().max()),
            "test_accuracy": {"our_script": 100 * L.compute_accuracy(ours, test_dl),
                              "fedavg_script": 100 * L.compute_accuracy(fedavg, test_dl),
                              "flare": 100 * L.compute_accuracy(as_script, test_dl)},
            "cpu_seconds": {"our_script": run_o["cpu"], "fedavg_script": run_e["cpu"], "flare": run_f["cpu"]}}


# ------------------------------------------------------------------------------------------------ part 2: the server
def aggregation_statements(main: ast.If) -> ast.Module:
    """The script's own aggregation: in its round loop, the statements after the clients' training call up to the
    first bare expression (its logging and scoring) — the size weights, the weighted average, the factors' sums and
    the two solutions."""
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For)
                and any("local_train_net_blockoffline" in ast.unparse(s) for s in n.body))
    i = next(j for j, s in enumerate(loop.body) if "local_train_net_blockoffline" in ast.unparse(s))
    body = []
    for s in loop.body[i + 1:]:
        if isinstance(s, ast.Expr):
            break
        body.append(s)
    return ast.Module(body=body, type_ignores=[])


def server_part(L, main, args, setup, saved: Path) -> dict:
    import torch

    from flare.baselines.fedlpa import FedLPAOptions, merge
    from flare.server.extras import client_side
    from flare.server.strategy import make_strategies

    cfg = setup.cfg
    K = cfg.num_clients
    files = [saved / f"client{i}.pt" for i in range(K)]
    if missing := [str(f) for f in files if not f.is_file()]:
        raise SystemExit(f"reference_fedlpa_oracle: --saved-clients lacks {missing[0]}")
    saved_clients = [torch.load(f, weights_only=False) for f in files]
    nets, _, _ = L.init_nets(args.net_config, 0, K, args)
    for i, s in enumerate(saved_clients):
        nets[i].load_state_dict(s["weights"])
    global_model = L.init_nets(args.net_config, 0, 1, args)[0][0]
    names = [name for name, m in global_model.named_modules() if type(m).__name__ in {"Linear", "Conv2d"}]
    f_nets = [OrderedDict((name, {0: s["factors"][name][0], 1: s["factors"][name][1]}) for name in names)
              for s in saved_clients]
    global_fim = OrderedDict((name, {}) for name in names)
    parts = setup.partition.client_indices
    ns = vars(L)
    ns.update(nets=nets, selected=list(range(K)), f_nets=f_nets, global_fim=global_fim, global_model=global_model,
              net_dataidx_map={i: list(map(int, parts[i])) for i in range(K)}, args=args,
              param_shapes={k: v.shape for k, v in global_model.state_dict().items()})
    t0 = time.process_time()
    exec(compile(aggregation_statements(main), L.__file__, "exec"), ns)
    cpu_script = time.process_time() - t0
    freqs = ns["fed_avg_freqs"]
    _, test_dl, _, _ = L.get_dataloader(args.dataset, args.datadir, args.batch_size, 32)

    def score(state: dict) -> float:
        global_model.load_state_dict(state)
        return 100 * L.compute_accuracy(global_model, test_dl)

    flare_model = copy.deepcopy(setup.server.template).cpu()
    pairs = matched_keys(flare_model.state_dict(), global_model.state_dict())
    to_flare = {tb: fa for fa, tb in pairs}
    to_theirs = {fa: tb for fa, tb in pairs}
    states = [{to_flare[k]: v for k, v in net.state_dict().items()} for net in nets.values()]
    fedlpa = make_strategies(cfg, ["fedlpa"])["fedlpa"]
    layers = fedlpa._layers(flare_model)
    if [L_.name for L_ in layers] != [to_flare[f"{n}.weight"][: -len(".weight")] for n in names]:
        raise SystemExit("reference_fedlpa_oracle: FLARE's factor layers are not the script's")
    their_extras = [{f"{L_.name}.{ab}": f[n][j][None] for L_, n in zip(layers, names) for j, ab in ((0, "A"), (1, "G"))}
                    for f in f_nets]
    w = torch.tensor(freqs, dtype=torch.float64)
    out = {"saved_clients": {"path": str(saved), "test_acc": [s.get("record", {}).get("test_acc")
                                                              for s in saved_clients]},
           "client_sizes": [len(parts[i]) for i in range(K)], "weights": freqs,
           "script": {"cpu_seconds": round(cpu_script, 1)}}

    def as_theirs(state):
        return {to_theirs[k]: v for k, v in state.items()}

    solved = {}
    for label, steps in (("closed_form", 0), ("refined", 50)):
        t0 = time.process_time()
        st, logs = merge(states, their_extras, w, layers, FedLPAOptions(damping=0.0, refine_steps=steps), True)
        solved[label] = as_theirs(st)
        out[f"flare_merge_{label}"] = {"residual": logs["residual"], "cpu_seconds": round(time.process_time() - t0, 1)}
    for key, theirs in (("avg_param", "fedavg"), ("biased_param", "biased"), ("newtons_param", "newton")):
        out["script"][theirs] = score(ns[key])
    # how far the script's 10,000 "newton" steps moved its solution from the closed form it starts at
    out["script"]["newton_vs_biased_max_abs_diff"] = max_diff(ns["newtons_param"], ns["biased_param"])
    # the script's two solutions against FLARE's arithmetic on the same weights and factors
    out["flare_merge_closed_form"].update(acc=score(solved["closed_form"]),
                                          max_abs_diff_vs_script_biased=max_diff(solved["closed_form"],
                                                                                 ns["biased_param"]))
    out["flare_merge_refined"].update(acc=score(solved["refined"]),
                                      max_abs_diff_vs_script_newton=max_diff(solved["refined"], ns["newtons_param"]),
                                      max_abs_diff_vs_script_biased=max_diff(solved["refined"], ns["biased_param"]))
    out["max_abs_param"] = max(float(v.abs().max()) for v in ns["biased_param"].values())

    # FLARE's servers over the same clients with their own factors: the table's fedlpa, and fedlpa_reference
    sys.path.insert(0, str(PLUGINS))
    import flare_fedlpa_reference  # noqa: F401  (registers fedlpa_reference)

    built = make_strategies(cfg, ["fedlpa", "fedlpa_reference"])
    ctx = setup.ctx
    for name, strategy in built.items():
        t0 = time.process_time()
        extras = []
        for i in range(K):
            model = copy.deepcopy(flare_model)
            model.load_state_dict(states[i])
            ix = torch.as_tensor(parts[i])
            extras.append(strategy.client_extras(client_side(i, model, ctx.train_x[ix], ctx.train_y[ix],
                                                             ctx.plain, None, torch.device("cpu"))))
        st, logs = merge(states, extras, w, strategy._layers(flare_model), strategy.options, True)
        entry = {"acc": score(as_theirs(st)), "residual": logs["residual"],
                 "cpu_seconds": round(time.process_time() - t0, 1)}
        if name == "fedlpa_reference":  # its factors against the script's, client by client
            rel = [float((e[k][0].double() - t[k][0].double()).norm() / t[k][0].double().norm())
                   for e, t in zip(extras, their_extras) for k in t]
            entry["factors_max_relative_diff_vs_script"] = max(rel)
        out[f"flare_{name}"] = entry
    return out


# ------------------------------------------------------------------------------------------------ the command
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, help="a checkout of lebronlambert/FedLPA_NeurIPS2024 (none: skip)")
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=2, help="local epochs compared: up to a round, or whole rounds")
    ap.add_argument("--table", type=Path, default=TABLE)
    ap.add_argument("--saved-clients", type=Path, help="reference_fedlpa's clients/ directory of the same cell: "
                                                        "the server part runs over them")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a FLARE config override")
    ap.add_argument("--runs", type=Path, default=ref.RUNS / "oracle", help="scratch: the IDX files")
    ap.add_argument("--record", type=Path, help="write the measurement here (JSON)")
    a = ap.parse_args(argv)
    if a.checkout is None:
        print("reference_fedlpa_oracle: skipped — no --checkout of lebronlambert/FedLPA_NeurIPS2024 given (the "
              "reference is not part of FLARE); nothing was run.")
        return 0
    checkout = a.checkout.resolve()
    if not (checkout / drv.SCRIPTS["fedlpa"]).is_file():
        print(f"reference_fedlpa_oracle: {checkout} has no {drv.SCRIPTS['fedlpa']}.", file=sys.stderr)
        return 2
    import torch

    t_wall, t_cpu = time.time(), time.process_time()
    if a.epochs < 1:
        print("reference_fedlpa_oracle: --epochs must be at least 1.", file=sys.stderr)
        return 2
    spec, cell, cfg, full_epochs, rounds = flare_config(a.table, a.alpha, a.seed, a.epochs, a.set)
    setup, client = flare_client(cfg, a.client)
    run_dir = (a.runs / f"a{a.alpha:g}-s{a.seed}").resolve()
    raw = run_dir / "data" / "FashionMNIST" / "raw"
    for name, arr in (("train-images-idx3-ubyte", setup.ctx.train_x[:, 0]), ("train-labels-idx1-ubyte",
                                                                             setup.ctx.train_y),
                      ("t10k-images-idx3-ubyte", setup.server.test_x[:, 0]), ("t10k-labels-idx1-ubyte",
                                                                             setup.server.test_y)):
        ref.write_idx(raw / name, arr.cpu().numpy())
    L, E, main_block = their_modules(checkout)
    args, e_args, flags, e_flags = their_args(L, E, cell, run_dir, a.epochs, cfg)
    shown = {name: [f for f in fl if not f.startswith(("--datadir", "--logdir"))]  # scratch paths left out
             for name, fl in (("our_script", flags), ("fedavg_script", e_flags))}
    pos, prefix_ok = plan_positions(client, setup.ctx, full_epochs, rounds)
    rec = {"tool": "benchmarks/reference_fedlpa_oracle.py", "reference": "lebronlambert/FedLPA_NeurIPS2024 "
           "experiments_our.py", "commit": subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"],
                                                         capture_output=True, text=True).stdout.strip() or None,
           "table": spec["table"], "flare_cell": cell["name"], "alpha": a.alpha, "seed": a.seed,
           "flare_overrides": a.set, "script_flags": shown,
           "same_threshold": SAME, "plan_is_the_cells_first_epochs": prefix_ok,
           "flare_rounds": rounds,
           "local": local_part(L, E, args, e_args, setup, client, pos, a.epochs, rounds)}
    if a.saved_clients:
        rec["server"] = server_part(L, main_block, args, setup, a.saved_clients)
    rec.update(torch=torch.__version__, threads=torch.get_num_threads(), cpu_model=ref.cpu_model(),
               wall_seconds=round(time.time() - t_wall, 1), cpu_seconds=round(time.process_time() - t_cpu, 1),
               date=time.strftime("%Y-%m-%d"))
    text = json.dumps(rec, indent=1) + "\n"
    if a.record:
        a.record.parent.mkdir(parents=True, exist_ok=True)
        a.record.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
