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

import ast
import copy
import logging
import math
import sys
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_dense as ref  # noqa: E402
import reference_fedlpa as drv  # noqa: E402
from oracle import (PlannedBatches, by_flare, by_script, compared, matched_keys, max_diff,  # noqa: E402
                    oracle_arguments, portable, prepared, record_head, refused, snapshot_steps, write_record)

ROOT = ref.ROOT
TABLE = ROOT / "configs" / "papers" / "fedlpa-fmnist.yaml"
PLUGINS = ROOT / "configs" / "papers" / "plugins"
TOOL = "reference_fedlpa_oracle"


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


# ------------------------------------------------------------------------------------------------ part 1: a client
def local_part(L, E, args, e_args, setup, client, pos, epochs: int, rounds: int) -> dict:
    import torch

    cfg, ctx = setup.server.cfg, setup.ctx
    n, B = client.num_samples, cfg.batch_size
    spe = math.ceil(n / B)
    want = snapshot_steps(spe, epochs)
    dataidxs = client.indices.cpu().tolist()
    _, test_dl, train_ds, _ = L.get_dataloader(args.dataset, args.datadir, args.batch_size, 32, dataidxs, 0)

    nets, _, _ = L.init_nets(args.net_config, 0, 2, args)
    ours, fedavg = nets[0], nets[1]  # experiments_our.py's client, experiments.py's (the same class)
    flare_init = {k: v.detach().clone() for k, v in client.model.state_dict().items()}
    pairs = matched_keys(TOOL, flare_init, ours.state_dict())
    for net in (ours, fedavg):
        net.load_state_dict({b: flare_init[a] for a, b in pairs})

    # the inputs: the script's item for each of the client's samples against FLARE's plain view of the same sample
    xs = torch.stack([train_ds[i][0] for i in range(n)])
    ys = torch.as_tensor([int(train_ds[i][1]) for i in range(n)])
    inputs = {"max_abs_diff": float((xs - ctx.plain(ctx.train_x[client.indices]).cpu()).abs().max()),
              "labels_equal": bool(torch.equal(ys, ctx.train_y[client.indices].cpu()))}

    def loader():
        sampler = PlannedBatches(pos, n, B, first=1)  # the scripts score the loader once before training
        return sampler, torch.utils.data.DataLoader(train_ds, batch_sampler=sampler)

    # experiments_our.py (--alg=our): train, then its K-FAC pass (no step); its posterior term is 0 in round 1
    s_o, dl_o = loader()
    f_local = OrderedDict((name, {}) for name, m in ours.named_modules() if type(m).__name__ in {"Linear", "Conv2d"})
    f_global = copy.deepcopy(f_local)
    run_o, _ = by_script(lambda: L.train_net_blockoffline(client.cid, ours, f_local, copy.deepcopy(ours.state_dict()),
                                                       f_global, n, dl_o, test_dl, epochs, args.lr, args.coor, args,
                                                       device="cpu"), ours, s_o, want)
    # experiments.py (--alg=fedavg, the paper's FedAvg column): its train_net
    s_e, dl_e = loader()
    run_e, _ = by_script(lambda: E.train_net(client.cid, fedavg, dl_e, test_dl, epochs, e_args.lr, e_args.optimizer,
                                          device="cpu"), fedavg, s_e, want)
    # FLARE's client, the same steps: the cell's rounds, one optimiser throughout (optim.reset_each_round: false)
    run_f = by_flare(client, ctx, rounds, want)

    # the trained models on the same test inputs: logits and accuracy (the script's compute_accuracy)
    tx = setup.server.test_x[:1000].cpu()
    client.model.eval()
    ours.eval()
    with torch.no_grad():
        lf, lo = client.model(setup.server.norm(tx))[1], ours(setup.server.norm(tx))
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

    cfg = setup.server.cfg
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
    pairs = matched_keys(TOOL, flare_model.state_dict(), global_model.state_dict())
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
    out = {"saved_clients": {"path": portable(saved), "test_acc": [s.get("record", {}).get("test_acc")
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
    repo = "lebronlambert/FedLPA_NeurIPS2024"
    ap = oracle_arguments(__doc__, repo, 0.1, TABLE, 2)
    a = ap.parse_args(argv)
    if (rc := refused(TOOL, repo, a, drv.SCRIPTS["fedlpa"])) is not None:
        return rc
    p = prepared(TOOL, a)
    L, E, main_block = their_modules(a.checkout.resolve())
    args, e_args, flags, e_flags = their_args(L, E, p.cell, p.run_dir, a.epochs, p.cfg)
    shown = {name: [f for f in fl if not f.startswith(("--datadir", "--logdir"))]  # scratch paths left out
             for name, fl in (("our_script", flags), ("fedavg_script", e_flags))}
    rec = {**record_head(TOOL, f"{repo} experiments_our.py", a, p, shown),
           "local": local_part(L, E, args, e_args, p.setup, p.client, p.pos, a.epochs, p.rounds)}
    return write_record(rec, a, p, lambda saved: server_part(L, main_block, args, p.setup, saved))


if __name__ == "__main__":
    sys.exit(main())
