"""Server strategies whose output cannot be scored (tests/test_bad_input.py): the server must refuse each one with
exit 2 naming it, and write no accuracy for it."""
import torch

from flare.registry import STRATEGIES
from flare.server.strategy import ClientOutputs, ClientPredictor, ModelPredictor, Strategy


@STRATEGIES.register("bad_not_predictor")
class NotPredictor(Strategy):
    """predictor() returns a tensor instead of a predictor."""

    def predictor(self, ctx):
        return ctx.weights


class WrongShape(ClientPredictor):
    def scores(self, out: ClientOutputs):
        return out.logits[0][:, :-1]  # one class short


@STRATEGIES.register("bad_shape")
class BadShape(Strategy):
    """Scores of shape batch × (classes − 1)."""

    def predictor(self, ctx):
        return WrongShape()


class NanModel(ModelPredictor):
    def scores(self, x):
        return torch.full_like(super().scores(x), float("nan"))


@STRATEGIES.register("bad_nan")
class BadNan(Strategy):
    """A model-owning predictor whose scores are NaN (their argmax would still be an "accuracy")."""

    def predictor(self, ctx):
        return NanModel(ctx.models[0])
