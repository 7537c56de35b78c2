"""The K client models on one batch, the way every server reads them: `client_outputs` is the one forward pass
the evaluator, the saved global predictor and BN recalibration run, so a rule scores the same tensors wherever it
is applied; and the aggregation weights the rules (server/rules.py) share.

`eval.bn=batch` (docs/method.md#batchnorm-at-evaluation) reproduces the reference, whose feature and IFFI servers
held the clients in a plain Python list, so `model.eval()` never reached them: the feature rules read a second,
train-mode pass, whose BN buffers are saved before and restored after.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor


def aggregation_weights(sizes: list[int], mode: str) -> Tensor:
    """w_i = n_i / Σn ("size") or 1/K ("uniform")."""
    n = torch.tensor(sizes, dtype=torch.float32)
    return torch.full_like(n, 1.0 / len(sizes)) if mode == "uniform" else n / n.sum()


@dataclass
class ClientOutputs:
    """The K client models' outputs on one test batch: features K×B×d, logits K×B×C and, when a predictor asked
    for them, the features of the IFFI noise input K×B×d (under eval.bn=batch `feats` is the train-mode pass)."""

    feats: Tensor
    logits: Tensor
    noise_feats: Tensor | None = None


def client_outputs(models: list[torch.nn.Module], x: Tensor, *, noise: torch.Generator | None = None,
                   batch_bn: list[dict[str, Tensor]] | None = None, amp=None,
                   channels_last: bool = False, clock: dict | None = None) -> ClientOutputs:
    """Run the K models (eval mode) on the normalised batch `x`. `noise`: also draw the IFFI noise input
    ε ~ N(0, I) of x's shape from this generator and read the models' features of it. `batch_bn`: the buffer
    snapshot of eval.bn=batch — the features (clean and noise) come from a train-mode pass, the logits stay the
    eval-mode pass's. `amp`: the run's autocast context (None: full precision). `clock`: gets the host seconds of
    the clean pass ("clients"), the noise pass ("noise") and the train-mode pass ("batch_bn")."""
    amp = amp if amp is not None else nullcontext()
    tick = Ticker(clock)
    with amp:
        outs = [m(x) for m in models]
    feats = torch.stack([o[0].float() for o in outs])   # K×B×d
    logits = torch.stack([o[1].float() for o in outs])  # K×B×C
    tick("clients")
    eps = noise_feats = None
    if noise is not None:
        eps = torch.randn(x.shape, generator=noise, device=x.device, dtype=x.dtype)
        if channels_last:
            eps = eps.contiguous(memory_format=torch.channels_last)
        if batch_bn is None:
            with amp:
                noise_feats = torch.stack([m(eps)[0].float() for m in models])
        tick("noise")
    if batch_bn is not None:  # the reference's train-mode BN: the clean batch and the noise batch, each on its own
        with batch_statistics(models, batch_bn), amp:
            feats = torch.stack([m(x)[0].float() for m in models])
            if eps is not None:
                noise_feats = torch.stack([m(eps)[0].float() for m in models])
        tick("batch_bn")
    return ClientOutputs(feats, logits, noise_feats)


class Ticker:
    """Adds the seconds since the last tick to `clock[part]` (nothing when `clock` is None)."""

    def __init__(self, clock: dict | None):
        self.clock, self.t = clock, time.perf_counter()

    def __call__(self, part: str) -> None:
        if self.clock is not None:
            now = time.perf_counter()
            self.clock[part] = self.clock.get(part, 0.0) + now - self.t
            self.t = now


@contextmanager
def batch_statistics(models: list[torch.nn.Module], saved: list[dict[str, Tensor]]):
    """Inside: the models in train mode (BN normalises with each batch's statistics). On exit: every buffer
    restored bit for bit from `saved` (`snapshot_buffers`, taken once for many batches), and eval mode."""
    try:
        for m in models:
            m.train()
        yield
    finally:
        for m, buf in zip(models, saved):
            m.eval()
            for k, b in m.named_buffers():
                b.copy_(buf[k])


def snapshot_buffers(models: list[torch.nn.Module]) -> list[dict[str, Tensor]]:
    return [{k: b.detach().clone() for k, b in m.named_buffers()} for m in models]
