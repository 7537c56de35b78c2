"""The server's round loop — the one loop every way of running a federation goes through. It owns the order of a
round: what the server sends before the clients train, their uploads, the evaluation checkpoint (the strategies, the
rounds they hold with the clients after the upload), what the server carries into the next round, the round's record,
and the uploads written to the run directory (uploads.pt), so that `flare fuse` later scores exactly what the server
received, extras included.

Where the clients are is the transport's business (`Clients`), and there are three:
* in process (flare/runner.py: the sequential, threads and batched engines train the clients beside the server);
* a Flower grid (flare/flower/server.py: one message per block of rounds, each reply through the upload gate);
* saved uploads (flare/fuse.py: the last round's uploads.pt of a finished run; nothing trains).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Mapping, Protocol

from torch import nn

from flare.client.lam import runaway_warnings
from flare.rundir import RunDir
from flare.server.exchange import Transport
from flare.server.rounds import Evaluation, primary_rule
from flare.server.strategy import Strategy
from flare.server.upload import Upload, save_uploads
from flare.setup import ServerSetup


class Clients(Protocol):
    """How the loop reaches a run's clients. In a block of rounds [first, end) the loop hands `train` what the server
    sends (`ServerSetup.train_message`) and gets the clients' training records; on an evaluated round it asks for
    their `uploads` (with the statistics the scored strategies ask for), the `models` holding them and the `exchange`
    to their owners for the rounds a strategy holds after the upload (None where none is asked); `known` adds what the
    transport knows of the round to its record, and `round_done` keeps what the transport keeps (a checkpoint, a line)."""

    def blocks(self, start: int) -> list[tuple[int, int]]: ...
    def train(self, first: int, end: int, sent: dict) -> list[dict]: ...
    def known(self, r: int, t0: float) -> dict: ...
    def uploads(self, r: int, scored: Mapping[str, Strategy]) -> list[Upload]: ...
    def models(self, uploads: list[Upload]) -> list[nn.Module]: ...
    def exchange(self, uploads: list[Upload], scored: Mapping[str, Strategy]) -> Transport | None: ...
    def round_done(self, r: int, rec: dict, logs: list[dict], ev: Evaluation | None) -> None: ...


def run_rounds(server: ServerSetup, clients: Clients, out: RunDir | None, warn: Callable[[str], None],
               start: int = 0, rules: tuple[str, ...] | None = None, scratch: Path | None = None) -> list[dict]:
    """Every round from `start` on, over `clients`; returns the records it appended. `out`: the run directory whose
    metrics.jsonl and uploads.pt it writes (None: `flare fuse`, which keeps its own record). `rules`: the strategies
    to score (`flare fuse`'s one), else each round's own (`rules_for`)."""
    cfg, records = server.cfg, []
    for first, end in clients.blocks(start):
        t0, r = time.perf_counter(), end - 1
        logs = clients.train(first, end, server.train_message(first))
        known = clients.known(r, t0)
        ev = None
        if cfg.evaluates(r):
            scored = server.scored(r) if rules is None else {n: server.strategies[n] for n in rules}
            uploads, carried = clients.uploads(r, scored), server.server_state()
            ev = server.evaluate(r, uploads, clients.models(uploads), rules=rules,
                                 clients=clients.exchange(uploads, scored), scratch=scratch)
            server.carry(ev)
            if out is not None:  # what the server received, and the state it scored them with
                save_uploads(out, r, uploads, carried)
        rec = ev.record if ev is not None else {"kind": "round", "round": r, "method": cfg.method,
                                                 "primary": primary_rule(cfg), "evaluated": False}
        rec.update(known, seconds=time.perf_counter() - t0)
        for w in runaway_warnings(cfg, logs):
            warn(w)
        if out is not None:
            out.append(logs + [rec])
        records += logs + [rec]
        clients.round_done(r, rec, logs, ev)
    return records
