"""The server's round loop — the one loop every way of running a federation goes through. It owns the order of a
round: what the server sends before the clients train, their uploads and the one gate and quorum they pass
(`gate_uploads`), the evaluation checkpoint, what the server carries into the next round, the round's record, and
the uploads written to the run directory (uploads.pt). Where the clients are is the transport's business
(`Clients`): in process (flare/runner.py), a Flower grid (flare/flower/server.py), saved uploads (flare/fuse.py).
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Protocol

from torch import nn

from flare.client.lam import runaway_warnings
from flare.errors import FlareError
from flare.rundir import RunDir
from flare.server.exchange import LocalClients, Transport
from flare.server.extras import ClientData, extras_shapes
from flare.server.rounds import Evaluation, primary_rule
from flare.server.strategy import Strategy
from flare.server.upload import Upload, UploadSpec, save_uploads, validate_upload
from flare.setup import ServerSetup


class Clients(Protocol):
    """How the loop reaches a run's clients. In a block of rounds [first, end) the loop hands `train` what the server
    sends and gets the clients' training records, then their `uploads`, gates them and tells the transport who
    passed (`gated`); fewer than `required` passing (those `without_data` counted) ends the run with `stop`'s error.
    On an evaluated round it asks for the `models` holding the uploads and the `exchange` to their owners (None where
    no strategy holds rounds after the upload; by default the clients in this process, each the `side` a strategy's
    `client_extras` sees). `roll_call`: every round's record names who uploaded."""

    required: int
    without_data: set[int] | frozenset[int] = frozenset()
    roll_call = False

    def blocks(self, start: int) -> list[tuple[int, int]]: ...
    def train(self, first: int, end: int, sent: dict) -> list[dict]: ...
    def uploads(self, r: int, scored: Mapping[str, Strategy]) -> list[Upload]: ...
    def gated(self, r: int, uploads: list[Upload], rejected: dict[int, list[str]]) -> None: ...
    def stop(self, msg: str, rejected: dict[int, list[str]]) -> FlareError: ...
    def models(self, uploads: list[Upload]) -> list[nn.Module]: ...
    def side(self, cid: int) -> ClientData: ...
    def round_done(self, r: int, rec: dict, logs: list[dict], ev: Evaluation | None) -> None: ...

    def exchange(self, uploads: list[Upload], scored: Mapping[str, Strategy]) -> Transport | None:
        talks = any(s.extra_rounds() > 0 for s in scored.values())
        return LocalClients([self.side(u.client) for u in uploads]) if talks else None


def why_rejected(server: ServerSetup, upload: Upload, scored: Mapping[str, Strategy]) -> list[str]:
    """Every reason to turn `upload` away: a client id outside the run, or not its architecture's weights plus the
    statistics `scored` ask for."""
    K, cid = server.cfg.num_clients, upload.client
    if not isinstance(cid, int) or isinstance(cid, bool) or not 0 <= cid < K:
        return [f"client id {cid!r} is not in 0..{K - 1}"]
    init, own = server.client_init(cid), server.architectures[cid]
    reasons = validate_upload(upload, replace(UploadSpec.from_model(init, server.meta.num_classes),
                                              extras=extras_shapes(scored, init)))
    if reasons and isinstance(upload.state, dict):
        other = [a for a, m in server.inits.items() if a != own and set(m.state_dict()) == set(upload.state)]
        reasons[:0] = [f"it holds a {other[0].label} network, but client {cid} runs {own.label}"] if other else []
    return reasons


def gate_uploads(server: ServerSetup, clients: Clients, r: int, scored: Mapping[str, Strategy], logs: list[dict],
                 warn: Callable[[str], None]) -> tuple[list[Upload], list[dict], dict]:
    """The block's uploads that pass `why_rejected`, if enough pass; their clients' training logs; what the round's
    record says of who uploaded."""
    passed, rejected = [], {}
    for u in clients.uploads(r, scored):
        if reasons := why_rejected(server, u, scored):
            rejected[u.client] = reasons
            warn(f"round {r + 1}: client {u.client} upload rejected: " + "; ".join(reasons))
        else:
            passed.append(u)
    clients.gated(r, passed, rejected)
    K, empty = server.cfg.num_clients, clients.without_data
    missing = sorted(set(range(K)) - {u.client for u in passed} - empty)
    if not passed or len(passed) + len(empty) < clients.required:
        raise clients.stop(f"round {r + 1}: {len(passed)} valid upload(s) (+{len(empty)} client(s) without data) "
                           f"from {K} clients, fewer than min_clients={clients.required}; missing or rejected: "
                           f"{missing}.", rejected)
    roll = {"clients": [u.client for u in passed], "missing_clients": missing} if clients.roll_call or missing else {}
    return passed, [rec for rec in logs if rec["client"] not in rejected], roll


def run_rounds(server: ServerSetup, clients: Clients, out: RunDir | None, warn: Callable[[str], None],
               start: int = 0, rules: tuple[str, ...] | None = None, scratch: Path | None = None) -> list[dict]:
    """Every round from `start` on, over `clients`; returns the records it appended. `out`: the run directory it
    writes (None: `flare fuse`'s own record). `rules`: the strategies to score, else each round's own."""
    cfg, records = server.cfg, []
    for first, end in clients.blocks(start):
        t0, r = time.perf_counter(), end - 1
        logs = clients.train(first, end, server.train_message(first))
        trained = time.perf_counter() - t0
        evaluates = cfg.evaluates(r)
        scored = (server.scored(r) if rules is None else {n: server.strategies[n] for n in rules}) if evaluates else {}
        uploads, logs, roll = gate_uploads(server, clients, r, scored, logs, warn)
        ev = None
        if evaluates:
            carried = server.server_state()
            ev = server.evaluate(r, uploads, clients.models(uploads), rules=rules,
                                 clients=clients.exchange(uploads, scored), scratch=scratch)
            server.carry(ev)
            if out is not None:  # what the server received, and the state it scored them with
                save_uploads(out, r, uploads, carried)
        rec = ev.record if ev is not None else {"kind": "round", "round": r, "method": cfg.method,
                                                 "primary": primary_rule(cfg), "evaluated": False}
        rec.update(roll, seconds_train=trained, seconds=time.perf_counter() - t0)
        for w in runaway_warnings(cfg, logs):
            warn(w)
        if out is not None:
            out.append(logs + [rec])
        records += logs + [rec]
        clients.round_done(r, rec, logs, ev)
    return records
