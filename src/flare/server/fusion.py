"""The server's rules (docs/method.md#built-in-rules) as small pure functions, so that tests can pin them; the
strategies that use them are server/strategy.py, and the one batched test pass that scores them all is
server/evaluator.py.

BatchNorm at evaluation (`eval.bn`). `running` evaluates every model in eval mode. `batch` reproduces the
reference: its feature and IFFI servers held the clients in a plain Python list, so `model.eval()` never reached
them and every encoder normalised each (shuffled, 256-image) test batch — and IFFI's noise batch — with that
batch's own statistics. Under `batch` the test order is a seeded permutation (new every round), the feature rules
read a second, train-mode pass, and the output/FedAvg rules and the per-client accuracies keep the eval-mode pass
(the reference's output server and baselines ran in eval mode). Train-mode passes update BN buffers; they are
saved before and restored after, so the clients' running statistics are never touched.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from flare.server.fedavg import average_state_dicts

FEATURE_RULES = ("feature", "iffi", "iffi_reference")  # the rules eval.bn=batch evaluates with batch statistics


def aggregation_weights(sizes: list[int], mode: str) -> Tensor:
    """w_i = n_i / Σn ("size") or 1/K ("uniform")."""
    n = torch.tensor(sizes, dtype=torch.float32)
    if mode == "uniform":
        return torch.full_like(n, 1.0 / len(sizes))
    return n / n.sum()


def fuse_features(feats: Tensor, weights: Tensor) -> Tensor:
    """feats K×B×d, weights K (global) or K×B (per sample) → h = Σ_i w_i f_i (B×d)."""
    w = weights if weights.dim() == 2 else weights[:, None].expand(feats.shape[:2])
    return (w[..., None].to(feats.dtype) * feats).sum(0)


def informativeness(feats: Tensor, noise_feats: Tensor) -> Tensor:
    """u_i(x) = 1 − cos(f_i(x), f_i(ε)): K×B."""
    return 1.0 - F.cosine_similarity(feats, noise_feats, dim=-1)


def iffi_weights(feats: Tensor, noise_feats: Tensor) -> Tensor:
    """Per-model, per-sample weights u_i(x) / Σ_j u_j(x) (K×B)."""
    u = informativeness(feats, noise_feats)
    return u / u.sum(0, keepdim=True).clamp_min(1e-12)


def iffi_reference_features(feats: Tensor, noise_feats: Tensor) -> Tensor:
    """The seeds' code: the mean of u_i over models scales the *plain sum* of features. The scalar per
    sample is cancelled by the normalisation before the prototype match, so this is exactly uniform
    feature fusion — kept to reproduce the seeds' "IFFI" numbers."""
    u_mean = informativeness(feats, noise_feats).mean(0)  # B
    return u_mean[:, None] * feats.sum(0)


def prototype_scores(h: Tensor, G: Tensor) -> Tensor:
    """(h/‖h‖) Gᵀ: B×C; the prediction is its argmax."""
    return F.normalize(h.float(), dim=1) @ G.float().T


def fuse_outputs(logits: Tensor, weights: Tensor, mode: str = "softmax") -> Tensor:
    """Σ_i w_i softmax(logits_i) (`softmax`), or Σ_i w_i logits_i (`logits`: the reference's Ensemble): B×C."""
    x = logits.float().softmax(-1) if mode == "softmax" else logits.float()
    return (weights.to(logits.device)[:, None, None] * x).sum(0)


def rule_scores(rule: str, feats: Tensor, logits: Tensor, weights: Tensor, G: Tensor | None,
                noise_feats: Tensor | None = None, ensemble: str = "softmax") -> Tensor:
    """B×C scores of one server rule (docs/method.md#built-in-rules) from the client models' outputs on a batch — the
    one dispatch used by the evaluation and by the saved global predictor. `feats` K×B×d and `logits` K×B×C are the K
    models' outputs; for `fedavg` they are the single averaged model's (K = 1); IFFI rules need the models' features
    of the noise input, `noise_feats` K×B×d."""
    if rule == "fedavg":
        return logits[0]
    if rule == "output":
        return fuse_outputs(logits, weights, ensemble)
    if rule == "feature":
        h = fuse_features(feats, weights)
    elif rule == "iffi":
        h = fuse_features(feats, iffi_weights(feats, noise_feats))
    elif rule == "iffi_reference":
        h = iffi_reference_features(feats, noise_feats)
    else:
        raise ValueError(f"unknown server rule {rule!r}")
    return prototype_scores(h, G)


def fedavg_model(models: list[torch.nn.Module], weights: Tensor, buffers: str = "average") -> torch.nn.Module:
    """The one-shot FedAvg model; `buffers="first"` keeps the first model's BN buffers (parameters only averaged)."""
    avg = copy.deepcopy(models[0])
    params = {k for k, _ in avg.named_parameters()} if buffers == "first" else None
    avg.load_state_dict(average_state_dicts([m.state_dict() for m in models], weights, only=params))
    return avg.eval()


@contextmanager
def batch_statistics(models: list[torch.nn.Module], saved: list[dict[str, Tensor]] | None = None):
    """Inside: the models in train mode (BN normalises with each batch's statistics). On exit: every buffer
    (running statistics, num_batches_tracked) restored bit for bit, and eval mode — so the eval-mode passes of
    the next batch see the clients' own running statistics. `saved`: a snapshot taken once for many batches
    (the restore makes it the same every time), instead of cloning every buffer per batch."""
    saved = saved if saved is not None else snapshot_buffers(models)
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
