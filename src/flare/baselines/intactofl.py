"""IntactOFL (Zeng et al., "One-shot-but-not-degraded Federated Learning", ACM MM 2024; zenghui9977/IntactOFL, cited
below by its paths under source/): the K client models kept intact as the experts of a mixture whose gate alone is
trained, data-free, with DENSE's synthesis (datafree.py's `Synthesis`: the mixture as teacher, the experts' average as
adversary). The mixture, the epoch, the options' reference lines and the departures: docs/baselines.md, `intactofl`.
"""
from __future__ import annotations

import copy
import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from flare.baselines.datafree import DataFree, DenseOptions, Synthesis, weighted_mean
from flare.baselines.kd import client_logits, kd_loss, private_stream
from flare.registry import STRATEGIES
from flare.rng import derived_seed


class IntactOFLOptions(DenseOptions):
    """IntactOFL's published settings: source/yaml_config/oneshot/cifar10_clients5_dir0.1.yaml (`intactofl:`,
    lines 123-144, the config algo_main.py:11 runs) and the constants of source/oneshot_algorithms. g_steps, lr_g,
    nz, ngf and bn are DENSE's, at the same values (their yaml lines: docs/baselines.md, `intactofl`)."""

    epochs: int = Field(200, ge=1, description="synthesis + gate-training epochs (yaml:138)")
    synthesis_batch: int = Field(128, ge=2, description="images synthesised per epoch (yaml:130)")
    batch_size: int = Field(128, ge=2, description="pool images per gate step (yaml:131)")
    oh: float = Field(1.0, ge=0, description="weight of the mixture's CE to the pseudo-labels (yaml:134)")
    adv: float = Field(1.0, ge=0, description="weight of the adversarial (mixture-average disagreement) term "
                       "(yaml:132)")
    adv_temperature: float = Field(3.0, gt=0, description="temperature of the adversarial KL "
                                   "(synthesizer_utils.py:716)")
    temperature: float = Field(4.0, gt=0, description="temperature T of the gate's KL to the average, × T² "
                               "(kd_T, yaml:144; oneshot_intactofl.py:102)")
    lr: float = Field(0.01, gt=0, description="gate SGD learning rate (gt_lr, yaml:139)")
    momentum: float = Field(0.9, ge=0, description="gate SGD momentum (oneshot_intactofl.py:101)")
    weight_decay: float = Field(1e-4, ge=0, description="gate SGD weight decay (yaml:140)")
    cosine: bool = Field(True, description="cosine-anneal the gate's learning rate over the epochs "
                         "(oneshot_intactofl.py:103)")
    clip: float | None = Field(10.0, gt=0, description="gradient-norm clip of generator and gate "
                               "(synthesizer_utils.py:722, oneshot_intactofl.py:45)")
    augment: bool = Field(False, description="crop (4-pixel padding) + flip of the pool images the gate sees (the "
                          "reference: none, its transform is ToTensor + Normalize, dataset_helper.py:35-37)")
    curve_every: int = Field(0, ge=0, description="score the mixture on the test set every this many epochs, for "
                             "the record only (the best point is the reference's test-selected epoch, reported as "
                             "such, never used); 0: off")
    top_k_share: float = Field(1.0, gt=0, le=1, description="share of the K experts whose gate scores each input "
                               "keeps, k = ⌊share·K⌋ ≥ 1, the others zeroed (topk, yaml:125)")
    balance: float = Field(0.01, ge=0, description="weight of the std of the gate scores (alpha, yaml:141)")
    distill: float = Field(1.0, ge=0, description="weight of the KL to the experts' average (beta, yaml:142)")
    eps: float = Field(8 / 255, ge=0, description="size of the signed ODS step on the gate's inputs (model-input "
                       "units; the code's literal odseta is 8, yaml:143)")
    perturb: Literal["ods", "none"] = Field("ods", description="the gate's inputs: one ODS step "
                                            "(oneshot_intactofl.py:18-24), or as synthesised")


def mixture(weights: Tensor, expert_logits: Tensor) -> Tensor:
    """(1/K) Σ_k weights[:, k] · expert_logits[k]: B×K gate weights, K×B×C expert logits → B×C."""
    return (weights.t()[:, :, None] * expert_logits).mean(0)


class MixtureOfExperts(nn.Module):
    """The gate over intact experts. The experts sit in a plain list: they are neither parameters nor state of this
    module (nothing trains them, `state_dict` is the gate's), and must be in eval mode. `forward` returns (gate
    weights, logits), in the (features, logits) place of a FLARE model, so every model scorer reads its logits."""

    def __init__(self, experts: list[nn.Module], gate: nn.Linear, top_k: int):
        super().__init__()
        self.experts, self.gate, self.top_k = list(experts), gate, top_k

    def weights(self, x: Tensor) -> Tensor:
        """B×K gate scores, each row's top_k kept and the others zero (not −∞: no softmax follows)."""
        scores = self.gate(x.reshape(x.shape[0], -1)).float()
        top, idx = scores.topk(self.top_k, dim=-1)
        return torch.zeros_like(scores).scatter(-1, idx, top)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        w = self.weights(x)
        return w, mixture(w, client_logits(self.experts, x))


def gate_loss(logits: Tensor, weights: Tensor, average: Tensor, y: Tensor, o: IntactOFLOptions) -> Tensor:
    """CE(mixture, y) + balance·std(gate weights) + distill·KL_T(average ‖ mixture)·T²
    (oneshot_intactofl.py:34-40)."""
    return (F.cross_entropy(logits, y) + o.balance * weights.std()
            + o.distill * kd_loss(logits, average, o.temperature))


class GateSynthesis(Synthesis):
    """DENSE's generator with the mixture as its teacher and the experts' average as its adversary; the learner is
    the gate (`MixtureOfExperts`), trained on the pool by `gate_loss`."""

    o: IntactOFLOptions
    _experts_of: tuple[Tensor, Tensor] | None = None  # (x, the experts' logits of x) of the teacher's last call

    def make_student(self) -> nn.Module:
        K = len(self.models)
        with private_stream(derived_seed(self.facts.seed, self.ctx.round, self.tag, 2)):
            gate = nn.Linear(math.prod(self.shape), K)  # torch's default init, as the reference's nn.Linear
        return MixtureOfExperts(self.models, gate.to(self.dev), max(1, int(self.o.top_k_share * K)))

    def teacher(self, x: Tensor) -> Tensor:
        z = client_logits(self.models, x)
        self._experts_of = (x, z)  # the adversary of the same generator step reads them again
        return mixture(self.student.weights(x), z)

    def adversary(self, x: Tensor) -> Tensor:
        seen, z = self._experts_of or (None, None)
        return weighted_mean(self.w, z if seen is x else client_logits(self.models, x))

    def batch_loss(self, ix: Tensor) -> Tensor:
        x, y = self.view(ix), self.pool_y[ix.to(self.dev)]
        if self.o.perturb == "ods":
            x = self.perturb(x, lambda v: weighted_mean(self.w, client_logits(self.models, v)))
        with torch.no_grad():
            z = client_logits(self.models, x)
        w = self.student.weights(x)
        return gate_loss(mixture(w, z), w, weighted_mean(self.w, z), y, self.o)

    def run(self) -> tuple[nn.Module, dict[str, float]]:
        moe, logs = super().run()
        self._experts_of = None
        # the predictor owns frozen copies: whatever later happens to the client models, its experts stay intact
        moe.experts = [copy.deepcopy(m).eval().requires_grad_(False) for m in moe.experts]
        logs.update(gate_loss_last=logs.pop("kd_loss_last"), top_k=float(moe.top_k))
        return moe, logs


@STRATEGIES.register("intactofl", options=IntactOFLOptions)
class IntactOFL(DataFree):
    """IntactOFL: the client models kept intact as the experts of a mixture whose linear gate over the image is
    trained on generator-synthesised data (data-free)."""

    tag, synthesis = 2104, GateSynthesis
