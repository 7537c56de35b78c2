"""Building the global predictor from the uploads and scoring it (SPEC §4).

Evaluation is batched: one pass over the test set computes every client encoder's features (and, for
IFFI, its features of a noise input) once, and every fusion rule is read off those same tensors. The
rules themselves are small pure functions so that tests can pin them.
"""
from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor

from flare.server.fedavg import average_state_dicts

RULES_PROTOTYPE = ("feature", "iffi", "iffi_reference", "output", "fedavg")
RULES_LINEAR = ("output", "fedavg")


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


def predict_with_prototypes(h: Tensor, G: Tensor) -> Tensor:
    """ŷ = argmax (h/‖h‖) Gᵀ."""
    return (F.normalize(h.float(), dim=1) @ G.float().T).argmax(1)


def fuse_outputs(logits: Tensor, weights: Tensor) -> Tensor:
    """Σ_i w_i softmax(logits_i): B×C."""
    return (weights.to(logits.device)[:, None, None] * logits.float().softmax(-1)).sum(0)


def fedavg_model(models: list[torch.nn.Module], weights: Tensor) -> torch.nn.Module:
    avg = copy.deepcopy(models[0])
    avg.load_state_dict(average_state_dicts([m.state_dict() for m in models], weights))
    return avg.eval()


@torch.no_grad()
def evaluate(models: list[torch.nn.Module], weights: Tensor, G: Tensor | None, test_x: Tensor, test_y: Tensor,
             normalize, *, rules: tuple[str, ...], batch_size: int = 256, noise_seed: int = 0,
             amp_dtype: torch.dtype | None = None, channels_last: bool = False) -> dict:
    """Accuracy of every requested rule plus each client model alone (its own head).

    `normalize` maps a uint8 batch to the model's input. The IFFI noise ε ~ N(0, I) has the input's
    shape and is drawn from its own seeded generator, the same for every round and method.
    """
    device = test_x.device
    for m in models:
        m.eval()
    w = weights.to(device)
    avg = fedavg_model(models, weights) if "fedavg" in rules else None
    need_noise = "iffi" in rules or "iffi_reference" in rules
    gen = torch.Generator(device=device).manual_seed(noise_seed) if need_noise else None
    amp = (torch.autocast(device_type=device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext())
    correct = {r: 0 for r in rules}
    client_correct = torch.zeros(len(models), dtype=torch.long, device=device)
    n = 0
    for s in range(0, test_x.shape[0], batch_size):
        x = normalize(test_x[s:s + batch_size])
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = test_y[s:s + batch_size]
        with amp:
            outs = [m(x) for m in models]
        feats = torch.stack([o[0].float() for o in outs])   # K×B×d
        logits = torch.stack([o[1].float() for o in outs])  # K×B×C
        client_correct += (logits.argmax(-1) == y).sum(1)
        preds: dict[str, Tensor] = {}
        if need_noise:
            eps = torch.randn(x.shape, generator=gen, device=device, dtype=x.dtype)
            if channels_last:
                eps = eps.contiguous(memory_format=torch.channels_last)
            with amp:
                noise_feats = torch.stack([m(eps)[0].float() for m in models])
        if "feature" in rules:
            preds["feature"] = predict_with_prototypes(fuse_features(feats, w), G)
        if "iffi" in rules:
            preds["iffi"] = predict_with_prototypes(fuse_features(feats, iffi_weights(feats, noise_feats)), G)
        if "iffi_reference" in rules:
            preds["iffi_reference"] = predict_with_prototypes(iffi_reference_features(feats, noise_feats), G)
        if "output" in rules:
            preds["output"] = fuse_outputs(logits, w).argmax(1)
        if avg is not None:
            with amp:
                preds["fedavg"] = avg(x)[1].float().argmax(1)
        for r, pr in preds.items():
            correct[r] += (pr == y).sum()
        n += y.numel()
    out = {f"acc_{r}": float(c) / n for r, c in correct.items()}
    out["client_acc"] = (client_correct.float() / n).tolist()
    return out
