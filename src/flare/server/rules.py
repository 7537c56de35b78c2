"""The built-in server rules (docs/method.md#server-rules), each a strategy registered exactly as a plugin's is
(docs/extending.md), with its arithmetic beside it: adding a rule is one class in this file.

Four rules score the K client models' outputs (`ClientRule`); they depend on the aggregation weights, G and the
output rule's ensemble only, so the saved predictor and BN recalibration rebuild them from those tensors
(`RulePredictor`). FedAvg builds one model. The registration order is that of every table's accuracy columns.
"""
from __future__ import annotations

import copy
from typing import Literal

import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from flare.config.sections import Strict
from flare.registry import STRATEGIES
from flare.server.fedavg import average_state_dicts
from flare.server.fusion import ClientOutputs
from flare.server.strategy import ClientPredictor, ModelPredictor, ServerContext, Strategy


# ----------------------------------------------------------------------------------------------
# the arithmetic, as pure functions that tests pin


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


def fedavg_model(models: list[nn.Module], weights: Tensor, buffers: str = "average") -> nn.Module:
    """The one-shot FedAvg model; `buffers="first"` keeps the first model's BN buffers (parameters only averaged)."""
    avg = copy.deepcopy(models[0])
    params = {k for k, _ in avg.named_parameters()} if buffers == "first" else None
    avg.load_state_dict(average_state_dicts([m.state_dict() for m in models], weights, only=params))
    return avg.eval()


# ----------------------------------------------------------------------------------------------
# the rules over the client models' outputs


class ClientRule(Strategy):
    """A built-in rule over the client outputs: `scores` is its arithmetic (`needs_noise`, `batch_bn`: as
    `ClientPredictor`'s)."""

    default = True
    needs_noise = False
    batch_bn = False
    mixed_architectures = True  # it reads each client model's outputs (features in the shared d)

    @staticmethod
    def scores(out: ClientOutputs, weights: Tensor, G: Tensor | None, ensemble: str) -> Tensor:
        """B×C scores from the K models' outputs, the weights (on the batch's device), G and the ensemble mode."""
        raise NotImplementedError

    def predictor(self, ctx: ServerContext) -> RulePredictor:
        return RulePredictor(type(self), ctx.weights, ctx.G, self.options_of(OutputRule).ensemble)


class RulePredictor(ClientPredictor):
    """A `ClientRule` applied with fixed weights, G and ensemble mode."""

    def __init__(self, rule: type[ClientRule], weights: Tensor, G: Tensor | None, ensemble: str = "softmax"):
        self.rule, self.weights, self.G, self.ensemble = rule, weights, G, ensemble
        self.needs_noise, self.batch_bn = rule.needs_noise, rule.batch_bn

    def scores(self, out: ClientOutputs) -> Tensor:
        return self.rule.scores(out, self.weights.to(out.logits.device), self.G, self.ensemble)


@STRATEGIES.register("feature")
class FeatureRule(ClientRule):
    """Σ_i w_i f_i(x) matched to the global prototypes G (FAFI's server)."""

    title, colour = "feature (simple)", "C0"  # how reports name and draw it
    needs_prototypes = True
    primary_for = ("prototype",)
    batch_bn = True

    @staticmethod
    def scores(out, weights, G, ensemble):
        return prototype_scores(fuse_features(out.feats, weights), G)


@STRATEGIES.register("iffi")
class IffiRule(ClientRule):
    """Features weighted per sample by their informativeness against a noise input."""

    title, colour = "IFFI", "C1"
    needs_prototypes = True
    needs_noise = True
    batch_bn = True

    @staticmethod
    def scores(out, weights, G, ensemble):
        return prototype_scores(fuse_features(out.feats, iffi_weights(out.feats, out.noise_feats)), G)


@STRATEGIES.register("iffi_reference")
class IffiReferenceRule(ClientRule):
    """The seeds' IFFI code: exactly uniform feature fusion (reproduces their numbers)."""

    title, colour = "IFFI (seeds' code = uniform)", "C2"
    needs_prototypes = True
    needs_noise = True
    batch_bn = True

    @staticmethod
    def scores(out, weights, G, ensemble):
        return prototype_scores(iffi_reference_features(out.feats, out.noise_feats), G)


class OutputOptions(Strict):
    ensemble: Literal["softmax", "logits"] = Field("softmax", description="Σ w_i softmax(logits_i), or raw logits")


@STRATEGIES.register("output", options=OutputOptions)
class OutputRule(ClientRule):
    """Σ_i w_i softmax(logits_i) (or raw logits: server.strategies.output.ensemble) — the output ensemble."""

    title, colour = "output ensemble", "C3"
    primary_for = ("*",)  # every head but the prototype head
    @staticmethod
    def scores(out, weights, G, ensemble):
        return fuse_outputs(out.logits, weights, ensemble)


# ----------------------------------------------------------------------------------------------
# a rule that builds one model


class FedAvgOptions(Strict):
    buffers: Literal["average", "first"] = Field("average", description="average BN buffers too, or keep client 0's")


@STRATEGIES.register("fedavg", options=FedAvgOptions)
class FedAvgRule(Strategy):
    """One-shot FedAvg: the weighted average of the uploaded models (server.strategies.fedavg.buffers)."""

    title, colour = "FedAvg", "C4"
    default = True
    one_architecture_why = "it averages the clients' parameters tensor by tensor"

    def predictor(self, ctx: ServerContext) -> ModelPredictor:
        return ModelPredictor(fedavg_model(ctx.models, ctx.weights, self.options.buffers))
