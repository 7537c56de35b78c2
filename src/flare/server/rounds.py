"""The pieces of the server's evaluation checkpoint (docs/method.md#server-rules, #metrics), engine-free: which
strategies a round scores, its record (`Evaluation`), one model's accuracy scored as a round scores it, and each rule's
cost. `setup.ServerSetup.evaluate` scores a round with them, for every engine's round loop (flare/loop.py).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flare.config import Config
from flare.registry import STRATEGIES
from flare.server.strategy import ClientPredictor, ModelPredictor


def primary_rule(cfg: Config) -> str:
    """The rule whose accuracy is "the" accuracy of a run."""
    return cfg.server.primary if cfg.server.primary != "auto" else head_primary(cfg.head)


def head_primary(head: str) -> str:
    """The strategy that claims `head` (`Strategy.primary_for`), else the one that claims every other head."""
    claims = {h: n for n in STRATEGIES.names() for h in STRATEGIES.get(n).primary_for}
    return claims.get(head) or claims["*"]


def rules_for(cfg: Config, r: int | None = None) -> tuple[str, ...]:
    """The server strategies an evaluation scores (registered order): every default one that applies to the head
    (and fuses mixed architectures, when the clients run them), or those `eval.rules` names, and always the primary;
    with a round index `r`, those with `every_round=False` are left out of all but the last round."""
    mixed = cfg.mixed_architectures

    def applies(n: str) -> bool:  # a named strategy that cannot fuse mixed clients was refused by the config
        s = STRATEGIES.get(n)
        return (cfg.head == "prototype" or not s.needs_prototypes) and (not mixed or s.mixed_architectures)

    prim = primary_rule(cfg)
    want = ({n for n in STRATEGIES.names() if STRATEGIES.get(n).default} if cfg.eval.rules is None else
            {prim if n == "primary" else n for n in cfg.eval.rules}) | {prim}
    names = sorted((n for n in STRATEGIES.names() if n in want and applies(n)),
                   key=lambda n: not STRATEGIES.get(n).default)  # stable: the built-in rules first
    return tuple(n for n in names if r is None or STRATEGIES.get(n).every_round or r == cfg.rounds - 1)


@dataclass
class Evaluation:
    """One evaluation checkpoint: its metrics record and what the server built. `kept`: what the server keeps for
    the next round (None: unchanged)."""

    record: dict
    weights: Tensor
    G: Tensor | None
    kept: dict[str, Tensor] | None = None
    predictors: dict = field(default_factory=dict)


def accuracy_on_test(model: torch.nn.Module, test_x: Tensor, test_y: Tensor, norm, *, batch_size: int,
                  amp_dtype=None, channels_last: bool = False) -> float:
    """One model's test accuracy scored as a round's `ModelPredictor` is (batches, precision, layout), so that a
    strategy's intermediate score is comparable with its final one. The model is left in the mode it came in."""
    was_training = model.training
    model.eval()
    amp = torch.autocast(device_type=test_x.device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    correct = torch.zeros((), dtype=torch.long, device=test_x.device)
    try:
        with torch.no_grad():
            for s in range(0, test_x.shape[0], batch_size):
                x = norm(test_x[s:s + batch_size])
                if channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                with amp:
                    correct += (ModelPredictor(model).scores(x).argmax(1) == test_y[s:s + batch_size]).sum()
    finally:
        model.train(was_training)
    return float(correct) / test_x.shape[0]


def rule_costs(parts: dict, preds: dict) -> dict:
    """Seconds each rule's evaluation would take alone: its own part of `parts` (`seconds_eval_parts`, the additive
    split) and the shared passes it reads."""
    out = {}
    for n, p in preds.items():
        s = parts.get(n, 0.0)
        if isinstance(p, ClientPredictor):
            s += parts.get("clients", 0.0)
            s += parts.get("noise", 0.0) if p.needs_noise else 0.0
            s += parts.get("batch_bn", 0.0) if p.batch_bn else 0.0
        out[n] = round(s, 4)
    return out
