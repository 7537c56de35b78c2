"""The server's evaluation checkpoint (docs/method.md#server-rules, #metrics), engine-free: which strategies a round
scores, the global prototypes, every strategy's predictor scored in one test pass, and the round's diagnostics. Every
engine's round loop (flare/loop.py) calls these through `setup.ServerSetup.evaluate`.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import Tensor

from flare.config import Config
from flare.metrics import g_protos_std, inter_client_proto_std, model_variance_mean
from flare.registry import STRATEGIES
from flare.rng import derived_seed
from flare.server.evaluator import check_predictor, evaluate_predictors
from flare.server.exchange import Transport, hold_rounds
from flare.server.extras import own_extras
from flare.server.fusion import aggregation_weights
from flare.server.strategy import ClientPredictor, ModelPredictor, ServerContext, ServerProtocol, Strategy
from flare.server.upload import Upload


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


def evaluate_uploads(cfg: Config, r: int, uploads: list[Upload], models: list[torch.nn.Module],
                     anchors: Tensor | None, test_x: Tensor | None, test_y: Tensor | None, norm, *,
                     protocols: Sequence[ServerProtocol], kept: dict[str, Tensor], strategies: Mapping[str, Strategy],
                     strategy_state: dict, amp_dtype=None, channels_last: bool = False, public_x: Tensor | None = None,
                     rules: tuple[str, ...] | None = None, clients: Transport | None = None,
                     scratch: Path | None = None) -> Evaluation:
    """One evaluation checkpoint from the uploads alone (`models[i]` holds `uploads[i].state`): the protocols' fold,
    every strategy's predictor scored in one test pass (none without `test_x`), diagnostics. `rules`: else the
    round's own. `clients`: the transport for the rounds a strategy holds after the upload (None: unreachable)."""
    t0 = time.perf_counter()
    weights = aggregation_weights([u.num_samples for u in uploads], cfg.server.weights)
    protos = [u.prototypes for u in uploads if u.prototypes is not None]
    prim = primary_rule(cfg)
    rec: dict = {"kind": "round", "round": r, "method": cfg.method, "primary": prim}
    read, kept_next = {}, None
    for protocol in protocols:
        state, keeps, logs = protocol.fold(r, uploads, anchors, kept)
        read = read | state
        if keeps is not None:  # what it keeps replaces its own keys; the other protocols' stay
            kept_next = (kept_next if kept_next is not None else dict(kept)) | keeps
        rec.update(logs)
    G = read.get("G")
    t_agg = time.perf_counter() - t0
    t1 = time.perf_counter()
    for m in models:  # as ServerContext promises (the runner's live client models come in train mode)
        m.eval()
    shape = tuple(int(s) for s in test_x.shape[1:]) if test_x is not None else None
    # without a test set only the primary is built: it is what a Flower server saves as the run's predictor
    names = rules if rules is not None else rules_for(cfg, r)
    if test_x is None:
        names = tuple(n for n in names if n == prim)
    score = None if test_x is None else (lambda model: accuracy_on_test(
        model, test_x, test_y, norm, batch_size=cfg.test_batch_size, amp_dtype=amp_dtype, channels_last=channels_last))
    preds, built = {}, {}
    for n in names:
        t = time.perf_counter()
        ctx = ServerContext(r, uploads, models, weights, G, anchors, strategy_state.setdefault(n, {}),
                            own_extras(uploads, n, strategies[n]), public_x, norm, shape, score, scratch and scratch / n)
        talk = hold_rounds(n, strategies[n], ctx, clients)
        preds[n] = strategies[n].predictor(ctx)
        if talk:  # the extra rounds' cost beside what the strategy logs itself
            preds[n].logs = {**talk, **preds[n].logs}
        built[n] = time.perf_counter() - t
    for n, p in preds.items():
        check_predictor(n, p, r)
    if test_x is not None:
        # eval.bn=batch draws a new seeded test order every round (the reference's shuffled test loader)
        shuffle_seed = derived_seed(abs(cfg.eval.noise_seed), r, 5) if cfg.eval.bn == "batch" else 0
        rec.update(evaluate_predictors(models, preds, test_x, test_y, norm, batch_size=cfg.test_batch_size,
                                       noise_seed=cfg.eval.noise_seed, amp_dtype=amp_dtype, channels_last=channels_last,
                                       bn=cfg.eval.bn, shuffle_seed=shuffle_seed, round_idx=r))
        rec.update({f"{n}.{k}": v for n, p in preds.items() for k, v in p.logs.items()})
        if "seconds_eval_parts" in rec:  # a rule's own part includes building its predictor (FedAvg: averaging)
            parts = rec["seconds_eval_parts"]
            parts.update({n: round(parts.get(n, 0.0) + t, 4) for n, t in built.items()})
            rec["seconds_eval_rules"] = rule_costs(parts, preds)
    rec["seconds_eval"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    rec["model_variance_mean"] = model_variance_mean(models)
    if protos:
        rec["g_protos_std"] = g_protos_std(G)
        rec["inter_client_proto_std"] = inter_client_proto_std(protos)
    rec["seconds_aggregate"] = t_agg + time.perf_counter() - t2
    rec["acc"] = rec.get(f"acc_{prim}")
    return Evaluation(rec, weights, G, kept_next, preds)
