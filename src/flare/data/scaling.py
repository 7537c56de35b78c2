"""Input scaling: how uint8 images become the model's inputs, for training views and for evaluation.

`augment.input_scaling=dataset` (ours): x/255 standardised by the training set's mean/std, before training
(after the augmentation) and at test time alike.

`augment.input_scaling=reference`: the reference code's transforms (docs/reproduction.md, item (b)): each dataset's
*dataset transform* (training and test images) and the augmentation's own closing Normalize; a dataset the reference
lacks follows CIFAR-10. The un-augmented view (the baselines' `loss.ce_input=plain`, the server's public bank,
evaluation) is the dataset transform alone.

`augment.input_scaling=none`: x/255 and nothing else — torchvision's `ToTensor()` alone, for training views and
test images alike, as NIID-Bench, FedLPA and DENSE feed Fashion-MNIST and MNIST (docs/papers.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from flare.registry import SCALINGS

Stats = tuple[tuple[float, ...], tuple[float, ...]]

HALF: Stats = ((0.5,), (0.5,))
IDENTITY: Stats = ((0.0,), (1.0,))
CIFAR100: Stats = ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761))


@dataclass(frozen=True)
class InputScaling:
    """`pre`: the dataset transform before the augmentation (None: images enter the augmentation in [0, 1]);
    `post`: the augmentation's closing Normalize; `test`: the evaluation transform (and the un-augmented view)."""

    pre: Stats | None
    post: Stats
    test: Stats


@dataclass(frozen=True)
class ScalingFacts:
    """What a scaling is built from: the dataset (its name) and its training set's statistics mean/std."""
    dataset: str
    mean: tuple[float, ...]
    std: tuple[float, ...]


class ScalingFn(Protocol):
    """What `SCALINGS` holds: the scaling for the run's dataset, built by `SCALINGS.create`."""
    def __call__(self, facts: ScalingFacts, options: None) -> InputScaling: ...


def input_scaling(mode: str, dataset: str, mean, std) -> InputScaling:
    """The scaling `augment.input_scaling` names, for a dataset whose training set has statistics mean/std."""
    return SCALINGS.create(mode, ScalingFacts(dataset, tuple(mean), tuple(std)))


@SCALINGS.register("dataset")
def dataset_scaling(facts: ScalingFacts, options: None) -> InputScaling:
    """(x − mean)/std of the training set, for training views and test images alike (ours)."""
    stats = (facts.mean, facts.std)
    return InputScaling(None, stats, stats)


@SCALINGS.register("none")
def no_scaling(facts: ScalingFacts, options: None) -> InputScaling:
    """x/255 only (ToTensor), training and test."""
    return InputScaling(None, IDENTITY, IDENTITY)


@SCALINGS.register("reference")
def reference_scaling(facts: ScalingFacts, options: None) -> InputScaling:
    """The reference code's per-dataset transforms (the reference protocol's item b; the module docstring's table)."""
    dataset = facts.dataset
    if dataset == "cifar100":
        return InputScaling(CIFAR100, CIFAR100, CIFAR100)
    return InputScaling(HALF, HALF, HALF) if dataset == "svhn" else InputScaling(None, HALF, IDENTITY)
