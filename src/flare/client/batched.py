"""Batched clients (`client_engine=batched`): all K clients of a round trained as one program.

Why: trained one after another, every client issues its own small kernels for every op, and at batch 512 on 32×32
images a GPU spends most of a round waiting for the host. The clients share one architecture, so their parameters and
buffers can be stacked along a leading client axis and one forward/backward computes every client's step:
`torch.func.functional_call` under `torch.vmap` over the stacked state (a convolution becomes a grouped convolution;
BatchNorm updates each client's own running statistics, since the buffers are stacked too), then a per-client
functional SGD updates the stack. `compile=true` wraps the vmapped step and the update with `torch.compile`.

Each client runs its own round plan (client/plan.py), the one `Client.train_round` runs, so both engines compute the
same math per client (tests/test_batched.py holds them to float tolerance on CPU): each client's augmentation runs
under its own streams; clients whose batch sizes differ at a step (a ragged last batch, or no batch left) are never
mixed in one vmapped call; each client has its own lr, λ (the learner's σ stepped by `lam.sigma_sgd`), gradient norm
for clipping, and SGD with momentum and weight decay as `torch.optim.SGD` computes them (a fresh momentum buffer is
a zero buffer: 0·m + g is g exactly).

The clients stay the home of every state: the stack is built from them when a round starts and written back when it
ends, so uploads, evaluation, checkpoints and resume are the sequential engine's. No host sync per step: a round's
lr and λ strength are one table copied to the device once; the step logs are read once per round. No channels_last:
vmap cannot query an NHWC layout; on CUDA, BatchNorm runs in float32 on the native kernel (`_batch_norm_fp32_native`).
"""
from __future__ import annotations

import copy
import functools
import time
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor
from torch.func import functional_call, stack_module_state
from torch.profiler import record_function

from flare.client.lam import LamLearner, LamProvider, sigma_sgd
from flare.client.plan import RoundLogs, RoundPlan
from flare.client.step import local_loss
from flare.client.trainer import Client, TrainContext
from flare.config import Config
from flare.errors import FlareError, KeyedValueError
from flare.models import layout
from flare.registry import CLIENT_ENGINES


class _StepTable:
    """The clients' round plans laid side by side by global step: at its step t client i is at `plans[i].steps[t]`,
    so clients in different epochs at the same t keep their own progress. Per step one row of lr, λ strength and
    which log row and epoch step each client writes, copied to the device once per round."""

    def __init__(self, plans: list[RoundPlan], clients: list[Client], ctx: TrainContext):
        self.plans = plans
        self.T = max(len(pl.steps) for pl in plans)
        K, E = len(plans), ctx.cfg.local_epochs
        lr, strength, rows, batch = ([[0] * K for _ in range(self.T)] for _ in range(4))
        for i, (pl, c) in enumerate(zip(plans, clients)):
            for t, s in enumerate(pl.steps):
                lr[t][i], strength[t][i] = s.lr, c.lam.strength(s.p)
                rows[t][i], batch[t][i] = i * E + s.epoch, s.batch
        # T×K each; rows: the client-epoch row of the logs, batch: the step within the epoch
        self.lr, self.strength = (torch.tensor(v, dtype=torch.float32).to(ctx.device) for v in (lr, strength))
        self.rows, self.batch = (torch.tensor(v, dtype=torch.long).to(ctx.device) for v in (rows, batch))

    def groups(self, t: int) -> dict[int, list[int]]:
        """Batch size → the clients (positions) that train at global step t with batches of that size."""
        out: dict[int, list[int]] = {}
        for i, pl in enumerate(self.plans):
            if t < len(pl.steps):
                out.setdefault(pl.size(t), []).append(i)
        return out


@CLIENT_ENGINES.register("batched")
class BatchedClients:
    """Trains `clients` (all active clients of a run, in a fixed order) one round at a time as one batched program.
    What it cannot run it states: settings at config validation (`check`), λ providers when it is built
    (`lam_unsupported`), a loss term that cannot be vmapped at its first step (`_vmap_errors`)."""

    @staticmethod
    def check(cfg: Config) -> None:
        """Refuse a config with a setting the engine does not implement, naming the first one and the way out
        (docs/performance.md): gradient surgery needs each client's two gradients apart, the engine takes one
        backward of all clients' summed loss; the contrast banks are per-client queues rewritten after every step; a
        moving alignment target starts from each client's own initial prototypes at its own progress (the engine
        plans strengths only); SGDR's momentum reset changes state between steps the stack does not hold; eval-mode
        epochs (train_mode_epochs) would need every client's mode switched inside the one program."""
        blocked = [(key, value) for key, value, on in (
            ("align.surgery", cfg.align.surgery, cfg.align.surgery != "none"),
            ("loss.contrast", cfg.loss.contrast, cfg.loss.contrast != "none"),
            ("align.target", cfg.align.target, cfg.align.anchors != "none" and cfg.align.target != "fixed"),
            ("lr_schedule.reset_momentum", True, cfg.lr_schedule.kind == "sgdr" and cfg.lr_schedule.reset_momentum),
            ("train_mode_epochs", cfg.train_mode_epochs, cfg.train_mode_epochs is not None),
        ) if on]
        if blocked:
            key, value = blocked[0]
            raise KeyedValueError(key, f"client_engine=batched does not support {key}={value} (it trains "
                                  "every client as one vmapped program; docs/performance.md lists what it runs "
                                  f"and why this is not among it); use client_engine=sequential (or threads) "
                                  f"for {key}={value}")

    @staticmethod
    def lam_unsupported(provider: LamProvider) -> str | None:
        """Why the engine cannot run `provider`, or None. It plans a round's `strength(p)` ahead, calls
        `weigh(base, align, strength, state)` under vmap with the clients' stacked `sigma_state()`, and updates σ
        with `sigma_sgd` at the provider's optimizer lr (what `LamLearner.step` does); a provider whose step is more
        than that (its own `__call__` or `step`, or an optimizer with momentum) needs the sequential engine."""
        cls = type(provider)
        if cls.__call__ is not LamProvider.__call__:
            return f"{cls.__name__} overrides __call__ (the engine calls strength() and weigh())"
        if provider.sigma_state():
            opt = getattr(provider, "optimizer", None)
            if not isinstance(opt, torch.optim.SGD) or any(g.get("momentum") or g.get("weight_decay")
                                                           for g in opt.param_groups):
                return f"{cls.__name__} has σ parameters without a plain SGD optimizer (the engine's σ update)"
            if cls.step is not LamLearner.step:
                return f"{cls.__name__} overrides step() (the engine updates σ itself)"
        elif cls.step is not LamProvider.step:
            return f"{cls.__name__} overrides step() (the engine never calls it)"
        return None

    def __init__(self, clients: list[Client], ctx: TrainContext, compile: bool = False):
        self.clients, self.ctx, self.cfg = clients, ctx, ctx.cfg
        # The template's own tensors are never used: functional_call swaps the clients' stacked state in.
        self.template = copy.deepcopy(clients[0].model)
        for m in self.template.modules() if ctx.device.type == "cuda" else ():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.forward = functools.partial(_batch_norm_fp32_native, m)
        self.proto_name = "head.prototypes" if self.template.prototypes is not None else None
        self.lam = clients[0].lam  # the λ arithmetic (its coefficients are the config's, the same for every client)
        if why := self.lam_unsupported(self.lam):
            raise FlareError(f"client_engine=batched cannot run the λ provider lam.learner={self.cfg.lam.learner}: "
                             f"{why}.", key="lam.learner",
                             fix=f"use client_engine=sequential (or threads) for lam.learner={self.cfg.lam.learner}.")
        self._step, self._update = ((torch.compile(f) if compile else f)
                                    for f in (torch.vmap(self._client_loss), _sgd_update))
        self._index: dict[tuple, Tensor] = {}
        self.calls = 0  # vmapped calls made (tests and the profiler read it)

    # -- one client's loss, vmapped over the clients ----------------------------------------------------------
    def _client_loss(self, params: dict, buffers: dict, sigma: tuple, strength: Tensor, imgs: Tensor,
                     y2: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One client's step loss and logs, written for one client and vmapped over the group: the forward of
        `Client._step` (autocast around the model only), then `local_loss` — the function the sequential engine
        and the LR probe call — with L_align to the fixed target (the anchors, or the one the server sent: Plan
        B's G) and λ through the provider's `weigh`."""
        ctx, cfg = self.ctx, self.cfg
        amp = (torch.autocast(device_type=ctx.device.type, dtype=ctx.amp_dtype)
               if ctx.amp_dtype is not None else nullcontext())
        with amp:
            feat, logits = functional_call(self.template, (params, buffers), (imgs,))
        protos = params[self.proto_name] if self.proto_name else None
        loss = local_loss(cfg, feat, logits, y2, protos, target=ctx.align_anchors,  # align.target=fixed
                          weigh=lambda base, align: self.lam.weigh(base, align, strength, sigma if sigma else None))
        return loss.total(), loss.logs()

    # -- one round -----------------------------------------------------------------------------------------------
    def train_round(self, round_idx: int, on_step=None) -> list[dict]:
        cfg, ctx, clients = self.cfg, self.ctx, self.clients
        t0, K = time.perf_counter(), len(clients)
        plans = [RoundPlan(c, ctx, round_idx) for c in clients]
        table = _StepTable(plans, clients, ctx)
        logs = RoundLogs([c.cid for c in clients], cfg.local_epochs, round_idx, ctx.device)
        params, buffers = stack_module_state([c.model for c in clients])
        names = list(params)
        momentum = cfg.optim.momentum
        bufs = [self._momentum(n) for n in names] if momentum else None
        sigma = tuple(torch.stack([s.detach() for s in ss]).requires_grad_()
                      for ss in zip(*(c.lam.sigma_state() for c in clients)))
        sigma_lr = clients[0].lam.optimizer.param_groups[0]["lr"] if sigma else 0.0
        for t in range(table.T):
            groups = table.groups(t)
            for p in params.values():
                p.grad = None
            for size, members in groups.items():
                gi = None if len(members) == K else self._cached(tuple(members), lambda: torch.tensor(members))
                imgs, y2 = self._views(plans, members, t)
                pick = (lambda v: v) if gi is None else (lambda v: v.index_select(0, gi))
                b_g = buffers if gi is None else {n: pick(v) for n, v in buffers.items()}
                with record_function("flare.forward_loss"), _vmap_errors(self.cfg):
                    total, step_logs = self._step({n: pick(v) for n, v in params.items()}, b_g,
                                                  tuple(pick(s) for s in sigma), pick(table.strength[t]), imgs, y2)
                self.calls += 1
                with record_function("flare.backward"):
                    total.sum().backward()
                if gi is not None:  # BatchNorm statistics of the group back into the stack
                    with torch.no_grad():
                        for n, v in buffers.items():
                            v.index_copy_(0, gi, b_g[n])
                logs.add(step_logs, pick(table.rows[t]), pick(table.batch[t]))
                if on_step is not None:
                    for _ in members:
                        on_step()
            active = sorted(i for m in groups.values() for i in m)
            mask = None if len(active) == K else self._cached(("mask", *active), lambda: torch.zeros(
                K, dtype=torch.bool).index_fill_(0, torch.tensor(active), True))
            with record_function("flare.optimizer"):
                grads = [params[n].grad for n in names]
                if any(g is None for g in grads):
                    missing = [n for n, g in zip(names, grads) if g is None]
                    raise RuntimeError(f"batched clients: parameters without a gradient: {missing}")
                with torch.no_grad():
                    plist = [params[n] for n in names]
                    new_p, new_b = self._update(plist, grads, bufs, table.lr[t], mask, cfg.optim.grad_clip,
                                                momentum, cfg.optim.weight_decay)
                    torch._foreach_copy_(plist, new_p)
                    if bufs is not None:
                        torch._foreach_copy_(bufs, new_b)
                sigma_sgd(sigma, sigma_lr, mask)  # the λ learner's σ step, as `LamLearner.step` takes it
        logs.close(range(K * cfg.local_epochs))  # one device read; stops at the first diverged client-epoch
        return self._finish(plans, params, buffers, bufs, sigma, logs, time.perf_counter() - t0)

    def _finish(self, plans, params, buffers, bufs, sigma, logs: RoundLogs, seconds: float) -> list[dict]:
        """Write every state back into its client, and its record."""
        cfg, records = self.cfg, []
        with torch.no_grad():
            for i, (c, plan) in enumerate(zip(self.clients, plans)):
                for n, p in c.model.named_parameters():
                    p.copy_(params[n][i])
                for n, b in c.model.named_buffers():
                    b.copy_(buffers[n][i])
                if c.optimizer is None or cfg.optim.reset_each_round:
                    c.optimizer = c._make_optimizer()
                for g in c.optimizer.param_groups:
                    g["lr"] = plan.last_lr
                if bufs is not None:
                    for p, buf in zip(c.model.parameters(), bufs):
                        c.optimizer.state[p]["momentum_buffer"] = buf[i].clone()
                for own, stacked in zip(c.lam.sigma_state(), sigma):
                    own.copy_(stacked[i])
                c.epochs_done += plan.E
                records.append(c.round_record(plan, logs.means(i, len(plan.steps)), seconds))
        return records

    # -- helpers ---------------------------------------------------------------------------------------------
    def _momentum(self, name: str) -> Tensor:
        """The stacked momentum buffers of one parameter: the clients' own when their optimizer carries over
        rounds (optim.reset_each_round=false, or a resumed checkpoint), zeros for a fresh optimizer."""
        out = []
        for c in self.clients:
            p = c.model.get_parameter(name)
            keep = c.optimizer is not None and not self.cfg.optim.reset_each_round
            buf = c.optimizer.state.get(p, {}).get("momentum_buffer") if keep else None
            out.append(buf.detach().clone() if buf is not None else torch.zeros_like(p))
        return torch.stack(out)

    def _cached(self, key: tuple, make) -> Tensor:
        """A group's index or mask, built once per distinct group: no host-to-device copy per step."""
        if key not in self._index:
            self._index[key] = make().to(self.ctx.device)
        return self._index[key]

    def _views(self, plans: list[RoundPlan], members: list[int], t: int) -> tuple[Tensor, Tensor]:
        """Each member's step-t input and labels from its own plan (`RoundPlan.views`: its own streams, or the plain
        view), stacked: k×2B×C×H×W (plain: k×B×C×H×W)."""
        with record_function("flare.augment"):
            views, labels = zip(*(plans[i].views(self.ctx, t) for i in members))
        return torch.stack(views), torch.stack(labels)


def by_architecture(clients: list[Client], ctx: TrainContext, compile: bool = False) -> list["BatchedClients"]:
    """One batched engine per architecture among `clients` (clients whose models hold the same tensors): vmap
    stacks the clients' parameters, so one program trains clients of one layout; the groups train one after the
    other, each client on its own streams, so the numbers are those of one engine over every client."""
    groups: dict[tuple, list[Client]] = {}
    for c in clients:
        groups.setdefault(layout(c.model), []).append(c)
    return [BatchedClients(g, ctx, compile=compile) for g in groups.values()]


def _batch_norm_fp32_native(bn: torch.nn.Module, x: Tensor) -> Tensor:
    """A CUDA BatchNorm under vmap: float32 in, on the native kernel (cuDNN off around this op only), out in the
    input's dtype. `batch_norm` picks its backend before vmap's rule sees the call: bf16 in, the native kernel
    refuses float32 running statistics; float32 in, cuDNN queries the batched tensor's memory format (NYI)."""
    with torch.autocast("cuda", enabled=False), torch.backends.cudnn.flags(enabled=False):
        return type(bn).forward(bn, x.float()).to(x.dtype)


@contextmanager
def _vmap_errors(cfg):
    """A registered loss term, λ provider or model that cannot run under vmap (a `.item()`, data-dependent control
    flow, an op whose batching rule is missing on this device) fails with the parts named and the way out, not with
    vmap's internals. The model is among them: a CUDA batch-norm path once failed here with a healthy λ provider."""
    try:
        yield
    except RuntimeError as e:
        if "vmap" not in str(e) and "Batched" not in str(e):
            raise
        parts = ([f"loss.terms.{n}" for n in cfg.loss.terms] + [f"lam.learner={cfg.lam.learner}"]
                 + [f"model.name={cfg.model.name}"])
        raise FlareError(f"client_engine=batched traces one client's loss under torch.vmap, and it failed: {e}. A "
                         f"part of this config is not vmappable (one of: {', '.join(parts)}).",
                         key=f"loss.terms.{next(iter(cfg.loss.terms))}" if cfg.loss.terms else "lam.learner",
                         fix="use client_engine=sequential (or threads), or write the part without .item() and "
                             "data-dependent branches.") from None


def _sgd_update(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor] | None, lr: Tensor,
                mask: Tensor | None, clip: float | None, momentum: float,
                weight_decay: float) -> tuple[list[Tensor], list[Tensor] | None]:
    """One step of every client, as new tensors (a pure function: it compiles): each client's gradients
    clipped by its own global norm (as `clip_grad_norm_` does), then SGD as `torch.optim.SGD` computes it (weight
    decay, momentum without dampening, the client's lr). Clients outside `mask` keep parameters and momentum."""
    K = params[0].shape[0]
    coef = None
    if clip is not None:
        norms = torch.stack([torch.linalg.vector_norm(g.reshape(K, -1), 2, dim=1) for g in grads])
        coef = torch.clamp(clip / (torch.linalg.vector_norm(norms, 2, dim=0) + 1e-6), max=1.0)
    new_params, new_bufs = [], []
    for j, (p, g) in enumerate(zip(params, grads)):
        shape = (K,) + (1,) * (p.dim() - 1)
        d = g * coef.view(shape) if coef is not None else g
        if weight_decay:
            d = d.add(p, alpha=weight_decay)
        if bufs is not None:
            d = bufs[j] * momentum + d
            new_bufs.append(d if mask is None else torch.where(mask.view(shape), d, bufs[j]))
        q = p - lr.view(shape) * d
        new_params.append(q if mask is None else torch.where(mask.view(shape), q, p))
    return new_params, (new_bufs if bufs is not None else None)
