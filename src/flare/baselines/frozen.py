"""One-shot servers over a frozen pretrained encoder's features (docs/frozen-encoder.md): FedCGS and FedPFT. Both
read what the clients upload about the frozen features (a `features` run's input, data/features.py), never their
trained adapters, and end in a linear head over those features (`FeatureLinear`).

FedCGS (AAAI 2025; Yuqin-G/FedCGS): the clients' per-class counts, feature sums and second moments (the upload every
closed-form head reads, `SufficientStatistics`) add up to the centralised ones, from which the server builds the
reference's Gaussian classifier — no training, no randomness. FedPFT (Beitollahi et al. 2024; its Flower baseline):
per-class Gaussian mixtures of each client's features, sampled by the server to train a linear head with AdamW.
"""
from __future__ import annotations

import functools
import time
import weakref
from typing import Callable, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from flare.errors import FlareError
from flare.registry import STRATEGIES, Seed
from flare.rng import derived_seed
from flare.server.strategy import ModelPredictor, ServerContext, Strategy

TAG = 2301  # FedPFT's server seed stream (shuffling the synthetic features, the head's init)


class FeatureLinear(nn.Module):
    """A linear head over the frozen features, shaped like a FLARE model: forward(x) → (x, logits)."""

    def __init__(self, weight: Tensor, bias: Tensor):
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0])
        self.linear.load_state_dict({"weight": weight, "bias": bias})

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x = x.flatten(1)
        return x, self.linear(x)


def frozen_dim(template: nn.Module) -> int:
    """D, the frozen feature's dimension: what the run's adapter reads."""
    d = getattr(template.encoder, "in_dim", None)
    if d is None:
        raise FlareError("this strategy reads the frozen features, which only model.name=adapter takes as input.",
                         key="model.name", fix="set model.name=adapter (docs/frozen-encoder.md).")
    return int(d)


def frozen_features(data, copy: int = 0) -> Tensor:
    """A client's frozen features (N×D, float64 on the CPU): the evaluation transform of its samples, which reads the
    first stored copy — of the copies from `copy` on (1: the mirror images of a `flip` dataset)."""
    return data.normalize(data.x[:, copy:] if copy else data.x).flatten(1).double().cpu()


# FedCGS
def lda_head(counts: Tensor, class_sums: Tensor, total: Tensor, second: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """(W, b) of the reference's Gaussian classifier from the summed statistics (float64; module docstring)."""
    n = counts.sum()
    mu = total / n
    cov = (second - torch.outer(mu, total) - torch.outer(total, mu) + n * torch.outer(mu, mu)) / (n - 1)
    cov = cov + gamma * torch.eye(cov.shape[0], dtype=cov.dtype)
    means = class_sums / counts.clamp(min=1)[:, None]
    try:
        solved = torch.linalg.solve(cov, means.T).T      # M S⁻¹ (S symmetric)
    except torch.linalg.LinAlgError:
        # An exactly singular S (a feature constant over the training set, at γ = 0), where the reference's inverse
        # fails: the pseudo-inverse inverts the features that vary, and a constant feature separates no class.
        solved = (torch.linalg.pinv(cov, hermitian=True) @ means.T).T
    b = -0.5 * (solved * means).sum(1) + torch.log(counts / n)  # a class nobody holds: log 0 = −inf, never predicted
    return solved, b.clamp(min=-1e30)  # finite: the evaluator refuses non-finite scores


def once_per_input(fn: Callable) -> Callable:
    """`fn` remembering its last call: called again with the very same tensors (the same objects, not equal values;
    in lists, tuples and dicts too) and equal other arguments, it returns the same result. The closed-form heads of
    an evaluation read one summed upload and derive the same things from it (the class scatters, the covariances,
    the Fisher subspace), so each is computed once, bit for bit what each head computed alone. It holds its inputs
    weakly and drops the result when one of them dies; callers never modify a result."""
    last: dict = {}

    def leaves(x):
        x = list(x.values()) if isinstance(x, dict) else x
        return [y for v in x for y in leaves(v)] if isinstance(x, (list, tuple)) else [x]

    @functools.wraps(fn)
    def cached(*args):
        flat = leaves(args)
        tensors, key = [t for t in flat if isinstance(t, Tensor)], [id(a) if isinstance(a, Tensor) else a for a in flat]
        if last.get("key") != key or any(r() is not t for r, t in zip(last["refs"], tensors)):
            last.clear()
            forget = lambda ref: any(ref is r for r in last.get("refs", ())) and last.clear()  # noqa: E731
            last.update(value=fn(*args), key=key, refs=[weakref.ref(t, forget) for t in tensors])
        return last["value"]
    return cached


@once_per_input
def summed(extras: list[dict[str, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """The clients' statistics added up in upload order: sum()'s bits (0 + the first, then each), one buffer each."""
    return tuple(functools.reduce(Tensor.add_, [e[k] for e in extras[1:]], 0 + extras[0][k])
                 for k in ("counts", "sums", "second"))


def moments(f: Tensor, y: Tensor, classes: int, per_class: bool = True) -> dict[str, Tensor]:
    """The upload of rows f (float64) labelled y: per-class counts and sums, and each class's second moment Σ x xᵀ
    (or, `per_class` False, only their sum over classes, 1×d×d)."""
    return {"counts": torch.bincount(y, minlength=classes).double(),
            "sums": torch.zeros(classes, f.shape[1], dtype=torch.float64).index_add_(0, y, f),
            "second": torch.stack([(r := f[y == k]).T @ r for k in range(classes)]) if per_class else (f.T @ f)[None]}


class StatisticsOptions(BaseModel):
    """The shared upload's options, which every closed-form head's options extend."""
    model_config = ConfigDict(extra="forbid")
    mirrored: bool = Field(False, description="count each training image's stored mirror image (dataset.options."
                           "flip) too: every image in the statistics twice, as itself and mirrored")


class SufficientStatistics(Strategy):
    """The one upload of every closed-form head (FedCGS here, GH-OFL's heads, Fed3R, AFL and FedNCM in
    closed_form.py): a client's float64 per-class counts, feature sums and second moments Σ_{y=c} x xᵀ. They add up
    over clients to the pooled features' own, so a head built from their sum is the head of the pooled features
    whatever the split; the second moments are per class because QDA needs each class's covariance (C·d² floats).
    The family shares them (`shares_extras`): a run scoring several of its heads uploads them once. A subclass
    builds its head from the sums in `head`; with `mirrored` they count each image's mirror image too (copy 1)."""

    inputs = ("features",)
    mixed_architectures = True  # it never reads a client's model

    @property
    def shares_extras(self) -> str:  # heads with and without the mirror images read different uploads
        return "statistics-mirrored" if self.options.mirrored else "statistics"

    def check_data(self, histogram, data) -> None:
        if self.options.mirrored and getattr(data, "test_flip", None) is None:  # a features dataset with `flip`
            name = next(n for n in STRATEGIES.names() if STRATEGIES.get(n) is type(self))
            raise FlareError(f"server strategy {name} counts each training image's mirror image (mirrored), and the "
                             f"dataset {data.name} stores none.", key=f"server.strategies.{name}.mirrored",
                             fix="set dataset.options.flip=true, or leave mirrored off.")

    def samples(self, data) -> tuple[Tensor, Tensor]:
        """The rows the statistics count, and their labels: the frozen features, then (`mirrored`) copy 1's."""
        copies = (0, 1) if self.options.mirrored else (0,)
        return torch.cat([frozen_features(data, c) for c in copies]), data.y.cpu().repeat(len(copies))

    def extras_shapes(self, template: nn.Module) -> dict:
        c, d = int(template.num_classes), frozen_dim(template)
        return {"counts": ((c,), torch.float64), "sums": ((c, d), torch.float64), "second": ((c, d, d), torch.float64)}

    def client_extras(self, data) -> dict[str, Tensor]:
        return moments(*self.samples(data), int(data.model.num_classes))

    def head(self, counts: Tensor, sums: Tensor, second: Tensor, ctx: ServerContext) -> nn.Module | tuple:
        """The head from the summed statistics: a model, or (W, b) of a linear one (float64)."""
        raise NotImplementedError

    def predictor(self, ctx: ServerContext) -> ModelPredictor:
        t0 = time.perf_counter()
        counts, sums, second = summed(ctx.extras)
        with torch.enable_grad():  # the heads that train on sampled features
            model = self.head(counts, sums, second, ctx)
        model = FeatureLinear(model[0].float(), model[1].float()) if isinstance(model, tuple) else model
        return ModelPredictor(model.to(ctx.device), {"samples": float(counts.sum()),
                                                     "seconds": time.perf_counter() - t0})


class FedCGSOptions(StatisticsOptions):
    gamma: float = Field(0.0, ge=0, description="γ added to the covariance's diagonal (the reference's default 0)")


@STRATEGIES.register("fedcgs", options=FedCGSOptions)
class FedCGS(SufficientStatistics):
    """FedCGS: summed per-class first and second moments of the frozen features → a Gaussian (LDA) head."""

    def head(self, counts, sums, second, ctx):
        return lda_head(counts, sums, sums.sum(0), second.sum(0), self.options.gamma)


# FedPFT
class FedPFTOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_mixtures: int = Field(2, ge=1, le=64, description="Gaussian components per class and client")
    cov_type: Literal["spherical", "diag"] = Field("spherical", description="the mixtures' covariance type")
    tol: float = Field(1e-12, gt=0, description="EM convergence tolerance")
    max_iter: int = Field(10000, ge=1, description="EM iterations at most")
    gmm_seed: Seed = Field(0, description="the mixtures' random_state (fit and sample), as the baseline's seed")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate of the server's head")
    epochs: int = Field(1, ge=1, description="epochs over the synthetic features")
    batch_size: int = Field(32, ge=1, description="synthetic features per step")


def _mixture(o: FedPFTOptions):
    try:  # lazy: scikit-learn is the encoders extra's
        from sklearn.mixture import GaussianMixture
    except ImportError as e:
        raise FlareError(f"fedpft fits scikit-learn's GaussianMixture, which is not installed ({e}).",
                         key="server.strategies.fedpft", fix="pip install 'flare-ofl[encoders]'.") from None
    return GaussianMixture(n_components=o.n_mixtures, covariance_type=o.cov_type, random_state=o.gmm_seed, tol=o.tol,
                           max_iter=o.max_iter)


def fit_class_mixtures(features: np.ndarray, labels: np.ndarray, num_classes: int, o: FedPFTOptions) -> dict:
    """One client's upload: per class with more than n_mixtures samples, its mixture's parameters in float16."""
    d, m = features.shape[1], o.n_mixtures
    cov_shape = (num_classes, m) if o.cov_type == "spherical" else (num_classes, m, d)
    out = {"means": np.zeros((num_classes, m, d), np.float16), "weights": np.zeros((num_classes, m), np.float16),
           "covariances": np.zeros(cov_shape, np.float16), "counts": np.zeros(num_classes, np.int64)}
    for c in np.unique(labels):
        rows = features[labels == c]
        if len(rows) <= m:
            continue
        gmm = _mixture(o).fit(rows)
        out["means"][c], out["weights"][c] = gmm.means_.astype(np.float16), gmm.weights_.astype(np.float16)
        out["covariances"][c] = gmm.covariances_.astype(np.float16)
        out["counts"][c] = len(rows)
    return {k: torch.from_numpy(v) for k, v in out.items()}


def sample_features(extras: list[dict], o: FedPFTOptions) -> tuple[np.ndarray, np.ndarray]:
    """Every client's every class mixture sampled `count` times, in upload order (the baseline's server loop)."""
    xs, ys = [], []
    for e in extras:
        for c in range(len(e["counts"])):
            n = int(e["counts"][c])
            if n == 0:
                continue
            gmm = _mixture(o)
            gmm.means_ = e["means"][c].numpy().astype(np.float32)
            gmm.weights_ = e["weights"][c].numpy().astype(np.float32)
            gmm.covariances_ = e["covariances"][c].numpy().astype(np.float32)
            x, _ = gmm.sample(n)
            xs.append(x.astype(np.float32))
            ys.append(np.full(n, c, np.int64))
    return np.concatenate(xs), np.concatenate(ys)


def init_linear(layer: nn.Linear, gen: torch.Generator) -> nn.Linear:
    """nn.Linear's own init (weight and bias U(±1/√fan_in)), drawn from a strategy's seeded stream instead of the
    global one, so that a server's head is repeatable."""
    with torch.no_grad():
        bound = 1 / layer.in_features ** 0.5
        for p in (layer.weight, layer.bias):
            if p is not None:
                p.uniform_(-bound, bound, generator=gen)
    return layer


def fit(module: nn.Module, n: int, loss: Callable[[Tensor], Tensor], epochs: int, batch_size: int, lr: float,
        weight_decay: float, gen: torch.Generator) -> list[float]:
    """The loop of every head a server trains on sampled features: AdamW over `epochs` shuffles of n samples in
    batches, `loss(indices)` per batch; the batch losses."""
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, batch_size):
            value = loss(perm[s:s + batch_size])
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()
            losses.append(float(value.detach()))
    return losses


def train_head(x: Tensor, y: Tensor, num_classes: int, o: FedPFTOptions,
               gen: torch.Generator) -> tuple[nn.Linear, list]:
    """The baseline's server head: Linear(D, C) under AdamW (torch's default weight decay) on shuffled batches,
    plain cross-entropy."""
    head = init_linear(nn.Linear(x.shape[1], num_classes), gen)
    return head, fit(head, len(y), lambda ix: nn.functional.cross_entropy(head(x[ix]), y[ix]), o.epochs,
                     o.batch_size, o.lr, 0.01, gen)


@STRATEGIES.register("fedpft", options=FedPFTOptions)
class FedPFT(Strategy):
    """FedPFT: per-class Gaussian mixtures of the frozen features → synthetic features → a linear head (AdamW)."""

    inputs = ("features",)

    def check_data(self, histogram, data) -> None:
        if int(histogram.max(initial=0)) <= self.options.n_mixtures:  # fit_class_mixtures skips every class
            raise FlareError(f"server.strategies.fedpft.n_mixtures={self.options.n_mixtures}: a client fits a class's "
                             f"mixture only from more samples than components, and the largest class of any client "
                             f"holds {int(histogram.max(initial=0))}; nothing would be uploaded.",
                             key="server.strategies.fedpft.n_mixtures",
                             fix=f"set it below {int(histogram.max(initial=0))}, or give the clients more data.")

    every_round = False
    mixed_architectures = True

    def extras_shapes(self, template: nn.Module) -> dict:
        c, d, m = int(template.num_classes), frozen_dim(template), self.options.n_mixtures
        cov = (c, m) if self.options.cov_type == "spherical" else (c, m, d)
        return {"means": ((c, m, d), torch.float16), "weights": ((c, m), torch.float16),
                "covariances": (cov, torch.float16), "counts": ((c,), torch.int64)}

    def client_extras(self, data) -> dict[str, Tensor]:
        return fit_class_mixtures(frozen_features(data).numpy(), data.y.cpu().numpy(), int(data.model.num_classes),
                                  self.options)

    def predictor(self, ctx: ServerContext) -> ModelPredictor:
        t0 = time.perf_counter()
        with torch.enable_grad():
            x, y = sample_features(ctx.extras, self.options)
            gen = torch.Generator().manual_seed(derived_seed(self.facts.seed, ctx.round, TAG))
            head, losses = train_head(torch.from_numpy(x), torch.from_numpy(y), int(ctx.models[0].num_classes),
                                      self.options, gen)
        model = FeatureLinear(head.weight.detach(), head.bias.detach()).to(ctx.device)
        return ModelPredictor(model, {"synthetic": float(len(y)), "loss_first": losses[0], "loss_last": losses[-1],
                                      "seconds": time.perf_counter() - t0})
