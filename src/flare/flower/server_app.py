"""FLARE's Flower ServerApp (`flare.flower.server_app:app`): the engine-free server (`flare.flower.server`) over
Flower's grid. It builds the run's config from the app's run config (`FederationSettings`), waits for the nodes,
and sends each a `train` message per block of rounds; every reply is decoded here. A strategy that holds rounds
with the clients after their upload (FENS) sends each round as one `query` message to the nodes (`make_talk`).
"""
from __future__ import annotations

import time
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid, ServerApp

from flare.errors import FlareError
from flare.flower.server import FederationSettings, Reply, ServerSession, run_federation
from flare.flower.records import record_to_state, state_to_record

app = ServerApp()


def _log(msg: str) -> None:
    flwr_log(WARNING if msg.startswith("WARNING") else INFO, "[flare] %s", msg)


def decode_content(node: int, content: RecordDict) -> Reply:
    """A reply's content → `Reply` (never raises: malformed content becomes a decode error the gate reports); a
    query reply's tensors (`reply`) go in `state`."""
    rep = Reply(node)
    try:
        rep.meta = dict(content.config_records.get("meta") or {})
        tensors = {k: dict(record_to_state(rec)) for k, rec in content.array_records.items()}
        rep.state, rep.extras = tensors.get("upload", tensors.get("reply")), tensors.get("extras")
    except Exception as e:  # noqa: BLE001 — anything a peer sends that does not decode is a rejection
        rep.state, rep.decode_error = None, f"{type(e).__name__}: {e}"
    return rep


def ask(grid: Grid, timeout: float, kind: str, group: str, content: RecordDict, nodes: list[int]) -> list[Reply]:
    """One message of `kind` to each of `nodes`; their replies within `timeout`, decoded (`decode_content`)."""
    msgs = [Message(content=content, dst_node_id=n, message_type=kind, group_id=group) for n in nodes]
    return [Reply(int(m.metadata.src_node_id), error=f"{m.error.reason} (code {m.error.code})") if m.has_error()
            else decode_content(int(m.metadata.src_node_id), m.content)
            for m in grid.send_and_receive(msgs, timeout=timeout)]


def make_talk(grid: Grid, timeout: float):
    """The Flower side of `ServerSession.round`: one `query` message per node and round."""
    return lambda task, name, rnd, message, nodes: ask(grid, timeout, "query", f"{name}-{rnd}", RecordDict({
        "task": ConfigRecord(task.to_config()), "talk": ConfigRecord({"strategy": name, "round": rnd}),
        "message": state_to_record(message)}), nodes)


def train_content(task, include_init: bool, session: ServerSession) -> RecordDict:
    """A train message's content: the task; in the first message what the server sends before training (`init`:
    `ServerSetup.initial_message`); in every message what it sends before the block (`sent`: `train_message`)."""
    content = RecordDict({"task": ConfigRecord(task.to_config())})
    if include_init:
        content["init"] = state_to_record(session.setup.initial_message())
    if sent := session.setup.train_message(task.round_start):
        content["sent"] = state_to_record(sent)
    return content


def make_exchange(grid: Grid, timeout: float):
    """The Flower side of `ServerSession.train`: one `train` message per node and block of rounds."""
    return lambda task, include_init, nodes, session: ask(grid, timeout, "train", str(task.round_start),
                                                          train_content(task, include_init, session), nodes)


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        fed = FederationSettings.from_run_config(context.run_config)
        cfg = fed.load_config()
        _log(f"{cfg.method}: {cfg.num_clients} clients, {cfg.rounds} rounds × {cfg.local_epochs} epochs, upload "
             f"{fed.upload}, min_clients {fed.min_clients or cfg.num_clients}")
        deadline = time.monotonic() + fed.wait_nodes
        while len(nodes := sorted(grid.get_node_ids())) < cfg.num_clients and time.monotonic() < deadline:
            time.sleep(1.0)
        summary = run_federation(cfg, fed, make_exchange(grid, fed.timeout), nodes, log=_log,
                                 talk=make_talk(grid, fed.timeout))
    except FlareError as e:
        _log(f"WARNING: federation failed: {e.render()}")
        raise
    if summary.get("acc") is not None:
        _log(f"final acc ({summary.get('primary')}) = {100 * summary['acc']:.2f}% → {summary.get('out')}")
