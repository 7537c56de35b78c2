"""FLARE's Flower ServerApp (`flare.flower.server_app:app`): the engine-free server (`flare.flower.server`) over
Flower's grid.

It builds the run's config from the app's run config (the keys: `flare.flower.server.FederationSettings`), waits for
the nodes, and sends each a `train` message per block of rounds (`train_content`); every reply is decoded here, its
upload passes the round loop's gate (`flare.loop.gate_uploads`) and every fusion rule is scored as in `flare run`.
A strategy that holds rounds with the clients after their upload (FENS) sends each round as one `query` message to
the nodes (`make_talk`). It writes the same run directory plus federation.json (who answered, who was missing or
rejected, and why) and the global predictor (predictor.pt + predictor.json).
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


def wait_for_nodes(grid: Grid, want: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= want or time.monotonic() >= deadline:
            return nodes
        time.sleep(1.0)


def decode_reply(msg: Message, decode=None) -> Reply:
    """A reply message → `Reply`, its content read by `decode` (default `decode_content`; never raises: malformed
    content becomes a decode error the gate reports)."""
    node = int(msg.metadata.src_node_id)
    if msg.has_error():
        return Reply(node, error=f"{msg.error.reason} (code {msg.error.code})")
    return (decode or decode_content)(node, msg.content)


def decode_content(node: int, content: RecordDict) -> Reply:
    rep = Reply(node)
    try:
        rep.meta = dict(content.config_records.get("meta") or {})
        up, ex = content.array_records.get("upload"), content.array_records.get("extras")
        rep.state = dict(record_to_state(up)) if up is not None else None
        rep.extras = dict(record_to_state(ex)) if ex is not None else None
    except Exception as e:  # noqa: BLE001 — anything a peer sends that does not decode is a rejection
        rep.state, rep.decode_error = None, f"{type(e).__name__}: {e}"
    return rep


def decode_talk(node: int, content: RecordDict) -> Reply:
    """A reply to a strategy's round after the upload → `Reply` with its tensors in `state` (never raises)."""
    rep = Reply(node)
    try:
        rep.state = dict(record_to_state(content.array_records["reply"]))
    except Exception as e:  # noqa: BLE001 — anything a peer sends that does not decode is a failed reply
        rep.decode_error = f"{type(e).__name__}: {e}"
    return rep


def make_talk(grid: Grid, timeout: float):
    """The Flower side of `NodeClients`: one `query` message per node and round."""

    def talk(task, name: str, rnd: int, message: dict, nodes: list[int]) -> list[Reply]:
        content = RecordDict({"task": ConfigRecord(task.to_config()),
                              "talk": ConfigRecord({"strategy": name, "round": rnd}),
                              "message": state_to_record(message)})
        msgs = [Message(content=content, dst_node_id=n, message_type="query", group_id=f"{name}-{rnd}") for n in nodes]
        return [decode_reply(m, decode_talk) for m in grid.send_and_receive(msgs, timeout=timeout)]

    return talk


def train_content(task, include_init: bool, session: ServerSession) -> RecordDict:
    """A train message's content: the task; in the first message what the server sends before training (`init`:
    `ServerSetup.initial_message`: every architecture's init, the anchor seed, the public bank); in every message what
    it sends before the block's first round (`sent`: `ServerSetup.train_message`). The node hands both to its client."""
    content = RecordDict({"task": ConfigRecord(task.to_config())})
    if include_init:
        content["init"] = state_to_record(session.setup.initial_message())
    if sent := session.setup.train_message(task.round_start):
        content["sent"] = state_to_record(sent)
    return content


def make_exchange(grid: Grid, timeout: float):
    def exchange(task, include_init: bool, nodes: list[int], session: ServerSession) -> list[Reply]:
        content = train_content(task, include_init, session)
        msgs = [Message(content=content, dst_node_id=n, message_type="train", group_id=str(task.round_start))
                for n in nodes]
        return [decode_reply(m) for m in grid.send_and_receive(msgs, timeout=timeout)]

    return exchange


def run_server(grid: Grid, run_config) -> dict:
    fed = FederationSettings.from_run_config(run_config)
    cfg = fed.load_config()
    _log(f"{cfg.method}: {cfg.num_clients} clients, {cfg.rounds} rounds × {cfg.local_epochs} epochs, upload "
         f"{fed.upload}, min_clients {fed.min_clients or cfg.num_clients}")
    nodes = wait_for_nodes(grid, cfg.num_clients, fed.wait_nodes)
    summary = run_federation(cfg, fed, make_exchange(grid, fed.timeout), nodes, log=_log,
                             talk=make_talk(grid, fed.timeout))
    if summary.get("acc") is not None:
        _log(f"final acc ({summary.get('primary')}) = {100 * summary['acc']:.2f}% → {summary.get('out')}")
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        run_server(grid, context.run_config)
    except FlareError as e:
        _log(f"WARNING: federation failed: {e.render()}")
        raise
