"""OTFusion (Singh & Jaggi, "Model Fusion via Optimal Transport", NeurIPS 2020; sidak/otfusion), weight-based with
exact OT, for K clients: every client's neurons aligned to one pivot client layer by layer (`ot.emd` over the distances
of incoming weight rows already mapped by their inputs' maps), then averaged with the aggregation weights. BatchNorm
follows its channels' map, a residual block's output shares its shortcut's, the classes are never permuted. The walk
follows each module's children in registration order (every FLARE encoder's data flow) and refuses any other layer
with parameters. Residual streams, heads and the reference's departures: docs/baselines.md, `otfusion`.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from flare.errors import FlareError
from flare.models import LinearHead, PrototypeHead
from flare.registry import STRATEGIES
from flare.server.strategy import ModelPredictor, ServerContext, Strategy

BN_LAYERS = (nn.BatchNorm1d, nn.BatchNorm2d)  # the BatchNorm layers the weight-merging servers average


def chosen_by(primary: str, name: str) -> str:
    """The config key that put strategy `name` in this evaluation, `primary` being server.primary (for errors)."""
    return "server.primary" if primary == name else "eval.rules"


class OTFusionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pivot: int | None = Field(None, ge=0, description="the client (id) every model is aligned to; default: the "
                                                      "client with the largest aggregation weight (first on ties)")
    cost: Literal["euclidean", "sqeuclidean"] = Field(
        "euclidean", description="ground cost between incoming weight rows (the reference's runs: euclidean, "
                                 "--not-squared)")


@dataclass
class Group:
    """One set of neurons mapped together: `size` of them, defined by `rows`, the (weight key, bias key or None, input
    group or None) of every layer that writes them (several: a block's last conv and its projection shortcut)."""

    size: int
    rows: list[tuple[str, str | None, int | None]] = field(default_factory=list)


@dataclass
class Plan:
    """The groups in forward order, and for every mapped state key the group on its axis 0 (outputs) and axis 1
    (inputs), either None."""

    groups: list[Group] = field(default_factory=list)
    axes: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)


def _has_state(m: nn.Module, recurse: bool = True) -> bool:
    return any(True for _ in m.parameters(recurse=recurse)) or any(True for _ in m.buffers(recurse=recurse))


def _refuse(where: str, m: nn.Module, why: str, key: str) -> FlareError:
    return FlareError(f"server strategy 'otfusion' cannot align layer '{where or '(model)'}' "
                      f"({type(m).__name__}): {why}.", key=key,
                      fix="drop otfusion from the strategies for this model, or use a model built from Conv2d, Linear "
                          "and BatchNorm layers (cnn, resnet18/34/50).")


def _write(m: nn.Module, prefix: str, inp: int | None, out: int | None, plan: Plan, key: str, new_rows: bool) -> int:
    """A Conv2d/Linear reading group `inp`; writes a new group (out None), or into group `out` (its rows added when
    `new_rows`: a projection shortcut; not for a block writing into an identity stream)."""
    if isinstance(m, nn.Conv2d) and m.groups != 1:
        raise _refuse(prefix[:-1], m, "grouped convolutions are not supported", key)
    size = m.out_channels if isinstance(m, nn.Conv2d) else m.out_features
    w, b = f"{prefix}weight", (f"{prefix}bias" if m.bias is not None else None)
    if out is None:
        plan.groups.append(Group(size))
        out = len(plan.groups) - 1
    elif plan.groups[out].size != size:
        raise _refuse(prefix[:-1], m, f"writes {size} channels into a residual stream of {plan.groups[out].size}", key)
    if new_rows:
        plan.groups[out].rows.append((w, b, inp))
    plan.axes[w] = (out, inp)
    if b is not None:
        plan.axes[b] = (out, None)
    return out


def _norm(prefix: str, g: int | None, plan: Plan) -> None:
    for k in ("weight", "bias", "running_mean", "running_var"):
        plan.axes[f"{prefix}{k}"] = (g, None)


def _walk(m: nn.Module, prefix: str, cur: int | None, plan: Plan, key: str) -> int | None:
    """Add module `m` (state keys under `prefix`) reading group `cur` to the plan; returns the group it outputs."""
    if isinstance(m, (nn.Conv2d, nn.Linear)):
        return _write(m, prefix, cur, None, plan, key, True)
    if isinstance(m, BN_LAYERS):
        _norm(prefix, cur, plan)
        return cur
    if isinstance(m, PrototypeHead):
        plan.axes[f"{prefix}prototypes"] = (None, cur)  # classes × features: the feature map on the columns
        return None
    if isinstance(m, LinearHead):
        plan.axes[f"{prefix}fc.weight"], plan.axes[f"{prefix}fc.bias"] = (None, cur), (None, None)
        return None
    if hasattr(m, "shortcut") and hasattr(m, "conv1"):
        return _block(m, prefix, cur, plan, key)
    if _has_state(m, recurse=False):
        raise _refuse(prefix[:-1], m, "only Conv2d, Linear, BatchNorm, residual blocks and the FLARE heads are "
                                      "supported", key)
    for name, child in m.named_children():
        cur = _walk(child, f"{prefix}{name}.", cur, plan, key)
    return cur


def _block(m: nn.Module, prefix: str, cur: int | None, plan: Plan, key: str) -> int:
    """A residual block: its main path up to the last conv as usual; the last conv, the BN after it and the shortcut
    write one group (the input's under an identity shortcut, else a new one with both convs' rows)."""
    path = [(n, c) for n, c in m.named_children() if n != "shortcut" and _has_state(c)]
    convs = [i for i, (_, c) in enumerate(path) if isinstance(c, nn.Conv2d)]
    if not convs or any(not isinstance(c, (nn.Conv2d, *BN_LAYERS)) for _, c in path):
        raise _refuse(prefix[:-1], m, "a residual block's main path must be Conv2d and BatchNorm layers", key)
    inner = cur
    for n, c in path[:convs[-1]]:
        inner = _walk(c, f"{prefix}{n}.", inner, plan, key)
    n, last = path[convs[-1]]
    short = [(f"{prefix}shortcut.{sn}." if sn else f"{prefix}shortcut.", sc)
             for sn, sc in m.shortcut.named_modules() if _has_state(sc, recurse=False)]
    if not short:  # identity: the block writes into its input's stream, whose map was found where it began
        if cur is None:
            raise _refuse(prefix[:-1], m, "an identity shortcut on the raw input", key)
        out = _write(last, f"{prefix}{n}.", inner, cur, plan, key, False)
    else:
        out = _write(last, f"{prefix}{n}.", inner, None, plan, key, True)
        for sp, sc in short:
            if isinstance(sc, nn.Conv2d):
                _write(sc, sp, cur, out, plan, key, True)
            elif isinstance(sc, BN_LAYERS):
                _norm(sp, out, plan)
            else:
                raise _refuse(sp[:-1], sc, "a shortcut must be Conv2d and BatchNorm layers", key)
    for n2, c in path[convs[-1] + 1:]:
        _norm(f"{prefix}{n2}.", out, plan)
    return out


def alignment_plan(model: nn.Module, key: str = "eval.rules") -> Plan:
    """Which neurons are mapped together, and which axis of which state tensor each map acts on."""
    plan = Plan()
    _walk(model, "", None, plan, key)
    return plan


def _map_in(t: Tensor, T: Tensor) -> Tensor:
    """t (out, in, ...) with its input axis mapped: W T. A Linear after a flatten reads in = channels × positions
    (channel-major), so the input axis is viewed as (channels, rest)."""
    o = t.shape[0]
    return torch.einsum("onr,nm->omr", t.reshape(o, T.shape[0], -1), T).reshape(t.shape)


def _map_out(t: Tensor, T: Tensor) -> Tensor:
    return (T.t() @ t.reshape(T.shape[0], -1)).reshape(t.shape)


def _pot():
    """POT, imported on OTFusion's first transport: it is an optional extra, so every other part runs without it."""
    try:
        import ot  # lazy: the optional baselines extra
    except ImportError:
        raise FlareError("OTFusion needs POT (Python Optimal Transport), which is not installed.",
                         key="server.strategies", fix="pip install 'flare-ofl[baselines]' (or pip install pot).") from None
    return ot


def _transport(x: Tensor, y: Tensor, cost: str) -> Tensor:
    """The exact OT plan between the rows of x (client) and y (pivot), uniform marginals, times n."""
    n = x.shape[0]
    c = torch.cdist(x, y)
    c = c * c if cost == "sqeuclidean" else c
    u = torch.full((n,), 1.0 / n, dtype=torch.float64)
    T = _pot().emd(u, u, c.cpu(), numItermax=max(100_000, 50 * n * n))
    return torch.as_tensor(T, dtype=torch.float64).to(x.device) * n


def align_state(state: dict[str, Tensor], pivot: dict[str, Tensor], plan: Plan,
                cost: str = "euclidean") -> tuple[dict[str, Tensor], float]:
    """A client's state aligned to the pivot's neurons (float64), and the share of its neurons mapped to the same
    index (1.0: nothing moved)."""
    maps: list[Tensor] = []
    kept = 0.0
    for g in plan.groups:
        xs, ys = [], []
        for w, b, inp in g.rows:
            xw = state[w].double()
            xs.append((_map_in(xw, maps[inp]) if inp is not None else xw).reshape(g.size, -1))
            ys.append(pivot[w].double().reshape(g.size, -1))
            if b is not None:
                xs.append(state[b].double().reshape(g.size, 1))
                ys.append(pivot[b].double().reshape(g.size, 1))
        T = _transport(torch.cat(xs, 1), torch.cat(ys, 1), cost)
        kept += float(T.diagonal().sum())
        maps.append(T)
    out = {}
    for k, v in state.items():
        o, i = plan.axes.get(k, (None, None))
        if not torch.is_floating_point(v):
            out[k] = v
            continue
        t = v.double()
        t = _map_in(t, maps[i]) if i is not None else t
        out[k] = _map_out(t, maps[o]) if o is not None else t
    return out, kept / max(1, sum(g.size for g in plan.groups))


def otfusion(states: list[dict[str, Tensor]], weights: Tensor, plan: Plan, pivot: int,
             cost: str = "euclidean") -> tuple[dict[str, Tensor], float]:
    """Σ_k w_k (client k aligned to client `pivot`), in the pivot's dtypes; and the mean share of unmoved neurons."""
    acc: dict[str, Tensor] = {}
    kept = []
    for k, s in enumerate(states):
        if k == pivot:
            aligned = {n: v.double() if torch.is_floating_point(v) else v for n, v in s.items()}
        else:
            aligned, share = align_state(s, states[pivot], plan, cost)
            kept.append(share)
        w = float(weights[k])
        for n, v in aligned.items():
            if torch.is_floating_point(v):
                acc[n] = acc[n] + w * v if n in acc else w * v
    fused = {n: (acc[n].to(v.dtype) if n in acc else v.clone()) for n, v in states[pivot].items()}
    return fused, (sum(kept) / len(kept) if kept else 1.0)


@STRATEGIES.register("otfusion", options=OTFusionOptions)
class OTFusion(Strategy):
    """OTFusion: every client's neurons aligned to a pivot client by exact OT, layer by layer, then averaged."""

    every_round = False
    one_architecture_why = "it matches the clients' neurons layer by layer and averages them, which needs one layout"

    def predictor(self, ctx: ServerContext) -> ModelPredictor:
        t0 = time.perf_counter()
        key = chosen_by(self.facts.primary, "otfusion")
        clients = [u.client for u in ctx.uploads]
        if self.options.pivot is None:
            pivot = int(torch.argmax(ctx.weights.cpu()))
        elif self.options.pivot in clients:
            pivot = clients.index(self.options.pivot)
        else:
            raise FlareError(f"otfusion's pivot is client {self.options.pivot}, which is not among the uploads "
                             f"(clients {clients}).", key="server.strategies.otfusion.pivot",
                             fix="name a client that holds samples, or leave pivot unset.")
        # one layout: the config refuses otfusion for mixed clients, the upload gate a state not of its client's
        states = [u.state for u in ctx.uploads]
        model = copy.deepcopy(ctx.models[pivot])
        plan = alignment_plan(model, key)
        fused, kept = otfusion(states, ctx.weights, plan, pivot, self.options.cost)
        model.load_state_dict(fused)
        mb = sum(v.numel() for v in states[pivot].values() if torch.is_floating_point(v)) * 8 / 2 ** 20
        return ModelPredictor(model, logs={"seconds": time.perf_counter() - t0, "unmoved_share": kept,
                                           "peak_mb": 2 * mb,  # float64: the running sum and one aligned client
                                           "pivot": float(clients[pivot])})
