"""Batched clients (`client_engine=batched`): all K clients of a round trained as one program.

Why: trained one after another, every client issues its own small kernels for every op, and at batch 512 on
32×32 images a GPU spends most of a round waiting for the host. The clients share one architecture,
so their parameters and buffers can be stacked along a leading client axis and one forward/backward computes every
client's step: `torch.func.functional_call` under `torch.vmap` over the stacked state (a convolution becomes a
grouped convolution; BatchNorm updates each client's own running statistics, since the buffers are stacked too),
then a per-client functional SGD updates the stack. `compile=true` wraps the vmapped step and the update with
`torch.compile`.

The same math per client as `Client.train_round` (tests/test_batched.py holds the two to float tolerance on CPU):

* every client draws its batch order from its own order generator and its augmentation from its own
  `RngStreams`, exactly as in sequential mode: the augmentation runs per client under that client's streams, and
  only its views are stacked, so the draws match one for one;
* clients hold different sample counts: at global step t only the clients that still have a batch take part, and
  clients whose batch sizes differ (a ragged last batch) are never mixed in one vmapped call — a step makes one
  call per batch size present;
* per client: its lr schedule, its λ (λ0·a(p), fixed or from the entropy rule, or the decoupled learner with its
  own σ and σ-SGD), its own global gradient norm for clipping, and SGD with momentum and weight decay computed as
  `torch.optim.SGD` computes them (a fresh momentum buffer is a zero buffer: 0·m + g is g exactly).

The clients stay the home of every state: the stack is built from their models, optimizers and λ providers when a
round starts and written back when it ends, so uploads, evaluation, checkpoints (`Client.state_dict`) and resume
are those of the sequential engine. No host sync per step: a round's per-step numbers (lr, λ strength) are one
table copied to the device once, and the step logs are summed on the device and read once per round. What the
engine does not implement fails at config validation (`Config.batched_engine_blockers`); channels_last is not
used (vmap cannot query an NHWC layout).
"""
from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor
from torch.func import functional_call, stack_module_state
from torch.profiler import record_function

from flare.client.lam import batched_unsupported
from flare.client.step import local_loss
from flare.client.trainer import Client, StepLogs, TrainContext
from flare.errors import FlareError
from flare.rng import RngStreams, augmentation_generators, derived_seed


class RoundPlan:
    """Who trains on what at each global step of one round: per client its steps, batch slices, lr and λ strength.

    Client i has `spe_i = ceil(n_i / B)` steps per epoch and `E·spe_i` steps in the round; at its step t it is in
    epoch `t // spe_i` at batch `t % spe_i`, exactly as its own loop in `Client.train_round` would be."""

    def __init__(self, clients: list[Client], ctx: TrainContext, round_idx: int):
        cfg = ctx.cfg
        B, E = cfg.batch_size, cfg.local_epochs
        self.B, self.E = B, E
        self.n = [c.num_samples for c in clients]
        # steps per epoch as the client's own loop counts them: floor(n/B) with drop_last (n < B: no step)
        self.spe = [n // B if cfg.drop_last else math.ceil(n / B) for n in self.n]
        self.steps = [E * s for s in self.spe]
        self.T = max(self.steps)
        K = len(clients)
        # the batch orders: E permutations per client from its order generator, as its own loop draws them
        self.perms = []
        for c in clients:
            gen = torch.Generator().manual_seed(derived_seed(cfg.seed, round_idx, c.cid, 2))
            self.perms.append(torch.cat([torch.randperm(c.num_samples, generator=gen) for _ in range(E)])
                              .to(c.indices.device))
        lr = [[0.0] * K for _ in range(self.T)]
        strength = [[0.0] * K for _ in range(self.T)]
        rows = [[0] * K for _ in range(self.T)]
        batch = [[0] * K for _ in range(self.T)]
        self.last_lr = [cfg.base_lr] * K
        for i, c in enumerate(clients):
            for t in range(self.steps[i]):
                e, b = divmod(t, self.spe[i])
                epochs = c.epochs_done + e
                lr[t][i] = ctx.lr_schedule(epochs + b / self.spe[i], round_idx)
                strength[t][i] = c.lam.strength(c.progress_at(ctx, e, b, self.spe[i], epochs)[0])
                rows[t][i], batch[t][i] = i * E + e, b
            if self.steps[i]:
                self.last_lr[i] = lr[self.steps[i] - 1][i]
        dev = ctx.device
        self.lr = torch.tensor(lr, dtype=torch.float32).to(dev)                  # T×K, one copy per round
        self.strength = torch.tensor(strength, dtype=torch.float32).to(dev)      # T×K
        self.rows = torch.tensor(rows, dtype=torch.long).to(dev)                  # T×K: client-epoch row of the logs
        self.batch = torch.tensor(batch, dtype=torch.long).to(dev)                # T×K: step within the epoch

    def groups(self, t: int) -> dict[int, list[int]]:
        """Batch size → the clients (positions) that train at global step t with batches of that size."""
        out: dict[int, list[int]] = {}
        for i, (n, spe) in enumerate(zip(self.n, self.spe)):
            if t < self.steps[i]:
                size = min(self.B, n - (t % spe) * self.B)
                out.setdefault(size, []).append(i)
        return out

    def batch_positions(self, i: int, t: int) -> Tensor:
        """Client i's permuted positions of its batch at step t (a slice: no copy, no sync)."""
        e, b = divmod(t, self.spe[i])
        n = self.n[i]
        return self.perms[i][e * n + b * self.B: e * n + min((b + 1) * self.B, n)]


class BatchedClients:
    """Trains `clients` (all active clients of a run, in a fixed order) one round at a time as one batched program."""

    def __init__(self, clients: list[Client], ctx: TrainContext, compile: bool = False):
        if not clients:
            raise ValueError("BatchedClients needs at least one client")
        self.clients = clients
        self.ctx = ctx
        self.cfg = ctx.cfg
        # The template's own tensors are never used: functional_call swaps the clients' stacked state in.
        self.template = copy.deepcopy(clients[0].model)
        self.proto_name = "head.prototypes" if self.template.prototypes is not None else None
        self.lam = clients[0].lam  # the λ arithmetic (its coefficients are the config's, the same for every client)
        why = batched_unsupported(self.lam)
        if why:
            raise FlareError(f"client_engine=batched cannot run the λ provider lam.learner={self.cfg.lam.learner}: "
                             f"{why}.", key="lam.learner",
                             fix=f"use client_engine=sequential (or threads) for lam.learner={self.cfg.lam.learner}.")
        step = torch.vmap(self._client_loss)
        self._step = torch.compile(step) if compile else step
        self._update = torch.compile(_sgd_update) if compile else _sgd_update
        self._index: dict[tuple, Tensor] = {}
        self.calls = 0  # vmapped calls made (tests and the profiler read it)

    # -- one client's loss, vmapped over the clients ----------------------------------------------------------
    def _client_loss(self, params: dict, buffers: dict, sigma: tuple, strength: Tensor, imgs: Tensor,
                     y2: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One client's step loss and logs, written for one client and vmapped over the group: the forward of
        `Client._step` (autocast around the model only), then `local_loss` — the function the sequential engine
        and the LR probe call — with L_align to the fixed anchors and λ through the provider's `weigh`."""
        ctx, cfg = self.ctx, self.cfg
        amp = (torch.autocast(device_type=ctx.device.type, dtype=ctx.amp_dtype)
               if ctx.amp_dtype is not None else nullcontext())
        with amp:
            feat, logits = functional_call(self.template, (params, buffers), (imgs,))
        protos = params[self.proto_name] if self.proto_name else None
        loss = local_loss(cfg, feat, logits, y2, protos, target=ctx.anchors,  # align.target=fixed
                          weigh=lambda base, align: self.lam.weigh(base, align, strength, sigma if sigma else None))
        total, logs = loss.total(), loss.logs()
        return total, logs

    # -- one round -----------------------------------------------------------------------------------------------
    def train_round(self, round_idx: int, on_step=None) -> list[dict]:
        cfg, ctx, clients = self.cfg, self.ctx, self.clients
        t0 = time.perf_counter()
        K, E = len(clients), cfg.local_epochs
        plan = RoundPlan(clients, ctx, round_idx)
        gens = augmentation_generators(ctx.device)
        streams = [RngStreams(gens, [derived_seed(cfg.seed, round_idx, c.cid, 1, *([k] if k else []))
                                     for k in range(len(gens))]) for c in clients]
        params, buffers = stack_module_state([c.model for c in clients])
        names = list(params)
        momentum = cfg.optim.momentum
        bufs = [self._momentum(n) for n in names] if momentum else None
        sigma = tuple(torch.stack([s.detach() for s in ss]).requires_grad_()
                      for ss in zip(*(c.lam.sigma_state() for c in clients)))
        sigma_lr = clients[0].lam.optimizer.param_groups[0]["lr"] if sigma else 0.0
        keys: list[str] | None = None
        sums = first_bad = None
        for t in range(plan.T):
            groups = plan.groups(t)
            for p in params.values():
                p.grad = None
            for s in sigma:
                s.grad = None
            for size, members in groups.items():
                gi = None if len(members) == K else self._gidx(members, params[names[0]].device)
                imgs, y2 = self._views(plan, streams, members, t)
                pick = (lambda v: v) if gi is None else (lambda v: v.index_select(0, gi))
                b_g = buffers if gi is None else {n: pick(v) for n, v in buffers.items()}
                with record_function("flare.forward_loss"), _vmap_errors(self.cfg):
                    total, logs = self._step({n: pick(v) for n, v in params.items()}, b_g,
                                             tuple(pick(s) for s in sigma), pick(plan.strength[t]), imgs, y2)
                self.calls += 1
                with record_function("flare.backward"):
                    total.sum().backward()
                if gi is not None:  # BatchNorm statistics of the group back into the stack
                    with torch.no_grad():
                        for n, v in buffers.items():
                            v.index_copy_(0, gi, b_g[n])
                if keys is None:
                    keys = list(logs)
                    sums = torch.zeros(K * E, len(keys), device=ctx.device)
                    first_bad = torch.full((K * E, len(keys)), -1, dtype=torch.long, device=ctx.device)
                _add_logs(sums, first_bad, torch.stack([logs[k].float() for k in keys], dim=1),
                          pick(plan.rows[t]), pick(plan.batch[t]))
                if on_step is not None:
                    for _ in members:
                        on_step()
            active = sorted(i for m in groups.values() for i in m)
            mask = None if len(active) == K else self._mask(active, K)
            with record_function("flare.optimizer"):
                grads = [params[n].grad for n in names]
                if any(g is None for g in grads):
                    missing = [n for n, g in zip(names, grads) if g is None]
                    raise RuntimeError(f"batched clients: parameters without a gradient: {missing}")
                with torch.no_grad():
                    plist = [params[n] for n in names]
                    new_p, new_b = self._update(plist, grads, bufs, plan.lr[t], mask, cfg.optim.grad_clip,
                                                momentum, cfg.optim.weight_decay)
                    torch._foreach_copy_(plist, new_p)
                    if bufs is not None:
                        torch._foreach_copy_(bufs, new_b)
                    for s in sigma:  # the σ-SGD of the λ learner (no momentum, no clipping)
                        _masked_set(s, s - sigma_lr * s.grad, mask)
        return self._finish(round_idx, plan, params, buffers, bufs, sigma, keys, sums, first_bad,
                            time.perf_counter() - t0)

    def _finish(self, round_idx, plan, params, buffers, bufs, sigma, keys, sums, first_bad, seconds) -> list[dict]:
        """Judge and sum the round's logs (one device read), then write every state back into its client."""
        cfg, ctx = self.cfg, self.ctx
        E = cfg.local_epochs
        sums, first_bad = (sums.cpu(), first_bad.cpu()) if keys is not None else (None, None)
        round_sums = []
        for i, c in enumerate(self.clients):
            acc: dict[str, float] = {}
            for e in range(E if keys is not None else 0):  # no step at all this round (drop_last, n < B)
                for k, v in StepLogs.of(keys, sums[i * E + e], first_bad[i * E + e]).finish(c.cid, round_idx).items():
                    acc[k] = acc.get(k, 0.0) + v
            round_sums.append(acc)
        records = []
        with torch.no_grad():
            for i, c in enumerate(self.clients):
                for n, p in c.model.named_parameters():
                    p.copy_(params[n][i])
                for n, b in c.model.named_buffers():
                    b.copy_(buffers[n][i])
                if c.optimizer is None or cfg.optim.reset_each_round:
                    c.optimizer = c._make_optimizer()
                for g in c.optimizer.param_groups:
                    g["lr"] = plan.last_lr[i]
                if bufs is not None:
                    for (n, p), buf in zip(c.model.named_parameters(), bufs):
                        c.optimizer.state[p]["momentum_buffer"] = buf[i].clone()
                for own, stacked in zip(c.lam.sigma_state(), sigma):
                    own.copy_(stacked[i])
                c.epochs_done += E
                records.append(c.round_record(ctx, round_idx, plan.last_lr[i], plan.steps[i], round_sums[i],
                                              seconds))
        return records

    # -- helpers ---------------------------------------------------------------------------------------------
    def _momentum(self, name: str) -> Tensor:
        """The stacked momentum buffers of one parameter: the clients' own when their optimizer carries over
        rounds (optim.reset_each_round=false, or a resumed checkpoint), zeros for a fresh optimizer."""
        out = []
        for c in self.clients:
            p = c.model.get_parameter(name)
            st = c.optimizer.state.get(p, {}) if (c.optimizer is not None and not self.cfg.optim.reset_each_round) \
                else {}
            buf = st.get("momentum_buffer")
            out.append(buf.detach().clone() if buf is not None else torch.zeros_like(p))
        return torch.stack(out)

    def _gidx(self, members: list[int], device) -> Tensor:
        key = tuple(members)
        if key not in self._index:  # built once per distinct group: no host-to-device copy per step
            self._index[key] = torch.tensor(members, dtype=torch.long).to(device)
        return self._index[key]

    def _mask(self, active: list[int], K: int) -> Tensor:
        key = ("mask",) + tuple(active)
        if key not in self._index:
            self._index[key] = torch.zeros(K, dtype=torch.bool).index_fill_(0, torch.tensor(active), True).to(
                self.ctx.device)
        return self._index[key]

    def _views(self, plan: RoundPlan, streams: list[RngStreams], members: list[int], t: int) -> tuple[Tensor, Tensor]:
        """Each member's two views, drawn from its own streams as in sequential mode, stacked: K×2B×C×H×W (the
        reference's CE baselines, `loss.ce_input=plain`: one un-augmented view, K×B×C×H×W, as `Client._step`)."""
        ctx = self.ctx
        plain = self.cfg.loss.objective == "ce" and self.cfg.loss.ce_input == "plain"
        views, labels = [], []
        with record_function("flare.augment"):
            for i in members:
                idx = self.clients[i].indices[plan.batch_positions(i, t)]
                xb, yb = ctx.train_x[idx], ctx.train_y[idx]
                if plain:
                    views.append(ctx.plain(xb))
                    labels.append(yb)
                    continue
                with streams[i].active():
                    v1, v2 = ctx.augment(xb)
                views.append(torch.cat([v1, v2]))
                labels.append(torch.cat([yb, yb]))
        return torch.stack(views), torch.stack(labels)


@contextmanager
def _vmap_errors(cfg):
    """A registered loss term or λ provider that cannot run under vmap (a `.item()`, data-dependent control flow)
    fails with the part named and the way out, not with vmap's internals."""
    try:
        yield
    except RuntimeError as e:
        if "vmap" not in str(e) and "Batched" not in str(e):
            raise
        parts = [f"loss.terms.{n}" for n in cfg.loss.terms] + [f"lam.learner={cfg.lam.learner}"]
        raise FlareError(f"client_engine=batched traces one client's loss under torch.vmap, and it failed: {e}. A "
                         f"part of this config is not vmappable (one of: {', '.join(parts)}).",
                         key=f"loss.terms.{next(iter(cfg.loss.terms))}" if cfg.loss.terms else "lam.learner",
                         fix="use client_engine=sequential (or threads), or write the part without .item() and "
                             "data-dependent branches.") from None


def _add_logs(sums: Tensor, first_bad: Tensor, v: Tensor, rows: Tensor, batch: Tensor) -> None:
    """Add one call's step logs (k×n_keys) to their clients' epoch rows, and note where an entry first went
    non-finite (the step within the epoch, as `StepLogs.add` does)."""
    sums.index_add_(0, rows, v)
    cur = first_bad.index_select(0, rows)
    first_bad.index_copy_(0, rows, torch.where(~torch.isfinite(v) & (cur < 0), batch[:, None], cur))


def _masked_set(dst: Tensor, new: Tensor, mask: Tensor | None) -> None:
    """dst ← new for the clients that took part in the step (all when `mask` is None)."""
    if mask is None:
        dst.copy_(new)
    else:
        dst.copy_(torch.where(mask.view((-1,) + (1,) * (dst.dim() - 1)), new, dst))


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
