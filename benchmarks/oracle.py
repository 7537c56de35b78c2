"""What every "identical tensors" oracle shares (benchmarks/reference_*_oracle.py): a paper's own client code and
FLARE's client run in one process from the same weights over the same batches, their parameters compared step by
step.

The recipe, the same for every paper: build the table cell's FLARE run and one of its clients (`flare_config`,
`flare_client`); take FLARE's batch order for that client as positions into its samples (`plan_positions`); copy
FLARE's init into the script's network by position (`matched_keys`: both networks must list the same tensors in the
same order); serve FLARE's order to the script's own loader (`PlannedBatches`); watch the script's SGD steps from
outside (`by_script`) and FLARE's through `on_step` (`by_flare`); compare (`compared`). A difference that float
summation order explains stays near 1e-6 after a step (`SAME`); a setting that differs shows at the first step it
touches. The oracles differ only in how they call the scripts, which is each paper's own."""
from __future__ import annotations

import copy
import math
import subprocess
import time
from pathlib import Path

import reference_dense as ref

SAME = 1e-5  # the largest parameter difference float summation order explains after a step (the yardstick)


# ------------------------------------------------------------------------------------------------ FLARE's side
def flare_config(tool: str, table: Path, alpha: float, seed: int, epochs: int, sets: list[str]):
    """The table cell's FLARE config (its FedAvg method: the clients the table's columns fuse) with any `--set`
    overrides (a test's tiny data), and how many of its rounds `epochs` spans: fewer epochs than a round run as a
    shortened first round (`local_epochs` = epochs), a whole number of rounds as the cell's own. Returns the
    table's spec, the cell (as the table file gives it), the config, the cell's epochs per round and the rounds
    run."""
    from flare.config.load import deep_merge, load_config, parse_overrides

    spec, cell = ref.table_cell(table, alpha, seed)
    mapping = deep_merge(copy.deepcopy(cell["config"]), parse_overrides(list(sets)))
    full, rounds = mapping["local_epochs"], 1
    if epochs <= full:
        mapping["local_epochs"] = epochs
    elif epochs % full == 0 and epochs // full <= mapping["rounds"]:
        rounds = epochs // full
    else:
        raise SystemExit(f"{tool}: --epochs must be 1..{full} or whole rounds of {full} epochs, at most "
                         f"{mapping['rounds']} of them.")
    return spec, cell, load_config(overrides=mapping), full, rounds


def flare_client(cfg, k: int):
    """The run's setup and its client k, built as `flare run` builds them."""
    from flare.setup import RunSetup

    setup = RunSetup.build(cfg)
    clients = setup.make_clients(lambda m: None, lambda m: None)
    return setup, clients[k]


def write_data(setup, raw: Path) -> None:
    """FLARE's prepared train and test arrays as the four IDX files torchvision's FashionMNIST reads from `raw`."""
    for name, arr in (("train-images-idx3-ubyte", setup.ctx.train_x[:, 0]),
                      ("train-labels-idx1-ubyte", setup.ctx.train_y),
                      ("t10k-images-idx3-ubyte", setup.server.test_x[:, 0]),
                      ("t10k-labels-idx1-ubyte", setup.server.test_y)):
        ref.write_idx(raw / name, arr.cpu().numpy())


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


def by_flare(client, ctx, rounds: int, want: list[int]) -> dict:
    """FLARE's client trains its first `rounds` rounds (one optimiser throughout where the cell carries it); the
    state after each step in `want` and the model's train/eval mode then, how many steps, the CPU seconds."""
    snaps, modes, steps = {}, {}, [0]

    def on_step():
        steps[0] += 1
        if steps[0] in want:
            snaps[steps[0]] = {k: v.detach().clone() for k, v in client.model.state_dict().items()}
            modes[steps[0]] = client.model.training

    t0 = time.process_time()
    for r in range(rounds):
        client.train_round(ctx, r, on_step=on_step)
    return {"snaps": snaps, "modes": modes, "steps": steps[0], "cpu": round(time.process_time() - t0, 1)}


# ------------------------------------------------------------------------------------------------ the script's side
class PlannedBatches:
    """A batch sampler for the script's loader: the loader's pass `first + e` serves `orders[e]` (a script that
    iterates its loader once before training, for an accuracy, starts its epochs at pass 1), every other pass the
    samples in order; `served` keeps the pass of every batch."""

    def __init__(self, orders, n: int, batch: int, first: int = 0):
        self.orders, self.n, self.B, self.first, self.passes, self.served = orders, n, batch, first, 0, []

    def __iter__(self):
        p, self.passes = self.passes, self.passes + 1
        e = p - self.first
        order = self.orders[e].tolist() if 0 <= e < len(self.orders) else list(range(self.n))
        for s in range(0, self.n, self.B):
            self.served.append(p)
            yield order[s:s + self.B]

    def __len__(self) -> int:
        return math.ceil(self.n / self.B)


def snapshot_steps(spe: int, epochs: int) -> list[int]:
    return sorted({1, 2, 5, *(spe * e for e in range(1, epochs + 1))} & set(range(1, spe * epochs + 1)))


def max_diff(a: dict, b: dict) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a.values(), b.values()))


def matched_keys(tool: str, flare_state: dict, their_state: dict) -> list[tuple[str, str]]:
    """FLARE's keys and the script's, paired by position; refused unless every pair has one shape."""
    pairs = list(zip(flare_state, their_state))
    if len(flare_state) != len(their_state) or any(flare_state[a].shape != their_state[b].shape for a, b in pairs):
        raise SystemExit(f"{tool}: FLARE's network and the script's do not list the same tensors: "
                         f"{[(k, tuple(v.shape)) for k, v in flare_state.items()]} against "
                         f"{[(k, tuple(v.shape)) for k, v in their_state.items()]}")
    return pairs


def by_script(train, net, sampler: PlannedBatches, want: list[int]):
    """Runs one of the scripts' client functions (`train`, no arguments), watching its SGD steps from outside:
    the state after each step in `want` and the network's train/eval mode then, how many steps, in which passes of
    the loader, the CPU seconds. Returns that and what `train` returned."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    snaps, modes, count, passes = {}, {}, [0], set()

    def after_step(opt, a, kw):
        if isinstance(opt, torch.optim.SGD):  # an optimiser that only gathers statistics never steps
            count[0] += 1
            passes.add(sampler.served[-1])
            if count[0] in want:
                snaps[count[0]] = {k: v.detach().clone() for k, v in net.state_dict().items()}
                modes[count[0]] = net.training

    handle = register_optimizer_step_post_hook(after_step)
    t0 = time.process_time()
    try:
        out = train()
    finally:
        handle.remove()
    return {"snaps": snaps, "modes": modes, "steps": count[0], "passes": sorted(passes),
            "cpu": round(time.process_time() - t0, 1)}, out


def compared(a: dict, b: dict, keys: list[tuple[str, str]], init: list, spe: int) -> dict:
    """Step by step, the largest absolute difference between two runs' state entries (a's and b's keys paired,
    `init` the initial tensors in that order; BatchNorm's statistics are entries too), the entry where it is largest,
    how far each run has moved from the init and each one's train/eval mode at the step; the first step past
    `SAME`."""
    def moved(run, s, side):  # the floating entries: a step counter moves by one a step whatever the weights do
        return max(float((run["snaps"][s][k[side]].double() - t.double()).abs().max()) for k, t in zip(keys, init)
                   if t.is_floating_point())

    rows = []
    for s in sorted(a["snaps"]):
        per = {ka: float((a["snaps"][s][ka].double() - b["snaps"][s][kb].double()).abs().max()) for ka, kb in keys}
        rows.append({"step": s, "epoch": round(s / spe, 4), "max_abs_diff": max(per.values()),
                     "worst_tensor": max(per, key=per.get), "max_abs_update": [moved(a, s, 0), moved(b, s, 1)],
                     "train_mode": [a["modes"].get(s), b["modes"].get(s)]})
    first = next((r for r in rows if r["max_abs_diff"] > SAME), None)
    return {"steps": rows, "first_divergence": first, "verdict": "same" if first is None else "differs"}


def flare_models(tool: str, template, weights: list[dict], sizes: list[int]):
    """The script's kept clients as FLARE models (`template`'s copies, the script's tensors paired by position) and
    the uploads FLARE's server receives from them, each with its client's sample count."""
    from flare.server.upload import upload_of

    pairs = matched_keys(tool, template.state_dict(), weights[0])
    models = []
    for w in weights:
        m = copy.deepcopy(template)
        m.load_state_dict({a: w[b] for a, b in pairs})
        models.append(m)
    return models, [upload_of(i, m, n) for i, (m, n) in enumerate(zip(models, sizes))], pairs


def portable(path: Path) -> str:
    """A kept run's folder as a record names it: from its `runs/` component on (the repository's run tree, wherever
    the checkout or worktree sat), so that a committed record holds no machine's absolute path."""
    parts = path.resolve().parts
    at = max((i for i, part in enumerate(parts) if part == "runs"), default=None)
    return Path(*parts[at:]).as_posix() if at is not None else path.as_posix()


def checkout_commit(checkout: Path) -> str | None:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or None


def machine_facts(t_wall: float, t_cpu: float) -> dict:
    """What every oracle record ends with: the kernels' versions and threads, the CPU, the seconds it took."""
    import torch

    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_model": ref.cpu_model(),
            "wall_seconds": round(time.time() - t_wall, 1), "cpu_seconds": round(time.process_time() - t_cpu, 1),
            "date": time.strftime("%Y-%m-%d")}


# ------------------------------------------------------------------------------------------------ the command
def oracle_arguments(doc: str, repo: str, alpha: float, table: Path, epochs: int):
    """The command line every oracle shares: which checkout (none: the tool skips), which table cell and client, how
    many local epochs, FLARE overrides, scratch and record paths."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, help=f"a checkout of {repo} (none: skip)")
    ap.add_argument("--alpha", type=float, default=alpha)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=epochs, help="local epochs compared: up to a round, or whole rounds")
    ap.add_argument("--table", type=Path, default=table)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a FLARE config override")
    ap.add_argument("--runs", type=Path, default=ref.RUNS / "oracle", help="scratch: the IDX files")
    ap.add_argument("--record", type=Path, help="write the measurement here (JSON)")
    ap.add_argument("--saved-clients", type=Path, help="the clients/ directory the reference's driver keeps for the "
                                                        "same cell: the server part runs over them")
    return ap


def refused(tool: str, repo: str, a, script: str) -> int | None:
    """None when the command can run; else its exit status, having said why: no checkout (0, a skip — the reference
    is not part of FLARE), a folder without the script or fewer than one epoch (2)."""
    import sys

    if a.checkout is None:
        print(f"{tool}: skipped — no --checkout of {repo} given (the reference is not part of FLARE); nothing was "
              "run.")
        return 0
    if not (a.checkout / script).is_file():
        print(f"{tool}: {a.checkout.resolve()} has no {script}.", file=sys.stderr)
        return 2
    if a.epochs < 1:
        print(f"{tool}: --epochs must be at least 1.", file=sys.stderr)
        return 2
    return None


def prepared(tool: str, a):
    """FLARE's side of a command `a` (`oracle_arguments`): the table cell's config and run, the client, its batch
    order, and the cell's data as IDX files under the scratch run directory (`data/`, torchvision's root) — with the
    clocks started. Returns them as attributes."""
    import types

    t_wall, t_cpu = time.time(), time.process_time()
    spec, cell, cfg, full_epochs, rounds = flare_config(tool, a.table, a.alpha, a.seed, a.epochs, a.set)
    setup, client = flare_client(cfg, a.client)
    run_dir = (a.runs / spec["table"] / f"a{a.alpha:g}-s{a.seed}").resolve()
    write_data(setup, run_dir / "data" / "FashionMNIST" / "raw")
    pos, plan_ok = plan_positions(client, setup.ctx, full_epochs, rounds)
    return types.SimpleNamespace(spec=spec, cell=cell, cfg=cfg, setup=setup, client=client, rounds=rounds,
                                 run_dir=run_dir, pos=pos, plan_ok=plan_ok, t_wall=t_wall, t_cpu=t_cpu)


def record_head(tool: str, reference: str, a, p, flags) -> dict:
    """What every oracle record starts with: the tool, the reference and its commit, the table cell (`p`, from
    `prepared`), the FLARE overrides, the script's flags, the yardstick, whether the plan is the cell's and the FLARE
    rounds it spans."""
    return {"tool": f"benchmarks/{tool}.py", "reference": reference, "commit": checkout_commit(a.checkout),
            "table": p.spec["table"], "flare_cell": p.cell["name"], "alpha": a.alpha, "seed": a.seed,
            "flare_overrides": a.set, "script_flags": flags, "same_threshold": SAME,
            "plan_is_the_cells_first_epochs": p.plan_ok, "flare_rounds": p.rounds}


def write_record(rec: dict, a, p, server) -> int:
    """The record with the server part (`server(path)`, with `--saved-clients`) and `machine_facts`, to `--record`
    (when given) and to stdout; the command's exit status."""
    if a.saved_clients:
        rec["server"] = server(a.saved_clients)
    rec.update(machine_facts(p.t_wall, p.t_cpu))
    return emit(rec, a.record)


def emit(rec: dict, path: Path | None) -> int:
    """The record as JSON to `path` (when given) and to stdout; the command's exit status."""
    import json

    text = json.dumps(rec, indent=1) + "\n"
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(text, end="")
    return 0
