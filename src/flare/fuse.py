"""`flare fuse RUN_DIR... --strategies a,b`: server strategies over a finished run's saved uploads (uploads.pt: what
the server received at the last round), without retraining a client, over `flare run`'s runs and a federation's.

The run's server is rebuilt from its config.yaml (`setup.ServerSetup`), and each strategy is scored alone by the
round loop (flare/loop.py) at the last round over the saved uploads (`SavedUploads`): a built-in strategy reproduces
the run's own last-round accuracy exactly. Results are appended to fuse.jsonl, one record per strategy; a rerun
skips the strategies already there, so an interrupted fuse resumes (a long build from `fuse-scratch/`).

A server strategy's options (`server.strategies.<name>.<option>=VALUE`) may be given anew: they change only what
the server builds from the same clients, so they are the one override `flare fuse` takes; a strategy counts as
fused only with the same options.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from flare.config import Config, build_config, deep_merge, parse_list, parse_overrides
from flare.errors import FlareError
from flare.registry import STRATEGIES, load_plugins
from flare.report.run_report import write_run_report
from flare.rundir import FUSE, SCRATCH, RunDir, read_jsonl
from flare.server.extras import ClientData, client_extras, client_side, extras_shapes
from flare.loop import Clients, run_rounds, why_rejected
from flare.server.upload import UPLOADS, Upload, load_uploads
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
    if not rd.file(UPLOADS).is_file():
        raise FlareError(f"run directory '{rd.path}' has no {UPLOADS}, which holds the uploads the server received.",
                         key=KEY, fix="rerun the experiment (`flare run` or a federation) into a new directory (runs "
                                      "are deterministic) and fuse that one.")
    rd.check_consistent(KEY)
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
    """Check every directory, then score the strategies (comma-separated) not yet fused in each, with the options
    `overrides` gives anew; returns (dir, its fuse records of those strategies)."""
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
    """Rebuild the run's server and score each strategy over the saved uploads, one record as each finishes."""
    cfg, rd = job.cfg, job.dir
    # the clients' weights come from uploads.pt; the strategies asked for are built once, here
    server = ServerSetup.build(cfg, bank=False, checkpoints=False, strategies=tuple(names))
    data, partition = checked_split(server)  # what the data cannot serve, refused before any strategy computes
    saved = SavedUploads(server, rd, data, partition)
    for name in names:
        t0 = time.perf_counter()
        server.load_server_state(saved.server_state)  # each strategy from the state the last round was scored with
        run_rounds(server, saved, None, lambda w: None, rules=(name,), scratch=rd.path / SCRATCH)
        ev = saved.last
        # seconds: the clients' statistics, the rounds it holds with them, its build and its test pass
        rd.append([{"kind": "fuse", "strategy": name, "round": saved.round, "acc": ev.record[f"acc_{name}"],
                    "seconds": time.perf_counter() - t0, **({"options": job.options[name]} if job.options[name] else {}),
                    **{f"{name}.{k}": v for k, v in ev.predictors[name].logs.items()}}], FUSE)
        shutil.rmtree(rd.path / SCRATCH / name, ignore_errors=True)  # its progress is in the record now
        with contextlib.suppress(OSError):
            (rd.path / SCRATCH).rmdir()


class SavedUploads(Clients):
    """The round loop's transport over a finished run's saved uploads: nothing trains; every upload must pass the
    loop's gate, and a strategy reads the statistics the server received, else computes them from the saved
    weights on the client's own samples."""

    def __init__(self, server: ServerSetup, rd: RunDir, data, partition):
        cfg, self.server, self.data, self.parts = server.cfg, server, data, partition.client_indices
        self.path, self.fix = rd.file(UPLOADS), "rerun the experiment into a new directory (runs are deterministic) and fuse that one."
        try:
            self.round, self.server_state, self.saved = load_uploads(self.path, server.backend.device)
        except Exception as e:  # noqa: BLE001 — a truncated/empty/foreign file raises many kinds of error
            raise FlareError(f"'{self.path}' is unreadable ({type(e).__name__}).", key=KEY, fix=self.fix) from None
        if self.round != cfg.rounds - 1:
            raise FlareError(f"'{self.path}' holds the uploads of round {self.round + 1}, not of the last round "
                             f"({cfg.rounds}).", key=KEY, fix=self.fix)
        self.received = [u.extras for u in self.saved]
        self.required = len(self.saved)
        self.last, self.models_ = None, []

    def blocks(self, start: int) -> list[tuple[int, int]]:
        return [(self.round, self.round + 1)]

    def train(self, first: int, end: int, sent: dict) -> list[dict]:
        return []  # the clients trained in the run

    def side(self, cid: int) -> ClientData:
        """A client's side, from its saved weights and its data (for one strategy: a copy of its model)."""
        s, d, ix = self.server, self.data, torch.as_tensor(self.parts[cid])
        model = self.models(self.saved)[[u.client for u in self.saved].index(cid)]
        return client_side(cid, model, d.train_x[ix], d.train_y[ix], s.norm, s.augment, s.backend.device)

    def uploads(self, r: int, scored) -> list[Upload]:
        """The saved uploads with the statistics `scored` ask for: those the server received, else computed from
        weights that pass the gate."""
        wanted = extras_shapes(scored, self.server.template)
        got = all(set(wanted) <= set(ex) for ex in self.received)
        extras = ([{k: ex[k] for k in wanted} for ex in self.received] if got
                  else [{} for _ in self.saved] if any(why_rejected(self.server, replace(u, extras={}), {})
                                                       for u in self.saved)
                  else [client_extras(scored, self.side(u.client)) for u in self.saved])
        for u, ex in zip(self.saved, extras):
            u.extras = ex
        return self.saved

    def stop(self, msg: str, rejected: dict[int, list[str]]) -> FlareError:
        return FlareError(f"'{self.path}': " + (" ".join(f"the upload of client {c} does not fit the run ("
                          + "; ".join(why) + ")." for c, why in rejected.items()) or msg), key=KEY, fix=self.fix)

    def models(self, uploads: list[Upload]) -> list:
        """The saved weights in their clients' inits, built once the gate has passed them."""
        self.models_ = self.models_ or [m.eval() for m in self.server.client_models(self.saved)]
        return self.models_

    def round_done(self, r: int, rec: dict, logs: list[dict], ev) -> None:
        self.last = ev
