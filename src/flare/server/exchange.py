"""The rounds a strategy holds with the clients after their one-shot upload (`Strategy.extra_rounds`), driven one
way for every engine that can reach the clients' data: each round the server configures what every client receives,
each client computes its reply where its data lives, and the server aggregates the replies — Flower's configure /
fit / aggregate, with the bytes each way counted so that a method's extra communication is reported beside its
accuracy (`<strategy>.rounds`, `.bytes_down`, `.bytes_up` in the round record and in fuse.jsonl).
"""
from __future__ import annotations

from torch import Tensor

from flare.errors import FlareError
from flare.server.extras import ClientData
from flare.server.strategy import ServerContext, Strategy


def tensor_bytes(message: dict[str, Tensor]) -> int:
    """The bytes of a message's tensors as they would travel (raw, uncompressed)."""
    return sum(int(t.numel()) * t.element_size() for t in message.values())


def hold_rounds(name: str, strategy: Strategy, ctx: ServerContext,
                clients: list[ClientData] | None) -> dict[str, float]:
    """Hold `strategy`'s extra rounds with `clients` (`clients[i]` is the owner of `ctx.uploads[i]`, its data
    beside the server: `flare run`, `flare fuse`); returns what they cost, {} for a strategy that holds none."""
    n = int(strategy.extra_rounds())
    if n <= 0:
        return {}
    if clients is None:
        raise FlareError(f"server strategy '{name}' holds {n} rounds with the clients after their upload, which this "
                         "engine cannot reach.", key=f"server.strategies.{name}",
                         fix="run it with `flare run`, or score it afterwards with `flare fuse` over a finished run.")
    memory: list[dict] = [{} for _ in clients]
    down = up = 0
    for rnd in range(n):
        message = strategy.configure_round(rnd, ctx)
        replies = []
        for data, mem in zip(clients, memory):
            down += tensor_bytes(message)
            reply = strategy.client_round(rnd, message, data, mem)
            up += tensor_bytes(reply)
            replies.append(reply)
        strategy.aggregate_round(rnd, replies, ctx)
    return {"rounds": n, "bytes_down": down, "bytes_up": up}
