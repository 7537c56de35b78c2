"""The run's data, as every engine prepares it: the dataset facts all parties share (`DataMeta`: a Flower server
sends them), the seeded subsets and the server's public slice, and the seeded split over the clients with its
partition.json report. Built here once so the in-process runner, the Flower apps, `flare fuse` and the LR probe
see the same samples."""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import Tensor

from flare.config import Config
from flare.data.datasets import ImageData, load_dataset, stratified_subset
from flare.data.features import FeatureData
from flare.data.partition import Partition, PartitionFacts
from flare.errors import FlareError
from flare.registry import PARTITIONS, REFERENCE_PARTITIONS


@dataclass
class DataMeta:
    """Dataset facts every party of a run must share: class names, shapes and the normalisation statistics of
    the training set (a Flower server sends them: a node's local data alone would give other statistics)."""

    name: str
    classes: list[str]
    in_channels: int
    image_size: int
    mean: list[float]
    std: list[float]
    kind: str = "images"  # or "features": a frozen encoder's cached features (data/features.py)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @classmethod
    def from_data(cls, data: ImageData) -> "DataMeta":
        return cls(data.name, list(map(str, data.classes)), int(data.in_channels), int(data.image_size),
                   [float(v) for v in data.mean], [float(v) for v in data.std],
                   "features" if isinstance(data, FeatureData) else "images")

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> "DataMeta":
        d = json.loads(text)
        return cls(str(d["name"]), [str(c) for c in d["classes"]], int(d["in_channels"]), int(d["image_size"]),
                   [float(v) for v in d["mean"]], [float(v) for v in d["std"]], str(d.get("kind", "images")))


def prepare_data(cfg: Config) -> tuple[ImageData, tuple[Tensor, Tensor] | None]:
    """Load the dataset, apply the seeded subsets, carve out the server's public slice (if any)."""
    d = cfg.dataset
    data = load_dataset(d.name, d.root, format=d.format, download=d.download, cache_dir=d.cache_dir, options=d.options)
    for key, size, n in (("dataset.train_subset", d.train_subset, len(data.train_y)),
                         ("dataset.test_subset", d.test_subset, len(data.test_y))):
        if size is not None and size > n:
            raise FlareError(f"{key}={size} asks for more samples than {d.name} has ({n}).", key=key,
                             fix=f"use at most {n}, or remove {key} to use them all.")
    if d.train_subset is not None:
        ix = stratified_subset(data.train_y, d.train_subset, cfg.seed)
        data.train_x, data.train_y = data.train_x[ix], data.train_y[ix]
    if d.test_subset is not None:
        ix = stratified_subset(data.test_y, d.test_subset, cfg.seed + 1)
        data.test_x, data.test_y = data.test_x[ix], data.test_y[ix]
    public = None
    if d.public_size:
        if d.public_size >= len(data.train_y):
            raise FlareError(f"dataset.public_size={d.public_size} is not smaller than the training set "
                             f"({len(data.train_y)} samples).", key="dataset.public_size",
                             fix="hold out fewer samples for the server's public bank.")
        ix = stratified_subset(data.train_y, d.public_size, cfg.seed + 2)
        keep = torch.ones(len(data.train_y), dtype=torch.bool)
        keep[ix] = False
        public = (data.train_x[ix], data.train_y[ix])
        data.train_x, data.train_y = data.train_x[keep], data.train_y[keep]
    return data, public


def split(cfg: Config, labels: Tensor, num_classes: int) -> Partition:
    """The run's split of the training set over its clients (seeded: every engine gets the same one); with
    partition.rng=legacy the kind's draw as the reference code made it (the config refused a kind without one)."""
    p = cfg.partition
    if cfg.num_clients > len(labels):
        raise FlareError(f"num_clients={cfg.num_clients} exceeds the {len(labels)} training samples.",
                         key="num_clients", fix="use fewer clients or a larger dataset.train_subset.")
    facts = PartitionFacts(labels.numpy(), cfg.num_clients, cfg.seed, num_classes, p.alpha, p.shards_per_client)
    if p.rng == "legacy":
        return REFERENCE_PARTITIONS.create(p.kind, facts, p.options, key="partition.rng")
    return PARTITIONS.create(p.kind, facts, p.options)


def describe_partition(cfg: Config, part: Partition, classes: list[str]) -> dict:
    """partition.json: per-client counts, class histograms, label entropies, the architecture each client runs, and
    the setting that made them."""
    report = part.report()
    for c, arch in zip(report["clients"], cfg.client_architectures()):
        c["model"] = arch.label
    report.update({"dataset": cfg.dataset.name, "kind": cfg.partition.kind, "alpha": cfg.partition.alpha,
                   "rng": cfg.partition.rng, "seed": cfg.seed, "classes": list(classes)})
    return report
