"""The global predictor a federated run ends with, saved and loaded without pickles.

`predictor.pt` holds tensors only (`torch.load(..., weights_only=True)` reads it): the state dict of every client
encoder of the last round (or the one model a strategy such as `fedavg` built), the aggregation weights and G.
`predictor.json` says how to rebuild and use it: the rule, the model(s), the input size and normalisation, the
class names, the clients, and the accuracy the server measured. It always normalises with running BN statistics
(eval mode), also for runs evaluated with `eval.bn=batch`: a deployed predictor should not depend on which images
share its batch.

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
from flare.config.architectures import Architecture, server_architecture
from flare.data.augment import normalize
from flare.models import create_architecture, create_model, layout
from flare.rundir import RunDir
from flare.registry import STRATEGIES
from flare.server.fusion import client_outputs
from flare.server.rules import ClientRule, OutputRule, RulePredictor
from flare.server.strategy import ModelPredictor
from flare.server.upload import Upload
from flare.server.rounds import primary_rule
from flare.data.prepare import DataMeta
from flare.setup import scaling

FORMAT = 1


class GlobalPredictor(nn.Module):
    """Applies the run's primary strategy to uint8 images: a built-in `ClientRule` over the client models' outputs,
    or `model`: the one model a model-building strategy built, scored by its logits. The IFFI noise inputs are drawn
    from a generator seeded with `noise_seed` on every call."""

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
        rule = STRATEGIES.get(self.rule) if self.rule in STRATEGIES else None
        if not (isinstance(rule, type) and issubclass(rule, ClientRule)):  # "model" (older files: "fedavg")
            return ModelPredictor(self.models[0]).scores(x)
        p = RulePredictor(rule, self.weights, self.G, self.ensemble)
        noise = torch.Generator(device=x.device).manual_seed(self.noise_seed) if p.needs_noise else None
        return p.scores(client_outputs(list(self.models), x, noise=noise))

    def predict(self, x_uint8: Tensor) -> Tensor:
        return self(x_uint8).argmax(1)


def _architecture_of(state: dict, cfg: Config, meta: DataMeta) -> Architecture | None:
    """The architecture of a strategy's one model: the server's (a student: FedDF, DENSE …) or a client's (an
    average, a pick), the first whose tensors `state` fits; None when none does (BN recalibration's K models)."""
    for arch in dict.fromkeys([server_architecture(cfg), *cfg.client_architectures()]):
        net = create_architecture(arch, meta.in_channels, meta.num_classes, cfg.head, cfg.model.feature_dim,
                                  checkpoint=False)
        if layout(net) == layout(state):
            return arch
    return None


def save_predictor(out: RunDir, cfg: Config, meta: DataMeta, uploads: list[Upload], weights: Tensor,
                   G: Tensor | None, record: dict, feature_dim: int, predictors: dict | None = None) -> Path | str:
    """Write predictor.pt and predictor.json for the run's primary strategy from the last round's evaluation: a
    `ClientRule` as every client's state, a ModelPredictor of the server's or a client's architecture as that model
    (`"rule": "model"`); otherwise nothing is written and the reason is returned."""
    def describe(arch: Architecture) -> dict:
        return {"name": arch.name, "width": arch.width, "head": cfg.head, "options": arch.options,
                "in_channels": meta.in_channels, "num_classes": meta.num_classes, "feature_dim": int(feature_dim)}

    strategy = primary_rule(cfg)
    if issubclass(STRATEGIES.get(strategy), ClientRule):
        rule, client_archs = strategy, cfg.client_architectures()
        states = {str(u.client): {k: v.detach().cpu() for k, v in u.state.items()} for u in uploads}
        archs = {str(u.client): client_archs[u.client] for u in uploads}
    else:
        pred = (predictors or {}).get(strategy)
        state = pred.model.state_dict() if isinstance(pred, ModelPredictor) else None
        arch = _architecture_of(state, cfg, meta) if state is not None else None
        if arch is None:
            return (f"no predictor saved: the primary strategy '{strategy}' did not build one model of the run's "
                    "architecture (a strategy scoring the clients' outputs with its own code cannot be saved as "
                    "tensors); score it with `flare fuse` on an in-process run.")
        rule, states = "model", {"model": {k: v.detach().cpu() for k, v in state.items()}}
        archs = {"model": arch}
    G = G.detach().cpu() if G is not None else None
    test_mean, test_std = scaling(cfg, meta).test  # the evaluation transform (augment.input_scaling)
    out.save_torch("predictor.pt", {"format": FORMAT, "states": states, "weights": weights, "G": G})
    info = {
        "format": FORMAT, "rule": rule, "strategy": strategy, "method": cfg.method, "seed": cfg.seed,
        "round": record["round"],
        "accuracy": record.get("acc"), "accuracies": {k: v for k, v in record.items() if k.startswith("acc_")},
        "clients": [u.client for u in uploads], "weights": weights.tolist(),
        "model": describe(next(iter(archs.values()))),
        "image_size": meta.image_size, "mean": list(test_mean), "std": list(test_std), "classes": meta.classes,
        "dataset": cfg.dataset.name, "noise_seed": cfg.eval.noise_seed, "states": list(states),
        "ensemble": OutputRule.options_in(cfg).ensemble, "bn": "running"}
    if len(set(archs.values())) > 1:  # clients of different architectures: each state's own
        info["models"] = {key: describe(a) for key, a in archs.items()}
    out.write_text("predictor.json", json.dumps(info, indent=1))
    return out.path / "predictor.pt"


def load_predictor(run_dir: str | Path, device: str | torch.device = "cpu") -> GlobalPredictor:
    d = Path(run_dir)
    info = json.loads((d / "predictor.json").read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{d / 'predictor.json'}: format {info.get('format')} is not {FORMAT}")
    blob = torch.load(d / "predictor.pt", map_location=device, weights_only=True)
    models = []
    for key in info["states"]:
        m, state = info.get("models", {}).get(key, info["model"]), blob["states"][key]
        projected = any(k.startswith("proj.") for k in state)  # model.feature_dim: a projection to the shared d
        net = create_model(m["name"], m["in_channels"], m["num_classes"], m["width"], head=m["head"],
                           options=m.get("options"), feature_dim=m["feature_dim"] if projected else None)
        net.load_state_dict(state)
        models.append(net.to(device).eval())
    return GlobalPredictor(info["rule"], models, blob["weights"].to(device),
                           blob["G"].to(device) if blob["G"] is not None else None, info["mean"], info["std"],
                           info.get("noise_seed", 0), info.get("ensemble", "softmax")).to(device)
