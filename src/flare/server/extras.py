"""Client statistics a server strategy asks for at upload time (`Upload.extras`).

Some one-shot servers need more than the weights: FedLPA / RegMean need each client's per-layer input (and output-
gradient) second moments, computed on the client's own data after training. A strategy asks for them with two
methods of its class (server/strategy.py):

* `extras_shapes(template)` → `{name: (shape, dtype)}`, declared from the run's model: what the server's gate
  expects from every client (checked like the weights: exact names, shapes, dtypes, finite values);
* `client_extras(data: ClientData)` → `{name: tensor}`, run where the client's data lives — in the client's
  process under Flower, beside the client in `flare run`, from the saved states in `flare fuse`.

In an upload the names travel as `<strategy>/<name>` (so two strategies never collide; Flower carries them as
one more array record); a strategy reads its own, without the prefix, from `ServerContext.extras`. Strategies that
read the same statistics name them alike (`Strategy.shares_extras`): they travel once, as `<that name>/<name>`.
The in-process runner checks a strategy's output against its declaration too, so a plugin that declares one shape
and computes another fails at once (exit 2, naming the strategy), not later inside its server code.
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
    """What a strategy's `client_extras` sees of one client after its training (the model's train mode is the
    strategy's to set; the samples are uint8 images and labels on `device`)."""

    cid: int
    model: nn.Module
    x: Tensor
    y: Tensor
    normalize: Callable[[Tensor], Tensor]
    augment: Callable | None
    device: torch.device


def client_side(cid: int, model: nn.Module, x: Tensor, y: Tensor, normalize, augment,
                device: torch.device) -> ClientData:
    """The one way a `ClientData` is made — beside the client in `flare run`, on a Flower node, from the saved
    states in `flare fuse`: a copy of the client's model (a strategy can disturb neither training nor another
    strategy's view) and its samples on `device`."""
    return ClientData(cid, copy.deepcopy(model), x.to(device), y.to(device), normalize, augment, device)


def prefix(name: str, strategy: Strategy) -> str:
    """Where a strategy's statistics travel: its shared name, else its own."""
    return getattr(strategy, "shares_extras", "") or name


def extras_shapes(strategies: Mapping[str, Strategy], template: nn.Module) -> Shapes:
    """The prefixed shapes every upload must carry for `strategies` (name → the run's instance; empty when none
    asks)."""
    return {f"{prefix(n, strategy)}/{k}": (tuple(int(s) for s in shape), dtype) for n, strategy in strategies.items()
            for k, (shape, dtype) in strategy.extras_shapes(template).items()}


def client_extras(strategies: Mapping[str, Strategy], data: ClientData) -> dict[str, Tensor]:
    """Every strategy's statistics of one client, prefixed and moved to the CPU; checked against the declared
    shapes (a strategy that computes what it did not declare is a FlareError naming it)."""
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
