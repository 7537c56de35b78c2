"""A FLARE plugin with one part of every kind, each refusing the same config it cannot serve (tests/test_plugins.py):
`seed=13`. Function-registered parts state it with `check=` (register, register_model, register_dataset); the
objective and the strategy carry their own `check` (a method, a classmethod), as a class-based part does."""
import torch
from torch import nn

from flare.client.lam import LamProvider
from flare.client.objective import Objective
from flare.client.terms.fafi import fafi_terms
from flare.data.datasets import register_dataset
from flare.errors import FlareError
from flare.models import register_model
from flare.registry import (ANCHORS, CONTRAST, LAM_PROVIDERS, LOSS_TERMS, OBJECTIVES, PARTITIONS, SCHEDULES,
                            STRATEGIES, SURGERY)
from flare.server.strategy import Strategy

UNLUCKY = 13


def refuses(kind: str):
    """The check of the picky part of `kind`: a FlareError naming the key at fault."""
    def check(cfg) -> None:
        if cfg.seed == UNLUCKY:
            raise FlareError(f"the picky {kind} cannot serve seed={UNLUCKY}.", key="seed", fix="use another seed.")
    return check


@register_model("picky_model", check=refuses("model"))
def picky_model(facts, options) -> nn.Module:
    """A linear encoder."""
    enc = nn.Sequential(nn.Flatten(), nn.LazyLinear(8))
    enc.feature_dim = 8
    return enc


@register_dataset("picky_data", num_classes=2, check=refuses("dataset"))
def picky_data(facts, options):
    """Never built: the config refuses first."""
    raise AssertionError("not reached")


PARTITIONS.register("picky_partition", lambda facts, options: None,
                    description="never called", check=refuses("partition"))
ANCHORS.register("picky_anchors", lambda facts, options: torch.eye(facts.num_classes, facts.dim),
                 description="the first d unit vectors", check=refuses("anchors"))
LAM_PROVIDERS.register("picky_lam", lambda facts, options: LamProvider(facts.lambda_init),
                       description="λ0, fixed", check=refuses("λ provider"))
SCHEDULES.register("picky_schedule", lambda facts, options: lambda p: 1.0, description="a(p) = 1",
                   check=refuses("schedule"))
SURGERY.register("picky_surgery", None, description="one plain backward", check=refuses("surgery"))
CONTRAST.register("picky_bank", None, description="no extension", check=refuses("contrast bank"))
LOSS_TERMS.register("picky_term", lambda facts, options: lambda batch: batch.feat.sum() * 0, description="zero",
                    check=refuses("loss term"))


class PickyObjective(Objective):
    def check(self, cfg) -> None:
        super().check(cfg)  # an Objective's own rule: alignment needs the prototype head
        refuses("objective")(cfg)


OBJECTIVES.register("picky_objective", PickyObjective(lambda facts: lambda feat, logits, y, prototypes, bank:
                                                      fafi_terms(feat, logits, y, prototypes)),
                    description="FAFI's terms")


@STRATEGIES.register("picky_strategy")
class PickyStrategy(Strategy):
    """Never asked for a predictor: the config refuses first."""

    @classmethod
    def check(cls, cfg) -> None:
        refuses("strategy")(cfg)
