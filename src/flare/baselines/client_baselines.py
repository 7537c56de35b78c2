"""Client-side one-shot baselines of the official FAFI code (docs/baselines.md): FedProto and FedETF.

* **FedProto (one-shot)** — clients train plain CE (a linear head) and upload per-class feature sums and counts; a
  test image takes the class of the nearest global prototype (the unweighted mean of the clients' class means), on
  the FedAvg encoder's features (`fedproto`) or the weighted sum of the client encoders' (`fedproto_fused`).
* **FedETF (one-shot)** — the `etf` head trained with CE (the `fedetf` objective registered here); the preset
  (src/flare/presets/fedetf.yaml) averages the weights and ensembles raw logits.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from flare.client.objective import Objective
from flare.client.terms.fafi import ce_terms
from flare.registry import OBJECTIVES, STRATEGIES
from flare.server.rules import FedAvgRule, fedavg_model
from flare.server.strategy import ClientOutputs, ClientPredictor, ModelPredictor, ServerContext, Strategy

OBJECTIVES.register("fedetf", Objective(lambda f: lambda feat, logits, y, prototypes, bank: ce_terms(logits, y), "etf"),
                    description="FedETF: CE through a fixed simplex-ETF classifier (the etf head)")

_BATCH = 256  # images per forward pass when a client computes its class sums


def _nearest(feats: Tensor, protos: Tensor, present: Tensor) -> Tensor:
    """B×C scores: minus the squared distance to each class prototype (−inf for a class no client holds)."""
    d = torch.cdist(feats.float(), protos.to(feats.device).float()).square()
    return (-d).masked_fill(~present.to(feats.device)[None, :], float("-inf"))


class _FedAvgProtoPredictor(ModelPredictor):
    def __init__(self, model: nn.Module, protos: Tensor, present: Tensor, logs: dict):
        super().__init__(model, logs)
        self.protos, self.present = protos, present

    def scores(self, x: Tensor) -> Tensor:
        return _nearest(self.model(x)[0], self.protos, self.present)


class _FusedProtoPredictor(ClientPredictor):
    def __init__(self, weights: Tensor, protos: Tensor, present: Tensor, logs: dict):
        self.weights, self.protos, self.present, self.logs = weights, protos, present, logs

    def scores(self, out: ClientOutputs) -> Tensor:
        w = self.weights.to(out.feats.device)
        return _nearest((w[:, None, None] * out.feats).sum(0), self.protos, self.present)


class FedProto(Strategy):
    """Nearest global class prototype on the FedAvg encoder's features (the reference's one-shot FedProto)."""

    fused = False
    one_architecture_why = "it reads features through the FedAvg of the clients' encoders (fedproto_fused fuses mixed clients)"

    def extras_shapes(self, template: nn.Module) -> dict:
        C, d = template.num_classes, template.feature_dim
        return {"class_sums": ((C, d), torch.float32), "class_counts": ((C,), torch.float32)}

    def client_extras(self, data) -> dict:
        model = data.model.eval()
        C, d = model.num_classes, model.feature_dim
        sums = torch.zeros(C, d, dtype=torch.float64, device=data.device)
        with torch.no_grad():
            for s in range(0, data.x.shape[0], _BATCH):
                f = model(data.normalize(data.x[s:s + _BATCH]))[0].double()
                sums.index_add_(0, data.y[s:s + _BATCH], f)
        return {"class_sums": sums.float(), "class_counts": torch.bincount(data.y, minlength=C).float()}

    def prototypes(self, ctx: ServerContext) -> tuple[Tensor, Tensor]:
        """(C×d global prototypes, C booleans: some client holds the class)."""
        sums = torch.stack([e["class_sums"].double() for e in ctx.extras])     # K×C×d
        counts = torch.stack([e["class_counts"].double() for e in ctx.extras])  # K×C
        held = counts > 0
        means = sums / counts.clamp(min=1)[..., None]
        protos = (means * held[..., None]).sum(0) / held.sum(0).clamp(min=1)[:, None]
        return protos.float(), held.any(0)

    def predictor(self, ctx: ServerContext):
        protos, present = self.prototypes(ctx)
        logs = {"classes_held": float(present.sum())}
        if self.fused:
            return _FusedProtoPredictor(ctx.weights, protos, present, logs)
        avg = fedavg_model(ctx.models, ctx.weights, self.options_of(FedAvgRule).buffers)
        return _FedAvgProtoPredictor(avg, protos, present, logs)


class FedProtoFused(FedProto):
    """Nearest global class prototype on the weighted sum of the client encoders' features."""

    fused = True
    mixed_architectures = True  # each client's features, in the shared d


STRATEGIES.register("fedproto", FedProto, description="one-shot FedProto: nearest class prototype, FedAvg encoder")
STRATEGIES.register("fedproto_fused", FedProtoFused,
                    description="one-shot FedProto: nearest class prototype, fused client features")
