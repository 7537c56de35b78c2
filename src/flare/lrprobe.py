"""LR probe (docs/method.md#lr-probe): the largest Hessian eigenvalue L of the local loss at the initial model and the
stability bound η_crit = 2/L of (non-momentum) gradient descent on a quadratic with that curvature.

`flare lr-probe` builds the run exactly like the runner (data, subsets, partition, seeded global init, anchors),
takes one client's data (or the whole training set with `--all-data`), draws `--batches` fixed batches with fixed
augmentation seeds, and runs power iteration on Hessian–vector products (double backward) of their mean loss: the
weights' local loss at p = 0 with the client's initial λ, weighed by its λ provider's `probe_loss`, with the extra
terms of `loss.terms`; the contrast extensions are left out (the memory bank is empty at the start, the public bank
needs the server's teacher). BatchNorm runs in training mode, as in local training."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from flare.client.lam import LamStep, initial_lambda, lam_facts
from flare.client.step import local_loss
from flare.client.terms.extra import uses_params
from flare.config import Config
from flare.config.architectures import server_architecture
from flare.errors import FlareError
from flare.progress import Counter
from flare.registry import LAM_PROVIDERS
from flare.rng import derived_seed
from flare.data.prepare import split
from flare.setup import ServerSetup


@dataclass
class EigenEstimate:
    value: float                       # the estimated largest eigenvalue
    history: list[float] = field(default_factory=list)  # Rayleigh quotient per iteration
    rel_change: float = float("nan")  # |last − previous| / |last|: a convergence indicator


def _dot(a: list[Tensor], b: list[Tensor]) -> Tensor:
    return sum((x * y).sum() for x, y in zip(a, b))


def hvp_fn(loss_fns: list[Callable[[], Tensor]], params: list[Tensor]) -> Callable[[list[Tensor]], list[Tensor]]:
    """v ↦ H v for the mean of the losses (each closure recomputes one batch's loss; double backward)."""

    def hvp(v: list[Tensor]) -> list[Tensor]:
        out = [torch.zeros_like(p) for p in params]
        for fn in loss_fns:
            grads = torch.autograd.grad(fn(), params, create_graph=True, allow_unused=True)
            pairs = [(g, vi) for g, vi in zip(grads, v) if g is not None]
            if not pairs:
                continue
            gv = sum((g * vi).sum() for g, vi in pairs)
            hv = torch.autograd.grad(gv, params, allow_unused=True)
            for o, h in zip(out, hv):
                if h is not None:
                    o.add_(h.detach(), alpha=1.0 / len(loss_fns))
        return out

    return hvp


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


def power_iteration(hvp: Callable[[list[Tensor]], list[Tensor]], params: list[Tensor], iters: int = 20,
                    seed: int = 0, shift: float = 0.0, tol: float = 0.0,
                    on_iter: Callable[[float], None] | None = None) -> EigenEstimate:
    """Dominant eigenvalue of (H − shift·I) by power iteration from a seeded random unit vector.

    Stops after `iters` Hessian–vector products, or earlier once the Rayleigh quotient changed by less than
    `tol` (relative) in each of the last two iterations: one HVP of a full-width ResNet costs seconds to
    minutes on a CPU, and the quotient usually settles in well under 20."""
    g = torch.Generator().manual_seed(seed)
    v = [torch.randn(p.shape, generator=g).to(p.device, p.dtype) for p in params]
    n = math.sqrt(float(_dot(v, v)))
    v = [x / n for x in v]
    hist: list[float] = []
    for _ in range(max(1, iters)):
        hv = hvp(v)
        if shift:
            hv = [h - shift * x for h, x in zip(hv, v)]
        hist.append(float(_dot(v, hv)))  # Rayleigh quotient (v has unit norm)
        if on_iter is not None:
            on_iter(hist[-1])
        norm = math.sqrt(float(_dot(hv, hv)))
        if norm == 0 or not math.isfinite(norm):
            break
        v = [h / norm for h in hv]
        if tol > 0 and len(hist) >= 3 and all(_rel(hist[-i], hist[-i - 1]) < tol for i in (1, 2)):
            break
    return EigenEstimate(hist[-1], hist, _rel(hist[-1], hist[-2]) if len(hist) > 1 else float("nan"))


def top_hessian_eigenvalue(loss_fns: list[Callable[[], Tensor]], params: list[Tensor], iters: int = 20,
                           seed: int = 0, tol: float = 0.0,
                           on_iter: Callable[[float], None] | None = None) -> EigenEstimate:
    """The largest eigenvalue L of the Hessian of mean(loss_fns) w.r.t. params."""
    params = [p for p in params if p.requires_grad]
    hvp = hvp_fn(loss_fns, params)
    est = power_iteration(hvp, params, iters, seed, tol=tol, on_iter=on_iter)
    if est.value < 0:  # the dominant eigenvalue is negative: look for the largest one above it
        shifted = power_iteration(hvp, params, iters, seed + 1, shift=est.value, tol=tol, on_iter=on_iter)
        est = EigenEstimate(shifted.value + est.value, [h + est.value for h in shifted.history], shifted.rel_change)
    return est


# One HVP costs about five forward passes, so on a CPU the probe's price is set by its images (ResNet-18 at full
# width: ~0.17 s per image per HVP on two cores). What the cap changes in L: docs/alignment.md#lr-probe.
PROBE_BATCH_CAP = 64


def probe(cfg: Config, client: int = 0, all_data: bool = False, batches: int = 2, iters: int = 30,
          batch_size: int | None = None, tol: float = 1e-3, progress: bool = True) -> dict:
    """Build the run's data and initial model like the runner and estimate L at the initial model.

    `batch_size=None` probes batches of min(cfg.batch_size, PROBE_BATCH_CAP); `iters` is the most power
    iterations, `tol` the relative change that ends them early (0 runs all of them)."""
    if batches < 1 or iters < 1:
        raise FlareError("--batches and --iters must be at least 1.", key="--batches" if batches < 1 else "--iters")
    if batch_size is not None and batch_size < 1:
        raise FlareError(f"--batch-size must be at least 1, got {batch_size}.", key="--batch-size")
    if not 0 <= tol < 1:
        raise FlareError(f"--tol must be in [0, 1), got {tol}.", key="--tol")
    if not all_data and not 0 <= client < cfg.num_clients:
        raise FlareError(f"--client {client} is not a client of this run (0..{cfg.num_clients - 1}).", key="--client")
    server = ServerSetup.build(cfg, bank=False)  # the run's data, seeded global init, anchors and augmentation
    device, augment = server.backend.device, server.augment
    data = server.take_data()
    part = split(cfg, data.train_y, data.num_classes)
    if all_data:
        ix = torch.arange(len(data.train_y))
        q = torch.bincount(data.train_y, minlength=data.num_classes).double()
        q = q[q > 0] / q.sum()
        ent = float(-(q * q.log2()).sum()) / math.log2(data.num_classes) if data.num_classes > 1 else 0.0
        who = "the whole training set"
    else:
        ix = torch.as_tensor(part.client_indices[client])
        ent = part.report()["clients"][client]["normalized_entropy"]
        who = f"client {client}"
        if len(ix) == 0:
            raise FlareError(f"client {client} holds no samples under this partition.", key="--client",
                             fix="probe another client or use --all-data.")
    # the probed client's own architecture (its seeded init); the whole training set: the server architecture's
    model, anchors = (server.template if all_data else server.client_init(client)), server.anchors
    arch = server_architecture(cfg) if all_data else server.architectures[client]
    model.train()
    lam = initial_lambda(cfg, ent) if anchors is not None else 0.0
    provider = LAM_PROVIDERS.create(cfg.lam.learner, lam_facts(cfg, ent, device),
                                    cfg.lam.options)  # the client's λ provider at p = 0 (`probe_loss`)

    order = torch.Generator().manual_seed(derived_seed(cfg.seed, 31337, 0))
    perm = ix[torch.randperm(len(ix), generator=order)]
    B = batch_size if batch_size is not None else min(cfg.batch_size, PROBE_BATCH_CAP)
    nb = min(batches, math.ceil(len(perm) / B))
    fixed = []
    with torch.random.fork_rng(devices=[]):  # the CPU generator comes back as it was
        for b in range(nb):
            sel = perm[b * B:(b + 1) * B]
            torch.manual_seed(derived_seed(cfg.seed, 31337, 1, b))  # fixed augmentation per batch
            v1, v2 = augment(data.train_x[sel].to(device))
            yb = data.train_y[sel].to(device)
            fixed.append((torch.cat([v1, v2]).detach(), torch.cat([yb, yb])))

    def weigh(base: Tensor, align: Tensor | None) -> LamStep:  # the weights' loss at p = 0, no σ step
        return LamStep(provider.probe_loss(base, align), None)

    start = ({n: q.detach().clone() for n, q in model.named_parameters() if q.requires_grad}
             if uses_params(cfg.loss) else None)  # the probe's model is the start (FedProx's w_global)

    def make_loss(imgs: Tensor, y2: Tensor) -> Callable[[], Tensor]:
        def loss() -> Tensor:
            feat, logits = model(imgs)
            params = {n: q for n, q in model.named_parameters() if n in start} if start is not None else None
            return local_loss(cfg, feat, logits, y2, model.prototypes, target=anchors, weigh=weigh, params=params,
                              start=start).total()

        return loss

    bar = Counter(iters, desc="lr-probe", unit="Hessian-vector product", disable=not progress)

    def tick(rq: float) -> None:
        bar.set_postfix_str(f"L={rq:.5g}")
        bar.update(1)

    with bar:
        est = top_hessian_eigenvalue([make_loss(i, y) for i, y in fixed], list(model.parameters()), iters,
                                     seed=cfg.seed, tol=tol, on_iter=tick)
    L = est.value
    return {"L": L, "eta_crit": 2.0 / L if L > 0 else float("inf"), "lr": cfg.base_lr, "history": est.history,
            "rel_change": est.rel_change, "who": who, "samples": int(len(ix)), "batches": nb, "batch_size": B,
            "images": sum(len(y) // 2 for _, y in fixed), "config_batch_size": cfg.batch_size,
            "iters": len(est.history), "max_iters": iters, "tol": tol, "lambda": lam, "model": arch.name,
            "width": arch.width}


def format_probe(cfg: Config, r: dict) -> str:
    lines = [
        f"lr-probe: {cfg.dataset.name}, {r['who']} ({r['samples']} samples), {r['model']} "
        f"(width {r['width']}), objective {cfg.loss.objective}"
        + (f" + {r['lambda']:.4g}·L_align" if r["lambda"] else "")
        + f"; {r['batches']} fixed batch(es) of {r['batch_size']} ({r['images']} images)"
        + (f" (config batch_size {r['config_batch_size']}; --batch-size to change)"
           if r["batch_size"] != r["config_batch_size"] else "")
        + f", {r['iters']} power iterations"
        + (f" (stopped at relative change < {r['tol']:g})" if r["iters"] < r["max_iters"] else ""),
        f"L = {r['L']:.6g}    (largest Hessian eigenvalue; last relative change {r['rel_change']:.2e})",
        f"eta_crit = 2/L = {r['eta_crit']:.6g}",
        f"lr = {r['lr']:.6g}    (configured peak local lr"
        + (", linear scaling applied" if cfg.optim.linear_scaling else "") + ")"]
    if r["lr"] > r["eta_crit"]:
        lines.append(f"WARNING: lr = {r['lr']:.6g} exceeds eta_crit = {r['eta_crit']:.6g}: gradient descent is "
                     "unstable along the sharpest direction at the initial model (momentum and clipping change "
                     "the bound; the first steps are the risky ones).")
    return "\n".join(lines)
