"""The training-free one-shot heads over one upload of per-class sufficient statistics (docs/frozen-encoder.md): the
clients' float64 counts n_c, feature sums s_c and second moments S_c = Σ_{y=c} x xᵀ (frozen.py's
`SufficientStatistics`), summed by the server — the pooled features' own, so each head is the pooled features' head
whatever the split; FisherMix and Proto-Hyper train on samples drawn from them. The arithmetic and the defaults are
the reference codes': GH-OFL (ICLR 2026; FabioTur-dev/One-Shot-FL, server/GH_OFL_server.py, configs/cifar10.yaml),
Fed3R (ICML 2024; Erosinho13/Fed3R, src/fed3r.py), AFL (CVPR 2025; ZHUANGHP/Analytic-federated-learning, afl.py) and
FedNCM (NeurIPS 2023; GwenLegate/GuidingLastLayerFLPretrain).
"""
from __future__ import annotations

import functools
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn
from torch.nn import functional as F

from flare.baselines.frozen import (StatisticsOptions, SufficientStatistics, fit, frozen_dim, init_linear, moments,
                                    once_per_input)
from flare.errors import FlareError
from flare.registry import STRATEGIES
from flare.rng import derived_seed

TAG = 2302  # the GH-OFL samples' seed stream (FisherMix and Proto-Hyper draw the same samples, as the reference)
RF_TAG = 2303  # Fed3R-RF's random features: every client and the server draw the same
NEVER = -1e30  # the score of a class no client holds where a head would otherwise give it NaN (finite: evaluated)


class FeatureGaussian(nn.Module):
    """Per-class quadratic scores over the frozen features, shaped like a FLARE model: b_c − ½‖F_c⁻¹(x − μ_c)‖²,
    with F_c the Cholesky factor of class c's covariance (QDA) or its standard deviations (naive Bayes), b_c the log
    prior minus half the log-determinant. In float64, autocast off: the quadratic form of a d-dimensional feature
    needs more digits than float32 keeps."""

    def __init__(self, means: Tensor, factors: Tensor, bias: Tensor):
        super().__init__()
        for k, v in (("means", means), ("factors", factors), ("bias", bias)):
            self.register_buffer(k, v.double())

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x = x.flatten(1)
        with torch.autocast(x.device.type, enabled=False):
            z = x.double()
            q = [(torch.linalg.solve_triangular(f, (z - m).T, upper=False).T if f.dim() == 2 else (z - m) / f)
                 for m, f in zip(self.means, self.factors)]
            return x, self.bias - 0.5 * torch.stack([r.square().sum(1) for r in q], 1)


# the statistics' derived quantities (the reference's aggregate_clients_x)
def sym(s: Tensor) -> Tensor:
    return (s + s.mT) / 2


def eye_like(s: Tensor) -> Tensor:
    return torch.eye(s.shape[-1], dtype=s.dtype)


def class_means(counts: Tensor, sums: Tensor) -> Tensor:
    return sums / counts.clamp(min=1)[:, None]  # a class no client holds: mean 0 (the reference's)


def log_priors(counts: Tensor) -> Tensor:
    return torch.log((counts / counts.sum().clamp(min=1)).clamp(min=1e-12))


@once_per_input
def scatter(counts: Tensor, sums: Tensor, second: Tensor) -> Tensor:
    """Each class's Σ (x − μ_c)(x − μ_c)ᵀ."""
    mu = class_means(counts, sums)
    return second - counts[:, None, None] * mu[:, :, None] * mu[:, None, :]


@once_per_input
def pooled_covariance(counts: Tensor, sums: Tensor, second: Tensor) -> Tensor:
    """The within-class covariance, Σ_c scatter_c / (N − C)."""
    return sym(scatter(counts, sums, second).sum(0) / max(1.0, float(counts.sum()) - len(counts)))


@once_per_input
def class_covariances(counts: Tensor, sums: Tensor, second: Tensor) -> Tensor:
    """scatter_c / (n_c − 1); the pooled covariance for a class of one sample or none (the reference's)."""
    own = scatter(counts, sums, second) / (counts - 1).clamp(min=1)[:, None, None]
    return sym(torch.where((counts > 1)[:, None, None], own, pooled_covariance(counts, sums, second)))


def shrink(s: Tensor, alpha: float) -> Tensor:
    """(1 − α) S + α tr(S)/d I: scikit-learn's shrunk_covariance, the reference's shrink_cov."""
    s = sym(s)
    tr = s.diagonal(dim1=-2, dim2=-1).sum(-1).clamp(min=0)
    return (1 - alpha) * s + (alpha * tr / s.shape[-1])[..., None, None] * eye_like(s)


def refuse(head: str, option: str, why: str) -> FlareError:
    return FlareError(f"server strategy {head}: {why}", key=f"server.strategies.{head}.{option}",
                      fix=f"raise server.strategies.{head}.{option}.")


# GH-OFL's closed-form heads
def gh_nb(counts: Tensor, sums: Tensor, second: Tensor, var_floor: float) -> FeatureGaussian:
    """Diagonal naive Bayes: each class's biased per-feature variance, floored at `var_floor`."""
    mu = class_means(counts, sums)
    var = (second.diagonal(dim1=1, dim2=2) / counts.clamp(min=1)[:, None] - mu * mu).clamp(min=var_floor)
    return FeatureGaussian(mu, var.sqrt(), log_priors(counts) - 0.5 * var.log().sum(1))


def gh_lda(counts: Tensor, sums: Tensor, second: Tensor, shrinkage: float, jitter: float) -> tuple[Tensor, Tensor]:
    """(W, b): the shrunk pooled covariance S (plus `jitter` I), W = M S⁻¹, b_c = −½ μ_cᵀ S⁻¹ μ_c + log π_c."""
    mu, s = class_means(counts, sums), shrink(pooled_covariance(counts, sums, second), shrinkage)
    try:
        w = torch.linalg.solve(s + jitter * eye_like(s), mu.T).T
    except torch.linalg.LinAlgError:
        raise refuse("gh_lda", "shrinkage", "the pooled covariance is singular (a feature constant over the "
                     "training set) with no shrinkage and no jitter.") from None
    return w, -0.5 * (w * mu).sum(1) + log_priors(counts)


def gh_qda(counts: Tensor, sums: Tensor, second: Tensor, shrinkage: float, jitter: float) -> FeatureGaussian:
    """Each class's own shrunk covariance (plus `jitter` I), through its Cholesky factor."""
    cov = shrink(class_covariances(counts, sums, second), shrinkage)
    factors, info = torch.linalg.cholesky_ex(cov + jitter * eye_like(cov))
    if info.any():
        raise refuse("gh_qda", "shrinkage", f"the covariance of class {int(info.nonzero()[0])} is not positive "
                     "definite (fewer samples than features, or a constant feature).")
    half_logdet = factors.diagonal(dim1=1, dim2=2).log().sum(1)
    return FeatureGaussian(class_means(counts, sums), factors, log_priors(counts) - half_logdet)


class GHNBOptions(StatisticsOptions):
    var_floor: float = Field(1e-6, gt=0, description="the least per-feature variance (the reference's)")


class GHLDAOptions(StatisticsOptions):
    shrinkage: float = Field(0.05, ge=0, le=1, description="α of (1 − α) S + α tr(S)/d I (cifar10.yaml lda_shrink)")
    jitter: float = Field(2e-6, ge=0, description="added to the diagonal (the reference adds its 1e-6 twice)")


class GHQDAOptions(GHLDAOptions):
    shrinkage: float = Field(0.1, ge=0, le=1, description="α of each class's shrinkage (cifar10.yaml qda_shrink)")
    jitter: float = Field(1e-6, ge=0, description="added to the diagonal (the reference's)")


@STRATEGIES.register("gh_nb", options=GHNBOptions)
class GHNaiveBayes(SufficientStatistics):
    """GH-OFL's diagonal Gaussian naive Bayes over the summed statistics."""

    def head(self, counts, sums, second, ctx):
        return gh_nb(counts, sums, second, self.options.var_floor)


@STRATEGIES.register("gh_lda", options=GHLDAOptions)
class GHLDA(SufficientStatistics):
    """GH-OFL's LDA: the pooled within-class covariance, shrunk."""

    def head(self, counts, sums, second, ctx):
        return gh_lda(counts, sums, second, self.options.shrinkage, self.options.jitter)


@STRATEGIES.register("gh_qda", options=GHQDAOptions)
class GHQDA(SufficientStatistics):
    """GH-OFL's QDA: each class's own covariance, shrunk."""

    def head(self, counts, sums, second, ctx):
        return gh_qda(counts, sums, second, self.options.shrinkage, self.options.jitter)


# GH-OFL's heads trained on samples in the Fisher subspace
@once_per_input
def fisher_basis(counts: Tensor, sums: Tensor, second: Tensor, shrinkage: float, energy: float,
                 max_dim: int) -> Tensor:
    """V (d × k): the generalised eigenvectors of the between-class scatter against the shrunk pooled covariance,
    whitened, enough of them to hold `energy` of the eigenvalues' sum (at least 2, at most `max_dim`)."""
    mu, pri = class_means(counts, sums), log_priors(counts).exp()
    dm = mu - pri @ mu
    sw = shrink(pooled_covariance(counts, sums, second), shrinkage)
    val, vec = torch.linalg.eigh(sym(sw + 1e-6 * eye_like(sw)))
    w_isqrt = (vec * val.clamp(min=1e-12).rsqrt()) @ vec.T
    lam, u = torch.linalg.eigh(sym(w_isqrt @ sym((pri[:, None] * dm).T @ dm) @ w_isqrt))
    lam, u = lam.flip(0).clamp(min=0), u.flip(1)
    if float(lam.sum()) <= 0:
        return torch.eye(len(sw), dtype=sw.dtype)[:, :2]
    k = int((lam.cumsum(0) / lam.sum() >= energy).nonzero()[0]) + 1
    return w_isqrt @ u[:, :max(2, min(k, max_dim, len(sw)))]


@once_per_input
def sampling_gaussians(counts: Tensor, sums: Tensor, second: Tensor, v: Tensor, shrinkage: float,
                       tau: float) -> tuple[Tensor, Tensor]:
    """(Vᵀμ_c, the Cholesky factor of τ² Vᵀ shrink(Σ_c) V): the Gaussians the Fisher-space samples come from."""
    cov = sym(v.T @ shrink(class_covariances(counts, sums, second), shrinkage) @ v)
    cov = cov + 1e-6 * eye_like(cov)
    return class_means(counts, sums) @ v, torch.linalg.cholesky(tau ** 2 * cov + 1e-6 * eye_like(cov))


def fisher_samples(counts: Tensor, sums: Tensor, second: Tensor, v: Tensor, o: GHSampledOptions,
                   gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """`o.samples` Fisher-space features per class from N(Vᵀμ_c, τ² Vᵀ shrink(Σ_c) V) (float32, class order)."""
    k, (mu, chol) = v.shape[1], sampling_gaussians(counts, sums, second, v, o.sample_shrinkage, o.tau)
    z = torch.cat([mu[c] + torch.randn(o.samples, k, dtype=v.dtype, generator=gen) @ chol[c].T
                   for c in range(len(counts))])
    return z.float(), torch.arange(len(counts)).repeat_interleave(o.samples)


def fisher_gaussians(counts: Tensor, sums: Tensor, second: Tensor, v: Tensor,
                     shrinkage: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The linear scores of the Fisher-space LDA and of the spherical naive Bayes (σ² = tr Σ_f / k) over z = Vᵀx,
    as (W_lda, b_lda, W_nb, b_nb) of z W + b — NB's ‖z‖²/2σ² is the same for every class, so it drops out of any
    softmax and argmax."""
    mu, logp = class_means(counts, sums) @ v, log_priors(counts)
    cov = sym(v.T @ shrink(pooled_covariance(counts, sums, second), shrinkage) @ v)
    cov = cov + 1e-6 * eye_like(cov)
    w_lda = torch.linalg.solve(cov + 1e-6 * eye_like(cov), mu.T)
    sigma2 = max(float(cov.diagonal().sum()) / v.shape[1], 1e-12)
    return w_lda, logp - 0.5 * (mu * w_lda.T).sum(1), mu.T / sigma2, logp - 0.5 * mu.square().sum(1) / sigma2


class GHSampledOptions(StatisticsOptions):
    shrinkage: float = Field(0.05, ge=0, le=1, description="the pooled covariance's shrinkage (lda_shrink)")
    energy: float = Field(0.995, gt=0, le=1, description="the Fisher eigenvalues' share kept (fisher_energy)")
    max_dim: int = Field(16, ge=2, description="the Fisher subspace's largest dimension (fisher_max_dim)")
    samples: int = Field(4000, ge=1, description="samples drawn per class (syn_ns_per_class)")
    tau: float = Field(0.9, gt=0, description="the samples' covariance scale τ (syn_tau_base)")
    sample_shrinkage: float = Field(0.05, ge=0, le=1, description="the class covariances' shrinkage (syn_shrink)")
    epochs: int = Field(40, ge=1, description="epochs over the samples")
    batch_size: int = Field(2048, ge=1, description="samples per AdamW step")
    lr: float = Field(8e-4, gt=0, description="AdamW's learning rate")
    weight_decay: float = Field(3e-4, ge=0, description="AdamW's weight decay")


class GHProtoHyperOptions(GHSampledOptions):
    batch_size: int = Field(1024, ge=1, description="samples per AdamW step (ph_batch)")
    lr: float = Field(1e-3, gt=0, description="AdamW's learning rate (ph_lr)")
    weight_decay: float = Field(5e-4, ge=0, description="AdamW's weight decay (ph_wd)")
    rank: int = Field(16, ge=1, description="the residual's rank (ph_rank)")
    kd_weight: float = Field(0.4, ge=0, le=1, description="the distillation term's weight (kd_alpha)")
    temperature: float = Field(4.0, gt=0, description="the distillation temperature (kd_T)")
    teacher_lda: float = Field(0.7, ge=0, le=1, description="the teacher's LDA share, the rest NB (teacher_blend)")


class GHSampled(SufficientStatistics):
    """GH-OFL's trained heads: the Fisher subspace, the samples, then `train` (z-space weights and bias), folded
    into one linear head over x (z = Vᵀx)."""

    every_round = False

    def head(self, counts, sums, second, ctx):
        o = self.options
        v = fisher_basis(counts, sums, second, o.shrinkage, o.energy, o.max_dim)
        gen = torch.Generator().manual_seed(derived_seed(self.facts.seed, ctx.round, TAG))
        z, y = fisher_samples(counts, sums, second, v, o, gen)
        w, b = self.train(z, y, fisher_gaussians(counts, sums, second, v, o.shrinkage), gen)
        return (v @ w.double()).T, b


@STRATEGIES.register("gh_fishermix", options=GHSampledOptions)
class GHFisherMix(GHSampled):
    """GH-OFL's FisherMix: a linear head trained with cross-entropy on the Fisher-space samples."""

    def train(self, z, y, gaussians, gen):
        o, lin = self.options, init_linear(nn.Linear(z.shape[1], int(y.max()) + 1), gen)
        fit(lin, len(y), lambda ix: F.cross_entropy(lin(z[ix]), y[ix]), o.epochs, o.batch_size, o.lr,
            o.weight_decay, gen)
        return lin.weight.detach().T, lin.bias.detach()


@STRATEGIES.register("gh_protohyper", options=GHProtoHyperOptions)
class GHProtoHyper(GHSampled):
    """GH-OFL's Proto-Hyper: the Fisher-space naive Bayes plus a low-rank residual, trained on the samples with
    cross-entropy and distillation from a blend of the Fisher-space LDA and naive Bayes."""

    def train(self, z, y, gaussians, gen):
        o, (w_lda, b_lda, w_nb, b_nb) = self.options, (g.float() for g in gaussians)
        down = init_linear(nn.Linear(z.shape[1], min(o.rank, z.shape[1]), bias=False), gen)
        up = init_linear(nn.Linear(down.out_features, len(b_nb)), gen)
        base = z @ w_nb + b_nb
        teacher = o.teacher_lda * (z @ w_lda + b_lda) + (1 - o.teacher_lda) * base

        def loss(ix):
            student, t = base[ix] + up(down(z[ix])), o.temperature
            kd = F.kl_div(F.log_softmax(student / t, 1), F.softmax(teacher[ix] / t, 1), reduction="batchmean")
            return o.kd_weight * t * t * kd + (1 - o.kd_weight) * F.cross_entropy(student, y[ix])
        fit(nn.ModuleList([down, up]), len(y), loss, o.epochs, o.batch_size, o.lr, o.weight_decay, gen)
        return w_nb + (up.weight @ down.weight).detach().T, b_nb + up.bias.detach()


# the ridge heads and the class means
def ridge(counts: Tensor, sums: Tensor, second: Tensor, lam: float) -> tuple[Tensor, Tensor]:
    """Fed3R: (W, b) solving (Σ x̃x̃ᵀ + λI) [W; b] = Σ x̃ yᵀ with x̃ = [x, 1] and one-hot y (the bias regularised
    too), then every class's (w_c, b_c) divided by ‖w_c‖."""
    g = torch.cat([torch.cat([second.sum(0), sums.sum(0)[:, None]], 1),
                   torch.cat([sums.sum(0), counts.sum()[None]])[None]])
    wb = torch.linalg.solve(g + lam * eye_like(g), torch.cat([sums.T, counts[None]]))
    norm = wb[:-1].norm(dim=0)
    norm = torch.where(norm == 0, 1e-6, norm)  # a class no client holds: w_c = b_c = 0 (the reference's)
    return (wb[:-1] / norm).T, wb[-1] / norm


def analytic(counts: Tensor, sums: Tensor, second: Tensor, rg: float, clients: int, clean: bool) -> Tensor:
    """AFL: W = (Σ xxᵀ + KγI)⁻¹ Σ x yᵀ, the K clients' regularised solutions aggregated; `clean` then removes
    the regulariser, W + Kγ (Σ xxᵀ)⁻¹ W, which is the pooled least-squares solution (no bias)."""
    g, k = second.sum(0), clients * rg
    w = torch.linalg.solve(g + k * eye_like(g), sums.T)
    if clean:
        try:
            w = w + k * torch.linalg.solve(g, w)
        except torch.linalg.LinAlgError:
            raise FlareError("server strategy afl: removing the regulariser needs an invertible Σ x xᵀ; this one "
                             "is singular (a feature that is zero over the training set, or fewer samples than "
                             "features).", key="server.strategies.afl.clean_regularization",
                             fix="set server.strategies.afl.clean_regularization=false.") from None
    return w.T


def class_mean_head(counts: Tensor, sums: Tensor, rule: str) -> tuple[Tensor, Tensor]:
    """FedNCM: the class means normalised as the weights, no bias ("normalized", the reference's); or
    ("euclidean") the nearest class mean, x·μ_c − ½‖μ_c‖². A class no client holds is never predicted."""
    mu = class_means(counts, sums)
    w, b = (F.normalize(mu), torch.zeros(len(mu), dtype=mu.dtype)) if rule == "normalized" else \
        (mu, -0.5 * mu.square().sum(1))
    return w, torch.where(counts > 0, b, NEVER)


class Fed3ROptions(StatisticsOptions):
    ridge: float = Field(0.01, gt=0, description="λ on the diagonal of Σ x̃x̃ᵀ (the reference's lambda_)")
    random_features: int = Field(0, ge=0, le=65536, description="D random Fourier features of a Gaussian kernel "
                                 "(Fed3R-RF; 0: the plain features, the reference code's)")
    kernel_width: float | None = Field(None, gt=0, description="σ of the kernel exp(−‖x − x′‖²/2σ²); no default "
                                       "(none published): required with random_features")

    @model_validator(mode="after")
    def _width(self):
        if self.random_features and self.kernel_width is None:
            raise ValueError("random_features needs a σ, server.strategies.fed3r.kernel_width (none is published)")
        return self


class RandomFeatureLinear(nn.Module):
    """A linear head over random Fourier features φ(x) = √(2/D) cos(x Ω + β) of the frozen features (float64)."""

    def __init__(self, omega: Tensor, beta: Tensor, weight: Tensor, bias: Tensor):
        super().__init__()
        for k, v in (("omega", omega), ("beta", beta), ("weight", weight), ("bias", bias)):
            self.register_buffer(k, v.double())

    def features(self, x: Tensor) -> Tensor:
        return (2 / len(self.beta)) ** 0.5 * torch.cos(x.flatten(1).double() @ self.omega + self.beta)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        with torch.autocast(x.device.type, enabled=False):
            return x.flatten(1), self.features(x) @ self.weight.T + self.bias


@functools.lru_cache(maxsize=1)  # drawn once for a run's clients and server (8·d·D bytes), never modified
def random_fourier(seed: int, d: int, n: int, width: float) -> RandomFeatureLinear:
    """Ω ~ N(0, σ⁻²), β ~ U[0, 2π), from the run's seed: every client and the server draw the same."""
    gen = torch.Generator().manual_seed(seed)
    omega = torch.randn(d, n, generator=gen, dtype=torch.float64) / width
    beta = torch.rand(n, generator=gen, dtype=torch.float64) * 2 * torch.pi
    return RandomFeatureLinear(omega, beta, torch.zeros(1, n), torch.zeros(1))


class AFLOptions(StatisticsOptions):
    rg: float = Field(1.0, gt=0, description="each client's regularisation γ (the reference's run.sh --rg)")
    clean_regularization: bool = Field(True, description="remove the K·γ regulariser after aggregation (--clean_reg)")


class FedNCMOptions(StatisticsOptions):
    rule: Literal["normalized", "euclidean"] = Field("normalized", description="normalized: the reference's "
                                                     "head; euclidean: the nearest class mean")


@STRATEGIES.register("fed3r", options=Fed3ROptions)
class Fed3R(SufficientStatistics):
    """Fed3R: ridge regression on the frozen features, from the summed statistics.

    With random features (Fed3R-RF) its statistics are those of the features' φ instead, with only their pooled
    second moment: its own upload (D² numbers), since no sum of the shared one gives them."""

    @property
    def shares_extras(self) -> str:
        return "" if self.options.random_features else super().shares_extras

    def random_map(self, d: int) -> RandomFeatureLinear:
        return random_fourier(derived_seed(self.facts.seed, 0, RF_TAG), d, self.options.random_features,
                              self.options.kernel_width)

    def extras_shapes(self, template):
        shapes, n = super().extras_shapes(template), self.options.random_features
        return shapes if not n else {**shapes, "sums": ((shapes["counts"][0][0], n), torch.float64),
                                     "second": ((1, n, n), torch.float64)}

    def client_extras(self, data):
        if not self.options.random_features:
            return super().client_extras(data)
        f, y = self.samples(data)
        return moments(self.random_map(f.shape[1]).features(f), y, int(data.model.num_classes), per_class=False)

    def head(self, counts, sums, second, ctx):
        w, b = ridge(counts, sums, second, self.options.ridge)
        rf = self.options.random_features and self.random_map(frozen_dim(ctx.models[0]))
        return RandomFeatureLinear(rf.omega, rf.beta, w, b) if rf else (w, b)


@STRATEGIES.register("afl", options=AFLOptions)
class AFL(SufficientStatistics):
    """AFL: the aggregated analytic (least-squares) head, its regulariser removed."""

    def check_data(self, histogram, data) -> None:
        super().check_data(histogram, data)
        n, d = int(histogram.sum()), int(data.train_x.shape[-1])
        if self.options.clean_regularization and n < d:  # Σ x xᵀ of n < d samples is singular
            raise FlareError(f"server strategy afl removes its regulariser, which needs an invertible Σ x xᵀ: the "
                             f"clients hold {n} samples of {d} features.",
                             key="server.strategies.afl.clean_regularization",
                             fix="set server.strategies.afl.clean_regularization=false, or train on more samples.")

    def head(self, counts, sums, second, ctx):
        w = analytic(counts, sums, second, self.options.rg, len(ctx.extras), self.options.clean_regularization)
        return w, torch.zeros(len(w))


@STRATEGIES.register("fedncm", options=FedNCMOptions)
class FedNCM(SufficientStatistics):
    """FedNCM: the class means as the head."""

    def head(self, counts, sums, second, ctx):
        return class_mean_head(counts, sums, self.options.rule)
