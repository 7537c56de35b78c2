"""A FLARE plugin that lives outside src/: one part of each kind the tests exercise (tests/test_plugins.py).

Every part leaves a mark only it can make: the loss term logs `term_demo_center`, the λ provider a constant
λ = options.lam (0.4242 by default), the partition deals samples round-robin, the dataset is 4 seeded blobs, the
server strategy `demo_class0` always predicts class 0 (its accuracy is the test set's class-0 share, exactly) and
`demo_pick` scores with one client's own model (its accuracy is that client's `client_acc`, exactly), and
`demo_counts` asks the clients for their class counts (`Upload.extras`) and logs what it received.
"""
import torch
from pydantic import BaseModel
from torch import nn

from flare.client.lam import LamProvider
from flare.data.datasets import ImageData, register_dataset
from flare.data.partition import Partition
from flare.models import register_model
from flare.registry import LAM_PROVIDERS, LOSS_TERMS, PARTITIONS, STRATEGIES, TermOptions
from flare.server.strategy import ClientOutputs, ClientPredictor, ModelPredictor, Strategy


class CenterOptions(TermOptions):
    radius: float = 1.0


@LOSS_TERMS.register("demo_center", options=CenterOptions)
def demo_center(facts, options):
    """Pull feature norms towards `radius`: mean (‖f‖ − r)²."""
    return lambda batch: (batch.feat.float().norm(dim=1) - options.radius).pow(2).mean()


@LOSS_TERMS.register("demo_host_mean")
def demo_host_mean(facts, options):
    """Reads a value back to the host (`float(...)`): fine one client at a time, not vmappable."""
    return lambda batch: batch.feat.new_tensor(float(batch.feat.float().mean())) * 0.0 + batch.feat.float().mean()


class ConstantLamOptions(BaseModel):
    lam: float = 0.4242


class ConstantLam(LamProvider):
    """λ = options.lam at every step, whatever the entropy rule or schedule say."""

    def strength(self, p: float) -> float:
        return self.lambda0


@LAM_PROVIDERS.register("demo_constant", options=ConstantLamOptions)
def demo_constant(facts, options):
    """A constant λ from lam.options.lam."""
    return ConstantLam(options.lam)


class MlpOptions(BaseModel):
    hidden: int = 24


@register_model("demo_mlp", options=MlpOptions)
def demo_mlp(facts, options: MlpOptions) -> nn.Module:
    """A two-layer MLP on 8×8 images."""
    d = max(4, int(options.hidden * facts.width))
    enc = nn.Sequential(nn.Flatten(), nn.Linear(facts.in_channels * 64, d), nn.ReLU(), nn.Linear(d, d))
    enc.feature_dim = d
    return enc


class BlobOptions(BaseModel):
    n_train: int = 96


@register_dataset("demo_blobs", options=BlobOptions, num_classes=4)
def demo_blobs(facts, options: BlobOptions) -> ImageData:
    """Four seeded colour blobs, 1x8x8 (no files)."""
    g = torch.Generator().manual_seed(0)
    centre = torch.tensor([30, 90, 150, 210], dtype=torch.uint8)

    def make(n):
        y = torch.arange(n) % 4
        x = (centre[y].view(n, 1, 1, 1) + torch.randint(0, 40, (n, 1, 8, 8), generator=g)).clamp(0, 255)
        return x.to(torch.uint8), y

    train_x, train_y = make(options.n_train)
    test_x, test_y = make(32)
    return ImageData.from_tensors("demo_blobs", train_x, train_y, test_x, test_y, [f"blob{c}" for c in range(4)])


@PARTITIONS.register("demo_round_robin")
def demo_round_robin(facts, options):
    """Sample i goes to client i mod K."""
    idx, k = torch.arange(len(facts.labels)).numpy(), facts.num_clients
    return Partition([idx[c::k] for c in range(k)], facts.num_classes or int(facts.labels.max()) + 1, facts.labels)


class Class0Predictor(ClientPredictor):
    def scores(self, out: ClientOutputs):
        s = torch.zeros_like(out.logits[0])
        s[:, 0] = 1.0
        return s


@STRATEGIES.register("demo_class0")
class Class0(Strategy):
    """Predicts class 0 for every image (reads the client outputs only for their shape)."""

    def predictor(self, ctx):
        ctx.state["calls"] = ctx.state.get("calls", 0) + 1  # the strategy's own state across rounds
        return Class0Predictor()


class PickOptions(BaseModel):
    client: int = 0


@STRATEGIES.register("demo_pick", options=PickOptions)
class Pick(Strategy):
    """One client's own model as the global model (a model-owning predictor), at the last round only."""

    every_round = False

    def predictor(self, ctx):
        return ModelPredictor(ctx.models[self.options.client])


class CountsOptions(BaseModel):
    bad_shape: bool = False  # compute one count more than declared (the bad-input test of the extras check)


class CountsPredictor(ClientPredictor):
    def __init__(self, counts, logs):
        self.counts, self.logs = counts, logs

    def scores(self, out: ClientOutputs):
        return (self.counts.to(out.logits.device)[:, None, :] * out.logits.softmax(-1)).sum(0)


@STRATEGIES.register("demo_counts", options=CountsOptions)
class Counts(Strategy):
    """Asks every client for its class counts (Upload.extras) and weighs each client's softmax per class by them;
    logs the counts it received (their total and the majority class), which only the uploaded statistics give."""

    def extras_shapes(self, template):
        return {"counts": ((template.num_classes,), torch.float32)}

    def client_extras(self, data):
        C = data.model.num_classes + (1 if self.options.bad_shape else 0)
        return {"counts": torch.bincount(data.y.cpu(), minlength=C).float()}

    def predictor(self, ctx):
        counts = torch.stack([e["counts"] for e in ctx.extras])  # K×C
        total = counts.sum(0)
        return CountsPredictor(counts, {"samples": float(total.sum()), "majority": int(total.argmax())})
