"""The global predictor a federated run ends with, saved and loaded without pickles.

`predictor.pt` holds tensors only (`torch.load(..., weights_only=True)` reads it): the state dict of every
client encoder that took part in the last round (or, for the `fedavg` rule, the one averaged state), the
aggregation weights and the global prototypes G. `predictor.json` says how to rebuild and use it: the
rule, the model (name, width, head, channels, classes, feature dimension), the input size, the
normalisation statistics, the class names, which clients it holds, and the accuracy the server measured.
It applies the run's evaluation transform (`augment.input_scaling`) and output fusion (`server.ensemble`), and
always normalises with running BN statistics (eval mode), also for runs evaluated with `eval.bn=batch`: a
deployed predictor should not depend on which images share its batch.

    from flare.flower.predictor import load_predictor
    p = load_predictor("runs/fed")          # a torch.nn.Module
    scores = p(x_uint8)                     # B×C; p.predict(x_uint8) → labels
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from flare.config import Config
from flare.data.augment import normalize
from flare.models import create_model
from flare.rundir import RunDir
from flare.server.fedavg import average_state_dicts
from flare.server.fusion import rule_scores
from flare.server.strategy import ModelPredictor
from flare.server.upload import Upload
from flare.server.rounds import primary_rule
from flare.setup import DataMeta, scaling

FORMAT = 1


BUILT_IN = ("feature", "iffi", "iffi_reference", "output", "fedavg")


class GlobalPredictor(nn.Module):
    """Applies one server rule (docs/method.md#server-rules) to uint8 images: `feature`, `iffi`, `iffi_reference`,
    `output` or `fedavg` — or `model`: the one model a model-building strategy (a plugin's, OTFusion, FedLPA …) built,
    scored by its logits. The IFFI noise inputs are drawn from a generator seeded with `noise_seed` on every call."""

    def __init__(self, rule: str, models: list[nn.Module], weights: Tensor, G: Tensor | None,
                 mean, std, noise_seed: int = 0, ensemble: str = "softmax"):
        super().__init__()
        self.rule, self.ensemble = rule, ensemble
        self.models = nn.ModuleList(models)
        self.register_buffer("weights", weights.float())
        self.register_buffer("G", G.float() if G is not None else None)
        self.mean, self.std, self.noise_seed = tuple(mean), tuple(std), noise_seed

    @torch.no_grad()
    def forward(self, x_uint8: Tensor) -> Tensor:
        self.eval()
        x = normalize(x_uint8.to(self.weights.device), self.mean, self.std)
        outs = [m(x) for m in self.models]
        if self.rule == "model":
            return outs[0][1].float()
        feats = torch.stack([o[0].float() for o in outs])
        logits = torch.stack([o[1].float() for o in outs])
        noise = None
        if self.rule in ("iffi", "iffi_reference"):
            gen = torch.Generator(device=x.device).manual_seed(self.noise_seed)
            eps = torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
            noise = torch.stack([m(eps)[0].float() for m in self.models])
        return rule_scores(self.rule, feats, logits, self.weights, self.G, noise, self.ensemble)

    def predict(self, x_uint8: Tensor) -> Tensor:
        return self(x_uint8).argmax(1)


def save_predictor(out: RunDir, cfg: Config, meta: DataMeta, uploads: list[Upload], weights: Tensor,
                   G: Tensor | None, record: dict, feature_dim: int, predictors: dict | None = None) -> Path | str:
    """Write predictor.pt and predictor.json for the run's primary rule from the last round's uploads, with the
    aggregation weights and global prototypes G that round's evaluation used. A primary strategy that is not a
    built-in rule is saved when it built one model of the run's architecture (`predictors[primary]` a
    ModelPredictor); otherwise nothing is written and the reason is returned (a strategy scoring the clients'
    outputs with its own code cannot travel as tensors)."""
    rule = primary_rule(cfg)
    template = create_model(cfg.model.name, meta.in_channels, meta.num_classes, cfg.model.width, head=cfg.head,
                            options=cfg.model.options)
    if rule not in BUILT_IN:
        pred = (predictors or {}).get(rule)
        state = pred.model.state_dict() if isinstance(pred, ModelPredictor) else None
        want = {k: tuple(v.shape) for k, v in template.state_dict().items()}
        if state is None or {k: tuple(v.shape) for k, v in state.items()} != want:
            return (f"no predictor saved: the primary strategy '{rule}' did not build one model of the run's "
                    "architecture (a strategy scoring the clients' outputs with its own code cannot be saved as "
                    "tensors); score it with `flare fuse` on an in-process run.")
        states = {"model": {k: v.detach().cpu() for k, v in state.items()}}
        rule = "model"
    elif rule == "fedavg":
        params = None
        if cfg.server.fedavg_buffers == "first":  # parameters only averaged, the first client's buffers
            params = {k for k, _ in template.named_parameters()}
        states = {"avg": average_state_dicts([{k: v.cpu() for k, v in u.state.items()} for u in uploads], weights,
                                             only=params)}
    else:
        states = {str(u.client): {k: v.detach().cpu() for k, v in u.state.items()} for u in uploads}
    G = G.detach().cpu() if G is not None else None
    test_mean, test_std = scaling(cfg, meta).test  # the evaluation transform (augment.input_scaling)
    out.save_torch("predictor.pt", {"format": FORMAT, "states": states, "weights": weights, "G": G})
    info = {
        "format": FORMAT, "rule": rule, "strategy": primary_rule(cfg), "method": cfg.method, "seed": cfg.seed, "round": record["round"],
        "accuracy": record.get("acc"), "accuracies": {k: v for k, v in record.items() if k.startswith("acc_")},
        "clients": [u.client for u in uploads], "weights": weights.tolist(),
        "model": {"name": cfg.model.name, "width": cfg.model.width, "head": cfg.head, "options": cfg.model.options,
                  "in_channels": meta.in_channels, "num_classes": meta.num_classes, "feature_dim": int(feature_dim)},
        "image_size": meta.image_size, "mean": list(test_mean), "std": list(test_std), "classes": meta.classes,
        "dataset": cfg.dataset.name, "noise_seed": cfg.eval.noise_seed, "states": list(states),
        "ensemble": cfg.server.ensemble, "bn": "running",
    }
    out.write_text("predictor.json", json.dumps(info, indent=1))
    return out.path / "predictor.pt"


def load_predictor(run_dir: str | Path, device: str | torch.device = "cpu") -> GlobalPredictor:
    d = Path(run_dir)
    info = json.loads((d / "predictor.json").read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{d / 'predictor.json'}: format {info.get('format')} is not {FORMAT}")
    blob = torch.load(d / "predictor.pt", map_location=device, weights_only=True)
    m = info["model"]
    models = []
    for key in info["states"]:
        net = create_model(m["name"], m["in_channels"], m["num_classes"], m["width"], head=m["head"],
                           options=m.get("options"))
        net.load_state_dict(blob["states"][key])
        models.append(net.to(device).eval())
    return GlobalPredictor(info["rule"], models, blob["weights"].to(device),
                           blob["G"].to(device) if blob["G"] is not None else None, info["mean"], info["std"],
                           info.get("noise_seed", 0), info.get("ensemble", "softmax")).to(device)
