"""What the distilling servers share (FedDF in distill.py, DENSE and Co-Boosting in datafree.py, BN recalibration in
bnrecal.py): the public-slice requirement, seeded streams, a fresh student of the run's architecture, the weighted
ensemble's logits, the distillation loss, crop-and-flip augmentation drawn from a private generator, the run's
normalisation as an affine map, and the cost logs. Registers nothing.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flare.config import Config
from flare.errors import FlareError
from flare.models import create_architecture
from flare.rng import RngStreams, derived_seed

BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _no_public(name: str) -> FlareError:
    return FlareError(f"server strategy '{name}' trains on the server's unlabeled public slice, but "
                      "dataset.public_size is 0.", key="dataset.public_size",
                      fix="set dataset.public_size to the number of training samples the server holds out "
                          "(e.g. dataset.public_size=1000), or leave the strategy out of eval.rules.")


def require_public(cfg: Config, name: str) -> None:
    """A server that learns on the unlabeled public slice refuses a run without one (FlareError → exit 2)."""
    if cfg.dataset.public_size <= 0:
        raise _no_public(name)


def public_slice(ctx, name: str) -> Tensor:
    """ctx.public_x (uint8), or the same FlareError when a caller built the context without it."""
    if ctx.public_x is None or ctx.public_x.shape[0] == 0:
        raise _no_public(name)
    return ctx.public_x


def generator(seed: int, r: int, tag: int, *more: int) -> torch.Generator:
    """A CPU generator seeded from (run seed, round, strategy tag, …): never the global RNG."""
    return torch.Generator().manual_seed(derived_seed(seed, r, tag, *more))


def passes(n: int, size: int, gen: torch.Generator):
    """One shuffled pass over n samples in batches (a 1-sample leftover is skipped: train-mode BatchNorm)."""
    perm = torch.randperm(n, generator=gen)
    return [perm[s:s + size] for s in range(0, n, size) if min(size, n - s) > 1 or n == 1]


def private_stream(seed: int):
    """A block whose draws from torch's default CPU generator (module constructors' init) come from a private stream
    seeded with `seed`; the global state is left as it was."""
    return RngStreams([torch.default_generator], [seed]).active()


def fresh_model(facts, in_channels: int, num_classes: int, seed: int, device: torch.device) -> nn.Module:
    """A newly initialised model of the server architecture (`server.model`, by default the most common client
    architecture) and the run's head (`facts`: the strategy's StrategyFacts); it starts from a checkpoint only where
    `server.model` names one. create_model's init draws from torch's default generator, so it runs inside a private
    stream seeded with `seed`: the global state is left as it was."""
    with private_stream(seed):
        model = create_architecture(facts.server_architecture, in_channels, num_classes, facts.head,
                                    facts.feature_dim, checkpoint=facts.server_checkpoint)
    return model.to(device)


@contextmanager
def eval_mode(models: list[nn.Module]):
    """The client models in eval mode inside (the teachers: their BatchNorm statistics must not move), every
    module's mode as it was on exit. (The in-process runner hands the live client models over in train mode.)"""
    saved = [(mod, mod.training) for m in models for mod in m.modules()]
    try:
        for m in models:
            m.eval()
        yield
    finally:
        for mod, flag in saved:
            mod.training = flag


def client_logits(models: list[nn.Module], x: Tensor) -> Tensor:
    return torch.stack([m(x)[1].float() for m in models])  # K×B×C


def kd_loss(student: Tensor, teacher: Tensor, T: float, *, probs: bool = False, scale: bool = True,
            reduction: str = "batchmean") -> Tensor:
    """KL(softmax(teacher/T) ‖ softmax(student/T)) (× T² with `scale`, the data-free codes' KLDiv; FedDF's
    divergence has no T²). `probs`: `teacher` already holds probabilities (FedDF's avg_probs)."""
    p = teacher if probs else F.softmax(teacher / T, dim=1)
    out = F.kl_div(F.log_softmax(student / T, dim=1), p, reduction=reduction)
    return out * (T * T) if scale else out


def crop_flip(x: Tensor, gen: torch.Generator, pad: int = 4) -> Tensor:
    """Per image: a random crop of the zero-padded image back to its size (torchvision's RandomCrop(size,
    padding=pad)) and a horizontal flip with p = 0.5, drawn from `gen`; uint8 or float (differentiable)."""
    B, _, H, W = x.shape
    oy = torch.randint(0, 2 * pad + 1, (B,), generator=gen).to(x.device)
    ox = torch.randint(0, 2 * pad + 1, (B,), generator=gen).to(x.device)
    xp = F.pad(x, (pad, pad, pad, pad))
    rows = (oy[:, None] + torch.arange(H, device=x.device))[:, None, :, None]
    cols = (ox[:, None] + torch.arange(W, device=x.device))[:, None, None, :]
    b = torch.arange(B, device=x.device)[:, None, None, None]
    c = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    x = xp[b, c, rows, cols]
    f = (torch.rand(B, generator=gen) < 0.5).to(x.device)[:, None, None, None]
    return torch.where(f, x.flip(3), x)


def affine_normalizer(normalize: Callable[[Tensor], Tensor], channels: int,
                      device: torch.device) -> Callable[[Tensor], Tensor]:
    """The run's uint8 → input map as the affine map it is, for float images in [0, 1] (a generator's output):
    x ↦ n(0) + (n(255) − n(0))·x, with n = `normalize` probed at the two ends of the uint8 range."""
    lo = normalize(torch.zeros(1, channels, 1, 1, dtype=torch.uint8, device=device)).float()
    hi = normalize(torch.full((1, channels, 1, 1), 255, dtype=torch.uint8, device=device)).float()
    return lambda x01: lo + (hi - lo) * x01


def to_uint8(x01: Tensor) -> Tensor:
    """[0, 1] floats → uint8 (the reference codes stored their synthetic images as PNG files)."""
    return (x01.detach().clamp(0, 1) * 255).round().to(torch.uint8)


class Cost:
    """Wall-clock seconds and, on a GPU, the peak memory of one build: the `seconds` / `gpu_peak_mb` logs."""

    def __init__(self, device: torch.device):
        self.device, self.t0 = device, time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def logs(self) -> dict[str, float]:
        out = {"seconds": time.perf_counter() - self.t0}
        if self.device.type == "cuda":
            out["gpu_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 2 ** 20
        return out


@torch.no_grad()
def agreement(student: nn.Module, models: list[nn.Module], weights: Tensor, x: Tensor, batch: int = 256) -> float:
    """The share of inputs (normalised) on which the student's argmax equals the weighted ensemble's: Σ_k w_k
    logits_k(x), the reference codes' `avg_logits` / Ensemble."""
    w, hits = weights.to(x.device, torch.float32), 0
    for xb in x.split(batch):
        mine = student(xb)[1].argmax(1)
        hits += int((mine == sum(w[k] * m(xb)[1].float() for k, m in enumerate(models)).argmax(1)).sum())
    return hits / max(1, x.shape[0])
