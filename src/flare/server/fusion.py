"""Building the global predictor from the uploads and scoring it (SPEC §4).

Evaluation is batched: one pass over the test set computes every client encoder's features (and, for
IFFI, its features of a noise input) once, and every fusion rule is read off those same tensors. The
rules themselves are small pure functions so that tests can pin them.

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
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor

from flare.server.fedavg import average_state_dicts

RULES_PROTOTYPE = ("feature", "iffi", "iffi_reference", "output", "fedavg")
RULES_LINEAR = ("output", "fedavg")
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


def predict_with_prototypes(h: Tensor, G: Tensor) -> Tensor:
    """ŷ = argmax (h/‖h‖) Gᵀ."""
    return prototype_scores(h, G).argmax(1)


def fuse_outputs(logits: Tensor, weights: Tensor, mode: str = "softmax") -> Tensor:
    """Σ_i w_i softmax(logits_i) (`softmax`), or Σ_i w_i logits_i (`logits`: the reference's Ensemble): B×C."""
    x = logits.float().softmax(-1) if mode == "softmax" else logits.float()
    return (weights.to(logits.device)[:, None, None] * x).sum(0)


def rule_scores(rule: str, feats: Tensor, logits: Tensor, weights: Tensor, G: Tensor | None,
                noise_feats: Tensor | None = None, ensemble: str = "softmax") -> Tensor:
    """B×C scores of one server rule (SPEC §4) from the client models' outputs on a batch — the one dispatch
    used by the evaluation and by the saved global predictor. `feats` K×B×d and `logits` K×B×C are the K
    models' outputs; for `fedavg` they are the single averaged model's (K = 1); IFFI rules need the models'
    features of the noise input, `noise_feats` K×B×d."""
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


@torch.no_grad()
def evaluate(models: list[torch.nn.Module], weights: Tensor, G: Tensor | None, test_x: Tensor, test_y: Tensor,
             normalize, *, rules: tuple[str, ...], batch_size: int = 256, noise_seed: int = 0,
             amp_dtype: torch.dtype | None = None, channels_last: bool = False, bn: str = "running",
             shuffle_seed: int = 0, ensemble: str = "softmax", fedavg_buffers: str = "average") -> dict:
    """Accuracy of every requested rule plus each client model alone (its own head).

    `normalize` maps a uint8 batch to the model's input. The IFFI noise ε ~ N(0, I) has the input's
    shape and is drawn from its own seeded generator, the same for every round and method. `bn="batch"`: see
    the module docstring (the test order is then the permutation seeded by `shuffle_seed`).
    """
    device = test_x.device
    for m in models:
        m.eval()
    w = weights.to(device)
    avg = fedavg_model(models, weights, fedavg_buffers) if "fedavg" in rules else None
    need_noise = "iffi" in rules or "iffi_reference" in rules
    gen = torch.Generator(device=device).manual_seed(noise_seed) if need_noise else None
    amp = (torch.autocast(device_type=device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext())
    batch_rules = [r for r in rules if r in FEATURE_RULES] if bn == "batch" else []
    order = (torch.randperm(test_x.shape[0], generator=torch.Generator().manual_seed(shuffle_seed)).to(device)
             if batch_rules else None)
    saved = snapshot_buffers(models) if batch_rules else None
    correct = {r: 0 for r in rules}
    client_correct = torch.zeros(len(models), dtype=torch.long, device=device)
    n = 0
    for s in range(0, test_x.shape[0], batch_size):
        ix = order[s:s + batch_size] if order is not None else slice(s, s + batch_size)
        x = normalize(test_x[ix])
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = test_y[ix]
        with amp:
            outs = [m(x) for m in models]
        feats = torch.stack([o[0].float() for o in outs])   # K×B×d
        logits = torch.stack([o[1].float() for o in outs])  # K×B×C
        client_correct += (logits.argmax(-1) == y).sum(1)
        noise_feats = None
        eps = None
        if need_noise:
            eps = torch.randn(x.shape, generator=gen, device=device, dtype=x.dtype)
            if channels_last:
                eps = eps.contiguous(memory_format=torch.channels_last)
            if not batch_rules:
                with amp:
                    noise_feats = torch.stack([m(eps)[0].float() for m in models])
        if batch_rules:  # the reference's train-mode BN: the clean batch and the noise batch, each on its own
            with batch_statistics(models, saved), amp:
                feats = torch.stack([m(x)[0].float() for m in models])
                if eps is not None:
                    noise_feats = torch.stack([m(eps)[0].float() for m in models])
        for r in rules:
            if r == "fedavg":
                with amp:
                    avg_logits = avg(x)[1].float()[None]
                scores = rule_scores(r, None, avg_logits, w, G)
            else:
                scores = rule_scores(r, feats, logits, w, G, noise_feats, ensemble)
            correct[r] += (scores.argmax(1) == y).sum()
        n += y.numel()
    out = {f"acc_{r}": float(c) / n for r, c in correct.items()}
    out["client_acc"] = (client_correct.float() / n).tolist()
    return out
