"""The rounds a server protocol holds with the clients after their one-shot upload (`ServerProtocol.extra_rounds`),
one loop over every transport, with the bytes each way counted and reported beside the accuracy. A transport
carries a round's message to the clients and their replies back: `LocalClients` when their data is beside the
server, the Flower server's nodes otherwise; either keeps each client's `memory` across the rounds.
"""
from __future__ import annotations

from typing import Protocol

from torch import Tensor

from flare.errors import FlareError
from flare.server.extras import ClientData
from flare.server.strategy import ServerContext, Strategy

Message = dict[str, Tensor]


class Transport(Protocol):
    def round(self, name: str, strategy: Strategy, rnd: int, message: Message) -> list[Message]:
        """Send `message` to every client of the uploads and return their replies in upload order."""


class LocalClients:
    """The clients' data beside the server: `clients[i]` owns `uploads[i]`; each reply is computed here."""

    def __init__(self, clients: list[ClientData]):
        self.clients = clients
        self.memory: dict[str, list[dict]] = {}  # strategy → each client's memory

    def round(self, name: str, strategy: Strategy, rnd: int, message: Message) -> list[Message]:
        memory = self.memory.setdefault(name, [{} for _ in self.clients])
        return [strategy.client_round(rnd, message, c, m) for c, m in zip(self.clients, memory)]


def tensor_bytes(message: Message) -> int:
    """The bytes of a message's tensors as they would travel (raw, uncompressed)."""
    return sum(int(t.numel()) * t.element_size() for t in message.values())


def hold_rounds(name: str, strategy: Strategy, ctx: ServerContext, transport: Transport | None) -> dict[str, float]:
    """Hold `strategy`'s extra rounds with the clients of `ctx.uploads` over `transport`; returns what they cost, {}
    for a strategy that holds none."""
    n = int(strategy.extra_rounds())
    if n <= 0:
        return {}
    if transport is None:
        raise FlareError(f"server strategy '{name}' holds {n} rounds with the clients after their upload, which this "
                         "engine cannot reach.", key=f"server.strategies.{name}",
                         fix="run it with `flare run`, or score it afterwards with `flare fuse` over a finished run.")
    down = up = 0
    for rnd in range(n):
        message = strategy.configure_round(rnd, ctx)
        replies = transport.round(name, strategy, rnd, message)
        down += tensor_bytes(message) * len(ctx.uploads)
        up += sum(tensor_bytes(r) for r in replies)
        strategy.aggregate_round(rnd, replies, ctx)
    return {"rounds": n, "bytes_down": down, "bytes_up": up}
