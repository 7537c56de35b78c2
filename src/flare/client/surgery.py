"""Gradient surgery between the local objective and the alignment term (Plan C; docs/method.md#gradient-surgery-plan-c):
one-sided PCGrad, which projects g_loc = ∇ local onto the normal plane of g_al = ∇ align when they conflict and steps
with g_loc + g_al.

How the gradients are obtained. The two weight gradients come from two backward passes over the same graph (`local`
with `retain_graph=True`, then `align`), each read off the weights' `.grad` and cleared again. Using `.backward()`
rather than `torch.autograd.grad(…, params)` matters for λ learners (docs/method.md#learned-λ-v10v14) whose
`local`/`align` parts also depend on their own log-variances (V10/V11: `½e^{−s_l}·base`, `½e^{−s_a}·L_align`): those
parameters are not in `params`, and `.backward()` accumulates their gradient from both parts exactly as an unsurgical
`(local + align + extra).backward()` would. Surgery touches the weights' gradient only.

`extra` (a λ learner's `L_σ`) is backpropagated last, into its own parameters. By design it does not depend on the
weights (V12–V14 build it from `sg(base)` and `sg(L_align)`); if it nevertheless reaches some weights, that gradient
is *kept* and added after the surgery, as the plain path does, and `pcgrad_extra_on_weights = 1` makes it visible."""
from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import Tensor

from flare.registry import SURGERY, NoFacts


Backward = Callable[..., dict[str, Tensor]]  # (local, align, params, extra=None) -> logs; writes the weights' .grad


class SurgeryFn(Protocol):
    """What `SURGERY` holds, built once per run by `SURGERY.create`: a backward that writes `.grad` of `params` from
    the two weight losses (and the λ provider's σ loss `extra`); the entry `none` is None: one plain backward."""
    def __call__(self, facts: NoFacts, options: None) -> Backward: ...


def _take_grads(params: list[Tensor]) -> list[Tensor]:
    """The weights' current .grad (zeros where unused), then clear them."""
    out = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    for p in params:
        p.grad = None
    return out


def _dot(a: list[Tensor], b: list[Tensor]) -> Tensor:
    return torch.stack([(x.float() * y.float()).sum() for x, y in zip(a, b)]).sum()


def pcgrad_backward(local: Tensor, align: Tensor, params: list[Tensor],
                    extra: Tensor | None = None) -> dict[str, Tensor]:
    """Backward pass with one-sided PCGrad; writes `p.grad = g_loc' + g_al` for every p in `params`. Logs (0-d
    tensors): `pcgrad_conflict` (1.0 if the gradients conflicted), `grad_cos` (cos(g_loc, g_al) before the
    projection) and, when `extra` is given, `pcgrad_extra_on_weights`."""
    params = list(params)
    for p in params:
        p.grad = None  # a stale gradient would be mistaken for part of g_loc
    local.backward(retain_graph=True)
    g_loc = _take_grads(params)
    align.backward(retain_graph=extra is not None)
    g_al = _take_grads(params)

    dot = _dot(g_loc, g_al)
    nl2, na2 = _dot(g_loc, g_loc), _dot(g_al, g_al)
    cos = dot / (nl2.sqrt() * na2.sqrt()).clamp_min(1e-30)
    conflict = (dot < 0) & (na2 > 0)
    # branch-free (no host sync): coef = g_loc·g_al/‖g_al‖² where they conflict, 0 elsewhere
    coef = torch.where(conflict, dot / na2.clamp_min(1e-30), torch.zeros_like(dot))

    logs: dict[str, Tensor] = {"pcgrad_conflict": conflict.float().detach(), "grad_cos": cos.detach()}
    g_extra = None
    if extra is not None:
        extra.backward()
        reached = any(p.grad is not None for p in params)
        if reached:
            g_extra = _take_grads(params)
        logs["pcgrad_extra_on_weights"] = torch.full((), float(reached), device=dot.device)
    for i, p in enumerate(params):
        g = g_loc[i] - coef.to(g_loc[i].dtype) * g_al[i] + g_al[i]
        if g_extra is not None:
            g = g + g_extra[i]
        p.grad = g
    return logs


SURGERY.register("none", None, description="one backward of local + align (+ the λ provider's σ loss)")
def _pcgrad_check(cfg) -> None:
    """PCGrad projects the local gradient against the alignment gradient: without anchors there is none."""
    cfg.require_anchors("align.surgery=pcgrad")


SURGERY.register("pcgrad", lambda facts, options: pcgrad_backward,
                 description="one-sided PCGrad between local and align (Plan C)",
                 check=_pcgrad_check)
