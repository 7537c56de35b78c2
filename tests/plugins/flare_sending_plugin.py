"""flare_sending_plugin: a server strategy that sends as well as scores (docs/extending.md).

`own_targets` fixes the class geometry from the server: C orthonormal directions of the feature space, drawn from a
seed of its own rather than the run's anchors. It sends them twice — once before training as every client's initial
prototypes, and with every round's training message as `align_target`, which the clients align their prototypes to
in place of the anchors — and scores a test image by the target its features are nearest to, over the K client
models. Sending and scoring meet in one tensor: features that were never trained against the targets score near
chance.
"""
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import Tensor

from flare.errors import FlareError
from flare.registry import STRATEGIES, Seed
from flare.server.strategy import ClientOutputs, ClientPredictor, InitContext, ServerContext, Strategy


class OwnTargetsOptions(BaseModel):
    seed: Seed = Field(0, description="the seed of the targets, independent of the run's anchors")


def orthonormal_targets(num_classes: int, dim: int, seed: int) -> Tensor:
    """C×d orthonormal rows, every pair of classes as far apart as the space allows (QR of a seeded Gaussian)."""
    if dim < num_classes:
        raise FlareError(f"own_targets draws C orthonormal directions, which needs d >= C, but the model has d = "
                         f"{dim} < C = {num_classes}.", key="model.width", fix="use a wider model (model.width).")
    g = torch.randn(dim, num_classes, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.linalg.qr(g)[0].T.float()


class NearestTarget(ClientPredictor):
    def __init__(self, targets: Tensor):
        self.targets = targets

    def scores(self, out: ClientOutputs) -> Tensor:
        feats = F.normalize(out.feats.float(), dim=-1)                # K×B×d, one row per client model
        return (feats @ F.normalize(self.targets, dim=1).T).mean(0)   # B×C: mean cosine to each class's target


@STRATEGIES.register("own_targets", options=OwnTargetsOptions)
class OwnTargets(Strategy):
    """Sends its own targets as the clients' initial prototypes and as their `align_target` every round; scores by
    the nearest target."""

    needs_prototypes = True                   # what it sends replaces a prototype head's weights and target

    @classmethod
    def check(cls, cfg) -> None:              # refuse a run in which the clients would not train against the targets
        cfg.require_anchors("server.primary=own_targets")   # clients align only when there are anchors
        if cfg.server.primary != "own_targets":
            raise FlareError("own_targets scores against the targets it sends, and only the primary strategy sends.",
                             key="server.primary", fix="set server.primary=own_targets.")
        if cfg.server.protos == "trainable" and cfg.server.protos_flow == "reference":
            raise FlareError("own_targets sends its own align_target, in place of the server's G that "
                             "server.protos_flow=reference sends.", key="server.protos_flow", fix="drop it.")

    def targets(self, model) -> Tensor:
        """Drawn from the seed alone, so every process holding this strategy draws the same; rows of norm √d, the
        norm of a row of the N(0, 1) init they replace, so the logits keep the scale the temperatures expect."""
        C, d = model.prototypes.shape
        return (orthonormal_targets(C, d, self.options.seed) * d ** 0.5).to(model.prototypes.device)

    def initialize(self, ctx: InitContext) -> dict[str, Tensor]:   # once per server process, before any round
        self.sent = self.targets(next(iter(ctx.inits.values())))
        sent = super().initialize(ctx)        # every architecture's seeded init, the anchor seed, the public bank
        return sent | {f"{key}/head.prototypes": self.sent for key in ctx.inits}  # with the targets as prototypes

    def configure_train(self, rnd: int, carried: dict[str, Tensor]) -> dict[str, Tensor]:  # before every round
        return {"align_target": self.sent}

    def predictor(self, ctx: ServerContext) -> NearestTarget:
        return NearestTarget(self.targets(ctx.models[0]))
