"""`flare fuse RUN_DIR... --strategies a,b`: server strategies over a finished run's saved uploads, without
retraining a client. A run's checkpoint.pt holds every client's state after the last round, so any strategy — a
built-in rule, or a model-building method a plugin registers — can be scored on the run's test set afterwards.

The run's server is rebuilt from its config.yaml by the one builder a run uses (`setup.ServerSetup`), and each
strategy is scored by that server's own evaluation at the last round (`ServerSetup.evaluate`, the one strategy
alone): a built-in strategy reproduces the run's own last-round accuracy exactly.
Results are appended to fuse.jsonl (one record per strategy, under the run directory's lock); a rerun skips the
strategies already there, so an interrupted fuse resumes (a data-free server's build from its last finished epoch,
kept in `fuse-scratch/` until its record is written). summary.md is rewritten with them.

A server strategy's options (`server.strategies.<name>.<option>=VALUE`) may be given anew: they change only what
the server builds from the same clients — a data-free server's budget, say — never the clients, so they are the one
override `flare fuse` takes. They are written into the fuse record (`options`), and a strategy counts as fused
only with the same options.
"""
from __future__ import annotations

import contextlib
import copy
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flare.config import Config, build_config, deep_merge, parse_list, parse_overrides
from flare.errors import FlareError
from flare.registry import STRATEGIES, load_plugins
from flare.report.run_report import write_run_report
from flare.rundir import CHECKPOINT, FUSE, SCRATCH, RunDir, read_jsonl
from flare.server.exchange import LocalClients
from flare.server.extras import ClientData, client_extras, client_side, extras_shapes
from flare.server.upload import upload_of
from flare.setup import ServerSetup, checked_split

KEY = "RUN_DIR"


@dataclass
class FuseJob:
    """One run directory to fuse, checked: its validated config and the strategies asked for."""

    dir: RunDir
    cfg: Config
    names: list[str]
    options: dict  # name → the strategy options given anew (server.strategies.<name>), {} for none


def strategy_overrides(items: list[str], names: list[str]) -> dict:
    """KEY=VALUE items as {strategy: {option: value}}: only `server.strategies.<a strategy being fused>.<option>`,
    since anything else would make the clients another experiment's."""
    if not items:
        return {}
    tree = parse_overrides(items)
    server = tree.get("server")
    if not (set(tree) == {"server"} and isinstance(server, dict) and set(server) == {"strategies"}
            and isinstance(server["strategies"], dict)):
        raise FlareError(f"flare fuse takes only server-strategy options as overrides ({' '.join(items)}): anything "
                         "else would change the clients, which it reads from the run's checkpoint.", key="fuse",
                         fix="give server.strategies.<name>.<option>=VALUE, or rerun the experiment with `flare run`.")
    out = server["strategies"]
    for n in out:
        if n not in names or not isinstance(out[n], dict):
            raise FlareError(f"override server.strategies.{n}: '{n}' is not among --strategies ({','.join(names)}), "
                             "or gives no option.", key=f"server.strategies.{n}",
                             fix="name the strategy in --strategies and give server.strategies.<name>.<option>=VALUE.")
    return out


def check(run_dir: str | Path, names: list[str], round_: int | None, options: dict | None = None) -> FuseJob:
    """Everything that can be refused before any computation: not a run, not finished, no checkpoint, a round
    other than the last, a strategy the run's head cannot serve."""
    rd = RunDir(run_dir)
    old = rd.read_config() if rd.path.is_dir() else None
    if old is None:
        raise FlareError(f"'{rd.path}' is not a run directory (no config.yaml).", key=KEY,
                         fix="give the --out directory of a finished `flare run`.")
    status = rd.read_state().get("status", "unknown")
    if status != "finished":
        raise FlareError(f"run directory '{rd.path}' is not finished (status: {status}); `flare fuse` reads the "
                         "clients' states after the last round.", key=KEY,
                         fix=f"finish it first (`flare run --resume {rd.path}`), then fuse.")
    if not rd.file(CHECKPOINT).is_file():
        raise FlareError(f"run directory '{rd.path}' has no {CHECKPOINT}, which holds the clients' saved states.",
                         key=KEY, fix="rerun the experiment with `flare run` into a new directory (runs are "
                                      "deterministic; a Flower run keeps no client states) and fuse that one.")
    # the checkpoint's own record of its config too (loaded once here, dropped: fuse reloads it to score)
    rd.check_consistent(KEY, rd.load_checkpoint("cpu", lambda w: None))
    options = options or {}
    # imports the run's own plugins, whose strategies may be named; the strategies' new options validated with it
    cfg = build_config(deep_merge(old, {"server": {"strategies": options}}) if options else old)
    if round_ is not None and round_ != cfg.rounds:
        raise FlareError(f"--round {round_}: only the states after the last round ({cfg.rounds}) are saved in "
                         f"'{rd.path}'.", key="--round", fix=f"leave --round out, or give --round {cfg.rounds}.")
    for n in names:
        STRATEGIES.entry(n, key="--strategies")
        STRATEGIES.check(n, cfg)
        cfg.check_fuses_mixed(n, "--strategies")
        cfg.check_reads(n, "--strategies")
        if STRATEGIES.get(n).needs_prototypes and cfg.head != "prototype":
            raise FlareError(f"strategy '{n}' reads prototypes, which the run '{rd.path}' (loss.objective="
                             f"{cfg.loss.objective}) has not.", key="--strategies",
                             fix="choose strategies for a plain classifier, e.g. output or fedavg.")
    return FuseJob(rd, cfg, names, {n: options.get(n, {}) for n in names})


def _not_fused(job: FuseJob) -> list[str]:
    done = {(f.get("strategy"), json.dumps(f.get("options", {}), sort_keys=True))
            for f in read_jsonl(job.dir.file(FUSE)) if f.get("kind") == "fuse"}
    return [n for n in job.names if (n, json.dumps(job.options[n], sort_keys=True)) not in done]


def fuse_runs(dirs: list[str], strategies: str, round_: int | None = None,
              plugins: list[str] | None = None, overrides: list[str] | None = None) -> list[tuple[Path, list[dict]]]:
    """Check every directory, then score the strategies (comma-separated) not yet fused in each, with their
    options given anew (`overrides`, server.strategies.<name>.<option>=VALUE); returns (dir, its fuse records of
    those strategies)."""
    load_plugins(plugins or [], key="--plugin")
    # deduplicated; checked against the registry once each run's plugins are in
    names = parse_list(strategies, "--strategies", duplicates="drop", example="feature,fedavg")
    options = strategy_overrides(overrides or [], names)
    jobs = [check(d, names, round_, options) for d in dirs]
    out = []
    for job in jobs:
        with job.dir.lock(key=KEY):
            if todo := _not_fused(job):
                _score(job, todo)
            write_run_report(job.dir.path)
        recs = [f for f in read_jsonl(job.dir.file(FUSE)) if f.get("kind") == "fuse" and f.get("strategy") in names]
        out.append((job.dir.path, recs))
    return out


def _score(job: FuseJob, names: list[str]) -> None:
    """Rebuild the run's server from its config, load the clients' states from the checkpoint, and score each
    strategy through the server's own evaluation at the last round — one record as each finishes."""
    cfg, rd = job.cfg, job.dir
    # the clients' states come from checkpoint.pt; the strategies asked for are built once, here
    server = ServerSetup.build(cfg, bank=False, checkpoints=False, strategies=tuple(names))
    data, partition = checked_split(server)  # what the data cannot serve, refused before any strategy computes
    parts = partition.client_indices
    template, device = server.template, server.backend.device  # extras' shapes: their callers pass client models
    ck = rd.load_checkpoint(device, lambda w: None)
    if ck is None or "clients" not in ck or int(ck["rounds_done"]) < cfg.rounds:
        raise FlareError(f"'{rd.path}/{CHECKPOINT}' is unreadable, holds no client states or does not cover the "
                         "last round.", key=KEY,
                         fix="rerun the experiment into a new directory (runs are deterministic) and fuse that one.")
    rd.check_client_states(ck["clients"], [server.client_init(i) for i in range(len(parts))], KEY,
                           "rerun into a new directory")
    models, uploads, owners = [], [], []
    for i, (ix, st) in enumerate(zip(parts, ck["clients"])):
        if len(ix) == 0:  # the runner leaves clients without samples out of every evaluation
            continue
        m = copy.deepcopy(server.client_init(i))
        m.load_state_dict(st["model"])
        m.eval()
        uploads.append(upload_of(i, m, len(ix)))
        models.append(m)
        owners.append(torch.as_tensor(ix))

    def clients() -> list[ClientData]:
        """Every client's side, from its saved state and its data (for one strategy: a copy of each model)."""
        return [client_side(cfg, u.client, m, data.train_x[ix], data.train_y[ix], server.norm, server.augment, device)
                for u, m, ix in zip(uploads, models, owners)]

    r = cfg.rounds - 1
    server.load_server_state(ck.get("server"))  # Plan B's G as the last round left it
    for name in names:
        t0 = time.perf_counter()
        strategy = {name: server.strategies[name]}
        extras = ([client_extras(strategy, c) for c in clients()] if extras_shapes(strategy, template)
                  else [{} for _ in uploads])
        for u, ex in zip(uploads, extras):
            u.extras = ex
        talks = server.strategies[name].extra_rounds() > 0
        ev = server.evaluate(r, uploads, models, rules=(name,), clients=LocalClients(clients()) if talks else None,
                             scratch=rd.path / SCRATCH)
        # seconds: the clients' statistics, the rounds it holds with them, its build and its test pass
        rd.append([{"kind": "fuse", "strategy": name, "round": r, "acc": ev.record[f"acc_{name}"],
                    "seconds": time.perf_counter() - t0, **({"options": job.options[name]} if job.options[name] else {}),
                    **{f"{name}.{k}": v for k, v in ev.predictors[name].logs.items()}}], FUSE)
        shutil.rmtree(rd.path / SCRATCH / name, ignore_errors=True)  # its progress is in the record now
        with contextlib.suppress(OSError):
            (rd.path / SCRATCH).rmdir()
