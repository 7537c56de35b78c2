"""The scales of `flare paper` (smoke, cpu, full): models, data sizes, R × E per dataset, the methods of each
experiment, and the notes' per-dataset settings at full scale (`ScaleRule`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from flare.config.protocol import ITEM_KEYS

from flare_paper import reproduce
from flare_paper.report import PaperScale


@dataclass
class ScaleRule:
    """Extra config values for the points that match (flat keys; "preset" matches the point's preset), and a seed
    map (e.g. the notes ran SVHN α = 0.05 with seed 114514 where everything else used seed 1). Keys the user
    overrides on the command line win."""

    match: dict
    set: dict = field(default_factory=dict)
    seed_map: dict = field(default_factory=dict)


# Table 2 names each method by what it leaves out of FLARE: the experiment's roles, not the presets' own labels.
ABLATION_VARIANTS = {"flare": "FLARE (V14)", "decoupled": "w/o safety valve (V12)",
                     "uw-rescaled": "w/o meta-annealing (V10-rescaled)", "etf-anneal": "w/o learned λ (V7)",
                     "fafi": "FAFI (V4)"}


@dataclass
class Scale:
    name: str
    description: str
    datasets: list[str]
    seeds: list[int]
    common: dict
    per_dataset: dict[str, dict]
    table1_alphas: list[float] = field(default_factory=lambda: [0.1, 0.05])
    table1_methods: list[str] = field(default_factory=lambda: ["fedavg", "fafi", "etf-anneal", "flare"])
    ablation_methods: list[str] = field(default_factory=lambda: list(ABLATION_VARIANTS))
    robust_methods: list[str] = field(default_factory=lambda: ["decoupled", "flare"])
    lambda0s: list[float] = field(default_factory=lambda: [1.0, 2.5, 5.0, 10.0, 20.0, 50.0])
    sweep_alphas: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.3, 0.5])
    alpha_methods: list[str] = field(default_factory=lambda: ["fafi", "drcl", "drcl-anneal", "etf-anneal", "flare"])
    hard: list[str] = field(default_factory=lambda: ["cifar100", "tinyimagenet", "cifar10", "svhn", "fmnist"])
    robust: list[str] = field(default_factory=lambda: ["svhn", "cifar10", "cifar100", "fmnist"])
    sweep: list[str] = field(default_factory=lambda: ["cifar10", "svhn", "cifar100", "fmnist"])
    hard_alpha: float = 0.05
    references: bool = False
    rules: list[ScaleRule] = field(default_factory=list)
    reproduce_methods: list[str] = field(default_factory=lambda: list(reproduce.METHODS))
    reproduce_alphas: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.3, 0.5])
    later_alphas: list[float] = field(default_factory=lambda: [0.05, 0.3])  # where the notes' later batch has numbers
    ablation_items: list[str] = field(default_factory=lambda: list(ITEM_KEYS))
    reproduce_rounds: int | None = None

    def for_report(self) -> PaperScale:
        return PaperScale(self.name, self.description, self.references, self.table1_alphas, self.hard_alpha)


DATASET_DEFAULTS = {  # the notes' R and E (docs/method.md); Tiny-ImageNet's E is not given: we use CIFAR-100's
    "cifar10": {"rounds": 50, "local_epochs": 1},
    "svhn": {"rounds": 50, "local_epochs": 1},
    "cifar100": {"rounds": 10, "local_epochs": 10},
    "tinyimagenet": {"rounds": 10, "local_epochs": 10},
    "fmnist": {"rounds": 50, "local_epochs": 1},
    "mnist": {"rounds": 50, "local_epochs": 1},
}

SCALES = {
    "full": Scale(
        "full", "the notes' setting: ResNet-18, 5 clients, batch 512, lr 0.05, R/E per dataset, whole datasets",
        datasets=["cifar10", "cifar100", "svhn"], seeds=[1],
        common={"model": {"name": "resnet18", "width": 1.0}, "num_clients": 5, "batch_size": 512},
        per_dataset={k: dict(v) for k, v in DATASET_DEFAULTS.items()}, references=True,
        rules=[ScaleRule({"dataset.name": "cifar100"}, {"align.lambda_max": 20.0}),
               ScaleRule({"dataset.name": "cifar100", "preset": "etf-anneal"}, {"align.lambda0": 20.0}),
               ScaleRule({"dataset.name": "svhn", "partition.alpha": 0.05}, {"batch_size": 256}, {1: 114514})]),
    "cpu": Scale(
        "cpu", "CPU-sized: a small CNN (width 0.5), batch 64, 2000/1000-sample subsets of the offline CIFAR-10 "
               "export and Fashion-MNIST; about an hour on 2 cores",
        datasets=["cifar10", "fmnist"], seeds=[1],
        common={"model": {"name": "cnn", "width": 0.5}, "num_clients": 5, "batch_size": 64},
        per_dataset={"cifar10": {"rounds": 10, "local_epochs": 1, "dataset": {"train_subset": 2000,
                                                                               "test_subset": 1000}},
                     "fmnist": {"rounds": 6, "local_epochs": 1, "dataset": {"train_subset": 2000,
                                                                              "test_subset": 1000}},
                     "svhn": {"rounds": 8, "local_epochs": 1, "dataset": {"train_subset": 2000, "test_subset": 1000}},
                     "cifar100": {"rounds": 4, "local_epochs": 2, "dataset": {"train_subset": 4000,
                                                                                "test_subset": 1000}}},
        lambda0s=[1.0, 5.0, 20.0, 50.0], sweep_alphas=[0.05, 0.1, 0.5],
        alpha_methods=["fafi", "etf-anneal", "flare"], reproduce_alphas=[0.05, 0.5], later_alphas=[0.05],
        ablation_items=[k for k in ITEM_KEYS if k != "amp"], reproduce_rounds=6),
    "smoke": Scale(
        "smoke", "CI smoke test: a tiny CNN, 2 rounds on 400/200 Fashion-MNIST samples",
        datasets=["fmnist"], seeds=[1],
        common={"model": {"name": "cnn", "width": 0.25}, "num_clients": 5, "batch_size": 32},
        per_dataset={"fmnist": {"rounds": 2, "local_epochs": 1, "dataset": {"train_subset": 400, "test_subset": 200}},
                     "cifar10": {"rounds": 2, "local_epochs": 1, "dataset": {"train_subset": 300,
                                                                              "test_subset": 200}}},
        lambda0s=[1.0, 5.0], sweep_alphas=[0.05, 0.1], alpha_methods=["fafi"], reproduce_methods=["fedavg", "fafi"],
        reproduce_alphas=[0.05], later_alphas=[0.05], ablation_items=["eval.bn", "loss.ce_input", "drop_last"]),
}
