"""The global predictor a federated run ends with, saved and loaded without pickles.

`predictor.pt` holds tensors only (`torch.load(..., weights_only=True)` reads it): the state dict of every
client encoder that took part in the last round (or, for the `fedavg` rule, the one averaged state), the
aggregation weights and the global prototypes G. `predictor.json` says how to rebuild and use it: the
rule, the model (name, width, head, channels, classes, feature dimension), the input size, the
normalisation statistics, the class names, which clients it holds, and the accuracy the server measured.

    from flare.flower.predictor import load_predictor
    p = load_predictor("runs/fed")          # a torch.nn.Module
    scores = p(x_uint8)                     # B×C; p.predict(x_uint8) → labels
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

FORMAT = 1


class GlobalPredictor(nn.Module):
    """Applies one server rule (SPEC §4) to uint8 images: `feature`, `iffi`, `iffi_reference`, `output` or
    `fedavg`. The IFFI noise inputs are drawn from a generator seeded with `noise_seed` on every call."""

    def __init__(self, rule: str, models: list[nn.Module], weights: Tensor, G: Tensor | None,
                 mean, std, noise_seed: int = 0):
        super().__init__()
        self.rule = rule
        self.models = nn.ModuleList(models)
        self.register_buffer("weights", weights.float())
        self.register_buffer("G", G.float() if G is not None else None)
        self.mean, self.std, self.noise_seed = tuple(mean), tuple(std), noise_seed

    @torch.no_grad()
    def forward(self, x_uint8: Tensor) -> Tensor:
        from flare.data.augment import normalize
        from flare.server.fusion import fuse_features, fuse_outputs, iffi_reference_features, iffi_weights

        self.eval()
        x = normalize(x_uint8.to(self.weights.device), self.mean, self.std)
        if self.rule == "fedavg":
            return self.models[0](x)[1].float()
        outs = [m(x) for m in self.models]
        feats = torch.stack([o[0].float() for o in outs])
        if self.rule == "output":
            return fuse_outputs(torch.stack([o[1].float() for o in outs]), self.weights)
        if self.rule == "feature":
            h = fuse_features(feats, self.weights)
        else:
            gen = torch.Generator(device=x.device).manual_seed(self.noise_seed)
            eps = torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
            noise = torch.stack([m(eps)[0].float() for m in self.models])
            h = (fuse_features(feats, iffi_weights(feats, noise)) if self.rule == "iffi"
                 else iffi_reference_features(feats, noise))
        return torch.nn.functional.normalize(h.float(), dim=1) @ self.G.float().T

    def predict(self, x_uint8: Tensor) -> Tensor:
        return self(x_uint8).argmax(1)


def save_predictor(out: str | Path, cfg, meta, uploads, models, record: dict, anchors, template) -> Path:
    """Write predictor.pt and predictor.json for the run's primary rule from the last round's uploads."""
    from flare.client.trainer import derived_seed
    from flare.runner import atomic_torch_save, atomic_write_text, primary_rule
    from flare.server.fedavg import average_state_dicts
    from flare.server.fusion import aggregation_weights
    from flare.server.protos import global_prototypes

    out = Path(out)
    rule = primary_rule(cfg)
    weights = aggregation_weights([u.num_samples for u in uploads], cfg.server.weights)
    G = None
    protos = [u.prototypes for u in uploads if u.prototypes is not None]
    if protos:
        G, _ = global_prototypes(protos, cfg.server, anchors, derived_seed(cfg.seed, record["round"], 99))
        G = G.detach().cpu()
    if rule == "fedavg":
        states = {"avg": average_state_dicts([{k: v.cpu() for k, v in u.state.items()} for u in uploads], weights)}
    else:
        states = {str(u.client): {k: v.detach().cpu() for k, v in u.state.items()} for u in uploads}
    atomic_torch_save({"format": FORMAT, "states": states, "weights": weights, "G": G}, out / "predictor.pt")
    info = {
        "format": FORMAT, "rule": rule, "method": cfg.method, "seed": cfg.seed, "round": record["round"],
        "accuracy": record.get("acc"), "accuracies": {k: v for k, v in record.items() if k.startswith("acc_")},
        "clients": [u.client for u in uploads], "weights": weights.tolist(),
        "model": {"name": cfg.model.name, "width": cfg.model.width, "head": cfg.head,
                  "in_channels": meta.in_channels, "num_classes": meta.num_classes,
                  "feature_dim": int(template.feature_dim)},
        "image_size": meta.image_size, "mean": meta.mean, "std": meta.std, "classes": meta.classes,
        "dataset": cfg.dataset.name, "noise_seed": cfg.eval.noise_seed, "states": list(states),
    }
    atomic_write_text(out / "predictor.json", json.dumps(info, indent=1))
    return out / "predictor.pt"


def load_predictor(run_dir: str | Path, device: str | torch.device = "cpu") -> GlobalPredictor:
    from flare.models import create_model

    d = Path(run_dir)
    info = json.loads((d / "predictor.json").read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{d / 'predictor.json'}: format {info.get('format')} is not {FORMAT}")
    blob = torch.load(d / "predictor.pt", map_location=device, weights_only=True)
    m = info["model"]
    models = []
    for key in info["states"]:
        net = create_model(m["name"], m["in_channels"], m["num_classes"], m["width"], head=m["head"])
        net.load_state_dict(blob["states"][key])
        models.append(net.to(device).eval())
    return GlobalPredictor(info["rule"], models, blob["weights"].to(device),
                           blob["G"].to(device) if blob["G"] is not None else None, info["mean"], info["std"],
                           info.get("noise_seed", 0)).to(device)
