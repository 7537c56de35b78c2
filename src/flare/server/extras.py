"""Client statistics a server strategy asks for at upload time (`Upload.extras`): FedLPA / RegMean need each
client's per-layer second moments, computed on the client's own data after training. A strategy declares them from
the run's model (`extras_shapes(template)` → `{name: (shape, dtype)}`: what the gate expects from every client) and
computes them where the client's data lives (`client_extras(data: ClientData)` → `{name: tensor}`).

In an upload the names travel as `<strategy>/<name>`, so two strategies never collide; strategies that read the
same statistics name them alike (`Strategy.shares_extras`) and they travel once. A strategy reads its own, without
the prefix, from `ServerContext.extras`. What a strategy computes is checked against its declaration at once, so a
plugin that declares one shape and computes another fails naming the strategy, not later inside its server code.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor, nn

from flare.errors import FlareError
from flare.server.strategy import Strategy
from flare.server.upload import Shapes, check_tensors


@dataclass
class ClientData:
    """What a strategy's `client_extras` sees of one client after its training (its samples on `device`)."""

    cid: int
    model: nn.Module
    x: Tensor
    y: Tensor
    normalize: Callable[[Tensor], Tensor]
    augment: Callable | None
    device: torch.device


def client_side(cid: int, model: nn.Module, x: Tensor, y: Tensor, normalize, augment,
                device: torch.device) -> ClientData:
    """The one way a `ClientData` is made, on every engine: a copy of the client's model (a strategy can disturb
    neither training nor another strategy's view) and its samples on `device`."""
    return ClientData(cid, copy.deepcopy(model), x.to(device), y.to(device), normalize, augment, device)


def prefix(name: str, strategy: Strategy) -> str:
    """Where a strategy's statistics travel: its shared name, else its own."""
    return getattr(strategy, "shares_extras", "") or name


def extras_shapes(strategies: Mapping[str, Strategy], template: nn.Module) -> Shapes:
    """The prefixed shapes every upload must carry for `strategies` (name → instance; empty when none asks)."""
    return {f"{prefix(n, strategy)}/{k}": (tuple(int(s) for s in shape), dtype) for n, strategy in strategies.items()
            for k, (shape, dtype) in strategy.extras_shapes(template).items()}


def client_extras(strategies: Mapping[str, Strategy], data: ClientData) -> dict[str, Tensor]:
    """Every strategy's statistics of one client, prefixed, on the CPU, checked against the declared shapes."""
    out: dict[str, Tensor] = {}
    for n, strategy in strategies.items():
        declared, pre = strategy.extras_shapes(data.model), prefix(n, strategy)
        if not declared or f"{pre}/{next(iter(declared))}" in out:  # none asked, or shared and computed already
            continue
        got = {f"{pre}/{k}": (v.detach().cpu() if isinstance(v, Tensor) else v)
               for k, v in dict(strategy.client_extras(data)).items()}
        if reasons := check_tensors("extras", got, {f"{pre}/{k}": (tuple(s), d) for k, (s, d) in declared.items()}):
            raise FlareError(f"server strategy '{n}' computed client statistics that do not match what it declares "
                             f"(extras_shapes) for client {data.cid}: " + "; ".join(reasons) + ".",
                             key=f"server.strategies.{n}",
                             fix="make the strategy's client_extras return exactly the names, shapes and dtypes its "
                                 "extras_shapes declares.")
        out.update(got)
    return out


def own_extras(uploads, name: str, strategy: Strategy) -> list[dict[str, Tensor]]:
    """Strategy `name`'s statistics of every upload, without the prefix."""
    pre = f"{prefix(name, strategy)}/"
    return [{k[len(pre):]: v for k, v in (u.extras or {}).items() if k.startswith(pre)} for u in uploads]
