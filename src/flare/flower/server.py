"""The server of a federated run, engine-free: the run settings of the Flower app, the round loop's transport over a
Flower grid (flare/loop.py) and the run directory. `server_app.py` wraps it in Flower's Message API. It is built,
and evaluates, exactly as `flare run`'s (`flare.setup.ServerSetup`), and writes the same run directory plus
federation.json and the saved global predictor.
"""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from flare.config import Config, experiment_differences, load_config
from flare.data.partition import Partition
from flare.errors import FlareError
from flare.flower.predictor import save_predictor
from flare.flower.protocol import Task
from flare.report.run_report import write_run_report
from flare.rundata import RunData
from flare.rundir import RunDir
from flare.server.upload import Upload, upload_of
from flare.loop import Clients, run_rounds
from flare.server.rounds import Evaluation
from flare.data.prepare import describe_partition
from flare.setup import ServerSetup

MAX_RECORDS_BYTES = 4_000_000  # a client's per-round training logs, as JSON text


@dataclass
class FederationSettings:
    """The `[tool.flwr.app.config]` keys of the Flower app (overridable with `flwr run --run-config`)."""

    preset: str = ""
    config_file: str = ""
    overrides: str = ""
    out_dir: str = ""
    upload: str = "per-round"      # "per-round": R messages, one snapshot per round; "once": one message
    min_clients: int = 0           # 0: every client must answer
    timeout: float = 3600.0        # seconds to wait for the replies to one message
    wait_nodes: float = 60.0       # seconds to wait for num_clients nodes to connect
    dataset_meta: str = ""         # JSON of DataMeta, for a server without the dataset (no test set)
    save_predictor: bool = True

    @classmethod
    def from_run_config(cls, rc) -> "FederationSettings":
        s = cls()
        for key, attr in cls.KEYS.items():
            if key in rc:
                cur, v = getattr(s, attr), rc[key]
                setattr(s, attr, type(cur)(v) if not isinstance(cur, bool) else (
                    v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")))
        if s.upload not in ("per-round", "once"):
            raise FlareError(f"upload='{s.upload}' is neither 'per-round' nor 'once'.", key="upload",
                             fix="set upload=\"per-round\" (simulation, curve over rounds) or \"once\" (deployment).")
        return s

    def load_config(self) -> Config:
        return load_config(self.config_file or None, self.preset or None, shlex.split(self.overrides))


FederationSettings.KEYS = {f.name.replace("_", "-"): f.name for f in fields(FederationSettings)}  # key → field


@dataclass
class Reply:
    """What the engine hands back for one node: an error string, or the decoded reply fields (any of which may be
    malformed)."""

    node: int
    error: str | None = None
    meta: dict = field(default_factory=dict)
    state: dict | None = None
    extras: dict | None = None
    decode_error: str | None = None


def _sanitize_records(text, cid: int, rounds: range) -> tuple[list[dict], str | None]:
    if not isinstance(text, str):
        return [], "training logs are not text"
    if len(text) > MAX_RECORDS_BYTES:
        return [], f"training logs are {len(text)} bytes, more than {MAX_RECORDS_BYTES}"
    try:
        recs = json.loads(text)
    except json.JSONDecodeError as e:
        return [], f"training logs are not JSON ({e.msg})"
    if not isinstance(recs, list) or len(recs) != len(rounds):
        return [], f"expected {len(rounds)} training-log records"
    out = []
    for rec, r in zip(recs, rounds):
        if not isinstance(rec, dict) or rec.get("client") != cid or rec.get("round") != r:
            return [], f"training-log record for round {r} is malformed or names another client/round"
        out.append({**{k: v for k, v in rec.items() if isinstance(k, str) and (
            v is None or isinstance(v, (bool, int, float, str))
            or isinstance(v, list) and all(isinstance(x, (int, float)) for x in v))}, "kind": "client"})
    return out, None


class ServerSession(Clients):
    """The server of one federated run: the run directory, the server's setup, and the round loop's transports over
    a Flower grid: one message per block of rounds, and one per round a strategy holds after the upload."""

    roll_call = True  # nodes come and go: every round's record names who uploaded

    def __init__(self, cfg: Config, fed: FederationSettings, log=print, talk=None):
        self.cfg, self.fed, self.log, self.talk = cfg, fed, log, talk
        self.required = fed.min_clients or cfg.num_clients  # the quorum
        self.warnings: list[str] = []
        self.out = Path(fed.out_dir or f"runs/flower-{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.dir = RunDir(self.out).lock(key="out-dir")
        old = self.dir.read_config()
        self.config = cfg.model_dump(mode="json")  # the resolved config, recorded in state.json (rundir.py)
        self.finished_already = (old is not None and not experiment_differences(old, cfg)
                                 and self.dir.read_state().get("status") == "finished")
        if self.finished_already:
            return
        try:
            self.setup = ServerSetup.build(cfg, dataset_meta=fed.dataset_meta or None)
            if talk is None and (talking := [n for n, s in self.setup.strategies.items() if s.extra_rounds() > 0]):
                raise FlareError(f"server strategies {talking} hold rounds with the clients after their upload, "
                                 "which this engine cannot send.", key=f"server.strategies.{talking[0]}",
                                 fix="run the federation through the FLARE ServerApp, or use `flare run`.")
            # what it sends before a later round depends on the evaluations between: one message cannot carry it
            if fed.upload == "once" and cfg.rounds > 1 and (sends := self.setup.train_message(1)):
                raise FlareError(f"the server sends the clients {sorted(sends)} before every round (e.g. Plan B's G "
                                 "under server.protos_flow=reference), which upload=once's one message cannot carry.",
                                 key="upload", fix='set upload="per-round".')
        except FlareError:
            self.close()
            self.dir.remove_if_empty()
            raise
        for w in self.setup.warnings:
            self._warn(w)
        self.setup.take_data()  # the clients' samples are on the nodes
        self.meta = self.setup.meta
        self.node_client: dict[int, int] = {}   # node id -> client id (fixed by its first upload through the gate)
        self.histograms: dict[int, list[int]] = {}
        self.without_data: set[int] = set()
        self.arrived: dict[int, tuple[int, list[int]]] = {}  # the block's uploads at the gate: client -> node, hist
        self.events: list[dict] = []            # who was missing or rejected, and why
        self.last: Evaluation | None = None
        self.send, self.nodes = None, []  # set by `run_federation`: the engine's exchange, the nodes it keeps
        self.received: list[Upload] = []
        self.talking: list[int] = []  # the nodes of the uploads a strategy's rounds after the upload go to
        self.dir.write_config(cfg)
        self.dir.clear_checkpoints()
        self.dir.write_metrics([])
        self.dir.write_state("running", 0, self.warnings, self.config)

    def close(self) -> None:
        self.dir.unlock()

    def task(self, round_start: int, round_end: int) -> Task:
        return Task(self.cfg, self.meta, round_start, round_end)

    # -- the loop's transport (flare/loop.py) ------------------------------------------------------
    def blocks(self, start: int) -> list[tuple[int, int]]:
        R = self.cfg.rounds
        return [(r, r + 1) for r in range(start, R)] if self.fed.upload == "per-round" else [(0, R)]

    def train(self, first: int, end: int, sent: dict) -> list[dict]:
        """One message to the nodes still kept; each reply checked for what only a reply can get wrong (who it is,
        its sample count and class histogram, its training logs, an upload that cannot be decoded), its node dropped
        if it is missing or turned away. The uploads, in client order, wait for the loop's gate; returns their logs."""
        nodes, self.arrived = self.nodes, {}
        replies = self.send(self.task(first, end), first == 0, nodes, self) if nodes else []  # none: the quorum stops
        by_node = {rep.node: rep for rep in reversed(replies) if rep.node in nodes}  # each node's first reply
        uploads: dict[int, Upload] = {}
        logs: dict[int, list[dict]] = {}
        keep: list[int] = []
        for node in nodes:
            rep = by_node.get(node)
            known = self.node_client.get(node)
            if rep is None or rep.error is not None:
                self._event("missing", end - 1, node, known, [
                    f"no reply within {self.fed.timeout:g} s (crashed, disconnected or too slow)" if rep is None
                    else f"the node reported an error: {rep.error}"])
                continue
            reasons: list[str] = []
            m = rep.meta
            cid, n, hist = m.get("client"), m.get("num-samples"), m.get("class-histogram")
            if not isinstance(cid, int) or isinstance(cid, bool) or not 0 <= cid < self.cfg.num_clients:
                reasons.append(f"client id {cid!r} is not in 0..{self.cfg.num_clients - 1}")
            elif known is not None and known != cid:
                reasons.append(f"the node answered as client {known} before and as client {cid} now")
            elif cid in uploads or known is None and cid in self.node_client.values():
                reasons.append(f"client {cid} already answered from another node")
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                reasons.append(f"sample count {n!r} is not a non-negative integer")
            if (not isinstance(hist, list) or len(hist) != self.meta.num_classes
                    or not all(isinstance(h, int) and h >= 0 for h in hist)):
                reasons.append(f"class histogram is not {self.meta.num_classes} non-negative counts "
                               "(a class count that does not match the run?)")
            elif isinstance(n, int) and sum(hist) != n:
                reasons.append(f"class histogram sums to {sum(hist)}, not to the sample count {n}")
            if reasons:
                self._event("rejected", end - 1, node, known, reasons)
                continue
            if n == 0:
                if cid not in self.without_data:
                    self._warn(f"client {cid} received no samples under this partition; it is skipped (weight 0).")
                self.node_client[node], self.histograms[cid] = cid, hist
                self.without_data.add(cid)
                continue
            recs, why = _sanitize_records(m.get("records"), cid, range(first, end))
            if rep.decode_error is not None or rep.state is None:
                why = f"upload could not be decoded: {rep.decode_error or 'no weights'}"
            if why:
                self._event("rejected", end - 1, node, cid, [why])
                continue
            uploads[cid] = upload_of(cid, self.setup.client_init(cid), n, rep.extras, state=rep.state)
            logs[cid], self.arrived[cid] = recs, (node, hist)
            keep.append(node)
        order = sorted(uploads)  # the in-process runner's order: fusion sums in client order
        self.received, self.nodes = [uploads[c] for c in order], keep
        return sorted((rec for c in order for rec in logs[c]), key=lambda rec: (rec["round"], rec["client"]))

    def uploads(self, r: int, scored) -> list[Upload]:
        return self.received

    def gated(self, r: int, uploads: list[Upload], rejected: dict[int, list[str]]) -> None:
        """Drop the nodes whose upload the gate turned away (recorded in federation.json); the others are known."""
        for cid, reasons in rejected.items():
            node = self.arrived[cid][0]
            self.events.append({"kind": "rejected", "round": r, "node": node, "client": cid, "reasons": reasons})
            self.nodes.remove(node)
        for u in uploads:
            node, self.histograms[u.client] = self.arrived[u.client]
            self.node_client[node] = u.client
        self.received = uploads

    def stop(self, msg: str, rejected) -> FlareError:
        return self._fail(msg + " The federation stops here; the run directory keeps the earlier rounds and "
                          "federation.json says who failed and why.", key="min-clients",
                          fix="bring the missing nodes up (see federation.json for the reasons), or lower "
                              "min-clients if the run may proceed without them.")

    def models(self, uploads: list[Upload]) -> list:
        return self.setup.client_models(uploads)  # in the backend's layout

    def exchange(self, uploads: list[Upload], scored) -> "ServerSession | None":
        self.talking = [self.arrived[u.client][0] for u in uploads]  # the block's: where each upload came from
        return self if self.talk is not None else None

    def round(self, name: str, strategy, rnd: int, message: dict) -> list[dict]:
        """One round a strategy holds after the upload: one message to the nodes that uploaded, in upload order
        (the reply's tensors in `Reply.state`); each must answer, as the strategy aggregates every one."""
        got = {r.node: r for r in self.talk(self.task(self.cfg.rounds - 1, self.cfg.rounds), name, rnd, message,
                                            self.talking)}
        out = []
        for node in self.talking:
            rep = got.get(node)
            why = ("no reply within the timeout" if rep is None else rep.error or rep.decode_error
                   or ("no tensors" if rep.state is None else None))
            if why:
                msg = (f"round {rnd + 1} of the rounds server strategy '{name}' holds after the upload: client "
                       f"{self.node_client[node]} did not answer ({why}); the strategy needs every client that "
                       "uploaded.")
                raise self._fail(msg, key=f"server.strategies.{name}",
                                 fix="bring the node up and run the federation again (federation.json says who "
                                     "failed), or leave the strategy out of eval.rules.")
            out.append(dict(rep.state))
        return out

    def round_done(self, r: int, rec: dict, logs: list[dict], ev: Evaluation | None) -> None:
        self.last = ev or self.last  # the last round is always evaluated: it ends as the final predictor
        self.dir.write_state("running", r + 1, self.warnings, self.config)
        self.log(f"round {r + 1}: {len(self.received)} upload(s)"
                 + (f", acc ({rec['primary']}) {100 * acc:.2f}%" if (acc := rec.get("acc")) is not None else "")
                 + (f", missing {rec['missing_clients']}" if rec["missing_clients"] else ""))

    # -- the run directory -------------------------------------------------------------------------
    def finish(self) -> dict:
        if self.fed.save_predictor and self.received:
            saved = save_predictor(self.dir, self.cfg, self.meta, self.received, self.last.weights, self.last.G,
                                   self.last.record, self.setup.template.feature_dim, self.last.predictors)
            if isinstance(saved, str):
                self._warn(saved)
        self._record("finished")
        summary = write_run_report(self.out).summary()
        return summary | {"acc": None} if self.setup.test_x is None else summary  # None: nothing was scored

    def _fail(self, msg: str, key: str, fix: str) -> FlareError:
        """Record the federation as failed; returns the error to raise."""
        self.warnings.append(msg)
        self._record("failed", msg)
        return FlareError(msg, key=key, fix=fix)

    def _record(self, status: str, error: str | None = None) -> None:
        """partition.json from the class histograms the clients reported (the server may not hold their data), then
        federation.json and state.json with the federation's `status`."""
        if self.histograms:
            C = self.meta.num_classes
            labels = [np.repeat(np.arange(C), self.histograms.get(i, [0] * C)) for i in range(self.cfg.num_clients)]
            ends = np.cumsum([0] + [len(lab) for lab in labels]).tolist()
            part = Partition([np.arange(a, b) for a, b in zip(ends, ends[1:])], C, np.concatenate(labels))
            report = describe_partition(self.cfg, part, self.meta.classes)
            for c in report["clients"]:
                if c["client"] not in self.histograms:
                    c["missing"] = True
            self.dir.write_partition(report | {"source": "class histograms reported by the clients"})
        failed = {"error": error} if error else {}
        self.dir.write_text("federation.json", json.dumps({
            "status": status, "upload": self.fed.upload, "num_clients": self.cfg.num_clients,
            "min_clients": self.required, "timeout_s": self.fed.timeout,
            "nodes": {str(n): c for n, c in sorted(self.node_client.items())}, "events": self.events,
            "clients_without_data": sorted(self.without_data)} | failed, indent=1))
        done = self.dir.read_state().get("rounds_done", 0) if failed else self.cfg.rounds
        self.dir.write_state(status, done, self.warnings, self.config, **failed)

    def _event(self, kind: str, round_idx: int, node: int, cid, reasons: list[str]) -> None:
        self.events.append({"kind": kind, "round": round_idx, "node": node, "client": cid, "reasons": reasons})
        self._warn(f"round {round_idx + 1}: {f'client {cid}' if cid is not None else f'node {node}'} "
                   f"{'is missing' if kind == 'missing' else 'upload rejected'}: " + "; ".join(reasons))

    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)
        self.log("WARNING: " + msg)


def run_federation(cfg: Config, fed: FederationSettings, exchange, node_ids: list[int], log=print, talk=None) -> dict:
    """The server's whole protocol over an engine: `exchange(task, include_init, nodes, session) -> list[Reply]`
    sends one task to `nodes` and returns their replies within the timeout; `talk` carries the rounds a strategy
    holds with the clients after their upload (None: an engine that cannot, which refuses such a strategy)."""
    if not 0 <= fed.min_clients <= cfg.num_clients:
        raise FlareError(f"min-clients={fed.min_clients} is not in 0..num_clients={cfg.num_clients}.",
                         key="min-clients", fix="set min-clients at most num_clients (0: every client).")
    s = ServerSession(cfg, fed, log=log, talk=talk)
    try:
        if s.finished_already:
            log(f"{s.out}: finished earlier; nothing to recompute.")
            return RunData.load(s.out).summary()
        if len(node_ids) < s.required:
            msg = (f"only {len(node_ids)} node(s) connected, fewer than min_clients={s.required} "
                   f"(num_clients={cfg.num_clients}).")
            raise s._fail(msg, key="min-clients", fix="start more SuperNodes or lower min-clients.")
        if len(node_ids) < cfg.num_clients:
            s._warn(f"{len(node_ids)} node(s) connected for {cfg.num_clients} clients; proceeding with min_clients="
                    f"{s.required}.")
        s.send, s.nodes = exchange, list(node_ids)
        run_rounds(s.setup, s, s.dir, s._warn)
        summary = s.finish()
    finally:
        s.close()
    return {**summary, "out": str(s.out)}
