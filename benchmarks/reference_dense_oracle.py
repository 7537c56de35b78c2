"""DENSE's own code (zj-jayzhang/DENSE, `loop_df_fl.py --type pretrain`) and FLARE side by side on identical
tensors, at a FedAvg cell of the DENSE Fashion-MNIST table (configs/papers/dense-fmnist.yaml): where do they part
ways?

    python benchmarks/reference_dense_oracle.py --checkout PATH/TO/DENSE --alpha 0.3 --seed 0 --client 0 \
        --epochs 10 --saved-clients runs/papers-reference/dense-fmnist/a0.3-s0/clients --record FILE.json

Three parts, each measured, never assumed (benchmarks/oracle.py holds the recipe the oracles share).

* **The client** (`local`). One client's local training, once by the script's own `LocalUpdate.update_weights`
  and once by FLARE's `Client.train_round` at the table cell's config, from the same initial weights (FLARE's seeded
  init, copied into the script's `CNNMnist` by position: the two networks list the same tensors, BatchNorm's
  statistics included, in the same order) and over the same batches in the same order (FLARE's round plan, served to
  the loader `LocalUpdate` built, over the very dataset it built: `DatasetSplit` over torchvision's FashionMNIST
  reading IDX files written from FLARE's arrays). The script's per-epoch `test` runs as it does in the script, on
  its own test loader, so its BatchNorm mode after the first epoch is the script's. After step 1, 2 and 5 and after
  every epoch every state entry is compared (largest absolute difference), with each side's train/eval mode; at the
  end both models are scored by the script's `test`. Fewer `--epochs` than a round run as a shortened first round
  (FLARE draws a round's permutations one after another from one generator; checked here).
* **The script's own draws** (`own_draws`). The script's `__main__` block, executed from the checkout's file up to
  its `global_model = get_model(args)` (its seeding, its own split, its test loader, its init), against FLARE's: is
  its initial model FLARE's, is its split FLARE's, and (client 0 only: later clients' orders follow the earlier
  clients' training) is the first epoch's batch order its loader would draw FLARE's?
* **The server** (`server`, with `--saved-clients`). The clients the script trained at the cell
  (`benchmarks/reference_dense.py` keeps them under runs/). The script's `average_weights`, `Ensemble` and `test`
  score them as its pretrain does; FLARE's server, as the table's cell runs it (`server.weights`, the `fedavg` and
  `output` strategies, its evaluator), scores the same five — so a gap that survives is in the clients' draws, one
  that vanishes was in the server's arithmetic.

Both codes run in this one process, on the same kernels; the script's module is imported from the checkout with
reference_dense's stand-ins (device, logging, workers, unused imports, data root), never copied. Without
`--checkout` the tool says so and exits 0: the reference is not part of FLARE.
"""
from __future__ import annotations

import ast
import copy
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_dense as ref  # noqa: E402
from oracle import (PlannedBatches, by_flare, by_script, compared, flare_models, matched_keys,  # noqa: E402
                    oracle_arguments, portable, prepared, record_head, refused, snapshot_steps, write_record)

TOOL = "reference_dense_oracle"
REPO = "zj-jayzhang/DENSE"


# ------------------------------------------------------------------------------------------------ the script's side
def their_module(checkout: Path, data_root: Path):
    """loop_df_fl.py as a module (its top level run under reference_dense's stand-ins, its `__main__` block kept
    aside). Returns the module and that block."""
    ref._stand_ins(data_root)
    sys.path.insert(0, str(checkout))
    import loop_df_fl as L

    main = next(n for n in ast.parse(Path(L.__file__).read_text()).body
                if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    return L, main


def their_flags(cell: dict, cfg, epochs: int) -> list[str]:
    """reference_dense's flags for the cell (the README's pretrain command), with the epochs compared as
    `--local_ep` and the batch size and client count FLARE's config runs (the table's; a test's smaller ones)."""
    flags = ref.their_flags(cell, "fedavg", None)[0]
    given = {"--local_ep": str(epochs), "--local_bs": str(cfg.batch_size), "--num_users": str(cfg.num_clients)}
    return [given.get(flags[i - 1], f) if i else f for i, f in enumerate(flags)]


def their_start(L, main: ast.If, flags: list[str]) -> dict:
    """The script's `__main__` block, its parser given `flags`, up to and including its `global_model = ...`
    assignment (its seeding, split, test loader and init), executed in the module's namespace, which it returns."""
    body = []
    for s in main.body:
        body.append(s)
        if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "global_model" for t in s.targets):
            break
    ns, old = vars(L), sys.argv
    try:
        sys.argv = [ref.SCRIPT, *flags]
        exec(compile(ast.Module(body=body, type_ignores=[]), L.__file__, "exec"), ns)
    finally:
        sys.argv = old
    return ns


def own_draws(L, ns: dict, setup, client, pos) -> dict:
    """The script's own init, split and (client 0) first batch order against FLARE's."""
    import numpy as np

    flare_init = setup.server.client_init(client.cid).state_dict()
    theirs = ns["global_model"].state_dict()
    pairs = matched_keys(TOOL, flare_init, theirs)
    own = np.asarray(ns["user_groups"][client.cid], dtype=np.int64)
    ids = client.indices.cpu().numpy()
    out = {"init_max_abs_diff": max(float((flare_init[a].double() - theirs[b].double()).abs().max()) for a, b in pairs),
           "split_equals_flare": bool(np.array_equal(own, ids))}
    if client.cid == 0:  # the first loader the script builds draws from the streams its init left
        local = L.LocalUpdate(args=ns["args"], dataset=ns["train_dataset"], idxs=own)
        it = iter(local.train_loader)  # as its first epoch starts: the loader's base seed, then the sampler's
        order = np.asarray([i for batch in it._sampler_iter for i in batch])
        flare_ids, their_ids = ids[pos[0].numpy()], own[order]
        out["first_epoch_order_equals_flare"] = bool(np.array_equal(their_ids, flare_ids))
        m = min(len(their_ids), len(flare_ids))  # a split of its own may give the client another size
        out["first_epoch_positions_equal"] = int((their_ids[:m] == flare_ids[:m]).sum())
    return out


# ------------------------------------------------------------------------------------------------ part 1: a client
def local_part(L, ns: dict, setup, client, pos, epochs: int, rounds: int) -> dict:
    import torch

    cfg, ctx = setup.server.cfg, setup.ctx
    n, B = client.num_samples, cfg.batch_size
    spe = math.ceil(n / B)
    want = snapshot_steps(spe, epochs)
    net = copy.deepcopy(ns["global_model"])
    flare_init = {k: v.detach().clone() for k, v in client.model.state_dict().items()}
    pairs = matched_keys(TOOL, flare_init, net.state_dict())
    net.load_state_dict({b: flare_init[a] for a, b in pairs})

    local = L.LocalUpdate(args=ns["args"], dataset=ns["train_dataset"], idxs=client.indices.cpu().tolist())
    data = local.train_loader.dataset  # the script's DatasetSplit over its FashionMNIST
    xs = torch.stack([data[i][0] for i in range(n)])
    ys = torch.as_tensor([int(data[i][1]) for i in range(n)])
    inputs = {"max_abs_diff": float((xs - ctx.plain(ctx.train_x[client.indices]).cpu()).abs().max()),
              "labels_equal": bool(torch.equal(ys, ctx.train_y[client.indices].cpu()))}
    sampler = PlannedBatches(pos, n, B)  # the script's epochs are its loader's passes 0..E-1
    local.train_loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    run_t, (w, accs) = by_script(lambda: local.update_weights(net, client.cid), net, sampler, want)
    run_f = by_flare(client, ctx, rounds, want)

    flare_as_theirs = copy.deepcopy(net)
    flare_as_theirs.load_state_dict({tb: client.model.state_dict()[fa] for fa, tb in pairs})
    init = [flare_init[a] for a, _ in pairs]
    return {"client": client.cid, "samples": n, "batch_size": B, "steps_per_epoch": spe, "epochs": epochs,
            "inputs": inputs, "optimizer_steps": {"script": run_t["steps"], "flare": run_f["steps"]},
            "loader_passes_with_steps": run_t["passes"],
            "script_vs_flare": compared(run_t, run_f, [(b, a) for a, b in pairs], init, spe),
            "script_test_accuracy_per_epoch": [float(x) for x in accs],
            "test_accuracy": {"script": float(L.test(net, ns["test_loader"])[0]),
                              "flare": float(L.test(flare_as_theirs, ns["test_loader"])[0])},
            "cpu_seconds": {"script": run_t["cpu"], "flare": run_f["cpu"]}}


# ------------------------------------------------------------------------------------------------ part 2: the server
def their_scores(L, main: ast.If, ns: dict, weights: list[dict]) -> dict:
    """The script's pretrain from its saved clients on: the statements of its `--type pretrain` branch after it
    saves `local_weights` (the plain average, loaded into its model and tested, then the clients copied from that
    model and their logits' mean tested), executed in the module's namespace over `weights`, its `test` watched.
    The order matters: the ensemble keeps its models in a plain list, so its `eval()` reaches none of them, and
    they test in the mode the average's test left the model they were copied from."""
    branch = next(n for n in main.body if isinstance(n, ast.If) and "pretrain" in ast.unparse(n.test))
    i = next(j for j, s in enumerate(branch.body) if "torch.save" in ast.unparse(s) and "local_weights" in ast.unparse(s))
    scores, their_test = [], L.test

    def test(model, loader):
        acc, loss = their_test(model, loader)
        scores.append(("ensemble" if isinstance(model, L.Ensemble) else "fedavg", float(acc)))
        return acc, loss

    ns.update(local_weights=[copy.deepcopy(w) for w in weights], test=test)
    try:
        exec(compile(ast.Module(body=branch.body[i + 1:], type_ignores=[]), L.__file__, "exec"), ns)
    finally:
        ns["test"] = their_test
    return dict(scores)


def server_part(L, main: ast.If, ns: dict, setup, saved: Path) -> dict:
    import torch

    from flare.server.rules import fedavg_model

    cfg, K = setup.server.cfg, setup.server.cfg.num_clients
    files = [saved / f"client{i}.pt" for i in range(K)]
    if missing := [str(f) for f in files if not f.is_file()]:
        raise SystemExit(f"{TOOL}: --saved-clients lacks {missing[0]}")
    kept = [torch.load(f, weights_only=False) for f in files]
    weights = [k["weights"] for k in kept]
    t0 = time.process_time()
    script = their_scores(L, main, ns, weights)
    script["cpu_seconds"] = round(time.process_time() - t0, 1)
    global_weights = ns["global_weights"]

    parts = setup.partition.client_indices
    models, uploads, pairs = flare_models(TOOL, setup.server.template, weights, [len(p) for p in parts])
    t0 = time.process_time()
    ev = setup.server.evaluate(cfg.rounds - 1, uploads, models, rules=("fedavg", "output"))
    avg = fedavg_model(models, ev.weights, cfg.server.strategies["fedavg"]["buffers"]).state_dict()
    floats = [(a, b) for a, b in pairs if torch.is_floating_point(avg[a])]
    return {"saved_clients": {"path": portable(saved), "test_acc": [k.get("record", {}).get("acc_per_epoch", [None])[-1]
                                                               for k in kept]},
            "client_sizes": [len(p) for p in parts], "flare_weights": [float(x) for x in ev.weights],
            "script": script,
            "flare": {"fedavg": 100 * ev.record["acc_fedavg"], "ensemble": 100 * ev.record["acc_output"],
                      "client_acc": [100 * a for a in ev.record["client_acc"]],
                      "cpu_seconds": round(time.process_time() - t0, 1)},
            "average_max_abs_diff": max(float((avg[a].double() - global_weights[b].double()).abs().max())
                                        for a, b in floats),
            "average_max_abs": max(float(global_weights[b].abs().max()) for _, b in floats),
            "num_batches_tracked": {"script": [float(global_weights[b]) for a, b in pairs if a not in dict(floats)],
                                    "flare": [float(avg[a]) for a, b in pairs if a not in dict(floats)]}}


# ------------------------------------------------------------------------------------------------ the command
def main(argv=None) -> int:
    ap = oracle_arguments(__doc__, REPO, 0.3, ref.TABLE, 3)
    a = ap.parse_args(argv)
    if (rc := refused(TOOL, REPO, a, ref.SCRIPT)) is not None:
        return rc
    p = prepared(TOOL, a)
    L, main_block = their_module(a.checkout.resolve(), p.run_dir / "data")
    flags = their_flags(p.cell, p.cfg, a.epochs)
    ns = their_start(L, main_block, flags)
    rec = {**record_head(TOOL, f"{REPO} {ref.SCRIPT} --type pretrain", a, p, flags),
           "own_draws": own_draws(L, ns, p.setup, p.client, p.pos),
           "local": local_part(L, ns, p.setup, p.client, p.pos, a.epochs, p.rounds)}
    return write_record(rec, a, p, lambda saved: server_part(L, main_block, ns, p.setup, saved))


if __name__ == "__main__":
    sys.exit(main())
